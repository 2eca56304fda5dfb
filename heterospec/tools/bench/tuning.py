"""The trees tuned to this machine before a run, on tuning prompts (never the benchmark's): ``eagle3-tuned``'s
static tree (:func:`tune_static_tree`, also ``heterospec calibrate --search-base-tree``) and
``heterospec-tuned``'s calibration on it (:func:`calibrate_on`)."""
from __future__ import annotations

import math

from ...measure import DeviceTimer
from ...policy import Policy

TUNE_DEPTHS = (0, 1, 2, 3, 4, 5, 6, 7, 8)   # 0: the root expansion alone (no draft call between it and the verify)
TUNE_NODES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 60)


def tune_static_tree(target, draft, prompt_ids, tr, *, cost_model, depths=TUNE_DEPTHS, nodes=TUNE_NODES,
                     measure=3, timer=None, progress=None, cuda_graphs=False, cpu_decoder="auto"):
    """The fastest static tree on this machine for ``prompt_ids`` (tuning prompts), ``tr`` their recorded
    trace (:func:`heterospec.tune.record`, at least ``max(depths)`` levels): every (depth, nodes) of the
    grid is replayed with ``cost_model``; the ``measure`` best by predicted speed are then decoded for real
    (greedy, ``tr.max_new_tokens`` tokens) and the fastest measured one wins.  Returns (Policy, report).
    ``progress(what, i, n)``: called after each timed tree; ``cuda_graphs``, ``cpu_decoder``: the engines'
    settings."""
    from ...engine.loop import HeteroSpec

    timer = timer or DeviceTimer("cpu")
    top_k = tr.top_k
    if max(depths) > tr.levels:
        raise ValueError(f"tune_static_tree: argument 'depths' goes to {max(depths)}, the trace has {tr.levels} levels")
    grid = []
    for d in depths:
        for n in nodes:
            r = tr.replay(Policy.static(d, top_k, n), cost_model=cost_model)
            grid.append({"depth": d, "top_k": top_k, "nodes": n, "tau": r.tau,
                         "predicted_tokens_per_s": r.tokens_per_s})
    grid.sort(key=lambda g: -(g["predicted_tokens_per_s"] or 0.0))
    measured = []
    for j, g in enumerate(grid[:measure]):
        pol = Policy.static(g["depth"], top_k, g["nodes"])
        new, secs = 0, 0.0
        longest = max(ids.shape[1] for ids in prompt_ids) + tr.max_new_tokens
        with HeteroSpec(target, draft, pol, cuda_graphs=cuda_graphs, max_length=longest,
                        cpu_decoder=cpu_decoder) as hs:
            hs.generate(prompt_ids[0], max_new_tokens=8, eos_token_id=[])  # warm-up (and recording, with cuda_graphs)
            for ids in prompt_ids:
                (_, st), dt = timer(lambda: hs.generate(ids, max_new_tokens=tr.max_new_tokens, eos_token_id=[]))
                new += st.new_tokens
                secs += dt
        measured.append(dict(g, measured_tokens_per_s=new / secs if secs else 0.0))
        if progress:
            progress("tuning: timing", j + 1, min(measure, len(grid)))
    best = max(measured, key=lambda g: g["measured_tokens_per_s"])
    report = {"prompts": len(prompt_ids), "max_new_tokens": tr.max_new_tokens, "grid": grid, "measured": measured,
              "chosen": {"depth": best["depth"], "top_k": top_k, "nodes": best["nodes"]}}
    return Policy.static(best["depth"], top_k, best["nodes"]), report


def calibrate_on(tr, base, cost_model):
    """HeteroSpec calibrated on the static tree ``base`` with the trace ``tr``: entropy bins fitted at the
    base depth (paper Eq. 2, as ``heterospec calibrate``), per-bin extra depth and kept nodes optimised.
    Returns (Policy, report)."""
    from ...tune.bins import fit_bins
    from ...tune.optimise import optimise_policy

    th, _, x = fit_bins(tr, base.depth, base.total_tokens)
    # extra depth up to the paper's alpha + 1 (its Table 3 range)
    pol, pred = optimise_policy(tr, cost_model, base_depth=base.depth, total_tokens=base.total_tokens, thresholds=th,
                                max_extra=math.ceil(base.depth / 2) + 1)
    pol = type(pol)(pol.depth, pol.top_k, pol.total_tokens, pol.thresholds, pol.extra, pol.keep, name="heterospec-tuned")
    return pol, {"positions": int(len(x)), "thresholds": list(th), "extra": list(pol.extra), "keep": list(pol.keep),
                 "predicted_tokens_per_s": pred}
