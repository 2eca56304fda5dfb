"""`heterospec generate` on a tiny target + EAGLE-3 draft saved to disk, with a word-level tokenizer."""
import os
import json
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from _models import THRESHOLDS, reference_greedy  # noqa: E402
from _pairs import save_tiny_pair  # noqa: E402

@pytest.mark.parametrize("method", ["ar", "eagle3", "heterospec"])
def test_generate_command_streams_the_targets_greedy_answer(tmp_path, method):
    model, tok = save_tiny_pair(tmp_path)
    prompt = "w5 w17 w3 w40 w22"
    cmd = [sys.executable, "-m", "heterospec", "generate", "--target", str(tmp_path / "target"), "--draft",
           str(tmp_path / "draft"), "--prompt", prompt, "--method", method, "--max-new-tokens", "16", "--no-eos",
           "--depth", "4", "--top-k-tree", "3", "--total-tokens", "12",
           "--thresholds", ",".join(str(t) for t in THRESHOLDS), "--device", "cpu"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    ref = reference_greedy(model, ids, 16)[0, ids.shape[1]:]
    expected = tok.decode(ref)
    assert expected.strip() in res.stdout
    assert f"[{method}] 16 tokens" in res.stdout and "tau" in res.stdout


def test_generate_command_applies_a_repetition_penalty_losslessly(tmp_path):
    """--repetition-penalty and --no-repeat-ngram-size: HeteroSpec's answer is HuggingFace's greedy generate with
    the same options, which differs from the unpenalised answer."""
    model, tok = save_tiny_pair(tmp_path)
    prompt = "w5 w17 w3 w40 w22"
    cmd = [sys.executable, "-m", "heterospec", "generate", "--target", str(tmp_path / "target"), "--draft",
           str(tmp_path / "draft"), "--prompt", prompt, "--method", "heterospec", "--max-new-tokens", "16",
           "--no-eos", "--depth", "4", "--top-k-tree", "3", "--total-tokens", "12",
           "--thresholds", ",".join(str(t) for t in THRESHOLDS), "--repetition-penalty", "1.8",
           "--no-repeat-ngram-size", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                         min_new_tokens=16, pad_token_id=0, eos_token_id=None, repetition_penalty=1.8,
                         no_repeat_ngram_size=2)[0, ids.shape[1]:]
    assert ref.tolist() != reference_greedy(model, ids, 16)[0, ids.shape[1]:].tolist()
    assert tok.decode(ref).strip() in res.stdout


@pytest.mark.parametrize("method", ["ar", "heterospec"])
def test_generate_command_with_prompt_lookup_is_lossless(tmp_path, method):
    """--prompt-lookup: the answer is HuggingFace's greedy generate, and the chains were verified (more tree tokens
    than verification calls, where ar alone verifies one token a call)."""
    model, tok = save_tiny_pair(tmp_path)
    prompt = "w5 w17 w3 w40 w22 w5 w17 w3"
    cmd = [sys.executable, "-m", "heterospec", "generate", "--target", str(tmp_path / "target"), "--draft",
           str(tmp_path / "draft"), "--prompt", prompt, "--method", method, "--max-new-tokens", "16", "--no-eos",
           "--depth", "4", "--top-k-tree", "3", "--total-tokens", "12", "--prompt-lookup", "4",
           "--lookup-ngram", "1,3"] + (["--thresholds", ",".join(str(t) for t in THRESHOLDS)]
                                       if method == "heterospec" else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    ref = reference_greedy(model, ids, 16)[0, ids.shape[1]:]
    assert tok.decode(ref).strip() in res.stdout
    calls, verified = re.search(r"verification calls (\d+), tree tokens verified (\d+)", res.stdout).groups()
    assert int(verified) > int(calls)


def test_generate_command_stops_at_a_stop_string_as_hf_generate_does(tmp_path):
    """--stop TEXT (repeatable): the answer is HuggingFace's greedy generate with the same stop_strings, the text
    that made it stop kept, and shorter than --max-new-tokens; \\n in TEXT reads as a newline."""
    from heterospec.tools.cli import _stop_string

    assert _stop_string("a\\nb\\t\\\\n") == "a\nb\t\\n"
    model, tok = save_tiny_pair(tmp_path, last="abcdef")
    prompt = "w5 w17 w3 w40 w22"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    new = reference_greedy(model, ids, 24)[0, ids.shape[1]:].tolist()
    stop = " " + tok.decode(new[7:9])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, pad_token_id=0,
                         eos_token_id=None, stop_strings=[stop, "w999"], tokenizer=tok)[0, ids.shape[1]:]
    assert 0 < ref.shape[0] < 24
    cmd = [sys.executable, "-m", "heterospec", "generate", "--target", str(tmp_path / "target"), "--draft",
           str(tmp_path / "draft"), "--prompt", prompt, "--method", "eagle3", "--max-new-tokens", "24", "--no-eos",
           "--depth", "4", "--top-k-tree", "3", "--total-tokens", "12", "--stop", stop, "--stop", "w999"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert tok.decode(ref).strip() + "\n" in res.stdout
    assert f"[eagle3] {ref.shape[0]} tokens" in res.stdout


def test_generate_command_needs_a_policy_for_heterospec_with_another_draft(tmp_path):
    save_tiny_pair(tmp_path)
    res = subprocess.run([sys.executable, "-m", "heterospec", "generate", "--target", str(tmp_path / "target"),
                          "--draft", str(tmp_path / "draft"), "--prompt", "w1", "--method", "heterospec"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "argument --method" in res.stderr and "--policy PROFILE" in res.stderr and "--thresholds" in res.stderr


# ---- issue 18: what a new user trips over ----------------------------------------------------------------------

def _run(*argv):
    return subprocess.run([sys.executable, "-m", "heterospec", *argv], capture_output=True, text=True, timeout=300)


def _one_line_usage_error(res, arg):
    """Exit status 2, one line on stderr naming the argument, no traceback, nothing on stdout."""
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"error: argument {arg}: expected " in res.stderr, res.stderr
    assert res.stdout == ""


def _profile(tmp_path, thresholds=(0.5, 1.5), extra=(1, 0, 0), keep=(6, 8, 12)):
    from heterospec.policy import Policy
    from heterospec.policy.profile import save_profile

    path = tmp_path / "profile.json"
    save_profile(path, Policy(3, 3, 12, tuple(thresholds), tuple(extra), tuple(keep), name="calibrated"), None)
    return path


@pytest.mark.parametrize("method", ["ar", "eagle3"])
def test_a_policy_with_another_method_is_a_usage_error_before_loading(tmp_path, method):
    """Issue 18.1: --policy used to override --method silently and print the --method name.  The target is an
    empty directory: a check made after loading would be a transformers traceback instead."""
    (tmp_path / "empty").mkdir()
    res = _run("generate", "--target", str(tmp_path / "empty"), "--draft", str(tmp_path), "--prompt", "w1",
               "--method", method, "--policy", str(_profile(tmp_path)))
    _one_line_usage_error(res, "--policy")
    assert f"--method {method}" in res.stderr


def test_a_policy_alone_runs_heterospec_and_says_so(tmp_path):
    """Issue 18.1: no --method and a profile: the method run (and printed) is heterospec."""
    model, tok = save_tiny_pair(tmp_path)
    res = _run("generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt",
               "w5 w17 w3", "--max-new-tokens", "12", "--no-eos", "--policy", str(_profile(tmp_path)))
    assert res.returncode == 0, res.stderr
    assert "[heterospec] calibrated profile" in res.stdout and "[heterospec] 12 tokens" in res.stdout
    assert "[eagle3]" not in res.stdout
    ids = tok("w5 w17 w3", return_tensors="pt")["input_ids"]
    assert tok.decode(reference_greedy(model, ids, 12)[0, ids.shape[1]:]).strip() in res.stdout


def test_policy_paper_means_what_it_means_in_demo(tmp_path):
    """Issue 18.2: --policy paper is the paper's rule (on --thresholds for a draft of one's own), not a file."""
    save_tiny_pair(tmp_path)
    base = ["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt",
            "w5 w17", "--max-new-tokens", "6", "--depth", "3", "--top-k-tree", "3", "--total-tokens", "12"]
    res = _run(*base, "--policy", "paper", "--thresholds", "0.4,1.1,2.5")
    assert res.returncode == 0, res.stderr
    assert "[heterospec] the paper's rule on entropy bins 0.4, 1.1, 2.5" in res.stdout
    _one_line_usage_error(_run(*base, "--policy", "paper"), "--policy")


def test_the_shipped_head_gets_the_shipped_profile_without_flags(monkeypatch):
    """Issue 18.2: --target default (--draft defaults to the shipped head) and the default method use the
    shipped calibrated profile; --policy paper takes the shipped bins; --thresholds of any count 1..7 work.
    Checked on the resolved arguments: nothing is loaded.  The CPU's kernel is pinned to AVX-512 (the CPU
    profile); an AVX2-only CPU gets its own (twenty-sixth session)."""
    from heterospec.models import cpu_gemm
    from heterospec.models.default import DEFAULT_HEAD, DEFAULT_PROFILE
    from heterospec.policy.profile import load_profile
    from heterospec.tools import cli

    monkeypatch.setattr(cpu_gemm, "kernel_isa", lambda: 2)

    parse = lambda *a: cli.resolve_generate(_parsed(["generate", "--target", "default", "--prompt", "hi", *a]))  # noqa: E731
    shipped = load_profile(DEFAULT_PROFILE)[0]
    args = parse()
    assert (args.method, args.draft, args.policy_obj) == ("heterospec", "default", shipped)
    assert args.policy_what.startswith("the shipped CPU profile (profile.json")
    monkeypatch.setattr(cpu_gemm, "kernel_isa", lambda: 1)
    avx2 = parse()
    assert avx2.policy_obj == load_profile(os.path.join(DEFAULT_HEAD, "profile-cpu-avx2.json"))[0] != shipped
    assert avx2.policy_what == "the shipped CPU profile for AVX2 CPUs (profile-cpu-avx2.json)"
    monkeypatch.setattr(cpu_gemm, "kernel_isa", lambda: 2)
    paper = parse("--policy", "paper").policy_obj
    assert paper.thresholds == shipped.thresholds and paper.extra[0] > 0
    assert parse("--thresholds", "1.5,2.5").policy_obj.thresholds == (1.5, 2.5)
    assert parse("--method", "ar").draft is None and parse("--method", "eagle3").policy_obj.extra == ()


def test_generate_on_cuda_takes_the_heads_gpu_profile_and_a_users_policy_still_wins(tmp_path, monkeypatch):
    """Issue 40.4: --device cuda takes the head's profile-cuda.json (the bins and shapes calibrated on a GPU);
    --policy PROFILE still wins. Checked on the resolved arguments: nothing is loaded."""
    import shutil

    import heterospec.models.default as default
    from heterospec.policy.profile import load_profile
    from heterospec.tools import cli

    head = tmp_path / "head"
    head.mkdir()
    shutil.copy(default.DEFAULT_PROFILE, head / "profile.json")
    raw = json.loads((head / "profile.json").read_text())
    raw["policy"]["thresholds"] = [t + 0.25 for t in raw["policy"]["thresholds"]]
    (head / "profile-cuda.json").write_text(json.dumps(raw))
    monkeypatch.setattr(default, "DEFAULT_HEAD", str(head))

    def parse(device, *a):   # --device is checked against this machine while parsing: set it after
        args = _parsed(["generate", "--target", "default", "--prompt", "hi", *a])
        args.device = device
        return cli.resolve_generate(args)

    gpu = parse("cuda")
    assert gpu.policy_obj == load_profile(str(head / "profile-cuda.json"))[0]
    assert gpu.policy_what.startswith("the shipped GPU profile (profile-cuda.json")
    assert parse("cuda:0", "--policy", "paper").policy_obj.thresholds == tuple(raw["policy"]["thresholds"])
    assert parse("cpu").policy_obj == load_profile(str(head / "profile.json"))[0]          # the CPU keeps its own
    own = parse("cuda", "--policy", str(head / "profile.json"))
    assert own.policy_obj == load_profile(str(head / "profile.json"))[0] and "calibrated profile" in own.policy_what


def _parsed(argv):
    """generate's argparse namespace without running it (main() parses, then resolves)."""
    from heterospec.tools import cli

    seen = {}

    def grab(args, out=None):
        seen["args"] = args

    real, real_resolve = cli.generate_cmd, cli.resolve_generate
    cli.generate_cmd, cli.resolve_generate = grab, lambda a: a
    try:
        cli.main(argv)
    finally:
        cli.generate_cmd, cli.resolve_generate = real, real_resolve
    return seen["args"]


@pytest.mark.parametrize("extra, arg", [
    (["--draft", "NOPE"], "--draft"),
    (["--draft", "EMPTYCFG"], "--draft"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "1e-31"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "-2"], "--top-k"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--repetition-penalty", "nan"], "--repetition-penalty"),
    (["--no-repeat-ngram-size", "-1"], "--no-repeat-ngram-size"),
    (["--prompt-lookup", "-1"], "--prompt-lookup"),
    (["--prompt-lookup", "65"], "--prompt-lookup"),
    (["--lookup-ngram", "3,2"], "--lookup-ngram"),
    (["--lookup-ngram", "0,2"], "--lookup-ngram"),
    (["--lookup-ngram", "2"], "--lookup-ngram"),
    (["--stop", ""], "--stop"),
    (["--min-p", "1.5"], "--min-p"),
    (["--min-p", "nan"], "--min-p"),
    (["--depth", "-1"], "--depth"),
    (["--total-tokens", "1"], "--total-tokens"),
    (["--thresholds", "2,1"], "--thresholds"),
    (["--thresholds", "a,b"], "--thresholds"),
    (["--policy", "NOTJSON"], "--policy"),
    (["--policy", "MISSING.json"], "--policy"),
])
def test_bad_generate_input_is_one_line_before_loading(tmp_path, extra, arg):
    """Issue 18.4: each bad argument is one line naming it, exit status 2, no traceback -- before any model
    loads (the target directory is empty, so loading would fail differently)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "EMPTYCFG").mkdir()
    (tmp_path / "EMPTYCFG" / "config.json").write_text("")
    (tmp_path / "NOTJSON").write_text("depth: 7\n")
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text("{}")
    extra = [str(tmp_path / e) if e in ("NOPE", "EMPTYCFG", "NOTJSON", "MISSING.json") else e for e in extra]
    argv = ["generate", "--target", str(tmp_path / "empty"), "--draft", str(tmp_path / "head"), "--prompt", "w1",
            "--method", "heterospec" if arg == "--policy" else "eagle3"]
    if "--draft" in extra:
        argv = argv[:3] + argv[5:]
    res = _run(*argv, *extra)
    _one_line_usage_error(res, arg)


def test_a_missing_target_directory_is_one_line():
    res = _run("generate", "--target", "/no/such/model", "--prompt", "w1", "--method", "ar")
    _one_line_usage_error(res, "--target")
    assert "'default'" in res.stderr


def test_a_missing_draft_mentions_the_shipped_head(tmp_path):
    (tmp_path / "m").mkdir()
    res = _run("generate", "--target", str(tmp_path / "m"), "--prompt", "w1")
    _one_line_usage_error(res, "--draft")
    assert "'default'" in res.stderr and "--method ar" in res.stderr


# ---- --device (issue 15): passed to the models and the inputs; a bad one is a one-line usage error ----------

COMMANDS = {
    "generate": ["generate", "--target", "T", "--draft", "D", "--prompt", "w1", "--method", "eagle3"],
    "calibrate": ["calibrate", "--target", "T", "--draft", "D", "--prompts", "q.jsonl", "--out", "p.json"],
    "train-draft": ["train-draft", "--target", "T", "--data", "q.jsonl", "--out", "o"],
}
BAD_DEVICES = ["foo", "cuda:x", "meta"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"])


@pytest.mark.parametrize("device", BAD_DEVICES)
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_a_bad_device_is_a_one_line_usage_error(cmd, device, capsys, monkeypatch):
    from heterospec.tools import cli

    monkeypatch.setattr("heterospec.tools.commands.load_pair", lambda *a, **k: pytest.fail("loaded models with a bad --device"))
    with pytest.raises(SystemExit) as e:
        cli.main(COMMANDS[cmd] + ["--device", device])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"heterospec {cmd}: error: argument --device: "), err
    assert repr(device) in err


def test_a_bad_device_has_no_traceback():
    res = subprocess.run([sys.executable, "-m", "heterospec", "generate", "--target", "T", "--prompt", "w1",
                          "--device", "cuda:7" if torch.cuda.is_available() else "cuda"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "argument --device" in res.stderr


class _Loaded(Exception):
    pass


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_device_reaches_load_pair(cmd, monkeypatch, tmp_path):
    from heterospec.tools import cli

    seen = {}

    def load_pair(args, device="cpu"):
        seen["device"] = device
        raise _Loaded

    monkeypatch.setattr("heterospec.tools.commands.load_pair", load_pair)
    monkeypatch.setattr("heterospec.models.default.load_pair", load_pair)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "T").mkdir()              # generate checks that these exist before it loads anything
    (tmp_path / "D").mkdir()
    (tmp_path / "D" / "config.json").write_text("{}")
    (tmp_path / "q.jsonl").write_text('{"turns": ["w1"]}\n')
    with pytest.raises(_Loaded):
        cli.main(COMMANDS[cmd] + ["--device", "cpu:0", "--dtype", "bfloat16"])
    assert seen["device"] == "cpu:0"


# ---- --cuda-graphs (issue 16) ----------------------------------------------------------------------------------

GRAPH_COMMANDS = {
    "demo": ["demo"],
    "generate": COMMANDS["generate"],
    "calibrate": COMMANDS["calibrate"],
    "bench": ["bench", "--questions", "q.jsonl"],
}


@pytest.mark.parametrize("cmd", list(GRAPH_COMMANDS))
def test_cuda_graphs_on_without_a_gpu_is_a_one_line_usage_error(cmd, capsys, monkeypatch):
    from heterospec.tools import cli

    monkeypatch.setattr("heterospec.tools.commands.load_pair", lambda *a, **k: pytest.fail("loaded models before checking --cuda-graphs"))
    monkeypatch.setattr("heterospec.models.default.load_pair", lambda *a, **k: pytest.fail("loaded models"))
    with pytest.raises(SystemExit) as e:
        cli.main(GRAPH_COMMANDS[cmd] + ["--device", "cpu", "--cuda-graphs", "on"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"heterospec {cmd}: error: argument --cuda-graphs: "), err
    assert "expected off or auto with --device cpu" in err and err.rstrip().endswith("got on")


@pytest.mark.parametrize("cmd", list(GRAPH_COMMANDS))
def test_cuda_graphs_default_is_auto(cmd):
    """Issue 40.8: on a GPU the recorded engine is the default (the eager engine is host-bound there), so every
    command that runs our engine takes --cuda-graphs auto unless told otherwise."""
    from heterospec.tools import cli

    args = cli.build_parser().parse_args(GRAPH_COMMANDS[cmd])
    assert args.cuda_graphs == "auto"


def _generate_spied(tmp_path, monkeypatch, setting, extra):
    """``heterospec generate`` (eagle3, 4 tokens) on a tiny saved pair with ``extra`` flags, HeteroSpec spied on:
    the engine setting ``setting`` as the command passed it and as the engine resolved it.  Returns (seen, argv)."""
    from heterospec.tools import cli

    import heterospec

    seen = {}
    real = heterospec.HeteroSpec

    def spy(*a, **k):
        seen["given"] = k.get(setting)
        hs = real(*a, **k)
        seen["resolved"] = getattr(hs, setting)
        return hs

    monkeypatch.setattr(heterospec, "HeteroSpec", spy)
    argv = ["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt",
            "w5 w17", "--method", "eagle3", "--max-new-tokens", "4", "--depth", "2", "--top-k-tree", "2",
            "--total-tokens", "4"]
    cli.main(argv + extra)
    return seen, argv


@pytest.mark.parametrize("given, want", [("auto", "auto"), ("off", False), (None, "auto")])
def test_cuda_graphs_reaches_the_engine(tmp_path, monkeypatch, given, want):
    """generate hands the switch to HeteroSpec ('auto' as such, also when not given: the engine resolves it, off
    on the CPU, and falls back to eager decoding if recording fails)."""
    save_tiny_pair(tmp_path)
    seen, _ = _generate_spied(tmp_path, monkeypatch, "cuda_graphs", [] if given is None else ["--cuda-graphs", given])
    assert seen["given"] == want and seen["resolved"] is False


# ---- --cpu-decoder --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", list(GRAPH_COMMANDS))
def test_cpu_decoder_on_off_the_cpu_is_a_one_line_usage_error(cmd, capsys, monkeypatch):
    from heterospec.tools import cli

    monkeypatch.setattr("heterospec.tools.commands.load_pair", lambda *a, **k: pytest.fail("loaded models"))
    monkeypatch.setattr("heterospec.models.default.load_pair", lambda *a, **k: pytest.fail("loaded models"))
    monkeypatch.setattr(cli, "check_device", lambda d: d)   # a CUDA device, as if this machine had one
    assert cli.build_parser().parse_args(GRAPH_COMMANDS[cmd]).cpu_decoder == "auto"
    with pytest.raises(SystemExit) as e:
        cli.main(GRAPH_COMMANDS[cmd] + ["--device", "cuda", "--dtype", "bfloat16", "--cpu-decoder", "on"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"heterospec {cmd}: error: argument --cpu-decoder: "), err
    assert "expected off or auto with --device cuda" in err and err.rstrip().endswith("got on")


@pytest.mark.parametrize("given, want, says", [(None, "auto", "target and draft ("), ("on", True, "target and draft ("),
                                               ("off", False, "off")])
def test_cpu_decoder_reaches_the_engine(tmp_path, monkeypatch, capsys, given, want, says):
    from heterospec.tools import cli

    save_tiny_pair(tmp_path)
    seen, argv = _generate_spied(tmp_path, monkeypatch, "cpu_decoder", [] if given is None else ["--cpu-decoder", given])
    assert seen["given"] == want and seen["resolved"].startswith(says)
    if given == "on":   # a model the decoder does not cover: the engine's reason, one line, status 2
        monkeypatch.setattr("heterospec.models.cpu_decoder.unsupported", lambda m: "a model of a test")
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            cli.main(argv + ["--cpu-decoder", "on"])
        err = capsys.readouterr().err.split("\n")   # (transformers' loading bar comes first, on its own line)
        assert e.value.code == 2 and err[-1] == "" and "Traceback" not in "\n".join(err), err
        assert err[-2].startswith("heterospec generate: error: HeteroSpec: argument 'cpu_decoder'") \
            and err[-2].endswith("a model of a test"), err


@pytest.mark.parametrize("argv, arg", [
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["demo", "--num-prompts", "9"], "--num-prompts"),
    (["demo", "--draft", "/no/such/head"], "--draft"),
    (["demo", "--policy", "/no/such/profile.json"], "--policy"),
    (["demo", "--target", "/no/such/model", "--draft", "/no/such/head"], "--target"),
    (["calibrate", "--target", "default", "--draft", "default", "--prompts", "/no/q.jsonl", "--out", "p.json"],
     "--prompts"),
    (["calibrate", "--target", "default", "--draft", "default", "--prompts", "Q", "--out", "p.json", "--depth", "-1"],
     "--depth"),
    (["calibrate", "--target", "default", "--draft", "default", "--prompts", "Q", "--out", "/no/dir/p.json"], "--out"),
    (["train-draft", "--target", "default", "--data", "Q", "--out", "o", "--steps", "0"], "--steps"),
    (["train-draft", "--target", "default", "--data", "/no/q.jsonl", "--out", "o"], "--data"),
    (["train-draft", "--target", "default", "--data", "self:0", "--out", "o"], "--data"),
    (["train-draft", "--target", "default", "--out", "o"], "--data"),             # no prompts, no --answers
    (["train-draft", "--target", "default", "--data", "Q", "--out", "o", "--epochs", "-1"], "--epochs"),
    (["train-draft", "--target", "default", "--data", "Q", "--out", "o", "--on-the-fly"], "--on-the-fly"),
    (["train-draft", "--target", "default", "--data", "Q", "--out", "o", "--time-limit", "0"], "--time-limit"),
    (["train-draft", "--target", "default", "--data", "Q", "--out", "o", "--add-prompts"], "--add-prompts"),
    (["train-draft", "--target", "default", "--data", "Q", "--out", "o", "--answers", "A", "--collect-only",
      "--max-prompts", "0"], "--max-prompts"),                                  # 0 only to grow a list
])
def test_bad_input_to_other_commands_is_one_line_before_loading(tmp_path, argv, arg):
    """Issue 18.4 for demo, calibrate and train-draft: the checks that need no model run first."""
    (tmp_path / "q.jsonl").write_text('{"turns": ["w1"]}\n')
    res = _run(*[str(tmp_path / "q.jsonl") if a == "Q" else str(tmp_path / "a") if a == "A" else a for a in argv])
    _one_line_usage_error(res, arg)


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--target", "T", "--draft", "D", "--max-new-tokens", "0"], "--max-new-tokens expected an int >= 1"),
    (["bench", "--target", "T", "--draft", "D", "--temperature", "-1"], "--temperature expected values 0"),
    (["bench", "--report", "E"], "--report expected a results.json"),
    (["calibrate", "--target", "T", "--draft", "D", "--prompts", "E", "--out", "p.json"], "no prompts found in"),
    (["train-draft", "--target", "T", "--data", "E", "--out", "o"], "no prompts found in"),
])
def test_bad_input_found_by_the_command_itself_exits_2_with_one_line(tmp_path, capsys, argv, needle):
    """What a command refuses once it runs (an empty prompts file is seen only when read): argparse's status 2
    and one line, as for the checks made before loading; these exited 1 before."""
    from _cli import run_cli

    save_tiny_pair(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    names = {"T": tmp_path / "target", "D": tmp_path / "draft", "E": tmp_path / "empty.txt"}
    device = [] if "--report" in argv else ["--device", "cpu"]
    rc, out, err = run_cli([names.get(a, a) for a in argv] + device, capsys)
    # one line of ours, the last (train-draft reads --data after loading the target, whose progress bar comes first:
    # --data self:N needs it)
    assert rc == 2 and needle in err.strip().splitlines()[-1] and "Traceback" not in err, (rc, err)
    assert sum("heterospec" in line for line in err.splitlines()) == 1 and out == "", (err, out)
