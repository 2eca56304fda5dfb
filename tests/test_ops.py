"""Every op against independent brute-force expectations, for both implementations (fixture `impl`)."""
import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from _oracles import (
    PHILOX_KATS,
    argmax_loop,
    greedy_brute,
    parent_closure,
    philox,
    random_forest,
    random_tree,
    sample_walk,
    tree_oracle,
    uniform,
)
from conftest import to_numpy

SIZES = (1, 7, 111, 32000, 49152, 128256)
TOL = dict(rtol=1e-6, atol=1e-6)


def rows_for(v):
    return 3 if v <= 1000 else 2


def entropy_oracle(row, k, temperature=1.0):
    """scipy on the k largest values (sorted), float64."""
    top = np.sort(np.asarray(row, np.float32).astype(np.float64))[::-1][:k]
    return scipy.stats.entropy(scipy.special.softmax(top / temperature))


def k_values(v):
    return sorted({1, max(1, v // 3), v})


# ---------------------------------------------------------------------------------------------- philox


@pytest.mark.parametrize("kat", range(len(PHILOX_KATS)))
def test_philox_kat(impl, kat):
    counter, key, expected = PHILOX_KATS[kat]
    assert philox(counter, key) == expected  # the test's own oracle first
    out = impl.philox4x32(counter, key)
    assert tuple(out) == expected
    assert all(type(x) is int for x in out)


@pytest.mark.parametrize(
    "seed,offset",
    [(0, 0), (1, 12345), (2**32 + 7, 2**32 - 2), (2**64 - 1, 2**64 - 3), (0xDEADBEEFCAFEF00D, 2**63)],
)
def test_philox_uniform_matches_block(impl, seed, offset):
    n = 6
    u = impl.philox_uniform(n, seed=seed, offset=offset)
    assert isinstance(u, np.ndarray) and u.dtype == np.float64 and u.shape == (n,)
    for j in range(n):
        c = (offset + j) % 2**64  # wraps around 2^64
        x0 = impl.philox4x32((c & 0xFFFFFFFF, c >> 32, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))[0]
        assert u[j] == x0 * 2.0**-32
        assert u[j] == uniform(seed, offset, j)
    assert np.all((u >= 0) & (u < 1))


def test_philox_uniform_offsets_and_empty(impl):
    a = impl.philox_uniform(10, seed=42, offset=100)
    b = impl.philox_uniform(4, seed=42, offset=106)
    np.testing.assert_array_equal(a[6:], b)
    assert not np.array_equal(a, impl.philox_uniform(10, seed=43, offset=100))
    e = impl.philox_uniform(0, seed=1, offset=0)
    assert isinstance(e, np.ndarray) and e.dtype == np.float64 and e.shape == (0,)
    big = impl.philox_uniform(20000, seed=7, offset=0)
    # sanity of the distribution: mean 1/2, KS test against U(0, 1)
    assert abs(big.mean() - 0.5) < 0.01
    assert scipy.stats.kstest(big, "uniform").pvalue > 1e-4


# ---------------------------------------------------------------------------------------------- topk_entropy


@pytest.mark.parametrize("v", SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_topk_entropy_sizes(impl, v, dtype):
    rng = np.random.default_rng(v)
    x = (rng.normal(size=(rows_for(v), v)) * 2).astype(dtype)
    for k in k_values(v):
        for temperature in (1.0, 0.6):
            h = to_numpy(impl.topk_entropy(x, k, temperature))
            assert h.dtype == np.float32 and h.shape == (x.shape[0],)
            want = [entropy_oracle(row, k, temperature) for row in x]
            np.testing.assert_allclose(h, want, **TOL)
            if k == 1:
                assert np.all(h == 0)


def test_topk_entropy_default_temperature_uniform_and_ties(impl):
    x = np.zeros((2, 9), np.float32)
    x[1, :4] = 3.0  # four tied maxima
    h = to_numpy(impl.topk_entropy(x, 4))
    np.testing.assert_allclose(h, [math.log(4), math.log(4)], **TOL)
    h = to_numpy(impl.topk_entropy(x, 9, temperature=2.0))
    np.testing.assert_allclose(h[0], math.log(9), **TOL)
    np.testing.assert_allclose(h[1], entropy_oracle(x[1], 9, 2.0), **TOL)


def test_topk_entropy_neg_inf(impl):
    x = np.full((3, 7), -np.inf, np.float32)
    x[0, 3] = 1.0  # a single finite value: H = 0 for every k
    x[1, [1, 5]] = [0.5, -0.25]
    x[2] = [0.1, -np.inf, 2.0, -1.0, -np.inf, 0.0, 0.3]
    for k in (1, 2, 5, 7):
        h = to_numpy(impl.topk_entropy(x, k))
        assert h[0] == 0
        want1 = scipy.stats.entropy(scipy.special.softmax([0.5, -0.25])) if k >= 2 else 0.0
        np.testing.assert_allclose(h[1], want1, **TOL)
        np.testing.assert_allclose(h[2], entropy_oracle(x[2], k), **TOL)
        assert np.all(np.isfinite(h))


def test_topk_entropy_empty_batch(impl):
    h = to_numpy(impl.topk_entropy(np.zeros((0, 5), np.float32), 2))
    assert h.shape == (0,) and h.dtype == np.float32


def test_topk_entropy_torch_inputs(impl):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 50)).astype(np.float32)
    want = [entropy_oracle(r, 10) for r in x]
    for t in (torch.from_numpy(x), torch.from_numpy(x.astype(np.float16))):
        out = impl.topk_entropy(t, 10)
        if impl.__name__.endswith("reference"):
            assert isinstance(out, np.ndarray)
        else:
            assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
        ref16 = [entropy_oracle(r, 10) for r in t.numpy()]
        np.testing.assert_allclose(to_numpy(out), ref16, **TOL)
    np.testing.assert_allclose(to_numpy(impl.topk_entropy(torch.from_numpy(x), 10)), want, **TOL)


def test_topk_entropy_bfloat16(impl):
    rng = np.random.default_rng(4)
    t = torch.from_numpy(rng.normal(size=(3, 40)).astype(np.float32)).to(torch.bfloat16)
    if impl.__name__.endswith("reference"):
        with pytest.raises(TypeError, match=r"argument 'logits'"):
            impl.topk_entropy(t, 5)
    else:
        want = [entropy_oracle(r, 5) for r in t.float().numpy()]
        np.testing.assert_allclose(to_numpy(impl.topk_entropy(t, 5)), want, **TOL)


# ---------------------------------------------------------------------------------------------- expand


def expand_oracle(x, beam_scores, beam_nodes, k, d2t=None, node_offset=0):
    x64 = np.asarray(x, np.float32).astype(np.float64)
    b, v = x64.shape
    toks, scs, pars, ents = [], [], [], []
    for r in range(b):
        lp = scipy.special.log_softmax(x64[r])
        ids = np.lexsort((np.arange(v), -x64[r]))[:k]  # by value descending, then id ascending
        toks += [int(i) + (int(d2t[i]) if d2t is not None else 0) for i in ids]
        scs += [float(beam_scores[r]) + lp[i] for i in ids]
        pars += [int(beam_nodes[r])] * k
        ents.append(entropy_oracle(x64[r], k))
    return np.array(toks, np.int64), np.array(scs), np.array(pars, np.int64), np.array(ents)


def next_beams_oracle(scores32, k, node_offset):
    order = sorted(range(len(scores32)), key=lambda i: (-float(scores32[i]), i))[:k]
    return np.array([node_offset + i for i in order], np.int64)


def check_expand(impl, x, bs, bn, k, d2t=None, node_offset=0):
    kwargs = {} if d2t is None else {"d2t": d2t}
    out = impl.expand(x, bs, bn, k, node_offset=node_offset, **kwargs)
    tokens, scores, parents, entropy, next_beams = map(to_numpy, out)
    b = x.shape[0]
    assert tokens.dtype == np.int64 and tokens.shape == (b * k,)
    assert scores.dtype == np.float32 and scores.shape == (b * k,)
    assert parents.dtype == np.int64 and parents.shape == (b * k,)
    assert entropy.dtype == np.float32 and entropy.shape == (b,)
    assert next_beams.dtype == np.int64 and next_beams.shape == (k,)
    w_tok, w_sc, w_par, w_ent = expand_oracle(x, bs, bn, k, d2t, node_offset)
    np.testing.assert_array_equal(tokens, w_tok)
    np.testing.assert_allclose(scores, w_sc, **TOL)
    np.testing.assert_array_equal(parents, w_par)
    np.testing.assert_allclose(entropy, w_ent, **TOL)
    np.testing.assert_array_equal(next_beams, next_beams_oracle(scores, k, node_offset))
    return tokens, scores, parents, entropy, next_beams


@pytest.mark.parametrize("v", SIZES)
def test_expand_sizes(impl, v):
    rng = np.random.default_rng(1000 + v)
    b = rows_for(v)
    x = (rng.normal(size=(b, v)) * 3).astype(np.float32)
    bs = -rng.random(b).astype(np.float64) * 5
    bn = np.arange(b, dtype=np.int64) + 4
    for k in k_values(v):
        check_expand(impl, x, bs, bn, k, node_offset=11)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("score_dtype", [np.float32, np.float64])
def test_expand_dtypes_d2t(impl, id_dtype, score_dtype):
    rng = np.random.default_rng(7)
    b, vd = 3, 111
    x = rng.normal(size=(b, vd)).astype(np.float16)  # float16 logits (many ties)
    bs = (-rng.random(b) * 3).astype(score_dtype)
    bn = np.array([-1, 0, 5], id_dtype)
    d2t = rng.integers(0, 500, size=vd).astype(id_dtype)  # EAGLE-3 draft->target offsets
    for k in (1, 4, vd):
        tokens, *_ = check_expand(impl, x, bs, bn, k, d2t=d2t, node_offset=3)
        assert tokens.min() >= 0


def test_expand_root_level(impl):
    rng = np.random.default_rng(8)
    x = rng.normal(size=(1, 7)).astype(np.float32)
    tokens, scores, parents, entropy, next_beams = check_expand(
        impl, x, np.zeros(1), np.array([-1]), 3
    )
    np.testing.assert_array_equal(parents, [-1, -1, -1])
    np.testing.assert_array_equal(next_beams, [0, 1, 2])  # root level: candidates are already sorted
    assert np.all(np.diff(scores) <= 0) and np.all(scores <= 0)


def test_expand_ties_and_neg_inf(impl):
    x = np.array(
        [
            [1.0, 2.0, 2.0, -np.inf, 1.0, 2.0],
            [1.0, 2.0, 2.0, -np.inf, 1.0, 2.0],  # identical row: equal scores across beams
            [-np.inf, 0.0, -np.inf, -np.inf, -np.inf, -np.inf],  # one finite token
        ],
        np.float32,
    )
    bs = np.array([-1.0, -1.0, -np.inf], np.float32)  # -inf beam scores are allowed
    bn = np.array([0, 1, 2])
    tokens, scores, parents, entropy, next_beams = check_expand(impl, x, bs, bn, 6, node_offset=100)
    np.testing.assert_array_equal(tokens[:6], [1, 2, 5, 0, 4, 3])  # ties to the lower id
    np.testing.assert_array_equal(tokens[12:], [1, 0, 2, 3, 4, 5])  # -inf entries in ascending id
    assert scores[5] == -np.inf and np.all(scores[12:] == -np.inf)
    # equal float32 scores across rows: ties to the lower node number
    np.testing.assert_array_equal(next_beams, [100, 101, 102, 106, 107, 108])
    x[:2, 2] = 1.5  # rows 0/1: top-2 are ids 1 (2.0) and 5 (2.0); then row 1's copies tie with row 0's
    tokens, scores, _, _, next_beams = check_expand(impl, x, bs, bn, 3)
    np.testing.assert_array_equal(tokens[:3], [1, 5, 2])
    np.testing.assert_array_equal(next_beams, [0, 1, 3])
    assert entropy[2] == 0


def test_expand_eagle_cycle(impl):
    """Root expand (B=1) then levels with continuing node numbers -> select -> build_tree."""
    rng = np.random.default_rng(11)
    vd, k, levels, n_sel, root_token = 37, 4, 4, 12, 9
    d2t = rng.integers(0, 3, size=vd)
    x = rng.normal(size=(1, vd)).astype(np.float32) * 2
    beam_scores, beam_nodes = np.zeros(1), np.array([-1])
    all_tok, all_sc, all_par = [], [], []
    offset = 0
    for level in range(levels):
        tok, sc, par, ent, nb = check_expand(impl, x, beam_scores, beam_nodes, k, d2t=d2t, node_offset=offset)
        all_tok.append(tok)
        all_sc.append(sc)
        all_par.append(par)
        offset += len(tok)
        flat_sc = np.concatenate(all_sc)
        assert np.all((nb >= offset - len(tok)) & (nb < offset))
        beam_nodes, beam_scores = nb, flat_sc[nb].astype(np.float32)
        x = (rng.normal(size=(k, vd)) * 2).astype(np.float32)
    tokens, scores, parents = map(np.concatenate, (all_tok, all_sc, all_par))
    assert len(tokens) == k + (levels - 1) * k * k
    # children score no more than their parent (lp <= 0)
    for m, p in enumerate(parents):
        assert p < m
        if p >= 0:
            assert scores[m] <= scores[p]
    sel = to_numpy(impl.select(scores, n_sel))
    np.testing.assert_array_equal(sel, sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n_sel]))
    chosen = set(sel.tolist())
    assert all(parents[s] == -1 or parents[s] in chosen for s in chosen)  # parent-closed
    tree = impl.build_tree(tokens, parents, sel, root_token)
    check_tree(tree, tree_oracle(tokens, parents, sel, root_token))


# ---------------------------------------------------------------------------------------------- select


def select_oracle(scores, n):
    return sorted(sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:n])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_select(impl, dtype):
    rng = np.random.default_rng(21)
    for m in (1, 2, 7, 60, 111):
        s = rng.integers(-3, 3, size=m).astype(dtype)  # many ties
        s[rng.random(m) < 0.1] = -np.inf
        s[rng.random(m) < 0.05] = np.inf
        for n in sorted({0, 1, m // 2, m - 1, m}):
            out = to_numpy(impl.select(s, n))
            assert out.dtype == np.int64 and out.shape == (n,)
            np.testing.assert_array_equal(out, select_oracle(s, n))


def test_select_large_and_empty(impl):
    rng = np.random.default_rng(22)
    s = rng.normal(size=32000).astype(np.float32)
    out = to_numpy(impl.select(s, 64))
    np.testing.assert_array_equal(out, np.sort(np.argsort(-s, kind="stable")[:64]))
    out = to_numpy(impl.select(np.zeros(0, np.float64), 0))
    assert out.shape == (0,) and out.dtype == np.int64


# ---------------------------------------------------------------------------------------------- build_tree


def check_tree(tree, want):
    assert tuple(tree._fields) == ("tokens", "parents", "depths", "mask", "retrieve")
    for name in ("tokens", "parents", "depths", "retrieve"):
        got = to_numpy(getattr(tree, name))
        assert got.dtype == np.int64, name
        np.testing.assert_array_equal(got, want[name], err_msg=name)
    mask = to_numpy(tree.mask)
    assert mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, want["mask"])


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_build_tree_random(impl, id_dtype):
    rng = np.random.default_rng(31)
    for trial in range(40):
        m = int(rng.integers(1, 60))
        parents = random_forest(rng, m)
        tokens = rng.integers(0, 1000, size=m)
        picks = rng.choice(m, size=int(rng.integers(0, m + 1)), replace=False)
        sel = parent_closure(parents, picks)
        root = int(rng.integers(0, 1000))
        tree = impl.build_tree(tokens.astype(id_dtype), parents.astype(id_dtype), sel.astype(id_dtype), root)
        check_tree(tree, tree_oracle(tokens, parents, sel, root))


def test_build_tree_empty_and_chain(impl):
    tokens = np.array([5, 6, 7], np.int64)
    parents = np.array([-1, 0, 1], np.int64)
    tree = impl.build_tree(tokens, parents, np.zeros(0, np.int64), 3)
    check_tree(
        tree,
        dict(tokens=[3], parents=[-1], depths=[0], mask=np.ones((1, 1), bool), retrieve=np.array([[0]])),
    )
    tree = impl.build_tree(tokens, parents, np.array([0, 1, 2]), 0)
    check_tree(
        tree,
        dict(
            tokens=[0, 5, 6, 7],
            parents=[-1, 0, 1, 2],
            depths=[0, 1, 2, 3],
            mask=np.tril(np.ones((4, 4), bool)),
            retrieve=np.array([[0, 1, 2, 3]]),
        ),
    )


def test_build_tree_retrieve_padding(impl):
    # candidates: 0,1 roots; 2 child of 0; 3 child of 2; 4 child of 1
    tokens = np.array([10, 11, 12, 13, 14])
    parents = np.array([-1, -1, 0, 2, 1])
    tree = impl.build_tree(tokens, parents, np.array([0, 1, 2, 3, 4]), 1)
    want = tree_oracle(tokens, parents, [0, 1, 2, 3, 4], 1)
    check_tree(tree, want)
    np.testing.assert_array_equal(to_numpy(tree.retrieve), [[0, 1, 3, 4], [0, 2, 5, -1]])


# ---------------------------------------------------------------------------------------------- verify_greedy


@pytest.mark.parametrize("v", (1, 7, 111))
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_verify_greedy_random_trees(impl, v, id_dtype):
    rng = np.random.default_rng(41 + v)
    for trial in range(60):
        n = int(rng.integers(1, 25))
        x = rng.integers(-2, 3, size=(n, v)).astype(np.float32)  # small ints: many argmax ties
        x[rng.random((n, v)) < 0.1] = -np.inf
        x[:, 0] = np.where(np.isinf(x).all(axis=1), 0.0, x[:, 0])
        tokens, parents, _ = random_tree(rng, n, v, logits=x)
        path, nxt = impl.verify_greedy(tokens.astype(id_dtype), parents.astype(id_dtype), x)
        want_path, want_next = greedy_brute(tokens, parents, x)
        path = to_numpy(path)
        assert path.dtype == np.int64
        np.testing.assert_array_equal(path, want_path)
        assert type(nxt) is int and nxt == want_next


@pytest.mark.parametrize("v", (32000, 128256))
def test_verify_greedy_large_vocab_float16(impl, v):
    rng = np.random.default_rng(v)
    x = rng.normal(size=(4, v)).astype(np.float16)
    top = [int(np.argmax(r)) for r in x]  # float16 ties resolved to the lower id by np.argmax
    tokens = np.array([0, top[0], top[1], 5])
    parents = np.array([-1, 0, 1, 0])
    path, nxt = impl.verify_greedy(tokens, parents, x)
    np.testing.assert_array_equal(to_numpy(path), [0, 1, 2])
    assert nxt == argmax_loop(x[2]) == top[2]


def test_verify_greedy_duplicate_children_and_unvisited_nan(impl):
    x = np.zeros((5, 4), np.float32)
    x[0, 2] = 1.0
    x[1, 3] = 1.0
    x[2, 1] = 1.0
    x[3] = np.nan  # never visited: not checked
    tokens = np.array([0, 2, 2, 1, 3])
    parents = np.array([-1, 0, 0, 2, 1])
    path, nxt = impl.verify_greedy(tokens, parents, x)
    np.testing.assert_array_equal(to_numpy(path), [0, 1, 4])  # lowest-index child among duplicates
    assert nxt == 0  # row 4 all zeros: ties to the lower id


# ---------------------------------------------------------------------------------------------- verify_sample

SAMPLE_SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.8), (0.8, 4, 0.9), (2.0, 100, 0.5)]


@pytest.mark.parametrize("setting", SAMPLE_SETTINGS, ids=lambda s: "T%s-k%s-p%s" % s)
def test_verify_sample_matches_walk(impl, setting):
    temperature, top_k, top_p = setting
    rng = np.random.default_rng(51)
    for trial in range(40):
        v = int(rng.choice([1, 5, 7, 111]))
        n = int(rng.integers(1, 12))
        x = (rng.normal(size=(n, v)) * 1.5).astype(rng.choice([np.float32, np.float16]))
        if v > 1:
            x[rng.random((n, v)) < 0.1] = -np.inf
            x[:, 0] = np.where(np.isinf(x).all(axis=1), 1.0, x[:, 0])
        tokens, parents, _ = random_tree(rng, n, v, p_greedy=0.7, logits=x)
        for s in range(5):
            seed = int(rng.integers(0, 2**63)) * 2 + s % 2
            offset = int(rng.integers(0, 2**64 - 64, dtype=np.uint64)) if s % 2 else int(rng.integers(0, 1000))
            path, nxt, draws = impl.verify_sample(
                tokens, parents, x, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset
            )
            w_path, w_next, w_draws = sample_walk(tokens, parents, x, temperature, top_k, top_p, seed, offset)
            path = to_numpy(path)
            assert path.dtype == np.int64
            assert path.tolist() == w_path
            assert type(nxt) is int and nxt == w_next
            assert type(draws) is int and draws == w_draws


def test_verify_sample_offset_wraps(impl):
    x = np.zeros((1, 7), np.float32)
    tokens, parents = np.array([0]), np.array([-1])
    _, nxt, draws = impl.verify_sample(tokens, parents, x, temperature=1.0, seed=5, offset=2**64 - 1)
    assert draws == 1
    u = uniform(5, 2**64 - 1, 0)
    assert nxt == int(u * 7)  # uniform row: the bin of u


def test_verify_sample_root_only_and_draw_count(impl):
    rng = np.random.default_rng(52)
    x = rng.normal(size=(1, 5)).astype(np.float32)
    counts = np.zeros(5)
    for seed in range(300):
        path, nxt, draws = impl.verify_sample(np.array([3]), np.array([-1]), x, temperature=1.0, seed=seed, offset=0)
        assert to_numpy(path).tolist() == [0] and draws == 1
        counts[nxt] += 1
    assert counts.sum() == 300 and (counts > 0).sum() >= 3


@pytest.mark.parametrize("mode", ["cold", "top_k1", "top_p_tiny"])
def test_verify_sample_degenerate_is_greedy(impl, mode):
    """With a one-hot warped distribution the walk is deterministic and equals greedy."""
    rng = np.random.default_rng(53)
    kw = dict(cold=dict(temperature=1e-3), top_k1=dict(temperature=1.0, top_k=1),
              top_p_tiny=dict(temperature=1.0, top_p=1e-9))[mode]
    for trial in range(30):
        n, v = int(rng.integers(1, 15)), 6
        x = rng.permuted(np.tile(np.arange(v, dtype=np.float32) * 2, (n, 1)), axis=1)  # distinct, gaps of 2
        tokens, parents, _ = random_tree(rng, n, v, p_greedy=0.6, logits=x)
        want_path, want_next = greedy_brute(tokens, parents, x)
        for seed in range(3):
            path, nxt, draws = impl.verify_sample(tokens, parents, x, seed=seed, offset=7, **kw)
            assert to_numpy(path).tolist() == want_path and nxt == want_next
            assert draws >= len(want_path)


def test_verify_sample_masked_child_never_accepted(impl):
    x = np.zeros((3, 4), np.float32)
    x[0, 1] = -np.inf
    tokens = np.array([0, 1, 1])  # both children carry the masked token; the duplicate costs no draw
    parents = np.array([-1, 0, 0])
    for seed in range(200):
        path, nxt, draws = impl.verify_sample(tokens, parents, x, temperature=0.9, seed=seed, offset=0)
        assert to_numpy(path).tolist() == [0]
        assert nxt != 1
        assert draws == 2  # one draw for child 1, none for its duplicate, one for the bonus token


def test_verify_sample_deterministic(impl):
    rng = np.random.default_rng(54)
    tokens, parents, x = random_tree(rng, 10, 7)
    a = [impl.verify_sample(tokens, parents, x, temperature=1.0, seed=s, offset=3) for s in range(50)]
    b = [impl.verify_sample(tokens, parents, x, temperature=1.0, seed=s, offset=3) for s in range(50)]
    for (p1, n1, d1), (p2, n2, d2) in zip(a, b):
        assert to_numpy(p1).tolist() == to_numpy(p2).tolist() and n1 == n2 and d1 == d2
    assert len({(tuple(to_numpy(p).tolist()), nx) for p, nx, _ in a}) > 1


# ---- verify_sample: seed / offset as 1-element int64 tensors on the CPU (a CUDA-graph engine's CPU emulation
#      keeps the Philox offset in a tensor, as it does on the GPU)

TENSOR_KINDS = ["numpy[1]", "numpy[]", "torch[1]", "torch[]"]


def as_tensor(kind, value):
    """value (an int in [0, 2^64)) as a 1-element int64 tensor of `kind` holding its bits."""
    bits = int(np.array(value, np.uint64).view(np.int64))
    a = np.array([bits] if kind.endswith("[1]") else bits, np.int64)
    return torch.from_numpy(a) if kind.startswith("torch") else a


def tensor_value(t):
    """The uint64 value held by a 1-element int64 tensor."""
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return int(a.reshape(-1).view(np.uint64)[0])


def sample_case(rng):
    n, v = int(rng.integers(1, 12)), int(rng.choice([1, 5, 37]))
    x = (rng.normal(size=(n, v)) * 1.5).astype(np.float32)
    tokens, parents, _ = random_tree(rng, n, v, p_greedy=0.6, logits=x)
    return tokens, parents, x


def same_sample(a, b):
    assert len(a) == len(b)
    assert to_numpy(a[0]).tolist() == to_numpy(b[0]).tolist()
    for p, q in zip(a[1:], b[1:]):
        assert int(p) == int(q)


SEEDS_OFFSETS = [(0, 0), (5, 123), (2**63 + 11, 2**64 - 3), (2**64 - 1, 2**63 - 1), (0xDEADBEEFCAFEF00D, 2**63)]


@pytest.mark.parametrize("kind", TENSOR_KINDS)
def test_verify_sample_tensor_seed_offset_equal_ints(impl, kind):
    rng = np.random.default_rng(55)
    for trial in range(12):
        tokens, parents, x = sample_case(rng)
        for seed, offset in SEEDS_OFFSETS:
            kw = dict(temperature=0.9, top_k=int(rng.integers(0, 4)), top_p=1.0)
            want = impl.verify_sample(tokens, parents, x, seed=seed, offset=offset, **kw)
            assert want[1:] == tuple(sample_walk(tokens, parents, x, 0.9, kw["top_k"], 1.0, seed, offset)[1:])
            s, o = as_tensor(kind, seed), as_tensor(kind, offset)
            same_sample(impl.verify_sample(tokens, parents, x, seed=s, offset=o, **kw), want)
            same_sample(impl.verify_sample(tokens, parents, x, seed=s, offset=offset, **kw), want)
            same_sample(impl.verify_sample(tokens, parents, x, seed=seed, offset=o, **kw), want)
            got = impl.verify_sample(tokens, parents, x, seed=s, offset=o, **kw)
            assert type(got[1]) is int and type(got[2]) is int
            assert (tensor_value(s), tensor_value(o)) == (seed, offset)  # read, never written without advance_offset
    # NumPy integer scalars stay ints (not tensors); a read-only tensor is fine when nothing is written
    ro = np.array([7], np.int64)
    ro.flags.writeable = False
    same_sample(impl.verify_sample(tokens, parents, x, temperature=1.0, seed=np.uint64(2**64 - 1), offset=ro),
                impl.verify_sample(tokens, parents, x, temperature=1.0, seed=2**64 - 1, offset=np.int64(7)))


@pytest.mark.parametrize("kind", TENSOR_KINDS)
def test_verify_sample_advance_offset_tensor(impl, kind):
    """advance_offset=True adds draws to the offset tensor (mod 2^64): two calls in a row equal two calls with
    int offsets o and o + draws1."""
    rng = np.random.default_rng(56)
    for trial in range(15):
        tokens, parents, x = sample_case(rng)
        for seed, o in SEEDS_OFFSETS:
            kw = dict(temperature=1.1, top_p=0.9)
            s, off = as_tensor(kind, seed), as_tensor(kind, o)
            first = impl.verify_sample(tokens, parents, x, seed=s, offset=off, advance_offset=True, **kw)
            want1 = impl.verify_sample(tokens, parents, x, seed=seed, offset=o, **kw)
            same_sample(first, want1)
            assert tensor_value(off) == (o + want1[2]) % 2**64
            second = impl.verify_sample(tokens, parents, x, seed=s, offset=off, advance_offset=True, **kw)
            want2 = impl.verify_sample(tokens, parents, x, seed=seed, offset=(o + want1[2]) % 2**64, **kw)
            same_sample(second, want2)
            assert tensor_value(off) == (o + want1[2] + want2[2]) % 2**64
            assert tensor_value(s) == seed
    # the same tensor as seed and offset: both read before the op, the offset written after it
    t = as_tensor(kind, 40)
    r = impl.verify_sample(tokens, parents, x, temperature=1.0, seed=t, offset=t, advance_offset=True)
    same_sample(r, impl.verify_sample(tokens, parents, x, temperature=1.0, seed=40, offset=40))
    assert tensor_value(t) == 40 + r[2]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_verify_sample_tensor_offset_device_outputs(impl, lib):
    rng = np.random.default_rng(57)
    put = torch.from_numpy if lib == "torch" else (lambda a: a)
    for trial in range(20):
        tokens, parents, x = sample_case(rng)
        seed, o = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**64, dtype=np.uint64))
        s, off = put(np.array([seed], np.int64)), put(np.array(o, np.uint64).view(np.int64).reshape(1))
        got = impl.verify_sample(put(tokens), put(parents), put(x), temperature=0.8, seed=s, offset=off,
                                 device_outputs=True, advance_offset=True)
        want = impl.verify_sample(tokens, parents, x, temperature=0.8, seed=seed, offset=o, device_outputs=True)
        assert len(got) == 4
        for g, w in zip(got, want):
            np.testing.assert_array_equal(to_numpy(g), to_numpy(w))
        assert tensor_value(off) == (o + int(want[3])) % 2**64
        # without advance_offset the tensor is only read
        again = impl.verify_sample(put(tokens), put(parents), put(x), temperature=0.8, seed=s,
                                   offset=put(np.array(o, np.uint64).view(np.int64).reshape(1)), device_outputs=True)
        for g, w in zip(again, want):
            np.testing.assert_array_equal(to_numpy(g), to_numpy(w))


def test_verify_sample_failed_call_leaves_offset_tensor(impl):
    off = np.array([17], np.int64)
    x = np.zeros((3, 5), np.float32)
    x[0, 2] = np.nan
    with pytest.raises(ValueError, match=r"^verify_sample: argument 'target_logits'"):
        impl.verify_sample(np.array([0, 1, 2]), np.array([-1, 0, 0]), x, temperature=1.0, seed=1, offset=off,
                           advance_offset=True)
    with pytest.raises(ValueError, match=r"^verify_sample: argument 'temperature'"):
        impl.verify_sample(np.array([0]), np.array([-1]), x[1:2], temperature=0.0, seed=1, offset=off,
                           advance_offset=True)
    assert off.tolist() == [17]


class FakeCudaInt64:
    """A 1-element int64 DLPack export that claims to live on cuda:0 (its memory is host memory, and must never
    be read)."""

    def __init__(self):
        import ctypes

        from _dlpack import _DELETER, _NAME, _Device, _DType, _ManagedVersioned, _PyCapsule_New, _Version

        self._ctypes, self._name, self._new = ctypes, _NAME, _PyCapsule_New
        self.arr = np.zeros(1, np.int64)
        self.shape = (ctypes.c_int64 * 1)(1)
        self._deleter = _DELETER(lambda _p: None)
        self.m = _ManagedVersioned()
        self.m.version = _Version(1, 0)
        self.m.deleter = self._deleter
        t = self.m.dl_tensor
        t.data = self.arr.ctypes.data
        t.device = _Device(2, 0)
        t.ndim = 1
        t.dtype = _DType(0, 64, 1)
        t.shape = self.shape

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        return self._new(self._ctypes.addressof(self.m), self._name.value, None)


def _read_only(a):
    a = np.array(a, np.int64)
    a.flags.writeable = False
    return a


BAD_SEED_OFFSET = [
    ("float-offset", TypeError, "offset", dict(offset=np.array([1.0]))),
    ("float-seed-torch", TypeError, "seed", dict(seed=torch.zeros(1))),
    ("int32-offset", TypeError, "offset", dict(offset=np.array([3], np.int32))),
    ("uint64-seed", TypeError, "seed", dict(seed=np.array([3], np.uint64))),
    ("two-elements", ValueError, "offset", dict(offset=np.array([1, 2], np.int64))),
    ("two-elements-torch-seed", ValueError, "seed", dict(seed=torch.zeros(2, dtype=torch.int64))),
    ("no-element", ValueError, "offset", dict(offset=np.zeros(0, np.int64))),
    ("advance-int", ValueError, "advance_offset", dict(offset=3, advance_offset=True)),
    ("advance-np-scalar", ValueError, "advance_offset", dict(offset=np.int64(3), advance_offset=True)),
    ("advance-read-only", ValueError, "offset", dict(offset=_read_only([3]), advance_offset=True)),
    ("other-device", ValueError, "offset", dict(offset="cuda")),
    ("other-device-seed", ValueError, "seed", dict(seed="cuda")),
]


@pytest.mark.parametrize("exc,arg,kw", [c[1:] for c in BAD_SEED_OFFSET], ids=[c[0] for c in BAD_SEED_OFFSET])
def test_verify_sample_bad_seed_offset_tensors(impl, exc, arg, kw):
    kw = {k: FakeCudaInt64() if isinstance(v, str) else v for k, v in kw.items()}
    args = dict(temperature=1.0, seed=0, offset=0)
    args.update(kw)
    with pytest.raises(exc, match=rf"^verify_sample: argument '{arg}' expected .+, got .+") as info:
        impl.verify_sample(np.array([0, 1, 2]), np.array([-1, 0, 0]), np.zeros((3, 5), np.float32), **args)
    assert "\n" not in str(info.value)
    for v in kw.values():
        if isinstance(v, np.ndarray) and v.size:
            assert v.reshape(-1)[0] in (1, 3)  # untouched


def test_verify_sample_offset_tensor_chain_c_equals_numpy(c_ops, ref_ops):
    """The C op and the NumPy twin, each advancing its own offset tensor over a chain of calls: identical paths,
    next tokens, draws and offsets."""
    rng = np.random.default_rng(58)
    for chain in range(10):
        seed = int(rng.integers(0, 2**64, dtype=np.uint64))
        o = int(rng.integers(0, 2**64, dtype=np.uint64)) if chain % 2 else int(rng.integers(0, 100))
        oc, on = torch.from_numpy(as_tensor("numpy[1]", o)), as_tensor("numpy[1]", o)
        sc, sn = as_tensor("torch[]", seed), as_tensor("numpy[]", seed)
        for step in range(8):
            tokens, parents, x = sample_case(rng)
            kw = dict(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(0, 6)), top_p=0.95,
                      device_outputs=bool(step % 2), advance_offset=True)
            same_sample(c_ops.verify_sample(tokens, parents, x, seed=sc, offset=oc, **kw),
                        ref_ops.verify_sample(tokens, parents, x, seed=sn, offset=on, **kw))
            assert tensor_value(oc) == tensor_value(on)
        assert tensor_value(oc) != o


def test_verify_sample_tensors_not_kept_alive(c_ops):
    """The C binding releases the seed/offset tensors on success and on every error path."""
    import sys

    s, o = torch.tensor([3]), np.array([5], np.int64)
    bad = np.zeros((3, 5), np.float32)
    bad[0, 1] = np.nan
    before = (sys.getrefcount(s), sys.getrefcount(o))
    tt, tp, x = np.array([0, 1, 2]), np.array([-1, 0, 0]), np.zeros((3, 5), np.float32)

    def failing(logits=x, **kw):
        args = dict(temperature=1.0, seed=s, offset=o, advance_offset=True)
        args.update(kw)
        try:
            c_ops.verify_sample(tt, tp, logits, **args)
        except (ValueError, TypeError):
            return
        raise AssertionError("a bad call did not raise")  # pragma: no cover

    for _ in range(50):
        c_ops.verify_sample(tt, tp, x, temperature=1.0, seed=s, offset=o, advance_offset=True)
        c_ops.verify_sample(tt, tp, x, temperature=1.0, seed=s, offset=o, device_outputs=True)
        failing(logits=bad)
        failing(top_p=2.0)
        failing(seed=torch.tensor([1, 2]))
        failing(offset=torch.tensor([1.0]))
        failing(offset=FakeCudaInt64())
        failing(offset=5)
    assert (sys.getrefcount(s), sys.getrefcount(o)) == before


def test_mixed_id_dtypes(impl):
    """docs/ops.md: every id input may be int32 or int64 -- independently of the other id inputs."""
    tokens = np.array([5, 6, 7, 8], np.int32)
    parents = np.array([-1, 0, 0, 1], np.int64)
    sel = np.array([0, 1, 3], np.int32)
    check_tree(impl.build_tree(tokens, parents, sel, 2), tree_oracle(tokens, parents, sel, 2))
    x = np.zeros((3, 4), np.float32)
    x[0, 1] = x[1, 3] = 1.0
    tt, tp = np.array([0, 1, 2], np.int64), np.array([-1, 0, 0], np.int32)
    path, nxt = impl.verify_greedy(tt, tp, x)
    assert to_numpy(path).tolist() == [0, 1] and nxt == 3
    path, nxt, draws = impl.verify_sample(tt, tp, x, temperature=1e-3, seed=1, offset=0)
    assert to_numpy(path).tolist() == [0, 1] and nxt == 3
    check_expand(impl, x, np.zeros(3), np.array([-1, 0, 1], np.int32), 2, d2t=np.zeros(4, np.int64))


# ---------------------------------------------------------------------------------------------- kv_compact


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_kv_compact(impl, slot_dtype):
    rng = np.random.default_rng(61)
    for trial in range(20):
        plen = int(rng.integers(0, 6))
        m = int(rng.integers(0, 9))
        s_min = plen + m + int(rng.integers(0, 6))
        slots = np.sort(rng.choice(np.arange(s_min - plen + 3), size=m, replace=False)).astype(slot_dtype)
        slots = np.maximum(slots, np.arange(m)).astype(slot_dtype)  # keep slots[i] >= i
        slots = np.array(sorted(set(slots.tolist())), slot_dtype)
        m = len(slots)
        last = int(slots[-1]) if m else 0
        tensors = [
            rng.normal(size=(2, 3, plen + last + 1 + int(rng.integers(0, 4)), 5)).astype(np.float16),
            rng.integers(-100, 100, size=(plen + last + 2, 3)).astype(np.int8),
            rng.random(size=(4, plen + last + 1, 1)) < 0.5,
            rng.normal(size=(1, plen + last + 3, 8)).astype(np.float32),
        ]
        expected = []
        for t in tensors:
            e = t.copy()
            dst = plen + np.arange(m)
            e[..., dst, :] = t[..., plen + slots.astype(np.int64), :]  # fancy indexing copies first
            expected.append(e)
        assert impl.kv_compact(tensors, plen, slots) is None
        for t, e in zip(tensors, expected):
            np.testing.assert_array_equal(t, e)


def test_kv_compact_noop_and_identity(impl):
    rng = np.random.default_rng(62)
    t = rng.normal(size=(3, 10, 4)).astype(np.float32)
    before = t.copy()
    impl.kv_compact([t], 2, np.zeros(0, np.int64))
    np.testing.assert_array_equal(t, before)
    impl.kv_compact((t,), 2, np.arange(5))  # slots == arange: rows copied onto themselves
    np.testing.assert_array_equal(t, before)
    impl.kv_compact([t], 0, np.array([9]))
    np.testing.assert_array_equal(t[:, 0], before[:, 9])
    np.testing.assert_array_equal(t[:, 1:], before[:, 1:])


def test_kv_compact_torch_in_place(impl):
    t = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    before = t.clone()
    impl.kv_compact([t], 1, np.array([1, 4, 6]))
    assert torch.equal(t[:, 1], before[:, 2])
    assert torch.equal(t[:, 2], before[:, 5])
    assert torch.equal(t[:, 3], before[:, 7])
    assert torch.equal(t[:, 0], before[:, 0]) and torch.equal(t[:, 4:], before[:, 4:])


def _kv_case(rng, plen, slots, extra=3):
    last = int(np.asarray(slots)[-1]) if len(slots) else 0
    return [
        rng.normal(size=(2, 3, plen + last + 1 + extra, 5)).astype(np.float32),
        rng.integers(-100, 100, size=(plen + last + 2, 3)).astype(np.int8),
    ]


@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_kv_compact_array_plen_equals_int_plen(impl, shape, lib):
    rng = np.random.default_rng(63)
    for trial in range(10):
        plen = int(rng.integers(0, 7))
        slots = np.array(sorted(set((np.arange(5) + rng.integers(0, 3, size=5).cumsum()).tolist())), np.int64)
        a = _kv_case(rng, plen, slots)
        b = [t.copy() for t in a]
        p = np.full(shape, plen, np.int64)
        if lib == "torch":
            p = torch.from_numpy(p)
        impl.kv_compact(a, plen, slots)
        assert impl.kv_compact(b, p, slots) is None
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        assert int(p.reshape(-1)[0]) == plen  # read, never written


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_kv_compact_padded_slots_equal_unpadded(impl, slot_dtype):
    rng = np.random.default_rng(64)
    for trial in range(20):
        plen = int(rng.integers(0, 5))
        m = int(rng.integers(0, 7))
        slots = np.array(sorted(set((np.arange(m) + rng.integers(0, 4, size=m).cumsum()).tolist())), slot_dtype)
        pad = int(rng.integers(1, 6))
        padded = np.concatenate([slots, np.full(pad, -1, slot_dtype)])
        a = _kv_case(rng, plen, slots)
        b = [t.copy() for t in a]
        impl.kv_compact(a, plen, slots)
        impl.kv_compact(b, plen if trial % 2 else np.array(plen), padded)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_kv_compact_all_padding_is_noop(impl):
    rng = np.random.default_rng(65)
    t = rng.normal(size=(3, 10, 4)).astype(np.float32)
    before = t.copy()
    for slots in (np.full(4, -1, np.int64), np.full(1, -1, np.int32), np.full(10, -1, np.int64)):
        impl.kv_compact([t], 9, slots)  # 9 + anything past S would be refused if it were read
        impl.kv_compact([t], np.array([9]), slots)
        np.testing.assert_array_equal(t, before)


def test_kv_compact_takes_the_padded_verify_path(impl):
    # the device-resident loop: verify's padded path and a prefix array, straight into kv_compact
    tokens = np.array([0, 5, 6, 7, 9], np.int64)
    parents = np.array([-1, 0, 0, 1, 3], np.int64)
    x = np.zeros((5, 12), np.float32)
    x[0, 5] = x[1, 7] = x[3, 2] = 9.0  # accepts 0 -> 1 -> 3, then next token 2
    path, length, nxt = impl.verify_greedy(tokens, parents, x, device_outputs=True)
    assert to_numpy(path).tolist() == [0, 1, 3, -1, -1] and int(length) == 3
    rng = np.random.default_rng(66)
    kv = rng.normal(size=(2, 4, 20, 8)).astype(np.float32)
    want = kv.copy()
    impl.kv_compact([want], 7, to_numpy(path)[: int(length)])
    prefix = np.array([7], np.int64)
    impl.kv_compact([kv], prefix, path)
    np.testing.assert_array_equal(kv, want)


def test_kv_tensors_equals_the_list(impl):
    rng = np.random.default_rng(67)
    a = [rng.normal(size=(2, 16, 4)).astype(np.float32), rng.normal(size=(3, 1, 18, 2)).astype(np.float16),
         torch.arange(5 * 17 * 3, dtype=torch.float32).reshape(5, 17, 3)]
    b = [t.clone() if isinstance(t, torch.Tensor) else t.copy() for t in a]
    kvt = impl.KVTensors(b)
    assert len(kvt) == 3 and len(kvt.tensors) == 3 and kvt.tensors[0] is b[0]
    prefix = np.array(3, np.int64)
    for slots in (np.array([1, 4, 5, -1]), np.array([0, 1, 2]), np.array([2, 6, -1, -1], np.int32), np.array([-1])):
        impl.kv_compact(a, int(prefix), slots)
        assert impl.kv_compact(kvt, prefix, slots) is None
        for x, y in zip(a, b):
            np.testing.assert_array_equal(to_numpy(x), to_numpy(y))
        prefix += 2  # a new value each call, same array
    # the same checks as kv_compact's list, before anything moves
    with pytest.raises(ValueError, match=r"argument 'slots' expected prefix_len \+ slot"):
        impl.kv_compact(kvt, 2, np.array([14]))  # 2 + 14 >= 16 (the shortest S)
    empty = impl.KVTensors([])
    assert len(empty) == 0
    impl.kv_compact(empty, 0, np.array([0, 1]))


def test_kv_tensors_keeps_the_tensors_alive(impl):
    import gc

    base = np.arange(4 * 12 * 2, dtype=np.float64).reshape(4, 12, 2)
    kvt = impl.KVTensors([torch.from_numpy(base.copy())])  # the only reference to the tensor
    gc.collect()
    impl.kv_compact(kvt, 1, np.array([3, 5]))
    t = to_numpy(kvt.tensors[0])
    np.testing.assert_array_equal(t[:, 1], base[:, 4])
    np.testing.assert_array_equal(t[:, 2], base[:, 6])
    np.testing.assert_array_equal(t[:, 3:], base[:, 3:])


def test_kv_compact_releases_what_it_imports(impl):
    import sys

    t, slots, prefix = np.zeros((2, 10, 4)), np.array([1, 3, -1]), np.array([2])
    before = [sys.getrefcount(x) for x in (t, slots, prefix)]
    for _ in range(20):
        impl.kv_compact([t], prefix, slots)
        with pytest.raises(ValueError):
            impl.kv_compact([t], prefix, np.array([0, -1, 1]))
        with pytest.raises(TypeError):
            impl.kv_compact([t], prefix.astype(np.int32), slots)
        with pytest.raises(ValueError):
            impl.kv_compact([t], np.array([-1]), slots)
        kvt = impl.KVTensors([t])
        impl.kv_compact(kvt, prefix, slots)
        with pytest.raises(ValueError):
            impl.kv_compact(kvt, prefix, np.array([9]))
        del kvt
    assert [sys.getrefcount(x) for x in (t, slots, prefix)] == before


def test_kv_compact_rejects_slots_or_plen_inside_a_tensor(impl):
    kv = np.zeros((2, 10, 4), np.int64)
    kv[0, 0, :2] = [1, 2]
    with pytest.raises(ValueError, match=r"argument 'slots' expected memory not shared with the tensors"):
        impl.kv_compact([kv], 0, kv[0, 0, :2])
    with pytest.raises(ValueError, match=r"argument 'prefix_len' expected memory not shared with the tensors"):
        impl.kv_compact([kv], kv[1, 9, 3:], np.array([1, 2]))
    assert kv.sum() == 3


# ---------------------------------------------------------------------------------------------- bucketize


@pytest.mark.parametrize("vdtype", [np.float32, np.float64])
@pytest.mark.parametrize("tdtype", [np.float32, np.float64])
def test_bucketize(impl, vdtype, tdtype):
    rng = np.random.default_rng(71)
    for t_len in (0, 1, 2, 7, 50):
        th = np.unique(rng.normal(size=t_len).astype(tdtype))
        vals = np.concatenate([rng.normal(size=200), th.astype(np.float64), [np.inf, -np.inf, 0.0]]).astype(vdtype)
        out = to_numpy(impl.bucketize(vals, th))
        assert out.dtype == np.int32 and out.shape == vals.shape
        brute = np.array([sum(1 for s in th.astype(np.float64) if float(v) > s) for v in vals])
        np.testing.assert_array_equal(out, brute)
        np.testing.assert_array_equal(out, np.searchsorted(th.astype(np.float64), vals.astype(np.float64), "left"))


def test_bucketize_float64_comparison(impl):
    # float32(0.1) = 0.10000000149 > 0.1 (float64): compared in float64, the value is above the threshold
    out = to_numpy(impl.bucketize(np.array([0.1], np.float32), np.array([0.1], np.float64)))
    assert out.tolist() == [1]
    out = to_numpy(impl.bucketize(np.array([0.1], np.float64), np.array([0.1], np.float32)))
    assert out.tolist() == [0]
    out = to_numpy(impl.bucketize(np.zeros(0), np.array([-np.inf, 0.0, np.inf])))
    assert out.shape == (0,) and out.dtype == np.int32
    out = to_numpy(impl.bucketize(np.array([-np.inf, -1.0, 0.0, 1.0, np.inf]), np.array([-np.inf, 0.0, np.inf])))
    assert out.tolist() == [0, 1, 1, 2, 2]


def test_kv_compact_rejects_overlapping_tensors(impl):
    # the same tensor twice (keys passed as values too) would be compacted twice: refused, nothing moved
    kv = np.arange(2 * 8 * 3, dtype=np.float32).reshape(2, 8, 3)
    before = kv.copy()
    with pytest.raises(ValueError, match=r"argument 'tensors\[1\]'.*overlap"):
        impl.kv_compact([kv, kv], 2, np.array([0, 2]))
    with pytest.raises(ValueError, match=r"argument 'tensors\[1\]'.*overlap"):
        impl.kv_compact([kv, kv[1:]], 2, np.array([0, 2]))
    np.testing.assert_array_equal(kv, before)
    # disjoint slices of one buffer (a stacked KV cache) are fine
    impl.kv_compact([kv[0], kv[1]], 2, np.array([0, 2]))
    before[:, 3] = before[:, 4]
    np.testing.assert_array_equal(kv, before)
