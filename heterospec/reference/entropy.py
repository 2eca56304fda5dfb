"""topk_entropy and bucketize: HeteroSpec's difficulty signal and its bins (the C core's csrc/core/entropy.c)."""
from __future__ import annotations

import numpy as np

from ._common import _check_logit_rows, _fail, _int, _logits, _scores, _temperature, _topk_entropy_rows


# ----------------------------------------------------------------------------------------------------------
# topk_entropy
# ----------------------------------------------------------------------------------------------------------


def _topk_entropy_host(logits, k, temperature=1.0, ndim=2):
    """Per-row entropy (nats) of the softmax of the k largest logits divided by temperature -> float32[N], or
    (ndim=3, logits [batch, N, V]) float32[batch, N]: the rows of every batch row, in order, as one [batch * N, V]
    matrix (an error names the row of that matrix)."""
    op = "topk_entropy"
    x = _logits(op, "logits", logits, ndim)
    v = x.shape[-1]
    rows = x.reshape(-1, v)
    k = _int(op, "k", k, 1, v)
    temperature = _temperature(op, temperature)
    x32 = rows.astype(np.float32, copy=False)
    _check_logit_rows(op, "logits", x32, np.arange(x32.shape[0]))
    return _topk_entropy_rows(x32.astype(np.float64), k, temperature).reshape(x.shape[:-1])


# ----------------------------------------------------------------------------------------------------------
# bucketize
# ----------------------------------------------------------------------------------------------------------


def _bucketize_host(values, thresholds):
    """bin[i] = number of thresholds s with values[i] > s (float64 comparison) -> int32[N]."""
    op = "bucketize"
    v = _scores(op, "values", values).astype(np.float64)
    t = _scores(op, "thresholds", thresholds).astype(np.float64)
    if np.isnan(t).any():
        _fail(ValueError, op, "thresholds", "no NaN", f"nan at index {int(np.flatnonzero(np.isnan(t))[0])}")
    # t[1:] <= t[:-1], not np.diff(t) <= 0: -inf followed by -inf differs by NaN, which no comparison catches
    if t.shape[0] > 1 and (t[1:] <= t[:-1]).any():
        i = int(np.flatnonzero(t[1:] <= t[:-1])[0]) + 1
        _fail(ValueError, op, "thresholds", "strictly ascending thresholds",
              f"{t[i - 1]} followed by {t[i]} at index {i}")
    if np.isnan(v).any():
        _fail(ValueError, op, "values", "no NaN", f"nan at index {int(np.flatnonzero(np.isnan(v))[0])}")
    # count of thresholds strictly below the value == leftmost insertion point in the sorted thresholds
    return np.searchsorted(t, v, side="left").astype(np.int32)


# ----------------------------------------------------------------------------------------------------------
# the public signatures: those of heterospec.ops (`stream`, `check` and `device_outputs`: see the
# package docstring, heterospec/reference/__init__.py)
# ----------------------------------------------------------------------------------------------------------


def topk_entropy(logits, k, temperature=1.0, *, stream=None, check=True):
    """Per-row entropy (nats) of the softmax of the k largest logits divided by temperature -> float32[N].
    Batched (logits [batch, N, V]): float32 [batch, N], row by row."""
    return _topk_entropy_host(logits, k, temperature, 3 if np.ndim(logits) == 3 else 2)


def bucketize(values, thresholds, *, stream=None, check=True):
    """bin[i] = number of thresholds s with values[i] > s (float64 comparison) -> int32[N]."""
    return _bucketize_host(values, thresholds)
