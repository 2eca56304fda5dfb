"""The default pair's head: acceptance length tau against the answer tokens it was trained on (issue 27.3).

    python benchmarks/scaling_curve.py benchmarks/results/head-scaling/points.json [--png curve.png] [--goal 3.0]

The points file is a JSON list, one entry per trained head:
``{"label": str, "answer_tokens": int (all answer tokens the head has been trained on, warm starts included),
"epochs": float, "tau": "tau.json of benchmarks/measure_tau.py" (relative to the points file) or
{"mt_bench": ..., ...}, "note": str}``.  tau is always measured the same way (measure_tau.py: static tree 7/10/60,
greedy, 256 new tokens, 10 questions per benchmark file); the mean is over the five files.

Prints a markdown table and the least-squares fit tau = a + b * log10(tokens) over the points, with the answer
tokens that fit puts at ``--goal`` and the tau it predicts at the sizes of the committed prompt list; writes the
plot with ``--png``.  A log-linear fit through a handful of points is a planning aid, not a law: the note says
how many points it rests on.
"""
import argparse
import json
import math
import os

FILES = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")


def load_points(path):
    """The points with their per-file tau dicts resolved and their mean."""
    base = os.path.dirname(os.path.abspath(path))
    points = json.load(open(path))
    for p in points:
        tau = p["tau"]
        if isinstance(tau, str):
            tau = {k: v["tau"] for k, v in json.load(open(os.path.join(base, tau)))["rows"].items()}
        missing = [f for f in FILES if f not in tau]
        if missing:
            raise SystemExit(f"scaling_curve: point {p['label']!r}: tau expected for {', '.join(FILES)}, "
                             f"missing {', '.join(missing)}")
        p["per_file"] = {f: float(tau[f]) for f in FILES}
        p["mean"] = sum(p["per_file"].values()) / len(FILES)
    return sorted(points, key=lambda p: p["answer_tokens"])


def fit(points):
    """(a, b) of tau = a + b * log10(answer tokens), least squares; None below two distinct sizes."""
    xs = [math.log10(p["answer_tokens"]) for p in points]
    ys = [p["mean"] for p in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def markdown(points, ab, goal, sizes):
    rows = ["| head | answer tokens | epochs | " + " | ".join(FILES) + " | mean τ |",
            "|---|---:|---:|" + "---:|" * len(FILES) + "---:|"]
    for p in points:
        rows.append(f"| {p['label']} | {p['answer_tokens']:,} | {p['epochs']:.2g} | "
                    + " | ".join(f"{p['per_file'][f]:.2f}" for f in FILES) + f" | **{p['mean']:.2f}** |")
    out = "\n".join(rows) + "\n"
    if ab is None:
        return out + "\nFewer than two training sizes: no fit.\n"
    a, b = ab
    out += (f"\nFit over {len(points)} points: τ = {a:.3f} + {b:.3f} · log10(answer tokens) "
            f"(+{b * math.log10(2):.3f} τ per doubling of the data).\n")
    if b > 0:
        out += f"τ = {goal} at about {10 ** ((goal - a) / b):,.0f} answer tokens by that fit.\n"
    for label, n in sizes:
        out += f"At {label} ({n:,} answer tokens) the fit predicts τ ≈ {a + b * math.log10(n):.2f}.\n"
    return out


def plot(points, ab, goal, sizes, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [p["answer_tokens"] for p in points]
    for f in FILES:
        ax.plot(xs, [p["per_file"][f] for p in points], "o:", alpha=0.45, label=f)
    ax.plot(xs, [p["mean"] for p in points], "ks-", lw=2, label="mean")
    for p in points:
        ax.annotate(p["label"], (p["answer_tokens"], p["mean"]), textcoords="offset points", xytext=(4, 6),
                    fontsize=7)
    if ab is not None:
        a, b = ab
        hi = max([n for _, n in sizes] + xs + ([10 ** ((goal - a) / b)] if b > 0 else []))
        grid = [min(xs) * (hi * 1.3 / min(xs)) ** (i / 50) for i in range(51)]
        ax.plot(grid, [a + b * math.log10(x) for x in grid], "k--", lw=1, label="log-linear fit")
        for label, n in sizes:
            ax.axvline(n, color="grey", lw=0.6, ls=":")
            ax.text(n, ax.get_ylim()[0], " " + label, rotation=90, fontsize=7, va="bottom", color="grey")
    ax.axhline(goal, color="tab:red", lw=0.8, ls="--", label=f"goal τ = {goal}")
    ax.set_xscale("log")
    ax.set_xlabel("answer tokens trained on")
    ax.set_ylabel("τ (static 7/10/60, greedy, 256 tokens)")
    ax.set_title("SmolLM2-135M-Instruct EAGLE-3 head: τ vs training data")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("points")
    ap.add_argument("--png", default=None)
    ap.add_argument("--goal", type=float, default=3.0)
    ap.add_argument("--size", action="append", default=[], metavar="LABEL=TOKENS",
                    help="a data size to mark and extrapolate to (repeatable)")
    a = ap.parse_args(argv)
    sizes = []
    for s in a.size:
        label, _, n = s.rpartition("=")
        if not label or not n.isdigit():
            ap.error(f"argument --size: expected LABEL=TOKENS, got {s!r}")
        sizes.append((label, int(n)))
    points = load_points(a.points)
    ab = fit(points)
    print(markdown(points, ab, a.goal, sizes), end="")
    if a.png:
        plot(points, ab, a.goal, sizes, a.png)


if __name__ == "__main__":
    main()
