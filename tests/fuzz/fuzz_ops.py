#!/usr/bin/env python3
"""Coverage-guided fuzzing of heterospec.ops: every entry of the C binding (issue 31, item 1).

Each input is decoded (atheris' FuzzedDataProvider) into one op call: the op, then every argument -- arrays
of any dtype (bfloat16 included), 0 to 4 dimensions, zero sizes, NaN/inf/-inf, huge and negative integers,
tree-shaped or raw parents, batch rows -- each array with a layout (C-contiguous, every other element of a
wider buffer, negative strides, Fortran order, zero-stride broadcast, one byte off its alignment) and
possibly read-only, and Python scalars from small ints to 2**64, NaN, bools, strings and None.  The call runs
on a device: NumPy arrays, torch CPU tensors, or "CUDA" tensors of the emulated build (tests/_dlpack.py's
EmuCuda: the kernels of csrc/cuda/ compiled as host code, so ASan sees their every index).

Passing:
- the call returns, or raises a documented error (docs/ops.md: TypeError, ValueError, BufferError; on the
  device path also heterospec._C.CudaError, the device-side checks);
- on NumPy arrays, heterospec.reference (the NumPy twin) agrees: both refuse the call, or both return the same
  results (integers equal, floats to 1e-6) and leave every argument array with the same contents;
- on the device, the kernels agree with the C core on the same arrays on the CPU, the same way (1e-5).
Anything else -- another exception type, a disagreement, a sanitizer report, a crash or a hang (-timeout) --
is a finding: libFuzzer stops and writes the input; each one became a test in tests/ops/test_fuzz_findings.py and
its file stays in tests/fuzz/corpus/, which every run replays first.

Run on the ASan + UBSan + coverage build (.ci/run stage 2b; docs/ops.md "Fuzzing"):
    CC=clang-14 CXX=clang++-14 HETEROSPEC_CUDA=emu HETEROSPEC_SANITIZE=fuzz \\
        python setup.py build_ext --build-lib build/fuzz --build-temp build/fuzz-tmp
    cd build/fuzz && LD_PRELOAD=$(python -c 'import atheris; print(atheris.path())')/asan_with_fuzzer.so \\
        ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \\
        python tests/fuzz/fuzz_ops.py -max_total_time=120 -timeout=20 -rss_limit_mb=6144 <corpus copy>
"""
import os
import sys

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
# the checkout (or the copy CI builds into) holding this file's heterospec/, before any installed one; tests/ for
# _dlpack
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

with atheris.instrument_imports(include=os.environ.get("HETEROSPEC_FUZZ_INSTRUMENT", "heterospec.ops").split(",")):
    import heterospec
    from heterospec import _C, ops, reference

import numpy as np

try:
    import torch
except ImportError:  # torch CPU tensors are one of the devices when it is installed
    torch = None

INFO = heterospec.build_info()
EMU = bool(INFO.get("cuda_emulated"))
if EMU:
    from _dlpack import EmuCuda

DOCUMENTED = (TypeError, ValueError, BufferError)
DEVICE_ERRORS = DOCUMENTED + (_C.CudaError,)
DTYPES = ["float32", "float16", "float64", "int64", "int32", "uint8", "int16", "bool", "complex64", "bfloat16"]
LAYOUTS = ["c", "c", "c", "c", "strided", "reversed", "fortran", "broadcast", "misaligned"]
DEVICES = ["numpy", "numpy", "torch", "emu"]
# HETEROSPEC_FUZZ_DEVICES=numpy,torch: a worker without the emulated device, several times faster per input (an input
# drawn for another device runs on NumPy arrays); the default draws all three
_ONLY = [d for d in os.environ.get("HETEROSPEC_FUZZ_DEVICES", "").split(",") if d]
assert set(_ONLY) <= set(DEVICES), f"HETEROSPEC_FUZZ_DEVICES: expected names from {sorted(set(DEVICES))}, got {_ONLY}"
MAX_ELEMENTS = 1 << 14
EMU_MAX_KV_BLOCKS = 32   # an emulated kv_compact of more leading rows (with bytes) runs on NumPy arrays instead: at
                         # 128 fibers a block, hundreds of blocks take seconds, and -timeout would call it a hang
BIG = [2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1, -2**31,
       -2**63, -2**63 - 1, 10**30]


class Finding(AssertionError):
    """A property of the fuzz target failed (not one of the op's documented errors)."""


class A:
    """An array argument: its values (NumPy; bfloat16 as float32 values rounded to bfloat16), dtype name, layout
    and read-only flag; realised anew for each device, so no call sees another's writes."""

    def __init__(self, values, dtype, layout="c", readonly=False):
        if dtype == "bfloat16":   # the CPU side of a bfloat16 array is a torch tensor: its layouts, never read-only
            layout, readonly = (layout if layout in ("c", "strided") else "c"), False
        self.dtype, self.layout, self.readonly = dtype, layout, readonly
        values = np.asarray(values)
        if layout == "broadcast" and values.ndim and values.shape[0]:
            values = np.broadcast_to(values[:1], values.shape).copy()
        self.values = values

    def numpy(self):
        return self.laid_out(self.values)

    def laid_out(self, v):
        """A copy of the NumPy array ``v`` in this argument's layout."""
        if self.layout == "strided" and v.ndim:
            wide = np.zeros(v.shape[:-1] + (2 * v.shape[-1],), v.dtype)
            wide[..., ::2] = v
            a = wide[..., ::2]
        elif self.layout == "reversed" and v.ndim:
            a = np.ascontiguousarray(v[::-1])[::-1]
        elif self.layout == "fortran":
            a = np.asfortranarray(v)
        elif self.layout == "broadcast" and v.ndim and v.shape[0]:
            a = np.broadcast_to(v[:1], v.shape)
        elif self.layout == "misaligned" and v.itemsize > 1:
            buf = np.zeros(v.nbytes + v.itemsize, np.uint8)
            a = buf[1:1 + v.nbytes].view(v.dtype).reshape(v.shape)
            a[...] = v
        else:
            a = v.copy()
        if self.readonly and a.flags.writeable:
            a.flags.writeable = False
        return a

    def torch(self):
        if self.dtype == "bfloat16":
            t = torch.from_numpy(self.values.astype(np.float32)).to(torch.bfloat16)
        elif self.dtype == "uint8" or self.values.dtype.kind in "fiucb":
            t = torch.from_numpy(self.values.copy())
        else:
            return self.numpy()
        if self.layout == "strided" and t.ndim:
            wide = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
            wide[..., ::2] = t
            t = wide[..., ::2]
        return t

    def emu(self):
        if self.dtype == "bfloat16":
            bits = torch.from_numpy(self.values.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
            return EmuCuda(self.laid_out(bits.view(np.uint16)), bf16=True, readonly=self.readonly)
        a = self.numpy()
        if any(s % a.itemsize for s in a.strides):  # not expressible in DLPack: a contiguous copy
            a = np.ascontiguousarray(a)
        return EmuCuda(a, readonly=self.readonly or not a.flags.writeable)   # (a broadcast view is read-only)


class Gen:
    """Argument generators over one fuzz input."""

    def __init__(self, data):
        self.f = atheris.FuzzedDataProvider(data)

    def int(self, lo, hi):
        return self.f.ConsumeIntInRange(lo, hi)

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def chance(self, percent):
        return self.int(0, 99) < percent

    def dim(self, typical=6):
        r = self.int(0, 99)
        if r >= 98:   # wide enough for the split-row kernels (several chunks per row from about 2,048 on)
            return self.int(1000, 6000)
        return 0 if r < 4 else 1 if r < 14 else self.int(1, typical) if r < 94 else self.int(typical, 4 * typical + 300)

    def count(self, typical):
        """An integer argument: usually in [0, typical], sometimes negative, huge or not an int at all."""
        r = self.int(0, 99)
        if r < 80:
            return self.int(0, typical)
        if r < 88:
            return self.pick(BIG)
        return self.pick([-1, -2, np.int64(min(self.int(0, typical), 2**63 - 1)), np.int32(1), True, 1.0, 2.5, float("nan"),
                          None, "3", [1], np.uint64(2**63)])

    def real(self, typical=1.0):
        r = self.int(0, 99)
        if r < 75:
            return typical * self.int(1, 1000) / 500.0
        return self.pick([0.0, -1.0, 1e-30, 1e30, 1e300, float("inf"), -float("inf"), float("nan"), 1, True, None,
                          np.float32(0.5), "1.0", 2**64, 5e-324])

    def values(self, shape, kind):
        size = int(np.prod(shape)) if len(shape) else 1
        if kind == "float":
            v = np.array([self.float() for _ in range(size)], np.float64)
        elif kind == "ids":
            hi = max(size, 2)
            v = np.array([self.int(-2, hi) if self.chance(95) else self.pick(BIG[:10]) for _ in range(size)],
                         dtype=object)
        else:
            v = np.array([self.int(-3, 9) for _ in range(size)], np.int64)
        return v.reshape(shape)

    def float(self):
        r = self.int(0, 99)
        if r < 85:
            return (self.int(0, 2000) - 1000) / 100.0
        return self.pick([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e38, -1e38, 3.4e38, 65504.0,
                          70000.0, 1e-45, 5e-324])

    def array(self, shape, kind, dtypes):
        """An array of `shape` whose dtype is usually one of `dtypes` (otherwise any); kind float, ids or int."""
        dtype = self.pick(dtypes) if self.chance(90) else self.pick(DTYPES)
        if self.chance(5) and len(shape):  # another rank
            shape = shape[:-1] if self.chance(50) else shape + (self.dim(3),)
        shape = tuple(shape)
        # big enough for every code path, small enough to be fast; zero dims count as 1, since an empty tensor's other
        # dims may still set launch sizes
        while int(np.prod([max(d, 1) for d in shape])) > MAX_ELEMENTS:
            i = int(np.argmax(shape))
            shape = shape[:i] + (shape[i] // 2,) + shape[i + 1:]
        vals = self.values(shape, kind)
        with np.errstate(all="ignore"):
            if dtype == "bfloat16":
                arr = vals.astype(np.float64).astype(np.float32)
            elif np.dtype(dtype).kind in "iu" and vals.dtype == object:
                info = np.iinfo(dtype)
                arr = np.array([min(max(int(x), info.min), info.max) for x in vals.ravel()], dtype).reshape(shape)
            elif np.dtype(dtype).kind in "iu":
                arr = np.nan_to_num(vals.astype(np.float64), posinf=0, neginf=0).astype(dtype)
            else:
                arr = vals.astype(np.float64).astype(dtype) if vals.dtype == object else vals.astype(dtype)
        if dtype == "int64" and vals.dtype == object:
            arr = np.array([min(max(int(x), -2**63), 2**63 - 1) for x in vals.ravel()], np.int64).reshape(shape)
        return A(arr, dtype, self.pick(LAYOUTS), self.chance(8))

    def parents(self, m, batch=None):
        """A parents array: a random forest (each parent an earlier index or -1) or raw ints."""
        def row():
            if self.chance(80):
                return [-1] + [self.int(-1, i - 1) if self.chance(97) else self.int(-5, m + 3) for i in range(1, m)]
            return [self.int(-3, m + 2) for _ in range(m)]
        rows = [row()[:m] for _ in range(batch or 1)]
        v = np.array(rows, np.int64).reshape((batch, m) if batch else (m,))
        return A(v, "int64" if self.chance(92) else self.pick(["int32", "float32", "uint8"]), self.pick(LAYOUTS), self.chance(5))

    def ascending(self, n, hi, batch=None):
        """Strictly ascending ints below hi (usually), n of them per row."""
        def row():
            if self.chance(85) and n <= hi:
                picks = sorted(set(self.int(0, max(hi - 1, 0)) for _ in range(2 * n + 2)))
                out = picks[:n]
                while len(out) < n:
                    out.append(out[-1] + 1 if out else 0)
                return out
            return [self.int(-2, hi + 2) for _ in range(n)]
        rows = [row() for _ in range(batch or 1)]
        v = np.array(rows, np.int64).reshape((batch, n) if batch else (n,))
        return A(v, "int64" if self.chance(92) else self.pick(["int32", "float64"]), self.pick(LAYOUTS), self.chance(5))


# ---- the ops: each returns (function name, positional args, keyword args), arrays as A ---------------------


def logits_arg(g, shape):
    return g.array(shape, "float", ["float32", "float32", "float16", "bfloat16"])


def maybe_batch(g):
    return g.int(1, 3) if g.chance(30) else None


def call_topk_entropy(g):
    b = maybe_batch(g)
    V = g.dim(40)
    shape = ((b,) if b else ()) + (g.dim(5), V)
    return "topk_entropy", [logits_arg(g, shape), g.count(V + 1)], {"temperature": g.real()}


def call_expand(g):
    b = maybe_batch(g)
    B, Vd = g.dim(4), g.dim(30)
    lead = (b,) if b else ()
    scores = g.array(lead + (B,), "float", ["float64", "float32"])
    nodes = g.array(lead + (B,), "ids", ["int64", "int32"])
    d2t = g.array((Vd,), "ids", ["int64", "int32"]) if g.chance(40) else None
    return "expand", [logits_arg(g, lead + (B, Vd)), scores, nodes, g.count(Vd + 1), d2t, g.count(50)], {}


def call_select(g):
    b = maybe_batch(g)
    M = g.dim(12)
    scores = g.array(((b,) if b else ()) + (M,), "float", ["float32", "float64"])
    kw = {}
    if b and g.chance(50):
        n = A(np.array([g.int(-1, M + 1) for _ in range(b)], np.int64), "int64", g.pick(LAYOUTS))
    else:
        n = g.count(M + 1)
    if b and g.chance(40):
        kw["m"] = A(np.array([g.int(-1, M + 1) for _ in range(b)], np.int64), "int64", "c")
    if g.chance(30):
        kw["width"] = g.count(M + 2)
    return "select", [scores, n], kw


def call_build_tree(g):
    b = maybe_batch(g)
    M = g.dim(10)
    lead = (b,) if b else ()
    tokens = g.array(lead + (M,), "ids", ["int64", "int32"])
    parents = g.parents(M, b)
    N = g.int(0, M + 1) if g.chance(95) else g.dim(10)
    selected = g.ascending(N, M, b)
    kw = {"device_outputs": g.chance(30)}
    if b:
        root = g.array((b,), "ids", ["int64"]) if g.chance(60) else g.count(50)
        if g.chance(50):
            kw["n"] = A(np.array([g.int(-1, N + 1) for _ in range(b)], np.int64), "int64", "c")
    else:
        root = g.count(50)
    return "build_tree", [tokens, parents, selected, root], kw


def verify_args(g):
    b = maybe_batch(g)
    T, V = max(g.dim(8), 1) if g.chance(95) else 0, g.dim(20)
    lead = (b,) if b else ()
    tokens = g.array(lead + (T,), "ids", ["int64", "int32"])
    parents = g.parents(T, b)
    logits = logits_arg(g, lead + (T, V))
    kw = {}
    if b and g.chance(50):
        kw["n"] = A(np.array([g.int(-1, T + 1) for _ in range(b)], np.int64), "int64", "c")
    elif g.chance(3):
        kw["n"] = A(np.array([1], np.int64), "int64", "c")
    if not b and g.chance(30):
        kw["device_outputs"] = True
    return [tokens, parents, logits], kw, b


def call_verify_greedy(g):
    args, kw, _ = verify_args(g)
    return "verify_greedy", args, kw


def call_verify_sample(g):
    args, kw, b = verify_args(g)
    kw.update(temperature=g.real(), top_k=g.count(25) if g.chance(40) else 0,
              top_p=g.real(0.5) if g.chance(40) else 1.0)
    for name in ("seed", "offset"):
        if g.chance(25):
            shape = (b,) if b else (1,)
            kw[name] = A(np.array([g.int(0, 2**40) for _ in range(shape[0])], np.int64), "int64", "c", g.chance(10))
        else:
            kw[name] = g.count(2**20)
    if g.chance(20):
        kw["advance_offset"] = True
    return "verify_sample", args, kw


def call_kv_compact(g):
    b = maybe_batch(g)
    S, D, m = g.dim(8), g.dim(4), g.dim(5)
    lead = (b,) if b else ()
    tensors = [g.array(lead + tuple(g.dim(2) for _ in range(g.int(0, 2))) + (S, D), "float",
                       ["float32", "float16", "bfloat16"]) for _ in range(g.int(0, 3))]
    slots = g.ascending(m, S, b)
    if g.chance(30):  # -1 padding after a prefix
        v = slots.values.copy()
        cut = g.int(0, m)
        v[..., cut:] = -1
        slots = A(v, slots.dtype, slots.layout, slots.readonly)
    if b and g.chance(50):
        plen = A(np.array([g.int(-1, S) for _ in range(b)], np.int64), "int64", "c")
    elif g.chance(25):
        plen = A(np.array([g.int(-1, S)] if g.chance(50) else g.int(-1, S), np.int64), "int64", "c")
    else:
        plen = g.count(S)
    as_list = g.chance(70)
    return "kv_compact" if not g.chance(20) else "KVTensors", [tensors if as_list else tuple(tensors), plen, slots], {}


def call_bucketize(g):
    N, K = g.dim(8), g.dim(8)
    values = g.array((N,), "float", ["float32", "float64"])
    th = g.array((K,), "float", ["float32", "float64"])
    if g.chance(70) and th.values.ndim == 1:
        th = A(np.sort(th.values), th.dtype, th.layout, th.readonly)
    return "bucketize", [values, th], {}


def call_philox(g):
    if g.chance(50):
        return "philox4x32", [[g.count(2**32 - 1) for _ in range(g.int(3, 5))],
                              [g.count(2**32 - 1) for _ in range(g.int(1, 3))]], {}
    n = g.count(64)
    if isinstance(n, int) and 2**16 < n < 2**50:   # an output that fits in virtual memory but not in RAM (the
        n %= 2**16                                   # OOM killer, not an error: docs/ops.md), or is slow here
    return "philox_uniform", [n], {"seed": g.count(2**64 - 1), "offset": g.count(2**64 - 1)}


CALLS = [call_topk_entropy, call_expand, call_select, call_build_tree, call_verify_greedy, call_verify_sample,
         call_kv_compact, call_bucketize, call_philox]


# ---- running a call on a device, and comparing ----------------------------------------------------------------


def realise(x, device):
    if isinstance(x, A):
        if device == "emu":
            return x.emu()
        if device == "torch" and torch is not None:
            return x.torch()
        if x.dtype == "bfloat16":  # NumPy has no bfloat16: torch's CPU tensor when torch is here
            return x.torch() if torch is not None else x.numpy().astype(np.float32)
        return x.numpy()
    if isinstance(x, list):
        return [realise(y, device) for y in x]
    if isinstance(x, tuple):
        return tuple(realise(y, device) for y in x)
    return x


def plain(x):
    """Outputs and argument arrays after the call, as nested lists of NumPy arrays and ints."""
    if EMU and isinstance(x, EmuCuda):
        a = np.asarray(x.arr)
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if x.bf16 else a  # bfloat16's values
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().float().numpy() if x.dtype == torch.bfloat16 else x.detach().numpy()
    if isinstance(x, np.ndarray):
        return np.array(x)
    if isinstance(x, (list, tuple)):
        return [plain(y) for y in x]
    if isinstance(x, ops.KVTensors):
        return plain(list(x.tensors))
    return x


def run(impl, name, args, kwargs, device, errors):
    """(ok, value): the call's outputs and its argument arrays afterwards, or the documented error raised."""
    if name == "philox_uniform":   # docs/ops.md: an n whose output does not fit in memory -> MemoryError
        errors = errors + (MemoryError,)
    a, kw = realise(args, device), {k: realise(v, device) for k, v in kwargs.items()}
    fn = getattr(impl, name)
    try:
        if name == "KVTensors":
            kv = fn(a[0])
            out = impl.kv_compact(kv, a[1], a[2])
        else:
            out = fn(*a, **kw)
    except errors as e:
        return False, e
    if device == "emu":
        _C.cuda_check(0, 0)  # a device-side error of this call must surface here, not in the next input's
    return True, [plain(out), plain(a), plain(kw)]


def same(x, y, rtol, path="out"):
    if isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            raise Finding(f"{path}: {len(x)} vs {len(y)} items")
        for i, (p, q) in enumerate(zip(x, y)):
            same(p, q, rtol, f"{path}[{i}]")
        return
    if isinstance(x, dict):
        return same([x[k] for k in sorted(x)], [y[k] for k in sorted(y)], rtol, path)
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape:
        raise Finding(f"{path}: shapes {x.shape} vs {y.shape}")
    if x.dtype.kind in "fc" or y.dtype.kind in "fc":
        wide = np.complex128 if "c" in (x.dtype.kind, y.dtype.kind) else np.float64
        if not np.allclose(x.astype(wide), y.astype(wide), rtol=rtol, atol=1e-6, equal_nan=True):
            raise Finding(f"{path}: {x!r} vs {y!r}")
    elif not np.array_equal(x, y):
        raise Finding(f"{path}: {x!r} vs {y!r}")


def uses(args, kwargs, what):
    flat = list(args) + list(kwargs.values())
    while flat:
        x = flat.pop()
        if isinstance(x, (list, tuple)):
            flat.extend(x)
        elif isinstance(x, A) and what(x):
            return True
    return False


def host_array(args, kwargs):
    """Whether an argument is an array that no device gets: a NumPy array or a list of numbers as drawn (say count()'s
    [1]), not an A."""
    def host(x):
        return isinstance(x, np.ndarray) or (isinstance(x, (list, tuple)) and len(x) > 0
                                             and not any(isinstance(y, (A, list, tuple)) for y in x))
    return any(host(x) for x in list(args) + list(kwargs.values()))


def emu_kv_blocks(tensors):
    """The blocks of an emulated kv_compact launch: one per leading row of each tensor that holds bytes
    (csrc/cuda/kv.cu), each 128 fibers on the host."""
    return sum(int(np.prod(t.values.shape[:-2])) for t in tensors
               if isinstance(t, A) and t.values.ndim >= 2 and t.values.shape[-2] and t.values.shape[-1])


def one_input(data):
    g = Gen(data)
    name, args, kwargs = g.pick(CALLS)(g)
    device = g.pick(DEVICES)
    if device == "emu" and not EMU or device == "torch" and torch is None or _ONLY and device not in _ONLY:
        device = "numpy"
    bf16 = uses(args, kwargs, lambda a: a.dtype == "bfloat16")
    if device == "emu" and name in ("kv_compact", "KVTensors") and emu_kv_blocks(args[0]) > EMU_MAX_KV_BLOCKS:
        device = "numpy"
    if device == "emu":
        ok, got = run(ops, name, args, kwargs, "emu", DEVICE_ERRORS)
        want_ok, want = run(ops, name, args, kwargs, "numpy", DOCUMENTED)   # (bfloat16 arrays as torch tensors)
        if ok and want_ok:
            same(got[0], want[0], 1e-5, f"{name}: device vs CPU output")
            same(got[1:], want[1:], 1e-5, f"{name}: device vs CPU arguments after the call")
        elif not ok and "expected the device of" in str(got) and host_array(args, kwargs):
            return   # a list or NumPy array given as it is stays on the host; a device call refuses it (docs/ops.md)
        elif ok != want_ok:
            raise Finding(f"{name}: the device {'accepted' if ok else 'refused'} what the CPU "
                          f"{'accepted' if want_ok else 'refused'}: {got if not ok else want!r}")
        return
    ok, got = run(ops, name, args, kwargs, device, DOCUMENTED)
    if device != "numpy" or bf16 or name == "KVTensors":
        return
    ref_ok, ref = run(reference, name, args, kwargs, "numpy", DOCUMENTED)
    if ok and ref_ok:
        same(got[0], ref[0], 1e-6, f"{name}: C core vs reference output")
        same(got[1:], ref[1:], 1e-6, f"{name}: C core vs reference arguments after the call")
    elif ok != ref_ok:
        raise Finding(f"{name}: the C core {'accepted' if ok else 'refused'} what the reference "
                      f"{'accepted' if ref_ok else 'refused'}: {got if not ok else ref!r}")


def main():
    assert INFO.get("sanitizers") or os.environ.get("HETEROSPEC_FUZZ_UNSANITIZED") == "1", (
        "fuzz_ops.py: expected the sanitizer build (HETEROSPEC_SANITIZE=fuzz), got " + repr(INFO))
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
