"""expand, select and build_tree: the EAGLE-2/3 dynamic draft tree (the C core's csrc/core/tree.c)."""
from __future__ import annotations

import numpy as np

from .._types import VerifyTree, sequence_as_array
from ._common import (_ID_DTYPES, _SCORE_DTYPES, _as_array, _check_logit_rows, _fail, _ids, _int, _is_array_like,
                      _length, _logits, _row_ints, _scores, _topk_desc, _topk_entropy_rows)


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
# the public signatures: those of heterospec.ops (`stream`, `check` and `device_outputs`: see the
# package docstring, heterospec/reference/__init__.py)
# ----------------------------------------------------------------------------------------------------------


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
