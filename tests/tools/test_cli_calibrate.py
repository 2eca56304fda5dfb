"""`heterospec calibrate` on a tiny pair saved to disk, then `heterospec generate --policy` with the profile."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from _pairs import save_tiny_pair  # noqa: E402
from _models import reference_greedy  # noqa: E402

from heterospec.policy.profile import load_profile  # noqa: E402


def test_calibrate_then_generate_with_the_profile(tmp_path):
    model, tok = save_tiny_pair(tmp_path)
    questions = tmp_path / "question.jsonl"
    with open(questions, "w") as f:
        for i in range(6):
            f.write(json.dumps({"question_id": i, "turns": [" ".join(f"w{(7 * i + j) % 90}" for j in range(5))]}) + "\n")
    profile = tmp_path / "profile.json"
    res = subprocess.run(
        [sys.executable, "-m", "heterospec", "calibrate", "--target", str(tmp_path / "target"), "--draft",
         str(tmp_path / "draft"), "--prompts", str(questions), "--out", str(profile), "--max-new-tokens", "24",
         "--depth", "3", "--top-k-tree", "3", "--total-tokens", "8", "--max-prompts", "5", "--device", "cpu"],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "| bin | share of cycles |" in res.stdout and "calibrated: tau" in res.stdout
    assert "recording traces" in res.stderr  # the progress bar
    policy, cost, raw = load_profile(profile)
    assert raw["model_pair"]["draft"]["name"] == "draft" and raw["model_pair"]["target"]["name"] == "target"
    assert str(tmp_path) not in json.dumps(raw["model_pair"])      # identities, never paths (issue 18.3)
    assert str(tmp_path) not in json.dumps(raw["notes"]) and raw["notes"]["target_name"] == "target"  # 28.6
    assert policy.depth == 3 and policy.top_k == 3 and cost is not None
    assert raw["notes"]["prompts"] == 5 and raw["notes"]["positions"] == 5 * 23
    # the per-bin table has the predicted tau and tokens/s, and the profile keeps them (issue 19.4)
    assert "| predicted tau | predicted tokens/s |" in res.stdout
    per_bin = raw["notes"]["per_bin"]
    assert per_bin and sum(v["cycles"] for v in per_bin.values()) > 0
    assert all(v["predicted_tokens_per_s"] > 0 for v in per_bin.values())
    assert len(per_bin) <= len(policy.thresholds) + 1
    # autoregressive decoding predicted beside the trees (tau 1: one token a call), and a warning where it wins
    pred = raw["notes"]["predicted_tokens_per_s"]
    assert "autoregressive: tau 1.00, calls " in res.stdout and pred["autoregressive"] > 0
    warned = "autoregressive decoding is predicted faster on this machine" in res.stderr
    assert warned == (pred["autoregressive"] > pred["calibrated"])
    png = tmp_path / "profile.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"

    prompt = "w5 w17 w3 w40 w22"
    res = subprocess.run(
        [sys.executable, "-m", "heterospec", "generate", "--target", str(tmp_path / "target"), "--draft",
         str(tmp_path / "draft"), "--prompt", prompt, "--policy", str(profile), "--max-new-tokens", "12", "--no-eos"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    expected = tok.decode(reference_greedy(model, ids, 12)[0, ids.shape[1]:])
    assert expected.strip() in res.stdout


def test_calibrate_searches_the_base_tree_first(tmp_path):
    """Issue 19.4: --search-base-tree finds the static base tree that is fastest here (as bench's eagle3-tuned)
    before fitting the bins: the profile's base tree is the search's choice, one of the grid's trees, and
    the search (grid replayed, best trees timed) is recorded in the profile's notes."""
    from heterospec.tools.bench import TUNE_DEPTHS, TUNE_NODES

    save_tiny_pair(tmp_path)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"w{i} w{i + 7} w{i + 3}"]}) for i in range(4)) + "\n")
    profile = tmp_path / "searched.json"
    res = subprocess.run(
        [sys.executable, "-m", "heterospec", "calibrate", "--target", str(tmp_path / "target"), "--draft",
         str(tmp_path / "draft"), "--prompts", str(questions), "--out", str(profile), "--max-new-tokens", "12",
         "--top-k-tree", "3", "--search-base-tree", "--search-prompts", "2", "--device", "cpu"],
        capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr
    policy, _, raw = load_profile(profile)
    search = raw["notes"]["base_tree_search"]
    chosen = search["chosen"]
    assert (policy.depth, policy.top_k, policy.total_tokens) == (chosen["depth"], 3, chosen["nodes"])
    assert chosen["depth"] in TUNE_DEPTHS and chosen["nodes"] in TUNE_NODES
    assert len(search["grid"]) == len(TUNE_DEPTHS) * len(TUNE_NODES) and len(search["measured"]) == 3
    best = max(search["measured"], key=lambda g: g["measured_tokens_per_s"])
    assert (best["depth"], best["nodes"]) == (chosen["depth"], chosen["nodes"])
    assert f"base tree searched on this machine: depth {chosen['depth']}, top_k 3, {chosen['nodes']} nodes" in res.stdout


# ---- calibrate --engine vllm: one CLI for both engines (issue 45.2) -----------------------------------------

def _vllm_args(tmp_path, *extra):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"turns": [f"w{i} w{i + 7} w{i + 3}"]}) for i in range(5)) + "\n")
    return ["calibrate", "--engine", "vllm", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
            "--prompts", str(questions), "--out", str(tmp_path / "chain.json"), *extra]


@pytest.mark.parametrize("extra, arg", [(["--depth", "5"], "--depth"), (["--total-tokens", "30"], "--total-tokens"),
                                        (["--search-base-tree"], "--search-base-tree"),
                                        (["--max-chain", "0"], "--max-chain"), (["--batch", "0"], "--batch")])
def test_calibrate_for_vllm_refuses_what_only_the_tree_engine_reads(tmp_path, extra, arg):
    save_tiny_pair(tmp_path)
    res = subprocess.run([sys.executable, "-m", "heterospec", *_vllm_args(tmp_path, *extra)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"heterospec calibrate: error: argument {arg}: expected "), line


def test_calibrate_for_vllm_needs_hf_directories_and_vllm(tmp_path):
    import importlib.util

    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    res = subprocess.run([sys.executable, "-m", "heterospec", *_vllm_args(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "argument --target: expected a HuggingFace model directory" in res.stderr
    if importlib.util.find_spec("vllm") is None:
        (tmp_path / "pair").mkdir()
        save_tiny_pair(tmp_path / "pair")
        args = _vllm_args(tmp_path / "pair")
        res = subprocess.run([sys.executable, "-m", "heterospec", *args], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "argument --engine: expected vLLM installed" in res.stderr


def test_calibrate_for_vllm_passes_its_options_to_the_chain_calibration(tmp_path, monkeypatch, capsys):
    """The command's wiring, without vLLM: the prompts encoded with the target's tokenizer (chat template off),
    --max-chain / --batch / --top-k-tree / --max-new-tokens handed to calibrate_chain, its summary printed."""
    import importlib.util

    from heterospec.integrations import vllm_runner
    from heterospec.tools import cli

    _, tok = save_tiny_pair(tmp_path)
    seen = {}

    def fake(target, draft, prompts, out, **kw):
        seen.update(target=target, draft=draft, prompts=prompts, out=out, **kw)
        report = {"chosen": {"lengths": [4, 1], "thresholds": [2.5], "positions": 1, "rate": 12.0},
                  "fixed": {1: 9.0, 2: 10.0}, "request_steps": 40, "checks": {"matched": 40}}
        return None, 4, report

    monkeypatch.setattr(vllm_runner, "calibrate_chain", fake)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert cli.main(_vllm_args(tmp_path, "--max-chain", "5", "--batch", "3", "--top-k-tree", "7",
                               "--max-new-tokens", "40", "--max-prompts", "4", "--no-chat-template")) == 0
    assert (seen["max_tokens"], seen["batch"], seen["top_k"], seen["max_new_tokens"]) == (5, 3, 7, 40)
    assert seen["target"] == str(tmp_path / "target") and seen["out"] == str(tmp_path / "chain.json")
    assert seen["prompts"] == [tok(f"w{i} w{i + 7} w{i + 3}")["input_ids"] for i in range(4)]
    out = capsys.readouterr().out
    assert "chain lengths [4, 1] over 2 bin(s)" in out and "pass num_speculative_tokens=4" in out


def test_the_old_vllm_calibrate_entry_says_where_it_went():
    res = subprocess.run([sys.executable, "-m", "heterospec.integrations.vllm", "calibrate"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1 and "heterospec calibrate --engine vllm" in res.stderr
