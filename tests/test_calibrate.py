"""Cost model, per-bin optimiser and profiles; the cost model's inputs on the model's device and its
device-synchronised clock (issue 15, crashes 2 and 3)."""
import json
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _doubles import StretchDraft  # noqa: E402
from test_decoding import eagle3_head, prompts, tiny_target  # noqa: E402

from heterospec import measure  # noqa: E402
from heterospec.policy.profile import CostModel, head_identity, load_profile, model_identity, save_profile  # noqa: E402
from heterospec.tune.costs import profile_costs  # noqa: E402
from heterospec.tune.optimise import optimise_policy  # noqa: E402
from heterospec.policy import Policy  # noqa: E402
from heterospec.tune.bins import fit_thresholds  # noqa: E402
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


def test_the_shipped_profile_names_its_pair_without_paths():
    """Issue 18.3: the shipped profile's pair is the default target and the shipped head by identity, so an
    installed copy (another path) loads it without a warning."""
    from heterospec.models.default import DEFAULT_HEAD, DEFAULT_PROFILE

    raw = json.loads(open(DEFAULT_PROFILE).read())
    pair = raw["model_pair"]
    assert isinstance(pair["target"], dict) and isinstance(pair["draft"], dict)
    assert "/" not in json.dumps(pair), pair
    assert pair["draft"] == head_identity(DEFAULT_HEAD)
    assert pair["target"]["name"] == "SmolLM2-135M-Instruct" and pair["target"]["vocab_size"] == 49152
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(DEFAULT_PROFILE, draft=head_identity(DEFAULT_HEAD), target=pair["target"])


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


def test_profile_costs_gives_the_draft_its_own_dtype(tmp_path):
    model = tiny_target("llama")
    draft = eagle3_head(model, tmp_path).to(torch.bfloat16)
    seen = []
    draft.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, args[0].device)))
    profile_costs(model, draft, tree_tokens=(1,), contexts=(8,), beams=(1, 2), reps=1)
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
    hooks = [model.register_forward_pre_hook(lambda m, args, kwargs: log.append(("target", kwargs["input_ids"].shape[1])),
                                             with_kwargs=True),
             draft.register_forward_pre_hook(lambda m, args: log.append(("draft", args[1].shape[1])))]
    trees, contexts, beams, reps = (1, 4), (20, 30), (1, 3), 2
    try:
        profile_costs(model, draft, tree_tokens=trees, contexts=contexts, beams=beams, reps=reps)
    finally:
        for h in hooks:
            h.remove()
    # every clock read comes right after a sync of the model's device
    for i, e in enumerate(log):
        if e[0] == "clock":
            assert i > 0 and log[i - 1] == ("sync", torch.device("cpu")), log[max(0, i - 3): i + 1]
    # clock reads pair up into regions; each region holds exactly one verify forward or one draft level,
    # then the sync before the stop; the prompt's prefill stays outside
    clocks = [i for i, e in enumerate(log) if e[0] == "clock"]
    assert len(clocks) % 2 == 0
    work_inside = []
    for start, stop in zip(clocks[::2], clocks[1::2]):
        inside = [e for e in log[start + 1: stop] if e[0] != "sync"]
        assert len(inside) == 1 and log[stop - 1][0] == "sync", log[start: stop + 1]
        work_inside.append(inside[0])
    assert sorted(work_inside) == sorted([("target", n) for _ in contexts for n in trees for _ in range(reps + 1)]
                                         + [("draft", b) for b in beams for _ in range(reps)])
    prefills = [e for e in log if e[0] == "target" and e[1] in contexts]
    assert prefills and all(e not in work_inside for e in prefills)


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
