"""Pure NumPy reference implementation of every op in docs/ops.md.

This module is the *executable specification*: each function follows the text of docs/ops.md step by step
and favours clarity over speed (while staying vectorised where that is natural).  The C core
(``heterospec.ops``) must agree with it: integers exactly, floats to float32 rounding.

Conventions (see docs/ops.md, "Conventions"):

* inputs may be NumPy arrays or anything ``np.asarray`` accepts (torch CPU tensors included; bfloat16 is
  not supported here because NumPy has no bfloat16 -> TypeError); outputs are always NumPy;
* logits are converted to float32 (then widened to float64 exactly); reductions accumulate in float64;
* non-C-contiguous arrays are refused (ValueError) -- we never copy silently;
* every error message starts with ``<op>: argument '<name>'`` and says what was expected and given.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ._types import MIN_TEMPERATURE, OP_NAMES, VerifyTree, sequence_as_array

__all__ = [*OP_NAMES, "VerifyTree", "KVTensors"]

_LOGIT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
_SCORE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))

_DTYPE_NAMES = {d: "/".join(str(t) for t in d) for d in (_LOGIT_DTYPES, _SCORE_DTYPES, _ID_DTYPES)}

_U32 = 0xFFFFFFFF
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


# ----------------------------------------------------------------------------------------------------------
# topk_entropy
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
# expand
# ----------------------------------------------------------------------------------------------------------


def _expand_host(logits, beam_scores, beam_nodes, k, d2t=None, node_offset=0):
    """One EAGLE-2/3 dynamic-tree level -> (tokens, scores, parents, entropy, next_beams)."""
    op = "expand"
    x = _logits(op, "logits", logits)
    b, vd = x.shape
    if b < 1 or vd < 1:
        _fail(ValueError, op, "logits", "a [B, Vd] matrix with B >= 1 and Vd >= 1", f"shape {tuple(x.shape)}")
    bs = _scores(op, "beam_scores", beam_scores)
    _length(op, "beam_scores", bs, b, "B = logits rows")
    bn = _ids(op, "beam_nodes", beam_nodes)
    _length(op, "beam_nodes", bn, b, "B = logits rows")
    k = _int(op, "k", k, 1, vd)
    if d2t is not None:
        d2t = _ids(op, "d2t", d2t)
        _length(op, "d2t", d2t, vd, "Vd = logits columns")
    node_offset = _int(op, "node_offset", node_offset, 0)

    bs64 = bs.astype(np.float64)
    if np.isnan(bs64).any() or (bs64 == np.inf).any():
        i = int(np.flatnonzero(np.isnan(bs64) | (bs64 == np.inf))[0])
        _fail(ValueError, op, "beam_scores", "no NaN and no +Inf", f"{bs64[i]} at index {i}")
    if (bn < -1).any():
        i = int(np.flatnonzero(bn < -1)[0])
        _fail(ValueError, op, "beam_nodes", "node numbers >= -1", f"{int(bn[i])} at index {i}")
    x32 = x.astype(np.float32, copy=False)
    _check_logit_rows(op, "logits", x32, np.arange(b))
    x64 = x32.astype(np.float64)

    # lp = (x - m) - ln(sum_v exp(x_v - m)), m = row max, sum in float64
    m = x64.max(axis=1, keepdims=True)
    d = x64 - m
    lp = d - np.log(np.exp(d).sum(axis=1, keepdims=True))

    # Rank by the logits themselves: log_softmax is monotonic, so this is the order of lp, without the
    # ties that rounding x - m - lse can create between logits that differ by less than an ulp of lse.
    ids = np.stack([_topk_desc(x64[r], k) for r in range(b)])
    tokens = ids.copy()
    if d2t is not None:
        tokens = ids + d2t[ids]
        if (tokens < 0).any():
            r, j = np.argwhere(tokens < 0)[0]
            _fail(ValueError, op, "d2t", "mapped tokens id + d2t[id] >= 0",
                  f"{int(ids[r, j])} + {int(d2t[ids[r, j]])} = {int(tokens[r, j])} (row {int(r)})")
    scores = (bs64[:, None] + np.take_along_axis(lp, ids, axis=1)).astype(np.float32)  # rounded once
    parents = np.repeat(bn, k)
    entropy = _topk_entropy_rows(x64, k, 1.0)
    flat_scores = scores.reshape(-1)
    next_beams = node_offset + _topk_desc(flat_scores.astype(np.float64), k)
    return (
        tokens.reshape(-1).astype(np.int64),
        flat_scores,
        parents.astype(np.int64),
        entropy,
        next_beams.astype(np.int64),
    )


# ----------------------------------------------------------------------------------------------------------
# select
# ----------------------------------------------------------------------------------------------------------


def _select_host(scores, n):
    """Indices of the n highest scores (ties to the lower index), in ascending index order -> int64[n]."""
    op = "select"
    s = _scores(op, "scores", scores)
    n = _int(op, "n", n, 0, s.shape[0])
    s64 = s.astype(np.float64)
    if np.isnan(s64).any():
        _fail(ValueError, op, "scores", "no NaN", f"nan at index {int(np.flatnonzero(np.isnan(s64))[0])}")
    return np.sort(_topk_desc(s64, n)).astype(np.int64)


# ----------------------------------------------------------------------------------------------------------
# build_tree
# ----------------------------------------------------------------------------------------------------------


def _build_tree_host(tokens, parents, selected, root_token):
    """Build the verification tree (root + selected candidates) -> VerifyTree."""
    op = "build_tree"
    tok = _ids(op, "tokens", tokens)
    par = _ids(op, "parents", parents)
    sel = _ids(op, "selected", selected)
    m = tok.shape[0]
    _length(op, "parents", par, m, "M = len(tokens)")
    root_token = _int(op, "root_token", root_token, 0)
    n = sel.shape[0]

    # only the selected candidates' entries are read (and checked): the others may hold anything
    if ((sel < 0) | (sel >= m)).any():
        i = int(np.flatnonzero((sel < 0) | (sel >= m))[0])
        _fail(ValueError, op, "selected", f"candidate indices in [0, {m})", f"{int(sel[i])} at index {i}")
    if n > 1 and (sel[1:] <= sel[:-1]).any():
        i = int(np.flatnonzero(sel[1:] <= sel[:-1])[0]) + 1
        _fail(ValueError, op, "selected", "strictly ascending indices",
              f"{int(sel[i - 1])} followed by {int(sel[i])} at index {i}")

    sel_par = par[sel]
    if ((sel_par < -1) | (sel_par >= m)).any():
        i = int(sel[np.flatnonzero((sel_par < -1) | (sel_par >= m))[0]])
        _fail(ValueError, op, "parents", f"candidate indices in [-1, {m})", f"{int(par[i])} at index {i}")
    if (sel_par >= sel).any():
        i = int(np.flatnonzero(sel_par >= sel)[0])
        _fail(ValueError, op, "parents", "parents must precede children (parents[m] < m)",
              f"parents[{int(sel[i])}] = {int(sel_par[i])}")
    if (tok[sel] < 0).any():
        i = int(sel[np.flatnonzero(tok[sel] < 0)[0]])
        _fail(ValueError, op, "tokens", "token ids >= 0 (selected candidates)", f"{int(tok[i])} at [{i}]")
    # tree index of each selected candidate's parent (0 = the root); selected is sorted -> searchsorted
    pos = np.searchsorted(sel, sel_par)
    found = (sel_par == -1) | ((pos < n) & (sel[np.minimum(pos, max(n - 1, 0))] == sel_par))
    if not found.all():
        i = int(np.flatnonzero(~found)[0])
        _fail(ValueError, op, "selected", "a parent-closed selection",
              f"candidate {int(sel[i])} selected but its parent candidate {int(sel_par[i])} not (not parent-closed)")

    tree_parents = np.empty(n + 1, dtype=np.int64)
    tree_parents[0] = -1
    tree_parents[1:] = np.where(sel_par == -1, 0, pos + 1)
    tree_tokens = np.empty(n + 1, dtype=np.int64)
    tree_tokens[0] = root_token
    tree_tokens[1:] = tok[sel]

    depths = np.zeros(n + 1, dtype=np.int64)
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    mask[0, 0] = True
    for i in range(1, n + 1):  # parents precede children, so parent rows are complete
        p = tree_parents[i]
        depths[i] = depths[p] + 1
        mask[i] = mask[p]
        mask[i, i] = True

    is_parent = np.zeros(n + 1, dtype=bool)
    is_parent[tree_parents[1:]] = True
    leaves = np.flatnonzero(~is_parent)  # ascending node index; the root alone when n == 0
    width = int(depths.max()) + 1
    retrieve = np.full((leaves.shape[0], width), -1, dtype=np.int64)
    for r, leaf in enumerate(leaves):
        chain = np.flatnonzero(mask[leaf])  # ancestors-or-self, ascending index == root -> leaf order
        retrieve[r, : chain.shape[0]] = chain
    return VerifyTree(tree_tokens, tree_parents, depths, mask, retrieve)


# ----------------------------------------------------------------------------------------------------------
# verification (greedy and sampled)
# ----------------------------------------------------------------------------------------------------------


def _tree(op, tree_tokens, tree_parents, target_logits):
    tok = _ids(op, "tree_tokens", tree_tokens)
    par = _ids(op, "tree_parents", tree_parents)
    x = _logits(op, "target_logits", target_logits)
    n = tok.shape[0]
    if n < 1:
        _fail(ValueError, op, "tree_tokens", "n >= 1 nodes (the root at least)", "0 nodes")
    _length(op, "tree_parents", par, n, "n = len(tree_tokens)")
    if x.shape[0] != n:
        _fail(ValueError, op, "target_logits", f"{n} rows (n = len(tree_tokens))", f"{x.shape[0]} rows")
    v = x.shape[1]
    if v < 1:
        _fail(ValueError, op, "target_logits", "a vocabulary of V >= 1 columns", f"shape {tuple(x.shape)}")
    if par[0] != -1:
        _fail(ValueError, op, "tree_parents", "tree_parents[0] == -1", f"{int(par[0])}")
    bad = (par[1:] < 0) | (par[1:] >= np.arange(1, n))
    if bad.any():
        i = int(np.flatnonzero(bad)[0]) + 1
        _fail(ValueError, op, "tree_parents", f"0 <= tree_parents[{i}] < {i}", f"{int(par[i])}")
    bad = (tok < 0) | (tok >= v)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _fail(ValueError, op, "tree_tokens", f"token ids in [0, {v})", f"{int(tok[i])} at node {i}")
    children = [[] for _ in range(n)]
    for i, p in enumerate(par[1:].tolist(), start=1):
        children[p].append(i)  # ascending node index
    return tok.tolist(), children, x


def _verify_greedy_host(tree_tokens, tree_parents, target_logits):
    """Greedy tree verification -> (path int64[len], next_token int)."""
    op = "verify_greedy"
    tok, children, x = _tree(op, tree_tokens, tree_parents, target_logits)
    node, path = 0, [0]
    while True:
        row = _logit_row64(op, "target_logits", x, node)
        best = int(np.argmax(row))  # first maximum = ties to the lower id
        nxt = next((c for c in children[node] if tok[c] == best), None)  # lowest node index
        if nxt is None:
            return np.array(path, dtype=np.int64), best
        node = nxt
        path.append(node)


def _lane_sum(w):
    """The lane sum of docs/ops.md: lane l sums w[v] for v = l (mod 8) in ascending v (sequential float64),
    then ((lane0 + lane1) + lane2) + ... + lane7.  Padding with zeros is exact (x + 0.0 == x)."""
    pad = (-w.shape[0]) % 8
    lanes = np.add.accumulate(np.concatenate([w, np.zeros(pad)]).reshape(-1, 8), axis=0)[-1]
    total = float(lanes[0])
    for lane in lanes[1:]:
        total += float(lane)
    return total


def _warp(row64, temperature, top_k, top_p):
    """HuggingFace-order warp of one float64 row (values already float32) -> w (float64, 0 = removed)."""
    v = row64.shape[0]
    z = row64 / temperature
    d = z - z.max()
    w = np.exp(d)
    w[d < -708.0] = 0.0  # exp(-708) < 1e-307: the C core's vector exp returns 0 there, by spec
    if 0 < top_k < v:
        t = np.partition(z, v - top_k)[v - top_k]  # the top_k-th largest z
        w[z < t] = 0.0  # ties at t are kept
    if top_p < 1.0:
        p = w / _lane_sum(w)
        ids = np.flatnonzero(w > 0.0)  # tokens without mass are removed either way
        order = ids[np.lexsort((ids, -z[ids]))]  # (z descending, id ascending)
        before = np.concatenate([[0.0], np.add.accumulate(p[order])[:-1]])  # mass strictly before each token
        w[order[before >= top_p]] = 0.0  # kept iff the mass before it is < top_p: the top token always is
    return w


def _philox_block(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on Python ints (fast for a single block)."""
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _U32, (p0 >> 32) ^ c3 ^ k1, p0 & _U32
        k0 = (k0 + 0x9E3779B9) & _U32
        k1 = (k1 + 0xBB67AE85) & _U32
    return c0, c1, c2, c3


def _uniform(seed, offset, j):
    """u_j = x0 * 2^-32 with x = Philox4x32-10((c_lo, c_hi, 0, 0), (seed_lo, seed_hi)), c = offset + j."""
    c = (offset + j) % _U64_LIMIT
    x0 = _philox_block(c & _U32, c >> 32, 0, 0, seed & _U32, seed >> 32)[0]
    return x0 * 2.0**-32


def _verify_sample_host(tree_tokens, tree_parents, target_logits, *, temperature, top_k=0, top_p=1.0, seed, offset):
    """Lossless tree verification by recursive rejection sampling -> (path int64[len], next_token, draws)."""
    op = "verify_sample"
    tok, children, x = _tree(op, tree_tokens, tree_parents, target_logits)
    temperature = _temperature(op, temperature)
    top_k = _int(op, "top_k", top_k, 0)
    top_p = _real(op, "top_p", top_p)
    if not (0.0 < top_p <= 1.0):
        _fail(ValueError, op, "top_p", "a float in (0, 1]", top_p)
    seed = _int(op, "seed", seed, 0, _U64_LIMIT - 1)
    offset = _int(op, "offset", offset, 0, _U64_LIMIT - 1)

    node, path, j = 0, [0], 0
    while True:
        # 1. warp the row of the current node
        w = _warp(_logit_row64(op, "target_logits", x, node), temperature, top_k, top_p)
        r_mass = _lane_sum(w)
        rejected = []
        accepted = None
        # 2. try the children in ascending node index
        for c in children[node]:
            t = tok[c]
            if t in rejected:
                continue  # a duplicate of a rejected token: no draw
            u = _uniform(seed, offset, j)
            j += 1
            wt = float(w[t])
            if wt > 0.0 and u * r_mass < wt:
                accepted = c
                break
            rejected.append(t)
            r_mass = r_mass - wt
            w[t] = 0.0
        if accepted is not None:
            path.append(accepted)
            node = accepted
            continue
        # 3. no child accepted: sample the bonus token from the residual
        u = _uniform(seed, offset, j)
        j += 1
        s_mass = _lane_sum(w)
        if s_mass > 0.0:
            cum = np.add.accumulate(w)  # sequential running sum over ascending ids
            hit = np.flatnonzero(cum > u * s_mass)  # the smallest id with running sum > u * S ...
            # ... or, when rounding leaves the sequential sum short of u * S, the largest id with mass
            next_token = int(hit[0]) if hit.size else int(np.flatnonzero(w > 0.0)[-1])
        else:
            next_token = rejected[-1]
        return np.array(path, dtype=np.int64), next_token, j


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


def _is_array_like(x):
    if isinstance(x, (bool, int, np.generic)):
        return False
    return isinstance(x, np.ndarray) or hasattr(x, "__dlpack__") or hasattr(x, "__array__")


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
# Philox helpers
# ----------------------------------------------------------------------------------------------------------


def _words(op, name, x, count):
    if isinstance(x, np.ndarray):
        x = x.tolist()
    if not isinstance(x, (list, tuple)):
        _fail(TypeError, op, name, f"a sequence of {count} uint32 words", type(x).__name__)
    if len(x) != count:
        _fail(ValueError, op, name, f"{count} uint32 words", f"{len(x)} words")
    out = []
    for w in x:
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
            _fail(TypeError, op, name, "int words", _describe(w))
        if not 0 <= int(w) <= _U32:
            _fail(ValueError, op, name, "words in [0, 2^32)", int(w))
        out.append(int(w))
    return out


def philox4x32(counter, key):
    """The Random123 Philox4x32-10 bijection -> tuple of 4 ints."""
    op = "philox4x32"
    c = _words(op, "counter", counter, 4)
    k = _words(op, "key", key, 2)
    return tuple(_philox_block(*c, *k))


def philox_uniform(n, *, seed, offset):
    """u_0..u_{n-1} (float64 in [0, 1)) as used by verify_sample -> float64[n]."""
    op = "philox_uniform"
    n = _int(op, "n", n, 0)
    seed = _int(op, "seed", seed, 0, _U64_LIMIT - 1)
    offset = _int(op, "offset", offset, 0, _U64_LIMIT - 1)
    c = np.uint64(offset) + np.arange(n, dtype=np.uint64)  # uint64 arithmetic wraps mod 2^64
    m32 = np.uint64(_U32)
    c0, c1 = c & m32, c >> np.uint64(32)
    c2 = np.zeros(n, dtype=np.uint64)
    c3 = np.zeros(n, dtype=np.uint64)
    k0, k1 = np.uint64(seed & _U32), np.uint64(seed >> 32)
    mul0, mul1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    s32 = np.uint64(32)
    for _ in range(10):
        p0 = mul0 * c0  # < 2^64: exact in uint64
        p1 = mul1 * c2
        c0, c1, c2, c3 = (p1 >> s32) ^ c1 ^ k0, p1 & m32, (p0 >> s32) ^ c3 ^ k1, p0 & m32
        k0 = (k0 + w0) & m32
        k1 = (k1 + w1) & m32
    return c0.astype(np.float64) * 2.0**-32


# ----------------------------------------------------------------------------------------------------------
# the public signatures: those of heterospec.ops.  `stream` and `check` concern CUDA launches and are
# accepted and ignored here (NumPy runs synchronously and raises at once); `device_outputs` gives the
# padded, host-sync-free result form of the CUDA path, so code written for it runs on the twin too.
# ----------------------------------------------------------------------------------------------------------


def topk_entropy(logits, k, temperature=1.0, *, stream=None, check=True):
    """Per-row entropy (nats) of the softmax of the k largest logits divided by temperature -> float32[N].
    Batched (logits [batch, N, V]): float32 [batch, N], row by row."""
    return _topk_entropy_host(logits, k, temperature, 3 if np.ndim(logits) == 3 else 2)


def expand(logits, beam_scores, beam_nodes, k, d2t=None, node_offset=0, *, stream=None, check=True):
    """One EAGLE-2/3 dynamic-tree level -> (tokens, scores, parents, entropy, next_beams).  Batched
    (logits [batch, B, Vd], beams [batch, B]): each output gains a leading batch dimension, row by row."""
    if np.ndim(logits) == 3:
        op = "expand"
        # the whole arrays checked as the C core checks them (dtype, rank, C-contiguity), then row by row
        x = _logits(op, "logits", logits, ndim=3)
        sc = _as_array(op, "beam_scores", beam_scores, "scores", _SCORE_DTYPES, 2)
        nd = _as_array(op, "beam_nodes", beam_nodes, "ids", _ID_DTYPES, 2)
        nb, B = x.shape[:2]
        for name, a in (("beam_scores", sc), ("beam_nodes", nd)):
            if a.ndim != 2:
                _fail(ValueError, op, name, "an array [batch, B] with ndim 2", f"ndim {a.ndim}")
            if a.shape != (nb, B):
                _fail(ValueError, op, name, f"shape ({nb}, {B}) (one row of beams per batch row)", f"{tuple(a.shape)}")
        rows = [_expand_host(x[b], sc[b], nd[b], k, d2t, node_offset) for b in range(nb)]
        if not rows:
            # no rows: k, d2t and node_offset are still checked as the C core checks them, on one row of zeros
            _expand_host(np.zeros(x.shape[1:], np.float32), np.zeros(B, np.float32), np.zeros(B, np.int64), k, d2t,
                         node_offset)
            kk = _int(op, "k", k, 1)
            return (np.zeros((0, B * kk), np.int64), np.zeros((0, B * kk), np.float32), np.zeros((0, B * kk), np.int64),
                    np.zeros((0, B), np.float32), np.zeros((0, kk), np.int64))
        return tuple(np.stack(parts) for parts in zip(*rows))
    return _expand_host(logits, beam_scores, beam_nodes, k, d2t, node_offset)


def select(scores, n, *, m=None, width=None, stream=None, check=True):
    """Indices of the n highest scores (ties to the lower index), in ascending index order -> int64[n].
    Batched (scores [batch, M], the same n for every row): int64 [batch, n], row by row.  Per-row sizes (n and/or
    m int64 [batch], output width default M for an array n, n for an int): int64 [batch, width], row b the
    unbatched call on scores[b, :m[b]] with n[b], padded with -1."""
    op = "select"
    n, m = sequence_as_array(n), sequence_as_array(m)   # as heterospec.ops takes them
    if m is not None or width is not None or _is_array_like(n):
        if np.ndim(scores) != 2:
            _fail(ValueError, op, "n", "an int for unbatched scores ([M]); per-row sizes (an array n, m or width) "
                  "need [batch, M] scores", "per-row sizes")
        x = _as_array(op, "scores", scores, "scores", _SCORE_DTYPES, 2)   # the whole array, as the C core checks it
        B, M = x.shape
        if width is None:
            width = M if _is_array_like(n) else n
        width = _int(op, "width", width)
        if not 0 <= width <= M:
            _fail(ValueError, op, "width", f"0 <= width <= M = {M}", width)
        if not _is_array_like(n):
            if not 0 <= _int(op, "n", n) <= M:
                _fail(ValueError, op, "n", f"0 <= n <= M = {M}", n)
            if n != width:
                _fail(ValueError, op, "width", f"n = {n} for an int n (per-row counts as an int64 [batch] array allow "
                      "a wider output)", width)
        counts = _row_ints(op, "n", n, B)
        ms = _row_ints(op, "m", M if m is None else m, B)
        out = np.full((B, width), -1, np.int64)
        for b in range(B):
            if not 0 <= ms[b] <= M:
                _fail(ValueError, op, "m", f"candidate counts in [0, {M}]", ms[b])
            if not 0 <= counts[b] <= min(ms[b], width):
                _fail(ValueError, op, "n", f"0 <= n[b] <= min(m[b], width) = {min(ms[b], width)}",
                      f"{counts[b]} at row {b}")
            out[b, : counts[b]] = _select_host(x[b, : ms[b]], counts[b])
        return out
    if np.ndim(scores) == 2:
        x = _as_array(op, "scores", scores, "scores", _SCORE_DTYPES, 2)
        rows = [_select_host(x[b], n) for b in range(x.shape[0])]
        return np.stack(rows) if rows else np.zeros((0, _int("select", "n", n, 0, x.shape[1])), np.int64)
    return _select_host(scores, n)


def build_tree(tokens, parents, selected, root_token, *, n=None, stream=None, check=True, device_outputs=False):
    """Build the verification tree (root + selected candidates) -> VerifyTree (or, with device_outputs,
    (VerifyTree with retrieve padded to [n+1, n+1], num_leaves, max_depth)).  Batched ([batch, M] candidates,
    selected [batch, N], n None or int64 [batch], root_token an int or int64 [batch]): (VerifyTree of
    [batch, N+1] / [batch, N+1, N+1] arrays, rows past n[b]+1 -1 and mask False, num_leaves [batch],
    max_depth [batch]), each row the unbatched call with device_outputs on its first n[b] entries."""
    n = sequence_as_array(n)   # as heterospec.ops takes it (and a batched call's root_token)
    if np.ndim(tokens) == 2:
        return _build_tree_batch(tokens, parents, selected, sequence_as_array(root_token), n)
    if n is not None:
        _fail(ValueError, "build_tree", "n", "None for an unbatched tree ([M] tokens)", "an array")
    tree = _build_tree_host(tokens, parents, selected, root_token)
    if not device_outputs:
        return tree
    t = tree.tokens.shape[0]
    leaves, width = tree.retrieve.shape
    padded = np.full((t, t), -1, dtype=np.int64)
    padded[:leaves, :width] = tree.retrieve
    return tree._replace(retrieve=padded), np.array(leaves, dtype=np.int64), np.array(width - 1, dtype=np.int64)


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


def _build_tree_batch(tokens, parents, selected, root_token, n):
    op = "build_tree"
    # the whole arrays checked as the C core checks them (dtype, rank, C-contiguity), then row by row
    tok = _as_array(op, "tokens", tokens, "ids", _ID_DTYPES, 2)
    par = _as_array(op, "parents", parents, "ids", _ID_DTYPES, 2)
    sel = _as_array(op, "selected", selected, "ids", _ID_DTYPES, 2)
    B, M = tok.shape
    if par.ndim != 2 or par.shape != (B, M):
        _fail(ValueError, op, "parents", f"shape ({B}, {M}) (one parent per candidate token)", f"{tuple(par.shape)}")
    if sel.ndim != 2 or sel.shape[0] != B:
        _fail(ValueError, op, "selected", f"shape ({B}, N) (one row per batch row)", f"{tuple(sel.shape)}")
    N = sel.shape[1]
    if N > M:
        _fail(ValueError, op, "selected", f"at most M = {M} entries per row", f"{N}")
    counts = _row_ints(op, "n", N if n is None else n, B)
    if any(not 0 <= c <= N for c in counts):
        _fail(ValueError, op, "n", f"selection sizes in [0, {N}]", [c for c in counts if not 0 <= c <= N][0])
    roots = _row_ints(op, "root_token", root_token, B)
    T = N + 1
    out = [np.full((B, T), -1, np.int64) for _ in range(3)]
    mask, retrieve = np.zeros((B, T, T), bool), np.full((B, T, T), -1, np.int64)
    leaves, depth = np.zeros(B, np.int64), np.zeros(B, np.int64)
    for b in range(B):
        c = counts[b]
        tree, leaves[b], depth[b] = build_tree(tok[b], par[b], sel[b, :c], roots[b], device_outputs=True)
        for o, a in zip(out, (tree.tokens, tree.parents, tree.depths)):
            o[b, : c + 1] = a
        mask[b, : c + 1, : c + 1] = tree.mask
        retrieve[b, : c + 1, : c + 1] = tree.retrieve
    return VerifyTree(*out, mask, retrieve), leaves, depth


def _padded(path, n):
    out = np.full(n, -1, dtype=np.int64)
    out[: path.shape[0]] = path
    return out


def _batch_rows(op, tree_tokens, tree_parents, target_logits, n):
    """Batched trees: ([batch, T] tokens, [batch, T] parents, [batch, T, V] logits, node counts [batch])."""
    # the whole arrays checked as the C core checks them (dtype, rank, C-contiguity), then row by row
    tok = _as_array(op, "tree_tokens", tree_tokens, "ids", _ID_DTYPES, 2)
    par = _as_array(op, "tree_parents", tree_parents, "ids", _ID_DTYPES, 2)
    x = _logits(op, "target_logits", target_logits, ndim=3)
    B, T = tok.shape
    if par.ndim != 2:
        _fail(ValueError, op, "tree_parents", "an array [batch, T] with ndim 2", f"ndim {par.ndim}")
    if par.shape != (B, T):
        _fail(ValueError, op, "tree_parents", f"shape ({B}, {T}) (one parent per tree node)", f"{tuple(par.shape)}")
    if x.ndim != 3:
        _fail(ValueError, op, "target_logits", "an array [batch, T, V] with ndim 3", f"ndim {x.ndim}")
    if x.shape[:2] != (B, T):
        _fail(ValueError, op, "target_logits", f"shape ({B}, {T}, V) (one logits row per tree node)",
              f"{tuple(x.shape)}")
    if T < 1:
        _fail(ValueError, op, "tree_tokens", "at least the root node", "T = 0")
    if n is None:
        counts = [T] * B
    else:
        a = _np_view(op, "n", n)
        if a.dtype != np.int64:
            _fail(TypeError, op, "n", "dtype int64", f"{a.dtype}")
        if a.shape != (B,):
            _fail(ValueError, op, "n", f"shape ({B},) (one node count per batch row)", f"{tuple(a.shape)}")
        _contiguous(op, "n", a)
        counts = [int(v) for v in a]
        bad = [c for c in counts if not 1 <= c <= T]
        if bad:
            _fail(ValueError, op, "n", f"node counts in [1, {T}]", bad[0])
    return tok, par, x, counts


def _batch_values(op, name, x, B):
    """seed / offset of a batched verify_sample: an int (every row) or an int64 [batch] array -> (values, array)."""
    if not _is_array_like(x):
        return [x] * B, None
    a = x if isinstance(x, np.ndarray) else _np_view(op, name, x)
    if a.dtype != np.int64:
        _fail(TypeError, op, name, "dtype int64 (or a Python int)", f"{a.dtype}")
    if a.shape != (B,):
        _fail(ValueError, op, name, f"shape ({B},) (one value per batch row)", f"{tuple(a.shape)}")
    return [int(v) % _U64_LIMIT for v in a], a


def verify_greedy(tree_tokens, tree_parents, target_logits, *, n=None, stream=None, check=True,
                  device_outputs=False):
    """Greedy tree verification -> (path int64[len], next_token int), or with device_outputs
    (path[n] padded with -1, length, next_token) as arrays.  Batched ([batch, T] trees, [batch, T, V] logits,
    n None or int64 [batch]): (path [batch, T] padded with -1, length [batch], next_token [batch])."""
    n = sequence_as_array(n)   # as heterospec.ops takes it
    if np.ndim(tree_tokens) == 2:
        tok, par, x, counts = _batch_rows("verify_greedy", tree_tokens, tree_parents, target_logits, n)
        B, T = tok.shape
        out = np.full((B, T), -1, dtype=np.int64), np.zeros(B, np.int64), np.zeros(B, np.int64)
        for b, c in enumerate(counts):
            path, nxt = _verify_greedy_host(tok[b, :c], par[b, :c], x[b, :c])
            out[0][b, : path.shape[0]], out[1][b], out[2][b] = path, path.shape[0], nxt
        return out
    if n is not None:
        _fail(ValueError, "verify_greedy", "n", "None for an unbatched tree (a [T] tree_tokens)", "an array")
    path, nxt = _verify_greedy_host(tree_tokens, tree_parents, target_logits)
    if not device_outputs:
        return path, nxt
    n = np.asarray(tree_tokens).shape[0]
    return _padded(path, n), np.array(path.shape[0], dtype=np.int64), np.array(nxt, dtype=np.int64)


def verify_sample(tree_tokens, tree_parents, target_logits, *, temperature, top_k=0, top_p=1.0, seed, offset, n=None,
                  stream=None, check=True, device_outputs=False, advance_offset=False):
    """Lossless tree verification by recursive rejection sampling -> (path int64[len], next_token, draws),
    or with device_outputs (path[n] padded with -1, length, next_token, draws) as arrays.

    seed / offset: an int, or a 1-element int64 array (NumPy or a torch CPU tensor; its int64 bits are the
    uint64 value, as the CUDA kernel reads them), read when the op runs; with advance_offset=True (an array
    offset only) offset + draws (mod 2^64) is written back into it in place."""
    op = "verify_sample"
    n = sequence_as_array(n)   # as heterospec.ops takes it
    if np.ndim(tree_tokens) == 2:
        tok, par, x, counts = _batch_rows(op, tree_tokens, tree_parents, target_logits, n)
        B, T = tok.shape
        seeds, _ = _batch_values(op, "seed", seed, B)
        offsets, offset_arr = _batch_values(op, "offset", offset, B)
        if advance_offset and offset_arr is None:
            _fail(ValueError, op, "advance_offset", "False unless 'offset' is an int64 [batch] array", "True")
        if advance_offset and not offset_arr.flags.writeable:
            _fail(ValueError, op, "offset", "a writable array with advance_offset=True", "a read-only one")
        out = (np.full((B, T), -1, dtype=np.int64), np.zeros(B, np.int64), np.zeros(B, np.int64),
               np.zeros(B, np.int64))
        for b, c in enumerate(counts):
            path, nxt, draws = _verify_sample_host(tok[b, :c], par[b, :c], x[b, :c], temperature=temperature,
                                                   top_k=top_k, top_p=top_p, seed=seeds[b], offset=offsets[b])
            out[0][b, : path.shape[0]], out[1][b], out[2][b], out[3][b] = path, path.shape[0], nxt, draws
        if advance_offset:
            for b in range(B):
                adv = (offsets[b] + int(out[3][b])) % _U64_LIMIT
                offset_arr[b] = adv - _U64_LIMIT if adv >= 1 << 63 else adv
        return out
    if n is not None:
        _fail(ValueError, op, "n", "None for an unbatched tree (a [T] tree_tokens)", "an array")

    def scalar(name, x):
        """-> (the value, the array or None); ints are range-checked by _verify_sample_host."""
        if not _is_array_like(x):
            return x, None
        device = getattr(x, "__dlpack_device__", None)
        kind, index = (int(d) for d in device()) if device is not None and not isinstance(x, np.ndarray) else (1, 0)
        if kind not in (1, 3):  # DLPack kDLCPU, kDLCUDAHost: this implementation runs on the host only
            where = {2: "cuda", 10: "rocm", 13: "cuda_managed"}.get(kind, "device")
            _fail(ValueError, op, name, "the device of 'tree_tokens' (cpu:0)", f"{where}:{index}")
        a = x if isinstance(x, np.ndarray) else _np_view(op, name, x)
        if a.dtype != np.int64:
            _fail(TypeError, op, name, "dtype int64 (or a Python int)", f"{a.dtype}")
        if a.size != 1:
            _fail(ValueError, op, name, "an int or a 1-element int64 tensor", f"{a.size} elements")
        return int(a.reshape(-1)[0]) % _U64_LIMIT, a

    seed, _ = scalar("seed", seed)
    offset, offset_arr = scalar("offset", offset)
    if advance_offset and offset_arr is None:
        _fail(ValueError, op, "advance_offset", "False unless 'offset' is a 1-element int64 tensor",
              "True (with an int offset)")
    if advance_offset and not offset_arr.flags.writeable:
        _fail(ValueError, op, "offset", "a writable tensor (advance_offset=True writes offset + draws into it)",
              "a read-only one")
    path, nxt, draws = _verify_sample_host(tree_tokens, tree_parents, target_logits, temperature=temperature,
                                           top_k=top_k, top_p=top_p, seed=seed, offset=offset)
    if advance_offset:  # offset += draws, mod 2^64, stored as the int64 with those bits (as the kernel does)
        advanced = (offset + draws) % _U64_LIMIT
        offset_arr.fill(advanced - _U64_LIMIT if advanced >= 1 << 63 else advanced)
    if not device_outputs:
        return path, nxt, draws
    n = np.asarray(tree_tokens).shape[0]
    return (_padded(path, n), np.array(path.shape[0], dtype=np.int64), np.array(nxt, dtype=np.int64),
            np.array(draws, dtype=np.int64))


def kv_compact(tensors, prefix_len, slots, *, stream=None, check=True):
    """In place: row prefix_len + i <- row prefix_len + slots[i] of every [..., S, D] tensor (a list/tuple or a
    KVTensors); slots may be padded with -1; prefix_len an int or a one-element int64 array. -> None."""
    return _kv_compact_host(tensors, prefix_len, slots)


def bucketize(values, thresholds, *, stream=None, check=True):
    """bin[i] = number of thresholds s with values[i] > s (float64 comparison) -> int32[N]."""
    return _bucketize_host(values, thresholds)
