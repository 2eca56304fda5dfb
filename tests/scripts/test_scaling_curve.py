"""benchmarks/scaling_curve.py (issue 27.3): tau per benchmark file against the answer tokens a head was trained
on, with a log-linear fit.  The fit is checked on points built from a known law, not on the script's output."""
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not os.path.exists(os.path.join(ROOT, "benchmarks", "scaling_curve.py")):
    pytest.skip("benchmarks/ is not next to tests/ (installed-package run)", allow_module_level=True)
from benchmarks import scaling_curve as sc  # noqa: E402


def _points(tmp_path, law, sizes, missing=None):
    pts = []
    for i, n in enumerate(sizes):
        tau = {f: law(n) + d for f, d in zip(sc.FILES, (-0.2, -0.1, 0.0, 0.1, 0.2))}
        if i == 1:                       # one point through a measure_tau.py JSON, as the real file has
            (tmp_path / "tau.json").write_text(json.dumps({"rows": {f: {"tau": t} for f, t in tau.items()}}))
            tau = "tau.json"
        elif missing:
            tau.pop(missing)
        pts.append({"label": f"h{i}", "answer_tokens": n, "epochs": 1.0, "tau": tau})
    path = tmp_path / "points.json"
    path.write_text(json.dumps(pts[::-1]))          # any order: sorted by size
    return path


def test_the_fit_recovers_a_log_linear_law_and_extrapolates(tmp_path, capsys):
    law = lambda n: 1.0 + 0.5 * math.log10(n)    # noqa: E731
    path = _points(tmp_path, law, [100_000, 400_000, 1_600_000])
    pts = sc.load_points(str(path))
    assert [p["answer_tokens"] for p in pts] == [100_000, 400_000, 1_600_000]
    assert [round(p["mean"], 9) for p in pts] == [round(law(n), 9) for n in (100_000, 400_000, 1_600_000)]
    a, b = sc.fit(pts)
    assert a == pytest.approx(1.0) and b == pytest.approx(0.5)
    sc.main([str(path), "--goal", "4.0", "--size", "full list=10000000", "--png", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert "τ = 4.0 at about 1,000,000 answer tokens" in out          # 1 + 0.5 * 6 = 4
    assert "(10,000,000 answer tokens) the fit predicts τ ≈ 4.50" in out
    assert "| h1 | 400,000 |" in out and (tmp_path / "c.png").stat().st_size > 0


def test_one_size_has_no_fit_and_a_missing_file_is_named(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    pts = sc.load_points(str(_points(one, lambda n: 2.0, [1e5])))
    assert sc.fit(pts) is None and "no fit" in sc.markdown(pts, None, 3.0, [])
    with pytest.raises(SystemExit, match=r"point 'h2': tau expected for .*, missing gsm8k"):
        sc.load_points(str(_points(tmp_path, lambda n: 2.0, [1e5, 2e5, 3e5], missing="gsm8k")))
