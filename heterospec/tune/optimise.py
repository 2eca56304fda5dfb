"""The per-bin optimiser: starting from the paper's rule, pick bin by bin the extra depth and kept node count
that maximise the replayed predicted speed over a whole trace; bins interact through the cycle boundaries, so
it sweeps the bins until no choice changes."""
from __future__ import annotations

import math

from ..policy import Policy

# Kept node counts every bin may take besides the fractions of the base tree's: the root alone (1: nothing drafted is
# verified, where the draft is rarely right) and a few nodes.  A base tree of 2-3 nodes (a CPU's, where each verified
# row costs a sixth to a quarter of a step) otherwise left every bin at its own size.
SMALL_KEEPS = (1, 2, 3, 4)


def optimise_policy(trace, cost_model, *, base_depth=None, total_tokens=None, thresholds=(), max_extra=None,
                    keep_grid=None, max_sweeps=4):
    """Per-bin (extra depth, kept nodes) maximising the replayed predicted tokens/s by coordinate descent from
    two starts, the paper's rule (bins past its three at (0, total_tokens)) and the static tree (every bin at
    (0, total_tokens)); the better result is returned, so the calibrated policy never predicts slower than the
    static tree of its base.  Kept nodes come from ``keep_grid``, by default fractions of ``total_tokens`` and
    ``SMALL_KEEPS``."""
    K = trace.top_k
    base = base_depth if base_depth is not None else trace.levels - math.ceil(trace.levels / 3)
    N = total_tokens or 60
    max_extra = trace.levels - base if max_extra is None else min(max_extra, trace.levels - base)
    nbins = len(thresholds) + 1
    paper = Policy.paper(base, K, N, thresholds)
    extra = [paper.extra[b] if b < 3 else 0 for b in range(nbins)]
    extra = [min(e, max_extra) for e in extra]
    keep = [paper.keep[b] if b < 3 else N for b in range(nbins)]
    default_grid = [max(2, round(N * g)) for g in (0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.2)] + list(SMALL_KEEPS)
    grid = sorted(set(keep_grid or default_grid) | set(keep))

    def score(ex, kp):
        pol = Policy(base, K, N, tuple(thresholds), tuple(ex), tuple(kp), name="calibrated")
        return trace.replay(pol, cost_model=cost_model).tokens_per_s or 0.0

    def descend(extra, keep):
        best = score(extra, keep)
        for _ in range(max_sweeps):
            changed = False
            for b in range(nbins):
                for e in range(max_extra + 1):
                    for k in grid:
                        ex, kp = list(extra), list(keep)
                        ex[b], kp[b] = e, k
                        s = score(ex, kp)
                        if s > best * (1 + 1e-9):
                            best, extra, keep, changed = s, ex, kp, True
            if not changed:
                break
        return best, extra, keep

    best, extra, keep = max(descend(extra, keep), descend([0] * nbins, [N] * nbins), key=lambda r: r[0])
    return Policy(base, K, N, tuple(thresholds), tuple(extra), tuple(keep), name="calibrated"), best
