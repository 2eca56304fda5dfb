"""The batched cases of the op tests (tests/ops/test_<family>.py; the batch-first ABI from Python, issue 17):
random batches of trees and candidates whose rows the tests call one by one, on both implementations (C core and
NumPy twin), and on the device in the device tests."""
import numpy as np
from _oracles import random_tree


def _batch(rng, B, T, V, counts=None):
    toks, pars, lgs = [], [], []
    for b in range(B):
        c = T if counts is None else counts[b]
        t, p, x = random_tree(rng, c, V)
        pad = T - c   # the rest of a row is garbage the op must ignore
        toks.append(np.concatenate([t, rng.integers(0, V, pad)]))
        pars.append(np.concatenate([p, np.full(pad, 7, np.int64)]))
        lgs.append(np.concatenate([x, np.full((pad, V), np.nan, np.float32)]))
    return np.stack(toks), np.stack(pars), np.stack(lgs)


def _closed_selection(rng, parents, n):
    """A parent-closed, ascending selection of n candidates (n <= M)."""
    chosen = set()
    for c in rng.permutation(len(parents)):
        chain, p = [], int(c)
        while p >= 0 and p not in chosen:
            chain.append(p)
            p = int(parents[p])
        if len(chosen) + len(chain) <= n:
            chosen.update(chain)
        if len(chosen) == n:
            break
    return np.array(sorted(chosen), np.int64)


def _candidate_batch(rng, B, M, N, counts):
    tok = rng.integers(0, 50, (B, M)).astype(np.int64)
    par = np.stack([np.array([-1] + [int(rng.integers(-1, c)) for c in range(1, M)], np.int64) for _ in range(B)])
    sel = np.full((B, N), M + 5, np.int64)      # past n[b]: out of range, so a read of it would be an error
    for b in range(B):
        s = _closed_selection(rng, par[b], int(counts[b]))
        sel[b, : len(s)] = s
        counts[b] = len(s)
    return tok, par, sel
