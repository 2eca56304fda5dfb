"""The device side of the op tests (tests/ops/test_<family>.py, tests/ops/test_device.py): CPU <-> CUDA parity,
device-side checks, device outputs, streams and graph capture.

Every parity test runs the same random inputs (odd sizes, ties, every logits dtype) through the C core on
the CPU and through the kernels, and asserts integers equal and floats to 1e-5 relative.  They run on a real
GPU (torch CUDA tensors) when there is one, and otherwise on the emulated build (HETEROSPEC_CUDA=emu, CI
stage 2: the same kernel source compiled as host C++, each CUDA thread a fiber, DLPack "CUDA" tensors in
host memory) -- which checks the kernels' logic but neither their speed nor GPU-only behaviour.  Every device
test carries :func:`on_device`; tests that need a real GPU (graph capture, streams, two devices, the statistical
test on the GPU path) also carry ``need_gpu`` and skip with the reason where there is none."""

import numpy as np
import pytest

import heterospec
from heterospec import ops

INFO = heterospec.build_info()

EMU = bool(INFO.get("cuda_emulated"))


def _real_gpu():
    if not INFO["cuda"] or EMU or not INFO.get("cuda_devices"):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


REAL = _real_gpu()

NO_DEVICE = (
    "no CUDA device here ("
    + (INFO.get("cuda_unavailable_reason") or "this build has no CUDA ops")
    + ") and this is not the emulated build (HETEROSPEC_CUDA=emu, run by CI stage 2)"
)


_no_device = pytest.mark.skipif(not (REAL or EMU), reason=NO_DEVICE)


def on_device(test):
    """The mark of every device test in tests/ops: skipped without a real GPU or the emulated build, and marked
    ``device``, which the GPU phases select (``-m device``)."""
    return pytest.mark.device(_no_device(test))


need_gpu = pytest.mark.skipif(not REAL, reason="needs a real GPU: " + NO_DEVICE if not EMU else "needs a real GPU (this is the emulated build)")

from _dlpack import EmuCuda


class Dev:
    """Moves NumPy arrays to the device under test and back."""

    def put(self, a, dtype=None):
        a = np.ascontiguousarray(a if dtype is None else np.asarray(a).astype(dtype))
        if REAL:
            import torch

            return torch.from_numpy(a).cuda()
        return EmuCuda(a)

    def put_logits(self, x, dtype):
        """float32 values as a device logits tensor of `dtype`, plus the CPU tensor with the same values."""
        import torch

        cpu = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(getattr(torch, dtype))
        if REAL:
            return cpu.cuda(), cpu
        if dtype == "bfloat16":
            bits = cpu.view(torch.int16).numpy().view(np.uint16).copy()
            return EmuCuda(bits, bf16=True), cpu
        return EmuCuda(cpu.numpy().copy()), cpu

    def get(self, x):
        if isinstance(x, EmuCuda):
            return np.asarray(x.arr)
        if hasattr(x, "cpu"):
            return x.cpu().numpy()
        return np.asarray(x)


D = Dev()

LOGIT_DTYPES = ["float32", "float16", "bfloat16"]


def close(a, b):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-6)


def logits(rng, rows, V, ties=False):
    x = rng.integers(-4, 5, size=(rows, V)).astype(np.float32) if ties else rng.normal(0, 3, (rows, V)).astype(np.float32)
    return x


def _expand_matches_cpu(dev, cpu, scores, nodes, k, d2t=None):
    want = ops.expand(cpu, scores, nodes, k, d2t, 7)
    got = ops.expand(dev, D.put(scores), D.put(nodes), k, None if d2t is None else D.put(d2t), 7)
    for name, w, g in zip(("tokens", "scores", "parents", "entropy", "next_beams"), want, got):
        w, g = w.numpy() if hasattr(w, "numpy") else np.asarray(w), D.get(g)
        if name in ("scores", "entropy"):
            close(g, w)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


def _random_tree_inputs(rng, M, n):
    """Candidates in expand order (parents before children) and a parent-closed selection of n."""
    parents = np.full(M, -1, np.int64)
    for c in range(M):
        parents[c] = rng.integers(-1, c) if c else -1
    tokens = rng.integers(0, 50, M).astype(np.int64)
    from _batches import _closed_selection

    return tokens, parents, _closed_selection(rng, parents, n)


def _tree_and_logits(rng, n, V, dtype, accept_bias=True):
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
    tokens = rng.integers(0, V, n).astype(np.int64)
    x = rng.normal(0, 2, (n, V)).astype(np.float32)
    if accept_bias:  # make the target agree with some children so paths get long
        for j in range(1, n):
            if rng.random() < 0.5:
                x[parents[j], tokens[j]] += 8.0
    return tokens, parents, x


def _set_scalar(p, value):
    """Change a device scalar in place (what the decoding loop does to its committed length)."""
    if isinstance(p, EmuCuda):
        p.arr[...] = value
    else:
        p.fill_(value)


def _split_logits(rng, shape, n, V, tokens, parents):
    if shape == "peaked":
        x = rng.normal(0, 3, (n, V))
        for j in range(1, n):
            x[parents[j], tokens[j]] += 12.0
    elif shape == "flat":
        x = rng.normal(0, 0.05, (n, V))
    else:  # ties: a handful of values, each shared by hundreds of tokens in every chunk
        x = rng.integers(-2, 3, (n, V)).astype(np.float64)
        for j in range(1, n):
            x[parents[j], tokens[j]] = 2.0
    return x.astype(np.float32)


def _sample_both(tokens, parents, x, dtype, **kw):
    dev, cpu = D.put_logits(x, dtype)
    want = ops.verify_sample(tokens, parents, cpu, **kw)
    got = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
    return [D.get(a) if not isinstance(a, int) else a for a in got], [np.asarray(a) if not isinstance(a, int) else a
                                                                      for a in want]


def _root_draws_match(x, dtype, seed, trials=6, **warp):
    """A root-only tree over the row x [1, V]: the residual draw samples the warped row itself; the next token
    and the draws equal the CPU's for `trials` seeds."""
    tokens, parents = np.zeros(1, np.int64), np.full(1, -1, np.int64)
    for trial in range(trials):
        got, want = _sample_both(tokens, parents, x, dtype, temperature=1.0, seed=seed + trial, offset=trial, **warp)
        assert got[1:] == want[1:], f"trial {trial}"


def _poisoned_outputs(monkeypatch):
    """Outputs allocated full of -777, so an output a kernel leaves unwritten shows."""
    if REAL:
        import torch

        dev = torch.device("cuda", 0)
        dts = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
        monkeypatch.setitem(ops._torch_allocs, dev,
                            lambda shape, dtype: torch.full(shape, -777, dtype=torch.int64, device=dev).to(dts[dtype]))
    else:
        monkeypatch.setitem(ops._ALLOCATORS, EmuCuda,
                            lambda like: (lambda shape, dtype: EmuCuda(np.full(shape, -777).astype(dtype))))


def _deferred_error(match):
    with pytest.raises(ValueError, match=match):
        ops.cuda_check(0, stream=0)
    ops.cuda_check(0, stream=0)    # consumed


def _star(T, n, root):
    """The tree a refused build_tree request gets: n nodes under the root, all with the root's token."""
    tokens = np.full(T, -1)
    tokens[:n + 1] = root
    parents = np.full(T, -1)
    parents[1:n + 1] = 0
    depths = np.full(T, -1)
    depths[0], depths[1:n + 1] = 0, 1
    mask = np.zeros((T, T), bool)
    mask[:n + 1, 0] = True
    mask[np.arange(n + 1), np.arange(n + 1)] = True
    retrieve = np.full((T, T), -1)
    if n == 0:
        retrieve[0, 0] = 0
    for i in range(1, n + 1):
        retrieve[i - 1, :2] = (0, i)
    return tokens, parents, depths, mask, retrieve, max(n, 1), min(n, 1)
