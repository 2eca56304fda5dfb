"""The tree family of ops, expand, select and build_tree: every test of the family in one file, as the C sources are
(csrc/core/tree.c, csrc/cuda/tree.cu, csrc/py/tree.c, heterospec/reference/tree.py; docs/ops.md).

In order: the cases against brute-force expectations (C core and NumPy twin, fixture ``impl``); the C core against
the NumPy twin on random input; batched calls against the same calls row by row; bad input (the documented exception
naming the argument); and on the device (``on_device``): CPU <-> CUDA parity and device-side checks, on a real GPU
or on the emulated build (HETEROSPEC_CUDA=emu, CI stage 2), skipped elsewhere."""
import numpy as np
import pytest
from _agree import (
    HYP,
    candidate_forests,
    expand_inputs,
    random_logits,
    same,
    same_tree,
    score_elems,
)
from _bad import (
    BN,
    BS,
    BT_PAR,
    BT_SEL,
    BT_TOK,
    L,
    S,
    case,
    check_bad_input,
    noncontig,
    with_value,
)
from _batches import _candidate_batch
from _cases import SIZES, check_expand, check_tree, k_values, rows_for, select_oracle
from _device import (
    LOGIT_DTYPES,
    REAL,
    D,
    _deferred_error,
    _expand_matches_cpu,
    _poisoned_outputs,
    _random_tree_inputs,
    _star,
    close,
    logits,
    on_device,
)
from _dlpack import EmuCuda
from _oracles import (
    parent_closure,
    random_forest,
    tree_oracle,
)
from conftest import to_numpy
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from heterospec import ops

# ---- against brute-force expectations, C core and NumPy twin (fixture `impl`) --------------------------------------


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


# ---- C core against the NumPy twin on random (hypothesis) inputs ---------------------------------------------------


def test_agree_expand(c_ops, ref_ops):
    rng = np.random.default_rng(102)
    for trial in range(200):
        b = int(rng.integers(1, 6))
        v = int(rng.choice([1, 3, 8, 57, 400]))
        k = int(rng.integers(1, v + 1))
        x = random_logits(rng, (b, v), rng.choice([np.float16, np.float32]))
        bs = (-rng.random(b) * 10).astype(rng.choice([np.float32, np.float64]))
        bs[rng.random(b) < 0.1] = -np.inf
        bn = rng.integers(-1, 50, size=b).astype(rng.choice([np.int32, np.int64]))
        kw = dict(node_offset=int(rng.integers(0, 1000)))
        if rng.random() < 0.5:
            kw["d2t"] = rng.integers(0, 100, size=v).astype(rng.choice([np.int32, np.int64]))
        c_out = c_ops.expand(x, bs, bn, k, **kw)
        r_out = ref_ops.expand(x, bs, bn, k, **kw)
        for name, c, r in zip(("tokens", "scores", "parents", "entropy", "next_beams"), c_out, r_out):
            same(c, r, f"trial {trial} {name}")


def test_agree_select_build_tree_chain(c_ops, ref_ops):
    rng = np.random.default_rng(103)
    for trial in range(100):
        m = int(rng.integers(1, 80))
        parents = random_forest(rng, m)
        tokens = rng.integers(0, 32000, size=m)
        scores = np.zeros(m, np.float32)
        for i in range(m):  # EAGLE-like cumulative log-probabilities: a child never beats its parent
            scores[i] = (scores[parents[i]] if parents[i] >= 0 else 0) - np.float32(rng.exponential())
        n = int(rng.integers(0, m + 1))
        sel_c, sel_r = c_ops.select(scores, n), ref_ops.select(scores, n)
        same(sel_c, sel_r, "select")
        root = int(rng.integers(0, 32000))
        same_tree(c_ops.build_tree(tokens, parents, sel_r, root), ref_ops.build_tree(tokens, parents, sel_r, root))


@HYP
@given(data=st.data())
def test_hyp_select(c_ops, ref_ops, data):
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    s = data.draw(hnp.arrays(dtype, st.integers(0, 60), elements=score_elems))
    n = data.draw(st.integers(0, len(s)))
    out_r = to_numpy(ref_ops.select(s, n))
    same(c_ops.select(s, n), out_r)
    assert out_r.shape == (n,) and np.all(np.diff(out_r) > 0)
    chosen = np.zeros(len(s), bool)
    chosen[out_r] = True
    if 0 < n < len(s):
        lo, hi = s[chosen].min(), s[~chosen].max()
        assert lo >= hi
        if lo == hi:  # ties broken to the lower index
            assert np.flatnonzero(chosen & (s == lo)).max() < np.flatnonzero(~chosen & (s == lo)).min()


@HYP
@given(forest=candidate_forests())
def test_hyp_build_tree(c_ops, ref_ops, forest):
    tokens, parents, sel, root = forest
    tr = ref_ops.build_tree(tokens, parents, sel, root)
    same_tree(c_ops.build_tree(tokens, parents, sel, root), tr)
    n = len(sel)
    t_par, depths, mask, retrieve = tr.parents, tr.depths, tr.mask, tr.retrieve
    assert tr.tokens[0] == root and t_par[0] == -1 and depths[0] == 0
    np.testing.assert_array_equal(tr.tokens[1:], tokens[sel])
    assert np.all(t_par[1:] < np.arange(1, n + 1)) and np.all(t_par[1:] >= 0)
    np.testing.assert_array_equal(depths[1:], depths[t_par[1:]] + 1)
    assert np.all(np.diag(mask)) and np.all(mask[:, 0])
    np.testing.assert_array_equal(mask.sum(axis=1), depths + 1)
    for i in range(1, n + 1):
        row = mask[t_par[i]].copy()
        row[i] = True
        np.testing.assert_array_equal(mask[i], row)
    leaves = sorted(set(range(n + 1)) - set(t_par[1:].tolist()))
    assert retrieve.shape == (len(leaves), depths.max() + 1)
    np.testing.assert_array_equal(retrieve[:, 0], 0)
    for row, leaf in zip(retrieve, leaves):
        chain = row[row >= 0]
        assert np.all(row[len(chain):] == -1)
        assert chain[-1] == leaf
        np.testing.assert_array_equal(t_par[chain[1:]], chain[:-1])
    covered = set(retrieve[retrieve >= 0].tolist())
    assert covered == set(range(n + 1))


@HYP
@given(inp=expand_inputs())
def test_hyp_expand(c_ops, ref_ops, inp):
    x, bs, bn, k, d2t, off = inp
    r_out = ref_ops.expand(x, bs, bn, k, d2t=d2t, node_offset=off)
    c_out = c_ops.expand(x, bs, bn, k, d2t=d2t, node_offset=off)
    for name, c, r in zip(("tokens", "scores", "parents", "entropy", "next_beams"), c_out, r_out):
        same(c, r, name)
    tokens, scores, parents, entropy, next_beams = r_out
    b, v = x.shape
    ids = tokens.reshape(b, k)
    for r in range(b):
        row_s = scores[r * k : (r + 1) * k]
        assert np.all(row_s[:-1] >= row_s[1:])  # listed in descending lp
        assert np.all(row_s <= bs[r])  # lp <= 0
        if d2t is None:
            assert len(set(ids[r].tolist())) == k and np.all((ids[r] >= 0) & (ids[r] < v))
    np.testing.assert_array_equal(parents, np.repeat(bn, k))
    assert np.all((entropy >= -1e-6) & (entropy <= np.log(k) + 1e-5))
    assert len(set(next_beams.tolist())) == k
    flat = next_beams - off
    assert np.all((flat >= 0) & (flat < b * k))
    chosen = scores[flat]
    assert np.all(chosen[:-1] >= chosen[1:])
    others = np.delete(scores, flat)
    if len(others):
        assert chosen.min() >= others.max()


# ---- batched calls equal to the same calls row by row --------------------------------------------------------------


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


# ---- bad input: the documented exception, naming the argument ------------------------------------------------------


CASES = []
case(CASES, "ex-int-logits", TypeError, "logits", lambda m: m.expand(L.astype(np.int64), BS, BN, 2))
case(CASES, "ex-int-beam-scores", TypeError, "beam_scores", lambda m: m.expand(L, np.zeros(3, np.int64), BN, 2))
case(CASES, "ex-f16-beam-scores", TypeError, "beam_scores", lambda m: m.expand(L, np.zeros(3, np.float16), BN, 2))
case(CASES, "ex-float-beam-nodes", TypeError, "beam_nodes", lambda m: m.expand(L, BS, BN.astype(np.float64), 2))
case(CASES, "ex-float-d2t", TypeError, "d2t", lambda m: m.expand(L, BS, BN, 2, d2t=np.zeros(7)))
case(CASES, "ex-k-float", TypeError, "k", lambda m: m.expand(L, BS, BN, 1.5))
case(CASES, "ex-beam-scores-len", ValueError, "beam_scores", lambda m: m.expand(L, np.zeros(2), BN, 2))
case(CASES, "ex-beam-scores-2d", ValueError, "beam_scores", lambda m: m.expand(L, np.zeros((3, 1)), BN, 2))
case(CASES, "ex-beam-nodes-len", ValueError, "beam_nodes", lambda m: m.expand(L, BS, np.array([-1, 0, 1, 2]), 2))
case(CASES, "ex-d2t-len", ValueError, "d2t", lambda m: m.expand(L, BS, BN, 2, d2t=np.zeros(6, np.int64)))
case(CASES, "ex-k-range", ValueError, "k", lambda m: m.expand(L, BS, BN, 0), lambda m: m.expand(L, BS, BN, 8))
case(CASES, "ex-beam-scores-nonfinite", ValueError, "beam_scores",
     lambda m: m.expand(L, with_value(BS, 1, np.nan), BN, 2),
     lambda m: m.expand(L, with_value(BS, 2, np.inf), BN, 2))
case(CASES, "ex-beam-nodes-below-minus1", ValueError, "beam_nodes", lambda m: m.expand(L, BS, with_value(BN, 0, -2), 2))
case(CASES, "ex-node-offset-negative", ValueError, "node_offset", lambda m: m.expand(L, BS, BN, 2, node_offset=-1))
case(CASES, "ex-d2t-negative-token", ValueError, "d2t",
     lambda m: m.expand(L, BS, BN, 2, d2t=np.full(7, -10, np.int64)))
case(CASES, "ex-logits-nan", ValueError, "logits", lambda m: m.expand(with_value(L, (0, 0), np.nan), BS, BN, 2))
case(CASES, "ex-logits-all-neginf", ValueError, "logits", lambda m: m.expand(with_value(L, 2, -np.inf), BS, BN, 2))
case(CASES, "ex-noncontig", ValueError, "logits", lambda m: m.expand(noncontig(L), BS, BN, 2))
case(CASES, "ex-noncontig-beam-scores", ValueError, "beam_scores", lambda m: m.expand(L, noncontig(BS), BN, 2))
case(CASES, "ex-noncontig-beam-nodes", ValueError, "beam_nodes", lambda m: m.expand(L, BS, noncontig(BN), 2))
case(CASES, "se-int-scores", TypeError, "scores", lambda m: m.select(np.arange(6), 2))
case(CASES, "se-3d", ValueError, "scores", lambda m: m.select(S.reshape(1, 2, 3), 2))  # 2-D is the batched form
case(CASES, "se-n-range", ValueError, "n", lambda m: m.select(S, -1), lambda m: m.select(S, 7))
case(CASES, "se-n-float", TypeError, "n", lambda m: m.select(S, 2.0))
case(CASES, "se-nan", ValueError, "scores", lambda m: m.select(with_value(S, 4, np.nan), 2))
case(CASES, "se-noncontig", ValueError, "scores", lambda m: m.select(noncontig(S), 2))
case(CASES, "bt-float-tokens", TypeError, "tokens", lambda m: m.build_tree(BT_TOK.astype(np.float32), BT_PAR, BT_SEL, 0))
case(CASES, "bt-float-parents", TypeError, "parents", lambda m: m.build_tree(BT_TOK, BT_PAR.astype(np.float64), BT_SEL, 0))
case(CASES, "bt-float-selected", TypeError, "selected", lambda m: m.build_tree(BT_TOK, BT_PAR, BT_SEL.astype(np.float64), 0))
case(CASES, "bt-tokens-3d", ValueError, "tokens", lambda m: m.build_tree(BT_TOK.reshape(1, 2, 2), BT_PAR, BT_SEL, 0))
case(CASES, "bt-parents-len", ValueError, "parents", lambda m: m.build_tree(BT_TOK, BT_PAR[:3], np.array([0, 1]), 0))
case(CASES, "bt-selected-order", ValueError, "selected",
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([1, 0]), 0),
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([0, 0, 1]), 0))
case(CASES, "bt-selected-range", ValueError, "selected",
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([0, 4]), 0),
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([-1, 0]), 0))
case(CASES, "bt-parents-range", ValueError, "parents",
     lambda m: m.build_tree(BT_TOK, np.array([-1, -2, 0, 1]), np.array([0, 1]), 0),
     lambda m: m.build_tree(BT_TOK, np.array([-1, 0, 0, 4]), BT_SEL, 0))
case(CASES, "bt-parents-precede", ValueError, "parents",
     lambda m: m.build_tree(BT_TOK, np.array([-1, 2, -1, 1]), np.array([1, 2]), 0),
     lambda m: m.build_tree(BT_TOK, np.array([-1, 1, -1, 1]), np.array([1]), 0))
case(CASES, "bt-not-parent-closed", ValueError, "selected",
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([1]), 0),
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([0, 3]), 0))
case(CASES, "bt-root-token-negative", ValueError, "root_token", lambda m: m.build_tree(BT_TOK, BT_PAR, BT_SEL, -1))
case(CASES, "bt-root-token-float", TypeError, "root_token", lambda m: m.build_tree(BT_TOK, BT_PAR, BT_SEL, 1.0))
case(CASES, "bt-noncontig", ValueError, "tokens", lambda m: m.build_tree(noncontig(BT_TOK), BT_PAR, BT_SEL, 0))


@pytest.mark.parametrize("fn,exc,arg", CASES)
def test_bad_input(impl, fn, exc, arg, request):
    check_bad_input(impl, fn, exc, arg, request)


def test_message_says_expected_and_given(impl):
    with pytest.raises(ValueError, match=r"^select: argument 'n'") as info:
        impl.select(S, 9)
    assert "9" in str(info.value) and len(str(info.value)) > len("select: argument 'n'") + 5


# ---- on the device: CPU <-> CUDA parity (a real GPU, or the emulated build), device-side checks --------------------


@on_device
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("B,V,k", [(1, 5, 5), (3, 111, 4), (4, 2000, 10), (2, 300, 33)])
@pytest.mark.parametrize("ties", [False, True])
def test_expand_parity(dtype, B, V, k, ties):
    rng = np.random.default_rng(B * 1000 + V + k)
    x = logits(rng, B, V, ties)
    dev, cpu = D.put_logits(x, dtype)
    scores = (-rng.random(B) * 3).astype(np.float64)
    nodes = rng.integers(-1, 50, B).astype(np.int64)
    d2t = rng.integers(0, 40, V).astype(np.int64)
    for d in (None, d2t):
        _expand_matches_cpu(dev, cpu, scores, nodes, k, d)


@on_device
@pytest.mark.parametrize("V,k", [(8192, 64), (8192, 100)] + ([(40000, 100)] if REAL else []))
@pytest.mark.parametrize("ties", [False, True])
def test_expand_merge_at_and_past_its_shared_memory_sort(V, k, ties):
    """The split expand's merge sorts the row's C * k candidates in shared memory up to 2,048 (8192 x 64: 32 chunks of
    64 in the emulation, the sort at its largest) and ranks them by binary searches past it (8192 x 100 in the
    emulation; 40000 x 100 on a GPU, 32 chunks there too).  One dtype: the dtypes' loads are test_expand_parity's."""
    rng = np.random.default_rng(V + k + ties)
    x = logits(rng, 1, V, ties)
    dev, cpu = D.put_logits(x, "float32")
    scores = (-rng.random(1) * 3).astype(np.float64)
    nodes = rng.integers(-1, 50, 1).astype(np.int64)
    _expand_matches_cpu(dev, cpu, scores, nodes, k)


@on_device
@pytest.mark.parametrize("B,k", [(5, 256), (3, 342), (4, 256), (100, 10), (2, 10)])
@pytest.mark.parametrize("ties", [False, True])
def test_expand_next_beams_by_rank_and_by_radix_select(B, k, ties):
    """The last block picks a request's next beams from its B * k scores: by rank counting up to 1024 scores
    (EAGLE's 10 x 10; 4 x 256 at the limit), by the radix select above it (5 x 256, 3 x 342); both give the
    CPU's order, ties (equal scores from equal logits) to the lower index."""
    rng = np.random.default_rng(B * 1000 + k + ties)
    V = 2 * k + 37
    x = logits(rng, B, V, ties)
    dev, cpu = D.put_logits(x, "float32")
    scores = (np.zeros(B) if ties else -rng.random(B) * 3).astype(np.float64)
    nodes = rng.integers(-1, 50, B).astype(np.int64)
    _expand_matches_cpu(dev, cpu, scores, nodes, k)


@on_device
@pytest.mark.parametrize("M,n", [(1, 0), (1, 1), (10, 4), (333, 59), (1000, 1000), (700, 1)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_select_parity(M, n, dtype):
    rng = np.random.default_rng(M + n)
    for s in (rng.normal(size=M), rng.integers(-3, 3, M).astype(float)):
        s = s.astype(dtype)
        np.testing.assert_array_equal(D.get(ops.select(D.put(s), n)), ops.select(s, n))


@on_device
@pytest.mark.parametrize("M,n", [(1, 0), (5, 3), (60, 20), (300, 59), (200, 127)])
def test_build_tree_parity(M, n):
    rng = np.random.default_rng(M * 3 + n)
    tokens, parents, sel = _random_tree_inputs(rng, M, n)
    want = ops.build_tree(tokens, parents, sel, 9)
    got = ops.build_tree(D.put(tokens), D.put(parents), D.put(sel), 9)
    for name in want._fields:
        np.testing.assert_array_equal(D.get(getattr(got, name)), getattr(want, name), err_msg=name)
    tree, leaves, depth = ops.build_tree(D.put(tokens), D.put(parents), D.put(sel), 9, device_outputs=True)
    wtree, wleaves, wdepth = ops.build_tree(tokens, parents, sel, 9, device_outputs=True)
    np.testing.assert_array_equal(D.get(tree.retrieve), wtree.retrieve)
    assert int(D.get(leaves)) == int(wleaves) and int(D.get(depth)) == int(wdepth)


@on_device
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_batched_expand_on_the_device_equals_the_cpu_batch(dtype):
    rng = np.random.default_rng(31)
    nb, B, Vd, k = 3, 4, 300, 5
    x = rng.normal(0, 2, (nb * B, Vd)).astype(np.float32)
    dx, cpu_x = D.put_logits(x, dtype)
    dx = dx.reshape(nb, B, Vd) if REAL else EmuCuda(D.get(dx).reshape(nb, B, Vd), bf16=dtype == "bfloat16")
    scores = rng.normal(-3, 1, (nb, B)).astype(np.float32)
    nodes = rng.integers(-1, 9, (nb, B)).astype(np.int64)
    d2t = np.sort(rng.integers(0, 4, Vd)).astype(np.int64)
    dev = [D.get(a) for a in ops.expand(dx, D.put(scores), D.put(nodes), k, D.put(d2t), 3)]
    cpu = [D.get(a) for a in ops.expand(cpu_x.reshape(nb, B, Vd), scores, nodes, k, d2t, 3)]
    for a, b in zip(dev[:3] + dev[4:], cpu[:3] + cpu[4:]):
        if a.dtype.kind == "f":
            close(a, b)
        else:
            assert np.array_equal(a, b)
    close(dev[3], cpu[3])


@on_device
def test_batched_select_on_the_device_equals_the_cpu_batch():
    rng = np.random.default_rng(41)
    x = rng.integers(-5, 5, (4, 200)).astype(np.float32)
    dev = D.get(ops.select(D.put(x), 31))
    assert np.array_equal(dev, ops.select(x, 31)) and dev.shape == (4, 31)


@on_device
def test_batched_build_tree_on_the_device_equals_the_cpu_batch():
    """build_tree over [batch, M] with per-row selection sizes and roots as device arrays: every output equals
    the CPU core's batch (the batched cases above show that equals the rows), padding rows included; a negative
    root on the device is a recorded error naming root_token."""
    from _batches import _candidate_batch

    rng = np.random.default_rng(41)
    B, M, N = 4, 30, 12
    counts = np.array([12, 0, 5, 9], np.int64)
    tok, par, sel = _candidate_batch(rng, B, M, N, counts)
    roots = np.array([7, 8, 9, 10], np.int64)
    want = ops.build_tree(tok, par, sel, roots, n=counts)
    got = ops.build_tree(D.put(tok), D.put(par), D.put(sel), D.put(roots), n=D.put(counts))
    for name, w, g in zip(want[0]._fields, want[0], got[0]):
        np.testing.assert_array_equal(D.get(g), np.asarray(w), err_msg=name)
    for w, g in zip(want[1:], got[1:]):
        np.testing.assert_array_equal(D.get(g), np.asarray(w))
    with pytest.raises(ValueError, match=r"build_tree: argument 'root_token' expected a token id >= 0, got -2 \(row 1\)"):
        ops.build_tree(D.put(tok), D.put(par), D.put(sel), D.put(np.array([1, -2, 3, 4], np.int64)), n=D.put(counts))


@on_device
def test_select_with_per_row_sizes_on_the_device_equals_the_cpu():
    rng = np.random.default_rng(43)
    B, M = 5, 300
    x = rng.integers(-3, 3, (B, M)).astype(np.float32)
    m = np.array([300, 0, 17, 299, 120], np.int64)
    n = np.array([59, 0, 17, 1, 60], np.int64)
    want = ops.select(x, n, m=m, width=64)
    got = ops.select(D.put(x), D.put(n), m=D.put(m), width=64)
    np.testing.assert_array_equal(D.get(got), want)
    with pytest.raises(ValueError, match=r"select: argument 'n' expected a per-row size within the buffers"):
        ops.select(D.put(x), D.put(np.array([59, 1, 17, 1, 60], np.int64)), m=D.put(m), width=64)


@on_device
@pytest.mark.parametrize("bad", ["nan", "inf", "allneg", "beam"])
@pytest.mark.parametrize("k", [3, 300])        # the split kernels (k <= 256) and the one-block-per-row one
def test_a_refused_expand_row_leaves_outputs_the_engine_can_index(bad, k, monkeypatch):
    """The third GPU window: a draft with NaN logits made expand (check=False, as the engine calls it) leave a
    row's parents and tokens as the allocator left them, and the engine's next gather killed the CUDA context
    with a device-side assert.  A refused row writes candidates 0..k-1 with score -inf and the row's node as
    parent, entropy 0; the other rows are the CPU core's, the next beams come from them, and the error is
    recorded for cuda_check."""
    _poisoned_outputs(monkeypatch)
    rng = np.random.default_rng(k)
    B, Vd, offset = 3, 400, 7
    x = rng.normal(0, 2, (B, Vd)).astype(np.float32)
    scores = np.array([-0.5, -1.0, -0.25])
    nodes = np.array([0, 2, 5], np.int64)
    clean_x, clean_scores = x.copy(), scores.copy()
    if bad == "nan":
        x[1, 9] = np.nan
    elif bad == "inf":
        x[1, 9] = np.inf
    elif bad == "allneg":
        x[1] = -np.inf
    else:
        scores[1] = np.nan
    dev, _ = D.put_logits(x, "float32")
    tok, sc, par, ent, nxt = (D.get(a) for a in ops.expand(dev, D.put(scores), D.put(nodes), k,
                                                           node_offset=offset, check=False))
    want = ops.expand(clean_x, clean_scores, nodes, k, node_offset=offset)
    row = slice(k, 2 * k)
    np.testing.assert_array_equal(tok[row], np.arange(k))
    assert np.all(sc[row] == -np.inf) and np.all(par[row] == 2) and ent[1] == 0.0
    for r in (0, 2):
        sl = slice(r * k, (r + 1) * k)
        np.testing.assert_array_equal(tok[sl], want[0][sl])
        np.testing.assert_allclose(sc[sl], want[1][sl], rtol=1e-5)
        np.testing.assert_array_equal(par[sl], want[2][sl])
    assert np.all((nxt >= offset) & (nxt < offset + B * k)) and not np.any((nxt >= offset + k) & (nxt < offset + 2 * k))
    _deferred_error(r"argument '(logits|beam_scores)' expected")


@on_device
def test_a_refused_select_row_selects_its_first_candidates(monkeypatch):
    _poisoned_outputs(monkeypatch)
    s = np.random.default_rng(0).normal(0, 1, (2, 40))
    clean = s.copy()
    s[0, 13] = np.nan
    got = D.get(ops.select(D.put(s), 5, check=False))
    np.testing.assert_array_equal(got[0], np.arange(5))
    np.testing.assert_array_equal(got[1], ops.select(clean, 5)[1])
    _deferred_error(r"argument 'scores' expected")
    # per-row sizes out of range: that row selects nothing (-1), the other is the CPU's
    got = D.get(ops.select(D.put(clean), D.put(np.array([3, 50], np.int64)), width=6, check=False))
    np.testing.assert_array_equal(got[1], np.full(6, -1))
    np.testing.assert_array_equal(got[0], ops.select(clean, np.array([3, 3], np.int64), width=6)[0])
    _deferred_error(r"cuda_check: argument")


@on_device
@pytest.mark.parametrize("bad", ["not-closed", "range", "order", "root", "size"])
def test_a_refused_build_tree_request_gets_a_tree_the_engine_can_index(bad, monkeypatch):
    """A refused request's tree: its nodes all children of the root with the root's token (0 for a negative
    root), so the verify forward's embedding, positions, mask and retrieve gathers stay in range; the other
    request's tree is the CPU core's."""
    _poisoned_outputs(monkeypatch)
    tokens = np.array([[4, 5, 6, 7], [8, 9, 10, 11]], np.int64)
    parents = np.array([[-1, 0, 1, -1], [-1, 0, 0, 2]], np.int64)
    sel = np.array([[0, 1, 3], [0, 2, 3]], np.int64)
    root = np.array([1, 2], np.int64)
    n = np.array([3, 3], np.int64)
    if bad == "not-closed":
        sel[0] = [0, 2, 3]           # candidate 2's parent 1 is not selected
    elif bad == "range":
        sel[0] = [0, 1, 9]
    elif bad == "order":
        sel[0] = [1, 0, 3]
    elif bad == "root":
        root[0] = -3
    else:
        n[0] = 7
    tree, leaves, depth = ops.build_tree(D.put(tokens), D.put(parents), D.put(sel), D.put(root), n=D.put(n),
                                         check=False)
    got = [D.get(a)[0] for a in tree] + [int(D.get(leaves)[0]), int(D.get(depth)[0])]
    want = _star(4, 0 if bad == "size" else 3, 0 if bad == "root" else 1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    ok = ops.build_tree(tokens[[1, 1]], parents[[1, 1]], sel[[1, 1]], root[[1, 1]], n=n[[1, 1]])
    for g, w in zip(list(tree) + [leaves, depth], list(ok[0]) + [ok[1], ok[2]]):
        np.testing.assert_array_equal(D.get(g)[1], np.asarray(w)[1])
    _deferred_error(r"cuda_check: argument '(selected|root_token|n)' expected")
