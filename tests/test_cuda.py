"""The CUDA path of heterospec.ops: CPU <-> CUDA parity, device-side checks, device outputs, streams and
graph capture.

Every parity test runs the same random inputs (odd sizes, ties, every logits dtype) through the C core on
the CPU and through the kernels, and asserts integers equal and floats to 1e-5 relative.  They run on a real
GPU (torch CUDA tensors) when there is one, and otherwise on the emulated build (HETEROSPEC_CUDA=emu, CI
stage 2: the same kernel source compiled as host C++, one thread per CUDA thread, DLPack "CUDA" tensors in
host memory) -- which checks the kernels' logic but neither their speed nor GPU-only behaviour.  Tests that
need a real GPU (graph capture, streams, two devices, the statistical test on the GPU path) skip with the
reason where there is none.
"""
import zlib

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
pytestmark = pytest.mark.skipif(not (REAL or EMU), reason=NO_DEVICE)
need_gpu = pytest.mark.skipif(not REAL, reason="needs a real GPU: " + NO_DEVICE if not EMU else "needs a real GPU (this is the emulated build)")


# ---- emulated device tensors: tests/_dlpack.py's EmuCuda (NumPy memory exported through DLPack as if it lived
# on cuda:0) --------------------------------------------------------------------------------------------------


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


def test_build_info_says_cuda():
    assert INFO["cuda"] is True
    assert INFO["cuda_archs"] == "emulated" if EMU else "sm_" in INFO["cuda_archs"]


# ---- parity ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("V,k", [(1, 1), (7, 3), (111, 10), (1000, 1), (1000, 1000), (3001, 64)])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_entropy_parity(dtype, V, k, ties):
    rng = np.random.default_rng(V * 7 + k)
    x = logits(rng, 3, V, ties)
    x[1, :: max(V // 5, 1)] = -np.inf
    x[1, 0] = 0.5
    dev, cpu = D.put_logits(x, dtype)
    for t in (1.0, 0.7):
        close(D.get(ops.topk_entropy(dev, k, t)), ops.topk_entropy(cpu, k, t).numpy())


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("B,V,k", [(1, 5, 5), (3, 111, 4), (4, 2000, 10), (2, 300, 33)])
@pytest.mark.parametrize("ties", [False, True])
def test_expand_parity(dtype, B, V, k, ties):
    rng = np.random.default_rng(B * 1000 + V + k)
    x = logits(rng, B, V, ties)
    dev, cpu = D.put_logits(x, dtype)
    scores = (-rng.random(B) * 3).astype(np.float64)
    nodes = rng.integers(-1, 50, B).astype(np.int64)
    d2t = rng.integers(0, 40, V).astype(np.int64)
    for d in (None, d2t):
        _expand_matches_cpu(dev, cpu, scores, nodes, k, d)


def _expand_matches_cpu(dev, cpu, scores, nodes, k, d2t=None):
    want = ops.expand(cpu, scores, nodes, k, d2t, 7)
    got = ops.expand(dev, D.put(scores), D.put(nodes), k, None if d2t is None else D.put(d2t), 7)
    for name, w, g in zip(("tokens", "scores", "parents", "entropy", "next_beams"), want, got):
        w, g = w.numpy() if hasattr(w, "numpy") else np.asarray(w), D.get(g)
        if name in ("scores", "entropy"):
            close(g, w)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("B,k", [(5, 256), (3, 342), (4, 256), (100, 10), (2, 10)])
@pytest.mark.parametrize("ties", [False, True])
def test_expand_next_beams_by_rank_and_by_radix_select(B, k, ties):
    """The last block picks a request's next beams from its B * k scores: by rank counting up to 1024 scores
    (EAGLE's 10 x 10; 4 x 256 at the limit), by the radix select above it (5 x 256, 3 x 342); both give the
    CPU's order, ties (equal scores from equal logits) to the lower index."""
    rng = np.random.default_rng(B * 1000 + k + ties)
    V = 2 * k + 37
    x = logits(rng, B, V, ties)
    dev, cpu = D.put_logits(x, "float32")
    scores = (np.zeros(B) if ties else -rng.random(B) * 3).astype(np.float64)
    nodes = rng.integers(-1, 50, B).astype(np.int64)
    _expand_matches_cpu(dev, cpu, scores, nodes, k)


@pytest.mark.parametrize("M,n", [(1, 0), (1, 1), (10, 4), (333, 59), (1000, 1000), (700, 1)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_select_parity(M, n, dtype):
    rng = np.random.default_rng(M + n)
    for s in (rng.normal(size=M), rng.integers(-3, 3, M).astype(float)):
        s = s.astype(dtype)
        np.testing.assert_array_equal(D.get(ops.select(D.put(s), n)), ops.select(s, n))


def _random_tree_inputs(rng, M, n):
    """Candidates in expand order (parents before children) and a parent-closed selection of n."""
    parents = np.full(M, -1, np.int64)
    for c in range(M):
        parents[c] = rng.integers(-1, c) if c else -1
    tokens = rng.integers(0, 50, M).astype(np.int64)
    from test_batch import _closed_selection

    return tokens, parents, _closed_selection(rng, parents, n)


@pytest.mark.parametrize("M,n", [(1, 0), (5, 3), (60, 20), (300, 59), (200, 127)])
def test_build_tree_parity(M, n):
    rng = np.random.default_rng(M * 3 + n)
    tokens, parents, sel = _random_tree_inputs(rng, M, n)
    want = ops.build_tree(tokens, parents, sel, 9)
    got = ops.build_tree(D.put(tokens), D.put(parents), D.put(sel), 9)
    for name in want._fields:
        np.testing.assert_array_equal(D.get(getattr(got, name)), getattr(want, name), err_msg=name)
    tree, leaves, depth = ops.build_tree(D.put(tokens), D.put(parents), D.put(sel), 9, device_outputs=True)
    wtree, wleaves, wdepth = ops.build_tree(tokens, parents, sel, 9, device_outputs=True)
    np.testing.assert_array_equal(D.get(tree.retrieve), wtree.retrieve)
    assert int(D.get(leaves)) == int(wleaves) and int(D.get(depth)) == int(wdepth)


def _tree_and_logits(rng, n, V, dtype, accept_bias=True):
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
    tokens = rng.integers(0, V, n).astype(np.int64)
    x = rng.normal(0, 2, (n, V)).astype(np.float32)
    if accept_bias:  # make the target agree with some children so paths get long
        for j in range(1, n):
            if rng.random() < 0.5:
                x[parents[j], tokens[j]] += 8.0
    return tokens, parents, x


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("n,V", [(1, 5), (8, 111), (30, 1000), (60, 3001)])
def test_verify_greedy_parity(dtype, n, V):
    rng = np.random.default_rng(n * 11 + V)
    for _ in range(3):
        tokens, parents, x = _tree_and_logits(rng, n, V, dtype)
        dev, cpu = D.put_logits(x, dtype)
        wpath, wnext = ops.verify_greedy(tokens, parents, cpu)
        path, nxt = ops.verify_greedy(D.put(tokens), D.put(parents), dev)
        np.testing.assert_array_equal(D.get(path), wpath.numpy() if hasattr(wpath, "numpy") else wpath)
        assert nxt == wnext
        p2, ln, nx = ops.verify_greedy(D.put(tokens), D.put(parents), dev, device_outputs=True)
        assert int(D.get(ln)) == len(wpath) and int(D.get(nx)) == wnext
        assert (D.get(p2)[len(wpath):] == -1).all()


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("n,V", [(1, 7), (10, 111), (40, 2000)])
@pytest.mark.parametrize("warp", [dict(), dict(top_k=5), dict(top_p=0.8), dict(top_k=50, top_p=0.9), dict(top_p=0.3)])
def test_verify_sample_parity_same_uniforms_same_path(dtype, n, V, warp):
    rng = np.random.default_rng(n * 13 + V + len(warp))
    for trial in range(4):
        tokens, parents, x = _tree_and_logits(rng, n, V, dtype)
        dev, cpu = D.put_logits(x, dtype)
        kw = dict(temperature=0.8, seed=1234 + trial, offset=trial * 100, **warp)
        wpath, wnext, wdraws = ops.verify_sample(tokens, parents, cpu, **kw)
        path, nxt, draws = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
        np.testing.assert_array_equal(D.get(path), wpath.numpy() if hasattr(wpath, "numpy") else wpath)
        assert (nxt, draws) == (wnext, wdraws)


def test_largest_trees_parity():
    """Trees at the CUDA path's limit (4096 nodes): their walk kernels need more than 48 KB of shared memory
    on a GPU, which a launch gets only after opting in (cudaFuncSetAttribute); without it they would fail.
    The emulated build runs 512 nodes (a std::thread per CUDA thread makes 4096 take minutes; 4096 passed
    there once, by hand)."""
    rng = np.random.default_rng(4096)
    T, V = (4096 if REAL else 512), 16
    parents = np.array([-1] + [(i - 1) // 8 for i in range(1, T)], np.int64)  # 8-ary: shallow, so quick
    tokens = rng.integers(0, V, T).astype(np.int64)
    x = rng.normal(0, 2, (T, V)).astype(np.float32)
    for j in range(1, T):
        if rng.random() < 0.5:
            x[parents[j], tokens[j]] += 8.0
    dev, cpu = D.put_logits(x, "float32")
    wpath, wnext = ops.verify_greedy(tokens, parents, cpu)
    path, nxt = ops.verify_greedy(D.put(tokens), D.put(parents), dev)
    np.testing.assert_array_equal(D.get(path), np.asarray(wpath))
    assert nxt == wnext
    kw = dict(temperature=0.9, seed=5, offset=0)
    want = ops.verify_sample(tokens, parents, cpu, **kw)
    got = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
    np.testing.assert_array_equal(D.get(got[0]), np.asarray(want[0]))
    assert got[1:] == want[1:]
    # build_tree at its limit (4095 selected + the root), over the same 8-ary candidates
    sel = np.arange(T - 1, dtype=np.int64)
    cand_parents = np.array([-1] * 8 + [(c - 8) // 8 for c in range(8, T - 1)], np.int64)
    wtree = ops.build_tree(tokens[: T - 1], cand_parents, sel, 3)
    gtree = ops.build_tree(D.put(tokens[: T - 1]), D.put(cand_parents), D.put(sel), 3)
    for name in ("tokens", "parents", "depths"):
        np.testing.assert_array_equal(D.get(getattr(gtree, name)), getattr(wtree, name), err_msg=name)
    with pytest.raises(ValueError, match=r"expected at most 4096 nodes on CUDA, got 4097"):
        ops.verify_greedy(D.put(np.zeros(4097, np.int64)), D.put(np.zeros(4097, np.int64)),
                          D.put_logits(np.zeros((4097, V), np.float32), "float32")[0])


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "uint8"])
def test_kv_compact_parity_many_tensors_one_launch(dtype):
    rng = np.random.default_rng(5)
    shapes = [(2, 3, 20, 8), (1, 20, 5), (4, 20, 16)] * 25  # 75 tensors: more than one launch's 64
    host = [(rng.normal(size=s) * 100).astype(dtype) for s in shapes]
    devs = [D.put(h) for h in host]
    slots = np.array([0, 2, 3, 7, 9], np.int64)
    ops.kv_compact(host, 6, slots)
    ops.kv_compact(devs, 6, D.put(slots))
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)


@pytest.mark.parametrize("prepared", [False, True])
def test_kv_compact_tensors_without_bytes_among_others_parity(prepared):
    # Tensors with S > 0 but no bytes per row (D = 0) get no blocks (csrc/cuda/kv.cu, fuzz finding 12); interleaved
    # with real tensors, over more than one launch's 64, every real tensor must still get its own blocks.
    rng = np.random.default_rng(8)
    shapes = [(2, 3, 20, 8), (40, 20, 0), (1, 20, 5), (3, 7, 20, 0), (4, 20, 16)] * 15   # 75 tensors, 30 empty
    host = [(rng.normal(size=s) * 100).astype(np.float32) for s in shapes]
    devs = [D.put(h) for h in host]
    slots = np.array([0, 2, 3, 7, 9], np.int64)
    ops.kv_compact(host, 6, slots)
    ops.kv_compact(ops.KVTensors(devs) if prepared else devs, 6, D.put(slots))
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)


def test_kv_compact_bad_slots_move_nothing():
    a = np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)
    d = D.put(a)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected prefix_len \+ slot < S = 10"):
        ops.kv_compact([d], 5, D.put(np.array([1, 5], np.int64)))
    np.testing.assert_array_equal(D.get(d), a)
    with pytest.raises(ValueError, match=r"argument 'slots' expected strictly ascending"):
        ops.kv_compact([d], 0, D.put(np.array([2, 2], np.int32)))
    np.testing.assert_array_equal(D.get(d), a)


def _set_scalar(p, value):
    """Change a device scalar in place (what the decoding loop does to its committed length)."""
    if isinstance(p, EmuCuda):
        p.arr[...] = value
    else:
        p.fill_(value)


@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("prepared", [False, True])
def test_kv_compact_device_plen_and_padded_slots_parity(shape, prepared):
    rng = np.random.default_rng(6)
    shapes = [(2, 3, 20, 8), (1, 20, 5), (4, 20, 16)] * (25 if prepared else 2)  # 75: more than one launch
    host = [(rng.normal(size=s) * 100).astype(np.float32) for s in shapes]
    devs = [D.put(h) for h in host]
    slots = np.array([0, 2, 3, 7, 9, -1, -1], np.int64)
    ops.kv_compact(host, 6, slots[:5])
    ops.kv_compact(ops.KVTensors(devs) if prepared else devs, D.put(np.full(shape, 6, np.int64)), D.put(slots))
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)


@pytest.mark.parametrize("prepared", [False, True])
def test_kv_compact_device_plen_is_read_when_the_kernel_runs(prepared):
    """The device-resident loop: one prefix tensor advanced between calls, check=False, padded paths."""
    rng = np.random.default_rng(7)
    host = [rng.normal(size=(2, 40, 8)).astype(np.float32), rng.integers(0, 99, size=(3, 1, 44, 4)).astype(np.int64)]
    devs = [D.put(h) for h in host]
    target = ops.KVTensors(devs) if prepared else devs
    prefix = D.put(np.array([0], np.int64))
    n, p = 6, 0
    for step in range(5):
        length = int(rng.integers(1, n + 1))
        path = np.full(n, -1, np.int64)
        path[:length] = [0] + sorted(rng.choice(np.arange(1, n), size=length - 1, replace=False).tolist())
        ops.kv_compact(host, p, path[:length])
        ops.kv_compact(target, prefix, D.put(path), check=False)  # prefix is read by the kernel, not here
        p += length
        _set_scalar(prefix, p)
    ops.cuda_check(0)
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)
    assert int(D.get(prefix)[0]) == p  # read, never written


def test_kv_compact_bad_device_plen_raises_at_cuda_check_and_moves_nothing():
    a = np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)
    d = D.put(a)
    prefix = D.put(np.array([-2], np.int64))
    ops.kv_compact([d], prefix, D.put(np.array([0, 3, -1], np.int64)), check=False)  # no error yet
    with pytest.raises(ValueError, match=r"^cuda_check: argument 'prefix_len' expected >= 0, got -2$"):
        ops.cuda_check(0)  # (the record is raised under the name of the call that checks it)
    np.testing.assert_array_equal(D.get(d), a)
    with pytest.raises(ValueError, match=r"argument 'prefix_len' expected >= 0, got -2"):
        ops.kv_compact(ops.KVTensors([d]), prefix, D.put(np.array([0, 3], np.int32)))
    # refused even with nothing to move: all padding, no slots, no tensors
    for tensors, slots in (([d], np.full(3, -1, np.int64)), ([d], np.zeros(0, np.int64)), ([], np.array([1]))):
        with pytest.raises(ValueError, match=r"argument 'prefix_len' expected >= 0, got -2"):
            ops.kv_compact(tensors, prefix, D.put(slots))
    np.testing.assert_array_equal(D.get(d), a)
    _set_scalar(prefix, 2)  # the same tensor, now valid
    ops.kv_compact([d], prefix, D.put(np.array([0, 3, -1], np.int64)))
    a[:, 3] = a[:, 5]
    np.testing.assert_array_equal(D.get(d), a)


def test_kv_compact_device_padding_errors_move_nothing():
    a = np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)
    d = D.put(a)
    with pytest.raises(ValueError, match=r"argument 'slots' expected only -1 \(padding\) after the first -1, got 4 at "
                                         r"\[2\] after -1 at \[1\]"):
        ops.kv_compact([d], D.put(np.array(1, np.int64)), D.put(np.array([0, -1, 4, -1], np.int64)))
    with pytest.raises(ValueError, match=r"argument 'slots' expected only -1"):
        ops.kv_compact([d], 0, D.put(np.array([-1, 0], np.int32)))
    for prefix in (2**62, 2**63 - 1):  # prefix + slot would overflow int64: refused, never wrapped
        with pytest.raises(ValueError, match=r"argument 'slots' expected prefix_len \+ slot < S = 10"):
            ops.kv_compact([d], D.put(np.array([prefix], np.int64)), D.put(np.array([2**62, -1], np.int64)))
    np.testing.assert_array_equal(D.get(d), a)
    ops.kv_compact([d], D.put(np.array([9], np.int64)), D.put(np.full(5, -1, np.int64)))  # all padding: a no-op
    np.testing.assert_array_equal(D.get(d), a)


def test_kv_compact_garbage_inputs_agree_with_the_cpu_core():
    """Random slot lists (garbage included: negative, huge, unordered, -1 anywhere) and prefixes up to the int64
    limit: the kernel raises exactly the CPU core's error, or moves exactly the same rows.  On the sanitized
    emulated build (CI stage 2) an out-of-bounds access or an int64 overflow here aborts the run."""
    rng = np.random.default_rng(8)
    pool = np.array([-1, -1, 0, 1, 2, 3, 5, 8, 13, -2, 2**31, 2**62, 2**63 - 1, -(2**63)], np.int64)
    for trial in range(60):
        m = int(rng.integers(0, 6))
        if trial % 3 == 0:  # mostly valid: ascending + padding
            slots = np.sort(rng.choice(9, size=m, replace=False)).astype(np.int64) if m else np.zeros(0, np.int64)
            slots = np.concatenate([slots, np.full(int(rng.integers(0, 3)), -1, np.int64)])
        else:
            slots = rng.choice(pool, size=m)
        prefix = int(rng.choice([0, 1, 3, 2**62, 2**63 - 1, -1, -(2**63)]))
        a = rng.normal(size=(2, 12, 3)).astype(np.float32)
        host, d = a.copy(), D.put(a)
        errors = []
        for fn in (lambda: ops.kv_compact([host], prefix, slots.copy()),
                   lambda: ops.kv_compact([d], D.put(np.array([prefix], np.int64)), D.put(slots))):
            try:
                fn()
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        assert errors[0] == errors[1], (prefix, slots, errors)
        np.testing.assert_array_equal(D.get(d), host)


def test_kv_compact_plen_and_kv_tensors_devices():
    d = D.put(np.zeros((2, 10, 4), np.float32))
    with pytest.raises(ValueError, match=r"kv_compact: argument 'prefix_len' expected the device of 'slots'"):
        ops.kv_compact([d], np.array([1], np.int64), D.put(np.array([0, 1])))
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected the device of 'tensors' \(cuda:0\)"):
        ops.kv_compact(ops.KVTensors([d]), 0, np.array([0, 1]))
    with pytest.raises(ValueError, match=r"KVTensors: argument 'tensors\[1\]' expected the device of 'tensors\[0\]'"):
        ops.KVTensors([d, np.zeros((2, 10, 4), np.float32)])
    with pytest.raises(TypeError, match=r"kv_compact: argument 'prefix_len' expected dtype int64"):
        ops.kv_compact([d], D.put(np.array([1], np.int32)), D.put(np.array([0, 1])))
    with pytest.raises(ValueError, match=r"kv_compact: argument 'prefix_len' expected an int or an int64 array with exactly one"):
        ops.kv_compact([d], D.put(np.array([1, 2], np.int64)), D.put(np.array([0, 1])))


@pytest.mark.parametrize("N,T", [(0, 3), (1, 0), (100, 7), (1000, 1)])
def test_bucketize_parity(N, T):
    rng = np.random.default_rng(N + T)
    v = rng.normal(size=N)
    t = np.sort(rng.normal(size=T))
    if N:
        v[: min(N, T)] = t[: min(N, T)] if T else v[:0]
    np.testing.assert_array_equal(D.get(ops.bucketize(D.put(v), D.put(t))), ops.bucketize(v, t))


# ---- device-side checks ----------------------------------------------------------------------------------


def test_nan_logits_raise_naming_the_argument():
    x = np.zeros((2, 30), np.float32)
    x[1, 17] = np.nan
    dev, _ = D.put_logits(x, "float32")
    with pytest.raises(ValueError, match=r"topk_entropy: argument 'logits' expected finite values .*got nan at \[1, 17\]"):
        ops.topk_entropy(dev, 3)
    with pytest.raises(ValueError, match=r"expand: argument 'logits' expected finite"):
        ops.expand(dev, D.put(np.zeros(2)), D.put(np.zeros(2, np.int64)), 2)
    # the record was consumed: a good call afterwards is fine
    good, _ = D.put_logits(np.zeros((2, 30), np.float32), "float32")
    ops.topk_entropy(good, 3)


def test_check_false_defers_errors_to_cuda_check():
    x = np.zeros((1, 30), np.float32)
    x[0, 3] = np.inf
    dev, _ = D.put_logits(x, "float32")
    ops.topk_entropy(dev, 3, check=False)  # returns without a sync
    with pytest.raises(ValueError, match=r"got \+inf at \[0, 3\]"):
        ops.cuda_check(0, stream=0)
    ops.cuda_check(0, stream=0)  # consumed


def test_build_tree_not_closed_and_verify_bad_tree_raise():
    with pytest.raises(ValueError, match=r"build_tree: argument 'selected' expected a parent-closed selection, got candidate 2"):
        ops.build_tree(D.put(np.array([1, 2, 3])), D.put(np.array([-1, 0, 1])), D.put(np.array([0, 2])), 0)
    x, _ = D.put_logits(np.zeros((3, 10), np.float32), "float32")
    with pytest.raises(ValueError, match=r"verify_greedy: argument 'tree_parents' expected 0 <= tree_parents\[i\] < i"):
        ops.verify_greedy(D.put(np.array([1, 2, 3])), D.put(np.array([-1, 0, 2])), x)
    with pytest.raises(ValueError, match=r"verify_sample: argument 'tree_tokens' expected ids in \[0, V = 10\)"):
        ops.verify_sample(D.put(np.array([1, 20, 3])), D.put(np.array([-1, 0, 0])), x, temperature=1.0, seed=1, offset=0)


def test_device_mismatch_cpu_index_with_cuda_tensor():
    x, _ = D.put_logits(np.zeros((3, 10), np.float32), "float32")
    with pytest.raises(ValueError, match=r"verify_greedy: argument 'target_logits' expected the device of 'tree_tokens' \(cpu:0\), got cuda:0"):
        ops.verify_greedy(np.array([1, 2, 3]), np.array([-1, 0, 1]), x)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'tensors\[0\]' expected the device of 'slots'"):
        ops.kv_compact([x], 0, np.array([0]))


def test_stream_is_handed_to_the_producer():
    if REAL:
        pytest.skip("the emulated producer records what it was asked; torch is covered by test_graph_capture")
    a = EmuCuda(np.zeros((2, 9), np.float32))
    ops.topk_entropy(a, 2, stream=0)
    ops.topk_entropy(a, 2, stream=12345)
    assert a.streams[-2:] == [1, 12345]  # DLPack: the legacy default stream 0 is sent as 1


# ---- real GPU only ----------------------------------------------------------------------------------------


@need_gpu
def test_two_gpus_are_refused():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with pytest.raises(ValueError, match=r"argument 'beam_scores' expected the device of 'logits' \(cuda:0\), got cuda:1"):
        ops.expand(torch.zeros(2, 10, device="cuda:0"), torch.zeros(2, device="cuda:1"), torch.zeros(2, dtype=torch.int64, device="cuda:0"), 2)


@need_gpu
def test_graph_capture_of_a_cycle_replays_exactly():
    import torch

    rng = np.random.default_rng(0)
    V, Vd, k = 5000, 3000, 4
    dl = torch.from_numpy(rng.normal(0, 3, (1, Vd)).astype(np.float32)).cuda()
    tl = torch.from_numpy(rng.normal(0, 3, (k + 1, V)).astype(np.float32)).cuda()
    kv = torch.randn(2, 4, 64, 16, device="cuda")
    s0, n0 = torch.zeros(1, dtype=torch.float64, device="cuda"), torch.full((1,), -1, dtype=torch.int64, device="cuda")
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    sel = torch.arange(k, device="cuda")

    def cycle():
        toks, sc, par, ent, nb = ops.expand(dl, s0, n0, k, check=False)
        chosen = ops.select(sc, k, check=False)
        tree, _, _ = ops.build_tree(toks, par, chosen, 3, check=False, device_outputs=True)
        g = ops.verify_greedy(tree.tokens, tree.parents, tl, check=False, device_outputs=True)
        s = ops.verify_sample(tree.tokens, tree.parents, tl, temperature=1.0, seed=7, offset=offset, check=False,
                              device_outputs=True, advance_offset=True)
        ops.kv_compact([kv], 10, sel, check=False)
        return ent, chosen, tree, g, s

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = cycle()  # warm-up: grows the workspace outside the capture
        torch.cuda.synchronize()
        eager_vals = [t.clone() for t in (eager[0], eager[1], eager[2].mask, eager[3][0], eager[4][0])]
        offset.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = cycle()
    graph.replay()
    torch.cuda.synchronize()
    ops.cuda_check(0)
    for a, b in zip(eager_vals, (out[0], out[1], out[2].mask, out[3][0], out[4][0])):
        assert torch.equal(a, b)
    draws = int(out[4][3])
    assert int(offset) == draws  # advanced on the device by the captured kernel
    graph.replay()
    torch.cuda.synchronize()
    assert int(offset) == draws + int(out[4][3])


@need_gpu
def test_graph_captured_kv_compact_follows_the_plen_tensor():
    """A captured commit (KVTensors, padded device path, device prefix) replayed after the prefix changes."""
    import torch

    kv = [torch.randn(2, 4, 64, 16, device="cuda") for _ in range(3)] + [torch.randn(64, 7, device="cuda")]
    kvt = ops.KVTensors(kv)
    prefix = torch.zeros(1, dtype=torch.int64, device="cuda")
    path = torch.tensor([0, 2, 5, -1, -1], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.kv_compact(kvt, prefix, path, check=False)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ops.kv_compact(kvt, prefix, path, check=False)
    torch.cuda.synchronize()
    for p in (3, 10, 40):
        want = [t.clone() for t in kv]
        for w in want:
            w[..., p:p + 3, :] = w[..., [p, p + 2, p + 5], :].clone()
        prefix.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        ops.cuda_check(0)
        for t, w in zip(kv, want):
            assert torch.equal(t, w)
    before = [t.clone() for t in kv]
    prefix.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"argument 'prefix_len' expected >= 0, got -1"):
        ops.cuda_check(0)
    prefix.fill_(60)  # 60 + 5 >= 64: the slots error, nothing moved
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"argument 'slots' expected prefix_len \+ slot < S = 64"):
        ops.cuda_check(0)
    for t, b in zip(kv, before):
        assert torch.equal(t, b)


@need_gpu
@pytest.mark.statistical     # 4,000 synchronised calls: the sanitizer phase leaves it out (racecheck stalled on it)
def test_sampled_tokens_have_the_target_distribution_on_gpu():
    """Chi-square test of the emitted first token against the warped target distribution (GPU path)."""
    import torch
    from scipy import stats

    rng = np.random.default_rng(3)
    V = 12
    x = rng.normal(0, 1.5, (4, V)).astype(np.float32)
    tokens = np.array([0, 2, 5, 2], np.int64)  # a duplicate sibling token too
    parents = np.array([-1, 0, 0, 0], np.int64)
    z = x[0].astype(np.float64) / 0.9
    p = np.exp(z - z.max())
    p /= p.sum()
    dev_t, dev_p, dev_x = (torch.from_numpy(a).cuda() for a in (tokens, parents, x))
    counts = np.zeros(V)
    n = 4000
    offset = 0
    for _ in range(n):
        path, nxt, draws = ops.verify_sample(dev_t, dev_p, dev_x, temperature=0.9, seed=99, offset=offset)
        offset += draws
        first = int(tokens[int(path[1])]) if len(path) > 1 else nxt
        counts[first] += 1
    # expected counts that sum to the observed total exactly (scipy checks the two sums to 1.5e-8 relative:
    # p * n from float32 logits missed by 8e-8 on the first GPU run)
    assert stats.chisquare(counts, p / p.sum() * counts.sum()).pvalue > 1e-3


# ---- the batch-first ABI on the device (issue 17) ------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_batched_verify_on_the_device_equals_the_cpu_batch(dtype):
    """verify_greedy / verify_sample over [batch, T] trees with per-row node counts, seeds and offsets (device
    arrays, advance_offset per row) give the CPU core's batched results, which tests/test_batch.py shows equal
    the rows called one by one."""
    from test_batch import _batch

    rng = np.random.default_rng(21)
    B, T, V = 6, 8, 40
    counts = rng.integers(1, T + 1, B).astype(np.int64)
    tok, par, x = _batch(rng, B, T, V, counts)
    x = np.nan_to_num(x, nan=0.0)                     # the padding rows' values do not matter
    dx, cpu_x = D.put_logits(x.reshape(B * T, V), dtype)
    dx = dx.reshape(B, T, V) if REAL else EmuCuda(D.get(dx).reshape(B, T, V), bf16=dtype == "bfloat16")
    cx = cpu_x.reshape(B, T, V)                       # the same values in the same dtype, on the CPU
    g_dev = [D.get(a) for a in ops.verify_greedy(D.put(tok), D.put(par), dx, n=D.put(counts))]
    g_cpu = ops.verify_greedy(tok, par, cx, n=counts)
    for a, b in zip(g_dev, g_cpu):
        assert np.array_equal(a, D.get(b))
    seeds = rng.integers(0, 2**62, B).astype(np.int64)
    offsets = rng.integers(0, 100, B).astype(np.int64)
    d_off = D.put(offsets.copy())   # (the emulated device array shares the host memory it was made from)
    s_dev = [D.get(a) for a in ops.verify_sample(D.put(tok), D.put(par), dx, n=D.put(counts), temperature=0.8,
                                                  top_k=10, top_p=0.9, seed=D.put(seeds), offset=d_off,
                                                  advance_offset=True)]
    c_off = offsets.copy()
    s_cpu = ops.verify_sample(tok, par, cx, n=counts, temperature=0.8, top_k=10, top_p=0.9, seed=seeds, offset=c_off,
                              advance_offset=True)
    for a, b in zip(s_dev, s_cpu):
        assert np.array_equal(a, D.get(b))
    assert np.array_equal(D.get(d_off), c_off) and (c_off == offsets + D.get(s_cpu[3])).all()


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_batched_expand_on_the_device_equals_the_cpu_batch(dtype):
    rng = np.random.default_rng(31)
    nb, B, Vd, k = 3, 4, 300, 5
    x = rng.normal(0, 2, (nb * B, Vd)).astype(np.float32)
    dx, cpu_x = D.put_logits(x, dtype)
    dx = dx.reshape(nb, B, Vd) if REAL else EmuCuda(D.get(dx).reshape(nb, B, Vd), bf16=dtype == "bfloat16")
    scores = rng.normal(-3, 1, (nb, B)).astype(np.float32)
    nodes = rng.integers(-1, 9, (nb, B)).astype(np.int64)
    d2t = np.sort(rng.integers(0, 4, Vd)).astype(np.int64)
    dev = [D.get(a) for a in ops.expand(dx, D.put(scores), D.put(nodes), k, D.put(d2t), 3)]
    cpu = [D.get(a) for a in ops.expand(cpu_x.reshape(nb, B, Vd), scores, nodes, k, d2t, 3)]
    for a, b in zip(dev[:3] + dev[4:], cpu[:3] + cpu[4:]):
        if a.dtype.kind == "f":
            close(a, b)
        else:
            assert np.array_equal(a, b)
    close(dev[3], cpu[3])


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("V,k", [(111, 10), (3001, 64), (3001, 300)])   # split rows, and k above the split path's
def test_batched_topk_entropy_on_the_device_equals_the_cpu_batch(dtype, V, k):
    rng = np.random.default_rng(V + k)
    B, N = 3, 2
    x = logits(rng, B * N, V, ties=True)
    x[3, ::5] = -np.inf
    dx, cpu_x = D.put_logits(x, dtype)
    dx = dx.reshape(B, N, V) if REAL else EmuCuda(D.get(dx).reshape(B, N, V), bf16=dtype == "bfloat16")
    dev = D.get(ops.topk_entropy(dx, k, 0.8))
    assert dev.shape == (B, N)
    close(dev, D.get(ops.topk_entropy(cpu_x.reshape(B, N, V), k, 0.8)))


def test_batched_select_on_the_device_equals_the_cpu_batch():
    rng = np.random.default_rng(41)
    x = rng.integers(-5, 5, (4, 200)).astype(np.float32)
    dev = D.get(ops.select(D.put(x), 31))
    assert np.array_equal(dev, ops.select(x, 31)) and dev.shape == (4, 31)


# ---- split rows (issue 17): rows cut into chunks, merged from candidates, with exact fallbacks ---------------
# The kernels cut each row into chunks (256 entries in the emulated build, so V = 3001 is 12 chunks) and decide
# a row from its chunks' candidates where those are enough; these inputs drive every branch: peaked rows (the
# candidates decide), flat rows (a nucleus wider than the candidates: the wide rows' split descents), integer logits
# (ties at the k-th value across chunk boundaries: the tie fallback; argmax ties across chunks), top_k above
# the split path's 256 (the unsplit kernels; for verify_sample the wide rows), padded batch rows (skipped).

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["peaked", "flat", "ties"])
@pytest.mark.parametrize("warp", [dict(), dict(top_p=0.9), dict(top_p=0.999), dict(top_k=7),
                                  dict(top_k=200, top_p=0.8), dict(top_k=300), dict(top_k=7, top_p=0.5)])
def test_split_rows_verify_sample_parity(dtype, shape, warp):
    rng = np.random.default_rng(zlib.crc32(f"{dtype} {shape} {warp}".encode()))  # not hash(): salted per process
    n, V = 6, 3001
    for trial in range(3):
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
        tokens = rng.integers(0, V, n).astype(np.int64)
        x = _split_logits(rng, shape, n, V, tokens, parents)
        dev, cpu = D.put_logits(x, dtype)
        kw = dict(temperature=0.9, seed=77 + trial, offset=trial * 10, **warp)
        want = ops.verify_sample(tokens, parents, cpu, **kw)
        got = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
        np.testing.assert_array_equal(D.get(got[0]), np.asarray(want[0]), err_msg=f"trial {trial}")
        assert got[1:] == want[1:], f"trial {trial}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("warp", [dict(top_k=200, top_p=0.8), dict(top_p=0.8), dict(top_k=256, top_p=0.6)])
def test_split_rows_top_p_cut_on_a_tied_run(dtype, warp):
    """The top-p crossing inside a run of equal logits whose length times top_p is a whole number: in real
    arithmetic the cut falls exactly on top_p, so the order of the float sums decides it.  The device must take
    it in the CPU's order (w / W added token by token, best first); the split merge once summed weights and
    divided once, kept one token fewer than the CPU and drew another next token (CI, ties with top_k 200)."""
    V = 3001
    for count in (605, 610, 630, 650):
        rng = np.random.default_rng(count)
        x = rng.integers(-2, 2, (1, V)).astype(np.float32)      # -2 .. 1 everywhere,
        x[0, rng.choice(V, count, replace=False)] = 2.0         # and a run of `count` equal maxima
        tokens, parents = np.zeros(1, np.int64), np.full(1, -1, np.int64)  # a root only: the residual draw
        dev, cpu = D.put_logits(x, dtype)                        # samples the warped row itself
        for trial in range(4):
            kw = dict(temperature=1.0, seed=1000 + trial, offset=trial, **warp)
            want = ops.verify_sample(tokens, parents, cpu, **kw)
            got = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
            assert got[1:] == want[1:], f"count {count}, trial {trial}"


# ---- the wide rows (issue 40.2): rows the candidates cannot decide are finished by radix descents split over the
# row's chunks (hs_k_wide_level), no longer by one block walking the whole row.  On an H200 that one block took
# 2.1 ms for 60 rows of 128,256 at top-p 0.9 (RESULTS, the second GPU run); these inputs drive every branch of
# the split descents against the CPU core: a nucleus wider than every candidate, a top-k above HS_CAND_MAX (with
# and without top-p), the k-th value's bin taken whole at the first level, the crossing inside a run of equal
# logits far longer than the candidates, and wide and decided rows in one call.

def _sample_both(tokens, parents, x, dtype, **kw):
    dev, cpu = D.put_logits(x, dtype)
    want = ops.verify_sample(tokens, parents, cpu, **kw)
    got = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
    return [D.get(a) if not isinstance(a, int) else a for a in got], [np.asarray(a) if not isinstance(a, int) else a
                                                                      for a in want]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("warp", [dict(top_k=1000), dict(top_k=1000, top_p=0.9), dict(top_k=2999, top_p=0.5),
                                  dict(top_p=0.95), dict(top_p=0.2)])
def test_wide_rows_a_mix_of_wide_and_decided_rows_equals_the_cpu(dtype, warp):
    """A tree whose rows alternate flat (the wide path) and peaked (decided by the candidates): each row's
    statistics, and so the walk and the residual draw, equal the CPU core's."""
    rng = np.random.default_rng(zlib.crc32(f"wide {dtype} {warp}".encode()))
    n, V = 7, 3001
    for trial in range(3):
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
        tokens = rng.integers(0, V, n).astype(np.int64)
        x = rng.normal(0, 0.05, (n, V)).astype(np.float32)
        for j in range(1, n):
            if parents[j] % 2:                     # odd rows peaked: a decided row among the wide ones
                x[parents[j]] = rng.normal(0, 3, V)
                x[parents[j], tokens[j]] += 12.0
        got, want = _sample_both(tokens, parents, x, dtype, temperature=0.9, seed=5 + trial, offset=trial, **warp)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"trial {trial}")
        assert got[1:] == want[1:], f"trial {trial}"


def _root_draws_match(x, dtype, seed, trials=6, **warp):
    """A root-only tree over the row x [1, V]: the residual draw samples the warped row itself; the next token
    and the draws equal the CPU's for `trials` seeds."""
    tokens, parents = np.zeros(1, np.int64), np.full(1, -1, np.int64)
    for trial in range(trials):
        got, want = _sample_both(tokens, parents, x, dtype, temperature=1.0, seed=seed + trial, offset=trial, **warp)
        assert got[1:] == want[1:], f"trial {trial}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("count, top_k", [(700, 700), (700, 701), (700, 699), (1800, 1800)])
def test_wide_rows_top_k_at_a_run_of_equal_maxima(dtype, count, top_k):
    """top_k above HS_CAND_MAX where the k-th largest value is shared: with exactly `count` maxima and top_k =
    count, the maxima's first-level bin is taken whole (the descent stops at level 0); one more or one fewer
    puts the k-th key among the next value's or inside the run (all its ties kept, as on the CPU)."""
    V = 3001
    rng = np.random.default_rng(count + top_k)
    x = rng.integers(-3, 2, (1, V)).astype(np.float32)      # -3 .. 1, and `count` tokens at 4
    x[0, rng.choice(V, count, replace=False)] = 4.0
    _root_draws_match(x, dtype, 300, top_k=top_k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("count, top_p", [(2000, 0.5), (2000, 0.75), (2500, 0.9), (1600, 0.3)])
def test_wide_rows_top_p_crossing_inside_a_long_run_of_equal_logits(dtype, count, top_p):
    """The top-p crossing inside a run of `count` equal maxima, longer than all the chunks' candidates: the wide
    descent finds the run's key, then takes its tokens one by one in id order as the CPU adds w / W, and the
    cut token (ptie) is found across chunks.  count * top_p close to a whole number puts the crossing on a
    boundary in real arithmetic, where only the order of the additions decides it (here both sides add the same
    numbers: the rest is -inf, so W is the run's count exactly)."""
    V = 3001
    rng = np.random.default_rng(count)
    x = np.full((1, V), -np.inf, np.float32)
    x[0, rng.choice(V, count, replace=False)] = 1.5
    _root_draws_match(x, dtype, 900, top_p=top_p)


def test_wide_rows_leave_no_state_for_the_next_call():
    """The wide rows' counters and histograms sit in the module workspace that every op shares: a call with
    wide rows, an expand and a select in between (which write that workspace), then the same call again give
    the same draws as the CPU each time."""
    rng = np.random.default_rng(41)
    n, V = 5, 3001
    parents = np.array([-1, 0, 0, 1, 2], np.int64)
    tokens = rng.integers(0, V, n).astype(np.int64)
    x = rng.normal(0, 0.05, (n, V)).astype(np.float32)
    first = _sample_both(tokens, parents, x, "float32", temperature=0.8, seed=3, offset=0, top_p=0.9)
    other = rng.normal(0, 1, (4, 2000)).astype(np.float32)
    ops.expand(D.put(other), D.put(np.zeros(4, np.float32)), D.put(np.arange(4, dtype=np.int64)), 10)
    again = _sample_both(tokens, parents, x, "float32", temperature=0.8, seed=3, offset=0, top_p=0.9)
    assert first[0][1:] == first[1][1:] and again[0][1:] == again[1][1:] and again[0][1:] == first[0][1:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["peaked", "ties"])
def test_split_rows_verify_greedy_parity(dtype, shape):
    rng = np.random.default_rng(5 if shape == "ties" else 6)
    n, V = 8, 3001
    for _ in range(3):
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
        tokens = rng.integers(0, V, n).astype(np.int64)
        x = _split_logits(rng, shape, n, V, tokens, parents)
        if shape == "ties":  # the row max appears in several chunks: the lowest id must win
            x[:, 2900] = x[:, 1700] = x[:, 300] = 2.0
        dev, cpu = D.put_logits(x, dtype)
        wpath, wnext = ops.verify_greedy(tokens, parents, cpu)
        path, nxt = ops.verify_greedy(D.put(tokens), D.put(parents), dev)
        np.testing.assert_array_equal(D.get(path), np.asarray(wpath))
        assert nxt == wnext


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 10, 200, 300])
@pytest.mark.parametrize("ties", [False, True])
def test_split_rows_expand_parity(dtype, k, ties):
    rng = np.random.default_rng(k * 2 + ties)
    B, V = 3, 3001
    x = logits(rng, B, V, ties)
    dev, cpu = D.put_logits(x, dtype)
    scores = (-rng.random(B) * 3).astype(np.float64)
    nodes = rng.integers(-1, 50, B).astype(np.int64)
    _expand_matches_cpu(dev, cpu, scores, nodes, k)


@pytest.mark.parametrize("warp", [dict(top_p=0.9), dict(top_k=20, top_p=0.95)])
def test_split_rows_batched_sampling_skips_padding_rows(warp):
    """A batch of 3 requests over V = 3001 with ragged node counts: the padding rows hold NaN, which the chunk
    kernels must skip (the CPU core ignores them too); seeds and offsets differ per row."""
    from test_batch import _batch

    rng = np.random.default_rng(12)
    B, T, V = 3, 7, 3001
    counts = np.array([7, 2, 5], np.int64)
    tok, par, x = _batch(rng, B, T, V, counts)
    dx, cpu_x = D.put_logits(x.reshape(B * T, V), "float32")
    dx = dx.reshape(B, T, V) if REAL else EmuCuda(D.get(dx).reshape(B, T, V))
    cx = cpu_x.reshape(B, T, V)
    seeds = np.array([3, 4, 5], np.int64)
    offsets = np.array([0, 10, 20], np.int64)
    for temperature in (0.7, 1.5):
        s_dev = [D.get(a) for a in ops.verify_sample(D.put(tok), D.put(par), dx, n=D.put(counts),
                                                      temperature=temperature, seed=D.put(seeds),
                                                      offset=D.put(offsets.copy()), **warp)]
        s_cpu = ops.verify_sample(tok, par, cx, n=counts, temperature=temperature, seed=seeds, offset=offsets.copy(),
                                  **warp)
        for a, b in zip(s_dev, s_cpu):
            assert np.array_equal(a, D.get(b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 10, 200, 300])
@pytest.mark.parametrize("ties", [False, True])
def test_split_rows_topk_entropy_parity(dtype, k, ties):
    rng = np.random.default_rng(k + 1000 * ties)
    x = logits(rng, 4, 3001, ties)
    x[1, ::7] = -np.inf          # whole stretches of -inf, and chunks that hold fewer than k finite values
    x[2, 256:1024] = -np.inf
    dev, cpu = D.put_logits(x, dtype)
    for t in (1.0, 0.6):
        close(D.get(ops.topk_entropy(dev, k, t)), ops.topk_entropy(cpu, k, t).numpy())


@need_gpu
@pytest.mark.parametrize("warp", [dict(top_p=0.9), dict(top_k=50), dict()])
def test_split_rows_at_the_benchmark_shape(warp):
    """60 nodes x 128256 bf16 (Llama-3's vocabulary, the cycle benchmark's shape): 9 chunks per row on a GPU;
    greedy and sampled verification equal the CPU core's."""
    rng = np.random.default_rng(60)
    n, V = 60, 128256
    parents = np.array([-1] + [int(rng.integers(max(0, i - 10), i)) for i in range(1, n)], np.int64)
    tokens = rng.integers(0, V, n).astype(np.int64)
    x = _split_logits(rng, "peaked", n, V, tokens, parents)
    dev, cpu = D.put_logits(x, "bfloat16")
    wpath, wnext = ops.verify_greedy(tokens, parents, cpu)
    path, nxt = ops.verify_greedy(D.put(tokens), D.put(parents), dev)
    np.testing.assert_array_equal(D.get(path), np.asarray(wpath))
    assert nxt == wnext
    for trial in range(5):
        kw = dict(temperature=1.0, seed=trial, offset=0, **warp)
        want = ops.verify_sample(tokens, parents, cpu, **kw)
        got = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
        np.testing.assert_array_equal(D.get(got[0]), np.asarray(want[0]))
        assert got[1:] == want[1:]


def test_batched_build_tree_on_the_device_equals_the_cpu_batch():
    """build_tree over [batch, M] with per-row selection sizes and roots as device arrays: every output equals
    the CPU core's batch (tests/test_batch.py shows that equals the rows), padding rows included; a negative
    root on the device is a recorded error naming root_token."""
    from test_batch import _candidate_batch

    rng = np.random.default_rng(41)
    B, M, N = 4, 30, 12
    counts = np.array([12, 0, 5, 9], np.int64)
    tok, par, sel = _candidate_batch(rng, B, M, N, counts)
    roots = np.array([7, 8, 9, 10], np.int64)
    want = ops.build_tree(tok, par, sel, roots, n=counts)
    got = ops.build_tree(D.put(tok), D.put(par), D.put(sel), D.put(roots), n=D.put(counts))
    for name, w, g in zip(want[0]._fields, want[0], got[0]):
        np.testing.assert_array_equal(D.get(g), np.asarray(w), err_msg=name)
    for w, g in zip(want[1:], got[1:]):
        np.testing.assert_array_equal(D.get(g), np.asarray(w))
    with pytest.raises(ValueError, match=r"build_tree: argument 'root_token' expected a token id >= 0, got -2 \(row 1\)"):
        ops.build_tree(D.put(tok), D.put(par), D.put(sel), D.put(np.array([1, -2, 3, 4], np.int64)), n=D.put(counts))


def test_select_with_per_row_sizes_on_the_device_equals_the_cpu():
    rng = np.random.default_rng(43)
    B, M = 5, 300
    x = rng.integers(-3, 3, (B, M)).astype(np.float32)
    m = np.array([300, 0, 17, 299, 120], np.int64)
    n = np.array([59, 0, 17, 1, 60], np.int64)
    want = ops.select(x, n, m=m, width=64)
    got = ops.select(D.put(x), D.put(n), m=D.put(m), width=64)
    np.testing.assert_array_equal(D.get(got), want)
    with pytest.raises(ValueError, match=r"select: argument 'n' expected a per-row size within the buffers"):
        ops.select(D.put(x), D.put(np.array([59, 1, 17, 1, 60], np.int64)), m=D.put(m), width=64)


@pytest.mark.parametrize("dtype", ["float16", "uint8"])
def test_batched_kv_compact_on_the_device_equals_the_cpu_batch(dtype):
    """kv_compact with slots [batch, m] and a device prefix array [batch] over 65 [batch, ..., S, D] tensors (two
    launches; 16-byte and odd rows): the CPU core's batch (tests/test_batch.py: equal to the rows); a bad request
    moves nothing in any request."""
    rng = np.random.default_rng(8)
    B = 3
    shapes = [(B, 20, 8), (B, 20, 5)] * 32 + [(B, 1, 20, 8)]
    host = [(rng.normal(size=s) * 100).astype(dtype) for s in shapes]
    devs = [D.put(h) for h in host]
    slots = np.array([[0, 2, 3, -1], [1, 4, 6, 9], [-1, -1, -1, -1]], np.int64)
    prefix = np.array([6, 2, 19], np.int64)
    ops.kv_compact(host, prefix, slots)
    ops.kv_compact(devs, D.put(prefix), D.put(slots))
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)
    before = [D.get(d).copy() for d in devs]
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected prefix_len \+ slot < S = 20, got 12 \+ 9"):
        ops.kv_compact(devs, D.put(np.array([0, 12, 0], np.int64)), D.put(slots))
    for b, d in zip(before, devs):
        np.testing.assert_array_equal(D.get(d), b)


# ---- defences for the first contact with a GPU (issue 26) ------------------------------------------------

def test_rows_are_split_into_chunks_as_on_a_gpu():
    """The split-row merge paths run on every GPU cycle; the emulation must take them too (it once kept every
    row whole).  Hand-computed: chunk = max(ceil(rows * V / 528), ceil(V / 32), minimum chunk), at most V;
    the minimum chunk is 256 entries emulated and 1024 on a GPU."""
    chunks = heterospec._C.cuda_chunks
    assert chunks(1, 100) == 1
    if EMU:
        assert chunks(6, 3001) == 12        # ceil(3001 / 256): the split_rows tests' shape
        assert chunks(1, 3001) == 12
        assert chunks(60, 128256) == 9      # ceil(60 * 128256 / 528) = 14575 entries a chunk
    else:
        assert chunks(6, 3001) == 3         # ceil(3001 / 1024)
        assert chunks(60, 128256) == 9      # the cycle benchmark's shape (test_split_rows_at_the_benchmark_shape)
    assert chunks(1, 49152) == 32           # SmolLM2's vocabulary, one row: the 32-chunk cap (1536 entries)


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


@pytest.mark.parametrize("bad", ["nan", "allneg"])
@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("V", [50, 3001])
def test_a_failed_verify_row_leaves_outputs_later_ops_can_index_and_the_error_recorded(bad, sample, V, monkeypatch):
    """The engine runs verification with check=False and indexes with its outputs on the device before the
    host looks (a scatter at length - 1, the next root token).  A row that fails (a NaN, a row of -inf) must
    leave the root alone and token 0 -- never the allocator's garbage, which would turn into a device-side
    assert of torch's that kills the context -- and its error must be what cuda_check raises."""
    _poisoned_outputs(monkeypatch)
    rng = np.random.default_rng(V)
    tokens = np.array([5, 6, 7], np.int64)
    parents = np.array([-1, 0, 1], np.int64)
    x = rng.normal(0, 1, (3, V)).astype(np.float32)
    if bad == "nan":
        x[0, 11] = np.nan
    else:
        x[0, :] = -np.inf
    dev, _ = D.put_logits(x, "float32")
    if sample:
        path, length, nxt, draws = ops.verify_sample(D.put(tokens), D.put(parents), dev, temperature=1.0, seed=3,
                                                      offset=0, check=False, device_outputs=True)
        assert int(D.get(draws).reshape(-1)[0]) == 0
    else:
        path, length, nxt = ops.verify_greedy(D.put(tokens), D.put(parents), dev, check=False, device_outputs=True)
    assert int(D.get(length).reshape(-1)[0]) == 1 and int(D.get(nxt).reshape(-1)[0]) == 0
    assert int(D.get(path).reshape(-1)[0]) == 0
    with pytest.raises(ValueError, match="expected finite" if bad == "nan" else "at least one"):
        ops.cuda_check(0, stream=0)
    ops.cuda_check(0, stream=0)    # consumed


def _deferred_error(match):
    with pytest.raises(ValueError, match=match):
        ops.cuda_check(0, stream=0)
    ops.cuda_check(0, stream=0)    # consumed


@pytest.mark.parametrize("bad", ["nan", "inf", "allneg", "beam"])
@pytest.mark.parametrize("k", [3, 300])        # the split kernels (k <= 256) and the one-block-per-row one
def test_a_refused_expand_row_leaves_outputs_the_engine_can_index(bad, k, monkeypatch):
    """The third GPU window: a draft with NaN logits made expand (check=False, as the engine calls it) leave a
    row's parents and tokens as the allocator left them, and the engine's next gather killed the CUDA context
    with a device-side assert.  A refused row writes candidates 0..k-1 with score -inf and the row's node as
    parent, entropy 0; the other rows are the CPU core's, the next beams come from them, and the error is
    recorded for cuda_check."""
    _poisoned_outputs(monkeypatch)
    rng = np.random.default_rng(k)
    B, Vd, offset = 3, 400, 7
    x = rng.normal(0, 2, (B, Vd)).astype(np.float32)
    scores = np.array([-0.5, -1.0, -0.25])
    nodes = np.array([0, 2, 5], np.int64)
    clean_x, clean_scores = x.copy(), scores.copy()
    if bad == "nan":
        x[1, 9] = np.nan
    elif bad == "inf":
        x[1, 9] = np.inf
    elif bad == "allneg":
        x[1] = -np.inf
    else:
        scores[1] = np.nan
    dev, _ = D.put_logits(x, "float32")
    tok, sc, par, ent, nxt = (D.get(a) for a in ops.expand(dev, D.put(scores), D.put(nodes), k,
                                                           node_offset=offset, check=False))
    want = ops.expand(clean_x, clean_scores, nodes, k, node_offset=offset)
    row = slice(k, 2 * k)
    np.testing.assert_array_equal(tok[row], np.arange(k))
    assert np.all(sc[row] == -np.inf) and np.all(par[row] == 2) and ent[1] == 0.0
    for r in (0, 2):
        sl = slice(r * k, (r + 1) * k)
        np.testing.assert_array_equal(tok[sl], want[0][sl])
        np.testing.assert_allclose(sc[sl], want[1][sl], rtol=1e-5)
        np.testing.assert_array_equal(par[sl], want[2][sl])
    assert np.all((nxt >= offset) & (nxt < offset + B * k)) and not np.any((nxt >= offset + k) & (nxt < offset + 2 * k))
    _deferred_error(r"argument '(logits|beam_scores)' expected")


def test_a_refused_topk_entropy_row_is_zero_and_the_others_are_the_cpus(monkeypatch):
    _poisoned_outputs(monkeypatch)
    for k in (3, 300):
        x = np.random.default_rng(k).normal(0, 1, (3, 500)).astype(np.float32)
        clean = x.copy()
        x[1, 4] = np.nan
        dev, _ = D.put_logits(x, "float32")
        got = D.get(ops.topk_entropy(dev, k, check=False))
        want = ops.topk_entropy(clean, k)
        assert got[1] == 0.0
        np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], rtol=1e-5)
        _deferred_error(r"argument 'logits' expected finite values .*got nan at \[1, 4\]")


def test_a_refused_select_row_selects_its_first_candidates(monkeypatch):
    _poisoned_outputs(monkeypatch)
    s = np.random.default_rng(0).normal(0, 1, (2, 40))
    clean = s.copy()
    s[0, 13] = np.nan
    got = D.get(ops.select(D.put(s), 5, check=False))
    np.testing.assert_array_equal(got[0], np.arange(5))
    np.testing.assert_array_equal(got[1], ops.select(clean, 5)[1])
    _deferred_error(r"argument 'scores' expected")
    # per-row sizes out of range: that row selects nothing (-1), the other is the CPU's
    got = D.get(ops.select(D.put(clean), D.put(np.array([3, 50], np.int64)), width=6, check=False))
    np.testing.assert_array_equal(got[1], np.full(6, -1))
    np.testing.assert_array_equal(got[0], ops.select(clean, np.array([3, 3], np.int64), width=6)[0])
    _deferred_error(r"cuda_check: argument")


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


@pytest.mark.parametrize("bad", ["not-closed", "range", "order", "root", "size"])
def test_a_refused_build_tree_request_gets_a_tree_the_engine_can_index(bad, monkeypatch):
    """A refused request's tree: its nodes all children of the root with the root's token (0 for a negative
    root), so the verify forward's embedding, positions, mask and retrieve gathers stay in range; the other
    request's tree is the CPU core's."""
    _poisoned_outputs(monkeypatch)
    tokens = np.array([[4, 5, 6, 7], [8, 9, 10, 11]], np.int64)
    parents = np.array([[-1, 0, 1, -1], [-1, 0, 0, 2]], np.int64)
    sel = np.array([[0, 1, 3], [0, 2, 3]], np.int64)
    root = np.array([1, 2], np.int64)
    n = np.array([3, 3], np.int64)
    if bad == "not-closed":
        sel[0] = [0, 2, 3]           # candidate 2's parent 1 is not selected
    elif bad == "range":
        sel[0] = [0, 1, 9]
    elif bad == "order":
        sel[0] = [1, 0, 3]
    elif bad == "root":
        root[0] = -3
    else:
        n[0] = 7
    tree, leaves, depth = ops.build_tree(D.put(tokens), D.put(parents), D.put(sel), D.put(root), n=D.put(n),
                                         check=False)
    got = [D.get(a)[0] for a in tree] + [int(D.get(leaves)[0]), int(D.get(depth)[0])]
    want = _star(4, 0 if bad == "size" else 3, 0 if bad == "root" else 1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    ok = ops.build_tree(tokens[[1, 1]], parents[[1, 1]], sel[[1, 1]], root[[1, 1]], n=n[[1, 1]])
    for g, w in zip(list(tree) + [leaves, depth], list(ok[0]) + [ok[1], ok[2]]):
        np.testing.assert_array_equal(D.get(g)[1], np.asarray(w)[1])
    _deferred_error(r"cuda_check: argument '(selected|root_token|n)' expected")


def test_a_grown_workspace_keeps_the_old_one_for_recorded_graphs():
    """A CUDA graph keeps the address of the workspace it was recorded with: growing must not free it.  Each
    growth at least doubles (so the kept ones together are smaller than the current one)."""
    have, kept = ops.cuda_reserve(0, 1)
    bigger = 2 * have + 12345
    have2, kept2 = ops.cuda_reserve(0, bigger)
    assert have2 >= bigger and have2 >= 2 * have and kept2 == kept + 1
    assert ops.cuda_reserve(0, bigger) == (have2, kept2)          # big enough: nothing changes
