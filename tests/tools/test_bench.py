"""`heterospec bench`: question files, the methods, the run on a tiny pair saved to disk (JSON schema,
markdown tables, plots, EAGLE-style answers, the second turn after the model's own first answer, both
temperatures), the eagle3-tuned search, the identical-output check firing on a broken method, and one
small run on the real default pair (CI's last stage)."""
import json
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from _pairs import save_tiny_pair  # noqa: E402
from _models import THRESHOLDS  # noqa: E402

from heterospec.tools import bench  # noqa: E402
from heterospec import HeteroSpec, Policy  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _questions(root):
    """Two small question files in the EAGLE format: one of two-turn questions, one in a question.jsonl
    directory (named by its directory, as in EAGLE's data/<bench>/question.jsonl)."""
    chat = root / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"question_id": 100 + i, "category": "x",
                                          "turns": [f"w{3 + i} w17 w40 w22", f"w{9 + i} w5"]}) for i in range(3)) + "\n")
    (root / "code").mkdir()
    code = root / "code" / "question.jsonl"
    code.write_text("".join(json.dumps({"question_id": i, "turns": [f"w{20 + i} w8 w31"]}) + "\n\n" for i in range(4)))
    return [chat, code]


def _pair(tmp_path):
    from heterospec.policy.profile import save_profile

    save_tiny_pair(tmp_path)
    save_profile(tmp_path / "profile.json", Policy(4, 3, 12, THRESHOLDS, (2, 1, 0), (4, 8, 12), name="calibrated"))
    return ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--profile",
            str(tmp_path / "profile.json")]


# ---- questions and methods ------------------------------------------------------------------------------------

def test_load_questions_reads_eagle_files_and_names_them(tmp_path):
    chat, code = _questions(tmp_path)
    qs = bench.load_questions([chat, code], limit=2)
    assert list(qs) == ["chat", "code"]
    assert [q["question_id"] for q in qs["chat"]] == [100, 101] and len(qs["chat"][0]["turns"]) == 2
    assert [q["question_id"] for q in bench.load_questions([code])["code"]] == [0, 1, 2, 3]  # blank lines skipped


@pytest.mark.parametrize("content, needle", [
    ('{"question_id": 1}\n', "expected an EAGLE question record"),
    ('{"turns": []}\n', "expected an EAGLE question record"),
    ('{"turns": ["ok", 3]}\n', "expected an EAGLE question record"),
    ("not json\n", "is not JSON"),
    ("\n\n", "no questions in"),
])
def test_load_questions_names_the_bad_line(tmp_path, content, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(ValueError, match=needle) as e:
        bench.load_questions([p])
    if "no questions" not in needle:
        assert "bad.jsonl:" in str(e.value)


def test_load_questions_refuses_a_missing_file_a_bad_limit_and_two_files_of_one_name(tmp_path):
    chat, _ = _questions(tmp_path)
    with pytest.raises(ValueError, match="cannot read question file"):
        bench.load_questions([tmp_path / "nowhere.jsonl"])
    with pytest.raises(ValueError, match="argument 'limit' expected an int >= 1, got 0"):
        bench.load_questions([chat], limit=0)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "chat.jsonl").write_text(chat.read_text())
    with pytest.raises(ValueError, match="two files named 'chat'"):
        bench.load_questions([chat, tmp_path / "b" / "chat.jsonl"])


def test_build_methods_and_their_errors():
    prof = Policy(7, 10, 60, THRESHOLDS, (4, 3, 2), (20, 40, 62), name="calibrated")
    tuned = Policy.static(3, 10, 8)
    hs_tuned = Policy(3, 10, 8, (1.0,), (1,), (4,), name="heterospec-tuned")
    m = dict(bench.build_methods(list(bench.METHODS), draft=object(), profile=prof, tuned=tuned, tuned_profile=hs_tuned))
    assert list(m) == list(bench.METHODS)
    assert m["ar"] == Policy.autoregressive() and m["eagle3"] == Policy.static(7, 10, 60)
    assert m["eagle3-tuned"] is tuned and m["heterospec"] is prof and m["heterospec-tuned"] is hs_tuned
    assert m["heterospec-paper"] == Policy.paper(7, 10, 60, THRESHOLDS)  # the paper's rule on the profile's bins
    assert m["hf"] == bench.HFMethod("hf") and m["hf-static"].cache_implementation == "static"
    assert m["hf-lookup"].prompt_lookup_num_tokens == 10 and not m["hf-lookup"].drafts
    assert not m["hf-static"].compile_all_devices and m["hf-static"].as_dict()["compile"] == "transformers' criterion"
    assert m["hf-compiled"].cache_implementation == "static" and m["hf-compiled"].compile_all_devices
    assert m["hf-compiled"].as_dict()["compile"] == "on every device"
    # our prompt lookup: the autoregressive policy or the profile, with the engine's lookup options
    assert m["lookup"] == Policy.autoregressive() and m["heterospec-lookup"] is prof
    assert bench.engine_options("lookup") == {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 3,
                                              "min_matching_ngram_size": 2} and bench.engine_options("eagle3") == {}
    assert bench.method_dict(m["lookup"], "lookup")["prompt_lookup_num_tokens"] == 4
    # bench's default: every method but hf-compiled (minutes of compilation on a CPU) and our lookup methods
    assert bench.DEFAULT_METHODS == tuple(n for n in bench.METHODS
                                          if n not in ("hf-compiled", "lookup", "heterospec-lookup"))
    # the HuggingFace baselines need no draft
    assert [n for n, _ in bench.build_methods(["ar", "hf", "hf-static", "hf-compiled", "hf-lookup", "lookup"])] == \
        ["ar", *bench.HF_METHODS, "lookup"]
    with pytest.raises(ValueError, match="argument 'methods' expected distinct names from .*hf-lookup.*got hf, hf-fast"):
        bench.build_methods(["hf", "hf-fast"])
    with pytest.raises(ValueError, match="argument 'methods' expected distinct names from .*got ar, medusa"):
        bench.build_methods(["ar", "medusa"])
    with pytest.raises(ValueError, match="argument 'methods'"):
        bench.build_methods(["ar", "ar"])
    with pytest.raises(ValueError, match="method 'eagle3' needs a draft head"):
        bench.build_methods(["ar", "eagle3"])
    with pytest.raises(ValueError, match="'heterospec-paper' needs a calibrated profile"):
        bench.build_methods(["heterospec-paper"], draft=object())
    with pytest.raises(ValueError, match="'eagle3-tuned' needs a tuned tree"):
        bench.build_methods(["eagle3-tuned"], draft=object())
    with pytest.raises(ValueError, match="'heterospec-tuned' needs tuning prompts"):
        bench.build_methods(["heterospec-tuned"], draft=object(), tuned=tuned)
    assert bench.parse_tree("3,10,8") == Policy.static(3, 10, 8)
    # the paper's rule on a shallow tree (alpha = 1): bin 2's alpha - i = -1 is taken as 0
    shallow = Policy.paper(2, 10, 6, (1.0, 2.0, 3.0))
    assert shallow.extra == (1, 0, 0) and shallow.keep == (round(0.3 * 6) + 1, round(0.6 * 6), 6)
    with pytest.raises(ValueError, match="'--tuned-tree' expected DEPTH,TOP_K,NODES"):
        bench.parse_tree("3,10")


def test_second_turn_is_asked_after_the_models_own_answer():
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = ["user", "assistant", "q1", "a1", "q2", ":"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}},
                                                           unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant : {% endif %}")
    ids = bench.encode_turn(fast, ["q1", "q2"], ["a1"])
    assert fast.decode(ids[0]).split() == "user : q1 assistant : a1 user : q2 assistant :".split()
    assert fast.decode(bench.encode_turn(fast, ["q1", "q2"], [])[0]).split() == "user : q1 assistant :".split()
    plain = bench.encode_turn(fast, ["q1", "q2"], ["a1"], chat=False)
    assert fast.decode(plain[0]).split() == ["q1", "a1", "q2"]


# ---- the command on a tiny pair ---------------------------------------------------------------------------

def test_bench_command_writes_json_tables_plots_and_answers(tmp_path):
    pair = _pair(tmp_path)
    qfiles = _questions(tmp_path)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "heterospec", "bench", *pair, "--questions", *map(str, qfiles), "--limit", "2",
           "--max-new-tokens", "10", "--temperature", "0", "1", "--tuned-tree", "3,3,6", "--warmup-tokens", "4",
           "--tune-prompts", str(_tune_prompts(tmp_path)), "--tune-limit", "2", "--tune-max-new-tokens", "8",
           "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    # the progress bar in a log (stderr is a pipe here): one bar a temperature, a redraw per 5% of its turns
    # (text=True reads tqdm's \r as a line end)
    assert res.stderr.count("bench [" + "#" * 24 + "]") == 2 and 2 * 10 < res.stderr.count("bench [") <= 2 * 22
    r = json.loads((out / "results.json").read_text())
    assert r["schema"] == bench.SCHEMA
    for key in ("command", "settings", "models", "methods", "tuning", "machine", "runs", "seconds"):
        assert key in r, key
    assert r["settings"]["max_new_tokens"] == 10 and r["settings"]["limit"] == 2
    assert r["machine"]["torch"] == torch.__version__ and "build" in r["machine"]
    assert r["tuning"]["chosen"] == {"depth": 3, "top_k": 3, "nodes": 6}
    assert r["methods"]["eagle3-tuned"]["total_tokens"] == 6 and r["methods"]["heterospec"]["keep"] == [4, 8, 12]
    # heterospec-tuned: calibrated on the given base tree, from the tuning prompts' trace
    ht = r["methods"]["heterospec-tuned"]
    assert (ht["depth"], ht["top_k"], ht["total_tokens"]) == (3, 3, 6)
    assert ht["thresholds"] == r["tuning"]["heterospec_tuned"]["thresholds"] and len(ht["extra"]) == len(ht["thresholds"]) + 1
    assert all(0 <= e <= 3 for e in ht["extra"])
    assert [run["temperature"] for run in r["runs"]] == [0.0, 1.0]
    names = list(bench.DEFAULT_METHODS)   # no --methods: all but hf-compiled
    for run in r["runs"]:
        assert list(run["files"]) == ["chat", "code"] and list(run["mean"]) == names
        for b, by_m in run["files"].items():
            assert list(by_m) == names
            for n, m in by_m.items():
                assert m["questions"] == 2 and m["turns"] == (4 if b == "chat" else 2)
                assert m["new_tokens"] > 0 and m["seconds"] > 0 and m["speedup"] > 0 and m["speedup_over_hf"] > 0
                assert len(m["per_question_tokens_per_s"]) == 2
                if n in bench.HF_METHODS:  # no draft, no verification calls: None, never a made-up number
                    assert m["tau"] is m["verification_calls"] is m["verified_tokens"] is m["time_split_s"] is None
                    assert m["bins"] == {} and run["mean"][n]["tau"] is None
                    continue
                assert m["verification_calls"] > 0
                assert set(m["time_split_s"]) == {"prefill", "draft", "verify", "ops", "graph", "idle", "loop"}
                assert abs(sum(m["time_split_share"].values()) - 1) < 1e-6
                if n.startswith("heterospec") and (n != "heterospec-tuned" or ht["thresholds"]):
                    assert abs(sum(v["share"] for v in m["bins"].values()) - 1) < 1e-9
                    assert sum(v["cycles"] for v in m["bins"].values()) == m["verification_calls"]
                    # measured per bin: tau from the accepted tokens, tokens/s over the bin's cycles' time
                    assert sum(v["seconds"] for v in m["bins"].values()) <= m["seconds"]
                    for v in m["bins"].values():
                        assert v["tau"] == pytest.approx(1 + v["mean_accepted"]) and v["tokens_per_s"] > 0
                else:
                    assert m["bins"] == {}
            ar = by_m["ar"]
            assert ar["speedup"] == 1.0 and ar["tau"] == 1.0 and ar["verified_tokens"] == ar["verification_calls"]
            assert by_m["eagle3"]["verified_tokens"] > by_m["eagle3"]["verification_calls"]  # trees of many nodes
            assert by_m[run["strongest_hf"]]["speedup_over_hf"] == 1.0
        # the strongest HF baseline: the best mean tokens/s of the three; hf-static warmed up, not compiled on a CPU
        assert run["strongest_hf"] == max((n for n in bench.HF_METHODS if n in names),
                                          key=lambda n: run["mean"][n]["tokens_per_s"])
        assert "hf_compiled" not in run
        assert set(run["warmup_s"]) == set(names) and all(v > 0 for v in run["warmup_s"].values())
        # 42.1: the CPU matrix path our engines measured and chose, per method (HF's baselines run torch's own)
        assert set(run["cpu_gemm"]) == {n for n in names if n not in bench.HF_METHODS}
        assert all(v == "off" or v.startswith("matrix paths: 1 row ") for v in run["cpu_gemm"].values()) and run["hf_static"]["static_cache_len"] > 10
        assert r["methods"]["hf-static"]["cache_implementation"] == "static"
    assert r["runs"][0]["mismatches"] == [] and r["runs"][1]["mismatches"] == []  # only checked at T=0
    # the markdown: Table-1 layout (with the speedup over the strongest HF baseline), one row per method, and
    # the identical-output line
    md = (out / "results.md").read_text()
    hf = r["runs"][0]["strongest_hf"]
    assert (f"| Method | chat speedup | chat vs {hf} | chat τ | code speedup | code vs {hf} | code τ | Mean speedup | "
            f"Mean vs {hf} | Mean τ |") in md
    assert f"over {hf} (the strongest HuggingFace baseline in this run" in md
    assert "hf-static on cpu: static cache of" in md and "not compiled" in md and "Warm-up before the timed run" in md
    assert "| hf | – | – | – | – | – | – |" in md  # no verification calls for a baseline
    assert "Temperature 1" in md
    for n in names:
        assert md.count(f"| {n} | ") >= 2 * 2 + 2 * 2  # two tables per temperature + time-split rows
    assert ("Identical greedy outputs across ar, hf, hf-static, hf-lookup, eagle3, eagle3-tuned, heterospec-paper, "
            "heterospec, heterospec-tuned") in md
    assert "heterospec-tuned: on that base tree, entropy bins" in md
    assert "per entropy bin, measured (all files pooled)" in md
    assert re.search(r"\| heterospec \| \d \| [01]\.\d{3} \| \d+\.\d\d \| \d+\.\d \|", md)
    assert md in res.stdout
    for png in ("speedup.png", "tau_vs_verified.png", "bins.png", "speedup_t1.png", "bins_t1.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG and len(data) > 5000, png
    assert "| Method | chat calls | chat verified | code calls | code verified | Total calls | Total verified |" in md
    # --report writes the markdown and the plots again from the JSON alone
    for f in ("results.md", "speedup.png", "bins.png"):
        (out / f).unlink()
    rep = subprocess.run([sys.executable, "-m", "heterospec", "bench", "--report", str(out / "results.json")],
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert (out / "results.md").read_text() == md and (out / "speedup.png").read_bytes()[:8] == PNG
    assert (out / "bins.png").exists()
    rep = subprocess.run([sys.executable, "-m", "heterospec", "bench", "--report", str(out / "answers.jsonl")],
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 2 and "--report expected a results.json" in rep.stderr and "Traceback" not in rep.stderr
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 2 * 2 * len(names) * 2  # temperatures x files x methods x questions
    a = next(a for a in answers if a["bench"] == "chat" and a["method"] == "heterospec" and a["temperature"] == 0)
    assert len(a["turns"]) == 2 and len(a["new_tokens"]) == 2 and len(a["wall_time"]) == 2
    greedy = {(a["bench"], a["question_id"]): a["turns"] for a in answers if a["temperature"] == 0 and a["method"] == "ar"}
    for a in answers:
        if a["temperature"] == 0:
            assert a["turns"] == greedy[(a["bench"], a["question_id"])], a["method"]


def test_bench_outputs_equal_the_targets_greedy_answers_turn_by_turn(tmp_path):
    """The second turn's prompt holds the first answer: the outputs equal a hand-rolled HF greedy run of
    the same conversation."""
    model, tok = save_tiny_pair(tmp_path)
    qs = bench.load_questions(_questions(tmp_path)[:1], limit=1)
    q = qs["chat"][0]
    from heterospec.models.draft import Eagle3Draft

    draft = Eagle3Draft.from_pretrained(str(tmp_path / "draft"), target=model)
    prof = Policy(3, 3, 8, THRESHOLDS, (1, 1, 0), (4, 6, 8), name="calibrated")
    methods = [("ar", Policy.autoregressive()), ("eagle3", Policy.static(3, 3, 8))] + \
        bench.build_methods(["lookup", "heterospec-lookup"], draft=draft, profile=prof)
    r = bench.run_bench(model, tok, draft, methods, qs, max_new_tokens=8, warmup_tokens=0,
                        eos_token_id=tok.eos_token_id)
    answers = []
    for turn in range(2):
        ids = bench.encode_turn(tok, q["turns"], answers)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                             pad_token_id=0, eos_token_id=tok.eos_token_id)
        answers.append(tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True))
    for a in r["answers"]:
        assert a["turns"] == answers, a["method"]
    assert r["mismatches"] == []


# ---- the HuggingFace baselines --------------------------------------------------------------------------------

HF_ALL = ["ar", *bench.HF_METHODS]
# the baselines transformers does not compile on a CPU: the calls of the tests below that vary max_new_tokens
# (each static-cache length a compilation of hf-compiled's); hf-compiled makes the same call with one more
# argument, and its tokens are checked in the run of every baseline
HF_EAGER = [n for n in bench.HF_METHODS if not bench.HF_BASELINES[n].compile_all_devices]


def _tiny(tmp_path):
    model, tok = save_tiny_pair(tmp_path)
    return model, tok, bench.load_questions(_questions(tmp_path), limit=2)


def test_hf_baselines_run_and_their_greedy_tokens_equal_ars(tmp_path):
    """hf, hf-static, hf-compiled and hf-lookup through model.generate: the same tokens as ar at T=0 in fp32
    (both turns, the second after each method's own first answer), the table's fields where they apply and
    None where they do not, warm-up times apart, hf-static uncompiled on the CPU as transformers leaves it and
    hf-compiled compiled there."""
    model, tok, qs = _tiny(tmp_path)
    r = bench.run_bench(model, tok, None, bench.build_methods(HF_ALL), qs, max_new_tokens=12, warmup_tokens=3,
                        eos_token_id=tok.eos_token_id)
    assert r["mismatches"] == []
    by = {}
    for a in r["answers"]:
        by.setdefault((a["bench"], a["question_id"]), {})[a["method"]] = (a["turns"], a["new_tokens"])
    for key, per_method in by.items():
        assert set(per_method) == set(HF_ALL)
        for n in bench.HF_METHODS:
            assert per_method[n] == per_method["ar"], (key, n)
    for n in bench.HF_METHODS:
        for b in qs:
            m = r["files"][b][n]
            assert m["new_tokens"] == r["files"][b]["ar"]["new_tokens"] and m["tokens_per_s"] > 0 and m["speedup"] > 0
            assert m["tau"] is None and m["verification_calls"] is None and m["verified_tokens"] is None
            assert m["time_split_share"] is None and m["bins"] == {}
        assert r["mean"][n]["tau"] is None and r["mean"][n]["verification_calls"] is None
    assert r["mean"]["ar"]["tau"] == 1.0 and r["mean"]["ar"]["verification_calls"] > 0
    assert set(r["warmup_s"]) == set(HF_ALL)
    assert r["hf_static"]["compiled"] is False and r["hf_static"]["device"] == "cpu"
    assert r["hf_compiled"]["compiled"] is True and r["hf_compiled"]["device"] == "cpu"
    assert r["hf_compiled"]["static_cache_len"] == r["hf_static"]["static_cache_len"]
    md = bench.markdown({"models": {"target": "tiny", "draft": None}, "runs": [r], "machine": {"summary": "here"},
                         "settings": {"device": "cpu", "dtype": "float32", "max_new_tokens": 12, "limit": 2, "seed": 0}})
    assert "hf-compiled on cpu: static cache of" in md and "(asked to compile on every device)" in md
    # the static cache holds the longest conversation: longest prompt + two answers of 12 (+ margin)
    assert r["hf_static"]["static_cache_len"] >= max(bench.encode_turn(tok, q["turns"], [""] * (len(q["turns"]) - 1)).shape[1]
                                                     for b in qs for q in qs[b]) + 2 * 12
    assert r["strongest_hf"] in bench.HF_METHODS


def test_hf_baselines_stop_at_the_same_eos_and_budget_as_the_engine(tmp_path):
    """EOS ids (an int or a list) and max_new_tokens as the engine: tokens up to and including the first
    EOS, the count includes it; without EOS ids, exactly max_new_tokens tokens."""
    model, tok, _ = _tiny(tmp_path)
    ids = tok("w5 w17 w3 w40", return_tensors="pt")["input_ids"]
    with HeteroSpec(model, None, Policy.autoregressive()) as hs:
        free, st = hs.generate(ids, max_new_tokens=16)
        new = free[0, ids.shape[1]:].tolist()
        assert st.new_tokens == 16
        eos = new[5]  # a token the model does say: its first appearance ends the answer
        stop = new.index(eos) + 1
        for e in (eos, [96, eos]):
            seq, st = hs.generate(ids, max_new_tokens=16, eos_token_id=e)
            assert st.new_tokens == stop and seq[0, ids.shape[1]:].tolist() == new[:stop]
    for n in HF_EAGER:
        g = bench.HFGenerate(model, bench.HF_BASELINES[n], pad_token_id=0)
        seq, st = g.generate(ids, max_new_tokens=16)
        assert st.new_tokens == 16 and seq[0, ids.shape[1]:].tolist() == new, n
        for e in (eos, [96, eos]):
            seq, st = g.generate(ids, max_new_tokens=16, eos_token_id=e)
            assert st.new_tokens == stop and seq[0, ids.shape[1]:].tolist() == new[:stop], (n, e)
        seq, st = g.generate(ids, max_new_tokens=3, eos_token_id=eos)
        assert st.new_tokens == 3 and seq[0, ids.shape[1]:].tolist() == new[:3], n


def test_hf_baselines_ignore_the_checkpoints_generation_config(tmp_path):
    """A checkpoint's generation config (repetition penalty, min length, sampling defaults) and forward
    hooks on its layers change nothing: the baselines decode what the engine decodes; the model is left as
    it was.  At T > 0 they sample, reproducibly per seed, within the budget."""
    model, tok, _ = _tiny(tmp_path)
    ids = tok("w9 w2 w33", return_tensors="pt")["input_ids"]
    with HeteroSpec(model, None, Policy.autoregressive()) as hs:
        ref = hs.generate(ids, max_new_tokens=10)[0][0].tolist()
    gc = model.generation_config
    gc.repetition_penalty, gc.min_new_tokens, gc.do_sample, gc.top_k = 3.0, 10, True, 2
    # a forward pre-hook on a layer, as an open drafting engine puts there to capture hidden states: off
    # during the baselines' calls, back afterwards
    calls = []
    handle = model.model.layers[1].register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        for n in HF_EAGER:
            g = bench.HFGenerate(model, bench.HF_BASELINES[n], pad_token_id=0)
            assert g.generate(ids, max_new_tokens=10)[0][0].tolist() == ref, n
            a, sa = g.generate(ids, max_new_tokens=10, temperature=1.5, seed=7)
            b, _ = g.generate(ids, max_new_tokens=10, temperature=1.5, seed=7)
            assert a.tolist() == b.tolist() and 1 <= sa.new_tokens <= 10 and a.shape[1] == ids.shape[1] + sa.new_tokens
            assert model.generation_config is gc and gc.repetition_penalty == 3.0
        assert calls == []
        model(ids)
        assert calls == [1]
    finally:
        handle.remove()
        gc.repetition_penalty, gc.min_new_tokens, gc.do_sample, gc.top_k = 1.0, None, False, 50


def test_speedup_over_the_strongest_hf_baseline_is_computed_from_the_measured_numbers():
    """The strongest HF baseline is the one with the best mean tokens/s; each row's speedup over it is, per
    file, the mean over questions of the ratio of tokens/s (as the speedup over ar), and in the Mean column
    the mean over files."""
    def row(q_tps):
        return {"per_question_tokens_per_s": q_tps, "tokens_per_s": sum(q_tps) / len(q_tps)}

    files = {"a": {"ar": row([10.0, 20.0]), "hf": row([20.0, 20.0]), "hf-static": row([40.0, 10.0]),
                   "eagle3": row([30.0, 50.0])},
             "b": {"ar": row([10.0]), "hf": row([10.0]), "hf-static": row([20.0]), "eagle3": row([30.0])}}
    mean = {n: {"tokens_per_s": (files["a"][n]["tokens_per_s"] + files["b"][n]["tokens_per_s"]) / 2} for n in files["a"]}
    # mean tokens/s: hf (20 + 10) / 2 = 15, hf-static (25 + 20) / 2 = 22.5 -> hf-static
    assert bench.add_speedup_over_hf(files, mean) == "hf-static"
    assert files["a"]["eagle3"]["speedup_over_hf"] == pytest.approx((30 / 40 + 50 / 10) / 2)
    assert files["b"]["eagle3"]["speedup_over_hf"] == pytest.approx(30 / 20)
    assert mean["eagle3"]["speedup_over_hf"] == pytest.approx(((30 / 40 + 50 / 10) / 2 + 1.5) / 2)
    assert files["a"]["ar"]["speedup_over_hf"] == pytest.approx((10 / 40 + 20 / 10) / 2)
    assert files["a"]["hf-static"]["speedup_over_hf"] == mean["hf-static"]["speedup_over_hf"] == 1.0
    assert files["b"]["hf"]["speedup_over_hf"] == pytest.approx(0.5)
    # a question the baseline did not time (0 tokens/s) is left out, as for ar
    files["b"]["hf-static"]["per_question_tokens_per_s"] = [0.0]
    bench.add_speedup_over_hf(files, mean)
    assert files["b"]["eagle3"]["speedup_over_hf"] is None
    assert mean["eagle3"]["speedup_over_hf"] == pytest.approx((30 / 40 + 50 / 10) / 2)
    # no HF baseline in the run: None everywhere, and the markdown keeps the table without the column
    del mean["hf"], mean["hf-static"]
    for b in files:
        del files[b]["hf"], files[b]["hf-static"]
    assert bench.add_speedup_over_hf(files, mean) is None
    assert mean["eagle3"]["speedup_over_hf"] is None and files["a"]["ar"]["speedup_over_hf"] is None


def test_a_broken_hf_baseline_is_reported_as_a_mismatch(tmp_path, monkeypatch):
    model, tok, qs = _tiny(tmp_path)
    real = bench.HFGenerate.generate

    def broken(self, input_ids, **kw):
        seq, st = real(self, input_ids, **kw)
        if self.method.name == "hf-lookup" and kw["max_new_tokens"] > 4:
            seq = seq.clone()
            seq[0, input_ids.shape[1] + 1] = (seq[0, input_ids.shape[1] + 1] + 1) % 97
        return seq, st

    monkeypatch.setattr(bench.HFGenerate, "generate", broken)
    qs = {"code": qs["code"]}
    r = bench.run_bench(model, tok, None, bench.build_methods(["ar", "hf", "hf-lookup"]), qs, max_new_tokens=6,
                        warmup_tokens=2, eos_token_id=tok.eos_token_id)
    assert r["mismatches"] == [{"bench": "code", "question_id": i, "turn": 0, "method": "hf-lookup", "reference": "ar",
                                "first_diff": 1} for i in range(2)]
    assert "hf_static" not in r


def test_bench_reports_a_mismatch_when_a_method_is_broken(tmp_path, monkeypatch, capsys):
    """A method whose output differs from ar's (here: eagle3's third new token changed) is reported in the
    JSON, the markdown and the exit status."""
    from heterospec.tools import cli

    pair = _pair(tmp_path)
    qfiles = _questions(tmp_path)
    real = HeteroSpec.generate

    def broken(self, input_ids, **kw):
        seq, st = real(self, input_ids, **kw)
        if self.policy.name == "eagle3" and kw.get("max_new_tokens", 0) > 4:
            seq = seq.clone()
            seq[0, input_ids.shape[1] + 2] = (seq[0, input_ids.shape[1] + 2] + 1) % 97
        return seq, st

    monkeypatch.setattr(HeteroSpec, "generate", broken)
    out = tmp_path / "out"
    status = cli.main(["bench", *pair, "--questions", str(qfiles[1]), "--limit", "2", "--max-new-tokens", "6",
                       "--methods", "ar,eagle3,heterospec", "--warmup-tokens", "2", "--no-plots", "--out", str(out)])
    assert status == 1
    r = json.loads((out / "results.json").read_text())
    assert r["runs"][0]["mismatches"] == [
        {"bench": "code", "question_id": i, "turn": 0, "method": "eagle3", "reference": "ar", "first_diff": 2}
        for i in range(2)]
    assert "MISMATCH: 2 outputs differ from ar's" in (out / "results.md").read_text()
    printed = capsys.readouterr().out
    assert "MISMATCH at temperature 0: eagle3 differs from ar on code question 1 turn 1 at new token 2" in printed
    assert not (out / "speedup.png").exists()


def test_other_arithmetic_is_only_transformers_half_generate_against_our_float32_decoder():
    """One rule for the demo and bench: a greedy difference is one of arithmetic (not a failure) only for a bf16 or
    fp16 model that our CPU decoder computes in float32, against one of transformers' generate baselines."""
    from heterospec.tools.bench.methods import other_arithmetic, split_mismatches

    on = "target and draft (AVX-512; weights as codes: BF16 65)"
    for dtype in ("bfloat16", "float16", "torch.bfloat16"):
        for hf in ("hf", "hf-static", "hf-compiled", "hf-lookup"):
            assert other_arithmetic((hf, "ar"), dtype, on) and other_arithmetic(("ar", hf), dtype, on)
    assert not other_arithmetic(("eagle3", "ar"), "bfloat16", on)           # ours against ours: a failure
    assert not other_arithmetic(("lookup", "ar"), "bfloat16", on)
    for dtype, decoder in (("float32", on), ("torch.float32", on), ("bfloat16", "off"), ("bfloat16", None)):
        assert not other_arithmetic(("hf", "ar"), dtype, decoder)
    bad = [{"method": "hf", "reference": "ar", "question_id": 1}, {"method": "eagle3", "reference": "ar", "question_id": 1}]
    assert split_mismatches(bad, "torch.bfloat16", ["off", on]) == ([bad[1]], [bad[0]])
    assert split_mismatches(bad, "torch.bfloat16", ["off"]) == (bad, [])
    assert split_mismatches(bad, "torch.float32", [on]) == (bad, [])


@pytest.mark.parametrize("broken_method, status", [("hf", 0), ("eagle3", 1)])
def test_bench_in_bfloat16_notes_transformers_arithmetic_and_fails_on_ours(tmp_path, monkeypatch, capsys,
                                                                           broken_method, status):
    """``bench --dtype bfloat16`` on our CPU decoder: transformers' bf16 generate answering otherwise than ar is a
    note (exit status 0, a line in results.md, "other_arithmetic" in the JSON), the demo's rule; a method of ours
    answering otherwise is still a MISMATCH and exit status 1."""
    from heterospec.tools import cli

    pair = _pair(tmp_path)
    qfiles = _questions(tmp_path)
    real_ours, real_hf = HeteroSpec.generate, bench.HFGenerate.generate

    def change(seq, n):
        seq = seq.clone()
        seq[0, n + 2] = (seq[0, n + 2] + 1) % 97
        return seq

    def ours(self, input_ids, **kw):
        seq, st = real_ours(self, input_ids, **kw)
        hit = self.policy.name == broken_method and kw.get("max_new_tokens", 0) > 4
        return (change(seq, input_ids.shape[1]) if hit else seq), st

    def theirs(self, input_ids, **kw):
        seq, st = real_hf(self, input_ids, **kw)
        hit = self.method.name == broken_method and kw.get("max_new_tokens", 0) > 4
        return (change(seq, input_ids.shape[1]) if hit else seq), st

    monkeypatch.setattr(HeteroSpec, "generate", ours)
    monkeypatch.setattr(bench.HFGenerate, "generate", theirs)
    out = tmp_path / "out"
    got = cli.main(["bench", *pair, "--questions", str(qfiles[1]), "--limit", "2", "--max-new-tokens", "6",
                    "--methods", "ar,hf,eagle3", "--warmup-tokens", "2", "--no-plots", "--dtype", "bfloat16",
                    "--out", str(out)])
    printed = capsys.readouterr().out
    r = json.loads((out / "results.json").read_text())
    run = r["runs"][0]
    assert r["runs"][0]["cpu_decoder"]["ar"] != "off" and got == status
    md = (out / "results.md").read_text()
    if broken_method == "hf":
        assert run["mismatches"] == [] and [m["method"] for m in run["other_arithmetic"]] == ["hf", "hf"]
        assert "note: hf differs from ar on code question 0 turn 1 at new token 2: transformers' generate rounds in " \
               "bfloat16" in printed and "MISMATCH" not in printed
        assert "Identical greedy outputs across ar, eagle3 on every question and turn; 2 outputs of hf differ" in md
    else:
        assert [m["method"] for m in run["mismatches"]] == ["eagle3", "eagle3"]
        assert "MISMATCH at temperature 0: eagle3 differs from ar on code question 1 turn 1" in printed
        assert "MISMATCH: 2 outputs differ from ar's" in md


def test_bench_command_refuses_bad_arguments(tmp_path, capsys):
    from _cli import run_cli

    pair = _pair(tmp_path)
    qfiles = [str(p) for p in _questions(tmp_path)]
    base = [sys.executable, "-m", "heterospec", "bench", *pair, "--out", str(tmp_path / "o")]
    # an unknown method: one line, exit status 2 (a usage error)
    res = subprocess.run(base + ["--questions", *qfiles, "--methods", "ar,hf-fast"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "heterospec bench: argument 'methods' expected distinct names from " + ", ".join(bench.METHODS)
        + ", got ar, hf-fast"], res.stderr
    for extra, needle in (
        (["--questions", *qfiles, "--methods", "ar,beam"], "argument 'methods' expected distinct names"),
        (["--questions", str(tmp_path / "none.jsonl")], "cannot read question file"),
        (["--questions", *qfiles, "--temperature", "-1"], "--temperature expected values 0 (greedy) or >= 1e-30"),
        (["--questions", *qfiles, "--temperature", "1e-40"], "--temperature expected values 0 (greedy) or >= 1e-30"),
        (["--questions", *qfiles, "--methods", "ar,eagle3-tuned", "--tuned-tree", "x"], "'--tuned-tree' expected"),
    ):   # the same checks in this process (the subprocess above shows the process's own status and line)
        rc, _, err = run_cli(base[3:] + extra, capsys)
        assert rc == 2 and needle in err, (extra, err)
    # heterospec without a profile for a head of one's own: refused before the models load
    rc, _, err = run_cli(base[3:4] + pair[:4] + ["--questions", *qfiles, "--methods", "ar,heterospec"], capsys)
    assert rc == 2 and "need a calibrated profile (--profile" in err, err


def _tune_prompts(root):
    p = root / "tune.txt"
    p.write_text("w5 w17 w3 w40\nw9 w2 w33\nw11 w12\n")
    return p


def test_tuning_picks_a_measured_tree_from_the_grid(tmp_path):
    """eagle3-tuned's search on a tiny pair: every grid point replayed, the best three by predicted speed
    timed, and the winner the fastest of those; heterospec-tuned calibrated on the winner."""
    from heterospec.policy.profile import CostModel
    from heterospec.models.draft import Eagle3Draft
    from heterospec.tune.trace import record

    model, tok = save_tiny_pair(tmp_path)
    draft = Eagle3Draft.from_pretrained(str(tmp_path / "draft"), target=model)
    ids = [tok(t, return_tensors="pt")["input_ids"] for t in ("w5 w17 w3 w40", "w9 w2 w33")]
    cost = CostModel((1e-3, 1e-4, 0.0, 0.0), (2e-4, 1e-5), 0.0)
    tr = record(model, draft, ids, max_new_tokens=8, top_k=3, levels=5)
    with pytest.raises(ValueError, match="argument 'depths' goes to 6, the trace has 5 levels"):
        bench.tune_static_tree(model, draft, ids, tr, cost_model=cost, depths=(1, 6))
    pol, rep = bench.tune_static_tree(model, draft, ids, tr, cost_model=cost, depths=(1, 2, 3), nodes=(2, 4, 8))
    assert len(rep["grid"]) == 9 and len(rep["measured"]) == 3
    preds = [g["predicted_tokens_per_s"] for g in rep["grid"]]
    assert preds == sorted(preds, reverse=True)
    assert rep["measured"] == [dict(g, measured_tokens_per_s=m["measured_tokens_per_s"])
                               for g, m in zip(rep["grid"][:3], rep["measured"])]
    best = max(rep["measured"], key=lambda g: g["measured_tokens_per_s"])
    assert (pol.depth, pol.top_k, pol.total_tokens) == (best["depth"], 3, best["nodes"]) == tuple(rep["chosen"].values())
    hs, info = bench.calibrate_on(tr, Policy.static(2, 3, 4), cost)
    assert (hs.depth, hs.top_k, hs.total_tokens, hs.name) == (2, 3, 4, "heterospec-tuned")
    assert list(hs.thresholds) == info["thresholds"] and len(hs.extra) == len(hs.thresholds) + 1
    assert max(hs.extra) <= 2 and info["predicted_tokens_per_s"] >= tr.replay(Policy.paper(2, 3, 4, hs.thresholds), cost).tokens_per_s - 1e-9


# ---- the real default pair (CI's last stage) ------------------------------------------------------------------

def test_bench_on_the_default_target_with_tuning(tmp_path):
    from _pairs import need_default_target

    need_default_target()
    qfiles = _questions_text(tmp_path)
    tune = tmp_path / "tune.txt"
    tune.write_text("Name three colours.\nWhat is two plus two?\n")
    res = subprocess.run([sys.executable, "-m", "heterospec", "bench", "--questions", *qfiles, "--limit", "1",
                          "--max-new-tokens", "12", "--tune-prompts", str(tune), "--tune-limit", "2",
                          "--tune-max-new-tokens", "10", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads((tmp_path / "out" / "results.json").read_text())
    assert r["models"]["target"] == "SmolLM2-135M-Instruct" and r["runs"][0]["mismatches"] == []
    assert r["tuning"]["chosen"]["nodes"] in bench.TUNE_NODES
    assert len(r["tuning"]["grid"]) == len(bench.TUNE_DEPTHS) * len(bench.TUNE_NODES) == 99   # depths 0-8
    assert ("Identical greedy outputs across ar, hf, hf-static, hf-lookup, eagle3, eagle3-tuned, heterospec-paper, "
            "heterospec, heterospec-tuned") in res.stdout


def _questions_text(root):
    p = root / "mini.jsonl"
    p.write_text(json.dumps({"question_id": 1, "turns": ["Give me a short tip for learning to cook.",
                                                         "Now make it shorter."]}) + "\n")
    return [str(p)]


def test_bench_with_recorded_engines_keeps_capture_out_of_the_timings(tmp_path):
    """run_bench(cuda_graphs=...) (here "emulate": the recorded-step plumbing on the CPU): engines sized once
    for the longest conversation, every tree shape recorded in the warm-up (none in the timed run), the
    recording time reported as capture_s, the same answers as the eager engines and no mismatch."""
    model, tok = save_tiny_pair(tmp_path)
    qs = bench.load_questions(_questions(tmp_path), limit=2)
    from heterospec.models.draft import Eagle3Draft

    draft = Eagle3Draft.from_pretrained(str(tmp_path / "draft"), target=model)
    methods = [("ar", Policy.autoregressive()), ("eagle3", Policy.static(3, 3, 8)),
               ("heterospec", Policy(3, 3, 8, THRESHOLDS, (2, 1, 0), (4, 8, 8), name="calibrated"))]
    runs = {g: bench.run_bench(model, tok, draft, methods, qs, max_new_tokens=10, warmup_tokens=4,
                               eos_token_id=tok.eos_token_id, cuda_graphs=g) for g in (False, "emulate")}
    rec = runs["emulate"]
    assert rec["mismatches"] == [] and rec["cuda_graphs"] == "emulate"
    assert [a["turns"] for a in rec["answers"]] == [a["turns"] for a in runs[False]["answers"]]
    assert set(rec["capture_s"]) == {"ar", "eagle3", "heterospec"} and all(v > 0 for v in rec["capture_s"].values())
    for b in rec["files"]:
        for n in ("eagle3", "heterospec"):
            m = rec["files"][b][n]
            # only the prompt's catch-up runs outside the recorded steps
            assert m["time_split_s"]["graph"] > m["time_split_s"]["draft"] and m["time_split_s"]["verify"] == 0
    md = bench.markdown({"settings": {"device": "cpu", "dtype": "float32", "max_new_tokens": 10, "limit": 2, "seed": 0},
                         "models": {"target": "t", "draft": "d"}, "machine": {"summary": "m"}, "runs": [rec]})
    assert "recorded steps (cuda_graphs='emulate')" in md and "recording took ar " in md


def test_pooled_bins_weigh_files_by_their_cycles():
    """The per-bin table pools files by cycles, not by averaging their means."""
    a = {"0": {"cycles": 30, "mean_accepted": 2.0, "seconds": 3.0}, "2": {"cycles": 10, "mean_accepted": 0.0, "seconds": 2.0}}
    b = {"0": {"cycles": 10, "mean_accepted": 4.0, "seconds": 1.0}}
    p = bench.pooled_bins([a, b])
    assert list(p) == ["0", "2"]
    assert p["0"]["share"] == pytest.approx(40 / 50) and p["2"]["share"] == pytest.approx(10 / 50)
    assert p["0"]["tau"] == pytest.approx(1 + (60 + 40) / 40)            # 3.5 committed per cycle
    assert p["0"]["tokens_per_s"] == pytest.approx((100 + 40) / 4.0)     # committed over 4 s
    assert p["2"]["tau"] == 1.0 and p["2"]["tokens_per_s"] == pytest.approx(10 / 2.0)


def test_pooled_bins_of_saved_files_equal_the_bins_of_the_pooled_stats():
    """results.json's per-file bins and the markdown's pooled ones come from one implementation
    (GenerationStats.per_bin): pooling the saved per-file dicts gives the bins of the files' stats pooled."""
    from collections import Counter

    from heterospec.engine.stats import GenerationStats
    from heterospec.tools.bench.metrics import bin_rows

    runs = [GenerationStats(bins=Counter({0: 3, 2: 1}), bin_accepted=Counter({0: 7, 2: 0}), bin_s=Counter({0: 0.3, 2: 0.1}),
                            bin_verified=Counter({0: 12, 2: 8})),
            GenerationStats(bins=Counter({0: 2, 10: 5}), bin_accepted=Counter({0: 2, 10: 4}), bin_s=Counter({0: 0.2}))]
    rows = [bin_rows(r) for r in runs]
    assert list(rows[1]) == ["0", "10"] and rows[1]["10"]["tokens_per_s"] is None   # no time: no rate
    assert set(rows[0]["0"]) == {"cycles", "share", "mean_accepted", "seconds", "tau", "tokens_per_s"}
    pooled = bench.pooled_bins(rows)
    want = bin_rows(GenerationStats.pooled(runs))
    assert list(pooled) == list(want) == ["0", "2", "10"]
    for k in want:
        assert pooled[k] == pytest.approx(want[k])


def test_questions_may_be_a_directory_of_the_five_files(tmp_path):
    from heterospec.tools import bench

    for n in bench.BENCHMARKS:
        (tmp_path / f"{n}.jsonl").write_text("")
    other = tmp_path / "extra.jsonl"
    other.write_text("")
    got = bench.question_paths([str(tmp_path), str(other)])
    assert got == [str(tmp_path / f"{n}.jsonl") for n in
                   ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")] + [str(other)]
    (tmp_path / "sum.jsonl").unlink()
    with pytest.raises(ValueError, match="argument --questions: .*sum.jsonl.*without them"):
        bench.question_paths([str(tmp_path)])
