"""The recorded engine over a batch (issue 29): the batched cycle's steps recorded once per (batch size, extra
levels, padded tree size) and replayed, with each row's plan in a static device tensor.

On the CPU ``cuda_graphs="emulate"`` runs the recorded-step plumbing without graphs (every replay re-runs the
step and is refused if it reads memory the recording did not); with ``HETEROSPEC_TEST_DEVICE=cuda`` (``.ci/gpu``)
the same tests replay real CUDA graphs.  Either way a recorded batch must give the eager batch's output token
for token and draw for draw, with the same per-row statistics, and each row must equal HF's greedy decoding of
its prompt alone."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _doubles import BatchTableDraft  # noqa: E402
from _models import THRESHOLDS, eagle3_head, prompts, reference_greedy, tiny_target  # noqa: E402
from test_graphs import DEVICE, MODE  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.engine import sync  # noqa: E402
from heterospec.engine.loop import GPU_BUCKETS  # noqa: E402

NEW = 24
ROWS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_target("llama")
    ps = prompts(ROWS)
    refs = [reference_greedy(model, p, NEW + 8) for p in ps]
    head = eagle3_head(model, tmp_path_factory.mktemp("head"))
    table = BatchTableDraft(model.config.vocab_size, ROWS).to(DEVICE).load([r[0] for r in refs])
    return model, ps, refs, head, table


def _method(name, model, head, table):
    return {
        "ar": (None, None),
        "eagle3-table": (table, Policy.static(4, 3, 12)),
        "heterospec-table": (table, Policy.paper(3, 3, 12, THRESHOLDS)),
        "heterospec-head": (head, Policy.paper(4, 3, 16, THRESHOLDS)),
    }[name]


def _run(hs, ps, **kw):
    outs, st = hs.generate([p[0] for p in ps], max_new_tokens=NEW, finished_rows="mask", **kw)
    rows = [(r.cycles, r.verified_tokens, dict(r.accepted_hist), dict(r.bins)) for r in st.per_row]
    return [o.tolist() for o in outs], rows, st


@pytest.mark.parametrize("buckets", ["auto", GPU_BUCKETS])
@pytest.mark.parametrize("name", ["ar", "eagle3-table", "heterospec-table", "heterospec-head"])
def test_a_recorded_batch_equals_the_eager_batch_and_each_prompt_alone(setup, name, buckets):
    model, ps, refs, head, table = setup
    draft, policy = _method(name, model, head, table)
    with HeteroSpec(model, draft, policy, buckets=buckets) as hs:
        eager, eager_rows, _ = _run(hs, ps)
    with HeteroSpec(model, draft, policy, buckets=buckets, cuda_graphs=MODE) as hs:
        recorded, rows, st = _run(hs, ps)
    assert st.graphs == ("cuda" if MODE is True else "emulate") and st.captured_steps >= 1
    for out, p, ref in zip(recorded, ps, refs):
        assert out == ref[0, :p.shape[1] + NEW].tolist(), f"{name}: a recorded row differs from HF's greedy"
    assert recorded == eager and rows == eager_rows, f"{name}: the recorded batch differs from the eager one"
    if name.endswith("table"):
        assert st.tau > 2.0, st.tau                       # multi-token commits really happened
        assert len({str(r[2]) for r in rows}) > 1         # rows accepted different lengths


@pytest.mark.parametrize("name", ["ar", "heterospec-head"])
def test_a_recorded_batch_with_prompt_lookup_equals_the_eager_batch(setup, name):
    """Each row's chain in the batch's static chain buffer, grafted inside the recording; rows finish at different
    cycles and keep a zero-length chain: the eager batch's outputs and per-row statistics, HF's greedy per row."""
    model, ps, refs, head, table = setup
    draft, policy = _method(name, model, head, table)
    kw = dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3)
    with HeteroSpec(model, draft, policy) as hs:
        eager, eager_rows, _ = _run(hs, ps, **kw)
        plain = _run(hs, ps)[2]
    with HeteroSpec(model, draft, policy, cuda_graphs=MODE) as hs:
        recorded, rows, st = _run(hs, ps, **kw)
    for out, p, ref in zip(recorded, ps, refs):
        assert out == ref[0, :p.shape[1] + NEW].tolist(), f"{name}: a recorded row with lookup differs from HF's"
    assert recorded == eager and rows == eager_rows
    assert st.tau > plain.tau


@pytest.mark.parametrize("name", ["ar", "eagle3-table", "heterospec-table", "heterospec-head"])
def test_a_recorded_batch_draws_as_the_eager_batch(setup, name):
    model, ps, refs, head, table = setup
    draft, policy = _method(name, model, head, table)
    kw = dict(temperature=0.9, top_k=20, top_p=0.95, seed=[11, 12, 13, 14])
    runs = {}
    for mode in (False, MODE):
        with HeteroSpec(model, draft, policy, cuda_graphs=mode) as hs:
            runs[mode] = _run(hs, ps, **kw)[:2]
    assert runs[MODE] == runs[False]
    with HeteroSpec(model, draft, policy, cuda_graphs=MODE) as hs:   # and the seeds matter
        other = _run(hs, ps, **dict(kw, seed=[21, 22, 23, 24]))[0]
    assert other != runs[MODE][0]


def test_each_batch_shape_is_recorded_once_and_kept(setup):
    """The keys are every (deepest extra depth, padded tree) two rows can make (one live, the other live or
    finished); a second call of the same batch size replays them without recording, a new sampling setting
    records a second set, another batch size its own cycle."""
    model, ps, refs, head, table = setup
    policy = Policy.paper(3, 3, 12, THRESHOLDS)
    with HeteroSpec(model, table, policy, cuda_graphs=MODE, max_length=96) as hs:
        _, _, first = _run(hs, ps)
        _, _, second = _run(hs, ps)
        cyc = hs._cycles[ROWS]
        (steps,) = cyc._recorded.values()
        keys = cyc.shapes()
        assert steps.captured == [("base",)] + [("finish", e, T) for e, T in keys]
        assert max(T for _, T in keys) == 12 and (0, 1) not in keys     # a live row is never root-only here
        assert first.capture_s > 0 and second.capture_s == 0
        assert first.captured_steps == second.captured_steps == 1 + len(keys)
        assert steps.replays == 2 * (first.batch_calls + second.batch_calls)     # base + finish per cycle
        _run(hs, ps, temperature=0.7, seed=1)
        assert len(cyc._recorded) == 2
        hs.generate([p[0] for p in ps[:2]], max_new_tokens=8)
        assert sorted(hs._cycles) == [2, ROWS]
    assert not hs._cycles                                              # close() drops them
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)  # no tap hook left


def test_ar_and_a_static_tree_are_one_replay_per_cycle(setup):
    model, ps, refs, head, table = setup
    for d, pol, key in [(table, Policy.static(4, 3, 12), ("cycle", 0, 12)), (None, None, ("cycle", 0, 1))]:
        with HeteroSpec(model, d, pol, cuda_graphs=MODE) as hs:
            _, _, st = _run(hs, ps)
            (steps,) = hs._cycles[ROWS]._recorded.values()
            assert steps.captured == [key] and steps.replays == st.batch_calls


def test_rows_that_finish_early_are_masked_in_a_recorded_batch(setup):
    """A row that meets EOS early stays in the recorded batch (its graph's batch is fixed) committing nothing,
    while the others go on to their budget; every row equals HF's greedy up to its EOS."""
    model, ps, refs, head, table = setup
    eos = refs[1][0, ps[1].shape[1] + 3].item()            # row 1's fourth new token
    with HeteroSpec(model, table, Policy.paper(3, 3, 12, THRESHOLDS), cuda_graphs=MODE) as hs:
        outs, st = hs.generate([p[0] for p in ps], max_new_tokens=NEW, eos_token_id=eos)
    for out, p, ref in zip(outs, ps, refs):
        full = ref[0, p.shape[1]:p.shape[1] + NEW].tolist()
        want = full[:full.index(eos) + 1] if eos in full else full
        assert out[p.shape[1]:].tolist() == want
    assert st.per_row[1].new_tokens <= 4 < st.per_row[0].new_tokens
    assert st.per_row[1].cycles < st.per_row[0].cycles


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the host-transfer guard patches torch.Tensor; CPU check")
@pytest.mark.parametrize("name, per_cycle", [("heterospec-head", ["bin", "accepted"]),
                                              ("heterospec-table", ["bin", "accepted"]),
                                              ("eagle3-table", ["accepted"]), ("ar", ["accepted"])])
def test_a_recorded_batch_reads_the_host_twice_per_cycle_at_most(setup, name, per_cycle):
    model, ps, refs, head, table = setup
    draft, policy = _method(name, model, head, table)
    record = []
    with HeteroSpec(model, draft, policy, cuda_graphs=MODE) as hs:
        with sync.forbid_host_transfers(record):
            _, st = hs.generate([p[0] for p in ps], max_new_tokens=NEW, finished_rows="mask")
    assert record == per_cycle * st.batch_calls
