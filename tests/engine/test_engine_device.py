"""The engine's device discipline, checked without a GPU (issue 15):

- under ``torch.set_default_device("meta")`` with models and inputs placed on the CPU explicitly, any tensor
  the engine creates without naming its device lands on meta and fails, so the output can only be right if
  every tensor is made where it belongs;
- inside a cycle no tensor reaches the host except at the two declared sync points ("bin", "accepted");
- the commit hands ``kv_compact`` the accepted path and the prefix length as tensors on the caches' device
  (crash 1 of the issue: a host path with CUDA caches);
- trees padded to buckets decode exactly as unpadded ones (greedy and sampled, same seed);
- bad input (cache size, device, dtype, a CUDA target on a CPU-only core) fails before decoding."""
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import OracleDraft  # noqa: E402
from _models import THRESHOLDS, eagle3_head, prompts, reference_greedy, tiny_target  # noqa: E402

import heterospec  # noqa: E402
from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.engine import sync  # noqa: E402
from heterospec.models import cpu_gemm  # noqa: E402

NEW = 24


def _policies():
    return {
        "ar": Policy.autoregressive(),
        "eagle3": Policy.static(depth=3, top_k=3, total_tokens=12),
        "heterospec": Policy.paper(3, 3, 12, thresholds=THRESHOLDS),
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tiny_target("llama")
    head = eagle3_head(model, tmp_path_factory.mktemp("head"))
    return model, head


@pytest.mark.parametrize("name", ["ar", "eagle3", "heterospec"])
@pytest.mark.parametrize("draft_kind", ["eagle3-head", "oracle"])
def test_engine_under_meta_default_device(pair, name, draft_kind, tmp_path, monkeypatch):
    model, head = pair
    # nothing measured yet (a fresh machine): the CPU matrix path's timing runs under the meta default too (it
    # once made its inputs there, and passed only where an earlier test in the process had measured the shapes)
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_gemm, "_CHOICES", {})
    draft = head if draft_kind == "eagle3-head" else OracleDraft(model)
    ps = prompts(3)
    want = [reference_greedy(model, p, NEW)[0].tolist() for p in ps]
    torch.set_default_device("meta")
    try:
        with HeteroSpec(model, draft, _policies()[name], cuda_graphs=False) as hs:
            got = [hs.generate(p, max_new_tokens=NEW)[0][0].tolist() for p in ps]
        # sampling too: its first token and the per-cycle draws take other paths
        with HeteroSpec(model, draft, _policies()[name], cuda_graphs=False) as hs:
            seq, _ = hs.generate(ps[0], max_new_tokens=8, temperature=0.8, top_k=20, seed=3)
    finally:
        torch.set_default_device(None)
    assert got == want
    assert seq.device.type == "cpu" and seq.shape[1] == ps[0].shape[1] + 8


def test_meta_default_device_catches_a_tensor_made_without_a_device():
    """The trap itself works: a tensor created without a device is a meta tensor, and using it with CPU
    data fails."""
    torch.set_default_device("meta")
    try:
        with pytest.raises((RuntimeError, NotImplementedError, ValueError)):
            (torch.zeros(3) + torch.zeros(3, device="cpu")).tolist()
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("name", ["ar", "eagle3", "heterospec"])
def test_no_host_transfer_inside_the_cycle(pair, name):
    model, head = pair
    p = prompts(2)[1]
    want = reference_greedy(model, p, NEW)[0].tolist()
    record = []
    with HeteroSpec(model, head, _policies()[name], cuda_graphs=False) as hs, sync.forbid_host_transfers(record):
        seq, stats = hs.generate(p, max_new_tokens=NEW)
        sseq, sstats = hs.generate(p, max_new_tokens=NEW, temperature=1.0, seed=5)
    assert seq[0].tolist() == want
    cycles = stats.cycles + sstats.cycles
    assert record.count("accepted") == cycles
    # "bin" only for policies with bins, once per cycle, always before that cycle's "accepted"
    bins = record.count("bin")
    assert bins == (cycles if name == "heterospec" else 0)
    if bins:
        assert record[0::2] == ["bin"] * cycles and record[1::2] == ["accepted"] * cycles


def test_the_host_transfer_guard_fires(pair, monkeypatch):
    """A host read planted inside the cycle (in the tree selection) is caught."""
    model, head = pair
    from heterospec.engine import tree

    real = tree.ops.select

    def leaky_select(scores, n, **kw):
        scores.max().item()
        return real(scores, n, **kw)

    monkeypatch.setattr(tree.ops, "select", leaky_select)
    p = prompts(1)[0]
    with HeteroSpec(model, head, _policies()["eagle3"], cuda_graphs=False) as hs, sync.forbid_host_transfers():
        with pytest.raises(AssertionError, match=r"host transfer Tensor.item\(\) inside the decoding cycle"):
            hs.generate(p, max_new_tokens=8)


def test_processors_read_the_host_at_their_declared_point_only(pair):
    """With logits processors the cycle reads the host at the declared "processors" point (the draft's expansions
    before "bin" and after it, the target's tree after the forward) besides "bin" and "accepted", nowhere else."""
    model, head = pair
    p = prompts(2)[1]
    record = []
    procs = [transformers.RepetitionPenaltyLogitsProcessor(1.5), transformers.NoRepeatNGramLogitsProcessor(3)]
    with HeteroSpec(model, head, _policies()["heterospec"], cuda_graphs=False) as hs, \
            sync.forbid_host_transfers(record):
        _, stats = hs.generate(p, max_new_tokens=NEW, logits_processor=procs)
    cycles, c = [], []
    for name in record:
        c.append(name)
        if name == "accepted":
            cycles.append(c)
            c = []
    assert not c and len(cycles) == stats.cycles
    for c in cycles:   # the root expansion (and base levels) processed, bin, extra levels, the tree, accepted
        assert c.count("bin") == 1 and c[0] == "processors" and c[-2:] == ["processors", "accepted"]
        assert set(c) == {"bin", "processors", "accepted"}
    # a repetition penalty alone runs on the device: the cycle's own points only, as without processors
    record.clear()
    with HeteroSpec(model, head, _policies()["heterospec"], cuda_graphs=False) as hs, \
            sync.forbid_host_transfers(record):
        _, stats = hs.generate(p, max_new_tokens=NEW, logits_processor=procs[:1])
    assert record == ["bin", "accepted"] * stats.cycles


def test_commit_gets_the_path_and_prefix_on_the_caches_device(pair, monkeypatch):
    """Crash 1 of issue 15: the commit passed a host (NumPy) path to kv_compact while the caches were on the
    GPU.  The path and the prefix length must be tensors on the caches' device, never host arrays."""
    model, head = pair
    from heterospec.models import target as target_mod

    real = target_mod.ops.kv_compact
    seen = []

    def spy(tensors, prefix_len, slots, **kw):
        kv = tensors.tensors[0] if hasattr(tensors, "tensors") else tensors[0]
        seen.append((type(slots), getattr(slots, "device", None), type(prefix_len), getattr(prefix_len, "device", None),
                     kv.device))
        return real(tensors, prefix_len, slots, **kw)

    monkeypatch.setattr(target_mod.ops, "kv_compact", spy)
    with HeteroSpec(model, head, _policies()["eagle3"], cuda_graphs=False) as hs:
        hs.generate(prompts(1)[0], max_new_tokens=NEW)
    assert seen
    for slots_t, slots_dev, prefix_t, prefix_dev, kv_dev in seen:
        assert slots_t is torch.Tensor and prefix_t is torch.Tensor
        assert slots_dev == kv_dev and prefix_dev == kv_dev


@pytest.mark.parametrize("name", ["eagle3", "heterospec"])
def test_padded_buckets_decode_exactly_as_unpadded_trees(pair, name):
    """Padding nodes are never accepted and draw no randomness: greedy and sampled outputs (same seed) are
    identical with and without buckets, and so are the statistics (padding is not counted as verified)."""
    model, head = pair
    pol = _policies()[name]
    for p in prompts(3, seed=7):
        with HeteroSpec(model, head, pol, buckets=None, cuda_graphs=False) as a, \
                HeteroSpec(model, head, pol, buckets=(2, 7, 16, 64), cuda_graphs=False) as b:
            for kw in ({}, {"temperature": 1.0, "top_p": 0.9, "seed": 11}):
                sa, ta = a.generate(p, max_new_tokens=NEW, **kw)
                sb, tb = b.generate(p, max_new_tokens=NEW, **kw)
                assert sa.tolist() == sb.tolist()
                assert (ta.cycles, ta.verified_tokens, ta.accepted_hist) == (tb.cycles, tb.verified_tokens,
                                                                             tb.accepted_hist)


def test_a_tree_padded_past_a_real_match_is_still_exact(pair):
    """The oracle draft's trees are accepted deeply; with a bucket far above the tree size most rows are
    padding: output still equals HF greedy."""
    model, _ = pair
    p = prompts(1, seed=9)[0]
    want = reference_greedy(model, p, NEW)[0].tolist()
    with HeteroSpec(model, OracleDraft(model), Policy.static(3, 3, 8), buckets=(64,), cuda_graphs=False) as hs:
        seq, stats = hs.generate(p, max_new_tokens=NEW)
    assert seq[0].tolist() == want
    assert stats.tau > 1.5


def test_static_cache_too_small_is_a_clear_error_before_decoding(pair):
    model, head = pair
    with HeteroSpec(model, head, _policies()["eagle3"], max_length=20, cuda_graphs=False) as hs:
        with pytest.raises(ValueError, match=r"generate: prompt \(15\) \+ max_new_tokens \(10\) = 25 exceed the "
                                             r"static caches' max_length \(20\)"):
            hs.generate(torch.zeros((1, 15), dtype=torch.long), max_new_tokens=10)
        seq, _ = hs.generate(torch.zeros((1, 10), dtype=torch.long), max_new_tokens=10)  # fits
        assert seq.shape == (1, 20)


def test_draft_on_another_dtype_or_device_is_refused(pair):
    model, head = pair
    with pytest.raises(ValueError, match=r"HeteroSpec: argument 'draft' expected the target's dtype torch.float32, "
                                         r"got torch.float64"):
        HeteroSpec(model, head.to(torch.float64), cuda_graphs=False)
    head.to(torch.float32)
    meta_head = types.SimpleNamespace(parameters=lambda: iter([torch.zeros(1, device="meta")]), dtype=torch.float32)
    device = next(model.parameters()).device      # cpu here, cuda:0 in .ci/gpu's engine phase
    with pytest.raises(ValueError, match=rf"HeteroSpec: argument 'draft' expected the target's device {device}, "
                                         r"got meta"):
        HeteroSpec(model, meta_head, cuda_graphs=False)


def test_cuda_target_with_a_cpu_only_core_is_refused(monkeypatch):
    fake = types.SimpleNamespace(device=torch.device("cuda:0"), dtype=torch.float32)
    target = types.SimpleNamespace(parameters=lambda: iter([fake]))
    monkeypatch.setattr(heterospec, "build_info", lambda: {"cuda": False})
    with pytest.raises(ValueError, match=r"HeteroSpec: argument 'target' is on cuda:0, but heterospec's C core was "
                                         r"built without CUDA"):
        HeteroSpec(target, cuda_graphs=False)


@pytest.mark.parametrize("bad", ["big", (4, 2), (0, 8), 3])
def test_bad_buckets(pair, bad):
    model, head = pair
    with pytest.raises(ValueError, match="HeteroSpec: argument 'buckets' expected"):
        HeteroSpec(model, head, buckets=bad, cuda_graphs=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_eager_attention_target(arch, tmp_path):
    """The static cache and the 4D tree mask work with eager attention too (not only sdpa)."""
    model = tiny_target(arch)
    model.set_attn_implementation("eager")
    head = eagle3_head(model, tmp_path)
    for p in prompts(2, seed=4):
        want = reference_greedy(model, p, NEW)[0].tolist()
        with HeteroSpec(model, head, _policies()["heterospec"], cuda_graphs=False) as hs:
            assert hs.generate(p, max_new_tokens=NEW)[0][0].tolist() == want
