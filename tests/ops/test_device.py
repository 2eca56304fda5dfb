"""What the op families share on the device: build info, the scratch workspace, rows split into chunks, streams,
graph capture of a whole cycle, device-side checks deferred to cuda_check, and mismatched devices
(csrc/cuda/runtime.cu, rows.cu, common.cuh).  On a real GPU, or on the emulated build (HETEROSPEC_CUDA=emu, CI
stage 2); skipped elsewhere."""
import numpy as np
import pytest
from _device import EMU, INFO, REAL, D, need_gpu, on_device
from _dlpack import EmuCuda

import heterospec
from heterospec import ops

# ---- on the device: CPU <-> CUDA parity (a real GPU, or the emulated build), device-side checks --------------------


@on_device
def test_build_info_says_cuda():
    assert INFO["cuda"] is True
    assert INFO["cuda_archs"] == "emulated" if EMU else "sm_" in INFO["cuda_archs"]


@on_device
def test_largest_trees_parity():
    """Trees at the CUDA path's limit (4096 nodes): their walk kernels need more than 48 KB of shared memory
    on a GPU, which a launch gets only after opting in (cudaFuncSetAttribute); without it they would fail.
    The emulated build runs 512 nodes (4096 nodes take minutes there; they passed once, by hand)."""
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


@on_device
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


@on_device
def test_check_false_defers_errors_to_cuda_check():
    x = np.zeros((1, 30), np.float32)
    x[0, 3] = np.inf
    dev, _ = D.put_logits(x, "float32")
    ops.topk_entropy(dev, 3, check=False)  # returns without a sync
    with pytest.raises(ValueError, match=r"got \+inf at \[0, 3\]"):
        ops.cuda_check(0, stream=0)
    ops.cuda_check(0, stream=0)  # consumed


@on_device
def test_device_mismatch_cpu_index_with_cuda_tensor():
    x, _ = D.put_logits(np.zeros((3, 10), np.float32), "float32")
    with pytest.raises(ValueError, match=r"verify_greedy: argument 'target_logits' expected the device of 'tree_tokens' \(cpu:0\), got cuda:0"):
        ops.verify_greedy(np.array([1, 2, 3]), np.array([-1, 0, 1]), x)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'tensors\[0\]' expected the device of 'slots'"):
        ops.kv_compact([x], 0, np.array([0]))


@on_device
def test_stream_is_handed_to_the_producer():
    if REAL:
        pytest.skip("the emulated producer records what it was asked; torch is covered by test_graph_capture")
    a = EmuCuda(np.zeros((2, 9), np.float32))
    ops.topk_entropy(a, 2, stream=0)
    ops.topk_entropy(a, 2, stream=12345)
    assert a.streams[-2:] == [1, 12345]  # DLPack: the legacy default stream 0 is sent as 1


@on_device
@need_gpu
def test_two_gpus_are_refused():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with pytest.raises(ValueError, match=r"argument 'beam_scores' expected the device of 'logits' \(cuda:0\), got cuda:1"):
        ops.expand(torch.zeros(2, 10, device="cuda:0"), torch.zeros(2, device="cuda:1"), torch.zeros(2, dtype=torch.int64, device="cuda:0"), 2)


@on_device
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


@on_device
def test_rows_are_split_into_chunks_as_on_a_gpu():
    """The split-row merge paths run on every GPU cycle; the emulation must take them too (it once kept every
    row whole).  Hand-computed: C = min(floor(528 / rows), 32) chunks a row (at least 1), chunk = ceil(V / C)
    entries but at least the minimum chunk (256 entries emulated, 1024 on a GPU) and at most V; so the blocks,
    rows * chunks, never pass 528 (one wave of the 64-register kernels on an H100 or H200: 4 blocks on each of
    132 SMs) while rows <= 528."""
    chunks = heterospec._C.cuda_chunks
    assert chunks(1, 100) == 1
    if EMU:
        assert chunks(6, 3001) == 12        # ceil(3001 / 256): the split_rows tests' shape
        assert chunks(1, 3001) == 12
    else:
        assert chunks(6, 3001) == 3         # ceil(3001 / 1024)
    # the cycle benchmark's shape (test_split_rows_at_the_benchmark_shape): 8 chunks of 16,032 (rounding the
    # chunk's length up from rows * V / 528 gave 9 of 14,575: 540 blocks, a second wave of 12)
    assert chunks(60, 128256) == 8 and chunks(60, 49152) == 8
    assert chunks(20, 128256) == 26         # floor(528 / 20) (rounding up gave 27: 540 blocks)
    assert chunks(1, 49152) == 32           # SmolLM2's vocabulary, one row: the 32-chunk cap (1536 entries)
    assert chunks(600, 128256) == 1         # more rows than blocks: one chunk a row
    for V in (49152, 128256, 151936):
        assert all(rows * chunks(rows, V) <= 528 for rows in range(1, 529)), V


@on_device
def test_the_minimum_chunk_can_be_set_and_the_ops_agree_at_every_split():
    """cuda_set_chunk_min (the probe's knob for timing the ops at several chunk lengths) changes the split of the
    launches made after it and returns the value it replaces; 0 restores the build's default.  topk_entropy and
    expand give the CPU core's answers at every split (12, 3 and 1 chunks a row here, emulated; 3 and 1 on a
    GPU), and a negative length is refused naming the argument."""
    C = heterospec._C
    default = 256 if EMU else 1024
    rng = np.random.default_rng(61)
    x = (rng.normal(0, 3, (6, 3001))).astype(np.float32)
    x[2, 17] = x[2, 2900] = x[2].max() + 1.0       # a tie for the top across chunks
    dev, cpu = D.put_logits(x, "float32")
    want_h = np.asarray(ops.topk_entropy(cpu, 8))
    want = ops.expand(cpu, np.zeros(6, np.float32), np.arange(6), 5, None, 6)
    try:
        for lo, split in ((0, 3001 // default + 1), (1024, 3), (3001, 1)):
            assert C.cuda_set_chunk_min(lo) >= 1
            assert C.cuda_chunks(6, 3001) == split, lo
            np.testing.assert_allclose(D.get(ops.topk_entropy(dev, 8)), want_h, rtol=1e-5, atol=1e-6)
            got = ops.expand(dev, D.put(np.zeros(6, np.float32)), D.put(np.arange(6)), 5, None, 6)
            for name, g, w in zip(("tokens", "scores", "parents", "entropy", "next_beams"), got, want):
                if name in ("scores", "entropy"):
                    np.testing.assert_allclose(D.get(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=name)
                else:
                    np.testing.assert_array_equal(D.get(g), np.asarray(w), err_msg=name)
        assert C.cuda_set_chunk_min(0) == 3001
        assert C.cuda_set_chunk_min(0) == default
        with pytest.raises(ValueError, match=r"argument 'n' expected >= 0 \(0: the default\), got -1"):
            C.cuda_set_chunk_min(-1)
    finally:
        C.cuda_set_chunk_min(0)


@on_device
def test_new_streams_are_distinct_and_usable():
    """cuda_new_stream gives a new stream each call (the engine's recorded sets each capture on one of their
    own, engine/graphs.stream_for); an op runs on it."""
    a, b = ops.cuda_new_stream(0), ops.cuda_new_stream(0)
    assert isinstance(a, int) and a != 0 and b != 0 and a != b
    x = np.array([[0.5, 3.0, -1.0]], np.float32)
    dev, _ = D.put_logits(x, "float32")
    path, nxt = ops.verify_greedy(D.put(np.array([0], np.int64)), D.put(np.array([-1], np.int64)), dev, stream=a)
    assert nxt == 1 and list(D.get(path)) == [0]


@on_device
def test_a_grown_workspace_keeps_the_old_one_for_recorded_graphs():
    """A CUDA graph keeps the address of the workspace it was recorded with: growing must not free it.  Each
    growth at least doubles (so the kept ones together are smaller than the current one)."""
    have, kept = ops.cuda_reserve(0, 1)
    bigger = 2 * have + 12345
    have2, kept2 = ops.cuda_reserve(0, bigger)
    assert have2 >= bigger and have2 >= 2 * have and kept2 == kept + 1
    assert ops.cuda_reserve(0, bigger) == (have2, kept2)          # big enough: nothing changes
