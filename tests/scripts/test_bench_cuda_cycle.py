"""The GPU cycle benchmark's torch baseline (benchmarks/bench_cuda_cycle.py) must be a faithful EAGLE cycle:
before timing, the benchmark checks that it builds the same tree (tokens, parents, retrieve rows) and
accepts the same length as heterospec.ops.  These tests run that cross-check on the CPU at small sizes,
and show it fires when the two disagree, so the GPU run cannot time a baseline that computes something
else."""
import os

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not os.path.exists(os.path.join(ROOT, "benchmarks", "bench_cuda_cycle.py")):
    pytest.skip("benchmarks/ is not next to tests/ (installed-package run)", allow_module_level=True)
from benchmarks import bench_cuda_cycle as bench  # noqa: E402

from heterospec import ops  # noqa: E402

CPU = torch.device("cpu")


def _small(seed, **kw):
    shape = dict(Vd=400, V=2000, k=4, depth=4, n=20, layers=2, S=128, seed=seed)
    shape.update(kw)
    x = bench.make_inputs(torch, CPU, **shape)
    state = bench.make_state(torch, CPU)
    state["slots"] = torch.tensor([0, 2, 5])
    return x, state


@pytest.mark.parametrize("seed", range(4))
def test_torch_baseline_builds_the_same_tree_and_accepts_the_same(seed):
    x, state = _small(seed)
    planted = bench.plant_accepts(ops, torch, x, state, accept=3)
    assert planted >= 1
    leaves, accept = bench.cross_check(ops, torch, x, state)
    assert accept == planted
    assert 1 <= leaves <= x["n"]


def test_the_benchmark_shape_agrees_on_cpu():
    """Issue 7's shape (k=10, depth 7, n=59, Vd=32000, V=128256) with one KV layer: the same tree."""
    x = bench.make_inputs(torch, CPU, layers=1, S=600)
    state = bench.make_state(torch, CPU)
    planted = bench.plant_accepts(ops, torch, x, state)
    assert bench.cross_check(ops, torch, x, state)[1] == planted


class _Skewed:
    """heterospec.ops, except build_tree reports a different token at one node."""

    def __getattr__(self, name):
        return getattr(ops, name)

    def build_tree(self, *a, **kw):
        tree, leaves, depth = ops.build_tree(*a, **kw)
        tree.tokens[3] += 1
        return tree, leaves, depth


def test_cross_check_fires_when_the_variants_disagree():
    x, state = _small(0)
    with pytest.raises(AssertionError, match="tree tokens differ"):
        bench.cross_check(_Skewed(), torch, x, state)


# --- --per-op (issue 17): the bytes formulas, the floor and the table, on the CPU ----------------------------


def test_per_op_bytes_of_the_default_shape_by_hand():
    """Issue 7's shape: Vd=32000, V=128256 bf16 target, k=10, depth 7, n=59 (T=60 tree nodes, M=710
    candidates), 32 layers of [1, 8, S, 128] bf16 keys and values, slots [0, 3, 9, 27, 44] (4 rows move)."""
    b = bench.per_op_bytes()
    assert list(b) == list(bench.PER_OPS)
    assert b["topk_entropy"] == 10 * 32000 * 4 + 10 * 4 == 1_280_040
    # logits + scores/nodes + d2t gathers + tokens/scores/parents + entropy + next beams
    assert b["expand root"] == 32000 * 4 + (4 + 8) + 10 * 8 + 10 * 20 + 4 + 10 * 8 == 128_376
    assert b["expand level"] == 10 * 32000 * 4 + 10 * 12 + 100 * 8 + 100 * 20 + 10 * 4 + 10 * 8 == 1_283_040
    assert b["select"] == 710 * 4 + 59 * 8 == 3_312
    # 3 x int64[59] read; tokens/parents/depths int64[60], mask bool[60, 60], retrieve int64[60, 60], 2 counts
    assert b["build_tree"] == 3 * 59 * 8 + 3 * 60 * 8 + 3600 + 3600 * 8 + 16 == 35_272
    logits = 60 * 128256 * 2
    assert logits == 15_390_720
    assert b["verify_greedy"] == logits + 2 * 60 * 8 + 60 * 8 + 16 == 15_392_176
    assert b["verify_sample"] == logits + 2 * 60 * 8 + 8 + 60 * 8 + 24 + 8 == 15_392_200
    assert b["verify_sample min-p"] == b["verify_sample"]
    kv = 4 * 64 * 8 * 128 * 2  # 4 rows x 64 tensors x 8 heads x 128 x bf16
    assert 2 * kv + 5 * 8 == 1_048_616  # read + written, + the slots
    assert b["kv_compact stacked"] == b["kv_compact list"] == 1_048_616


def test_per_op_shape_reads_the_benchmark_inputs():
    x = bench.make_inputs(torch, CPU, layers=1, S=600)
    state = bench.make_state(torch, CPU)
    shape = bench.per_op_shape(x, state["slots"].tolist())
    assert shape == dict(Vd=32000, V=128256, k=10, depth=7, n=59, layers=1, heads=8, head_dim=128, moved_rows=4,
                         slots=5, logit_bytes=2, kv_bytes=2)
    assert bench.per_op_bytes(**dict(shape, layers=32)) == bench.per_op_bytes()


def test_floor_is_bytes_over_bandwidth_but_never_under_5us():
    # 15,392,176 bytes at 3,000 GB/s: 15,392,176 / 3e12 s = 5.130725 us > 5
    assert bench.floor_us(15_392_176, 3000.0) == pytest.approx(15_392_176 / 3e12 * 1e6)
    assert bench.floor_us(15_392_176, 3000.0) == pytest.approx(5.130725, rel=1e-6)
    assert bench.floor_us(35_272, 3000.0) == 5.0  # 0.012 us of bytes: the 5 us minimum
    assert bench.floor_us(10**9, 1000.0) == pytest.approx(1000.0)  # 1 GB at 1 TB/s: 1 ms


def _timings(us):
    return {op: dict(eager=dict(median_us=2 * us, p10_us=1.5 * us, p90_us=3 * us),
                     graph=dict(median_us=us, p10_us=us, p90_us=us)) for op in bench.PER_OPS}


def test_per_op_rows_and_markdown_have_one_row_per_op():
    nbytes = bench.per_op_bytes()
    rows = bench.per_op_rows(nbytes, _timings(10.0), 2000.0)
    assert [r["op"] for r in rows] == list(bench.PER_OPS)
    v = rows[bench.PER_OPS.index("verify_greedy")]
    assert v["floor_us"] == pytest.approx(max(15_392_176 / 2e12 * 1e6, 5.0))  # 7.696 us
    assert v["achieved_GBs"] == pytest.approx(15_392_176 / 10e-6 / 1e9)
    assert v["graph_over_floor"] == pytest.approx(10.0 / (15_392_176 / 2e12 * 1e6))
    s = rows[bench.PER_OPS.index("select")]
    assert s["floor_us"] == 5.0 and s["graph_over_floor"] == pytest.approx(2.0)
    assert s["eager_median_us"] == 20.0 and s["eager_p10_us"] == 15.0 and s["eager_p90_us"] == 30.0
    md = bench.per_op_markdown(rows, "NVIDIA H100 80GB HBM3", 2000.0, 200)
    assert "NVIDIA H100 80GB HBM3" in md and "2000 GB/s" in md
    lines = md.splitlines()
    sep = lines.index("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    body = lines[sep + 1:]
    assert len(body) == len(bench.PER_OPS) == 10
    assert [line.split(" | ")[0] for line in body] == ["| " + op for op in bench.PER_OPS]
    assert all(line.count("|") == lines[sep].count("|") for line in body)


def test_per_op_calls_run_every_op_on_the_cpu():
    """The calls --per-op times, at a small shape on the CPU: every op runs on the cycle's own inputs, and
    the stacked (KVTensors) and the list kv_compact move the same rows."""
    x, state = _small(0)
    stacked = torch.stack(x["kv"])
    before = stacked.clone()
    calls = bench.per_op_calls(ops, torch, x, state, stacked)
    assert tuple(calls) == bench.PER_OPS
    for op, fn in calls.items():
        fn()
    p = x["prefix"]
    expected = before.clone()
    for i, s in enumerate(state["slots"].tolist()):  # [0, 2, 5]: rows p+2 and p+5 move to p+1 and p+2
        expected[..., p + i, :] = before[..., p + s, :]
    assert not torch.equal(expected, before)
    assert torch.equal(stacked, expected)
    assert torch.equal(torch.stack(x["kv"]), expected)


class _NoCheck:
    """heterospec.ops with cuda_check a no-op (the CPU has no device to check)."""

    def __getattr__(self, name):
        return getattr(ops, name)

    def cuda_check(self, *a, **kw):
        pass


def test_run_per_op_flow_on_the_cpu_with_fake_timers(monkeypatch):
    """run_per_op end to end on the CPU, CUDA events, graph capture and the copy measured replaced by fakes
    that still call each op: one JSON-serialisable row per op, the bytes of per_op_bytes for this shape."""
    import json

    calls = []

    def fake_timeit(torch_, fn, iters, warmup=20):
        fn()
        calls.append(fn)
        return dict(median_us=8.0, p10_us=7.0, p90_us=9.0)

    class FakeGraph:
        def __init__(self, fn):
            self.replay = fn

    monkeypatch.setattr(bench, "timeit", fake_timeit)
    monkeypatch.setattr(bench, "capture", lambda torch_, fn: FakeGraph(fn))
    monkeypatch.setattr(bench, "copy_bandwidth", lambda torch_, dev: dict(GBs=1000.0))
    x, state = _small(1)
    out = bench.run_per_op(_NoCheck(), torch, x, state, CPU, 3)
    json.dumps(out)
    assert len(calls) == 2 * len(bench.PER_OPS)
    assert [r["op"] for r in out["rows"]] == list(bench.PER_OPS)
    nbytes = bench.per_op_bytes(**bench.per_op_shape(x, [0, 2, 5]))
    assert [r["bytes"] for r in out["rows"]] == list(nbytes.values())
    assert nbytes["expand root"] == 400 * 4 + 12 + 4 * 8 + 4 * 20 + 4 + 4 * 8  # Vd=400, k=4
    md = bench.per_op_markdown(out["rows"], "cpu", 1000.0, 3)
    assert len([line for line in md.splitlines() if line.startswith("| ") and "---" not in line]) == 1 + len(bench.PER_OPS)


def test_the_kernel_probe_peaked_rows_hold_almost_all_the_mass():
    """benchmarks/probe_cuda_kernels.py times verify_sample on 'peaked' rows, said to put > 99.9 % of each row's
    mass on one token (a nucleus of one, unlike the bench's flat rows): checked at the bench's own shape."""
    from benchmarks import probe_cuda_kernels as probe

    x = bench.make_inputs(torch, CPU, Vd=64, V=128256, k=2, depth=1, n=7, layers=1, S=8)
    flat = x["target"]
    peaked = probe.peaked_rows(torch, flat)
    p_flat = torch.softmax(flat.float(), -1).max(-1).values
    p_peak = torch.softmax(peaked.float(), -1).max(-1).values
    assert p_peak.min().item() > 0.999 and p_flat.max().item() < 0.5
    assert torch.equal(probe.peaked_rows(torch, flat), peaked)     # the same tokens for a seed
