"""Pre-packed oneDNN weights for the linear layers of a model on the CPU (``cpu_gemm``).

Why: PyTorch's CPU ``linear`` goes to MKL, which takes a matrix-vector path for one row and a general matrix
product for two or more, repacking the weight on every call.  A speculative cycle verifies a few rows at once,
so on a 2-core CPU one SmolLM2-135M forward over 2-12 rows cost 84-97 ms against 57 ms for one row, while
the weights streamed from memory are the same (benchmarks/RESULTS.md, issue 28).  oneDNN with the weight
reordered once into its blocked layout (what ``torch.compile``'s CPU freezing does) runs the same forward in
40-50 ms for 1-12 rows.  The results are the same products summed in another order: logits agree to ~1e-4.

Which path is faster depends on the machine (on one Intel Xeon the packed path was slower for one row, on an AMD
EPYC faster), so ``cpu_gemm='auto'`` measures it (:func:`choose`): per layer shape and row class (one row; 2-16;
more), torch's default against the packed path, each layer group timed as the forward streams it; the packed
path only where it is faster.  The choice is kept per machine (CPU model and its widest unit, cores, torch and
its threads) for the process and on disk (``$HETEROSPEC_CACHE``, default ``~/.cache/heterospec``).

:class:`PackedLinears` gives every ``nn.Linear`` of the modules it is given (float32 or bfloat16 weights on the
CPU) a packed copy and, inside its ``with`` block only, routes the layer's ``forward`` to it.  The packed copies
cost as much memory as the weights they mirror (one copy per layer, shared by every engine on the model); a
weight written since it was packed is packed again at the next entry.
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
CHOICES_FILE = "cpu_gemm_choices.json"


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


def wanted(setting, module):
    """``cpu_gemm`` setting ('auto', True or False) -> whether to pack ``module``: 'auto' packs a CPU module with
    float32 or bfloat16 weights when :func:`available`; True insists (ValueError where it cannot)."""
    if setting not in ("auto", True, False):
        raise ValueError(f"HeteroSpec: argument 'cpu_gemm' expected 'auto', True or False, got {setting!r}")
    if setting is False:
        return False
    p = next(module.parameters(), None)
    fits = p is not None and p.device.type == "cpu" and p.dtype in PACKED_DTYPES
    if fits and p.dtype == torch.bfloat16:   # oneDNN refuses bfloat16 on CPUs without AVX-512 (or ARM's bf16)
        check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        fits = bool(check()) if check is not None else False
    if setting is True and not (fits and available()):
        why = ("this torch build has no oneDNN packed linear" if not available() else
               f"it needs a CPU model in float32, or in bfloat16 on a CPU that oneDNN runs bfloat16 on, got "
               f"{getattr(p, 'device', None)} {getattr(p, 'dtype', None)}")
        raise ValueError(f"HeteroSpec: argument 'cpu_gemm' expected 'auto' or False here ({why}), got True")
    return fits and available()


# nn.Linear -> ((weight data_ptr, weight version), packed weight): one packed copy per layer, however many engines
# route through it; repacked when the weight was written since
_CACHE = weakref.WeakKeyDictionary()


def _packed(lin, rows):
    w = lin.weight
    key = (w.data_ptr(), w._version)
    hit = _CACHE.get(lin)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows))
        _CACHE[lin] = hit
    return hit[1]


def _routed_forward(lin, packed, use, block=None):
    """``lin``'s forward with the packed weight for the row classes ``use`` marks, torch's default otherwise;
    ``block``: every call runs over exactly ``block`` rows (the rows in blocks, the last padded with zero rows:
    the row-invariant route, :func:`_invariant_forward`)."""
    bias = None if lin.bias is None else lin.bias.detach()
    weight = lin.weight.detach()   # shares the storage: a weight written in place is seen (inference only)
    linear = torch.nn.functional.linear
    pointwise = torch.ops.mkldnn._linear_pointwise

    def run(x2):
        if use[row_class(x2.shape[0])]:
            return pointwise(x2, packed, bias, "none", [], "")
        return linear(x2, weight, bias)

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


def _invariant_forward(lin, packed):
    """``lin``'s forward on one path for every row count (the packed weight, or torch's default where ``packed``
    is None), every call over exactly :data:`INVARIANT_BLOCK` rows.  Matrix kernels choose their blocking, and
    with it the order of a row's sums, by the call's row count: on the AMD EPYC (AVX-512 BF16) a one-row call
    takes another kernel than two rows or more, and on an Intel Xeon with AMX oneDNN's bfloat16 kernels change a
    row's bits from 2 rows on (the 576x1536 layers), past 11 (576x576) or at every count (the output layer).
    In calls of one fixed size a row's bits depend on neither its position nor the other rows.  A one-row step
    then costs an 8-row forward (34.3 against 30.7 ms for the default target on the AMX machine, packed), and a
    tree of more than 8 nodes several calls a layer (benchmarks/RESULTS.md).  (Until 2026-11-29 a one-row call
    was padded to two, and every larger call ran as is: row-invariant on the AMD EPYC, not on the AMX machine.)"""
    return _routed_forward(lin, packed, (packed is not None,) * len(ROW_CLASSES), block=INVARIANT_BLOCK)


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


def _linears(modules):
    for m in modules:
        for lin in m.modules():
            w = getattr(lin, "weight", None)
            if isinstance(lin, torch.nn.Linear) and w is not None and w.device.type == "cpu" \
                    and w.dtype in PACKED_DTYPES:
                yield lin


def shape_key(lin):
    """A linear layer's shape as the path choice keys it: ``"float32 576x1536 bias"``."""
    return (f"{str(lin.weight.dtype).replace('torch.', '')} {lin.in_features}x{lin.out_features}"
            f"{' bias' if lin.bias is not None else ''}")


ALL_PACKED = (True,) * len(ROW_CLASSES)
_INVARIANT = {}   # (shape_key, packed) -> whether every layer of that shape checked on that path was row-invariant
_CHECKED = weakref.WeakKeyDictionary()   # nn.Linear -> the (shape_key, packed) it was checked for


class PackedLinears:
    """A context manager: inside it, every ``nn.Linear`` of ``modules`` with a float32 / bfloat16 CPU weight runs
    through its oneDNN-packed copy for the row classes its shape's entry of ``choice`` marks ({shape_key: one
    bool per :data:`ROW_CLASSES`}; None: every class) and through torch's default ``linear`` for the others
    (inference only: no gradient flows through it); on exit the layers are ``nn.Linear`` again, so other code
    that shares the model (HuggingFace's ``generate`` in the same process) never sees the packed path.  The
    packed copies are made once per layer (:meth:`prepare`, or the first entry) and kept while the layer lives;
    a layer packed for no row class is neither packed nor routed.  ``rows``: the typical rows per call (a
    layout hint; any count works).  Re-entrant: a layer already routed is left to the outer context.

    ``invariant``: modules (the target, for bfloat16 verification that equals its one-row steps bit for bit) whose
    layers run on one path for every row count -- packed where ``choice`` packs the shape for 2-16 rows (``pack``
    False: never) -- every call in blocks of :data:`INVARIANT_BLOCK` rows (:func:`_invariant_forward`);
    ValueError where that is not row-invariant on this machine (:func:`check_invariant`, each layer once)."""

    def __init__(self, modules, rows=4, choice=None, invariant=(), pack=True):
        self._modules = [m for m in modules if m is not None]
        self._rows = rows
        self.choice = choice
        self._pack = pack
        self._invariant = set(_linears([m for m in invariant if m is not None]))
        self._patched = []
        self._check_invariant()

    def _invariant_path(self, lin):
        """The packed weight an invariant layer runs on, or None for torch's default."""
        return _packed(lin, self._rows) if self._invariant_key(lin)[1] else None

    def _invariant_key(self, lin):
        """(shape_key, whether the layer's one path is the packed one)."""
        return shape_key(lin), self._pack and self._use(shape_key(lin))[1]

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
                ok = check_invariant(_invariant_forward(lin, self._invariant_path(lin)), lin)
                _INVARIANT[key] = _INVARIANT.get(key, True) and ok
                _CHECKED[lin] = key
            if not _INVARIANT[key]:
                raise ValueError(f"HeteroSpec: row-invariant verification: the {'packed' if key[1] else 'default'} "
                                 f"matrix path of the {key[0]} layers gives a row another result in a call over "
                                 f"more rows on this machine, even when every call has {INVARIANT_BLOCK} rows; use "
                                 f"float32 or batch_invariant=False")

    def _use(self, key):
        """The row classes a layer of shape ``key`` runs packed in."""
        if not self._pack:
            return (False,) * len(ROW_CLASSES)
        return ALL_PACKED if self.choice is None else tuple(self.choice.get(key, (False,) * len(ROW_CLASSES)))

    def _layers(self):
        return [lin for lin in _linears(self._modules) if any(self._use(shape_key(lin)))
                and lin not in self._invariant]

    def prepare(self):
        """Pack every routed layer now (outside any timed region); returns the number of layers."""
        return sum(1 for lin in self._layers() if _packed(lin, self._rows) is not None) + \
            sum(1 for lin in self._invariant if self._invariant_path(lin) is not None)

    def __enter__(self):
        for lin in [*self._layers(), *self._invariant]:
            if "forward" not in vars(lin):
                lin.forward = _invariant_forward(lin, self._invariant_path(lin)) if lin in self._invariant else \
                    _routed_forward(lin, _packed(lin, self._rows), self._use(shape_key(lin)))
                self._patched.append(lin)
        return self

    def __exit__(self, *exc):
        for lin in self._patched:
            if "forward" in vars(lin):
                del lin.forward
        self._patched = []

    def describe(self):
        """One line: the packed path's share of the layer shapes per row class, e.g. ``"packed for 1 row: 0/8
        shapes, 2-16: 8/8, 17+: 8/8 (measured)"``; ``"off"`` when no layer is routed; with ``invariant``
        layers, their one path first (``"target row-invariant: one path for every row count, packed for 4/5
        shapes; draft: ..."``)."""
        shapes = sorted({shape_key(lin) for lin in _linears(self._modules) if lin not in self._invariant})
        line = "off"
        if shapes and self._layers():
            counts = [sum(1 for k in shapes if self._use(k)[c]) for c in range(len(ROW_CLASSES))]
            how = "measured" if self.choice is not None else "forced"
            parts = [f"{ROW_CLASSES[0]} row: {counts[0]}/{len(shapes)} shapes"] + \
                    [f"{name}: {n}/{len(shapes)}" for name, n in zip(ROW_CLASSES[1:], counts[1:])]
            line = f"packed for {', '.join(parts)} ({how})"
        if not self._invariant:
            return line
        inv = sorted({shape_key(lin) for lin in self._invariant})
        packed = sum(1 for k in inv if self._pack and self._use(k)[1])
        head = (f"target row-invariant: one path for every row count (every call in blocks of {INVARIANT_BLOCK} rows), "
                f"packed for {packed}/{len(inv)} shapes")
        return head if not shapes else f"{head}; draft: {line}"


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


def _time_group(layers, rows, reps):
    """(torch's default, packed) seconds of one pass over ``layers`` (one shape, in model order, so that the
    weights stream from memory as in a forward) at ``rows`` rows: the fastest of ``reps`` passes each, the two
    paths taking turns so that a busy spell of the machine falls on both."""
    lin0 = layers[0]
    x = torch.randn(rows, lin0.in_features, dtype=lin0.weight.dtype, device=lin0.weight.device)
    bias = [None if lin.bias is None else lin.bias.detach() for lin in layers]
    default = [(lin.weight.detach(), b) for lin, b in zip(layers, bias)]
    packed = [(_packed(lin, rows), b) for lin, b in zip(layers, bias)]
    linear, pointwise = torch.nn.functional.linear, torch.ops.mkldnn._linear_pointwise

    def run_default():
        for w, b in default:
            linear(x, w, b)

    def run_packed():
        for w, b in packed:
            pointwise(x, w, b, "none", [], "")

    timer = measure.device_timer("cpu")
    run_default(), run_packed()   # untimed: first touches of the packed copies' pages
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for i, fn in enumerate((run_default, run_packed)):
            best[i] = min(best[i], timer(fn)[1])
    return tuple(best)


def choose(modules, *, reps=5, cache=True, timer=None):
    """{shape_key: one bool per :data:`ROW_CLASSES`}: whether the packed path is faster than torch's default for
    that shape at that row class on this machine (ties keep the default), for every packable layer of
    ``modules``.  Measured once per machine and shape (:func:`machine_key`), kept for the process and, with
    ``cache``, in ``$HETEROSPEC_CACHE/cpu_gemm_choices.json``.  ``timer(layers, rows, reps)`` -> (default,
    packed) seconds replaces the measurement (tests)."""
    timer = timer or _time_group
    machine = machine_key()
    path = measure.cache_path(CHOICES_FILE)
    groups = {}
    for lin in _linears([m for m in modules if m is not None]):
        groups.setdefault(shape_key(lin), []).append(lin)
    missing = [k for k in groups if (machine, k) not in _CHOICES]
    if missing and cache:
        stored = _load_choices(path).get(machine) or {}
        for k in missing:
            v = stored.get(k)
            if isinstance(v, list) and len(v) == len(ROW_CLASSES) and all(isinstance(b, bool) for b in v):
                _CHOICES[(machine, k)] = tuple(v)
    measured = {}
    with torch.no_grad():
        for k in groups:
            if (machine, k) in _CHOICES:
                continue
            use = tuple(packed < default for default, packed in (timer(groups[k], r, reps) for r in PROBE_ROWS))
            _CHOICES[(machine, k)] = measured[k] = use
    if measured and cache:
        _save_choices(path, machine, measured)
    return {k: _CHOICES[(machine, k)] for k in groups}


def for_models(setting, target, *others, invariant=False):
    """The routed layers of ``target`` and ``others`` (None skipped) for a ``cpu_gemm`` setting (:func:`wanted`
    decides from the target; 'auto' routes what :func:`choose` measured faster, True every layer and row
    class), packed now: the one way the engine and the cost profile set it up.  ``invariant``: the target's
    layers on one row-invariant path each (:class:`PackedLinears`), whatever the setting."""
    modules = [target, *others]
    pack = wanted(setting, target)
    if not pack and not invariant:
        return PackedLinears([])
    choice = choose(modules) if pack and setting == "auto" else None
    packed = PackedLinears(modules, choice=choice, invariant=[target] if invariant else (), pack=pack)
    packed.prepare()
    return packed
