"""benchmarks/probe_cuda_kernels.py's sweeps (the fourth window's questions) on the CPU: the level-0 bin count
against hand-computed keys, the shifted rows' softmax, the chunk counts, and the sweeps' calls into the ops
with the GPU-only timing stubbed (so the next window does not spend its minutes on a wrong argument)."""
import pytest

torch = pytest.importorskip("torch")

import heterospec  # noqa: E402
from benchmarks import probe_cuda_kernels as probe  # noqa: E402
from benchmarks.bench_cuda_cycle import make_inputs, make_state  # noqa: E402
from heterospec import ops  # noqa: E402


def test_key_bins_counts_the_top_8_bits_of_the_order_preserving_key():
    # float32 bits: 1.0 = 0x3F800000 and 1.5 = 0x3FC00000 -> keys 0xBF8.., 0xBFC.. (bin 0xBF = 191); 3.0 =
    # 0x40400000 -> bin 0xC0; -1.0 = 0xBF800000 -> key ~u = 0x407FFFFF (bin 0x40); +0 and -0 -> 0x80000000 (bin 128)
    bins, largest = probe.key_bins(torch, torch.tensor([[1.0, 1.5, -1.0, 0.0, -0.0, 3.0]]))
    assert bins == 4.0 and largest == pytest.approx(2 / 6)
    # two rows: the means over rows
    bins, largest = probe.key_bins(torch, torch.tensor([[1.0, 1.5], [1.0, -1.0]]))
    assert bins == 1.5 and largest == pytest.approx(0.75)


def test_the_wide_cases_keep_the_softmax_and_narrow_the_bins():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 4096, generator=g) * 3
    seen = []
    for dtype, shift in probe.WIDE_CASES:
        x = (base + shift).to(getattr(torch, dtype))
        if dtype == "float32":   # a shift leaves the softmax (so the nucleus and the work) as it is, up to
            # float32's rounding of the shifted values (a step of 6e-5 at 1,000)
            assert torch.allclose(torch.softmax(x.double(), -1), torch.softmax(base.double(), -1), rtol=2e-4, atol=0)
            seen.append(probe.key_bins(torch, x)[0])
    assert seen[0] > 10 and seen[-1] == 1.0 and seen == sorted(seen, reverse=True), seen


def test_the_merge_vocabularies_give_1_to_32_chunks_a_row_on_a_gpu():
    if heterospec.build_info().get("cuda_emulated"):
        pytest.skip("the emulated build cuts rows into smaller chunks (HS_CHUNK_MIN 256)")
    assert [probe.chunks_per_row(10, v) for v in probe.MERGE_VOCABS] == [1, 4, 16, 32]


class _Graph:
    def __init__(self, fn):
        self.replay = fn


def test_the_sweeps_call_the_ops_with_arguments_they_accept(monkeypatch):
    calls = []

    def fake_timeit(torch_, fn, iters):
        fn()   # the op really runs (on the CPU core)
        calls.append(iters)
        return {"median_us": 1.0}

    monkeypatch.setattr(probe, "capture", lambda torch_, fn: _Graph(fn))
    monkeypatch.setattr(probe, "timeit", fake_timeit)
    monkeypatch.setattr(probe, "kernel_table", lambda torch_, fn, reps=5: {"k": (1.0, 2.0)})
    def fake_launches(torch_, fn, match):
        fn()
        return [1.0] * 4

    monkeypatch.setattr(probe, "launches", fake_launches)
    monkeypatch.setattr(ops, "cuda_check", lambda dev: None)
    dev = torch.device("cpu")
    rows = probe.merge_sweep(ops, torch, dev, iters=3)
    assert [(r["op"], r["Vd"]) for r in rows] == [(op, v) for v in probe.MERGE_VOCABS for op in ("topk_entropy", "expand")]
    assert all(r["graph_median_us"] == 1.0 and r["chunks"] >= 1 for r in rows)
    x = make_inputs(torch, dev, Vd=1024, V=4096)
    tokens, parents = probe.draft_tree(ops, torch, x, make_state(torch, dev))
    assert tokens.shape == (x["n"] + 1,) and parents.shape == (x["n"] + 1,)
    wide = probe.wide_sweep(ops, torch, dev, tokens, parents, 4096, iters=3)
    assert [(r["dtype"], r["shift"]) for r in wide] == list(probe.WIDE_CASES)
    assert [r["bins"] for r in wide][-1] == 1.0 and all(len(r["wide_level_us"]) == 4 for r in wide)
    assert calls == [3] * (len(rows) + len(wide))
