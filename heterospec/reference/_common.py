"""Argument checks and helpers shared by the op families of heterospec.reference (the C core's counterpart:
csrc/core/common.c, which also holds the sorted top-k entropy that topk_entropy and expand both use)."""
from __future__ import annotations

import math
import numbers

import numpy as np

from .._types import MIN_TEMPERATURE

_LOGIT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
_SCORE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))

_DTYPE_NAMES = {d: "/".join(str(t) for t in d) for d in (_LOGIT_DTYPES, _SCORE_DTYPES, _ID_DTYPES)}

_U64_LIMIT = 1 << 64


# ----------------------------------------------------------------------------------------------------------
# argument handling
# ----------------------------------------------------------------------------------------------------------


def _fail(exc, op, name, expected, given):
    raise exc(f"{op}: argument '{name}' expected {expected}, got {given}")


def _describe(x):
    if isinstance(x, np.ndarray):
        return f"ndarray(dtype={x.dtype}, shape={tuple(x.shape)})"
    return repr(x) if isinstance(x, numbers.Number) else type(x).__name__


def _is_torch_bfloat16(x):
    return type(x).__module__.startswith("torch") and str(getattr(x, "dtype", "")) == "torch.bfloat16"


def _np_view(op, name, x):
    """np.asarray(x): a tensor that refuses the export (e.g. torch with requires_grad) -> BufferError,
    anything else NumPy cannot convert -> TypeError."""
    try:
        return np.asarray(x)
    except RuntimeError as e:
        _fail(BufferError, op, name, "an array NumPy can import", f"{type(x).__name__} refusing the export ({e})")
    except Exception:  # noqa: BLE001 - anything else np.asarray refuses is a type problem
        _fail(TypeError, op, name, "an array", type(x).__name__)


def _as_array(op, name, x, kind, dtypes, ndim):
    """np.asarray(x) checked for dtype (TypeError), ndim and C-contiguity (ValueError)."""
    allowed = _DTYPE_NAMES[dtypes]
    if isinstance(x, np.ndarray):
        a = x
    else:
        if _is_torch_bfloat16(x):
            _fail(TypeError, op, name, f"{kind} of dtype {allowed}",
                  "torch.bfloat16 (bfloat16 is not supported by heterospec.reference)")
        a = _np_view(op, name, x)
    if a.dtype not in dtypes:
        _fail(TypeError, op, name, f"{kind} of dtype {allowed}", f"dtype {a.dtype}")
    if a.ndim != ndim:
        _fail(ValueError, op, name, f"a {ndim}-D array", f"a {a.ndim}-D array of shape {tuple(a.shape)}")
    _contiguous(op, name, a)
    return a


def _contiguous(op, name, a):
    """C-contiguous, and aligned to its items (as the C core reads them) unless empty."""
    if not a.flags.c_contiguous:
        _fail(ValueError, op, name, "a C-contiguous array", f"strides {a.strides} for shape {tuple(a.shape)}")
    if a.size and a.ctypes.data % min(a.itemsize, 8):
        _fail(ValueError, op, name, f"an array aligned to its {min(a.itemsize, 8)}-byte items",
              f"one at an address {a.ctypes.data % min(a.itemsize, 8)} bytes off")


def _logits(op, name, x, ndim=2):
    if isinstance(x, (list, tuple)):  # Python numbers as logits: float32, as heterospec.ops takes them
        x = _list_logits(op, name, x)
    return _as_array(op, name, x, "logits", _LOGIT_DTYPES, ndim)


def _list_logits(op, name, x):
    try:
        return np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError):
        _fail(TypeError, op, name, "numbers (a list of rows of logits)", _describe(x))


def _scores(op, name, x):
    return _as_array(op, name, x, "scores", _SCORE_DTYPES, 1)


def _ids(op, name, x):
    return _as_array(op, name, x, "ids", _ID_DTYPES, 1).astype(np.int64, copy=False)


def _length(op, name, a, n, what):
    if a.shape[0] != n:
        _fail(ValueError, op, name, f"length {n} ({what})", f"length {a.shape[0]}")


def _int(op, name, x, lo=None, hi=None):
    """A Python/NumPy integer in [lo, hi] (inclusive bounds; None = the int64 range's, the C core's integers,
    except where a bound says more: seeds and offsets are uint64)."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        _fail(TypeError, op, name, "an int", _describe(x))
    x = int(x)
    if not -(1 << 63) <= x <= (hi if hi is not None and hi >= 1 << 63 else (1 << 63) - 1):
        _fail(ValueError, op, name, "an int64 value", "one out of range")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "inf]" if hi is None else ("2^64)" if hi == _U64_LIMIT - 1 else f"{hi}]")
        _fail(ValueError, op, name, f"an int in [{lo_s}, {hi_s}", x)
    return x


def _real(op, name, x):
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        _fail(TypeError, op, name, "a float", _describe(x))
    return float(x)


def _temperature(op, x):
    t = _real(op, "temperature", x)
    if not (math.isfinite(t) and t >= MIN_TEMPERATURE):
        _fail(ValueError, op, "temperature", f"a finite float >= {MIN_TEMPERATURE:g}", t)
    return t


def _check_logit_rows(op, name, rows32, row_ids):
    """Logit checks: no NaN, no +Inf, at least one value that is not -Inf (rows32: float32 [r, V])."""
    bad = np.isnan(rows32) | (rows32 == np.inf)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        _fail(ValueError, op, name, "no NaN and no +Inf",
              f"{rows32[r, c]} at row {int(row_ids[r])}, column {int(c)}")
    all_neg_inf = (rows32 == -np.inf).all(axis=1)
    if all_neg_inf.any():
        r = int(np.flatnonzero(all_neg_inf)[0])
        _fail(ValueError, op, name, "at least one value that is not -Inf per row",
              f"-Inf in every column of row {int(row_ids[r])} (columns 0..{rows32.shape[1] - 1})")


def _logit_row64(op, name, logits, row):
    """Row `row` of a logits matrix, checked, converted to float32 and widened to float64."""
    r32 = logits[row : row + 1].astype(np.float32, copy=False)
    _check_logit_rows(op, name, r32, (row,))
    return r32[0].astype(np.float64)


def _topk_desc(vals, k):
    """Indices of the k largest entries of a 1-D array, listed by value descending, ties to the lower
    index (the 'k largest' convention of docs/ops.md).  vals has no NaN."""
    n = vals.shape[0]
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if k < n:
        t = np.partition(vals, n - k)[n - k]  # the k-th largest value
        above = np.flatnonzero(vals > t)
        at = np.flatnonzero(vals == t)[: k - above.shape[0]]  # lowest indices among the ties
        cand = np.sort(np.concatenate([above, at]))
    else:
        cand = np.arange(n)
    # stable sort on the negated values: descending value, ascending index among equal values
    order = np.argsort(-vals[cand], kind="stable")
    return cand[order].astype(np.int64)


def _is_array_like(x):
    if isinstance(x, (bool, int, np.generic)):
        return False
    return isinstance(x, np.ndarray) or hasattr(x, "__dlpack__") or hasattr(x, "__array__")


def _row_ints(op, name, x, B):
    """An int for every row, or an int64 [batch] array -> B Python ints (range checks are the caller's)."""
    if not _is_array_like(x):
        return [_int(op, name, x)] * B
    a = _np_view(op, name, x)
    if a.dtype != np.int64:
        _fail(TypeError, op, name, "dtype int64 (or a Python int)", f"{a.dtype}")
    if a.shape != (B,):
        _fail(ValueError, op, name, f"shape ({B},) (one value per batch row)", f"{tuple(a.shape)}")
    _contiguous(op, name, a)
    return [int(v) for v in a]


# ----------------------------------------------------------------------------------------------------------
# the top-k entropy of a checked matrix (topk_entropy; expand's entropy output)
# ----------------------------------------------------------------------------------------------------------


def _topk_entropy_rows(x64, k, temperature):
    """H of softmax(top-k(x) / temperature) per row of a float64 [N, V] matrix (already checked)."""
    n, v = x64.shape
    if n == 0:
        return np.empty(0, dtype=np.float32)
    top = np.partition(x64, v - k, axis=1)[:, v - k :]  # the k largest values per row (any order)
    top = -np.sort(-top, axis=1)  # descending: deterministic summation order
    z = top / temperature
    e = np.exp(z - z[:, :1])  # z[:, 0] is the row max; -inf entries give exp(-inf) = 0
    p = e / e.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        plogp = np.where(p > 0.0, p * np.log(np.where(p > 0.0, p, 1.0)), 0.0)  # 0 * ln 0 = 0
    return (0.0 - plogp.sum(axis=1)).astype(np.float32)  # 0.0 - s: an entropy of 0 is +0.0, not -0.0
