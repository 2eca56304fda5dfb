"""The notebooks run top to bottom (their code cells, in order, as one script) and are committed clean."""
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_has_no_outputs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "a notebook without code"
    assert all(not c["outputs"] and c["execution_count"] is None for c in code), "strip outputs before committing"
    exec(compile("\n".join("".join(c["source"]) for c in code), str(path), "exec"), {"__name__": "__main__"})


def test_there_is_a_notebook():
    assert NOTEBOOKS
