"""verify_greedy and verify_sample, and the Philox4x32-10 generator verify_sample draws from (philox4x32,
philox_uniform): lossless acceptance of a draft tree (the C core's csrc/core/verify.c)."""
from __future__ import annotations

import numpy as np

from .._types import sequence_as_array
from ._common import (_ID_DTYPES, _U64_LIMIT, _as_array, _contiguous, _describe, _fail, _ids, _int, _is_array_like,
                      _length, _logit_row64, _logits, _np_view, _real, _temperature)

_U32 = 0xFFFFFFFF


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


def _warp(row64, temperature, top_k, top_p, min_p=0.0):
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
    if min_p > 0.0:
        w[w < min_p] = 0.0  # p_v < min_p * max p, and p_v / max p = w_v (the largest w is 1), renormalised or not
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


def _verify_sample_host(tree_tokens, tree_parents, target_logits, *, temperature, top_k=0, top_p=1.0, min_p=0.0, seed,
                        offset):
    """Lossless tree verification by recursive rejection sampling -> (path int64[len], next_token, draws)."""
    op = "verify_sample"
    tok, children, x = _tree(op, tree_tokens, tree_parents, target_logits)
    temperature = _temperature(op, temperature)
    top_k = _int(op, "top_k", top_k, 0)
    top_p = _real(op, "top_p", top_p)
    if not (0.0 < top_p <= 1.0):
        _fail(ValueError, op, "top_p", "a float in (0, 1]", top_p)
    min_p = _real(op, "min_p", min_p)
    if not (0.0 <= min_p <= 1.0):
        _fail(ValueError, op, "min_p", "a float in [0, 1] (0 disables it)", min_p)
    seed = _int(op, "seed", seed, 0, _U64_LIMIT - 1)
    offset = _int(op, "offset", offset, 0, _U64_LIMIT - 1)

    node, path, j = 0, [0], 0
    while True:
        # 1. warp the row of the current node
        w = _warp(_logit_row64(op, "target_logits", x, node), temperature, top_k, top_p, min_p)
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
# the public signatures: those of heterospec.ops (`stream`, `check` and `device_outputs`: see the
# package docstring, heterospec/reference/__init__.py)
# ----------------------------------------------------------------------------------------------------------


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
                  stream=None, check=True, device_outputs=False, advance_offset=False, min_p=0.0):
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
                                                   top_k=top_k, top_p=top_p, min_p=min_p, seed=seeds[b],
                                                   offset=offsets[b])
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
                                           top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, offset=offset)
    if advance_offset:  # offset += draws, mod 2^64, stored as the int64 with those bits (as the kernel does)
        advanced = (offset + draws) % _U64_LIMIT
        offset_arr.fill(advanced - _U64_LIMIT if advanced >= 1 << 63 else advanced)
    if not device_outputs:
        return path, nxt, draws
    n = np.asarray(tree_tokens).shape[0]
    return (_padded(path, n), np.array(path.shape[0], dtype=np.int64), np.array(nxt, dtype=np.int64),
            np.array(draws, dtype=np.int64))
