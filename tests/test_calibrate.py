"""Cost model, per-bin optimiser and profiles."""
import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _doubles import StretchDraft  # noqa: E402
from test_decoding import prompts, tiny_target  # noqa: E402

from heterospec.policy.calibrate import CostModel, load_profile, optimise_policy, profile_costs, save_profile  # noqa: E402
from heterospec.policy import Policy  # noqa: E402
from heterospec.policy.trace import fit_thresholds, record  # noqa: E402

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
    static = stretch_trace.replay(Policy.static(BASE, K, N), cost_model=CPU_LIKE).predicted_tokens_per_s
    paper = stretch_trace.replay(Policy.paper(BASE, K, N, thresholds), cost_model=CPU_LIKE).predicted_tokens_per_s
    assert predicted >= paper >= 0 and predicted >= static
    r = stretch_trace.replay(policy, cost_model=CPU_LIKE)
    assert r.predicted_tokens_per_s == pytest.approx(predicted)
    # the easiest populated bin (lowest entropy, long acceptance) drafts deeper and verifies fewer nodes
    easy = min(r.per_bin)
    assert r.per_bin[easy]["mean_accepted"] > 2.0
    assert policy.extra[easy] >= 1 and policy.keep[easy] < N


def test_profile_round_trip_and_errors(tmp_path, stretch_trace):
    pol = Policy(BASE, K, N, (0.5, 1.0, 2.0), (3, 2, 0, 0), (6, 9, 16, 16), name="calibrated")
    path = tmp_path / "p.json"
    save_profile(path, pol, CPU_LIKE, target_id="tiny-llama", draft_id="stretch")
    again, cost, raw = load_profile(path, target_id="tiny-llama", draft_id="stretch")
    assert again == pol and cost == CPU_LIKE and raw["machine"]["platform"]
    with pytest.warns(UserWarning, match="calibrated for target"):
        load_profile(path, target_id="another-model")
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
        load_profile(path, target_id="tiny-llama", draft_id="stretch")  # no warning for the right pair
