"""heterospec.ops (C core) against heterospec.reference (NumPy specification) on random inputs.

Integers (ids, paths, next_token, draws, masks, bins) must agree exactly.  Floats agree to
rtol=1e-6 AND atol=1e-6: both sides round the same float64 value to float32, but the float64 sums may be
accumulated in a different order, which moves the result by a few float64 ulps and can flip the float32
rounding by one float32 ulp (relative 6e-8, covered by rtol).  Log-probabilities and entropies near 0 have
no relative scale (an entropy of 1e-9 vs 0 after cancellation in -sum p ln p), hence the absolute term.
Philox uniforms are exact (x0 * 2^-32) and compared exactly.

These tests need both modules; they fail (never skip) when heterospec.ops cannot be imported.
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from _oracles import parent_closure, random_forest, random_tree
from conftest import to_numpy

TOL = dict(rtol=1e-6, atol=1e-6)
HYP = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def same(c_out, r_out, what=""):
    c, r = to_numpy(c_out), to_numpy(r_out)
    assert c.dtype == r.dtype, (what, c.dtype, r.dtype)
    assert c.shape == r.shape, (what, c.shape, r.shape)
    if np.issubdtype(c.dtype, np.floating):
        np.testing.assert_allclose(c, r, err_msg=what, **TOL)
    else:
        np.testing.assert_array_equal(c, r, err_msg=what)


def same_tree(c_tree, r_tree):
    for name in r_tree._fields:
        same(getattr(c_tree, name), getattr(r_tree, name), name)


def random_logits(rng, shape, dtype=np.float32, p_ninf=0.05, scale=2.0):
    x = rng.normal(size=shape) * scale
    if rng.random() < 0.3:
        x = np.round(x)  # ties
    x[rng.random(shape) < p_ninf] = -np.inf
    x[..., 0] = np.where(np.isinf(x).all(axis=-1), 0.0, x[..., 0])
    return x.astype(dtype)


# ---------------------------------------------------------------------------------------------- deterministic random


def test_agree_topk_entropy(c_ops, ref_ops):
    rng = np.random.default_rng(101)
    for trial in range(200):
        v = int(rng.choice([1, 2, 7, 33, 111, 1000]))
        n = int(rng.integers(0, 6))
        x = random_logits(rng, (n, v), rng.choice([np.float16, np.float32]), scale=rng.choice([0.1, 2.0, 30.0]))
        k = int(rng.integers(1, v + 1))
        t = float(rng.choice([1.0, 0.3, 2.5, 1e-3, 50.0]))
        same(c_ops.topk_entropy(x, k, t), ref_ops.topk_entropy(x, k, t), f"trial {trial}")


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


def test_agree_verify_greedy(c_ops, ref_ops):
    rng = np.random.default_rng(104)
    for trial in range(400):
        v = int(rng.choice([1, 4, 9, 300]))
        n = int(rng.integers(1, 30))
        x = random_logits(rng, (n, v), rng.choice([np.float16, np.float32]))
        tokens, parents, _ = random_tree(rng, n, v, logits=x)
        pc, nc = c_ops.verify_greedy(tokens, parents, x)
        pr, nr = ref_ops.verify_greedy(tokens, parents, x)
        same(pc, pr, "path")
        assert type(nc) is int and nc == nr


@pytest.mark.parametrize(
    "setting",
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 2, 1.0), (1.0, 0, 0.7), (0.9, 5, 0.95), (1.0, 10**6, 0.999), (3.0, 1, 0.2)],
    ids=lambda s: "T%s-k%s-p%s" % s,
)
def test_agree_verify_sample(c_ops, ref_ops, setting):
    temperature, top_k, top_p = setting
    rng = np.random.default_rng(105)
    for trial in range(60):
        v = int(rng.choice([1, 2, 6, 8, 50]))
        n = int(rng.integers(1, 20))
        x = random_logits(rng, (n, v), rng.choice([np.float16, np.float32]), scale=rng.choice([0.5, 1.5, 4.0]))
        tokens, parents, _ = random_tree(rng, n, v, p_greedy=0.7, logits=x)
        id_dtype = rng.choice([np.int32, np.int64])  # same dtype for both (mixing: see test_ops)
        tokens, parents = tokens.astype(id_dtype), parents.astype(id_dtype)
        for s in range(30):
            seed = int(rng.integers(0, 2**64, dtype=np.uint64)) if s % 3 else s
            offset = int(rng.integers(0, 2**64, dtype=np.uint64)) if s % 2 else 64 * s
            kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset)
            pc, nc, dc = c_ops.verify_sample(tokens, parents, x, **kw)
            pr, nr, dr = ref_ops.verify_sample(tokens, parents, x, **kw)
            same(pc, pr, f"path trial {trial} seed {seed} offset {offset}")
            assert type(nc) is int and nc == nr, (trial, seed, offset)
            assert type(dc) is int and dc == dr, (trial, seed, offset)


def test_agree_kv_compact(c_ops, ref_ops):
    rng = np.random.default_rng(106)
    for trial in range(100):
        plen = int(rng.integers(0, 5))
        m = int(rng.integers(0, 8))
        slots = np.array(sorted(set((np.arange(m) + rng.integers(0, 4, size=m).cumsum()).tolist())), np.int64)
        s_len = plen + (int(slots[-1]) if len(slots) else 0) + 1 + int(rng.integers(0, 3))
        tensors = [
            rng.normal(size=(2, s_len, 3)).astype(np.float32),
            rng.integers(0, 1000, size=(3, 1, s_len + 2, 4)).astype(np.int64),
            rng.normal(size=(s_len, 1)).astype(np.float16),
        ]
        copies = [t.copy() for t in tensors]
        slots = slots.astype(rng.choice([np.int32, np.int64]))
        c_ops.kv_compact(tensors, plen, slots)
        ref_ops.kv_compact(copies, plen, slots)
        for a, b in zip(tensors, copies):
            np.testing.assert_array_equal(a, b)


def test_agree_kv_compact_padded_slots_and_plen_arrays(c_ops, ref_ops):
    """-1-padded slots (valid, all padding, or padding followed by an entry), int / 0-d / [1] prefixes, lists and
    KVTensors: the same rows move, or both refuse with the same exception naming the same argument."""
    rng = np.random.default_rng(108)
    outcomes = set()
    for trial in range(200):
        plen = int(rng.integers(0, 5))
        m = int(rng.integers(0, 7))
        slots = (np.arange(m) + rng.integers(0, 4, size=m).cumsum()).astype(np.int64)
        pad = int(rng.integers(0, 4))
        slots = np.concatenate([slots, np.full(pad, -1, np.int64)])
        if pad and rng.random() < 0.2:  # a valid-looking entry after the padding began
            slots[-1] = int(rng.integers(0, 8))
        if len(slots) and rng.random() < 0.1:  # out of order
            slots[int(rng.integers(0, len(slots)))] = int(rng.integers(-1, 9))
        s_len = plen + int(rng.integers(1, 10))
        tensors = [rng.normal(size=(2, s_len, 3)).astype(np.float32),
                   rng.integers(0, 1000, size=(3, s_len + 1, 2)).astype(np.int32)]
        copies = [t.copy() for t in tensors]
        kind = trial % 3
        prefix = plen if kind == 0 else np.array(plen, np.int64) if kind == 1 else np.array([plen], np.int64)
        slots = slots.astype(rng.choice([np.int32, np.int64]))
        results = []
        for ops, ts in ((c_ops, tensors), (ref_ops, copies)):
            arg = ops.KVTensors(ts) if trial % 2 else ts
            try:
                ops.kv_compact(arg, prefix, slots)
                results.append(None)
            except ValueError as e:
                results.append(str(e).split("'")[1])
        assert results[0] == results[1], (trial, plen, slots, s_len, results)
        outcomes.add(results[0])
        for a, b in zip(tensors, copies):
            np.testing.assert_array_equal(a, b)
    assert outcomes == {None, "slots"}, outcomes  # both kinds of case were drawn


def test_agree_bucketize(c_ops, ref_ops):
    rng = np.random.default_rng(107)
    for trial in range(200):
        th = np.unique(rng.normal(size=int(rng.integers(0, 30))) * rng.choice([1e-3, 1, 1e6]))
        th = th.astype(rng.choice([np.float32, np.float64]))
        th = np.unique(th)  # float32 rounding can merge values
        vals = np.concatenate([rng.normal(size=50), th.astype(np.float64), [np.inf, -np.inf]])
        vals = vals.astype(rng.choice([np.float32, np.float64]))
        same(c_ops.bucketize(vals, th), ref_ops.bucketize(vals, th))


def test_agree_philox(c_ops, ref_ops):
    rng = np.random.default_rng(108)
    for trial in range(500):
        counter = tuple(int(w) for w in rng.integers(0, 2**32, size=4, dtype=np.uint64))
        key = tuple(int(w) for w in rng.integers(0, 2**32, size=2, dtype=np.uint64))
        assert tuple(c_ops.philox4x32(counter, key)) == tuple(ref_ops.philox4x32(counter, key))
    for trial in range(100):
        seed = int(rng.integers(0, 2**64, dtype=np.uint64))
        offset = int(rng.integers(0, 2**64, dtype=np.uint64)) if trial % 2 else 2**64 - int(rng.integers(1, 50))
        n = int(rng.integers(0, 200))
        uc = c_ops.philox_uniform(n, seed=seed, offset=offset)
        ur = ref_ops.philox_uniform(n, seed=seed, offset=offset)
        assert isinstance(uc, np.ndarray) and uc.dtype == np.float64
        np.testing.assert_array_equal(uc, ur)  # exact: x0 * 2^-32


def test_agree_torch_inputs(c_ops, ref_ops):
    """C outputs follow the input library (torch here); values equal the reference's."""
    rng = np.random.default_rng(109)
    x = random_logits(rng, (3, 40))
    tx = torch.from_numpy(x)
    out = c_ops.topk_entropy(tx, 7)
    assert isinstance(out, torch.Tensor)
    same(out, ref_ops.topk_entropy(tx, 7))
    bs, bn = torch.zeros(3, dtype=torch.float32), torch.tensor([-1, 0, 1])
    c_out, r_out = c_ops.expand(tx, bs, bn, 5, node_offset=2), ref_ops.expand(tx, bs, bn, 5, node_offset=2)
    for c, r in zip(c_out, r_out):
        assert isinstance(c, torch.Tensor)
        same(c, r)
    tokens, parents, _ = random_tree(rng, 3, 40, logits=x)
    tt, tp = torch.from_numpy(tokens), torch.from_numpy(parents)
    pc, nc, dc = c_ops.verify_sample(tt, tp, tx, temperature=0.9, seed=3, offset=4)
    pr, nr, dr = ref_ops.verify_sample(tt, tp, tx, temperature=0.9, seed=3, offset=4)
    assert isinstance(pc, torch.Tensor)
    same(pc, pr)
    assert (nc, dc) == (nr, dr)


# ---------------------------------------------------------------------------------------------- hypothesis

score_elems = st.one_of(
    st.sampled_from([0.0, -1.0, 1.0, -np.inf, np.inf, 2.5]),  # ties and infinities
    st.floats(allow_nan=False, width=32),
)


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
@given(data=st.data())
def test_hyp_bucketize(c_ops, ref_ops, data):
    tdtype = data.draw(st.sampled_from([np.float32, np.float64]))
    th = np.array(
        sorted(set(data.draw(st.lists(st.floats(allow_nan=False, width=32), max_size=20)))), dtype=tdtype
    )
    th = np.unique(th)
    vdtype = data.draw(st.sampled_from([np.float32, np.float64]))
    width = 32 if vdtype == np.float32 else 64
    vals = data.draw(
        hnp.arrays(
            vdtype,
            st.integers(0, 40),
            elements=st.one_of(
                st.floats(allow_nan=False, width=width),
                st.sampled_from(th.astype(vdtype).tolist() or [0.0]),  # values equal to a threshold
            ),
        )
    )
    out = to_numpy(ref_ops.bucketize(vals, th))
    same(c_ops.bucketize(vals, th), out)
    t64, v64 = th.astype(np.float64), vals.astype(np.float64)
    for v, b in zip(v64, out):
        assert 0 <= b <= len(th)
        assert b == 0 or v > t64[b - 1]
        assert b == len(th) or v <= t64[b]


@st.composite
def candidate_forests(draw):
    m = draw(st.integers(1, 40))
    parents = [-1]
    for i in range(1, m):
        parents.append(draw(st.integers(-1, i - 1)))
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=m, max_size=m))
    picks = draw(st.lists(st.integers(0, m - 1), max_size=m))
    id_dtype = draw(st.sampled_from([np.int32, np.int64]))
    parents = np.array(parents, id_dtype)
    return np.array(tokens, id_dtype), parents, parent_closure(parents, picks).astype(id_dtype), draw(
        st.integers(0, 2**40)
    )


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


logit_elems = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, -np.inf]), st.floats(-60, 60, allow_nan=False, width=32)
)


@st.composite
def expand_inputs(draw):
    b = draw(st.integers(1, 4))
    v = draw(st.integers(1, 16))
    x = draw(hnp.arrays(np.float32, (b, v), elements=logit_elems))
    x[:, 0] = np.where(np.isinf(x).all(axis=1), 0.0, x[:, 0])
    k = draw(st.integers(1, v))
    bs = draw(hnp.arrays(np.float32, b, elements=st.one_of(st.just(-np.inf), st.floats(-100, 0, width=32))))
    bn = draw(hnp.arrays(np.int64, b, elements=st.integers(-1, 100)))
    d2t = draw(st.one_of(st.none(), hnp.arrays(np.int64, v, elements=st.integers(0, 50))))
    off = draw(st.integers(0, 10**6))
    return x, bs, bn, k, d2t, off


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
