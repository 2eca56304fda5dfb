"""The C core's batch-first ABI, exercised from C (the Python binding drives batch 1).

tests/c/test_batch.c checks, for every batched op, that a batch of requests with different per-row sizes
gives row by row exactly what batch-1 calls give, and that errors in one row name the argument.  It is
compiled here with AddressSanitizer and UndefinedBehaviorSanitizer when the compiler has them.
"""
import glob
import os
import shutil
import subprocess
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compiler():
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")


def _build(tmp_path, sanitize):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine")
    exe = str(tmp_path / ("test_batch_san" if sanitize else "test_batch"))
    flags = ["-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror"]
    if sanitize:
        flags += ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
    sources = [os.path.join(ROOT, "tests", "c", "test_batch.c")] + sorted(glob.glob(os.path.join(ROOT, "csrc", "core", "*.c")))
    cmd = [cc, *flags, "-I", os.path.join(ROOT, "csrc", "include"), *sources, "-lm", "-o", exe]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return exe, res


def test_batched_ops_match_batch_one(tmp_path):
    exe, res = _build(tmp_path, sanitize=True)
    if res.returncode != 0 and "sanitize" in res.stderr:
        exe, res = _build(tmp_path, sanitize=False)  # a compiler without the sanitizer runtimes
    assert res.returncode == 0, res.stderr
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["ASAN_OPTIONS"] = "detect_leaks=1"
    run = subprocess.run([exe], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("passed, 0 failed"), run.stdout
    assert int(run.stdout.split()[-4]) >= 30, run.stdout  # the checks really ran
