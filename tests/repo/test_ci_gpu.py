"""The GPU half of CI's plumbing, on the CPU: .ci/gpu's phases (listing, bounded runs, background and wait,
results collected into $OUT, summaries against the goals) and .ci/gpu_carry.py's bundles (split, stash,
reassemble, checksum, offline install).  The phases themselves need a GPU; their command lines are checked
here against the real command-line parser so they cannot rot."""
import importlib.util
import json
import re
import os
import shlex
import subprocess
import sys
import tarfile
import time
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CI = os.path.join(REPO, ".ci")


def _module(name):
    spec = importlib.util.spec_from_file_location("_ci_" + name, os.path.join(CI, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_ci_" + name] = mod       # dataclasses look their module up
    sys.path.insert(0, CI)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(CI)
    return mod


phases = _module("gpu_phases")
carry = _module("gpu_carry")


def _gpu(args, tmp_path, env=None, timeout=120):
    e = dict(os.environ, HETEROSPEC_GPU_WORK=str(tmp_path / "work"), OUT=str(tmp_path / "out"),
             PYTHON=sys.executable)
    e.pop("HETEROSPEC_WHEELS", None)
    e.update(env or {})
    os.makedirs(e["OUT"], exist_ok=True)
    return subprocess.run(["bash", os.path.join(CI, "gpu"), *args], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=timeout)


def _phases_file(tmp_path, table):
    p = tmp_path / "phases.json"
    p.write_text(json.dumps(table))
    return str(p)


# ---- the built-in table -----------------------------------------------------------------------------------

def test_list_works_without_a_gpu_and_names_every_phase_with_its_minutes():
    r = subprocess.run(["bash", os.path.join(CI, "gpu"), "--list"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[2:] if line.strip() and
            not line.startswith("Each")}
    for name in ("build", "kernels", "engine", "engine-chi2-oracle", "engine-chi2-noisy", "graphs", "bench",
                 "bench-eager", "bench-bf16", "bench-tuned", "bench-batch", "graphs-bench", "smoke", "head"):
        assert name in rows, r.stdout
        assert 0 < float(rows[name][1]) <= 9
    assert rows["head"][2] == "no" and rows["build"][2] == "yes"


def test_the_engine_tests_are_split_so_each_phase_fits_a_call():
    """The first H100 run cut the engine phase at 540 s in the chi-square tests: they have phases of their own,
    and together the three select every test of the engine files exactly once (the -k expressions, evaluated
    as pytest does on the names)."""
    import re

    ks = {}
    for name in ("engine", "engine-chi2-oracle", "engine-chi2-noisy"):
        (step,) = phases.BY_NAME[name].steps
        ks[name] = re.search(r"-k '([^']*)'", step.cmd).group(1)
    names = ["test_sampling_matches_the_target_distribution[oracle-setting0-rows50]",
             "test_sampling_matches_the_target_distribution[noisy-setting2-rows50]",
             "test_greedy_output_equals_target_generate[qwen3-eagle3-head-batched]", "test_no_host_transfer_in_the_cycle",
             "test_each_row_equals_its_prompt_alone[heterospec-qwen2]"]

    def selects(expr, test):   # pytest's -k: each word is a substring match; and / or / not as in Python
        return eval(re.sub(r"\w+", lambda m: m.group(0) if m.group(0) in ("and", "or", "not")
                           else str(m.group(0) in test), expr))

    for test in names:
        assert sum(selects(k, test) for k in ks.values()) == 1, (test, ks)
    # the batched chi-square stays on the CPU (stage 1): no GPU phase selects it
    assert not any(selects(k, "test_sampling_per_row_matches_the_target_distribution[setting0]") for k in ks.values())


def test_steps_run_with_the_faulthandler_and_calibrate_reports_the_failing_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("HETEROSPEC_GPU_WORK", str(tmp_path))
    ctx = phases.make_context(phases.BY_NAME)
    assert ctx.env["PYTHONFAULTHANDLER"] == "1"    # a signal (the first H200 run's calibrate) leaves a traceback
    (cal,) = [s for s in phases.BY_NAME["calibrate"].steps if s.name == "calibrate"]
    assert cal.cmd.startswith("CUDA_LAUNCH_BLOCKING=1 ")
    # the timed traceback dump comes only in the phase's last minute: the dump can crash a worker whose test is
    # still running (the fourth window lost engine-chi2-oracle's setting 0, a 7-minute test, to the dump at 5)
    for limit in (540, 300):
        monkeypatch.setenv("HETEROSPEC_GPU_PHASE_LIMIT", str(limit))
        ctx = phases.make_context(phases.BY_NAME)
        (step,) = [s for s in phases.BY_NAME["engine-chi2-oracle"].steps if s.name == "pytest"]
        dump = int(re.search(r"-o faulthandler_timeout=(\d+) ", ctx.fill(step.cmd, str(tmp_path))).group(1))
        assert limit - 60 <= dump < limit, (limit, dump)


def test_the_summary_imports_the_checkout_not_an_installed_copy(monkeypatch):
    """On a GPU machine the package is built in place and the runner runs as .ci/gpu_phases.py: the summary's
    numbers import heterospec from the checkout (the first H200 run: "No module named 'heterospec'")."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != phases.REPO])
    phases._repo_first()
    assert sys.path[0] == phases.REPO
    phases._repo_first()
    assert sys.path.count(phases.REPO) == 1


def test_every_phase_is_bounded_by_one_device_call():
    assert phases.PHASE_LIMIT_S <= 9 * 60
    assert all(p.minutes <= 9 for p in phases.PHASES)
    assert phases.PHASES[0].name == "build"   # a bare run builds first


def _commands(cmd):
    """The simple commands of a bash line, each a word list (split on && || | ; outside quotes)."""
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    cmds, cur = [], []
    for tok in lex:
        if tok in ("&&", "||", "|", ";"):
            cmds.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [c for c in cmds + [cur] if c]


def _heterospec_calls(cmd):
    """The argument lists of every `-m heterospec SUB ...` in a bash line."""
    return [w[w.index("-m") + 2:] for w in _commands(cmd) if "-m" in w and w[w.index("-m") + 1] == "heterospec"]


def test_every_phase_command_parses_with_the_real_command_line(tmp_path, monkeypatch):
    from heterospec.tools import cli

    monkeypatch.setenv("HETEROSPEC_GPU_WORK", str(tmp_path))
    monkeypatch.setenv("HETEROSPEC_QUESTIONS", str(tmp_path))
    ctx = phases.make_context()
    parser = cli.build_parser()
    seen = set()
    for ph in phases.PHASES:
        for step in ph.steps:
            cmd = ctx.fill(step.cmd, str(tmp_path / ph.name)).replace("${HEAD_SECONDS:-500}", "500") \
                .replace("${BATCH_TOKENS:-64}", "64")
            for argv in _heterospec_calls(cmd):
                args = parser.parse_args(argv)       # an unknown flag or a bad choice exits here
                seen.add(args.cmd)
            words = _commands(cmd)[0]
            if "pytest" in words:
                tests = [w for w in words if w.startswith("tests/")]
                assert tests and all(os.path.exists(os.path.join(REPO, t)) for t in tests), cmd
            if "-m" in words and words[words.index("-m") + 1].startswith("benchmarks."):
                mod = words[words.index("-m") + 1]
                assert os.path.isfile(os.path.join(REPO, *mod.split(".")) + ".py"), cmd
                if mod == "benchmarks.head_window":
                    from benchmarks import head_window

                    head_window.build_parser().parse_args(words[words.index("-m") + 2:])
                    seen.add("head_window")
    assert {"bench", "demo", "generate", "calibrate", "train-draft", "info", "head_window"} <= seen


def test_the_bench_phases_run_on_cuda_and_check_identity_at_fp32():
    by = phases.BY_NAME
    for name in ("bench", "bench-eager", "bench-tuned"):
        assert "--device cuda" in phases.bench_args() and by[name].steps[0].ok == "rc == 0"
    assert "hf-static" in by["bench"].steps[0].cmd and "--dtype bfloat16" in by["bench-bf16"].steps[0].cmd
    assert "--cuda-graphs off" in by["bench-eager"].steps[0].cmd


# ---- running phases ---------------------------------------------------------------------------------------

KILLED_LOG = """$ python3 -m pytest -v tests/test_x.py
tests/test_x.py::test_a PASSED                                        [ 25%]
tests/test_x.py::test_b[cuda-1] FAILED                                [ 50%]
tests/test_x.py::test_c SKIPPED (no GPU)                              [ 75%]
tests/test_x.py::test_d PASSED                                        [100%]
"""


def test_a_foreground_run_records_pass_fail_and_timeout_and_kills_the_whole_step(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    tiny = tmp_path / "test_tiny.py"
    tiny.write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n\ndef test_c():\n    assert 1 == 2\n")
    table = [
        {"name": "ok", "minutes": 1, "steps": [["echo", "echo fine"], ["true", "true"]]},
        {"name": "bad", "minutes": 1, "steps": [["first", "exit 3"], ["second", "echo still runs"],
                                                ["pytest", f"{{py}} -m pytest -v -p no:cacheprovider "
                                                           f"--junitxml={{dir}}/junit-t.xml {tiny}"]]},
        {"name": "slow", "minutes": 1, "steps": [["sleep", f"(sleep 60 & echo $! > {pidfile}; wait) ; true"],
                                                 ["never", "echo never"]]},
    ]
    t0 = time.monotonic()
    # 15 s, not less: the `bad` phase starts a pytest of its own, and under pytest-xdist on a 2-core machine that
    # took more than 3 s (a CI run failed here with `bad` timed out); `slow` sleeps 60 s and is still killed
    r = _gpu(["--phases-file", _phases_file(tmp_path, table)], tmp_path, {"HETEROSPEC_GPU_PHASE_LIMIT": "15"})
    assert time.monotonic() - t0 < 55
    assert r.returncode == 1, r.stdout + r.stderr
    work = tmp_path / "work"
    st = {n: json.loads((work / n / "status.json").read_text()) for n in ("ok", "bad", "slow")}
    assert st["ok"]["state"] == "pass" and [s["state"] for s in st["ok"]["steps"]] == ["pass", "pass"]
    # a failed step fails the phase, and the later steps still run (one call yields everything)
    assert st["bad"]["state"] == "fail" and [s["rc"] for s in st["bad"]["steps"]] == [3, 0, 1]
    assert "Tests: 2 passed, 1 failed, 0 errors, 0 skipped." in (work / "bad" / "summary.md").read_text()
    # the limit kills the step's process group (the backgrounded sleep too) and ends the phase
    assert st["slow"]["state"] == "timeout" and [s["step"] for s in st["slow"]["steps"]] == ["sleep"]
    pid = int(pidfile.read_text())
    time.sleep(0.5)
    assert not phases._alive(pid)
    assert "Tests:" not in (work / "ok" / "summary.md").read_text()   # it ran no tests
    # results: two files in $OUT whatever the number of phases
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["gpu-results.tar.gz", "summary.md"]
    text = (out / "summary.md").read_text()
    assert "| ok | pass |" in text and "| bad | fail |" in text and "| slow | timeout |" in text
    assert "# Phase `slow`: TIMEOUT" in text
    with tarfile.open(out / "gpu-results.tar.gz") as tar:
        names = tar.getnames()
    assert {"ok/status.json", "ok/summary.md", "bad/first.log", "slow/sleep.log"} <= set(names)
    assert all(n.count("/") <= 1 for n in names)   # flat enough to come back


def test_only_the_named_phases_run_and_a_passing_run_exits_zero(tmp_path):
    table = [{"name": "a", "steps": [["x", "true"]]}, {"name": "b", "steps": [["x", "false"]]},
             {"name": "c", "default": False, "steps": [["x", "true"]]}]
    f = _phases_file(tmp_path, table)
    r = _gpu(["--phases-file", f, "a"], tmp_path)
    assert r.returncode == 0, r.stdout
    assert sorted(os.listdir(tmp_path / "work")) == ["a", phases.MONITOR_LOG, "site", "state"]
    r = _gpu(["--phases-file", f], tmp_path)           # no argument: the default phases, in order
    assert r.returncode == 1 and "phase c" not in r.stdout
    assert r.stdout.index("phase a") < r.stdout.index("phase b")


def test_a_cuda_phase_builds_first_and_is_skipped_when_the_build_fails(tmp_path):
    table = [{"name": "build", "steps": [["build", "echo building"]]},
             {"name": "k", "needs": ["cuda"], "steps": [["x", "echo kernels"]]}]
    r = _gpu(["--phases-file", _phases_file(tmp_path, table), "k"], tmp_path)
    assert "running `build` first" in r.stdout and r.stdout.index("phase build") < r.stdout.index("phase k")
    assert json.loads((tmp_path / "work" / "k" / "status.json").read_text())["state"] == "pass"
    table[0]["steps"] = [["build", "exit 1"]]
    r = _gpu(["--phases-file", _phases_file(tmp_path, table), "k"], tmp_path)
    st = json.loads((tmp_path / "work" / "k" / "status.json").read_text())
    assert r.returncode == 1 and st["state"] == "skip" and st["reason"] == "the build phase failed"


def test_a_phase_without_its_questions_is_skipped_saying_why(tmp_path):
    empty = tmp_path / "noquestions"
    empty.mkdir()
    table = [{"name": "b", "needs": ["questions"], "steps": [["x", "echo {questions}"]]}]
    r = _gpu(["--phases-file", _phases_file(tmp_path, table)], tmp_path, {"HETEROSPEC_QUESTIONS": str(empty)})
    st = json.loads((tmp_path / "work" / "b" / "status.json").read_text())
    assert r.returncode == 1 and st["state"] == "skip" and "HETEROSPEC_QUESTIONS" in st["reason"]
    assert "Skipped:" in (tmp_path / "out" / "summary.md").read_text()
    (empty / "mt_bench.jsonl").write_text("{}\n")
    r = _gpu(["--phases-file", _phases_file(tmp_path, table)], tmp_path, {"HETEROSPEC_QUESTIONS": str(empty)})
    assert r.returncode == 0 and str(empty) in (tmp_path / "work" / "b" / "x.log").read_text()


def test_background_returns_at_once_and_wait_reports(tmp_path):
    table = [{"name": "quick", "steps": [["x", "echo quick"]]},
             {"name": "slow", "steps": [["x", "sleep 15; echo done"]]}]
    f = _phases_file(tmp_path, table)
    t0 = time.monotonic()
    r = _gpu(["--phases-file", f, "--background", "quick", "slow"], tmp_path)
    # returning well before `slow` ends is the point; the margin is for a loaded 2-core CI machine under xdist
    assert r.returncode == 0 and time.monotonic() - t0 < 12, r.stdout + r.stderr
    # a second run while it goes would share the GPU and the folders: refused, one line
    r2 = _gpu(["--phases-file", f, "quick"], tmp_path)
    assert r2.returncode == 2 and "still going" in r2.stderr and len(r2.stderr.strip().splitlines()) == 1
    r3 = _gpu(["--phases-file", f, "--wait", "0"], tmp_path)
    assert r3.returncode == phases.STILL_RUNNING, r3.stdout
    r4 = _gpu(["--phases-file", f, "--wait", "60"], tmp_path)
    assert r4.returncode == 0, r4.stdout + r4.stderr
    assert "# Phase `quick`: PASS" in r4.stdout and "# Phase `slow`: PASS" in r4.stdout
    assert "done" in (tmp_path / "work" / "slow" / "x.log").read_text()
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "background run of quick, slow: finished" in text


def test_a_background_run_works_from_its_own_snapshot_of_the_checkout(tmp_path):
    """The device tool re-sends the working tree with every call, so a background run works from a copy: the
    third window lost a header mid-build and one xdist worker collected the op tests without their conftest."""
    table = [{"name": "where", "steps": [["x", "pwd; test -f tests/conftest.py && test -f csrc/cuda/rows.cuh "
                                               "&& test ! -e .git && echo complete"]]}]
    f = _phases_file(tmp_path, table)
    assert _gpu(["--phases-file", f, "--background", "where"], tmp_path).returncode == 0
    assert _gpu(["--phases-file", f, "--wait", "60"], tmp_path).returncode == 0
    log = (tmp_path / "work" / "where" / "x.log").read_text()
    assert str(tmp_path / "work" / "src") in log and "complete" in log, log


def test_a_snapshot_copies_the_tree_without_environments_builds_or_itself(tmp_path):
    src = tmp_path / "repo"
    for rel in ("a.py", "pkg/_C.so", "tests/conftest.py", ".git/HEAD", ".venv/bin/python", "build/x.o",
                "pkg/__pycache__/a.pyc", "x.egg-info/PKG-INFO", ".gpu-carry/1/part", "benchmarks/build/keep.txt",
                "gpu-out/phase/log"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    dst = src / "gpu-out" / "src"          # inside the checkout, as the default work folder is
    (dst / "stale").mkdir(parents=True)
    phases.snapshot(str(src), str(dst), skip=[str(src / "gpu-out")])
    got = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    assert got == ["a.py", "benchmarks/build/keep.txt", "pkg/_C.so", "tests/conftest.py"]
    (src / "a.py").write_text("changed")   # the next call's copy of the tree does not reach the run's
    assert (dst / "a.py").read_text() == "a.py"


def test_a_killed_background_run_leaves_its_phase_interrupted_not_running(tmp_path):
    table = [{"name": "slow", "steps": [["x", "sleep 60"]]}]
    f = _phases_file(tmp_path, table)
    assert _gpu(["--phases-file", f, "--background", "slow"], tmp_path).returncode == 0
    bg = json.loads((tmp_path / "work" / "background.json").read_text())
    for _ in range(50):
        if (tmp_path / "work" / "slow" / "x.log").exists():
            break
        time.sleep(0.1)
    os.killpg(bg["pid"], 9)
    r = _gpu(["--phases-file", f, "--wait", "10"], tmp_path)
    assert r.returncode == 1
    assert json.loads((tmp_path / "work" / "slow" / "status.json").read_text())["state"] == "interrupted"


@pytest.mark.parametrize("args, arg", [(["nope"], "phase"), (["--wait", "-1"], "--wait"),
                                       (["--wait", "5", "build"], "--wait")])
def test_bad_arguments_are_one_line_with_status_2(tmp_path, args, arg):
    r = _gpu(args, tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and arg in r.stderr


# ---- summaries --------------------------------------------------------------------------------------------

def test_test_counts_come_from_junit_or_from_a_killed_pytests_log(tmp_path):
    (tmp_path / "pytest.log").write_text(KILLED_LOG)
    assert phases.test_counts(str(tmp_path)) == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1}
    (tmp_path / "junit-k.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="10" failures="2" errors="1" '
        'skipped="3"></testsuite></testsuites>')
    assert phases.test_counts(str(tmp_path)) == {"passed": 4, "failed": 2, "errors": 1, "skipped": 3}
    empty = tmp_path / "none"
    empty.mkdir()
    assert phases.test_counts(str(empty)) is None


def _metrics(tps, host=None, calls=10, tau=None):
    return {"tokens_per_s": sum(tps) / len(tps), "per_question_tokens_per_s": tps, "host_ms_per_cycle": host,
            "verification_calls": calls, "tau": tau}


def test_bench_numbers_are_against_hf_static_and_the_goals(tmp_path):
    files = {"mt_bench": {"ar": _metrics([60, 40], 0.2, tau=1.0), "hf-static": _metrics([50, 40]),
                          "eagle3": _metrics([100, 60], 0.5, tau=2.5), "heterospec": _metrics([120, 90], 0.25, tau=3.0)},
             "gsm8k": {"ar": _metrics([30], 0.2, tau=1.0), "hf-static": _metrics([20]),
                       "eagle3": _metrics([40], 0.1, tau=2.0), "heterospec": _metrics([50], 0.2, tau=2.5)}}
    mean = {n: {"tokens_per_s": 1.0, "tau": None} for n in ("ar", "hf-static", "eagle3", "heterospec")}
    result = {"settings": {"device": "cuda", "dtype": "float32", "cuda_graphs": True, "limit": 2,
                           "max_new_tokens": 256}, "machine": {"gpu": "NVIDIA H100"},
              "runs": [{"temperature": 0.0, "files": files, "mean": mean, "mismatches": []}]}
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.json").write_text(json.dumps(result))
    text = "\n".join(phases.bench_numbers(str(tmp_path)))
    # heterospec over hf-static: mt_bench (120/50 + 90/40) / 2 = 2.325, gsm8k 50/20 = 2.5; mean 2.4125
    assert "| heterospec | 1.0 | 2.41 |" in text and "| ≥ 2× | yes |" in text
    # eagle3: ((100/50 + 60/40) / 2 + 40/20) / 2 = 1.875 >= 1.5; ar: ((60/50 + 40/40)/2 + 30/20) / 2 = 1.3 >= 1.2
    assert "| eagle3 | 1.0 | 1.88 |" in text and "| ar | 1.0 | 1.30 |" in text
    # host ms per cycle: eagle3 worst file 0.5 > 0.3
    assert "| host time per cycle (eagle3, heterospec; worst file) | 0.5 ms | ≤ 0.3 ms | NO |" in text
    assert "0 outputs differ" in text


def test_kernel_numbers_read_the_cycle_and_verify_sample(tmp_path):
    r = {"device": "NVIDIA H100", "torch": "2.11", "cuda": "13.0", "iters": 200,
         "results": {"torch": {"median_us": 900.0}, "ops": {"median_us": 300.0}, "ops-graph": {"median_us": 42.0}},
         "per_op": {"rows": [{"op": "expand", "graph_median_us": 5.0}, {"op": "verify_sample", "graph_median_us": 31.5}]}}
    (tmp_path / "cuda-cycle.json").write_text(json.dumps(r))
    text = "\n".join(phases.kernel_numbers(str(tmp_path)))
    assert "| the C core's cycle in a CUDA graph | 42 µs | ≤ 50 µs | yes |" in text
    assert "| verify_sample in a graph | 31.5 µs | ≤ 20 µs | NO |" in text


def test_scale_numbers_fall_back_to_the_stages_a_killed_run_finished(tmp_path):
    (tmp_path / "scale").mkdir()
    assert phases.scale_numbers(str(tmp_path)) == []
    (tmp_path / "scale" / "progress.json").write_text(json.dumps(
        {"stages": [{"stage": "build", "at_s": 9.5}, {"stage": "hf", "at_s": 40.0, "rows": {}}]}))
    assert phases.scale_numbers(str(tmp_path)) == ["stopped early; finished: build at 9.5 s",
                                                   "stopped early; finished: hf at 40.0 s"]
    (tmp_path / "scale" / "scale.md").write_text("# Scale rehearsal\n\nline one\nline two")
    assert phases.scale_numbers(str(tmp_path)) == ["line one", "line two"]


def test_a_summary_survives_unreadable_numbers(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({"phase": "bench", "state": "pass", "steps": []}))
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.json").write_text(json.dumps({"settings": {}}))
    text = phases.phase_summary(str(tmp_path))
    assert text.startswith("# Phase `bench`: PASS") and "could not be read" in text


# ---- carried bundles --------------------------------------------------------------------------------------

def test_plan_splits_only_what_does_not_fit_and_keeps_every_byte():
    layout = carry.plan([("a", 30), ("big", 250), ("c", 10), ("d", 0)], 100)
    assert layout == [[("a", 0, 0, 30), ("big", 0, 0, 70)], [("big", 1, 70, 100)],
                      [("big", 2, 170, 80), ("c", 0, 0, 10), ("d", 0, 0, 0)]]
    assert all(sum(n for *_, n in b) <= 100 for b in layout)
    # a whole file that fits a fresh bundle is not split across two
    assert carry.plan([("a", 60), ("b", 60)], 100) == [[("a", 0, 0, 60)], [("b", 0, 0, 60)]]
    with pytest.raises(carry.CarryError, match="max bytes per bundle"):
        carry.plan([("a", 1)], 0)


def _wheel(path, name="hsfake", value=42):
    dist = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VALUE = {value}\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", f"{name}/__init__.py,,\n{dist}/METADATA,,\n{dist}/WHEEL,,\n{dist}/RECORD,,\n")


def _pack(tmp_path, max_bytes):
    w = tmp_path / "hsfake-1.0-py3-none-any.whl"
    _wheel(w)
    q = tmp_path / "q.jsonl"
    q.write_text('{"question_id": 1, "turns": ["hi"]}\n')
    sources = {"wheels/" + w.name: str(w), "questions/mt_bench.jsonl": str(q)}
    return carry.pack(sources, str(tmp_path / "carry"), max_bytes), w


def test_bundles_reassemble_in_any_order_and_install_offline(tmp_path):
    m, w = _pack(tmp_path, max_bytes=300)
    whl = m["files"]["wheels/" + w.name]
    assert m["bundles"] >= 3 and len(whl["parts"]) >= 2
    for b in range(1, m["bundles"] + 1):
        d = tmp_path / "carry" / str(b)
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs if f != "MANIFEST.json")
        assert size <= m["max_bytes"]
    store = tmp_path / "store"
    order = list(range(m["bundles"], 0, -1))              # the last bundle first
    for i, b in enumerate(order):
        r = carry.stash(str(tmp_path / "carry" / str(b)), str(store))
        if i < len(order) - 1:
            assert "wheels/" + w.name in r["waiting"] or "wheels/" + w.name in r["complete"]
    assert set(r["complete"]) == {"wheels/" + w.name, "questions/mt_bench.jsonl"} and not r["waiting"]
    assert carry.sha256(store / "files" / "wheels" / w.name) == carry.sha256(w)
    site = tmp_path / "site"
    assert carry.install(str(store), str(site)) == [w.name]
    assert carry.install(str(store), str(site)) == []       # installed once
    out = subprocess.run([sys.executable, "-c", "import hsfake; print(hsfake.VALUE)"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(site)))
    assert out.stdout.strip() == "42"


def test_a_corrupted_part_is_refused_naming_the_file_and_the_bundle(tmp_path):
    m, w = _pack(tmp_path, max_bytes=300)
    parts = m["files"]["wheels/" + w.name]["parts"]
    assert len(parts) >= 2
    victim = tmp_path / "carry" / str(parts[1]["bundle"]) / parts[1]["file"]
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))
    store = str(tmp_path / "store")
    with pytest.raises(carry.CarryError, match=rf"{w.name}: part .*bundle {parts[1]['bundle']}: expected sha256"):
        for b in range(1, m["bundles"] + 1):
            carry.stash(str(tmp_path / "carry" / str(b)), store)


def test_a_directory_that_is_not_a_bundle_is_one_line(tmp_path):
    with pytest.raises(carry.CarryError, match="MANIFEST.json"):
        carry.stash(str(tmp_path), str(tmp_path / "store"))


def test_gpu_stashes_one_bundle_per_call_and_the_phases_see_what_is_installed(tmp_path):
    m, w = _pack(tmp_path, max_bytes=700)
    assert m["bundles"] >= 2
    table = [{"name": "use", "steps": [["x", "{py} -c 'import hsfake; print(hsfake.VALUE)' && echo {questions}"]]}]
    f = _phases_file(tmp_path, table)
    for b in range(1, m["bundles"]):
        r = _gpu(["--phases-file", f, "--dry-run", "use"], tmp_path,
                 {"HETEROSPEC_WHEELS": str(tmp_path / "carry" / str(b))})
        assert r.returncode == 0 and "not carried yet" in r.stdout, r.stdout + r.stderr
    r = _gpu(["--phases-file", f, "use"], tmp_path, {"HETEROSPEC_WHEELS": str(tmp_path / "carry" / str(m["bundles"]))})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "installed " + w.name in r.stdout
    log = (tmp_path / "work" / "use" / "x.log").read_text()
    # the wheels from the bundles; the questions from the checkout (they travel with the working tree)
    assert "42" in log and os.path.join(REPO, "benchmarks", "data", "questions") in log
    r = _gpu(["--phases-file", f, "use"], tmp_path, {"HETEROSPEC_WHEELS": str(tmp_path)})
    assert r.returncode == 2 and "HETEROSPEC_WHEELS" in r.stderr and "Traceback" not in r.stderr


def test_prepare_packs_local_wheels_and_the_shared_data(tmp_path):
    wd = tmp_path / "wheels"
    wd.mkdir()
    _wheel(wd / "hsfake-1.0-py3-none-any.whl")
    out = tmp_path / "bundles"
    r = subprocess.run([sys.executable, os.path.join(CI, "gpu_carry.py"), "prepare", "--from", str(wd), "--out",
                        str(out), "--max-mb", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "1" / "MANIFEST.json").read_text())
    assert "wheels/hsfake-1.0-py3-none-any.whl" in m["files"]
    shared = os.path.join(REPO, "..", "shared", "data", "benchmarks")
    if os.path.isdir(shared):
        assert "questions/mt_bench.jsonl" in m["files"]
    assert "HETEROSPEC_WHEELS=" in r.stdout and m["bundles"] == len(os.listdir(out))


def test_prepare_carries_the_head_windows_state_where_the_head_phase_reads_it(tmp_path):
    wd, state = tmp_path / "wheels", tmp_path / "state"
    wd.mkdir()
    state.mkdir()
    _wheel(wd / "hsfake-1.0-py3-none-any.whl")
    for k in (1, 2):
        (state / f"head-window.tar.{k:02d}").write_bytes(os.urandom(3000))
    (state / "notes.txt").write_text("not a part")
    out = tmp_path / "bundles"
    r = subprocess.run([sys.executable, os.path.join(CI, "gpu_carry.py"), "prepare", "--from", str(wd), "--out",
                        str(out), "--max-mb", "1", "--head-state", str(state)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "1" / "MANIFEST.json").read_text())
    assert {"head/head-window.tar.01", "head/head-window.tar.02"} <= set(m["files"]) and "head/notes.txt" not in m["files"]
    store = tmp_path / "store"
    for b in sorted(os.listdir(out)):
        phases.gpu_carry.stash(str(out / b), str(store))
    assert (store / "files" / "head" / "head-window.tar.02").read_bytes() == (state / "head-window.tar.02").read_bytes()
    ctx = phases.make_context()
    cmd = ctx.fill(phases.BY_NAME["head"].steps[0].cmd, str(tmp_path / "head"))
    assert f"--state {os.path.join(ctx.work, 'carry', 'files', 'head')}" in cmd   # where stash puts them
    r = subprocess.run([sys.executable, os.path.join(CI, "gpu_carry.py"), "prepare", "--from", str(wd), "--out",
                        str(tmp_path / "b2"), "--head-state", str(tmp_path / "none")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--head-state" in r.stderr and "Traceback" not in r.stderr


def test_bench_batch_numbers_are_the_benchs_own_table(tmp_path):
    """bench-batch's summary shows the throughput-vs-batch table from the bench's batch.json (the same table
    the bench prints), with the ratio to ar and the batch size where a method stops beating it."""
    row = lambda t: {"tokens_per_s": t, "latency_mean_s": 1.0, "tau": None, "verified_per_call": None}  # noqa: E731
    r = {"batch_sizes": [1, 4], "prompts": 8, "max_new_tokens": 64, "machine": {"summary": "NVIDIA H200"},
         "results": {"1": {"ar": row(100.0), "eagle3": row(150.0)}, "4": {"ar": row(300.0), "eagle3": row(240.0)}},
         "mismatches": [], "stops_beating_ar": {"eagle3": 4}}
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "batch.json").write_text(json.dumps(r))
    text = "\n".join(phases.NUMBERS["bench-batch"](str(tmp_path)))
    assert text.startswith("NVIDIA H200; 64 new tokens per request, 8 prompts")
    assert "| eagle3 | 150.0 (1.50×)" in text and "240.0 (0.80×)" in text and "eagle3: 4" in text
    assert phases.NUMBERS["bench-batch"](str(tmp_path / "none")) == []


# ---- the window plan and the ledger (issue 40.1) ------------------------------------------------------------

window = _module("gpu_window")


def _table(specs):
    """A phase table from (name, kind, minutes, needs) tuples, as load_phases_file makes it."""
    return {n: phases.Phase(n, m, "", (phases.Step("x", f"echo {n}"),), tuple(needs), True, kind)
            for n, kind, m, needs in specs}


def _entry(digest, state="pass", minutes=None, definition=None):
    return {"kind": "correctness", "digest": digest, "state": state, "minutes": minutes, "definition": definition,
            "date": "2026-11-26 02:00:00 UTC"}


def test_dry_run_window_prints_a_plan_without_a_gpu(tmp_path):
    """Issue 40's "done when": `bash .ci/gpu --window 12 --dry-run` prints a plan on a machine without a GPU,
    from the committed ledger, with correctness before speed and nothing over the window."""
    r = _gpu(["--window", "12", "--dry-run"], tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [[c.strip() for c in row] for row in rows[1:]]          # past the header
    assert rows and rows[0][1] == "build"
    kinds = [row[2] for row in rows]
    assert kinds == sorted(kinds), kinds                           # "correctness" < "speed": correctness first
    expected = float(re.search(r"Expected: about ([\d.]+) of 12 minutes", r.stdout).group(1))
    assert expected <= 12
    assert "# build (needs: nothing)" in r.stdout                  # and the commands it would run
    assert not (tmp_path / "work" / "build").exists()              # a dry run runs nothing


def test_the_committed_ledger_names_real_phases_and_is_well_formed():
    led = window.load_ledger(window.LEDGER)
    assert led["phases"], "the ledger starts from the two windows of 2026-11-26"
    for name, e in led["phases"].items():
        assert name in phases.BY_NAME, name
        assert e["kind"] == phases.BY_NAME[name].kind
        assert e["state"] in ("pass", "fail", "timeout", "skip", "interrupted")
        assert re.fullmatch(r"[0-9a-f]{16}", e["digest"]) and e["device"].startswith("NVIDIA")
    # a recorded window's numbers are its raw results': the bf16 bench's entry, read from the committed results.json
    # of the window that ran it (the raw folder whose phase status ended when the entry says), not from the ledger
    e = led["phases"]["bench-bf16"]
    base = os.path.join(REPO, "benchmarks", "results", window.WINDOWS_DIR)
    (folder,) = [d for d in os.listdir(base) if os.path.isfile(os.path.join(base, d, "bench-bf16", "status.json"))
                 and json.load(open(os.path.join(base, d, "bench-bf16", "status.json"))).get("ended") == e["date"]]
    with open(os.path.join(base, folder, "bench-bf16", "bench", "results.json")) as f:
        raw = json.load(f)
    t0 = next(run for run in raw["runs"] if run["temperature"] == 0.0)
    assert e["device"].startswith("NVIDIA") and folder.startswith(e["date"][:10])
    assert e["numbers"]["T0"]["hf-static"]["tokens_per_s"] == round(t0["mean"]["hf-static"]["tokens_per_s"], 1)


def test_plan_takes_what_has_not_passed_on_this_code_correctness_first_side_by_side():
    t = _table([("build", "correctness", 0.5, ["cuda"]), ("k", "correctness", 1, ["cuda"]),
                ("e", "correctness", 4, ["cuda"]), ("c", "correctness", 2, ["cuda", "pair"]),
                ("s1", "speed", 3, ["cuda"]), ("s2", "speed", 5, ["cuda"])])
    digests = {n: f"d-{n}" for n in t}
    none = {"phases": {}, "windows": []}
    p = window.plan(t, none, 20, digests)
    # every correctness phase side by side, the one needing the pair too (it starts once the bundles are in)
    assert p["setup"] == ["build"] and p["group"] == ["k", "e", "c"] and p["serial"] == ["s1", "s2"]
    # side by side: the longest plus CONTENTION of the rest, not the sum
    assert p["minutes"] == pytest.approx(window.START_MINUTES + 0.5 + 4 + window.CONTENTION * (1 + 2) + 3 + 5)
    # a phase that passed on this digest is done; one that passed on other code, or failed, runs again
    led = {"phases": {"e": _entry("d-e"), "k": _entry("old"), "s1": _entry("d-s1", "fail")}, "windows": []}
    p = window.plan(t, led, 20, digests)
    assert "e" not in p["run"] and "k" in p["group"] and "s1" in p["serial"]
    assert "code changed" in p["why"]["k"] and "failed" in p["why"]["s1"] and p["why"]["s2"] == "never run on a GPU"
    # a speed phase with no passing result yet goes before one that passed on older code (numbers to refresh),
    # whatever their priority; correctness still first
    led = {"phases": {"k": _entry("old"), "s1": _entry("old")}, "windows": []}
    p = window.plan(t, led, 20, digests)
    assert p["group"] == ["k", "e", "c"] and p["serial"] == ["s2", "s1"]
    assert window.plan(t, led, 14.5, digests)["serial"] == ["s2"]     # s2 fits, s1 no longer does
    # what does not fit is left, named with its minutes; nothing planned goes over the window
    p = window.plan(t, none, 9, digests)
    assert p["run"] == ["build", "k", "e", "c"] and [n for n, _ in p["left"]] == ["s1", "s2"]
    assert p["minutes"] <= 9 and "3 min expected" in p["left"][0][1]
    # every phase done: nothing to run, build included
    done = {"phases": {n: _entry(d) for n, d in digests.items()}, "windows": []}
    assert window.plan(t, done, 20, digests)["run"] == []


def test_the_head_recipe_runs_beside_the_correctness_group_in_every_window():
    """The head recipe (issue 43) continues from its carried state, so it is planned in every window it fits
    (even after passing on this code), side by side with the correctness group and before any speed phase; the
    group's minutes are then its own (the longest) plus a share of the others."""
    import dataclasses

    t = _table([("build", "correctness", 0.5, ["cuda"]), ("k", "correctness", 4, ["cuda"]),
                ("s1", "speed", 3, ["cuda"])])
    t["head"] = dataclasses.replace(phases.BY_NAME["head"], minutes=8)
    digests = {n: f"d-{n}" for n in t}
    done = {"phases": {n: _entry(f"d-{n}") for n in t}, "windows": []}
    p = window.plan(t, done, 14, digests, env={})
    assert p["group"] == ["head"] and "every window" in p["why"]["head"]    # passed on this code: runs again
    p = window.plan(t, {"phases": {}, "windows": []}, 13, digests, env={})
    assert p["group"] == ["k", "head"] and p["serial"] == []                # before s1, which no longer fits
    assert p["minutes"] == pytest.approx(window.START_MINUTES + 0.5 + 8 + window.CONTENTION * 4)
    assert window.plan(t, {"phases": {}, "windows": []}, 17, digests, env={})["serial"] == ["s1"]
    assert phases.BY_NAME["head"].window and not phases.BY_NAME["vllm"].window


def test_head_seconds_sets_the_head_s_minutes_so_a_speed_phase_can_follow(tmp_path):
    """HEAD_SECONDS, which the head phase's command reads, also sets its minutes in the plan (seconds / 60 plus
    the pair's loading): at the default 500 s nothing follows the group and the head in 14 minutes; at 300 s a
    3-minute speed phase does.  A value the command could not run in one call is one line, status 2."""
    import dataclasses

    t = _table([("build", "correctness", 0.5, ["cuda"]), ("k", "correctness", 4, ["cuda"]),
                ("s1", "speed", 3, ["cuda"])])
    t["head"] = dataclasses.replace(phases.BY_NAME["head"], minutes=9)
    digests = {n: f"d-{n}" for n in t}
    none = {"phases": {}, "windows": []}
    p = window.plan(t, none, 14, digests, env={})
    assert p["expected"]["head"] == 9 and p["serial"] == [] and [n for n, _ in p["left"]] == ["s1"]
    at_default = window.plan(t, none, 14, digests, env={"HEAD_SECONDS": "500"})
    assert at_default["expected"]["head"] == pytest.approx(9, abs=0.01)
    p = window.plan(t, none, 14, digests, env={"HEAD_SECONDS": "300"})
    assert p["expected"]["head"] == pytest.approx(300 / 60 + window.HEAD_OVERHEAD_MINUTES)
    assert p["group"] == ["k", "head"] and p["serial"] == ["s1"]
    assert p["minutes"] == pytest.approx(window.START_MINUTES + 0.5 + p["expected"]["head"]
                                         + window.CONTENTION * 4 + 3)
    for bad in ("abc", "30", "600", "-5"):
        with pytest.raises(window.LedgerError, match="HEAD_SECONDS: expected seconds from 60 to 540"):
            window.plan(t, none, 14, digests, env={"HEAD_SECONDS": bad})
    r = _gpu(["--window", "14", "--dry-run"], tmp_path, {"HEAD_SECONDS": "abc"})
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "HEAD_SECONDS" in r.stderr
    assert "Traceback" not in r.stderr
    r = _gpu(["--window", "14", "--dry-run"], tmp_path, {"HEAD_SECONDS": "300"})
    assert r.returncode == 0 and re.search(r"\| head \| speed \| [^|]+ \| 5\.67 \|", r.stdout), r.stdout


def test_expected_minutes_come_from_the_last_run_of_the_same_definition():
    (ph,) = _table([("e", "correctness", 3, ["cuda"])]).values()
    same = window.phase_definition(ph)
    assert window.expected_minutes(ph, None) == 3
    assert window.expected_minutes(ph, _entry("x", "pass", 1.25, same)) == 1.25
    assert window.expected_minutes(ph, _entry("x", "pass", 1.25, "another")) == 3   # run another way then
    assert window.expected_minutes(ph, _entry("x", "timeout", 9.0, same)) == 9.0    # cut: at least that again
    assert window.expected_minutes(ph, _entry("x", "fail", 0.2, same)) == 3        # failed early: the estimate
    assert window.expected_minutes(ph, _entry("x", "fail", 6.5, same)) == 6.5      # failed late: that again


def _git_repo(tmp_path):
    root = tmp_path / "repo"
    for rel, text in {"setup.py": "x = 1\n", "pyproject.toml": "[p]\n", "csrc/a.c": "int a;\n",
                      "heterospec/__init__.py": "", "tests/test_k.py": "def test(): pass\n",
                      "tests/test_other.py": "def test(): pass\n", "benchmarks/b.py": ""}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "one"]):
        subprocess.run(["git", *cmd], cwd=root, check=True, env=env)
    return root


def test_a_digest_is_the_same_from_a_checkout_a_copy_and_a_commit_and_follows_the_phase_deps(tmp_path):
    root = _git_repo(tmp_path)
    ph = phases.Phase("k", 1, "", (phases.Step("pytest", "{py} -m pytest tests/test_k.py"),), ("cuda",))
    d = window.phase_digest(ph, window.Tree(str(root)))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    assert window.phase_digest(ph, window.Tree(str(root), head)) == d
    # the device tool's copy has no .git, and gains build products: the same digest
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".git"))
    (copy / "heterospec" / "_C.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (copy / "heterospec" / "__pycache__").mkdir()
    (copy / "heterospec" / "__pycache__" / "x.pyc").write_bytes(b"x")
    assert window.phase_digest(ph, window.Tree(str(copy))) == d
    # a test file the phase does not run leaves it alone; its own test file, the core and its command change it
    (copy / "tests" / "test_other.py").write_text("def test(): assert 0\n")
    assert window.phase_digest(ph, window.Tree(str(copy))) == d
    (copy / "tests" / "test_k.py").write_text("def test(): assert 0\n")
    assert window.phase_digest(ph, window.Tree(str(copy))) != d
    assert window.phase_digest(ph, window.Tree(str(root))) == d
    (root / "csrc" / "a.c").write_text("int b;\n")
    assert window.phase_digest(ph, window.Tree(str(root))) != d
    ph2 = phases.Phase("k", 1, "", (phases.Step("pytest", "{py} -m pytest -x tests/test_k.py"),), ("cuda",))
    assert window.phase_digest(ph2, window.Tree(str(root), head)) != d


def test_the_cpu_only_extensions_sources_count_for_the_build_alone(tmp_path):
    """csrc/gemm/ (heterospec._gemm, the CPU decoder's kernels) enters the digest of `build`, which compiles and
    imports it, and of no other phase; the rest of csrc/ enters every phase's."""
    root = _git_repo(tmp_path)
    (root / "csrc" / "gemm").mkdir()
    (root / "csrc" / "gemm" / "rows.c").write_text("int r;\n")
    build = phases.Phase("build", 1, "", (phases.Step("b", "{py} setup.py build_ext --inplace"),), ("cuda",))
    k = phases.Phase("k", 1, "", (phases.Step("pytest", "{py} -m pytest tests/test_k.py"),), ("cuda",))
    tree = window.Tree(str(root))
    assert "csrc/gemm/rows.c" in window.phase_files(build, tree) and "csrc/a.c" in window.phase_files(build, tree)
    assert "csrc/gemm/rows.c" not in window.phase_files(k, tree) and "csrc/a.c" in window.phase_files(k, tree)
    before = {ph.name: window.phase_digest(ph, window.Tree(str(root))) for ph in (build, k)}
    (root / "csrc" / "gemm" / "rows.c").write_text("int s;\n")
    after = {ph.name: window.phase_digest(ph, window.Tree(str(root))) for ph in (build, k)}
    assert after["k"] == before["k"] and after["build"] != before["build"]
    (root / "csrc" / "a.c").write_text("int c;\n")
    assert window.phase_digest(k, window.Tree(str(root))) != before["k"]


def test_the_package_counts_as_far_as_a_phase_reaches_it_by_import(tmp_path):
    """A module of heterospec/ enters a phase's digest only when the phase reaches it by import: from the test
    files (or folders of them) its commands name and the tests' helpers, the benchmark modules it runs, the
    command line when it runs it; imports inside functions, relative ones, and the package's lazy names (imported
    from it or read as its attributes) count.  The package's other files always count; a file that does not
    parse makes the whole package count."""
    root = _git_repo(tmp_path)
    files = {"heterospec/__init__.py": '_LAZY = {"Thing": ("engine", "Thing")}\n_SUBMODULES = ("ops",)\n',
             "heterospec/engine.py": "from .core import x\n", "heterospec/core.py": "x = 1\n",
             "heterospec/ops.py": "y = 1\n", "heterospec/tools/__init__.py": "",
             "heterospec/tools/cli.py": "from ..engine import x\n",
             "heterospec/__main__.py": "from .tools import cli\n",
             "heterospec/data/profile.json": "{}", "benchmarks/b.py": "import heterospec.ops\n",
             "tests/_helper.py": "def f():\n    from heterospec.tools import cli\n",
             "tests/ops/test_a.py": "import _helper\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)

    def deps(cmd, test_text=None):
        if test_text is not None:
            (root / "tests" / "test_k.py").write_text(test_text)
        ph = phases.Phase("k", 1, "", (phases.Step("s", cmd),), ("cuda",))
        got = window.phase_deps(ph, window.Tree(str(root)))
        return {f[len("heterospec/"):] for f in got if f.startswith("heterospec/")}

    plain = "{py} -m pytest tests/test_k.py"
    always = {"data/profile.json"}
    engine = {"__init__.py", "engine.py", "core.py"}
    tools = engine | {"tools/__init__.py", "tools/cli.py"}
    cases = {   # test file text -> the package's modules the phase depends on
        "def test(): pass\n": set(),
        "from heterospec import Thing\n": engine,
        "import heterospec as hs\n\ndef test():\n    hs.Thing\n": engine,
        "import heterospec\nheterospec.ops.y\n": {"__init__.py", "ops.py"},
        "def test():\n    from heterospec.tools import cli\n": tools,
        "from heterospec.core import x  # Thing, in a comment, imports nothing\n": {"__init__.py", "core.py"},
    }
    for text, want in cases.items():
        assert deps(plain, text) == always | want, text
    assert deps("{py} -m pytest tests/ops", "def test(): pass\n") == always | tools
    assert deps("{py} -m benchmarks.b --x") == always | {"__init__.py", "ops.py"}
    assert deps("{py} -m heterospec info") == always | tools | {"__main__.py"}
    assert deps(plain, "def test(:\n") == {""}     # it does not parse: "heterospec/", the whole package

    def digest(cmd):
        ph = phases.Phase("k", 1, "", (phases.Step("s", cmd),), ("cuda",))
        return window.phase_digest(ph, window.Tree(str(root)))

    (root / "tests" / "test_k.py").write_text("from heterospec import Thing\n")
    before = {c: digest(c) for c in (plain, "{py} -m benchmarks.b")}
    (root / "heterospec" / "core.py").write_text("x = 2\n")
    assert digest(plain) != before[plain] and digest("{py} -m benchmarks.b") == before["{py} -m benchmarks.b"]
    (root / "heterospec" / "data" / "profile.json").write_text('{"a": 1}')
    assert digest("{py} -m benchmarks.b") != before["{py} -m benchmarks.b"]


def test_the_static_closure_holds_every_module_the_phases_tests_import(tmp_path):
    """What reached() finds from a phase's test files is a superset of what collecting them really imports (in a
    subprocess: the engine phase's files and tests/ops); so a digest never misses a module the tests load."""
    script = tmp_path / "collect.py"
    script.write_text("import contextlib, io, json, sys\nimport pytest\n"
                      "with contextlib.redirect_stdout(io.StringIO()):\n"
                      "    pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider'] + sys.argv[1:])\n"
                      "print(json.dumps(sorted(m for m in sys.modules if m.startswith('heterospec'))))\n")
    tree = window.Tree(REPO)
    for name in ("engine", "kernels"):
        ph = phases.BY_NAME[name]
        cmd = next(s.cmd for s in ph.steps if "pytest" in s.cmd)
        named = re.findall(r"\b(tests/[\w/.-]*\w)", cmd)
        r = subprocess.run([sys.executable, str(script), *named], cwd=REPO, capture_output=True, text=True)
        imported = json.loads(r.stdout.strip().splitlines()[-1])
        deps = set(window.phase_deps(ph, tree))
        missing = [m for m in imported if not {m.replace(".", "/") + ".py", m.replace(".", "/") + "/__init__.py"} & deps
                   and {m.replace(".", "/") + ".py", m.replace(".", "/") + "/__init__.py"} & set(tree.files())]
        assert len(imported) > 5 and missing == [], (name, missing)


def test_redigest_recomputes_each_entry_at_its_commit(tmp_path):
    """--redigest: an entry of a commit of this repository gets the digest phase_deps gives at that commit; one of
    uncommitted code keeps its own."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps({"phases": {
        "kernels": {"kind": "correctness", "commit": head, "digest": "old", "state": "pass"},
        "engine": {"kind": "correctness", "commit": f"{head}+uncommitted", "digest": "mine", "state": "pass"}},
        "windows": []}))
    assert window.redigest(phases.BY_NAME, str(ledger), out=open(os.devnull, "w")) == ["kernels"]
    got = json.loads(ledger.read_text())["phases"]
    assert got["kernels"]["digest"] == window.phase_digest(phases.BY_NAME["kernels"], window.Tree(REPO, head))
    assert got["engine"]["digest"] == "mine"


def test_a_window_runs_correctness_side_by_side_then_speed_alone_and_records_into_the_ledger(tmp_path):
    span = "date +%s.%N > {dir}/t0; sleep 2; date +%s.%N > {dir}/t1"
    table = [{"name": "build", "minutes": 0.01, "steps": [["b", "echo built"]]},
             {"name": "c1", "minutes": 0.05, "needs": ["cuda"], "steps": [["s", span]]},
             {"name": "c2", "minutes": 0.05, "needs": ["cuda"], "steps": [["s", span]]},
             {"name": "c3", "minutes": 0.05, "needs": ["cuda"], "steps": [["s", span + "; exit 4"]]},
             {"name": "fast", "minutes": 0.02, "kind": "speed", "steps": [["s", "echo fast"]]},
             {"name": "huge", "minutes": 30, "kind": "speed", "steps": [["s", "echo never"]]},
             {"name": "manual", "minutes": 0.01, "window": False, "steps": [["s", "echo manual"]]}]
    f = _phases_file(tmp_path, table)
    ledger = tmp_path / "results" / "ledger.json"
    r = _gpu(["--phases-file", f, "--window", "3", "--ledger", str(ledger)], tmp_path,
             {"HETEROSPEC_GPU_WORK": str(tmp_path / "work"), "HETEROSPEC_GPU_MONITOR_S": "0.5"})
    assert r.returncode == 1, r.stdout + r.stderr          # c3 failed
    assert "side by side: c1, c2, c3" in r.stdout
    work = tmp_path / "work"
    spans = [[float((work / n / t).read_text()) for t in ("t0", "t1")] for n in ("c1", "c2", "c3")]
    assert max(a for a, _ in spans) < min(b for _, b in spans)     # all three were running at once
    st = {n: json.loads((work / n / "status.json").read_text()) for n in ("build", "c1", "c2", "c3", "fast")}
    assert [st[n]["state"] for n in ("c1", "c2", "c3", "fast")] == ["pass", "pass", "fail", "pass"]
    assert not (work / "huge").exists() and not (work / "manual").exists()   # left out of the plan
    assert re.fullmatch(r"[0-9a-f]{16}", st["c1"]["digest"]) and st["c1"]["digest"] != st["c2"]["digest"]
    assert st["c1"]["kind"] == "correctness" and st["fast"]["kind"] == "speed" and st["c1"]["device"]
    assert st["fast"]["passed"] == 1 and st["c3"]["failed"] == 1
    # the results that come back ($OUT) turn into ledger entries
    r = _gpu(["--phases-file", f, "--record", str(tmp_path / "out"), "--ledger", str(ledger)], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    led = json.loads(ledger.read_text())
    assert set(led["phases"]) == {"build", "c1", "c2", "c3", "fast"}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    e = led["phases"]["c1"]
    assert e["state"] == "pass" and e["digest"] == st["c1"]["digest"] and e["commit"].startswith(head)
    assert e["minutes"] is not None and e["expected_minutes"] == 0.05 and e["numbers"] == {}
    assert led["phases"]["c3"]["state"] == "fail" and led["windows"][-1]["phases"] == sorted(led["phases"])
    assert (ledger.parent / "gpu-windows").is_dir()          # the raw files kept beside it
    # the machine was sampled while the phases ran (over 2 s at 0.5 s), and the samples came back and were kept
    with tarfile.open(tmp_path / "out" / phases.RESULTS_TAR) as tar:
        samples = tar.extractfile(phases.MONITOR_LOG).read().decode().splitlines()
    assert len(samples) >= 3, samples
    for line in samples:
        m = re.search(r"host ([0-9.]+) of ([0-9.]+) GiB available, load [0-9.]+, gpu.*\| largest: (.*)", line)
        assert m and 0 < float(m.group(1)) <= float(m.group(2)) + 0.5 and "GiB pid" in m.group(3), line
    (kept,) = (ledger.parent / "gpu-windows").iterdir()
    assert (kept / phases.MONITOR_LOG).read_text().splitlines() == samples
    # the same results recorded again (a later call returns every phase so far) replace the window's entry
    r = _gpu(["--phases-file", f, "--record", str(tmp_path / "out"), "--ledger", str(ledger)], tmp_path)
    assert r.returncode == 0 and len(json.loads(ledger.read_text())["windows"]) == len(led["windows"])
    # the next plan skips what passed on this code and runs what failed
    r = _gpu(["--phases-file", f, "--window", "3", "--dry-run", "--ledger", str(ledger)], tmp_path)
    planned = re.findall(r"^\| \d+ \| (\S+) \|", r.stdout, flags=re.M)
    assert planned == ["build", "c3"], r.stdout


def test_two_windows_of_one_day_and_device_keep_their_raw_files_apart(tmp_path):
    """The sixth window (H200, 2026-11-28 19:21) first copied its raw files over the fifth's (the same day and
    GPU, 04:35): the folder was named by date and device alone.  A second window of a day gets a folder of its
    own; the same window recorded again reuses its folder."""
    ledger = tmp_path / "results" / "ledger.json"

    def results(name, started, text):
        d = tmp_path / name / "build"
        d.mkdir(parents=True)
        (d / "status.json").write_text(json.dumps({"state": "pass", "passed": 5, "failed": 0, "seconds": 20,
                                                   "device": "NVIDIA H200", "started": started,
                                                   "ended": started, "digest": "0" * 16}))
        (d / "build.log").write_text(text)
        return str(tmp_path / name)

    morning = results("morning", "2026-11-28 04:35:00 UTC", "the fifth window's log")
    evening = results("evening", "2026-11-28 19:21:33 UTC", "the sixth window's log")
    for r in (morning, evening, evening):
        assert window.record(r, phases.BY_NAME, str(ledger), out=open(os.devnull, "w")) == ["build"]
    kept = ledger.parent / "gpu-windows"
    assert sorted(p.name for p in kept.iterdir()) == ["2026-11-28-nvidia-h200", "2026-11-28-nvidia-h200-2"]
    assert (kept / "2026-11-28-nvidia-h200" / "build" / "build.log").read_text() == "the fifth window's log"
    assert (kept / "2026-11-28-nvidia-h200-2" / "build" / "build.log").read_text() == "the sixth window's log"
    mark = json.loads((kept / "2026-11-28-nvidia-h200-2" / window.WINDOW_FILE).read_text())
    assert mark["started"] == "2026-11-28 19:21:33 UTC" and mark["device"] == "NVIDIA H200"
    led = json.loads(ledger.read_text())                   # two windows in the ledger: the evening's twice is one
    assert [w["started"] for w in led["windows"]] == ["2026-11-28 04:35:00 UTC", "2026-11-28 19:21:33 UTC"]
    # a folder kept before WINDOW.json existed is another window's, never overwritten
    (kept / "2026-11-28-nvidia-h200" / window.WINDOW_FILE).unlink()
    later = results("later", "2026-11-28 23:00:00 UTC", "a third window's log")
    window.record(later, phases.BY_NAME, str(ledger), out=open(os.devnull, "w"))
    assert (kept / "2026-11-28-nvidia-h200" / "build" / "build.log").read_text() == "the fifth window's log"
    assert (kept / "2026-11-28-nvidia-h200-3" / "build" / "build.log").read_text() == "a third window's log"


def test_a_phase_still_running_when_the_results_came_back_is_recorded_as_interrupted(tmp_path):
    """The eighth window's head was running when its last results came back; an idle gap then gave the machine
    back.  The ledger read 'running' (a state the plan did not know: "code changed since it running"); it is an
    interrupted phase with the reason, and a later call's results of the same window replace the entry."""
    ledger = tmp_path / "results" / "ledger.json"
    d = tmp_path / "out" / "head"
    d.mkdir(parents=True)
    st = {"state": "running", "passed": None, "failed": None, "seconds": None, "device": "NVIDIA H200",
          "started": "2026-11-30 14:37:04 UTC", "digest": "0" * 16}
    (d / "status.json").write_text(json.dumps(st))
    assert window.record(str(tmp_path / "out"), phases.BY_NAME, str(ledger), out=open(os.devnull, "w")) == ["head"]
    e = json.loads(ledger.read_text())["phases"]["head"]
    assert e["state"] == "interrupted" and e["reason"] == "running when the results came back" and e["minutes"] is None
    (d / "status.json").write_text(json.dumps(dict(st, state="pass", passed=3, failed=0, seconds=480,
                                                   ended="2026-11-30 14:45:04 UTC")))
    window.record(str(tmp_path / "out"), phases.BY_NAME, str(ledger), out=open(os.devnull, "w"))
    led = json.loads(ledger.read_text())
    assert led["phases"]["head"]["state"] == "pass" and "reason" not in led["phases"]["head"]
    assert len(led["windows"]) == 1


def test_a_group_phase_that_needs_the_pair_waits_for_its_bundles_then_runs(monkeypatch):
    """The correctness phases that need the default pair run in the side-by-side group, started once the later
    calls have carried the pair's bundles in (the wait is not the phase's time), or handed to run_phase (which
    skips them, saying why) when the bundles do not come in time."""
    needs_pair = phases.Phase("c", 1, "", (phases.Step("s", "true"),), ("cuda", "pair"))
    answers = iter(["the default pair is not installed"] * 3)
    monkeypatch.setattr(phases, "unmet", lambda ctx, ph: next(answers, None))
    ran = []
    monkeypatch.setattr(phases, "run_phase", lambda ctx, ph, exp=None: ran.append((ph.name, time.monotonic())) or "r")
    t0 = time.monotonic()
    assert phases.run_when_ready(None, needs_pair, 1.0, wait_s=5, poll_s=0.05) == "r"
    assert ran and ran[0][0] == "c" and 0.05 <= ran[0][1] - t0 < 2     # it polled until the pair came
    monkeypatch.setattr(phases, "unmet", lambda ctx, ph: "the default pair is not installed")
    t0 = time.monotonic()
    phases.run_when_ready(None, needs_pair, 1.0, wait_s=0.3, poll_s=0.05)
    assert len(ran) == 2 and 0.25 <= ran[1][1] - t0 < 2                # gave up after wait_s, run_phase says why


def test_a_skipped_phase_does_not_overwrite_what_it_passed_before(tmp_path):
    table = [{"name": "p", "minutes": 0.01, "needs": ["questions"], "steps": [["s", "echo {questions}"]]}]
    f = _phases_file(tmp_path, table)
    qs = tmp_path / "qs"
    qs.mkdir()
    (qs / "a.jsonl").write_text("{}\n")
    ledger = tmp_path / "ledger.json"
    assert _gpu(["--phases-file", f, "p"], tmp_path, {"HETEROSPEC_QUESTIONS": str(qs)}).returncode == 0
    assert _gpu(["--phases-file", f, "--record", str(tmp_path / "out"), "--ledger", str(ledger)],
                tmp_path).returncode == 0
    (qs / "a.jsonl").unlink()
    assert _gpu(["--phases-file", f, "p"], tmp_path, {"HETEROSPEC_QUESTIONS": str(qs)}).returncode == 1
    r = _gpu(["--phases-file", f, "--record", str(tmp_path / "out"), "--ledger", str(ledger)], tmp_path)
    assert "stays" in r.stdout
    assert json.loads(ledger.read_text())["phases"]["p"]["state"] == "pass"


@pytest.mark.parametrize("args, arg", [(["--window", "0"], "--window"), (["--window", "5", "build"], "--window"),
                                       (["--record", "/nonexistent/results"], "--record")])
def test_bad_window_and_record_arguments_are_one_line_with_status_2(tmp_path, args, arg):
    r = _gpu(args, tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and arg in r.stderr


def test_the_window_phases_cover_the_issues_correctness_list_and_use_xdist(tmp_path, monkeypatch):
    """kernels, engine, chi-square, graphs, non-finite (in engine), calibrate and the sanitizer are correctness
    phases; the pytest ones spread over the cores with xdist where it is installed."""
    by = phases.BY_NAME
    for n in ("kernels", "engine", "engine-chi2-oracle", "engine-chi2-noisy", "graphs", "calibrate", "sanitizer"):
        assert by[n].kind == "correctness" and by[n].window, n
    assert "tests/engine/test_nonfinite.py" in by["engine"].steps[0].cmd
    for n in ("kernels-bench", "bench", "bench-bf16", "bench-batch", "profile-gpu", "graphs-bench"):
        assert by[n].kind == "speed", n
    assert by["head"].window and by["head"].beside and not by["vllm"].window   # the head: beside the group
    san = " ".join(s.cmd for s in by["sanitizer"].steps)
    assert "--tool memcheck" in san and "--tool racecheck" in san and "kns=hs_k" in san
    kb = " ".join(s.cmd for s in by["kernels-bench"].steps)
    assert "--vocab 49152" in kb and "--per-op" in kb
    monkeypatch.setenv("HETEROSPEC_GPU_WORK", str(tmp_path))
    ctx = phases.make_context()
    ctx.xdist = True
    assert " -n 6 " in ctx.fill(by["engine"].steps[0].cmd, str(tmp_path), by["engine"].workers)
    ctx.xdist = False
    assert " -n " not in ctx.fill(by["engine"].steps[0].cmd, str(tmp_path), by["engine"].workers)


def test_a_monitor_sample_is_one_line_whatever_the_processes_command_lines_hold():
    # CI's machine had a `bash -c` process whose script (newlines and all) was among the four largest: the
    # sample split over many lines and the log could no longer be read one sample a line
    script = "bash\0-c\0#!/bin/bash\nset -e\n\tpython3 -m pytest   tests/\n\0"
    assert phases._one_line(script) == "bash -c #!/bin/bash set -e python3 -m pytest tests/"
    assert phases._one_line("x" * 100) == "x" * 60 + "..." and phases._one_line("x" * 63) == "x" * 63
    assert phases._one_line("") == ""
    for _, _, cmd in phases._largest_processes():
        assert "\n" not in cmd and "\t" not in cmd and len(cmd) <= 63, cmd
