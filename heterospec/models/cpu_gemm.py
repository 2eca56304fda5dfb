"""The CPU matrix path of a model's linear layers (``cpu_gemm``): torch's default, oneDNN with weights packed
once, or heterospec's own few-rows kernel (``rows``), chosen per layer shape and rows per call.

Why: PyTorch's CPU ``linear`` goes to MKL, which takes a matrix-vector path for one row and a general matrix
product for two or more, repacking the weight on every call.  A speculative cycle verifies a few rows at once,
so on a 2-core CPU one SmolLM2-135M forward over 2-12 rows cost 84-97 ms against 57 ms for one row, while
the weights streamed from memory are the same (benchmarks/RESULTS.md, issue 28).  Two packed paths avoid that:

- ``onednn``: oneDNN with the weight reordered once into its blocked layout (what ``torch.compile``'s CPU
  freezing does), float32 or bfloat16; 40-50 ms for 1-12 rows on the AMD EPYC, but 1.5x a one-row step for 6
  rows on an Intel Xeon with AMX.
- ``rows`` (float32, x86 or any CPU through its portable loop; the extension ``heterospec._gemm``,
  csrc/gemm/rows.h): the weight in panels of 16 columns, every call streaming it once with up to 12 rows' sums
  in registers, on torch's own OpenMP threads.  Each output is the same chain of fused multiply-adds over k in
  order whatever the call's row count, the row's place in it, the thread count or the instruction set: a row's
  bits never depend on the other rows (row-invariant by construction).  On an AVX2 or AVX-512 CPU a weight that is
  exactly the float32 decoding of codes is packed as the codes (:func:`pack_rows`: a GGUF checkpoint's blocks,
  Q4_1 / Q8_0 / the K-quants / ..., or float16 / bfloat16 values) and decoded in registers to the same floats:
  the same bits from a sixth to a half of the bytes.

The paths' results are the same products summed in other orders: logits agree to ~1e-4.  Which is fastest
depends on the machine, so ``cpu_gemm='auto'`` measures it (:func:`choose`): per layer shape and row class
(one row; 2-16; more), every path that runs the layer, each layer group timed as the forward streams it; the
fastest wins (ties keep the earlier of :data:`PATHS`).  The choice is kept per machine (CPU model and its widest
unit, cores, torch and its threads) for the process and on disk (``$HETEROSPEC_CACHE``, default
``~/.cache/heterospec``).

:class:`PackedLinears` gives every ``nn.Linear`` of the modules it is given (float32 or bfloat16 weights on the
CPU) a packed copy per path it runs on and, inside its ``with`` block only, routes the layer's ``forward`` to
them.  The packed copies cost as much memory as the weights they mirror (one copy per layer and path, shared by
every engine on the model); a weight written since it was packed is packed again at the next entry.
"""
from __future__ import annotations

import json
import os
import weakref

import torch

from .. import measure

PACKED_DTYPES = (torch.float32, torch.bfloat16)
ROW_CLASSES = ("1", "2-16", "17+")   # rows per call: one (a decode step), a few (a tree, draft beams), many
PROBE_ROWS = (1, 8, 48)             # the rows each class is timed at
PATHS = ("default", "onednn", "rows")   # torch's linear; oneDNN packed; the few-rows kernel (float32 only)
SETTINGS = ("auto", True, False, "onednn", "rows")
CHOICES_FILE = "cpu_gemm_paths.json"


def row_class(rows):
    """The index in :data:`ROW_CLASSES` of a call over ``rows`` rows."""
    return 0 if rows <= 1 else 1 if rows <= 16 else 2


def available():
    """Whether this torch build has the oneDNN linear with pre-packed weights (x86 and ARM builds with mkldnn)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
                    and hasattr(ops, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def _rows_module():
    """heterospec._gemm, or None where it was not built (setup.py builds it where the compiler has OpenMP)."""
    try:
        from .. import _gemm
    except ImportError:
        return None
    return _gemm


def rows_available():
    """Whether the few-rows kernel (``rows``) is built into this install."""
    return _rows_module() is not None


def kernel_isa():
    """The widest instruction set the few-rows kernel runs on this CPU (0 its portable loop, 1 AVX2, 2 AVX-512),
    or None where it was not built."""
    g = _rows_module()
    return None if g is None else g.isa_best()


def _onednn_runs(dtype):
    if dtype == torch.float32:
        return available()
    if dtype == torch.bfloat16:   # oneDNN refuses bfloat16 on CPUs without AVX-512 (or ARM's bf16)
        check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return available() and (bool(check()) if check is not None else False)
    return False


def paths_for(dtype):
    """The packed paths that run layers of ``dtype`` on this machine and build (:data:`PATHS` order)."""
    return tuple(p for p, ok in (("onednn", _onednn_runs(dtype)),
                                 ("rows", dtype == torch.float32 and rows_available())) if ok)


def one_of(setting, choices):
    """Whether ``setting`` is one of ``choices``, a bool only as itself (1 is not True, 0 not False)."""
    return any(setting is v if isinstance(v, bool) else setting == v for v in choices)


def wanted(setting, module, traced=False):
    """``cpu_gemm`` setting -> the packed paths ``module``'s layers may take (empty: torch's default only):
    'auto' every path that runs a CPU module's dtype here (:func:`paths_for`), for :func:`choose` to measure;
    True the fastest expected without measuring (``rows`` for float32 where built with AVX2 or AVX-512, else
    ``onednn``); 'onednn' or
    'rows' that path.  True, 'onednn' and 'rows' insist (ValueError where it cannot run).  ``traced``: the
    forward runs under ``torch.compile`` (a backend other than inductor, which takes the default path), whose
    tracer cannot see into heterospec._gemm: ``rows`` is left out there."""
    if not one_of(setting, SETTINGS):
        raise ValueError(f"HeteroSpec: argument 'cpu_gemm' expected 'auto', True, False, 'onednn' or 'rows', "
                         f"got {setting!r}")
    if setting is False:
        return ()
    p = next(module.parameters(), None)
    dtype = getattr(p, "dtype", None)
    runs = paths_for(dtype) if p is not None and p.device.type == "cpu" and dtype in PACKED_DTYPES else ()
    if traced:
        runs = tuple(r for r in runs if r != "rows")
    if setting == "auto":
        return runs
    want = setting
    if setting is True:   # rows, unless only its portable loop runs here (~8x slower than AVX2) and oneDNN does
        portable = "rows" in runs and _rows_module().isa_best() == 0
        want = "rows" if "rows" in runs and not (portable and "onednn" in runs) else "onednn"
    if want not in runs:
        what = {"rows": "a CPU model in float32 and heterospec's few-rows kernel built (heterospec._gemm"
                        + ("" if rows_available() else ", absent from this install") + ")"
                        + (", and no torch.compile (its tracer cannot call the kernel)" if traced else ""),
                "onednn": "this torch build's oneDNN packed linear" if not available() else
                          "a CPU model in float32, or in bfloat16 on a CPU that oneDNN runs bfloat16 on"}[want]
        raise ValueError(f"HeteroSpec: argument 'cpu_gemm' expected 'auto' or False here ({setting!r} needs {what}; "
                         f"the model is {getattr(p, 'device', None)} {dtype}), got {setting!r}")
    return (want,)


# nn.Linear -> ((weight data_ptr, weight version), packed weight): one packed copy per layer and path, however
# many engines route through it; repacked when the weight was written since
_CACHE = {"onednn": weakref.WeakKeyDictionary(), "rows": weakref.WeakKeyDictionary()}


CODECS = {1: "Q8", 2: "Q4", 3: "F16", 4: "BF16", 5: "Q8X", 6: "Q5", 7: "Q8H"}   # rows.h's HSG_* (0: float32)
BLOCK = 32                    # rows.h's HSG_BLOCK
HALF = 16                     # rows.h's HSG_HALF: k per scale (and offset) of Q8X and Q8H
# codec -> (k per scale, an offset?)
_CODE_FORMS = {2: (BLOCK, True), 6: (BLOCK, True), 1: (BLOCK, False), 7: (HALF, False), 5: (HALF, True)}
_CODECS_TRIED = (2, 6, 1, 7, 5)   # Q4, Q5, Q8, Q8H, Q8X: the fewest bytes first (Q8X holds all but Q8's, Q8H's)


def _bits(t):
    return t.view(torch.int32)


def block_codes(w):
    """Whether a float32 CPU weight [N, K] is, bit for bit, the float32 decoding of block codes (rows.h): every block
    of 32 along k equal to ``d * q + m`` (Q4: q in 0..15; Q5: 0..31) or to ``q * d`` (Q8: q an int8), else every
    half-block of 16 to ``q * d`` (Q8H) or ``d * q + m`` (Q8X: q an int8, m possibly -0), with ``d * q`` exact where
    m is added.  These are the weights transformers' GGUF loader makes (gguf-py's dequantization, in float32) from
    the K-quants and the older formats: Q4_1 and Q4_K as Q4; Q5_1 and Q5_K as Q5; Q8_0, Q4_0 and Q5_0 as Q8; Q6_K
    and Q3_K as Q8H; Q2_K as Q8X; a matrix fused from rows of two formats (q/k/v of Q4_K and Q6_K) as the codec that
    holds both.  Returns (codec, q [N, K] int8, d, m or None) with d and m [N, K/32] (Q8X, Q8H: [N, K/16]) and every
    weight reproduced exactly, or None (also where heterospec._gemm is not built).  The search is the extension's
    (csrc/gemm/codes.c: the scales it tries per block; NumPy twin :func:`heterospec.reference.gemm.find_codes`), a
    pass over the weight per codec tried that stops at the first block without codes.  Only a match of every bit
    counts (signed zeros included), so the kernel that decodes them computes what it computes from the floats; the
    codes found need not be the file's, only decode to the same bits."""
    g = _rows_module()
    if g is None or w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK or w.numel() == 0 \
            or w.device.type != "cpu":
        return None
    w = w.detach().contiguous()
    n, k = w.shape
    # (every tensor on the CPU by name: never the default device, which may be 'meta')
    q = torch.empty((n, k), dtype=torch.int8, device="cpu")   # (the codes of every codec tried)
    for codec in _CODECS_TRIED:
        size, offset = _CODE_FORMS[codec]
        d = torch.empty((n, k // size), dtype=torch.float32, device="cpu")
        m = torch.empty_like(d) if offset else None
        if g.find_codes(codec, w.data_ptr(), q.data_ptr(), d.data_ptr(), 0 if m is None else m.data_ptr(), n, k):
            return codec, q, d, m
    return None


HALF_CODECS = {torch.float16: 3, torch.bfloat16: 4}   # rows.h's 16-bit codecs


def half_codes(w):
    """Whether every value of a float32 weight is a float16 (else a bfloat16) value, as a float16 EAGLE-3 head's or
    a bfloat16 checkpoint's loaded in float32 are: (codec, the 16-bit patterns [N, K] int16), or None."""
    if w.dtype != torch.float32 or not torch.isfinite(w).all():
        return None
    for dtype, codec in HALF_CODECS.items():
        h = w.to(dtype)
        if torch.equal(_bits(h.float()), _bits(w)):
            return codec, h.view(torch.int16).contiguous()
    return None


def pack_rows(w, coded=None):
    """The few-rows kernel's packed copy of a float32 weight [N, K] (rows.h), a new CPU tensor: codes where the
    weight is exactly their decoding and the kernel decodes them with AVX2 or AVX-512 (``coded`` None), always
    (True) or never (False) -- block codes (:func:`block_codes`: a GGUF checkpoint's tensors, 0.75 (Q4), 0.875 (Q5),
    1.125 (Q8), 1.25 (Q8H) or 1.5 (Q8X) bytes a weight), else 16-bit values (:func:`half_codes`: 2 bytes); else
    float32 panels (4 bytes).  The kernel
    computes the same bits from any of them.  A float16 or bfloat16 weight (a half-precision model's) is its own
    16-bit values where codes are read, else its float32 values: the same floats either way."""
    g = _rows_module()
    w = w.detach().contiguous()
    n, k = w.shape
    if coded is None:
        coded = g.isa_best() >= 1   # the portable loop decodes one weight at a time: floats are faster there
    if w.dtype in HALF_CODECS and coded:
        wp = torch.empty(g.packed_bytes(HALF_CODECS[w.dtype], n, k), dtype=torch.uint8, device="cpu")
        g.pack_half(HALF_CODECS[w.dtype], w.view(torch.int16).data_ptr(), wp.data_ptr(), n, k)
        return wp
    w = w.to(torch.float32)
    found = block_codes(w) if coded else None
    if found is not None:
        codec, q, d, m = found
        wp = torch.empty(g.packed_bytes(codec, n, k), dtype=torch.uint8, device="cpu")
        g.pack_codes(codec, q.data_ptr(), d.data_ptr(), 0 if m is None else m.data_ptr(), wp.data_ptr(), n, k)
        return wp
    half = half_codes(w) if coded else None
    if half is not None:
        codec, h = half
        wp = torch.empty(g.packed_bytes(codec, n, k), dtype=torch.uint8, device="cpu")
        g.pack_half(codec, h.data_ptr(), wp.data_ptr(), n, k)
        return wp
    wp = torch.empty(g.packed_floats(n, k), dtype=torch.float32, device="cpu")   # (never the default device)
    g.pack(w.data_ptr(), k, wp.data_ptr(), n, k)
    return wp


def packed_codec(wp):
    """The codec of a packed copy made by :func:`pack_rows`: "F32", "Q8", "Q4", "Q5", "Q8H", "Q8X", "F16" or
    "BF16"."""
    return CODECS.get(int(wp.view(torch.uint8)[4:8].view(torch.int32)[0]), "F32")


def _packed(lin, rows, path="onednn"):
    w = lin.weight
    key = (w.data_ptr(), w._version)
    cache = _CACHE[path]
    hit = cache.get(lin)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows) if path == "onednn"
                   else pack_rows(w))
        cache[lin] = hit
    return hit[1]


def _rows_linear(n_out, packed, bias):
    """x2 [m, k] float32 -> x2 W^T (+ bias) through the few-rows kernel, on torch's threads."""
    g = _rows_module()
    linear, isa = g.linear, g.isa_best()
    if bias is not None:
        bias = bias.contiguous()
    bias_ptr = 0 if bias is None else bias.data_ptr()
    wp_ptr = packed.data_ptr()
    empty = torch.empty

    def run(x2):
        x2 = x2.contiguous()
        m, k = x2.shape
        y = empty(m, n_out, dtype=torch.float32, device="cpu")
        linear(x2.data_ptr(), k, wp_ptr, bias_ptr, y.data_ptr(), n_out, m, n_out, k, isa, 0)
        return y
    run.keep = (packed, bias)   # the buffers the addresses point into live as long as the route
    return run


def _routed_forward(lin, weights, use, block=None):
    """``lin``'s forward on the path ``use`` names for each row class (``weights``: {path: its packed weight});
    ``block``: every call runs over exactly ``block`` rows (the rows in blocks, the last padded with zero rows:
    the row-invariant route, :func:`_invariant_forward`).  A call whose input is not float32 where the path is
    ``rows`` (an autocast region) takes torch's default."""
    bias = None if lin.bias is None else lin.bias.detach()
    weight = lin.weight.detach()   # shares the storage: a weight written in place is seen (inference only)
    linear = torch.nn.functional.linear
    pointwise = torch.ops.mkldnn._linear_pointwise
    runners = {"default": lambda x2: linear(x2, weight, bias)}
    if "onednn" in weights:
        packed = weights["onednn"]
        runners["onednn"] = lambda x2: pointwise(x2, packed, bias, "none", [], "")
    if "rows" in weights:
        rows_run = _rows_linear(lin.out_features, weights["rows"], bias)
        runners["rows"] = lambda x2: rows_run(x2) if x2.dtype == torch.float32 else linear(x2, weight, bias)
    by_class = [runners[p] for p in use]

    def run(x2):
        return by_class[row_class(x2.shape[0])](x2)

    def forward(x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n = x2.shape[0]
        if block is None:
            y = run(x2)
        else:
            if n % block:
                x2 = torch.cat([x2, x2.new_zeros(block - n % block, x2.shape[1])])
            y = run(x2) if x2.shape[0] == block else torch.cat([run(c) for c in x2.split(block)])
            y = y[:n]
        return y.view(*shape[:-1], y.shape[-1])
    return forward


INVARIANT_BLOCK = 8   # rows per call of the row-invariant route (a tree of up to 8 nodes in one call; below)


def _invariant_forward(lin, path, weight):
    """``lin``'s forward on one path for every row count (``weight``: that path's packed weight, None for
    torch's default).  ``rows`` is row-invariant by construction and runs every call as it comes; the other
    paths run every call over exactly :data:`INVARIANT_BLOCK` rows.  Their kernels choose their blocking, and
    with it the order of a row's sums, by the call's row count: on the AMD EPYC (AVX-512 BF16) a one-row call
    takes another kernel than two rows or more, and on an Intel Xeon with AMX oneDNN's bfloat16 kernels change a
    row's bits from 2 rows on (the 576x1536 layers), past 11 (576x576) or at every count (the output layer).
    In calls of one fixed size a row's bits depend on neither its position nor the other rows.  A one-row step
    then costs an 8-row forward (34.3 against 30.7 ms for the default target on the AMX machine, packed), and a
    tree of more than 8 nodes several calls a layer (benchmarks/RESULTS.md).  (Until 2026-11-29 a one-row call
    was padded to two, and every larger call ran as is: row-invariant on the AMD EPYC, not on the AMX machine.)"""
    weights = {} if weight is None else {path: weight}
    return _routed_forward(lin, weights, (path,) * len(ROW_CLASSES),
                           block=None if path == "rows" else INVARIANT_BLOCK)


INVARIANT_CHECK_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 18, 21, 33, 36, 40, 59)   # call sizes tried


def check_invariant(forward, lin):
    """Whether ``forward`` (a routed linear) gives each row what it gives that row in any other number of rows:
    64 random rows in one call, then calls of each of :data:`INVARIANT_CHECK_ROWS` rows from rows 0 and 5,
    compared bit for bit.  The sizes include those where an Intel Xeon's AMX kernels were seen to change a row's
    result (2, 12, 18, 21, 33 to 36 rows against a 40-row call; benchmarks/results/cpu-amx/)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, lin.in_features, generator=gen, device="cpu")   # (never the default device)
    x = x.to(lin.weight.dtype)
    with torch.no_grad():
        whole = forward(x)
        return all(torch.equal(forward(x[i:i + m]), whole[i:i + m]) for m in INVARIANT_CHECK_ROWS for i in (0, 5))


def plain_linear(module):
    """Whether ``module`` is an ``nn.Linear`` computing ``nn.Linear``'s own forward: a subclass with a forward of its
    own (PhiMoE's and Llama 4's routers return their top-k too) is something else, which neither the packed paths
    nor the CPU decoder may stand in for."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _linears(modules):
    for m in modules:
        for lin in m.modules():
            w = getattr(lin, "weight", None)
            if plain_linear(lin) and w is not None and w.device.type == "cpu" and w.dtype in PACKED_DTYPES:
                yield lin


def shape_key(lin):
    """A linear layer's shape as the path choice keys it: ``"float32 576x1536 bias"``."""
    return (f"{str(lin.weight.dtype).replace('torch.', '')} {lin.in_features}x{lin.out_features}"
            f"{' bias' if lin.bias is not None else ''}")


DEFAULT_USE = ("default",) * len(ROW_CLASSES)
_INVARIANT = {}   # (shape_key, path) -> whether every layer of that shape checked on that path was row-invariant
_CHECKED = weakref.WeakKeyDictionary()   # nn.Linear -> the (shape_key, path) it was checked for


class PackedLinears:
    """A context manager: inside it, every ``nn.Linear`` of ``modules`` with a float32 / bfloat16 CPU weight runs
    on the path its shape's entry of ``choice`` names per row class ({shape_key: one of :data:`PATHS` per
    :data:`ROW_CLASSES`}; a shape without an entry: torch's default), or, with no ``choice``, on ``path`` for
    every row count where that path runs the layer's dtype (None: torch's default everywhere).  Inference only:
    no gradient flows through it.  On exit the layers are ``nn.Linear`` again, so other code that shares the
    model (HuggingFace's ``generate`` in the same process) never sees the packed paths.  The packed copies are
    made once per layer and path (:meth:`prepare`, or the first entry) and kept while the layer lives; a layer
    on torch's default for every row class is neither packed nor routed.  ``rows``: the typical rows per call
    (oneDNN's layout hint; any count works).  Re-entrant: a layer already routed is left to the outer context.

    ``invariant``: modules (the target, for bfloat16 verification that equals its one-row steps bit for bit) whose
    layers run on one path for every row count -- the path chosen for 2-16 rows -- :func:`_invariant_forward`;
    ValueError where that is not row-invariant on this machine (:func:`check_invariant`, each layer once)."""

    def __init__(self, modules, rows=4, choice=None, invariant=(), path="onednn"):
        if path is not None and path not in PATHS:
            raise ValueError(f"HeteroSpec: argument 'path' expected one of {PATHS} or None, got {path!r}")
        self._modules = [m for m in modules if m is not None]
        self._rows = rows
        self.choice = choice
        self._path = path
        self._invariant = set(_linears([m for m in invariant if m is not None]))
        self._patched = []
        self._check_invariant()

    def _use(self, lin):
        """The path of each row class for ``lin``."""
        if self.choice is not None:
            return tuple(self.choice.get(shape_key(lin), DEFAULT_USE))
        if self._path in (None, "default") or self._path not in paths_for(lin.weight.dtype):
            return DEFAULT_USE
        return (self._path,) * len(ROW_CLASSES)

    def _weight(self, lin, path):
        return None if path == "default" else _packed(lin, self._rows, path)

    def _invariant_key(self, lin):
        """(shape_key, the layer's one path)."""
        return shape_key(lin), self._use(lin)[1]

    def _invariant_route(self, lin):
        path = self._invariant_key(lin)[1]
        return _invariant_forward(lin, path, self._weight(lin, path))

    def _check_invariant(self):
        """ValueError unless :func:`_invariant_forward` is row-invariant on this machine for every one of the
        invariant layers (each layer once per path in a process; a shape stays invariant while all of its layers
        checked are).  A bfloat16 row differs between kernels only where a sum rounds differently, so a check over
        random rows can pass by luck: on the AMX machine the padded-to-two route of before passed it for the test
        suite's random weights in some processes and not in others, and the output then differed.  The fixed
        size is what makes the route invariant; the check is the safety net."""
        for lin in self._invariant:
            key = self._invariant_key(lin)
            if _CHECKED.get(lin) != key:
                ok = check_invariant(self._invariant_route(lin), lin)
                _INVARIANT[key] = _INVARIANT.get(key, True) and ok
                _CHECKED[lin] = key
            if not _INVARIANT[key]:
                raise ValueError(f"HeteroSpec: row-invariant verification: the {key[1]} matrix path of the "
                                 f"{key[0]} layers gives a row another result in a call over more rows on this "
                                 f"machine, even when every call has {INVARIANT_BLOCK} rows; use float32 or "
                                 f"batch_invariant=False")

    def _layers(self):
        return [lin for lin in _linears(self._modules) if self._use(lin) != DEFAULT_USE
                and lin not in self._invariant]

    def prepare(self):
        """Pack every routed layer now (outside any timed region); returns the number of layers packed."""
        n = 0
        for lin in self._layers():
            weights = [self._weight(lin, p) for p in set(self._use(lin))]   # every path's copy made now
            n += any(w is not None for w in weights)
        return n + sum(1 for lin in self._invariant if self._weight(lin, self._invariant_key(lin)[1]) is not None)

    def __enter__(self):
        for lin in [*self._layers(), *self._invariant]:
            if "forward" not in vars(lin):
                if lin in self._invariant:
                    lin.forward = self._invariant_route(lin)
                else:
                    use = self._use(lin)
                    weights = {p: self._weight(lin, p) for p in set(use) if p != "default"}
                    lin.forward = _routed_forward(lin, weights, use)
                self._patched.append(lin)
        return self

    def __exit__(self, *exc):
        for lin in self._patched:
            if "forward" in vars(lin):
                del lin.forward
        self._patched = []

    def describe(self):
        """One line: each row class's paths and their share of the layer shapes, e.g. ``"matrix paths: 1 row
        rows 8/8 shapes; 2-16 rows 8/8; 17+ default 3/8, onednn 5/8 (measured)"``; ``"off"`` when no layer is
        routed; with ``invariant`` layers, their one path first (``"target row-invariant: one path for every row
        count, onednn for 4/5 shapes; draft: ..."``)."""
        lins = {shape_key(lin): lin for lin in _linears(self._modules) if lin not in self._invariant}
        line = "off"
        if lins and self._layers():
            parts = []
            for c, name in enumerate(ROW_CLASSES):
                counts = {}
                for lin in lins.values():
                    p = self._use(lin)[c]
                    counts[p] = counts.get(p, 0) + 1
                share = ", ".join(f"{p} {counts[p]}/{len(lins)}" for p in PATHS if p in counts)
                parts.append(f"{name} {'row ' if c == 0 else ''}{share}{' shapes' if c == 0 else ''}")
            line = f"matrix paths: {'; '.join(parts)} ({'measured' if self.choice is not None else 'forced'})"
        if not self._invariant:
            return line
        inv = {shape_key(lin): lin for lin in self._invariant}
        counts = {}
        for lin in inv.values():
            p = self._invariant_key(lin)[1]
            counts[p] = counts.get(p, 0) + 1
        share = ", ".join(f"{p} for {counts[p]}/{len(inv)} shapes" for p in PATHS if p in counts)
        head = (f"target row-invariant: one path for every row count (every call in blocks of {INVARIANT_BLOCK} "
                f"rows but on rows), {share}")
        return head if not lins else f"{head}; draft: {line}"


def machine_key():
    """What a path choice holds for: the CPU model and its widest unit (an AMX Xeon and an AVX-512 one can share a
    model name, and their fastest paths differ), its cores, torch's version and intra-op threads."""
    info = measure.machine_info("cpu")
    return f"{info['cpu']} | {info['cpus']} cores | torch {info['torch']} | " \
           f"{info['torch_threads']} threads"


_CHOICES = {}   # (machine_key, shape_key) -> one bool per row class: this process's measured choices


def _load_choices(path):
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_choices(path, machine, new):
    d = _load_choices(path)
    entry = d.get(machine) if isinstance(d.get(machine), dict) else {}
    entry.update({k: list(v) for k, v in new.items()})
    d[machine] = entry
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(d, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:   # a read-only home: the choice is measured again in the next process
        pass


def _time_group(layers, rows, reps, paths):
    """{path: seconds} of one pass over ``layers`` (one shape, in model order, so that the weights stream from
    memory as in a forward) at ``rows`` rows, for torch's default and each of ``paths``: the fastest of ``reps``
    passes each, the paths taking turns so that a busy spell of the machine falls on all of them."""
    lin0 = layers[0]
    x = torch.randn(rows, lin0.in_features, dtype=lin0.weight.dtype, device=lin0.weight.device)
    runs = {}
    for path in ("default", *paths):
        fwd = [_routed_forward(lin, {} if path == "default" else {path: _packed(lin, rows, path)},
                               (path,) * len(ROW_CLASSES)) for lin in layers]

        def run(fwd=fwd):
            for f in fwd:
                f(x)
        runs[path] = run
    timer = measure.device_timer("cpu")
    for run in runs.values():   # untimed: first touches of the packed copies' pages
        run()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(reps):
        for path, run in runs.items():
            best[path] = min(best[path], timer(run)[1])
    return best


def _valid_use(v, allowed):
    return isinstance(v, list) and len(v) == len(ROW_CLASSES) and all(p in allowed for p in v)


def choose(modules, *, reps=5, cache=True, timer=None, exclude=()):
    """{shape_key: one of :data:`PATHS` per :data:`ROW_CLASSES`}: the fastest path for that shape at that row
    class on this machine among torch's default and every packed path that runs the shape's dtype here
    (:func:`paths_for`; ties keep the earlier of :data:`PATHS`), for every packable layer of ``modules``.
    Measured once per machine and shape (:func:`machine_key`), kept for the process and, with ``cache``, in
    ``$HETEROSPEC_CACHE/cpu_gemm_paths.json`` (an entry naming a path this install lacks is measured again).
    ``timer(layers, rows, reps, paths)`` -> {path: seconds} replaces the measurement (tests).  ``exclude``: paths
    not to consider (kept apart: a choice without them is stored under ``"<shape_key> without <path>"``)."""
    timer = timer or _time_group
    machine = machine_key()
    path = measure.cache_path(CHOICES_FILE)
    groups = {}
    for lin in _linears([m for m in modules if m is not None]):
        groups.setdefault(shape_key(lin), []).append(lin)
    runs, store = {}, {}   # shape_key -> the paths timed; -> the key its choice is kept under
    for k, g in groups.items():
        every = paths_for(g[0].weight.dtype)
        runs[k] = tuple(p for p in every if p not in exclude)
        store[k] = k + "".join(f" without {p}" for p in every if p in exclude)
    missing = [k for k in groups if (machine, store[k]) not in _CHOICES]
    if missing and cache:
        stored = _load_choices(path).get(machine) or {}
        for k in missing:
            v = stored.get(store[k])
            if _valid_use(v, ("default", *runs[k])):
                _CHOICES[(machine, store[k])] = tuple(v)
    measured = {}
    with torch.no_grad():
        for k in groups:
            if (machine, store[k]) in _CHOICES:
                continue
            use = []
            for r in PROBE_ROWS:
                t = timer(groups[k], r, reps, runs[k])
                use.append(min(("default", *runs[k]), key=lambda p: (t[p], PATHS.index(p))))
            _CHOICES[(machine, store[k])] = measured[store[k]] = tuple(use)
    if measured and cache:
        _save_choices(path, machine, measured)
    return {k: _CHOICES[(machine, store[k])] for k in groups}


def for_models(setting, target, *others, invariant=False, traced=False, route_target=True):
    """The routed layers of ``target`` and ``others`` (None skipped) for a ``cpu_gemm`` setting (:func:`wanted`
    decides from the target; 'auto' routes what :func:`choose` measured fastest, True, 'onednn' and 'rows' every
    layer and row class on one path), packed now: the one way the engine and the cost profile set it up.
    ``invariant``: the target's layers on one row-invariant path each (:class:`PackedLinears`), whatever the
    setting; ``traced``: under ``torch.compile`` (:func:`wanted`); ``route_target``: False where the target's
    forward is not transformers' (``cpu_decoder``), which leaves its layers alone: only ``others`` are routed."""
    modules = [target, *others] if route_target else [m for m in others if m is not None]
    if not modules:
        return PackedLinears([])
    paths = wanted(setting, target, traced)
    if not paths and not invariant:
        return PackedLinears([])
    if paths and setting == "auto":
        packed = PackedLinears(modules, choice=choose(modules, exclude=("rows",) if traced else ()),
                               invariant=[target] if invariant else ())
    else:
        packed = PackedLinears(modules, path=paths[0] if paths else None, invariant=[target] if invariant else ())
    packed.prepare()
    return packed
