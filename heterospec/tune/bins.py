"""Entropy bins (paper Eq. 2): the depth-3 regression tree on one feature, the path entropy at the base
depth, whose split points are a profile's thresholds (a value falls in bin = number of thresholds below it,
``ops.bucketize`` / :meth:`heterospec.policy.Policy.plan`)."""
from __future__ import annotations

import numpy as np


def _best_split(x, y, min_leaf):
    """The threshold minimising Eq. 2, L(s) = MSE(left) + MSE(right) with each side's mean squared deviation
    normalised by its own size, over midpoints between distinct consecutive x (x sorted).  None if no split
    leaves >= min_leaf points on both sides."""
    n = x.shape[0]
    if n < 2 * min_leaf:
        return None
    cs, cs2 = np.cumsum(y), np.cumsum(y * y)
    i = np.arange(min_leaf, n - min_leaf + 1)  # left = x[:i]
    i = i[x[i - 1] < x[np.minimum(i, n - 1)]] if i.size else i  # only between distinct values
    i = i[i < n]
    if i.size == 0:
        return None
    nl, nr = i.astype(np.float64), (n - i).astype(np.float64)
    sl, sl2 = cs[i - 1], cs2[i - 1]
    sr, sr2 = cs[-1] - sl, cs2[-1] - sl2
    loss = (sl2 / nl - (sl / nl) ** 2) + (sr2 / nr - (sr / nr) ** 2)
    j = int(np.argmin(loss))  # ties: the leftmost split
    k = int(i[j])
    return 0.5 * (x[k - 1] + x[k]), k


def fit_thresholds(x, y, depth=3, min_leaf=1):
    """Fit the paper's regression tree (Eq. 2) on one feature and return its split thresholds, ascending:
    2**depth - 1 of them unless some node has too few points, no distinct values to split, or one value of y
    (nothing to separate: every split of a constant y scores 0, and the leftmost would peel off min_leaf points
    for no reason).  A value v falls in bin = number of thresholds below v (``ops.bucketize``)."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.ndim != 1 or y.shape != x.shape:
        raise ValueError(f"fit_thresholds: arguments 'x' and 'y' expected equal 1-D shapes, got {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("fit_thresholds: arguments 'x' and 'y' expected finite values")
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"fit_thresholds: argument 'depth' expected an int >= 1, got {depth!r}")
    if not isinstance(min_leaf, int) or min_leaf < 1:
        raise ValueError(f"fit_thresholds: argument 'min_leaf' expected an int >= 1, got {min_leaf!r}")
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    out = []

    def split(lo, hi, level):
        if level == depth or y[lo:hi].min() == y[lo:hi].max():
            return
        s = _best_split(x[lo:hi], y[lo:hi], min_leaf)
        if s is None:
            return
        thr, k = s
        out.append(thr)
        split(lo, lo + k, level + 1)
        split(lo + k, hi, level + 1)

    split(0, x.shape[0], 0)
    return np.array(sorted(out))


# Points each bin is fitted on, at least: a tenth of the trace.  Eq. 2 sums the two sides' variances unweighted, so
# it prefers to peel a min_leaf-sized group off an edge; with a fiftieth (before 2026-11-30) the bins of the AVX2 CPU
# profile held 1-2 % of the cycles each and 92-95 % fell in one bin, which left nothing to adapt.
MIN_LEAF_SHARE = 10


def fit_bins(trace, base_depth, total_tokens, target="rank", depth=3):
    """The entropy bins of a profile from a recorded trace (:class:`heterospec.tune.Trace`), what ``heterospec
    calibrate`` and ``bench``'s tuned HeteroSpec fit: :func:`fit_thresholds` on the path entropy at the static base
    tree (``base_depth``, ``total_tokens``) against ``target`` (``Trace.features``), each bin on at least a tenth of
    the positions.  The rank of the best path's leaf among the kept nodes is constant where the base grows no level
    past the root expansion (its best candidate is always kept first): there, and wherever that rank never varies,
    the bins are fitted on the accepted length instead.  Returns (thresholds, the target used, x)."""
    x, y = trace.features(base_depth, total_tokens, target=target)
    if target == "rank" and y.size and y.min() == y.max():
        target = "accepted"
        x, y = trace.features(base_depth, total_tokens, target=target)
    th = fit_thresholds(x, y, depth=depth, min_leaf=max(5, len(x) // MIN_LEAF_SHARE))
    return tuple(float(t) for t in th), target, x
