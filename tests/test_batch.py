"""The batch-first ABI from Python (issue 17): verify_greedy / verify_sample over [batch, T] trees equal the
same calls made row by row, on both implementations (C core and NumPy twin); per-row node counts ``n``,
per-row seeds and offsets, advance_offset per row; bad batched input named in one line.  The CUDA side of
the same calls is in tests/test_cuda.py."""
import numpy as np
import pytest

from _oracles import random_tree
from conftest import to_numpy


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


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ragged", [False, True])
def test_greedy_batch_equals_its_rows(impl, seed, ragged):
    rng = np.random.default_rng(seed)
    B, T, V = 5, 9, 30
    counts = rng.integers(1, T + 1, B) if ragged else None
    tok, par, x = _batch(rng, B, T, V, counts)
    n = None if counts is None else np.asarray(counts, np.int64)
    path, length, nxt = (to_numpy(a) for a in impl.verify_greedy(tok, par, x, n=n))
    assert path.shape == (B, T) and length.shape == (B,) and nxt.shape == (B,)
    for b in range(B):
        c = T if counts is None else int(counts[b])
        want_path, want_next = impl.verify_greedy(tok[b, :c], par[b, :c], x[b, :c])
        want_path = to_numpy(want_path)
        assert length[b] == len(want_path) and nxt[b] == want_next
        assert path[b, : length[b]].tolist() == want_path.tolist()
        assert (path[b, length[b]:] == -1).all()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_sample_batch_equals_its_rows_with_per_row_seeds(impl, seed, setting):
    temperature, top_k, top_p = setting
    rng = np.random.default_rng(10 + seed)
    B, T, V = 4, 7, 25
    counts = rng.integers(1, T + 1, B)
    tok, par, x = _batch(rng, B, T, V, counts)
    seeds = rng.integers(0, 2**62, B).astype(np.int64)
    offsets = rng.integers(0, 1000, B).astype(np.int64)
    start = offsets.copy()
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    path, length, nxt, draws = (to_numpy(a) for a in impl.verify_sample(
        tok, par, x, n=counts.astype(np.int64), seed=seeds, offset=offsets, advance_offset=True, **kw))
    for b in range(B):
        c = int(counts[b])
        wp, wn, wd = impl.verify_sample(tok[b, :c], par[b, :c], x[b, :c], seed=int(seeds[b]), offset=int(start[b]),
                                        **kw)
        assert path[b, : length[b]].tolist() == to_numpy(wp).tolist() and (path[b, length[b]:] == -1).all()
        assert (nxt[b], draws[b]) == (wn, wd)
    assert (offsets == start + draws).all()        # each row advanced by its own draws


def test_sample_batch_with_one_seed_for_every_row(impl):
    rng = np.random.default_rng(5)
    tok, par, x = _batch(rng, 3, 6, 20)
    path, length, nxt, draws = (to_numpy(a) for a in impl.verify_sample(tok, par, x, temperature=1.0, seed=9,
                                                                           offset=4))
    for b in range(3):
        wp, wn, wd = impl.verify_sample(tok[b], par[b], x[b], temperature=1.0, seed=9, offset=4)
        assert path[b, : length[b]].tolist() == to_numpy(wp).tolist() and (nxt[b], draws[b]) == (wn, wd)


def test_a_batch_of_zero_rows(impl):
    tok = np.zeros((0, 4), np.int64)
    path, length, nxt = (to_numpy(a) for a in impl.verify_greedy(tok, tok.copy(), np.zeros((0, 4, 8), np.float32)))
    assert path.shape == (0, 4) and length.shape == (0,) and nxt.shape == (0,)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(n=np.array([3, 9], np.int64)), ValueError, r"verify_greedy: argument 'n' expected"),
    (dict(n=np.array([3], np.int64)), ValueError, r"verify_greedy: argument 'n' expected .*one node count per batch row|verify_greedy: argument 'n' expected shape"),
    (dict(n=np.array([3, 2], np.int32)), TypeError, r"verify_greedy: argument 'n' expected .*int64"),
])
def test_bad_batched_greedy_input(impl, kw, exc, match):
    rng = np.random.default_rng(0)
    tok, par, x = _batch(rng, 2, 5, 10)
    with pytest.raises(exc, match=match):
        impl.verify_greedy(tok, par, x, **kw)


def test_bad_batched_shapes_and_seeds(impl):
    rng = np.random.default_rng(1)
    tok, par, x = _batch(rng, 2, 5, 10)
    with pytest.raises(ValueError, match=r"verify_greedy: argument 'target_logits' expected"):
        impl.verify_greedy(tok, par, x[0])
    with pytest.raises(ValueError, match=r"verify_greedy: argument 'tree_parents' expected"):
        impl.verify_greedy(tok, par[:, :4], x)
    with pytest.raises(ValueError, match=r"verify_sample: argument 'seed' expected"):
        impl.verify_sample(tok, par, x, temperature=1.0, seed=np.arange(3, dtype=np.int64), offset=0)
    with pytest.raises(ValueError, match=r"verify_sample: argument 'advance_offset' expected False"):
        impl.verify_sample(tok, par, x, temperature=1.0, seed=1, offset=0, advance_offset=True)
    with pytest.raises(ValueError, match=r"verify_greedy: argument 'n' expected None for an unbatched tree"):
        impl.verify_greedy(tok[0], par[0], x[0], n=np.array([5], np.int64))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_topk_entropy_batch_equals_its_rows(impl, seed, dtype):
    """topk_entropy over logits [batch, N, V] -> float32 [batch, N]: row b is the unbatched call on logits[b]."""
    rng = np.random.default_rng(20 + seed)
    B, N, V = 4, 3, 60
    x = (rng.normal(0, 2, (B, N, V)) + (rng.integers(0, 3, (B, N, V)) if seed == 2 else 0)).astype(dtype)  # ties
    x[1, 2, ::3] = -np.inf
    for k, temperature in ((1, 1.0), (7, 0.6), (V, 1.0)):
        out = to_numpy(impl.topk_entropy(x, k, temperature))
        assert out.shape == (B, N) and out.dtype == np.float32
        for b in range(B):
            assert np.array_equal(out[b], to_numpy(impl.topk_entropy(x[b], k, temperature)))
    assert to_numpy(impl.topk_entropy(np.zeros((0, 3, V), np.float32), 2)).shape == (0, 3)
    assert to_numpy(impl.topk_entropy(np.zeros((2, 0, V), np.float32), 2)).shape == (2, 0)


def test_bad_batched_topk_entropy(impl):
    x = np.zeros((2, 3, 10), np.float32)
    with pytest.raises(ValueError, match=r"topk_entropy: argument 'k' expected .*10.*got 11"):
        impl.topk_entropy(x, 11)
    x[1, 2, 4] = np.nan   # row 1 * 3 + 2 of the rows taken as one [batch * N, V] matrix
    with pytest.raises(ValueError, match=r"topk_entropy: argument 'logits' expected .*\b5\b.*\b4\b"):
        impl.topk_entropy(x, 2)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_d2t", [False, True])
def test_expand_batch_equals_its_rows(impl, seed, with_d2t):
    rng = np.random.default_rng(30 + seed)
    nb, B, Vd, k = 4, 3, 50, 4
    x = rng.normal(0, 2, (nb, B, Vd)).astype(np.float32)
    scores = rng.normal(-3, 1, (nb, B)).astype(np.float32)
    nodes = rng.integers(-1, 20, (nb, B)).astype(np.int64)
    d2t = np.sort(rng.integers(0, 5, Vd)).astype(np.int64) if with_d2t else None
    out = [to_numpy(a) for a in impl.expand(x, scores, nodes, k, d2t, 7)]
    shapes = [(nb, B * k), (nb, B * k), (nb, B * k), (nb, B), (nb, k)]
    assert [a.shape for a in out] == shapes
    for b in range(nb):
        want = [to_numpy(a) for a in impl.expand(x[b], scores[b], nodes[b], k, d2t, 7)]
        for got, w in zip(out, want):
            assert np.array_equal(got[b], w)


def test_bad_batched_expand(impl):
    x = np.zeros((2, 3, 10), np.float32)
    with pytest.raises(ValueError, match=r"expand: argument 'beam_scores' expected"):
        impl.expand(x, np.zeros(3, np.float32), np.zeros((2, 3), np.int64), 2)
    with pytest.raises(ValueError, match=r"expand: argument 'beam_nodes' expected"):
        impl.expand(x, np.zeros((2, 3), np.float32), np.zeros((3, 3), np.int64), 2)


@pytest.mark.parametrize("seed", range(3))
def test_select_batch_equals_its_rows(impl, seed):
    rng = np.random.default_rng(40 + seed)
    x = rng.integers(-5, 5, (5, 30)).astype(np.float32)      # ties: the lower index wins in every row
    out = to_numpy(impl.select(x, 7))
    assert out.shape == (5, 7)
    for b in range(5):
        assert out[b].tolist() == to_numpy(impl.select(x[b], 7)).tolist()
    assert to_numpy(impl.select(np.zeros((0, 4), np.float32), 2)).shape == (0, 2)
    with pytest.raises(ValueError, match=r"select: argument 'n' expected .*30.*got 31"):
        impl.select(x, 31)


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


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_row_root", [False, True])
def test_build_tree_batch_equals_its_rows(impl, seed, per_row_root):
    """build_tree over [batch, M] candidates with per-row selection sizes (0 included) and roots: row b is the
    unbatched call (device_outputs form) on its first n[b] entries, padded past n[b]+1 with -1 / False."""
    rng = np.random.default_rng(70 + seed)
    B, M, N = 5, 12, 8
    counts = rng.integers(0, N + 1, B).astype(np.int64)
    tok, par, sel = _candidate_batch(rng, B, M, N, counts)
    roots = rng.integers(0, 50, B).astype(np.int64) if per_row_root else 3
    tree, leaves, depth = impl.build_tree(tok, par, sel, roots, n=counts)
    fields = [to_numpy(a) for a in tree]
    assert [f.shape for f in fields] == [(B, N + 1)] * 3 + [(B, N + 1, N + 1)] * 2
    leaves, depth = to_numpy(leaves), to_numpy(depth)
    for b in range(B):
        c = int(counts[b])
        want, wl, wd = impl.build_tree(tok[b], par[b], sel[b, :c], int(roots[b]) if per_row_root else 3,
                                       device_outputs=True)
        for name, got, w in zip(tree._fields, fields, (to_numpy(a) for a in want)):
            if name in ("mask", "retrieve"):
                np.testing.assert_array_equal(got[b, : c + 1, : c + 1], w, err_msg=name)
                assert (got[b, c + 1:] == (False if name == "mask" else -1)).all()
            else:
                np.testing.assert_array_equal(got[b, : c + 1], w, err_msg=name)
                assert (got[b, c + 1:] == -1).all()
        assert (leaves[b], depth[b]) == (int(to_numpy(wl)), int(to_numpy(wd)))
    # without n: every row's N entries (all valid here)
    full = np.tile(np.arange(N, dtype=np.int64), (2, 1))
    chain = np.tile(np.array([-1] + list(range(M - 1)), np.int64), (2, 1))
    t2, l2, d2 = impl.build_tree(tok[:2], chain, full, 1)
    assert to_numpy(d2).tolist() == [N, N] and to_numpy(l2).tolist() == [1, 1]
    assert to_numpy(t2.retrieve)[0, 0].tolist() == list(range(N + 1))


def test_bad_batched_build_tree(impl):
    tok = np.zeros((2, 5), np.int64)
    par = np.array([[-1, 0, 1, 2, 3]] * 2, np.int64)
    sel = np.array([[0, 1], [0, 1]], np.int64)
    with pytest.raises(ValueError, match=r"build_tree: argument 'n' expected selection sizes in \[0, 2\], got 3"):
        impl.build_tree(tok, par, sel, 1, n=np.array([1, 3], np.int64))
    with pytest.raises(TypeError, match=r"build_tree: argument 'n' expected dtype int64"):
        impl.build_tree(tok, par, sel, 1, n=np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match=r"build_tree: argument 'root_token' expected (a token id >= 0|an int in \[0, inf\])"):
        impl.build_tree(tok, par, sel, np.array([1, -4], np.int64))
    with pytest.raises(ValueError, match=r"build_tree: argument 'root_token' expected .*\(2,\)|build_tree: argument 'root_token' expected.*one root token per batch row"):
        impl.build_tree(tok, par, sel, np.array([1, 2, 3], np.int64))
    with pytest.raises(ValueError, match=r"build_tree: argument 'parents' expected"):
        impl.build_tree(tok, par[:1], sel, 1)
    with pytest.raises(ValueError, match=r"build_tree: argument 'n' expected None for an unbatched tree"):
        impl.build_tree(tok[0], par[0], sel[0], 1, n=np.array([1], np.int64))
    with pytest.raises(ValueError, match=r"build_tree: argument 'selected' expected a parent-closed"):
        impl.build_tree(tok, par, np.array([[0, 1], [0, 2]], np.int64), 1)


@pytest.mark.parametrize("seed", range(3))
def test_select_with_per_row_sizes_equals_its_rows(impl, seed):
    """select over [batch, M] with per-row counts n and candidate counts m (ragged candidate lists): row b is
    the unbatched call on scores[b, :m[b]], padded with -1 to the output width."""
    rng = np.random.default_rng(90 + seed)
    B, M = 6, 40
    x = rng.integers(-4, 4, (B, M)).astype(np.float64)       # ties
    m = rng.integers(0, M + 1, B).astype(np.int64)
    n = np.array([int(rng.integers(0, c + 1)) for c in m], np.int64)
    for kw, width in ((dict(n=n, m=m), M), (dict(n=n, m=m, width=int(n.max())), int(n.max())), (dict(n=n), M)):
        mm = kw.get("m", np.full(B, M, np.int64))
        out = to_numpy(impl.select(x, **kw))
        assert out.shape == (B, width)
        for b in range(B):
            c = int(n[b])
            assert out[b, :c].tolist() == to_numpy(impl.select(x[b, : mm[b]], c)).tolist()
            assert (out[b, c:] == -1).all()
    same = to_numpy(impl.select(x, 3, m=np.full(B, 10, np.int64)))
    assert same.shape == (B, 3) and same.tolist() == to_numpy(impl.select(np.ascontiguousarray(x[:, :10]), 3)).tolist()


def test_bad_per_row_select(impl):
    x = np.zeros((2, 5))
    with pytest.raises(ValueError, match=r"select: argument 'n' expected 0 <= n\[b\] <= min\(m\[b\], width\) = 2, got 3 at row 1"):
        impl.select(x, np.array([1, 3], np.int64), m=np.array([5, 2], np.int64))
    with pytest.raises(ValueError, match=r"select: argument 'm' expected candidate counts in \[0, 5\], got 6"):
        impl.select(x, np.array([1, 1], np.int64), m=np.array([6, 2], np.int64))
    with pytest.raises(ValueError, match=r"select: argument 'width' expected n = 2 for an int n"):
        impl.select(x, 2, width=4)
    with pytest.raises(TypeError, match=r"select: argument 'n' expected .*int64"):
        impl.select(x, np.array([1, 1], np.int32))
    with pytest.raises(ValueError, match=r"select: argument 'n' expected an int for unbatched scores"):
        impl.select(x[0], np.array([1], np.int64))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("per_row_prefix", [False, True])
def test_kv_compact_batch_equals_its_rows(impl, seed, per_row_prefix):
    """kv_compact with slots [batch, m] (rows -1-padded differently) on [batch, ..., S, D] tensors: request b of
    every tensor ends as the unbatched call with slots[b] and prefix_len[b] leaves it."""
    rng = np.random.default_rng(110 + seed)
    B, S, m = 4, 24, 6
    prefixes = rng.integers(0, 8, B).astype(np.int64) if per_row_prefix else 5
    slots = np.full((B, m), -1, np.int64)
    for b in range(B):
        k = int(rng.integers(0, m + 1))
        slots[b, :k] = np.sort(rng.choice(10, k, replace=False))     # distinct, ascending: slots[i] >= i
    kv = [rng.normal(size=(B, 2, S, 4)).astype(np.float32), rng.normal(size=(B, S, 3)).astype(np.float16)]
    want = [a.copy() for a in kv]
    for b in range(B):
        p = int(prefixes[b]) if per_row_prefix else 5
        rows = [w[b] for w in want]
        impl.kv_compact(rows, p, slots[b])
        for w, r in zip(want, rows):
            w[b] = r
    impl.kv_compact(kv, prefixes, slots)
    for got, w in zip(kv, want):
        np.testing.assert_array_equal(got, w)


def test_bad_batched_kv_compact(impl):
    kv = [np.zeros((2, 10, 4), np.float32)]
    good = np.array([[0, 2], [1, -1]], np.int64)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected strictly ascending"):
        impl.kv_compact(kv, 1, np.array([[0, 2], [3, 3]], np.int64))
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected prefix_len \+ slot"
                                         r"|kv_compact: argument 'slots' expected prefix_len \+ slots\[-1\]"):
        impl.kv_compact(kv, np.array([1, 9], np.int64), good)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'prefix_len' expected"):
        impl.kv_compact(kv, np.array([1, 2, 3], np.int64), good)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'prefix_len' expected >= 0"):
        impl.kv_compact(kv, np.array([1, -2], np.int64), good)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'tensors\[0\]' expected an array \[batch = 3"):
        impl.kv_compact(kv, 1, np.zeros((3, 2), np.int64))
    before = kv[0].copy()
    with pytest.raises(ValueError):           # request 1 is bad: request 0 must not have moved either
        impl.kv_compact(kv, 1, np.array([[1, 2], [5, 4]], np.int64))
    np.testing.assert_array_equal(kv[0], before)
