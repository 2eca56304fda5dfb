"""`heterospec demo`: the comparison loop on tiny random models (identical outputs, the table, the
mismatch check), the command on a tiny pair saved to disk, and the shipped head for the default target."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _models import THRESHOLDS, eagle3_head, prompts, reference_greedy, tiny_target  # noqa: E402
from _pairs import need_default_target  # noqa: E402

from heterospec.tools import demo  # noqa: E402
from heterospec.policy import Policy  # noqa: E402


def _methods():
    return [("ar", Policy.autoregressive()), ("eagle3", Policy.static(4, 3, 12)),
            ("heterospec", Policy.paper(4, 3, 12, THRESHOLDS))]


def test_compare_gives_the_targets_greedy_output_for_every_method(tmp_path):
    model = tiny_target("llama")
    draft = eagle3_head(model, tmp_path / "draft")
    ps = prompts(3)
    res = demo.compare(model, draft, ps, _methods(), max_new_tokens=20, warmup_tokens=4)
    assert list(res) == ["ar", "eagle3", "heterospec"]
    assert res.mismatches() == []
    for i, p in enumerate(ps):
        ref = reference_greedy(model, p, 20)
        for name in res:
            assert res[name].sequences[i].tolist() == ref.tolist(), (name, i)
    for name, r in res.items():
        assert r.new_tokens == 60 and r.seconds > 0 and len(r.per_prompt_tps) == 3
    # autoregressive: one verification call per token after the prefill's, each committing one token
    assert res["ar"].cycles == 3 * 19 and res["ar"].tau == 1.0
    assert res["eagle3"].verified_tokens > res["eagle3"].cycles  # trees of several nodes
    rows = res.table().splitlines()
    assert rows[0].startswith("| method | tokens/s | per prompt (min-max) | x ar | tau |") and len(rows) == 5
    assert rows[2].split("|")[4].strip() == "1.00x"
    assert [r.split("|")[1].strip() for r in rows[2:]] == ["ar", "eagle3", "heterospec"]


def test_compare_puts_hf_generate_beside_ar(tmp_path):
    """42.4: the demo's methods include the target's own generate (what a user already has) and the table shows
    each method against it as well as against ar."""
    import heterospec
    from heterospec.tools.bench.methods import HFMethod

    assert heterospec.HFMethod is HFMethod and "HFMethod" in heterospec.__all__   # public, for compare()
    model = tiny_target("llama")
    draft = eagle3_head(model, tmp_path / "draft")
    methods = demo.default_methods(draft, Policy.paper(4, 3, 12, THRESHOLDS))
    assert [n for n, _ in methods] == ["ar", "hf", "lookup", "eagle3", "heterospec", "heterospec-lookup"]
    assert isinstance(methods[1][1], HFMethod) and methods[2][1] == Policy.autoregressive()
    assert methods[5][1] is methods[4][1]   # the same policy, with the prompt lookup's chains grafted on
    ps = prompts(2)
    res = demo.compare(model, draft, ps, methods, max_new_tokens=10, warmup_tokens=0)
    assert res.mismatches() == []
    assert res["hf"].sequences[1].tolist() == reference_greedy(model, ps[1], 10).tolist()
    assert res["hf"].new_tokens == 20 and res["hf"].cycles == 0
    header, rule, *rows = res.table().splitlines()
    cols = [c.strip() for c in header.split("|")[1:-1]]
    assert cols[3:5] == ["x ar", "x HF generate"] and len(rows) == 6 and rule.count("|") == header.count("|")
    cells = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[1:-1]] for r in rows}
    assert cells["ar"][3] == "1.00x" and cells["hf"][4] == "1.00x" and cells["hf"][5:] == ["-", "-", "-"]
    want = res["heterospec"].tokens_per_s / res["hf"].tokens_per_s
    assert cells["heterospec"][4] == f"{want:.2f}x"


def test_mismatch_check_fires_on_a_broken_method(tmp_path):
    model = tiny_target("llama")
    draft = eagle3_head(model, tmp_path / "draft")
    ps = prompts(2)
    res = demo.compare(model, draft, ps, _methods()[:2], max_new_tokens=12, warmup_tokens=0)
    broken = res["eagle3"].sequences[1].clone()
    pos = ps[1].shape[1] + 5
    broken[0, pos] = (broken[0, pos] + 1) % model.config.vocab_size
    res["eagle3"].sequences[1] = broken
    assert res.mismatches() == [("eagle3", 1, pos)]


def test_the_greedy_check_notes_transformers_half_arithmetic_and_fails_on_ours():
    """A bf16 model on our CPU decoder is computed in float32 (its float32 copy's output): transformers' own bf16
    generate ("hf") differing from ar is a note, not a failure; any method of ours differing fails, and in float32
    (or with our decoder off) "hf" differing fails too."""
    import io

    bad = [("hf", 0, 9), ("eagle3", 1, 12)]
    out = io.StringIO()
    assert demo.greedy_check(bad, ["ar", "hf", "eagle3"], "bfloat16", "target (AVX-512)", [4, 5], 2, out) == \
        [("eagle3", 1, 12)]
    text = out.getvalue()
    assert "note: hf differs from ar on prompt 0 at new token 5: transformers' generate rounds in bfloat16" in text
    assert "MISMATCH: eagle3 differs from ar on prompt 1 at new token 7" in text and "identical" not in text
    out = io.StringIO()
    assert demo.greedy_check(bad[:1], ["ar", "hf", "eagle3"], "bfloat16", "target (AVX-512)", [4, 5], 2, out) == []
    assert "identical greedy outputs across ar, eagle3 on all 2 prompts" in out.getvalue()
    for dtype, decoder in (("float32", "target (AVX-512)"), ("bfloat16", "off"), ("bfloat16", None)):
        out = io.StringIO()
        assert demo.greedy_check(bad[:1], ["ar", "hf"], dtype, decoder, [4, 5], 2, out) == bad[:1]
        assert "MISMATCH: hf differs from ar on prompt 0 at new token 5" in out.getvalue()


def test_demo_prompts_are_not_benchmark_prompts():
    texts = demo.demo_prompts()
    assert len(texts) >= 4 and all(isinstance(t, str) and t for t in texts)
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data", "questions")   # in the checkout
    if not os.path.isdir(bench):
        pytest.skip("benchmarks/ is not next to tests/ (CI's wheel stages copy tests/ alone)")
    seen = set()
    for name in sorted(n for n in os.listdir(bench) if n.endswith(".jsonl")):
        for line in open(os.path.join(bench, name)):
            if line.strip():
                seen.update(t.strip() for t in json.loads(line)["turns"])
    assert not seen.intersection(t.strip() for t in texts)


def test_demo_command_on_a_tiny_pair(tmp_path):
    from _pairs import save_tiny_pair

    from heterospec.policy.profile import save_profile

    save_tiny_pair(tmp_path)
    profile = tmp_path / "profile.json"
    save_profile(profile, Policy.paper(4, 3, 12, THRESHOLDS))
    cmd = [sys.executable, "-m", "heterospec", "demo", "--target", str(tmp_path / "target"), "--draft",
           str(tmp_path / "draft"), "--policy", str(profile), "--prompt", "w5 w17 w3 w40 w22",
           "--max-new-tokens", "12"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "identical greedy outputs across ar, hf, lookup, eagle3, heterospec, heterospec-lookup" in res.stdout
    assert "our engines' forwards: cpu_decoder target" in res.stdout   # a float32 Llama pair on the CPU: ours
    assert "[heterospec, streamed] >>> w5 w17 w3 w40 w22" in res.stdout
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["ar", "hf", "lookup", "eagle3", "heterospec",
                                                           "heterospec-lookup"]
    assert "x HF generate" in rows[0]
    # without a profile for a head of one's own, the heterospec row is left out and the reason printed
    res = subprocess.run(cmd[:8] + cmd[10:] + ["--no-stream"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "no profile for this head" in res.stdout and "| heterospec |" not in res.stdout
    assert "[eagle3] >>> w5 w17 w3 w40 w22" in res.stdout


def test_demo_refuses_a_missing_head(tmp_path):
    from _pairs import save_tiny_pair

    save_tiny_pair(tmp_path)
    res = subprocess.run([sys.executable, "-m", "heterospec", "demo", "--target", str(tmp_path / "target"),
                          "--draft", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "argument --draft: expected" in res.stderr and "no such directory" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_synthetic_demo_needs_no_models():
    res = subprocess.run([sys.executable, "-m", "heterospec", "demo", "--synthetic", "--vocab", "5000"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "verification tree" in res.stdout


# ---- the shipped head -----------------------------------------------------------------------------------

def test_shipped_head_files_and_provenance():
    from safetensors import safe_open

    d = demo.DEFAULT_HEAD
    if not os.path.exists(os.path.join(d, "config.json")):
        pytest.fail(f"the shipped head is missing from {d}")
    weights = os.path.join(d, "model.safetensors")
    assert os.path.getsize(weights) <= 25 * 2**20
    with safe_open(weights, "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes <= {"F16", "I64", "BOOL"}, dtypes
    prov = open(os.path.join(d, "PROVENANCE.md")).read()
    assert "heterospec train-draft" in prov and "machine" in prov.lower()
    from heterospec.policy.profile import load_profile

    policy, cost, raw = load_profile(demo.DEFAULT_PROFILE)
    # the Eq. 2 fit may merge bins (up to 7 thresholds); the policy keeps fewer nodes than the static tree
    assert 1 <= len(policy.thresholds) <= 7 and cost is not None
    # 42.2: the CPU profile was calibrated with --search-base-tree: its base tree is the static tree that measured
    # fastest on that machine, and the calibrated policy predicts no slower than that tree alone
    search = raw["notes"]["base_tree_search"]
    best = max(search["measured"], key=lambda t: t["measured_tokens_per_s"])
    assert (policy.depth, policy.top_k, policy.total_tokens) == (best["depth"], best["top_k"], best["nodes"])
    predicted = raw["notes"]["predicted_tokens_per_s"]
    assert predicted["calibrated"] >= predicted["static"] > 0


def test_shipped_head_loads_against_the_default_target():
    from heterospec.models import default as models

    need_default_target()
    from heterospec import HeteroSpec
    from heterospec.models.draft import Eagle3Draft

    model, tok = models.default_target()
    draft = Eagle3Draft.from_pretrained(demo.DEFAULT_HEAD, target=model, dtype=torch.float32)  # strict: every key and shape
    assert draft.config.vocab_size == 49152
    ids = demo._encode(tok, demo.demo_prompts()[0])
    ar, _ = HeteroSpec(model).generate(ids, max_new_tokens=24)
    sp, st = HeteroSpec(model, draft, Policy.static()).generate(ids, max_new_tokens=24)
    assert sp.tolist() == ar.tolist()
    assert st.tau > 1.5  # a trained head: well above the 1.0 of a head that never gets a token accepted


def test_default_target_pair_matches_the_shipped_profile_without_a_warning():
    """Issue 18.3: the shipped profile names its pair by identity (never a path), and the identity of the default
    target as this transformers converts it, with the shipped head, is that pair: no 'calibrated for' warning
    from an installed copy."""
    import argparse
    import warnings

    from heterospec.models import default as models
    from heterospec.tools.cli import pair_identity

    need_default_target()
    model, _ = models.default_target()
    t_id, d_id = pair_identity(argparse.Namespace(target="default", draft="default"), model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from heterospec.policy.profile import load_profile

        load_profile(demo.DEFAULT_PROFILE, target=t_id, draft=d_id)


def test_shipped_head_config_is_the_default_targets():
    """Issue 19.1: the shipped head attends with the target's own RoPE base and layer shapes.  The file alone:
    SmolLM2-135M-Instruct's published config has rope_theta 100000 (the head before issue 19 said 10000).
    With the default target: every field the head copies equals the target's, read here from the target's
    config directly (transformers 5 keeps the base in rope_parameters, 4.x in rope_theta)."""
    cfg = json.load(open(os.path.join(demo.DEFAULT_HEAD, "config.json")))
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    log = json.load(open(os.path.join(demo.DEFAULT_HEAD, "training_log.json")))
    assert log["ttt_steps"] == 7 and log["best_val_step"] is not None   # 7 training-time-test steps, validated

    from heterospec.models import default as models

    need_default_target()
    model, _ = models.default_target()
    t = model.config
    theta = (getattr(t, "rope_parameters", None) or {}).get("rope_theta", getattr(t, "rope_theta", None))
    assert cfg["rope_theta"] == float(theta)
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert cfg[k] == getattr(t, k), k
    assert cfg["head_dim"] == getattr(t, "head_dim", t.hidden_size // t.num_attention_heads)
    assert cfg["rms_norm_eps"] == pytest.approx(t.rms_norm_eps)


def test_no_machine_path_in_any_shipped_file():
    """Issue 28.6: nothing the package ships names a path on the machine that made it (the profile's
    notes.target_name held the conversion cache's absolute path until issue 27's re-calibration)."""
    import re

    data = os.path.join(os.path.dirname(demo.DEFAULT_HEAD))
    pattern = re.compile(r"(/root/|/home/|/work/|/tmp/|/Users/|[A-Za-z]:\\\\)")
    found = []
    for root, _, files in os.walk(data):
        for f in files:
            if f.endswith((".json", ".md", ".jinja", ".txt")):
                text = open(os.path.join(root, f), encoding="utf-8").read()
                found += [(f, m.group(0)) for m in pattern.finditer(text)]
    assert found == []
    prof = json.load(open(demo.DEFAULT_PROFILE))
    assert prof["notes"]["target_name"] == "SmolLM2-135M-Instruct"


def test_compare_interleaves_the_methods_prompt_by_prompt(tmp_path):
    """41.4: the methods take turns per prompt, the order rotated, so a background job slows all of them alike
    (it once landed on one method: HeteroSpec at 6.91x, then 1.05x on the rerun); the table shows each method's
    spread over the prompts."""
    model = tiny_target("llama")
    draft = eagle3_head(model, tmp_path / "draft")
    calls = []
    res = demo.compare(model, draft, prompts(4), _methods(), max_new_tokens=6, warmup_tokens=2,
                       progress=lambda name, i, n, streaming: calls.append((i, name)))
    assert calls == [(0, "ar"), (0, "eagle3"), (0, "heterospec"), (1, "eagle3"), (1, "heterospec"), (1, "ar"),
                     (2, "heterospec"), (2, "ar"), (2, "eagle3"), (3, "ar"), (3, "eagle3"), (3, "heterospec")]
    assert res.mismatches() == [] and all(len(r.sequences) == 4 for r in res.values())
    header, rule, *rows = res.table().splitlines()
    assert "per prompt (min-max)" in header and len(rows) == 3
    lo, hi = (float(v) for v in rows[0].split("|")[3].split("-"))
    assert 0 < lo <= hi


def test_a_busy_machine_is_named_in_one_line():
    from heterospec import measure

    assert measure.load_warning(load=1.5, cores=2) is None
    w = measure.load_warning(load=3.2, cores=2)
    assert w.startswith("warning: the machine's load (3.2) exceeded its 2 cores") and "\n" not in w


def test_two_conversions_into_one_cache_leave_one_whole_cache(tmp_path):
    """Processes converting the default target at once (two notebooks, a test run spread over cores) each write
    a folder of their own and rename it into place: the first wins, the second leaves the cache as it is and
    removes its own folder (they once shared one `.tmp` folder, each writing into the other's files)."""
    from _pairs import save_tiny_pair

    from heterospec.models import default as models

    model, tok = save_tiny_pair(tmp_path)
    cache = str(tmp_path / "cache")
    models._save_plain(model, tok, cache, {"who": "first"})
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)     # the second conversion's weights differ: it must not land
    models._save_plain(model, tok, cache, {"who": "second"})
    assert sorted(os.listdir(tmp_path)) == ["cache", "draft", "target"]      # no folder left behind
    with open(os.path.join(cache, models.CACHE_METADATA)) as f:
        assert json.load(f) == {"who": "first"}
    kept = transformers.AutoModelForCausalLM.from_pretrained(cache)
    assert not torch.equal(kept.lm_head.weight, model.lm_head.weight)
    (tmp_path / "cache" / "config.json").unlink()                           # a cache that is not whole
    with pytest.raises(OSError):
        models._save_plain(model, tok, cache, None)


def test_conversions_take_turns_under_the_cache_lock(tmp_path):
    """A second process finding no cache waits for the first one's conversion (then loads its cache) instead
    of converting at the same time: flock locks are per open file, so two threads show it in one process."""
    import threading
    import time

    from heterospec.models import default as models

    cache, order = str(tmp_path / "home" / "cache"), []
    first_in = threading.Event()

    def convert(name, hold):
        with models._one_conversion_at_a_time(cache):
            order.append(f"{name} in")
            first_in.set()
            time.sleep(hold)
            order.append(f"{name} out")

    a = threading.Thread(target=convert, args=("a", 0.5))
    a.start()
    assert first_in.wait(10)
    b = threading.Thread(target=convert, args=("b", 0.0))
    b.start()
    a.join(), b.join()
    assert order == ["a in", "a out", "b in", "b out"]
    assert os.path.exists(cache + ".lock") and not os.path.exists(cache)   # the lock makes its folder, not the cache
