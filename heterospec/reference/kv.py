"""kv_compact and KVTensors: KV-cache compaction after acceptance (the C core's csrc/core/kv.c)."""
from __future__ import annotations

import numpy as np

from ._common import (_ID_DTYPES, _as_array, _contiguous, _fail, _int, _is_array_like, _is_torch_bfloat16, _np_view,
                      _row_ints)


# ----------------------------------------------------------------------------------------------------------
# kv_compact
# ----------------------------------------------------------------------------------------------------------


def _kv_arrays(op, tensors):
    """The NumPy views of a list/tuple of writable, C-contiguous, non-overlapping [..., S, D] arrays."""
    if not isinstance(tensors, (list, tuple)):
        what = "a list or tuple of arrays" + (" or a KVTensors" if op == "kv_compact" else "")
        _fail(TypeError, op, "tensors", what, type(tensors).__name__)
    arrays = []
    for i, t in enumerate(tensors):
        if isinstance(t, np.ndarray):
            a = t
        else:
            if not (hasattr(t, "__array__") or hasattr(t, "__array_interface__") or hasattr(t, "__dlpack__")):
                _fail(TypeError, op, f"tensors[{i}]", "an array", type(t).__name__)
            if _is_torch_bfloat16(t):
                _fail(TypeError, op, f"tensors[{i}]", "an array NumPy can view",
                      "torch.bfloat16 (bfloat16 is not supported by heterospec.reference)")
            a = _np_view(op, f"tensors[{i}]", t)
        if a.ndim < 2:
            _fail(ValueError, op, f"tensors[{i}]", "an array of shape [..., S, D] (ndim >= 2)", f"ndim {a.ndim}")
        _contiguous(op, f"tensors[{i}]", a)
        if not a.flags.writeable:
            _fail(BufferError, op, f"tensors[{i}]", "a writable array (an output)", "a read-only array")
        for j, b in enumerate(arrays):  # a tensor listed twice (or overlapping another) would move twice
            if np.may_share_memory(a, b):
                _fail(ValueError, op, f"tensors[{i}]", "tensors that do not overlap in memory",
                      f"memory shared with tensors[{j}]")
        arrays.append(a)
    return arrays


class KVTensors:
    """The tensors of ``kv_compact`` validated once (the same checks as its 'tensors'), accepted by
    ``kv_compact`` in place of the list.  Keeps references to the tensors.  ``stream`` is accepted and ignored."""

    __slots__ = ("tensors", "_arrays")

    def __init__(self, tensors, *, stream=None):
        self._arrays = _kv_arrays("KVTensors", tensors)
        self.tensors = tuple(tensors)

    def __len__(self):
        return len(self._arrays)

    def __repr__(self):
        return f"KVTensors({len(self)} tensors)"


def _prefix_len(op, x):
    """prefix_len: an int >= 0, or an int64 array with exactly one element (shape [] or [1]) -> (int, array)."""
    name = "prefix_len"
    if not _is_array_like(x):
        return _int(op, name, x, 0), None
    a = x if isinstance(x, np.ndarray) else _np_view(op, name, x)
    if a.dtype != np.int64:
        _fail(TypeError, op, name, "an int or an int64 array with one element", f"dtype {a.dtype}")
    if a.ndim > 1 or a.size != 1:
        _fail(ValueError, op, name, "an int or an int64 array with exactly one element (shape [] or [1])",
              f"shape {tuple(a.shape)}")
    _contiguous(op, name, a)
    value = int(a.reshape(-1)[0])
    if value < 0:
        _fail(ValueError, op, name, ">= 0", value)
    return value, a


def _kv_valid_slots(op, s):
    """One request's slot list (int64) checked as the C core does -> its valid entries (before the -1 padding)."""
    pad = np.flatnonzero(s == -1)
    if pad.size:  # -1 padding: entries from the first -1 on are ignored, and must all be -1
        first = int(pad[0])
        after = np.flatnonzero(s[first + 1:] != -1)
        if after.size:
            i = first + 1 + int(after[0])
            _fail(ValueError, op, "slots", "only -1 (padding) after the first -1",
                  f"{int(s[i])} at [{i}] after -1 at [{first}]")
        s = s[:first]
    m = s.shape[0]
    if m > 1 and (s[1:] <= s[:-1]).any():
        i = int(np.flatnonzero(s[1:] <= s[:-1])[0]) + 1
        _fail(ValueError, op, "slots", "strictly ascending slots", f"{int(s[i - 1])} followed by {int(s[i])}")
    if (s < np.arange(m)).any():
        i = int(np.flatnonzero(s < np.arange(m))[0])
        _fail(ValueError, op, "slots", "slots[i] >= i", f"slots[{i}] = {int(s[i])}")
    return s


def _kv_compact_host(tensors, prefix_len, slots):
    """In place: row prefix_len + i <- row prefix_len + slots[i] of every [..., S, D] tensor. -> None.  Batched
    (slots [batch, m], every tensor [batch, ..., S, D], prefix_len an int or int64 [batch]): row b of every
    tensor with slots[b] and prefix_len[b]; every request is checked before any row moves."""
    op = "kv_compact"
    arrays = tensors._arrays if isinstance(tensors, KVTensors) else _kv_arrays(op, tensors)
    batched = np.ndim(slots) == 2
    slots_arr = _as_array(op, "slots", slots, "ids", _ID_DTYPES, 2 if batched else 1)
    if batched:
        B = slots_arr.shape[0]
        prefixes = _row_ints(op, "prefix_len", prefix_len, B)
        prefix_arr = prefix_len if _is_array_like(prefix_len) else None
        for j, a in enumerate(arrays):
            if a.ndim < 3 or a.shape[0] != B:
                _fail(ValueError, op, f"tensors[{j}]", f"an array [batch = {B}, ..., S, D] for batched slots",
                      f"shape {tuple(a.shape)}")
        rows = slots_arr.astype(np.int64, copy=False)
    else:
        value, prefix_arr = _prefix_len(op, prefix_len)
        prefixes, rows = [value], slots_arr.astype(np.int64, copy=False)[None]
    for name, x in (("slots", slots_arr), ("prefix_len", prefix_arr)):  # moving rows would change them mid-call
        for j, a in enumerate(arrays):
            if x is not None and np.may_share_memory(np.asarray(x), a):
                _fail(ValueError, op, name, "memory not shared with the tensors", f"memory shared with tensors[{j}]")
    if any(p < 0 for p in prefixes):
        _fail(ValueError, op, "prefix_len", ">= 0", [p for p in prefixes if p < 0][0])
    valid = []
    for b, p in enumerate(prefixes):  # every request checked before anything moves
        s = _kv_valid_slots(op, rows[b])
        for i, a in enumerate(arrays):
            if s.shape[0] and p + int(s[-1]) >= a.shape[-2]:
                _fail(ValueError, op, "slots", f"prefix_len + slots[-1] < S = {a.shape[-2]} of tensors[{i}]",
                      f"{p} + {int(s[-1])}")
        valid.append(s)
    for b, (p, s) in enumerate(zip(prefixes, valid)):
        if s.shape[0] == 0 or not arrays:   # nothing moves (and p, unchecked then, may exceed int64)
            continue
        dst, src = p + np.arange(s.shape[0]), p + s
        for a in arrays:
            # Sequential "for i in order: row dst[i] <- row src[i]" equals this gather-then-scatter because
            # slots is strictly ascending with slots[i] >= i: a source row is never overwritten before it is read.
            row = a[b] if batched else a
            row[..., dst, :] = row[..., src, :]
    return None


# ----------------------------------------------------------------------------------------------------------
# the public signatures: those of heterospec.ops (`stream`, `check` and `device_outputs`: see the
# package docstring, heterospec/reference/__init__.py)
# ----------------------------------------------------------------------------------------------------------


def kv_compact(tensors, prefix_len, slots, *, stream=None, check=True):
    """In place: row prefix_len + i <- row prefix_len + slots[i] of every [..., S, D] tensor (a list/tuple or a
    KVTensors); slots may be padded with -1; prefix_len an int or a one-element int64 array. -> None."""
    return _kv_compact_host(tensors, prefix_len, slots)
