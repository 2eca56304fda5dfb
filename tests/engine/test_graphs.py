"""The recorded-step engine (issue 16: one CUDA graph per tree shape) against the eager engine.

On the CPU, ``cuda_graphs="emulate"`` runs the recorded-step plumbing without graphs: every cross-step
value in a static tensor, each step recorded once per shape and "replayed" by running it again and copying
its outputs into the recorded ones.  With ``HETEROSPEC_TEST_DEVICE=cuda`` (``.ci/gpu``) the same tests run
real CUDA graphs (``cuda_graphs=True``).  Either way the recorded engine must give the eager engine's output
token for token (greedy) and draw for draw (sampling, same seed: the Philox offset lives in a device tensor
the kernel advances), with the same per-cycle statistics."""
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _doubles import NoisyDraft, ScriptDraft  # noqa: E402
from _models import THRESHOLDS, V, eagle3_head, prompts, reference_greedy, tiny_target  # noqa: E402

from heterospec import HeteroSpec, Policy, build_info  # noqa: E402
from heterospec.engine import sync  # noqa: E402
from heterospec.engine.graphs import StepGraphs, tensors_of  # noqa: E402
from heterospec.engine.loop import GPU_BUCKETS  # noqa: E402
from heterospec.engine.tree import bucket_for  # noqa: E402
from heterospec.growth import candidate_count  # noqa: E402

DEVICE = torch.device(os.environ.get("HETEROSPEC_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not (torch.cuda.is_available() and build_info()["cuda"]):
    pytest.skip("HETEROSPEC_TEST_DEVICE=cuda needs a GPU and a CUDA build of the core", allow_module_level=True)
MODE = True if DEVICE.type == "cuda" else "emulate"
NEW = 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_target("llama")
    ps = prompts(4)
    refs = [reference_greedy(model, p, NEW) for p in ps]
    head = eagle3_head(model, tmp_path_factory.mktemp("head"))
    return model, ps, refs, head


def _method(name, model, head):
    return {
        "ar": (None, None),
        "eagle3-script": (ScriptDraft(V).to(DEVICE), Policy.static(4, 3, 12)),
        "heterospec-script": (ScriptDraft(V).to(DEVICE), Policy.paper(3, 3, 12, THRESHOLDS)),
        "eagle3-noisy": (NoisyDraft(32, V).to(DEVICE), Policy.static(3, 3, 10)),
        "heterospec-head": (head, Policy.paper(4, 3, 16, THRESHOLDS)),
        # binned on the root expansion's entropy alone, a bin growing two levels past it
        "heterospec-depth0-script": (ScriptDraft(V).to(DEVICE), Policy(0, 3, 12, (0.5, 1.0), (2, 1, 0), (8, 12, 6))),
    }[name]


def _run(hs, draft, ps, refs, **kw):
    out = []
    for p, ref in zip(ps, refs):
        if isinstance(draft, ScriptDraft):
            draft.load(ref[0])
        seq, st = hs.generate(p, max_new_tokens=NEW, **kw)
        out.append((seq[0].tolist(), st.cycles, st.verified_tokens, dict(st.accepted_hist), dict(st.bins)))
    return out


METHODS = ["ar", "eagle3-script", "heterospec-script", "eagle3-noisy", "heterospec-head", "heterospec-depth0-script"]


@pytest.mark.parametrize("buckets", ["auto", GPU_BUCKETS])
@pytest.mark.parametrize("name", METHODS)
def test_recorded_steps_equal_the_eager_engine_greedy(setup, name, buckets):
    model, ps, refs, head = setup
    draft, policy = _method(name, model, head)
    with HeteroSpec(model, draft, policy, buckets=buckets) as hs:
        eager = _run(hs, draft, ps, refs)
    with HeteroSpec(model, draft, policy, buckets=buckets, cuda_graphs=MODE) as hs:
        recorded = _run(hs, draft, ps, refs)
    for (seq, *_), ref in zip(recorded, refs):
        assert seq == ref[0].tolist(), f"{name}: recorded engine differs from target.generate"
    assert recorded == eager, f"{name}: cycles, verified tokens, acceptance or bins differ from the eager engine"
    if name.endswith("script"):
        taus = [(len(s) - len(p[0])) / c for (s, c, *_), p in zip(recorded, ps)]
        assert min(taus) > 2.0, taus      # multi-token commits really happened


@pytest.mark.parametrize("warp", ["top-k-p", "min-p"])
@pytest.mark.parametrize("name", ["ar", "eagle3-script", "heterospec-head"])
def test_recorded_steps_equal_the_eager_engine_sampling(setup, name, warp):
    """Draw for draw, with HuggingFace's top-k and top-p (the acceptance's own) or with min-p after top-p (the
    warpers on the device before it, recorded inside the step)."""
    model, ps, refs, head = setup
    draft, policy = _method(name, model, head)
    kw = dict(temperature=0.9, top_k=20, top_p=0.95) if warp == "top-k-p" else dict(temperature=1.3, top_p=0.95,
                                                                                     min_p=0.15)
    runs = {}
    for mode in (False, MODE):
        with HeteroSpec(model, draft, policy, cuda_graphs=mode) as hs:
            runs[mode] = [_run(hs, draft, ps[i:i + 1], refs[i:i + 1], seed=100 + i, **kw) for i in range(3)]
    assert runs[MODE] == runs[False]
    # and the seed matters (the offset tensor is not stuck)
    with HeteroSpec(model, draft, policy, cuda_graphs=MODE) as hs:
        other = _run(hs, draft, ps[:1], refs[:1], seed=7, **kw)
    assert other[0][0] != runs[MODE][0][0][0]


LOOKUP = dict(prompt_lookup_num_tokens=5, max_matching_ngram_size=3)


@pytest.mark.parametrize("buckets", ["auto", GPU_BUCKETS])
@pytest.mark.parametrize("name", ["ar", "eagle3-noisy", "heterospec-head"])
def test_recorded_steps_with_prompt_lookup_equal_the_eager_engine(setup, name, buckets):
    """Prompt lookup in recorded steps: the chains grafted on the device inside the recording (trees padded for a
    whole chain) give the eager engine's output and statistics, which equal HF's greedy; the chains were used."""
    model, ps, refs, head = setup
    draft, policy = _method(name, model, head)
    with HeteroSpec(model, draft, policy, buckets=buckets) as hs:
        eager = _run(hs, draft, ps, refs, **LOOKUP)
        plain = _run(hs, draft, ps, refs)
    with HeteroSpec(model, draft, policy, buckets=buckets, cuda_graphs=MODE) as hs:
        recorded = _run(hs, draft, ps, refs, **LOOKUP)
        (key,) = hs.cycle._recorded
        assert key[1] == 5                      # recorded once, for chains of 5
        assert hs.cycle._recorded[key].captured[-1][-1] >= 5 + 1   # every tree has room for a whole chain
    for (seq, *_), ref in zip(recorded, refs):
        assert seq == ref[0].tolist(), f"{name}: recorded engine with lookup differs from target.generate"
    assert recorded == eager, f"{name}: cycles, verified tokens, acceptance or bins differ from the eager engine"
    assert sum(r[1] for r in recorded) < sum(r[1] for r in plain)    # fewer cycles: chains were accepted


def test_recorded_steps_with_prompt_lookup_draw_as_the_eager_engine(setup):
    model, ps, refs, head = setup
    draft, policy = _method("heterospec-head", model, head)
    kw = dict(temperature=0.9, top_k=20, top_p=0.95, **LOOKUP)
    runs = {}
    for mode in (False, MODE):
        with HeteroSpec(model, draft, policy, cuda_graphs=mode) as hs:
            runs[mode] = [_run(hs, draft, ps[i:i + 1], refs[i:i + 1], seed=100 + i, **kw) for i in range(3)]
    assert runs[MODE] == runs[False]


@pytest.mark.parametrize("name", ["ar", "heterospec-head"])
def test_recorded_steps_keep_the_eager_engines_logits(setup, name):
    """generate(output_logits=True) in recorded steps: the path rows' gather inside the recording, each cycle's rows
    copied out before the next replay rewrites them; the same logits as the eager engine (alone and in a batch)."""
    model, ps, refs, head = setup
    draft, policy = _method(name, model, head)
    runs = {}
    for mode in (False, MODE):
        with HeteroSpec(model, draft, policy, cuda_graphs=mode) as hs:
            alone = [hs.generate(p, max_new_tokens=NEW, output_logits=True) for p in ps[:2]]
            outs, st = hs.generate([p[0] for p in ps[:3]], max_new_tokens=NEW, output_logits=True)
            runs[mode] = ([(seq.tolist(), s.logits.cpu()) for seq, s in alone],
                          [(o.tolist(), r.logits.cpu()) for o, r in zip(outs, st.per_row)], st.graphs)
    assert runs[MODE][2] == ("cuda" if MODE is True else "emulate")
    for (a_seq, a_lg), (b_seq, b_lg) in zip(runs[False][0] + runs[False][1], runs[MODE][0] + runs[MODE][1]):
        assert a_seq == b_seq and a_lg.shape == b_lg.shape == (NEW, V)
        assert torch.allclose(a_lg, b_lg, atol=1e-5)
    assert not torch.allclose(runs[MODE][0][0][1][0], runs[MODE][0][0][1][-1])   # steps differ (no stale rows)


def test_each_shape_is_recorded_once_and_reported_apart(setup):
    model, ps, refs, _ = setup
    draft = ScriptDraft(V).to(DEVICE)
    policy = Policy.paper(3, 3, 12, THRESHOLDS)
    with HeteroSpec(model, draft, policy, cuda_graphs=MODE, max_length=128) as hs:
        plans = hs.policy.plans()
        assert plans == sorted({(e, k) for e, k in zip(policy.extra, policy.keep)} | {(0, 12)})
        stats = []
        for p, ref in zip(ps, refs):
            draft.load(ref[0])
            stats.append(hs.generate(p, max_new_tokens=NEW)[1])
        (steps, _), = [(s, k) for k, s in hs.cycle._recorded.items()]
        # one recording per (extra levels, tree size): plans whose trees come out the same size share it
        shapes = sorted({(e, bucket_for(min(k - 1, candidate_count(3, 3 + e)) + 1, hs.buckets)) for e, k in plans})
        assert hs.cycle.shapes() == shapes and len(shapes) >= 3
        assert steps.captured == [("base",)] + [("finish",) + sh for sh in shapes]
        assert stats[0].capture_s > 0 and all(s.capture_s == 0 for s in stats[1:])
        assert all(s.captured_steps == 1 + len(shapes) for s in stats)
        assert all(s.graphs == ("cuda" if MODE is True else "emulate") for s in stats)
        assert steps.replays == sum(s.cycles * 2 for s in stats)   # base + finish per cycle
        # the prompt's prefill and the first tokens are outside the timed decoding, capture too
        assert all(s.total_s > 0 and s.graph_s > 0 for s in stats)
        # new sampling settings record a second set; the greedy set is kept
        hs.generate(ps[0], max_new_tokens=8, temperature=0.7, seed=1)
        assert len(hs.cycle._recorded) == 2


def test_static_policy_and_ar_are_one_step_per_cycle(setup):
    model, ps, refs, _ = setup
    draft = ScriptDraft(V).to(DEVICE).load(refs[0][0])
    for d, pol, key in [(draft, Policy.static(4, 3, 12), ("cycle", 0, 12)), (None, None, ("cycle", 0, 1))]:
        with HeteroSpec(model, d, pol, cuda_graphs=MODE) as hs:
            _, st = hs.generate(ps[0], max_new_tokens=NEW)
            (steps,) = hs.cycle._recorded.values()
            assert steps.captured == [key] and steps.replays == st.cycles


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the host-transfer guard patches torch.Tensor; CPU check")
@pytest.mark.parametrize("lookup", [0, 4])
@pytest.mark.parametrize("name, per_cycle", [("heterospec-script", ["bin", "accepted"]),
                                              ("heterospec-head", ["bin", "accepted"]),
                                              ("eagle3-script", ["accepted"]), ("ar", ["accepted"])])
def test_at_most_two_sync_points_per_recorded_cycle(setup, name, per_cycle, lookup):
    model, ps, refs, head = setup
    draft, policy = _method(name, model, head)
    if isinstance(draft, ScriptDraft):
        draft.load(refs[0][0])
    record = []
    with HeteroSpec(model, draft, policy, cuda_graphs=MODE) as hs:
        with sync.forbid_host_transfers(record):
            _, st = hs.generate(ps[0], max_new_tokens=NEW, prompt_lookup_num_tokens=lookup)
    assert record == per_cycle * st.cycles


def test_emulated_replay_writes_into_the_recorded_outputs():
    """What the emulation promises: a replay's values land in the tensors the capture returned (a later
    step that kept them reads the new values), and a step that changes its output structure is refused."""
    steps = StepGraphs(emulate=True)
    state = torch.zeros(2)
    out = steps.capture("a", lambda: (state + 1, [state * 2]))
    kept = tensors_of(out)
    state.fill_(5)
    again = steps.replay("a")
    assert again is out and tensors_of(again)[0] is kept[0]
    assert kept[0].tolist() == [6.0, 6.0] and kept[1].tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="already captured"):
        steps.capture("a", lambda: state)
    n = [1]
    steps.capture("b", lambda: tuple(state for _ in range(n[0])))
    n[0] = 2
    with pytest.raises(RuntimeError, match="returned 2 tensors, it captured 1"):
        steps.replay("b")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU argument checks")
def test_bad_cuda_graphs_switch(setup):
    model, *_ = setup
    with pytest.raises(ValueError, match=r"argument 'cuda_graphs' expected False on cpu .*got True"):
        HeteroSpec(model, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"argument 'cuda_graphs' expected True, False, 'auto' or 'emulate', got 'yes'"):
        HeteroSpec(model, cuda_graphs="yes")
    assert HeteroSpec(model, cuda_graphs="auto").cuda_graphs is False     # no graphs on the CPU


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU argument checks")
def test_cuda_graphs_default_is_auto_and_on_for_a_cuda_model(setup):
    """Issue 40.8: HeteroSpec records CUDA graphs by default where it can (a CUDA model, RoPE without host
    reads), and stays the eager engine on the CPU."""
    import inspect

    from heterospec.engine.loop import _check_graphs

    model, *_ = setup
    assert inspect.signature(HeteroSpec).parameters["cuda_graphs"].default == "auto"
    assert _check_graphs("auto", torch.device("cuda"), None) is True
    assert HeteroSpec(model).cuda_graphs is False


def test_compiled_target_forward_decodes_as_the_plain_one(setup):
    """``compile=``: the target's forward through torch.compile (here the 'eager' backend: dynamo's tracing of
    our cache, mask and tap hooks without code generation, so the CPU test stays quick; .ci/gpu runs inductor
    in the bench).  Taps feed the EAGLE-3 head, so equal statistics mean equal taps too."""
    model, ps, refs, head = setup
    policy = Policy.paper(4, 3, 16, THRESHOLDS)
    with HeteroSpec(model, head, policy) as hs:
        plain = _run(hs, head, ps[:2], refs[:2])
    with HeteroSpec(model, head, policy, cuda_graphs=MODE, compile="eager") as hs:
        compiled = _run(hs, head, ps[:2], refs[:2])
    assert compiled == plain
    with pytest.raises(ValueError, match="argument 'compile' expected a bool or a torch.compile backend name"):
        HeteroSpec(model, compile=3)


def test_a_compiled_target_is_compiled_once_per_tree_shape_not_per_attention_window(setup):
    """Issue 40.3: a compiled verify forward sees one shape per tree shape.  On the CPU the eager target attends
    over the used columns only, rounded to 64, and a compiled one recompiled at every new width: 9 graphs for
    the 3 shapes of this policy over 120 tokens.  With ``compile`` the whole cache is attended, as on a GPU, and
    the layers are compiled one region at a time: one compiled layer serves all 8 (a whole-model compilation,
    or one per layer, would be more graphs than that), and the user's layers are left as they were."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model, ps, refs, head = setup
    policy = Policy.paper(4, 3, 16, THRESHOLDS)
    torch._dynamo.reset()
    counters.clear()
    with HeteroSpec(model, head, policy, compile="eager") as hs:
        for p in ps[:3]:
            seq, _ = hs.generate(p, max_new_tokens=120)          # past two 64-column windows
        shapes = hs.cycle.shapes()
        assert all(layer._compiled_call_impl is None for layer in model.model.layers)   # between calls: as it was
    # one region per layer call (the cache write inside it, test below): no graph break, and at most one graph
    # per tree shape (dynamo makes the second shape dynamic), never one per layer
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= len(shapes) < len(model.model.layers), \
        (dict(counters["stats"]), shapes)
    torch._dynamo.reset()


@pytest.mark.skipif(DEVICE.type == "cuda", reason="reads inductor's C++ code for the CPU; one device suffices")
def test_a_compiled_layer_writes_its_cache_in_place_not_every_layers_cache():
    """Every layer's cache is a view of one storage, and a compiled layer's write into its view made inductor
    write the whole storage back at every layer's call: a kernel over all of it, every layer's keys and values
    (the default pair on a 2-core CPU: 3.5 tokens/s compiled against 9 eager).  Each layer's region now takes its
    own views as inputs (``StaticKV.layer``, bound outside the region): no generated kernel loops over the whole
    cache (found in the generated C++ by its loop bound, the cache's element count), and the tokens are the
    target's."""
    import re

    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    model = tiny_target("llama")
    p = prompts(1)[0]
    torch._dynamo.reset()
    with HeteroSpec(model, None, None, compile=True, max_length=200) as hs:
        (seq, _), codes = run_and_get_code(lambda: hs.generate(p, max_new_tokens=12))
        kv = hs.cycle.target.kv
    torch._dynamo.reset()
    assert codes, "inductor generated no code: the forward was not compiled"
    whole = re.compile(rf"(static_cast<int64_t>\({kv.numel()}L\)|numel = {kv.numel()}\b)")
    assert not [c for c in codes if whole.search(c)], \
        f"a generated kernel loops over the whole cache {tuple(kv.shape)}"
    assert seq[0].tolist() == reference_greedy(model, p, 12)[0].tolist()


def test_inductor_keeps_the_packed_cpu_linears_off(setup):
    """compile=True with the packed oneDNN linears died in inductor's lowering at the first verify forward on
    the CPU (mkldnn._linear_pointwise): under inductor the packed path is off, and asking for it is one line."""
    model = setup[0]
    assert HeteroSpec(model, compile=True).cpu_gemm == "off"
    with pytest.raises(ValueError, match=r"^HeteroSpec: argument 'cpu_gemm' expected False or 'auto' with "
                                         r"compile=True .*, got True$"):
        HeteroSpec(model, compile=True, cpu_gemm=True)
    with pytest.raises(ValueError, match=r"^HeteroSpec: argument 'cpu_gemm' expected False or 'auto' with "
                                         r"compile=True .*, got 'rows'$"):
        HeteroSpec(model, compile=True, cpu_gemm="rows")


def test_the_guard_sees_host_reads_inside_torch():
    """Indexing with a 0-d tensor, boolean masks and tensor repeats read device values inside torch's C++
    (a host sync on a GPU, an error in graph capture): forbid_host_transfers catches them on the CPU, and
    lets them pass at a declared sync point."""
    x = torch.arange(10.0)
    i = torch.tensor(3)
    with sync.forbid_host_transfers():
        for bad in (lambda: x[i], lambda: x[x > 4], lambda: x.repeat_interleave(torch.full((10,), 2))):
            with pytest.raises(AssertionError, match="host read inside torch"):
                bad()
        assert x.index_select(0, i.view(1)).shape == (1,) and x.repeat_interleave(2).shape == (20,)
        with sync.point("bin"):
            assert float(x[i]) == 3.0


def test_custom_generate_passes_the_switch(setup, monkeypatch):
    import heterospec
    from heterospec.engine import hf_generate

    model, ps, refs, head = setup
    replays = []

    class Spy(hf_generate.HeteroSpec):
        def generate(self, *a, **k):
            seq, st = super().generate(*a, **k)
            replays.append((self.cuda_graphs, st.captured_steps))
            return seq, st

    monkeypatch.setattr(hf_generate, "HeteroSpec", Spy)
    out = model.generate(ps[0], attention_mask=torch.ones_like(ps[0]), custom_generate=heterospec.custom_generate,
                         draft=head, policy=Policy.paper(4, 3, 16, THRESHOLDS), cuda_graphs=MODE,
                         max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert out.tolist() == refs[0].tolist()
    assert replays == [(MODE, 4)]   # base + three plans: (2, 7), (1, 11), (0, 16) = bin 2 and the rest


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU argument checks")
def test_a_dynamic_rope_draft_is_not_recorded(setup):
    """Dynamic RoPE reads the largest position on the host each step: refused with True, off with 'auto'."""
    model, *_ = setup
    draft = NoisyDraft(32, V)
    draft.config = type("C", (), {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})()
    with pytest.raises(ValueError, match=r"argument 'cuda_graphs' expected False for a draft with dynamic RoPE"):
        HeteroSpec(model, draft, Policy.static(3, 3, 8), cuda_graphs=True)
    assert HeteroSpec(model, draft, Policy.static(3, 3, 8), cuda_graphs="auto").cuda_graphs is False


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU argument checks")
@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_a_host_reading_rope_target_is_not_recorded(field):
    """The target's RoPE counts as much as the draft's: transformers' dynamic variant picks its frequencies from a
    host read of the largest position in every forward (rope_parameters in transformers 5, rope_scaling before; per
    layer type in some models).  LongRoPE, read where the rotary reads it: tests/engine/test_longrope.py."""
    model = tiny_target("llama")
    rope = "dynamic"
    spec = {"rope_type": rope, "factor": 2.0, "rope_theta": 10000.0}
    setattr(model.config, field, {"full_attention": spec} if field == "rope_parameters" else spec)
    draft = NoisyDraft(32, V)
    with pytest.raises(ValueError, match=rf"argument 'cuda_graphs' expected False for a target with {rope} RoPE"):
        HeteroSpec(model, draft, Policy.static(3, 3, 8), cuda_graphs=True)
    assert HeteroSpec(model, draft, Policy.static(3, 3, 8), cuda_graphs="auto").cuda_graphs is False


def test_recorded_sets_are_kept_for_the_latest_sampling_settings_only(setup):
    """Each sampling setting records its own steps (and, on a GPU, its own graph memory pool): a sweep over
    temperatures keeps the MAX_GRAPH_SETS most recently used and drops the rest, and a setting used again after
    being dropped is recorded again and draws what it drew the first time."""
    from heterospec.engine.cycle import MAX_GRAPH_SETS

    model, ps, refs, head = setup
    temps = [0.5 + 0.1 * i for i in range(MAX_GRAPH_SETS + 2)]
    with HeteroSpec(model, head, Policy.static(3, 3, 8), cuda_graphs=MODE, max_length=64) as hs:
        first = hs.generate(ps[0], max_new_tokens=8, temperature=temps[0], seed=3)[0].tolist()
        for t in temps[1:]:
            hs.generate(ps[0], max_new_tokens=8, temperature=t, seed=3)
            assert len(hs.cycle._recorded) <= MAX_GRAPH_SETS
        assert len(hs.cycle._recorded) == MAX_GRAPH_SETS
        kept = [settings[1] for settings, *_ in hs.cycle._recorded]
        assert kept == pytest.approx(temps[-MAX_GRAPH_SETS:])
        again, st = hs.generate(ps[0], max_new_tokens=8, temperature=temps[0], seed=3)
        assert again.tolist() == first
        assert st.capture_s > 0                            # dropped, so recorded again
        hit = temps[-MAX_GRAPH_SETS + 1]                   # kept and not the newest
        st = hs.generate(ps[0], max_new_tokens=8, temperature=hit, seed=3)[1]
        assert st.capture_s == 0.0                         # replayed, not recorded
        assert [s[1] for s, *_ in hs.cycle._recorded][-1] == pytest.approx(hit)   # a hit becomes the most recent


def test_captured_costs_need_a_gpu(setup):
    from heterospec.tune.costs import profile_costs

    model, *_ = setup
    if DEVICE.type == "cuda":
        cost = profile_costs(model, tree_tokens=(1, 4), contexts=(16,), reps=2, graphs=True)
        assert all(v == v for v in cost.verify)          # a finite fit from replayed forwards
    else:
        with pytest.raises(ValueError, match=r"profile_costs: argument 'graphs' expected False for a model on cpu"):
            profile_costs(model, tree_tokens=(1, 4), contexts=(16,), reps=1, graphs=True)


def test_the_graphs_benchmark_runs_its_forward_part(setup):
    """benchmarks/bench_graphs.py's forward table on the tiny target (eager and graph, the graph emulated on a
    CPU), so the script .ci/gpu runs cannot rot (the seventh GPU window found its graph column calling the
    recorder without its set of graphs, which the eager-only CPU run never reached)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(root, "benchmarks", "bench_graphs.py")):
        pytest.skip("benchmarks/ is not next to tests/")
    from benchmarks import bench_graphs

    model, *_ = setup
    cols = ("eager", "graph")
    table = bench_graphs.forward_table(torch, model, tokens=(1, 4), context=8, reps=2, columns=cols)
    assert set(table) == set(cols) and all(set(r) == {1, 4} and min(r.values()) > 0 for r in table.values())
    md = bench_graphs.markdown({"device_name": "d", "torch": "t", "transformers": "x", "target": "tiny",
                                "context": 8, "reps": 2, "max_new_tokens": 4, "prompts": 1,
                                "forward": {"float32": table}, "engine": {}})
    assert "| 4 | " in md


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the emulation's check (a real graph would silently read stale memory)")
def test_the_emulation_refuses_a_tensor_rebound_between_replays(setup):
    """A draft that loads its state by rebinding an attribute to a new tensor (instead of copy_ into the old
    one) would leave a recorded graph reading the old memory: the emulation raises at the first replay
    after the rebind, naming the fix.  The same draft updating in place decodes fine (the tests above)."""
    model, ps, refs, _ = setup

    class Rebinding(ScriptDraft):
        def load(self, sequence):
            self.script = torch.zeros_like(self.script)
            self.script[: len(sequence)] = torch.as_tensor(sequence).to(self.script.device)
            return self

    draft = Rebinding(V).to(DEVICE)
    with HeteroSpec(model, draft, Policy.static(4, 3, 12), cuda_graphs="emulate") as hs:
        draft.load(refs[0][0])
        hs.generate(ps[0], max_new_tokens=8)          # recorded after the load: consistent
        draft.load(refs[1][0])
        with pytest.raises(RuntimeError, match=r"read 1 tensor\(s\) from outside that it did not read when it "
                                               r"was recorded.*copy_, fill_"):
            hs.generate(ps[1], max_new_tokens=8)


def test_auto_falls_back_to_eager_when_recording_fails(setup, monkeypatch):
    """With cuda_graphs='auto' a recording that fails (an op that cannot be captured, say) warns once and
    decodes eagerly -- same output; with True the failure is raised."""
    from heterospec.engine import graphs

    model, ps, refs, head = setup

    def broken(self, key, fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.StepGraphs, "capture", broken)
    policy = Policy.paper(4, 3, 16, THRESHOLDS)
    hs = HeteroSpec(model, head, policy, cuda_graphs=MODE)
    hs._graphs_fallback = True            # what 'auto' sets where it resolves to graphs (a GPU)
    with pytest.warns(RuntimeWarning, match="falls back to the eager engine"):
        seq, st = hs.generate(ps[0], max_new_tokens=NEW)
    assert seq.tolist() == refs[0].tolist() and st.graphs == "off" and hs.cuda_graphs is False
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        HeteroSpec(model, head, policy, cuda_graphs=MODE).generate(ps[0], max_new_tokens=4)


def test_no_garbage_is_collected_while_steps_are_recorded(setup, monkeypatch):
    """A dead engine held only by a reference cycle (an exception's traceback holds the frames that hold it) is
    collected before a recording, never in the middle of a capture: torch's capture no longer collects on entry,
    and destroying recorded graphs while another capture runs makes CUDA calls the capture forbids (the sixth
    GPU window: test_nonfinite's [True-inf-heterospec] failed to record after earlier tests had raised from
    recorded engines).  Here Python's collector is made to run at almost every allocation; garbage made during
    a capture must wait until the recording ends, and on a GPU the dead engines' graphs must not break it."""
    import gc
    import weakref

    from heterospec.engine import graphs

    model, ps, refs, head = setup
    policy = Policy.paper(4, 3, 16, THRESHOLDS)
    capturing, freed_during, made = [False], [], []
    real_capture = graphs.StepGraphs.capture

    class Cyclic:
        def __init__(self):
            self.me = self                  # only the cyclic collector frees it

    def capture(self, key, fn):
        c = Cyclic()
        weakref.finalize(c, lambda: freed_during.append(capturing[0]))
        made.append(key)
        del c                               # garbage from here on
        capturing[0] = True
        try:
            return real_capture(self, key, fn)
        finally:
            capturing[0] = False

    def dead_engine():
        hs = HeteroSpec(model, head, policy, cuda_graphs=MODE)
        hs.generate(ps[1], max_new_tokens=4)
        hs.self_ref = hs                   # kept only by this cycle once the function returns
        assert len(hs.cycle._recorded) == 1

    threshold = gc.get_threshold()
    gc.collect()
    for _ in range(2):
        dead_engine()                       # recorded graphs (real ones on a GPU), now garbage
    monkeypatch.setattr(graphs.StepGraphs, "capture", capture)
    try:
        with HeteroSpec(model, head, policy, cuda_graphs=MODE) as hs:
            gc.set_threshold(1, 1, 1)
            seq, st = hs.generate(ps[0], max_new_tokens=12)
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert seq.tolist() == refs[0][:, :ps[0].shape[1] + 12].tolist() and st.graphs != "off"
    assert len(made) >= 2 and len(freed_during) == len(made)     # every capture's garbage was freed ...
    assert not any(freed_during), freed_during                   # ... after its capture, not during it


def test_each_live_recorded_set_gets_a_capture_stream_of_its_own(monkeypatch):
    """torch keeps a cuBLAS workspace per (handle, stream) and destroying any graph captured on a stream drops
    it: a set of graphs must not share its capture stream with another live set (engine/graphs.stream_for).  A
    stream goes to a new owner only once its last owner is gone, and streams are never destroyed."""
    import gc

    from heterospec.engine import graphs

    made = []
    monkeypatch.setattr(graphs.ops, "cuda_new_stream", lambda index: made.append(index) or 0x100 * len(made))
    monkeypatch.setattr(graphs, "_STREAMS", {})

    class Owner:
        pass

    a, b = Owner(), Owner()
    sa, sb = graphs.stream_for(0, a), graphs.stream_for(0, b)
    assert sa != sb and made == [0, 0]
    assert graphs.stream_for(1, Owner()) not in (sa, sb) and made == [0, 0, 1]   # per device
    del a
    gc.collect()
    c = Owner()
    assert graphs.stream_for(0, c) == sa and len(made) == 3     # a's stream, now free, is handed on
    assert graphs.stream_for(0, Owner()) not in (sa, sb)         # b and c still hold theirs
    assert len(made) == 4 and b is not None and c is not None
