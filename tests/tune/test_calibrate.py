"""Cost model, per-bin optimiser and profiles; the cost model's inputs on the model's device and its
device-synchronised clock (issue 15, crashes 2 and 3)."""
import json
import os
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _doubles import StretchDraft  # noqa: E402
from _models import eagle3_head, prompts, tiny_target  # noqa: E402

from heterospec import measure  # noqa: E402
from heterospec.policy.profile import CostModel, head_identity, load_profile, model_identity, save_profile  # noqa: E402
from heterospec.tune.costs import profile_costs  # noqa: E402
from heterospec.tune.optimise import optimise_policy  # noqa: E402
from heterospec.policy import Policy  # noqa: E402
from heterospec.tune.bins import MIN_LEAF_SHARE, fit_bins, fit_thresholds  # noqa: E402
from heterospec.tune.trace import record  # noqa: E402

BASE, K, N, LEVELS = 4, 3, 16, 7
# a CPU-like machine: verifying a tree token costs a tenth of a whole small forward
CPU_LIKE = CostModel(verify=(0.010, 0.001, 0.0, 0.0), level=(0.002, 0.0002), overhead=0.0005)


@pytest.fixture(scope="module")
def stretch_trace():
    model = tiny_target("llama")
    return record(model, StretchDraft(model), prompts(4), max_new_tokens=48, top_k=K, levels=LEVELS)


def test_cost_model_is_a_function_of_the_tree():
    assert CPU_LIKE(60, 100, 7, 10) > CPU_LIKE(10, 100, 7, 10) > CPU_LIKE(10, 100, 3, 10) > CPU_LIKE(1, 100, 0, 0)
    again = CostModel.from_dict(json.loads(json.dumps(CPU_LIKE.to_dict())))
    assert again == CPU_LIKE


def test_cost_model_draft_terms_old_and_new_form():
    # profiles from before issue 28.4: (levels + 1) * (e + f*beam)
    old = CostModel((0.0, 0.0, 0.0, 0.0), (0.002, 0.0001))
    assert old.draft(7, 10) == pytest.approx(8 * 0.003) and old.draft(7, 0) == 0.0
    # now: levels*(e + f*beam) + g + h*beam (levels, and once per cycle the root, the tree and the catch-up)
    new = CostModel((0.01, 0.0, 0.0, 0.0), (0.002, 0.0001, 0.004, 0.0002))
    assert new.draft(7, 10) == pytest.approx(7 * 0.003 + 0.006)
    assert new(6, 100, 7, 10) == pytest.approx(0.01 + 7 * 0.003 + 0.006)
    assert new(1, 100, 0, 0) == pytest.approx(0.01)                   # autoregressive: no draft term
    assert CostModel.from_dict(json.loads(json.dumps(new.to_dict()))) == new
    with pytest.raises(ValueError, match="expected 4 or 6 verify and 2 or 4 level coefficients, got 4 and 3"):
        CostModel((0.0,) * 4, (0.0,) * 3)
    with pytest.raises(ValueError, match="got 5 and 4"):
        CostModel((0.0,) * 5, (0.0,) * 4)


def test_a_verify_step_with_a_knee_is_fitted_with_one():
    """verify with a knee (a, b, c, d, knee, b0): b0 per node up to the knee, b past it.  The fit takes it where
    it fits much better than a line (a CPU's few-rows kernel, a GPU's launch-bound step flat up to tens of
    tokens), keeps the line for a linear step, and never takes a knee with a falling cost per node."""
    from heterospec.tune.costs import _fit_verify_rows, _relative_error

    m = CostModel((0.01, 0.002, 1e-6, 0.0, 8.0, 0.0005), (0.0, 0.0))
    assert m.verify_cost(4, 100) == pytest.approx(0.01 + 4 * 0.0005 + 1e-4)
    assert m.verify_cost(20, 100) == pytest.approx(0.01 + 8 * 0.0005 + 12 * 0.002 + 1e-4)
    assert m(20, 100, 0, 0) == pytest.approx(m.verify_cost(20, 100))
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    grid = [(n, c) for c in (64, 160, 256) for n in (1, 2, 4, 8, 16, 32, 64, 128)]

    def fit(f):
        rows = [(n, c, f(n, c)) for n, c in grid]
        return _fit_verify_rows(rows), rows

    cpu, rows = fit(lambda n, c: 0.006 + 0.0009 * min(n, 16) + 0.0014 * max(n - 16, 0) + 2e-6 * c)
    assert len(cpu) == 6 and cpu[4] == 16 and _relative_error(cpu, rows) < 1e-6
    gpu, rows = fit(lambda n, c: 0.0036 + 1e-5 * min(n, 64) + 1e-4 * max(n - 64, 0) + 1e-7 * c)
    assert len(gpu) == 6 and gpu[4] == 64 and CostModel(gpu, (0, 0)).verify_cost(1, 100) == pytest.approx(0.00362)
    line, rows = fit(lambda n, c: 0.005 + 0.001 * n + 1e-6 * c)
    assert len(line) == 4 and _relative_error(line, rows) < 1e-9
    # one slow point at n = 1 (what a point timed after a much larger one read): a falling cost per node below
    # a knee is no knee
    odd, rows = fit(lambda n, c: (0.015 if n == 1 else 0.01 + 0.001 * n) + 1e-6 * c)
    assert len(odd) == 4 or (0 <= odd[5] <= odd[1])


def test_each_point_is_timed_right_after_an_untimed_run_of_itself():
    """_interleaved: in every round, a point's timed call comes right after an untimed call of the same point
    (a step timed after a much larger one pays for it), each call after its setup."""
    from heterospec.tune.costs import _interleaved

    log = []
    points = [(lambda k=k: log.append(("setup", k)), lambda k=k: log.append(("call", k))) for k in range(3)]

    def timer(fn):
        log.append(("timed",))
        fn()
        return None, 1.0

    assert _interleaved(timer, points, 2) == [1.0, 1.0, 1.0]
    rounds = log[6:]          # after the first untimed pass over the points
    assert len(rounds) == 2 * 3 * 5
    for i in range(0, len(rounds), 5):
        k = rounds[i][1]
        assert rounds[i: i + 5] == [("setup", k), ("call", k), ("setup", k), ("timed",), ("call", k)]


def test_profile_costs_measures_this_machine():
    model = tiny_target("llama")
    cm = profile_costs(model, None, tree_tokens=(1, 16, 64), contexts=(32, 96), reps=2)
    assert all(np.isfinite(cm.verify)) and cm(64, 96, 0, 0) > 0
    # bigger trees are not predicted to be cheaper than one token
    assert cm(64, 96, 0, 0) >= 0.5 * cm(1, 96, 0, 0)


def test_optimiser_deepens_and_prunes_the_easy_bins(stretch_trace):
    x, acc = stretch_trace.features(BASE, N, target="accepted")
    thresholds = tuple(fit_thresholds(x, acc, depth=3, min_leaf=10))
    assert len(thresholds) >= 1
    policy, predicted = optimise_policy(stretch_trace, CPU_LIKE, base_depth=BASE, total_tokens=N,
                                        thresholds=thresholds)
    static = stretch_trace.replay(Policy.static(BASE, K, N), cost_model=CPU_LIKE).tokens_per_s
    paper = stretch_trace.replay(Policy.paper(BASE, K, N, thresholds), cost_model=CPU_LIKE).tokens_per_s
    assert predicted >= paper >= 0 and predicted >= static
    r = stretch_trace.replay(policy, cost_model=CPU_LIKE)
    assert r.tokens_per_s == pytest.approx(predicted)
    # the easiest populated bin (lowest entropy, long acceptance) drafts deeper and verifies fewer nodes
    easy = min(r.per_bin())
    assert r.per_bin()[easy]["mean_accepted"] > 2.0
    assert policy.extra[easy] >= 1 and policy.keep[easy] < N


def test_the_calibrated_policy_never_predicts_slower_than_the_static_tree(stretch_trace):
    """42.2: the descent starts from the static tree as well as from the paper's rule, so however few sweeps it
    gets, the result is at least the static tree of its base (here a machine where drafting is dear, so the
    paper's deeper bins predict slower than static)."""
    dear_draft = CostModel(verify=(0.010, 0.0002, 0.0, 0.0), level=(0.02, 0.002), overhead=0.0005)
    x, acc = stretch_trace.features(BASE, N, target="accepted")
    thresholds = tuple(fit_thresholds(x, acc, depth=3, min_leaf=10))
    static = stretch_trace.replay(Policy.static(BASE, K, N), cost_model=dear_draft).tokens_per_s
    paper = stretch_trace.replay(Policy.paper(BASE, K, N, thresholds), cost_model=dear_draft).tokens_per_s
    assert paper < static   # the case the guarantee is for
    for sweeps in (0, 1, 4):
        policy, predicted = optimise_policy(stretch_trace, dear_draft, base_depth=BASE, total_tokens=N,
                                            thresholds=thresholds, max_sweeps=sweeps)
        assert predicted >= static
        assert stretch_trace.replay(policy, cost_model=dear_draft).tokens_per_s == pytest.approx(predicted)


def test_bins_at_depth_0_are_fitted_on_the_accepted_length(stretch_trace):
    """At a base tree of depth 0 the best path's leaf is the root expansion's best candidate, always kept first:
    its rank is 0 at every position, and Eq. 2 has nothing to fit (the shipped depth-0 CPU profiles' bins held
    1-2 % of the cycles each).  fit_bins fits on the accepted length there, and on the rank where it varies."""
    _, rank = stretch_trace.features(0, 2, target="rank")
    assert (rank == 0).all()
    th, target, x = fit_bins(stretch_trace, 0, 2)
    xa, acc = stretch_trace.features(0, 2, target="accepted")
    assert target == "accepted" and np.array_equal(x, xa) and acc.min() < acc.max()
    want = fit_thresholds(xa, acc, depth=3, min_leaf=max(5, len(xa) // MIN_LEAF_SHARE))
    assert len(th) >= 1 and th == tuple(float(t) for t in want)
    _, rank4 = stretch_trace.features(BASE, N, target="rank")
    assert rank4.min() < rank4.max() and fit_bins(stretch_trace, BASE, N)[1] == "rank"


def test_a_small_base_trees_bins_may_keep_fewer_or_more_nodes(stretch_trace):
    """The kept-node grid holds 1-4 besides the fractions of the base tree's nodes: with a 2-node base (a CPU's)
    it was {2} (and the paper's rule's start), so no bin could verify more than the base, however sure its draft."""
    th, _, _ = fit_bins(stretch_trace, 0, 2)
    policy, predicted = optimise_policy(stretch_trace, CPU_LIKE, base_depth=0, total_tokens=2, thresholds=th)
    frozen, before = optimise_policy(stretch_trace, CPU_LIKE, base_depth=0, total_tokens=2, thresholds=th,
                                     keep_grid=[2])
    assert max(frozen.keep) <= 2 < max(policy.keep) and predicted > before
    assert stretch_trace.replay(policy, cost_model=CPU_LIKE).tokens_per_s == pytest.approx(predicted)


def test_model_identity_is_stable_and_pathless(tmp_path):
    """Issue 18.3: a profile names its pair by what fixes the model (architecture fields hashed, vocabulary
    sizes), never a path: the same config in another directory or with fields transformers adds or drops
    (dtype, version, _name_or_path) has the same identity; another vocabulary does not."""
    cfg = {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2,
           "rope_theta": 100000.0}
    a = model_identity(dict(cfg, _name_or_path="/home/a/m", torch_dtype="float32", transformers_version="5.0"), "m")
    b = model_identity(dict(cfg, _name_or_path="/opt/b/m", dtype="bfloat16", transformers_version="5.23"), "m")
    assert a == b and a["vocab_size"] == 97 and "/" not in json.dumps(a)
    assert model_identity(dict(cfg, vocab_size=98), "m")["config_sha256"] != a["config_sha256"]
    assert model_identity(dict(cfg, rope_theta=10000.0), "m")["config_sha256"] != a["config_sha256"]
    head = tmp_path / "some" / "where" / "my-head"
    head.mkdir(parents=True)
    (head / "config.json").write_text(json.dumps({"hidden_size": 32, "vocab_size": 97, "draft_vocab_size": 40}))
    ident = head_identity(head)
    assert ident["name"] == "my-head" and ident["draft_vocab_size"] == 40 and str(tmp_path) not in json.dumps(ident)


@pytest.mark.parametrize("name", ["profile.json", "profile-cpu-avx2.json"])
def test_the_shipped_profile_names_its_pair_without_paths(name):
    """Issue 18.3: the shipped profiles' pair is the default target and the shipped head by identity, so an
    installed copy (another path) loads them without a warning."""
    from heterospec.models.default import DEFAULT_HEAD

    path = os.path.join(DEFAULT_HEAD, name)
    raw = json.loads(open(path).read())
    pair = raw["model_pair"]
    assert isinstance(pair["target"], dict) and isinstance(pair["draft"], dict)
    assert "/" not in json.dumps(pair), pair
    assert pair["draft"] == head_identity(DEFAULT_HEAD)
    assert pair["target"]["name"] == "SmolLM2-135M-Instruct" and pair["target"]["vocab_size"] == 49152
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(path, draft=head_identity(DEFAULT_HEAD), target=pair["target"])


def test_profile_round_trip_and_errors(tmp_path, stretch_trace):
    pol = Policy(BASE, K, N, (0.5, 1.0, 2.0), (3, 2, 0, 0), (6, 9, 16, 16), name="calibrated")
    path = tmp_path / "p.json"
    t_id = model_identity({"model_type": "llama", "vocab_size": 97, "hidden_size": 32}, "tiny-llama")
    d_id = model_identity({"hidden_size": 32, "vocab_size": 97, "draft_vocab_size": 40}, "stretch")
    save_profile(path, pol, CPU_LIKE, target=t_id, draft=d_id)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the same pair: no warning
        again, cost, raw = load_profile(path, target=t_id, draft=d_id)
    assert again == pol and cost == CPU_LIKE and raw["machine"]["platform"]
    with pytest.warns(UserWarning, match="calibrated for target 'tiny-llama', not 'another-model'"):
        load_profile(path, target=model_identity({"model_type": "llama", "vocab_size": 98}, "another-model"))
    with pytest.raises(TypeError, match="save_profile: argument 'draft' expected a model_identity dict"):
        save_profile(path, pol, CPU_LIKE, draft="/home/someone/heads/stretch")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not read"):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({"version": 0}))
    with pytest.raises(ValueError, match="version"):
        load_profile(tmp_path / "old.json")
    d = json.loads(path.read_text())
    del d["policy"]["keep"]
    (tmp_path / "missing.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="keep"):
        load_profile(tmp_path / "missing.json")
    d = json.loads(path.read_text())
    d["policy"]["thresholds"] = [2.0, 1.0]
    (tmp_path / "order.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="thresholds"):
        load_profile(tmp_path / "order.json")
    d["policy"]["thresholds"] = [1.0, float("nan")]           # json writes NaN, and reads it back
    (tmp_path / "nan.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"^load_profile: malformed profile '.*nan.json': Policy: argument "
                                         r"'thresholds' expected strictly ascending values, got \(1.0, nan\)$"):
        load_profile(tmp_path / "nan.json")
    d["policy"]["thresholds"] = [1.0]                          # 2 bins, 4 entries of extra and keep
    (tmp_path / "bins.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"^load_profile: malformed profile '.*bins.json': policy fields 'extra' and "
                                         r"'keep' expected at most 2 entries \(one per bin of 1 thresholds\), got 4$"):
        load_profile(tmp_path / "bins.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(path, target="tiny-llama", draft="stretch")  # names only: compared by name, no warning
    with pytest.warns(UserWarning, match="calibrated for draft 'stretch', not 'other'"):
        load_profile(path, draft="other")


# ---- issue 15, crash 2: every tensor profile_costs makes is made on the model's device ---------------------


@pytest.fixture
def meta_by_default():
    """A tensor made without an explicit device lands on "meta" (no data) and any op mixing it with the
    CPU models fails: a CPU-only machine catches what would be a host tensor next to a CUDA model."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.fixture(scope="module")
def cpu_pair(tmp_path_factory):
    with torch.device("cpu"):
        model = tiny_target("llama").to("cpu")
        draft = eagle3_head(model, tmp_path_factory.mktemp("draft")).to("cpu")
    return model, draft


def test_profile_costs_makes_its_inputs_on_the_models_device(cpu_pair, meta_by_default):
    # before the fix: torch.randint(0, vocab, (1, ctx)) -> a meta prompt for a CPU target (and the draft's
    # hid / ids / pos likewise): "Tensor on device cpu is not on the expected device meta"
    model, draft = cpu_pair
    cm = profile_costs(model, draft, tree_tokens=(1, 4), contexts=(12, 20), beams=(1, 2), reps=1)
    assert all(np.isfinite(cm.verify)) and all(np.isfinite(cm.level))
    assert torch.zeros(1).device.type == "meta"  # (the trap was armed throughout)


def test_profile_costs_reports_each_part_as_it_ends(cpu_pair):
    """calibrate was silent for the minutes of measuring (5.5 of a GPU window's 5.9 calibrate minutes): each part now
    says what it timed, at how many points, and its seconds."""
    model, draft = cpu_pair
    lines = []
    profile_costs(model, draft, tree_tokens=(1, 4), contexts=(12, 20), beams=(1, 2), levels=(1, 3), reps=1,
                  overhead_tokens=8, report=lines.append)
    assert len(lines) == 3, lines
    assert lines[0].startswith("costs: verify timed at 4 (tree size, context) points, eager steps, 1 rounds, in ")
    assert lines[1].startswith("costs: the draft's side timed at 4 (levels, beams) points, eager steps, 1 rounds, in ")
    assert lines[2].startswith("costs: overhead ") and "a generate call of 8 tokens after a warm-up" in lines[2]
    assert all(line.endswith(" s") and float(line.rsplit(" in ", 1)[1][:-2]) >= 0 for line in lines)
    lines.clear()
    profile_costs(model, None, tree_tokens=(1,), contexts=(12,), reps=1, overhead_tokens=0, report=lines.append)
    assert [line.split(" timed at ")[0] for line in lines] == ["costs: verify"]   # no draft, no overhead: one part


def _log_draft_steps(draft, log, what=lambda hidden, ids: ("draft", ids.shape[1])):
    """Wrap ``draft.step`` (what the engine calls for every draft forward) to log each call."""
    step = draft.step

    def logged(hidden, input_ids, *args, **kwargs):
        log.append(what(hidden, input_ids))
        return step(hidden, input_ids, *args, **kwargs)

    draft.step = logged
    return lambda: vars(draft).pop("step", None)


def test_profile_costs_gives_the_draft_its_own_dtype(tmp_path):
    # the engine takes a pair of one dtype; every draft step the profile times gets its hidden state in it
    model = tiny_target("llama").to(torch.bfloat16)
    draft = eagle3_head(model, tmp_path).to(torch.bfloat16)
    seen = []
    undo = _log_draft_steps(draft, seen, lambda hidden, ids: (hidden.dtype, hidden.device))
    try:
        profile_costs(model, draft, tree_tokens=(1,), contexts=(8,), beams=(1, 2), reps=1, overhead_tokens=0)
    finally:
        undo()
    assert seen and all(s == (torch.bfloat16, torch.device("cpu")) for s in seen), seen


# ---- issue 15, crash 3: the timers synchronise the device before starting and before stopping ----------------


def test_synchronize_waits_for_cuda_and_other_accelerators(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("cuda", device)))
    fake_cuda = types.SimpleNamespace(type="cuda", index=1)
    measure.synchronize(fake_cuda)
    assert calls == [("cuda", fake_cuda)]
    for cpu in ("cpu", torch.device("cpu"), types.SimpleNamespace(type="cpu", index=None)):
        measure.synchronize(cpu)  # the CPU runs ops synchronously: nothing to wait for
    assert calls == [("cuda", fake_cuda)]
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
        monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: calls.append(("accelerator", device)))
        fake_xpu = types.SimpleNamespace(type="xpu", index=0)
        measure.synchronize(fake_xpu)
        assert calls[-1] == ("accelerator", fake_xpu)


def test_device_timer_brackets_the_work_with_syncs(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: log.append("clock") or len(log)))
    timer = measure.device_timer(types.SimpleNamespace(type="cuda", index=0))
    result, seconds = timer(lambda x: log.append("work") or x + 1, 41)
    assert result == 42 and seconds == 5 - 2
    assert log == ["sync", "clock", "work", "sync", "clock"]
    log.clear()
    with timer as t:
        log.append("work")
    assert log == ["sync", "clock", "work", "sync", "clock"] and t.seconds == 5 - 2


def test_profile_costs_synchronises_before_every_clock_read(cpu_pair, monkeypatch):
    # before the fix the regions were bare perf_counter reads: on a GPU they timed the kernel launches
    model, draft = cpu_pair
    log = []
    monkeypatch.setattr(measure, "synchronize", lambda device: log.append(("sync", torch.device(device))))
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: log.append(("clock",)) or 0.0))
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: log.append(("target", kwargs["input_ids"].shape[1])),
                                           with_kwargs=True)
    undo = _log_draft_steps(draft, log)
    trees, contexts, beams, levels, reps = (1, 4), (20, 30), (1, 3), (1, 2), 2
    try:
        profile_costs(model, draft, tree_tokens=trees, contexts=contexts, beams=beams, levels=levels, reps=reps,
                      overhead_tokens=0)
    finally:
        hook.remove()
        undo()
    # every clock read comes right after a sync of the model's device
    for i, e in enumerate(log):
        if e[0] == "clock":
            assert i > 0 and log[i - 1] == ("sync", torch.device("cpu")), log[max(0, i - 3): i + 1]
    # clock reads pair up into regions; each region holds exactly one engine step, then the sync before the
    # stop: one verify forward of the target, or the draft's side of a cycle (L levels of K rows, then the
    # catch-up over the L + 2 rows a cycle may commit); the prompts' prefills stay outside
    clocks = [i for i, e in enumerate(log) if e[0] == "clock"]
    assert len(clocks) % 2 == 0
    work_inside = []
    for start, stop in zip(clocks[::2], clocks[1::2]):
        inside = tuple(e for e in log[start + 1: stop] if e[0] != "sync")
        assert inside and log[stop - 1][0] == "sync", log[start: stop + 1]
        work_inside.append(inside)
    expected = [(("target", n),) for _ in contexts for n in trees for _ in range(reps)]
    expected += [(("draft", K),) * L + (("draft", L + 2),) for K in beams for L in levels for _ in range(reps)]
    assert sorted(work_inside) == sorted(expected)
    prefills = [e for e in log if e[0] == "target" and e[1] in contexts]
    assert prefills and all((e,) not in work_inside for e in prefills)


def test_overhead_is_what_generate_spends_outside_the_modelled_steps():
    from heterospec.engine import GenerationStats
    from heterospec.tune.costs import overhead_per_cycle

    # eager engine: 10 cycles in 1.2 s after a 0.2 s prefill, of which 0.3 s drafting and 0.5 s verifying
    stats = GenerationStats(new_tokens=25, cycles=10, prefill_s=0.2, total_s=1.2, draft_s=0.3, verify_s=0.5,
                            ops_s=0.05)
    assert overhead_per_cycle(stats) == pytest.approx(0.02)     # the ops and the host: (1.0 - 0.8) / 10
    # recorded engine: the replayed steps are modelled, the device's idle time between them is not
    graphs = GenerationStats(new_tokens=25, cycles=10, prefill_s=0.2, total_s=1.2, graph_s=0.9, idle_s=0.08)
    assert overhead_per_cycle(graphs) == pytest.approx(0.01)
    # never below zero; no cycles, no overhead
    assert overhead_per_cycle(GenerationStats(cycles=3, total_s=0.1, verify_s=0.2)) == 0.0
    assert overhead_per_cycle(GenerationStats()) == 0.0


def test_profile_costs_measures_the_overhead_with_generate(cpu_pair, monkeypatch):
    from heterospec.engine import HeteroSpec
    from heterospec.tune import costs

    model, draft = cpu_pair
    calls = []
    real = HeteroSpec.generate

    def generate(self, input_ids, **kw):
        out, stats = real(self, input_ids, **kw)
        calls.append((self.policy.name, kw["max_new_tokens"], stats))
        return out, stats

    monkeypatch.setattr(HeteroSpec, "generate", generate)
    seen = {}
    monkeypatch.setattr(costs, "overhead_per_cycle", lambda stats: seen.setdefault("stats", stats) and 0.0123)
    cm = profile_costs(model, draft, tree_tokens=(1, 4), contexts=(12, 20), beams=(1, 2), reps=1, overhead_tokens=16)
    assert cm.overhead == 0.0123
    # a warm-up call, then the timed one: EAGLE-3's default static tree, 16 new tokens after a 12-token prompt
    assert [c[:2] for c in calls] == [("eagle3", 8), ("eagle3", 16)]
    assert seen["stats"] is calls[-1][2] and seen["stats"].cycles > 0


def test_replay_predicts_each_bins_tokens_per_second(stretch_trace):
    """Issue 19.4's per-bin table: with a cost model a replay charges every cycle's predicted seconds to its
    bin.  A flat cost of 0.25 s per cycle makes a bin's tokens/s its committed tokens per cycle over 0.25."""
    x, acc = stretch_trace.features(BASE, N, target="accepted")
    thresholds = tuple(fit_thresholds(x, acc, depth=3, min_leaf=10))
    flat = lambda nodes, context, levels, beam: 0.25  # noqa: E731
    r = stretch_trace.replay(Policy.paper(BASE, K, N, thresholds), cost_model=flat)
    assert len(r.per_bin()) >= 2 and r.predicted
    for b, v in r.per_bin().items():
        assert v["seconds"] == pytest.approx(0.25 * v["cycles"])
        assert v["tokens_per_s"] == pytest.approx((v["mean_accepted"] + 1) / 0.25)
    assert sum(v["cycles"] for v in r.per_bin().values()) == r.cycles
    # no cost model: no prediction anywhere
    bare = stretch_trace.replay(Policy.paper(BASE, K, N, thresholds))
    assert bare.tokens_per_s is None and not bare.predicted
    assert all(v["tokens_per_s"] is None for v in bare.per_bin().values())


def test_the_shipped_profile_is_chosen_per_device_and_says_which(tmp_path, monkeypatch):
    """Issue 40.4: a head ships a profile per device type (profile.json calibrated on a CPU, profile-cuda.json on
    an H100/H200); CUDA takes its own where it ships and otherwise the CPU one, saying so; a user's own profile is
    never replaced (the callers pass --policy/--profile first)."""
    import shutil

    from heterospec.models.default import DEFAULT_HEAD
    from heterospec.policy.profile import load_profile, default_policy, shipped_profile

    head = tmp_path / "head"
    head.mkdir()
    assert shipped_profile("cpu", str(head))[0] is None
    with pytest.raises(FileNotFoundError, match="no shipped profile"):
        default_policy("cuda", str(head))
    shutil.copy(os.path.join(DEFAULT_HEAD, "profile.json"), head / "profile.json")
    path, what = shipped_profile("cuda:0", str(head))
    assert path == str(head / "profile.json") and "CPU profile" in what and "no profile calibrated on a cuda" in what
    # 42.2: before the CPU profile (a searched base tree may be tiny), the one calibrated around 7/10/60
    shutil.copy(os.path.join(DEFAULT_HEAD, "profile-eagle3-base.json"), head / "profile-eagle3-base.json")
    path, what = shipped_profile("cuda", str(head))
    assert path == str(head / "profile-eagle3-base.json") and "7/10/60" in what and "no profile calibrated" in what
    assert default_policy("cuda", str(head)).depth == 7 and default_policy("cpu", str(head)).depth == 0
    assert shipped_profile("cpu", str(head))[0] == str(head / "profile.json")
    raw = json.loads((head / "profile.json").read_text())
    raw["policy"]["thresholds"] = [t + 0.125 for t in raw["policy"]["thresholds"]]   # a different, valid profile
    (head / "profile-cuda.json").write_text(json.dumps(raw))
    for dev in ("cuda", "cuda:1"):
        path, what = shipped_profile(dev, str(head))
        assert path == str(head / "profile-cuda.json") and "GPU profile" in what
    assert shipped_profile("cpu", str(head))[0] == str(head / "profile.json")
    gpu_policy = default_policy("cuda", str(head))
    assert gpu_policy.thresholds == load_profile(str(head / "profile-cuda.json"))[0].thresholds
    assert gpu_policy.thresholds != default_policy("cpu", str(head)).thresholds
    assert Policy.from_profile(str(head / "profile-cuda.json")) == gpu_policy
    # the default head: its CPU profile on the CPU, and on a CPU whose widest unit is AVX2 the one calibrated there
    # (twenty-sixth session); a head without that file keeps profile.json on any CPU
    from heterospec.models import cpu_gemm

    for isa, name in ((2, "profile.json"), (None, "profile.json"), (0, "profile.json"), (1, "profile-cpu-avx2.json")):
        monkeypatch.setattr(cpu_gemm, "kernel_isa", lambda isa=isa: isa)
        assert shipped_profile("cpu")[0] == os.path.join(DEFAULT_HEAD, name)
        assert shipped_profile("cpu", str(head))[0] == str(head / "profile.json")
        assert shipped_profile("cuda", str(head))[0] == str(head / "profile-cuda.json")
    avx2 = load_profile(os.path.join(DEFAULT_HEAD, "profile-cpu-avx2.json"))
    assert avx2[2]["machine"]["cpu_isa"] == "AVX2" and avx2[0] == default_policy("cpu")
    assert "for AVX2 CPUs" in shipped_profile("cpu:0")[1]
