"""The verify family of ops, verify_greedy, verify_sample and the Philox helpers: every test of the family in one
file, as the C sources are (csrc/core/verify.c, csrc/cuda/verify.cu, csrc/py/verify.c,
heterospec/reference/verify.py; docs/ops.md).

In order: the cases against brute-force expectations (C core and NumPy twin, fixture ``impl``); the C core against
the NumPy twin on random input; batched calls against the same calls row by row; bad input (the documented exception
naming the argument); and on the device (``on_device``): CPU <-> CUDA parity and device-side checks, on a real GPU
or on the emulated build (HETEROSPEC_CUDA=emu, CI stage 2), skipped elsewhere."""
import zlib

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from _agree import random_logits, same
from _bad import (
    BN,
    BS,
    BT_PAR,
    BT_SEL,
    BT_TOK,
    SL,
    TL,
    TP,
    TT,
    V5,
    L,
    S,
    _forced,
    both_verifiers,
    case,
    check_bad_input,
    kv_t,
    noncontig,
    readonly,
    vs,
    with_value,
)
from _batches import _batch
from _cases import (
    BAD_SEED_OFFSET,
    SAMPLE_SETTINGS,
    SEEDS_OFFSETS,
    TENSOR_KINDS,
    FakeCudaInt64,
    as_tensor,
    check_expand,
    check_tree,
    same_sample,
    sample_case,
    tensor_value,
)
from _device import (
    LOGIT_DTYPES,
    REAL,
    D,
    _expand_matches_cpu,
    _poisoned_outputs,
    _root_draws_match,
    _sample_both,
    _split_logits,
    _tree_and_logits,
    close,
    logits,
    need_gpu,
    on_device,
)
from _dlpack import EmuCuda
from _oracles import (
    PHILOX_KATS,
    argmax_loop,
    greedy_brute,
    philox,
    random_tree,
    sample_walk,
    tree_oracle,
    uniform,
)
from conftest import to_numpy

from heterospec import ops

# ---- against brute-force expectations, C core and NumPy twin (fixture `impl`) --------------------------------------


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


def test_verify_greedy_wide_rows_tie_to_the_lower_id_and_name_the_first_bad_column(impl):
    """Rows past the 8-lane blocks of the C core's float32 argmax: the maximum held by several columns in
    different lanes and blocks (and in the tail) goes to the lowest; -0.0 equals 0.0; the first NaN / +inf column
    is the one named, wherever the others are."""
    tokens, parents = np.array([0]), np.array([-1])
    x = np.full((1, 1003), -5.0, dtype=np.float32)
    x[0, [17, 500, 1001]] = 2.5
    assert impl.verify_greedy(tokens, parents, x)[1] == 17
    x[0, 9] = 2.5
    assert impl.verify_greedy(tokens, parents, x)[1] == 9
    z = np.full((1, 21), -np.inf, dtype=np.float32)
    z[0, 19], z[0, 20] = -0.0, 0.0
    assert impl.verify_greedy(tokens, parents, z)[1] == 19
    x[0, 700], x[0, 600], x[0, 1002] = np.inf, np.nan, np.nan
    with pytest.raises(ValueError, match=r"got nan at \D*0\D+600\b"):
        impl.verify_greedy(tokens, parents, x)
    x[0, 600] = 0.0
    with pytest.raises(ValueError, match=r"got \+?inf at \D*0\D+700\b"):
        impl.verify_greedy(tokens, parents, x)


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


@pytest.mark.parametrize("setting", SAMPLE_SETTINGS, ids=lambda s: "T%s-k%s-p%s-minp%s" % s)
def test_verify_sample_matches_walk(impl, setting):
    temperature, top_k, top_p, min_p = setting
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
                tokens, parents, x, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset,
                min_p=min_p)
            w_path, w_next, w_draws = sample_walk(tokens, parents, x, temperature, top_k, top_p, seed, offset, min_p)
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


# ---- C core against the NumPy twin on random (hypothesis) inputs ---------------------------------------------------


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
    [(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.5, 2, 1.0, 0.0), (1.0, 0, 0.7, 0.0), (0.9, 5, 0.95, 0.0),
     (1.0, 10**6, 0.999, 0.0), (3.0, 1, 0.2, 0.0), (1.0, 0, 1.0, 0.3), (0.9, 5, 0.95, 0.1), (1.2, 0, 0.7, 0.05)],
    ids=lambda s: "T%s-k%s-p%s-minp%s" % s,
)
def test_agree_verify_sample(c_ops, ref_ops, setting):
    temperature, top_k, top_p, min_p = setting
    rng = np.random.default_rng(105)
    for trial in range(60):
        v = int(rng.choice([1, 2, 6, 8, 50]))
        n = int(rng.integers(1, 20))
        x = random_logits(rng, (n, v), rng.choice([np.float16, np.float32]), scale=rng.choice([0.5, 1.5, 4.0]))
        tokens, parents, _ = random_tree(rng, n, v, p_greedy=0.7, logits=x)
        id_dtype = rng.choice([np.int32, np.int64])  # same dtype for both (mixing: test_mixed_id_dtypes)
        tokens, parents = tokens.astype(id_dtype), parents.astype(id_dtype)
        for s in range(30):
            seed = int(rng.integers(0, 2**64, dtype=np.uint64)) if s % 3 else s
            offset = int(rng.integers(0, 2**64, dtype=np.uint64)) if s % 2 else 64 * s
            kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, offset=offset)
            pc, nc, dc = c_ops.verify_sample(tokens, parents, x, **kw)
            pr, nr, dr = ref_ops.verify_sample(tokens, parents, x, **kw)
            same(pc, pr, f"path trial {trial} seed {seed} offset {offset}")
            assert type(nc) is int and nc == nr, (trial, seed, offset)
            assert type(dc) is int and dc == dr, (trial, seed, offset)


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


# ---- batched calls equal to the same calls row by row --------------------------------------------------------------


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
@pytest.mark.parametrize("setting", [(1.0, 0, 1.0, 0.0), (0.7, 5, 0.9, 0.0), (1.0, 0, 0.9, 0.2)])
def test_sample_batch_equals_its_rows_with_per_row_seeds(impl, seed, setting):
    temperature, top_k, top_p, min_p = setting
    rng = np.random.default_rng(10 + seed)
    B, T, V = 4, 7, 25
    counts = rng.integers(1, T + 1, B)
    tok, par, x = _batch(rng, B, T, V, counts)
    seeds = rng.integers(0, 2**62, B).astype(np.int64)
    offsets = rng.integers(0, 1000, B).astype(np.int64)
    start = offsets.copy()
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
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


# ---- bad input: the documented exception, naming the argument ------------------------------------------------------


CASES = []
case(CASES, "vf-float-tokens", TypeError, "tree_tokens", *both_verifiers(tokens=TT.astype(np.float64)))
case(CASES, "vf-float-parents", TypeError, "tree_parents", *both_verifiers(parents=TP.astype(np.float32)))
case(CASES, "vf-int-logits", TypeError, "target_logits", *both_verifiers(logits=TL.astype(np.int32)))
case(CASES, "vf-parents-len", ValueError, "tree_parents", *both_verifiers(parents=np.array([-1, 0])))
case(CASES, "vf-logits-rows", ValueError, "target_logits", *both_verifiers(logits=TL[:2].copy()))
case(CASES, "vf-logits-1d", ValueError, "target_logits", *both_verifiers(logits=TL[0].copy()))
case(CASES, "vf-parents-root", ValueError, "tree_parents", *both_verifiers(parents=np.array([0, 0, 0])))
case(CASES, "vf-parents-order", ValueError, "tree_parents",
     *both_verifiers(parents=np.array([-1, 0, 2])), *both_verifiers(parents=np.array([-1, 2, 0])))
case(CASES, "vf-parents-range", ValueError, "tree_parents", *both_verifiers(parents=np.array([-1, -2, 0])))
case(CASES, "vf-tokens-range", ValueError, "tree_tokens",
     *both_verifiers(tokens=np.array([0, 5, 1])), *both_verifiers(tokens=np.array([0, 1, -1])),
     *both_verifiers(tokens=np.array([5, 1, 2])))  # the root's token is checked too
case(CASES, "vf-logits-nan", ValueError, "target_logits", *both_verifiers(logits=with_value(TL, (0, 2), np.nan)))
case(CASES, "vf-logits-posinf", ValueError, "target_logits", *both_verifiers(logits=with_value(TL, (0, 4), np.inf)))
case(CASES, "vf-logits-all-neginf", ValueError, "target_logits", *both_verifiers(logits=with_value(TL, 0, -np.inf)))
case(CASES, "vf-visited-row-nan", ValueError, "target_logits", *both_verifiers(logits=with_value(_forced, (1, 3), np.nan)))
case(CASES, "vf-noncontig", ValueError, "target_logits", *both_verifiers(logits=noncontig(TL)))
case(CASES, "vf-noncontig-tokens", ValueError, "tree_tokens", *both_verifiers(tokens=noncontig(TT)))
case(CASES, "vs-temperature", ValueError, "temperature",
     lambda m: vs(m, temperature=0.0), lambda m: vs(m, temperature=-0.5),
     lambda m: vs(m, temperature=float("nan")), lambda m: vs(m, temperature=float("inf")),
     lambda m: vs(m, temperature=5e-324), lambda m: vs(m, temperature=9.9e-31))
case(CASES, "vs-temperature-type", TypeError, "temperature", lambda m: vs(m, temperature="1.0"))
case(CASES, "vs-top-k", ValueError, "top_k", lambda m: vs(m, top_k=-1))
case(CASES, "vs-top-k-type", TypeError, "top_k", lambda m: vs(m, top_k=1.5))
case(CASES, "vs-top-p", ValueError, "top_p",
     lambda m: vs(m, top_p=0.0), lambda m: vs(m, top_p=1.5), lambda m: vs(m, top_p=-0.1),
     lambda m: vs(m, top_p=float("nan")))
case(CASES, "vs-min-p", ValueError, "min_p",
     lambda m: vs(m, min_p=-0.1), lambda m: vs(m, min_p=1.5), lambda m: vs(m, min_p=float("nan")))
case(CASES, "vs-min-p-type", TypeError, "min_p", lambda m: vs(m, min_p="0.1"), lambda m: vs(m, min_p=None))
case(CASES, "vs-seed", ValueError, "seed", lambda m: vs(m, seed=-1), lambda m: vs(m, seed=2**64))
case(CASES, "vs-seed-type", TypeError, "seed", lambda m: vs(m, seed=1.0))
case(CASES, "vs-offset", ValueError, "offset", lambda m: vs(m, offset=-1), lambda m: vs(m, offset=2**64))
case(CASES, "kv-not-a-list", TypeError, "tensors", lambda m: m.kv_compact(kv_t(), 2, SL))
case(CASES, "kv-element-not-array", TypeError, "tensors", lambda m: m.kv_compact([kv_t(), 5], 2, SL))
case(CASES, "kv-1d", ValueError, "tensors", lambda m: m.kv_compact([np.zeros(10)], 2, SL))
case(CASES, "kv-noncontig", ValueError, "tensors", lambda m: m.kv_compact([kv_t(), noncontig(kv_t())], 2, SL))
case(CASES, "kv-readonly", BufferError, "tensors", lambda m: m.kv_compact([readonly()], 2, SL))
case(CASES, "kv-slots-float", TypeError, "slots", lambda m: m.kv_compact([kv_t()], 2, SL.astype(np.float64)))
case(CASES, "kv-slots-3d", ValueError, "slots", lambda m: m.kv_compact([kv_t()], 2, SL.reshape(1, 1, 2)))
case(CASES, "kv-slots-order", ValueError, "slots",
     lambda m: m.kv_compact([kv_t()], 2, np.array([3, 1])), lambda m: m.kv_compact([kv_t()], 2, np.array([2, 2])))
case(CASES, "kv-slots-below-i", ValueError, "slots",
     lambda m: m.kv_compact([kv_t()], 2, np.array([-1, 3])), lambda m: m.kv_compact([kv_t()], 2, np.array([0, 1, 1])))
case(CASES, "kv-slots-past-S", ValueError, "slots",
     lambda m: m.kv_compact([kv_t()], 2, np.array([1, 8])),
     lambda m: m.kv_compact([kv_t(20), kv_t(9)], 0, np.array([0, 9])))  # only the second tensor is too short
case(CASES, "kv-plen-negative", ValueError, "prefix_len", lambda m: m.kv_compact([kv_t()], -1, SL))
case(CASES, "kv-plen-float", TypeError, "prefix_len", lambda m: m.kv_compact([kv_t()], 2.0, SL))
# -1 padding: entries from the first -1 on are ignored and must all be -1
case(CASES, "kv-slots-pad-then-valid", ValueError, "slots",
     lambda m: m.kv_compact([kv_t()], 2, np.array([0, -1, 3])), lambda m: m.kv_compact([kv_t()], 2, np.array([-1, 0])),
     lambda m: m.kv_compact([kv_t()], 2, np.array([1, -1, -1, 4], np.int32)),
     lambda m: m.kv_compact([kv_t()], 2, np.array([1, -2])))  # -2 is no padding: slots[1] >= 1
case(CASES, "kv-slots-overflow", ValueError, "slots",  # prefix_len + slot overflows int64: refused, never wrapped
     lambda m: m.kv_compact([kv_t()], 2**62, np.array([2**62])),
     lambda m: m.kv_compact([kv_t()], np.array(2**63 - 1), np.array([0, 2**63 - 1])))
# prefix_len as an int64 array with exactly one element (shape [] or [1])
case(CASES, "kv-plen-array-negative", ValueError, "prefix_len",
     lambda m: m.kv_compact([kv_t()], np.array([-1]), SL), lambda m: m.kv_compact([kv_t()], np.array(-3), SL),
     lambda m: m.kv_compact([kv_t()], np.array([-1]), np.full(2, -1)))  # refused even when nothing moves
case(CASES, "kv-plen-array-dtype", TypeError, "prefix_len",
     lambda m: m.kv_compact([kv_t()], np.array([2], np.int32), SL),
     lambda m: m.kv_compact([kv_t()], np.array([2.0]), SL),
     lambda m: m.kv_compact([kv_t()], np.array([True]), SL),
     lambda m: m.kv_compact([kv_t()], torch.tensor([2], dtype=torch.int32), SL))
case(CASES, "kv-plen-array-size", ValueError, "prefix_len",
     lambda m: m.kv_compact([kv_t()], np.array([2, 3]), SL), lambda m: m.kv_compact([kv_t()], np.zeros(0, np.int64), SL),
     lambda m: m.kv_compact([kv_t()], np.array([[2]]), SL),
     lambda m: m.kv_compact([kv_t()], torch.tensor([1, 2]), SL))
# KVTensors: the checks of kv_compact's 'tensors', once
case(CASES, "kt-not-a-list", TypeError, "tensors", lambda m: m.KVTensors(kv_t()), lambda m: m.KVTensors(5))
case(CASES, "kt-element-not-array", TypeError, "tensors", lambda m: m.KVTensors([kv_t(), "x"]))
case(CASES, "kt-1d", ValueError, "tensors", lambda m: m.KVTensors([np.zeros(10)]))
case(CASES, "kt-noncontig", ValueError, "tensors", lambda m: m.KVTensors([noncontig(kv_t())]))
case(CASES, "kt-readonly", BufferError, "tensors", lambda m: m.KVTensors([kv_t(), readonly()]))
case(CASES, "kt-overlap", ValueError, "tensors", lambda m: (lambda t: m.KVTensors([t, t[1:]]))(kv_t()))
case(CASES, "kv-kvtensors-slots", ValueError, "slots",
     lambda m: m.kv_compact(m.KVTensors([kv_t()]), 2, np.array([3, 1])),
     lambda m: m.kv_compact(m.KVTensors([kv_t(20), kv_t(9)]), 0, np.array([0, 9])))
case(CASES, "kv-kvtensors-plen", ValueError, "prefix_len", lambda m: m.kv_compact(m.KVTensors([kv_t()]), np.array([-1]), SL))
case(CASES, "ph-counter-len", ValueError, "counter", lambda m: m.philox4x32((0, 0, 0), (0, 0)))
case(CASES, "ph-key-len", ValueError, "key", lambda m: m.philox4x32((0, 0, 0, 0), (0, 0, 0)))
case(CASES, "ph-counter-range", ValueError, "counter",
     lambda m: m.philox4x32((0, 2**32, 0, 0), (0, 0)), lambda m: m.philox4x32((0, 0, -1, 0), (0, 0)))
case(CASES, "ph-key-range", ValueError, "key", lambda m: m.philox4x32((0, 0, 0, 0), (2**32, 0)))
case(CASES, "ph-counter-type", TypeError, "counter", lambda m: m.philox4x32((0, 1.5, 0, 0), (0, 0)))
case(CASES, "pu-n", ValueError, "n", lambda m: m.philox_uniform(-1, seed=0, offset=0))
case(CASES, "pu-n-type", TypeError, "n", lambda m: m.philox_uniform(2.0, seed=0, offset=0))
case(CASES, "pu-seed", ValueError, "seed", lambda m: m.philox_uniform(2, seed=-1, offset=0))
case(CASES, "pu-offset", ValueError, "offset", lambda m: m.philox_uniform(2, seed=0, offset=2**64))


@pytest.mark.parametrize("fn,exc,arg", CASES)
def test_bad_input(impl, fn, exc, arg, request):
    check_bad_input(impl, fn, exc, arg, request)


def test_empty_tree(impl):
    empty = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match=r"argument '(tree_tokens|tree_parents|target_logits)'"):
        impl.verify_greedy(empty, empty, np.zeros((0, 5), np.float32))
    with pytest.raises(ValueError, match=r"argument '(tree_tokens|tree_parents|target_logits)'"):
        vs(impl, empty, empty, np.zeros((0, 5), np.float32))


def test_keyword_only_arguments(impl):
    with pytest.raises(TypeError):
        impl.verify_sample(TT, TP, TL, 1.0, 0, 1.0, 0, 0)  # temperature.. must be keywords
    with pytest.raises(TypeError):
        impl.verify_sample(TT, TP, TL, temperature=1.0, offset=0)  # seed is required
    with pytest.raises(TypeError):
        impl.philox_uniform(3, 0, 0)


def test_unvisited_rows_are_not_checked(impl):
    x = with_value(_forced, 2, np.nan)  # row 2 (node 2) is never visited: node 1 is always taken
    x = with_value(x, (1, 0), 5.0)  # row 1 has a clear argmax (0); node 1 is a leaf
    path, nxt = impl.verify_greedy(TT, TP, x)
    assert np.asarray(path).tolist() == [0, 1] and nxt == 0
    path, nxt, draws = vs(impl, logits=x)
    assert np.asarray(path).tolist() == [0, 1] and draws == 2


def test_valid_edge_values_accepted(impl):
    """The boundaries of every range are accepted (so the error tests above are not vacuous)."""
    impl.topk_entropy(L, 1)
    impl.topk_entropy(L, 7)
    impl.expand(L, with_value(BS, 0, -np.inf), with_value(BN, 1, -1), 7, d2t=np.zeros(7, np.int32), node_offset=0)
    impl.select(S, 0)
    impl.select(S, 6)
    impl.build_tree(BT_TOK, BT_PAR, BT_SEL, 0)
    impl.build_tree(BT_TOK, BT_PAR, np.zeros(0, np.int64), 0)
    vs(impl, temperature=1e-6, top_k=0, top_p=1.0, seed=2**64 - 1, offset=2**64 - 1)
    vs(impl, top_k=10**9, top_p=1e-12)
    impl.kv_compact([kv_t()], 2, np.array([1, 7]))  # prefix_len + slots[-1] = S - 1
    impl.kv_compact([kv_t()], 0, np.zeros(0, np.int32))
    impl.kv_compact([kv_t()], np.array(2), np.array([1, 7, -1]))  # a 0-d prefix array, padded slots
    impl.kv_compact([kv_t()], np.array([0]), np.array([-1, -1], np.int32))
    impl.kv_compact(impl.KVTensors([kv_t()]), np.array([8], np.int64), np.array([1]))
    impl.bucketize(V5, np.zeros(0))
    impl.bucketize(V5, np.array([-np.inf, np.inf]))
    assert impl.philox4x32((2**32 - 1,) * 4, (2**32 - 1,) * 2) is not None
    assert impl.philox_uniform(0, seed=2**64 - 1, offset=2**64 - 1).shape == (0,)


# ---- on the device: CPU <-> CUDA parity (a real GPU, or the emulated build), device-side checks --------------------


@on_device
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("n,V", [(1, 5), (8, 111), (30, 1000), (60, 3001)])
def test_verify_greedy_parity(dtype, n, V):
    rng = np.random.default_rng(n * 11 + V)
    for _ in range(3):
        tokens, parents, x = _tree_and_logits(rng, n, V, dtype)
        dev, cpu = D.put_logits(x, dtype)
        wpath, wnext = ops.verify_greedy(tokens, parents, cpu)
        path, nxt = ops.verify_greedy(D.put(tokens), D.put(parents), dev)
        np.testing.assert_array_equal(D.get(path), wpath.numpy() if hasattr(wpath, "numpy") else wpath)
        assert nxt == wnext
        p2, ln, nx = ops.verify_greedy(D.put(tokens), D.put(parents), dev, device_outputs=True)
        assert int(D.get(ln)) == len(wpath) and int(D.get(nx)) == wnext
        assert (D.get(p2)[len(wpath):] == -1).all()


@on_device
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("n,V", [(1, 7), (10, 111), (40, 2000)])
@pytest.mark.parametrize("warp", [dict(), dict(top_k=5), dict(top_p=0.8), dict(top_k=50, top_p=0.9), dict(top_p=0.3),
                                  dict(min_p=0.1), dict(top_p=0.9, min_p=0.05), dict(top_k=50, min_p=0.3)])
def test_verify_sample_parity_same_uniforms_same_path(dtype, n, V, warp):
    rng = np.random.default_rng(n * 13 + V + len(warp))
    for trial in range(4):
        tokens, parents, x = _tree_and_logits(rng, n, V, dtype)
        dev, cpu = D.put_logits(x, dtype)
        kw = dict(temperature=0.8, seed=1234 + trial, offset=trial * 100, **warp)
        wpath, wnext, wdraws = ops.verify_sample(tokens, parents, cpu, **kw)
        path, nxt, draws = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
        np.testing.assert_array_equal(D.get(path), wpath.numpy() if hasattr(wpath, "numpy") else wpath)
        assert (nxt, draws) == (wnext, wdraws)


@on_device
def test_build_tree_not_closed_and_verify_bad_tree_raise():
    with pytest.raises(ValueError, match=r"build_tree: argument 'selected' expected a parent-closed selection, got candidate 2"):
        ops.build_tree(D.put(np.array([1, 2, 3])), D.put(np.array([-1, 0, 1])), D.put(np.array([0, 2])), 0)
    x, _ = D.put_logits(np.zeros((3, 10), np.float32), "float32")
    with pytest.raises(ValueError, match=r"verify_greedy: argument 'tree_parents' expected 0 <= tree_parents\[i\] < i"):
        ops.verify_greedy(D.put(np.array([1, 2, 3])), D.put(np.array([-1, 0, 2])), x)
    with pytest.raises(ValueError, match=r"verify_sample: argument 'tree_tokens' expected ids in \[0, V = 10\)"):
        ops.verify_sample(D.put(np.array([1, 20, 3])), D.put(np.array([-1, 0, 0])), x, temperature=1.0, seed=1, offset=0)


@on_device
@need_gpu
@pytest.mark.statistical     # 4,000 synchronised calls: the sanitizer phase leaves it out (racecheck stalled on it)
def test_sampled_tokens_have_the_target_distribution_on_gpu():
    """Chi-square test of the emitted first token against the warped target distribution (GPU path)."""
    import torch
    from scipy import stats

    rng = np.random.default_rng(3)
    V = 12
    x = rng.normal(0, 1.5, (4, V)).astype(np.float32)
    tokens = np.array([0, 2, 5, 2], np.int64)  # a duplicate sibling token too
    parents = np.array([-1, 0, 0, 0], np.int64)
    z = x[0].astype(np.float64) / 0.9
    p = np.exp(z - z.max())
    p /= p.sum()
    dev_t, dev_p, dev_x = (torch.from_numpy(a).cuda() for a in (tokens, parents, x))
    counts = np.zeros(V)
    n = 4000
    offset = 0
    for _ in range(n):
        path, nxt, draws = ops.verify_sample(dev_t, dev_p, dev_x, temperature=0.9, seed=99, offset=offset)
        offset += draws
        first = int(tokens[int(path[1])]) if len(path) > 1 else nxt
        counts[first] += 1
    # expected counts that sum to the observed total exactly (scipy checks the two sums to 1.5e-8 relative:
    # p * n from float32 logits missed by 8e-8 on the first GPU run)
    assert stats.chisquare(counts, p / p.sum() * counts.sum()).pvalue > 1e-3


@on_device
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_batched_verify_on_the_device_equals_the_cpu_batch(dtype):
    """verify_greedy / verify_sample over [batch, T] trees with per-row node counts, seeds and offsets (device
    arrays, advance_offset per row) give the CPU core's batched results, which the batched cases above show equal
    the rows called one by one."""
    from _batches import _batch

    rng = np.random.default_rng(21)
    B, T, V = 6, 8, 40
    counts = rng.integers(1, T + 1, B).astype(np.int64)
    tok, par, x = _batch(rng, B, T, V, counts)
    x = np.nan_to_num(x, nan=0.0)                     # the padding rows' values do not matter
    dx, cpu_x = D.put_logits(x.reshape(B * T, V), dtype)
    dx = dx.reshape(B, T, V) if REAL else EmuCuda(D.get(dx).reshape(B, T, V), bf16=dtype == "bfloat16")
    cx = cpu_x.reshape(B, T, V)                       # the same values in the same dtype, on the CPU
    g_dev = [D.get(a) for a in ops.verify_greedy(D.put(tok), D.put(par), dx, n=D.put(counts))]
    g_cpu = ops.verify_greedy(tok, par, cx, n=counts)
    for a, b in zip(g_dev, g_cpu):
        assert np.array_equal(a, D.get(b))
    seeds = rng.integers(0, 2**62, B).astype(np.int64)
    offsets = rng.integers(0, 100, B).astype(np.int64)
    d_off = D.put(offsets.copy())   # (the emulated device array shares the host memory it was made from)
    s_dev = [D.get(a) for a in ops.verify_sample(D.put(tok), D.put(par), dx, n=D.put(counts), temperature=0.8,
                                                  top_k=10, top_p=0.9, seed=D.put(seeds), offset=d_off,
                                                  advance_offset=True)]
    c_off = offsets.copy()
    s_cpu = ops.verify_sample(tok, par, cx, n=counts, temperature=0.8, top_k=10, top_p=0.9, seed=seeds, offset=c_off,
                              advance_offset=True)
    for a, b in zip(s_dev, s_cpu):
        assert np.array_equal(a, D.get(b))
    assert np.array_equal(D.get(d_off), c_off) and (c_off == offsets + D.get(s_cpu[3])).all()


@on_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["peaked", "flat", "ties"])
@pytest.mark.parametrize("warp", [dict(), dict(top_p=0.9), dict(top_p=0.999), dict(top_k=7),
                                  dict(top_k=200, top_p=0.8), dict(top_k=300), dict(top_k=7, top_p=0.5),
                                  dict(min_p=0.02), dict(top_p=0.9, min_p=0.1), dict(top_k=300, min_p=0.05)])
def test_split_rows_verify_sample_parity(dtype, shape, warp):
    rng = np.random.default_rng(zlib.crc32(f"{dtype} {shape} {warp}".encode()))  # not hash(): salted per process
    n, V = 6, 3001
    for trial in range(3):
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
        tokens = rng.integers(0, V, n).astype(np.int64)
        x = _split_logits(rng, shape, n, V, tokens, parents)
        dev, cpu = D.put_logits(x, dtype)
        kw = dict(temperature=0.9, seed=77 + trial, offset=trial * 10, **warp)
        want = ops.verify_sample(tokens, parents, cpu, **kw)
        got = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
        np.testing.assert_array_equal(D.get(got[0]), np.asarray(want[0]), err_msg=f"trial {trial}")
        assert got[1:] == want[1:], f"trial {trial}"


@on_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("warp", [dict(top_k=200, top_p=0.8), dict(top_p=0.8), dict(top_k=256, top_p=0.6)])
def test_split_rows_top_p_cut_on_a_tied_run(dtype, warp):
    """The top-p crossing inside a run of equal logits whose length times top_p is a whole number: in real
    arithmetic the cut falls exactly on top_p, so the order of the float sums decides it.  The device must take
    it in the CPU's order (w / W added token by token, best first); the split merge once summed weights and
    divided once, kept one token fewer than the CPU and drew another next token (CI, ties with top_k 200)."""
    V = 3001
    for count in (605, 610, 630, 650):
        rng = np.random.default_rng(count)
        x = rng.integers(-2, 2, (1, V)).astype(np.float32)      # -2 .. 1 everywhere,
        x[0, rng.choice(V, count, replace=False)] = 2.0         # and a run of `count` equal maxima
        tokens, parents = np.zeros(1, np.int64), np.full(1, -1, np.int64)  # a root only: the residual draw
        dev, cpu = D.put_logits(x, dtype)                        # samples the warped row itself
        for trial in range(4):
            kw = dict(temperature=1.0, seed=1000 + trial, offset=trial, **warp)
            want = ops.verify_sample(tokens, parents, cpu, **kw)
            got = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
            assert got[1:] == want[1:], f"count {count}, trial {trial}"


@on_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("warp", [dict(top_k=1000), dict(top_k=1000, top_p=0.9), dict(top_k=2999, top_p=0.5),
                                  dict(top_p=0.95), dict(top_p=0.2)])
def test_wide_rows_a_mix_of_wide_and_decided_rows_equals_the_cpu(dtype, warp):
    """A tree whose rows alternate flat (the wide path) and peaked (decided by the candidates): each row's
    statistics, and so the walk and the residual draw, equal the CPU core's."""
    rng = np.random.default_rng(zlib.crc32(f"wide {dtype} {warp}".encode()))
    n, V = 7, 3001
    for trial in range(3):
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
        tokens = rng.integers(0, V, n).astype(np.int64)
        x = rng.normal(0, 0.05, (n, V)).astype(np.float32)
        for j in range(1, n):
            if parents[j] % 2:                     # odd rows peaked: a decided row among the wide ones
                x[parents[j]] = rng.normal(0, 3, V)
                x[parents[j], tokens[j]] += 12.0
        got, want = _sample_both(tokens, parents, x, dtype, temperature=0.9, seed=5 + trial, offset=trial, **warp)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"trial {trial}")
        assert got[1:] == want[1:], f"trial {trial}"


@on_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("count, top_k", [(700, 700), (700, 701), (700, 699), (1800, 1800)])
def test_wide_rows_top_k_at_a_run_of_equal_maxima(dtype, count, top_k):
    """top_k above HS_CAND_MAX where the k-th largest value is shared: with exactly `count` maxima and top_k =
    count, the maxima's first-level bin is taken whole (the descent stops at level 0); one more or one fewer
    puts the k-th key among the next value's or inside the run (all its ties kept, as on the CPU)."""
    V = 3001
    rng = np.random.default_rng(count + top_k)
    x = rng.integers(-3, 2, (1, V)).astype(np.float32)      # -3 .. 1, and `count` tokens at 4
    x[0, rng.choice(V, count, replace=False)] = 4.0
    _root_draws_match(x, dtype, 300, top_k=top_k)


@on_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("count, top_p", [(2000, 0.5), (2000, 0.75), (2500, 0.9), (1600, 0.3)])
def test_wide_rows_top_p_crossing_inside_a_long_run_of_equal_logits(dtype, count, top_p):
    """The top-p crossing inside a run of `count` equal maxima, longer than all the chunks' candidates: the wide
    descent finds the run's key, then takes its tokens one by one in id order as the CPU adds w / W, and the
    cut token (ptie) is found across chunks.  count * top_p close to a whole number puts the crossing on a
    boundary in real arithmetic, where only the order of the additions decides it (here both sides add the same
    numbers: the rest is -inf, so W is the run's count exactly)."""
    V = 3001
    rng = np.random.default_rng(count)
    x = np.full((1, V), -np.inf, np.float32)
    x[0, rng.choice(V, count, replace=False)] = 1.5
    _root_draws_match(x, dtype, 900, top_p=top_p)


@on_device
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shift", [0.0, -20.0])
@pytest.mark.parametrize("warp", [dict(top_p=0.9), dict(top_k=1000, top_p=0.7), dict(top_k=2000)])
def test_wide_rows_finish_where_the_dtype_has_no_more_key_bits(dtype, shift, warp):
    """A float16 value widened to float32 fixes its key after 19 bits and a bfloat16 one after 16, so the wide
    descent stops at level 2 or 1 and fills in the key's low bits: zeros for a positive value, ones for a negative
    one (shift -20: the same softmax over negative logits, the crossing key negative).  The rows are flat (the
    candidates cannot decide them) and on a grid of 1/256, so tokens share keys in every dtype while a float16
    key still uses all its bits; each draw equals the CPU's."""
    rng = np.random.default_rng(zlib.crc32(f"{dtype} {shift} {warp}".encode()))
    n, V = 4, 3001
    parents = np.array([-1, 0, 0, 1], np.int64)
    tokens = rng.integers(0, V, n).astype(np.int64)
    x = (np.round(rng.normal(0, 1.0, (n, V)) * 256) / 256 + shift).astype(np.float32)   # every float16 bit used
    for trial in range(3):
        got, want = _sample_both(tokens, parents, x, dtype, temperature=1.0, seed=11 + trial, offset=trial, **warp)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"trial {trial}")
        assert got[1:] == want[1:], f"trial {trial}"


@on_device
def test_wide_rows_leave_no_state_for_the_next_call():
    """The wide rows' counters and histograms sit in the module workspace that every op shares: a call with
    wide rows, an expand and a select in between (which write that workspace), then the same call again give
    the same draws as the CPU each time."""
    rng = np.random.default_rng(41)
    n, V = 5, 3001
    parents = np.array([-1, 0, 0, 1, 2], np.int64)
    tokens = rng.integers(0, V, n).astype(np.int64)
    x = rng.normal(0, 0.05, (n, V)).astype(np.float32)
    first = _sample_both(tokens, parents, x, "float32", temperature=0.8, seed=3, offset=0, top_p=0.9)
    other = rng.normal(0, 1, (4, 2000)).astype(np.float32)
    ops.expand(D.put(other), D.put(np.zeros(4, np.float32)), D.put(np.arange(4, dtype=np.int64)), 10)
    again = _sample_both(tokens, parents, x, "float32", temperature=0.8, seed=3, offset=0, top_p=0.9)
    assert first[0][1:] == first[1][1:] and again[0][1:] == again[1][1:] and again[0][1:] == first[0][1:]


@on_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", ["peaked", "ties"])
def test_split_rows_verify_greedy_parity(dtype, shape):
    rng = np.random.default_rng(5 if shape == "ties" else 6)
    n, V = 8, 3001
    for _ in range(3):
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
        tokens = rng.integers(0, V, n).astype(np.int64)
        x = _split_logits(rng, shape, n, V, tokens, parents)
        if shape == "ties":  # the row max appears in several chunks: the lowest id must win
            x[:, 2900] = x[:, 1700] = x[:, 300] = 2.0
        dev, cpu = D.put_logits(x, dtype)
        wpath, wnext = ops.verify_greedy(tokens, parents, cpu)
        path, nxt = ops.verify_greedy(D.put(tokens), D.put(parents), dev)
        np.testing.assert_array_equal(D.get(path), np.asarray(wpath))
        assert nxt == wnext


@on_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 10, 200, 300])
@pytest.mark.parametrize("ties", [False, True])
def test_split_rows_expand_parity(dtype, k, ties):
    rng = np.random.default_rng(k * 2 + ties)
    B, V = 3, 3001
    x = logits(rng, B, V, ties)
    dev, cpu = D.put_logits(x, dtype)
    scores = (-rng.random(B) * 3).astype(np.float64)
    nodes = rng.integers(-1, 50, B).astype(np.int64)
    _expand_matches_cpu(dev, cpu, scores, nodes, k)


@on_device
@pytest.mark.parametrize("warp", [dict(top_p=0.9), dict(top_k=20, top_p=0.95)])
def test_split_rows_batched_sampling_skips_padding_rows(warp):
    """A batch of 3 requests over V = 3001 with ragged node counts: the padding rows hold NaN, which the chunk
    kernels must skip (the CPU core ignores them too); seeds and offsets differ per row."""
    from _batches import _batch

    rng = np.random.default_rng(12)
    B, T, V = 3, 7, 3001
    counts = np.array([7, 2, 5], np.int64)
    tok, par, x = _batch(rng, B, T, V, counts)
    dx, cpu_x = D.put_logits(x.reshape(B * T, V), "float32")
    dx = dx.reshape(B, T, V) if REAL else EmuCuda(D.get(dx).reshape(B, T, V))
    cx = cpu_x.reshape(B, T, V)
    seeds = np.array([3, 4, 5], np.int64)
    offsets = np.array([0, 10, 20], np.int64)
    for temperature in (0.7, 1.5):
        s_dev = [D.get(a) for a in ops.verify_sample(D.put(tok), D.put(par), dx, n=D.put(counts),
                                                      temperature=temperature, seed=D.put(seeds),
                                                      offset=D.put(offsets.copy()), **warp)]
        s_cpu = ops.verify_sample(tok, par, cx, n=counts, temperature=temperature, seed=seeds, offset=offsets.copy(),
                                  **warp)
        for a, b in zip(s_dev, s_cpu):
            assert np.array_equal(a, D.get(b))


@on_device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 10, 200, 300])
@pytest.mark.parametrize("ties", [False, True])
def test_split_rows_topk_entropy_parity(dtype, k, ties):
    rng = np.random.default_rng(k + 1000 * ties)
    x = logits(rng, 4, 3001, ties)
    x[1, ::7] = -np.inf          # whole stretches of -inf, and chunks that hold fewer than k finite values
    x[2, 256:1024] = -np.inf
    dev, cpu = D.put_logits(x, dtype)
    for t in (1.0, 0.6):
        close(D.get(ops.topk_entropy(dev, k, t)), ops.topk_entropy(cpu, k, t).numpy())


@on_device
@need_gpu
@pytest.mark.parametrize("warp", [dict(top_p=0.9), dict(top_k=50), dict()])
def test_split_rows_at_the_benchmark_shape(warp):
    """60 nodes x 128256 bf16 (Llama-3's vocabulary, the cycle benchmark's shape): 9 chunks per row on a GPU;
    greedy and sampled verification equal the CPU core's."""
    rng = np.random.default_rng(60)
    n, V = 60, 128256
    parents = np.array([-1] + [int(rng.integers(max(0, i - 10), i)) for i in range(1, n)], np.int64)
    tokens = rng.integers(0, V, n).astype(np.int64)
    x = _split_logits(rng, "peaked", n, V, tokens, parents)
    dev, cpu = D.put_logits(x, "bfloat16")
    wpath, wnext = ops.verify_greedy(tokens, parents, cpu)
    path, nxt = ops.verify_greedy(D.put(tokens), D.put(parents), dev)
    np.testing.assert_array_equal(D.get(path), np.asarray(wpath))
    assert nxt == wnext
    for trial in range(5):
        kw = dict(temperature=1.0, seed=trial, offset=0, **warp)
        want = ops.verify_sample(tokens, parents, cpu, **kw)
        got = ops.verify_sample(D.put(tokens), D.put(parents), dev, **kw)
        np.testing.assert_array_equal(D.get(got[0]), np.asarray(want[0]))
        assert got[1:] == want[1:]


@on_device
@pytest.mark.parametrize("bad", ["nan", "allneg"])
@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("V", [50, 3001])
def test_a_failed_verify_row_leaves_outputs_later_ops_can_index_and_the_error_recorded(bad, sample, V, monkeypatch):
    """The engine runs verification with check=False and indexes with its outputs on the device before the
    host looks (a scatter at length - 1, the next root token).  A row that fails (a NaN, a row of -inf) must
    leave the root alone and token 0 -- never the allocator's garbage, which would turn into a device-side
    assert of torch's that kills the context -- and its error must be what cuda_check raises."""
    _poisoned_outputs(monkeypatch)
    rng = np.random.default_rng(V)
    tokens = np.array([5, 6, 7], np.int64)
    parents = np.array([-1, 0, 1], np.int64)
    x = rng.normal(0, 1, (3, V)).astype(np.float32)
    if bad == "nan":
        x[0, 11] = np.nan
    else:
        x[0, :] = -np.inf
    dev, _ = D.put_logits(x, "float32")
    if sample:
        path, length, nxt, draws = ops.verify_sample(D.put(tokens), D.put(parents), dev, temperature=1.0, seed=3,
                                                      offset=0, check=False, device_outputs=True)
        assert int(D.get(draws).reshape(-1)[0]) == 0
    else:
        path, length, nxt = ops.verify_greedy(D.put(tokens), D.put(parents), dev, check=False, device_outputs=True)
    assert int(D.get(length).reshape(-1)[0]) == 1 and int(D.get(nxt).reshape(-1)[0]) == 0
    assert int(D.get(path).reshape(-1)[0]) == 0
    with pytest.raises(ValueError, match="expected finite" if bad == "nan" else "at least one"):
        ops.cuda_check(0, stream=0)
    ops.cuda_check(0, stream=0)    # consumed
