"""What a run leaves in ``--out``: ``results.json`` (every number, the settings, the machine and versions;
schema :data:`SCHEMA`), ``results.md`` (:func:`markdown`: tables laid out like the paper's Table 1),
``answers.jsonl`` (EAGLE-style answer records) and PNG plots (:func:`plots`: ``speedup.png``,
``tau_vs_verified.png``, ``bins.png``); :func:`report` (``heterospec bench --report``) writes the markdown and
the plots again from a saved results.json.  The HuggingFace baselines' missing numbers are '–' in the
tables."""
from __future__ import annotations

import json
import os
import sys

from .methods import HF_METHODS, arithmetic_note
from .metrics import pooled_bins
from .questions import LABELS

SCHEMA = "heterospec.bench/1"


def _fmt(v, spec, suffix=""):
    return "–" if v is None else format(v, spec) + suffix


def markdown(result):
    """Markdown tables laid out like the paper's Table 1, one pair per temperature."""
    lines = []
    s = result["settings"]
    lines.append(f"Target {result['models']['target']}, draft {result['models']['draft']}; {s['device']} "
                 f"{s['dtype']}, max_new_tokens {s['max_new_tokens']}, up to {s['limit'] or 'all'} questions per file, "
                 f"seed {s['seed']}; {result['machine']['summary']}.")
    lines.append("")
    for run in result["runs"]:
        benches = list(run["files"])
        names = list(run["mean"])
        cols = [LABELS.get(b, b) for b in benches] + ["Mean"]
        hf = run.get("strongest_hf")
        if hf:
            lines.append(f"**Temperature {run['temperature']:g}: speedup over ar, over {hf} (the strongest HuggingFace "
                         f"baseline in this run, {run['mean'][hf]['tokens_per_s']:.1f} tokens/s mean) and tau**")
            lines.append("")
            lines.append("| Method | " + " | ".join(f"{c} speedup | {c} vs {hf} | {c} τ" for c in cols) + " |")
            lines.append("|---|" + "---:|---:|---:|" * len(cols))
        else:
            lines.append(f"**Temperature {run['temperature']:g}: speedup over ar and tau**")
            lines.append("")
            lines.append("| Method | " + " | ".join(f"{c} speedup | {c} τ" for c in cols) + " |")
            lines.append("|---|" + "---:|---:|" * len(cols))
        for n in names:
            cells = [run["files"][b][n] for b in benches] + [run["mean"][n]]
            lines.append(f"| {n} | " + " | ".join(
                f"{_fmt(c['speedup'], '.2f', 'x')} | " + (f"{_fmt(c.get('speedup_over_hf'), '.2f', 'x')} | " if hf else "")
                + _fmt(c["tau"], ".2f") for c in cells) + " |")
        lines.append("")
        lines.append(f"**Temperature {run['temperature']:g}: verification calls and verified tokens; tokens/s**")
        lines.append("")
        tcols = cols[:-1] + ["Total"]  # counts add up over the files
        lines.append("| Method | " + " | ".join(f"{c} calls | {c} verified" for c in tcols) + " | tokens/s (mean) |")
        lines.append("|---|" + "---:|---:|" * len(cols) + "---:|")
        for n in names:
            cells = [run["files"][b][n] for b in benches] + [run["mean"][n]]
            lines.append(f"| {n} | " + " | ".join(f"{_fmt(c['verification_calls'], 'd')} | {_fmt(c['verified_tokens'], 'd')}"
                                                  for c in cells) + f" | {run['mean'][n]['tokens_per_s']:.1f} |")
        lines.append("")
        lines.append(f"**Temperature {run['temperature']:g}: time split (share of decoding time) and entropy bins**")
        lines.append("")
        lines.append("| Method | Benchmark | prefill | draft | verify | ops | graphs | idle | loop | host ms/cycle | bin shares (mean accepted) |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for n in names:
            for b in benches:
                m = run["files"][b][n]
                sh = m["time_split_share"] or {}
                bins = ", ".join(f"{k}: {v['share']:.2f} ({v['mean_accepted']:.2f})" for k, v in m["bins"].items())
                lines.append(f"| {n} | {LABELS.get(b, b)} | " + " | ".join(
                    _fmt(sh.get(k), ".2f") for k in ("prefill", "draft", "verify", "ops", "graph", "idle", "loop"))
                    + f" | {_fmt(m.get('host_ms_per_cycle'), '.2f')} | {bins or '–'} |")
        lines.append("")
        binned = [n for n in names if any(run["files"][b][n]["bins"] for b in benches)]
        if binned:
            lines.append(f"**Temperature {run['temperature']:g}: per entropy bin, measured (all files pooled)**")
            lines.append("")
            lines.append("| Method | bin | share of cycles | tau | tokens/s in the bin's cycles |")
            lines.append("|---|---:|---:|---:|---:|")
            for n in binned:
                for k, v in pooled_bins([run["files"][b][n]["bins"] for b in benches]).items():
                    lines.append(f"| {n} | {k} | {v['share']:.3f} | {v['tau']:.2f} | {_fmt(v['tokens_per_s'], '.1f')} |")
            lines.append("")
            lines.append("τ and tokens/s of a bin count the committed tokens (accepted + the bonus) of the cycles in "
                         "that bin, over those cycles' wall time (drafting, verification and the ops up to the "
                         "accepted-tokens sync; the prefill is outside every bin).")
            lines.append("")
        if run.get("cuda_graphs"):
            caps = {n: v for n, v in (run.get("capture_s") or {}).items() if v}
            lines.append(f"Our engines ran recorded steps (cuda_graphs={run['cuda_graphs']!r}): the graphs column is "
                         f"the time in replayed steps (draft, verify and ops inside them), idle the device's idle "
                         f"time between replays; recording took "
                         + (", ".join(f"{n} {v:.2f} s" for n, v in caps.items()) or "no time in this run")
                         + " (untimed in the tables).")
            lines.append("")
        paths = {}
        for n, v in (run.get("cpu_gemm") or {}).items():
            paths.setdefault(v, []).append(n)
        decoders = {}
        for n, v in (run.get("cpu_decoder") or {}).items():
            decoders.setdefault(v, []).append(n)
        if set(decoders) - {"off"}:
            lines.append("Which forwards of our engines ran on heterospec's own CPU code (`cpu_decoder`, float32 "
                         "arithmetic: the target's decoder, the draft's layer and head; torch's modules where off): "
                         + "; ".join(f"{', '.join(ns)}: {v}" for v, ns in decoders.items()) + ".")
            lines.append("")
        if set(paths) - {"off"}:
            lines.append("Our engines' CPU matrix paths (torch's default, oneDNN with packed weights or our few-rows "
                         "kernel `rows`, measured on "
                         "this machine per layer shape and rows per call; the draft's layers, and the target's "
                         "where it runs on transformers' modules): "
                         + "; ".join(f"{', '.join(ns)}: {v}" for v, ns in paths.items()) + ".")
            lines.append("")
        if run.get("warmup_s"):
            lines.append("Warm-up before the timed run (untimed in the tables): " + ", ".join(
                f"{n} {v:.2f} s" for n, v in run["warmup_s"].items()) + ".")
            lines.append("")
        for n in ("hf-static", "hf-compiled"):
            st = run.get(n.replace("-", "_"))
            if not st:
                continue
            how = {True: "compiled by transformers" + (" (its auto-compile criterion held)" if n == "hf-static" else
                                                       " (asked to compile on every device)"),
                   False: "not compiled (transformers' auto-compile criterion did not hold: it compiles on CUDA, "
                          "XPU or TPU, not on a CPU; run uncompiled, as a user gets it)",
                   None: "compilation not known (this transformers has no auto-compile criterion to ask)"}[st["compiled"]]
            lines.append(f"{n} on {st['device']}: static cache of {st['static_cache_len']} positions, {how}"
                         + (f"; its warm-up (compiling, where it compiles) took {st['warmup_s']:.2f} s." if
                            st.get("warmup_s") is not None else "; no warm-up (compiling, where it compiles, is timed)."))
            lines.append("")
        if any(n in HF_METHODS for n in names):
            lines.append(f"HuggingFace baselines ({', '.join(n for n in HF_METHODS if n in names)}) draft nothing: "
                         "tau, verification calls and the time split do not apply (–).")
            lines.append("")
        if run["temperature"] == 0:
            theirs = run.get("other_arithmetic") or []
            if run["mismatches"]:
                lines.append(f"**MISMATCH: {len(run['mismatches'])} outputs differ from {run['mismatches'][0]['reference']}'s.**")
            elif theirs:
                apart = [n for n in names if any(m["method"] == n for m in theirs)]
                lines.append(f"Identical greedy outputs across {', '.join(n for n in names if n not in apart)} on "
                             f"every question and turn; {len(theirs)} outputs of {', '.join(apart)} differ from "
                             f"{theirs[0]['reference']}'s: {arithmetic_note(result['settings']['dtype'])}.")
            else:
                lines.append(f"Identical greedy outputs across {', '.join(names)} on every question and turn.")
            lines.append("")
    if result.get("tuning"):
        c = result["tuning"]["chosen"]
        lines.append(f"eagle3-tuned: depth {c['depth']}, top_k {c['top_k']}, {c['nodes']} nodes "
                     f"({result['tuning'].get('how', '')}).")
        h = result["tuning"].get("heterospec_tuned")
        if h:
            lines.append("")
            lines.append(f"heterospec-tuned: on that base tree, entropy bins {', '.join(f'{t:.3g}' for t in h['thresholds'])}; "
                         f"per-bin extra depth {h['extra']}, kept nodes {h['keep']} (fitted on {h['positions']} "
                         f"positions of the tuning trace).")
    return "\n".join(lines) + "\n"


def plots(result, out_dir):
    """speedup.png, tau_vs_verified.png and bins.png for the first run (temperature) of ``result``;
    returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for run in result["runs"]:
        suffix = "" if run is result["runs"][0] else f"_t{run['temperature']:g}"
        benches, names = list(run["files"]), list(run["mean"])
        labels = [LABELS.get(b, b) for b in benches] + ["Mean"]
        # 1. speedup by benchmark and method
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(labels), 3.6))
        w = 0.8 / len(names)
        for j, n in enumerate(names):
            vals = [run["files"][b][n]["speedup"] or 0.0 for b in benches] + [run["mean"][n]["speedup"] or 0.0]
            ax.bar([i + (j - (len(names) - 1) / 2) * w for i in range(len(labels))], vals, w, label=n)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel("speedup over ar")
        ax.set_title(f"speedup, temperature {run['temperature']:g}")
        ax.legend(fontsize=7, ncol=min(len(names), 5), loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
        paths.append(_save(fig, os.path.join(out_dir, f"speedup{suffix}.png")))
        # 2. tau against verified tokens (per benchmark, one marker per method)
        fig, ax = plt.subplots(figsize=(5.2, 3.8))
        for n in names:
            if any(run["files"][b][n]["tau"] is None for b in benches):
                continue  # the HuggingFace baselines verify nothing
            xs = [run["files"][b][n]["verified_per_new_token"] for b in benches]
            ys = [run["files"][b][n]["tau"] for b in benches]
            ax.plot(xs, ys, "o", label=n)
            for x, y, b in zip(xs, ys, benches):
                ax.annotate(LABELS.get(b, b), (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax.set_xlabel("verified tokens per generated token")
        ax.set_ylabel("tau (tokens per verification call)")
        ax.set_title(f"acceptance vs verification cost, temperature {run['temperature']:g}")
        ax.legend(fontsize=7)
        paths.append(_save(fig, os.path.join(out_dir, f"tau_vs_verified{suffix}.png")))
        # 3. entropy-bin distribution per benchmark (methods with bins)
        binned = [n for n in names if any(run["files"][b][n]["bins"] for b in benches)]
        fig, axes = plt.subplots(1, max(1, len(binned)), figsize=(1.2 + 3.2 * max(1, len(binned)), 3.6), squeeze=False)
        for ax, n in zip(axes[0], binned or [None]):
            if n is None:
                ax.text(0.5, 0.5, "no method with entropy bins", ha="center", va="center")
                ax.set_axis_off()
                continue
            allbins = sorted({int(k) for b in benches for k in run["files"][b][n]["bins"]})
            bottom = [0.0] * len(benches)
            for k in allbins:
                v = [run["files"][b][n]["bins"].get(str(k), {}).get("share", 0.0) for b in benches]
                ax.bar(range(len(benches)), v, bottom=bottom, label=f"bin {k}")
                bottom = [a + c for a, c in zip(bottom, v)]
            ax.set_xticks(range(len(benches)), [LABELS.get(b, b) for b in benches], fontsize=7)
            ax.set_ylabel("share of cycles")
            ax.set_title(n)
            ax.legend(fontsize=6)
        paths.append(_save(fig, os.path.join(out_dir, f"bins{suffix}.png")))
    return paths


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_outputs(result, answers, out_dir, make_plots=True):
    """results.json, results.md, answers.jsonl (and the plots) in ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.md"),
             os.path.join(out_dir, "answers.jsonl")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(result))
    with open(paths[2], "w") as f:
        for a in answers:
            f.write(json.dumps(a) + "\n")
    if make_plots:
        paths += plots(result, out_dir)
    return paths


def report(path, out=None):
    """``heterospec bench --report results.json``: write results.md and the plots again next to a saved
    results.json (e.g. after changing the plots), without running anything."""
    out = out or sys.stdout
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"heterospec bench: --report expected a results.json, could not read {path!r}: {e}") from None
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        raise SystemExit(f"heterospec bench: --report expected a {SCHEMA} results.json, got schema "
                         f"{result.get('schema') if isinstance(result, dict) else type(result).__name__!r}")
    d = os.path.dirname(os.path.abspath(path))
    with open(os.path.join(d, "results.md"), "w") as f:
        f.write(markdown(result))
    written = [os.path.join(d, "results.md")] + plots(result, d)
    print(markdown(result), file=out)
    print(f"wrote {', '.join(written)}", file=out)
    return 0
