"""The entropy family of ops, topk_entropy and bucketize: every test of the family in one file, as the C sources are
(csrc/core/entropy.c, csrc/cuda/entropy.cu, csrc/py/entropy.c, heterospec/reference/entropy.py; docs/ops.md).

In order: the cases against brute-force expectations (C core and NumPy twin, fixture ``impl``); the C core against
the NumPy twin on random input; batched calls against the same calls row by row; bad input (the documented exception
naming the argument); and on the device (``on_device``): CPU <-> CUDA parity and device-side checks, on a real GPU
or on the emulated build (HETEROSPEC_CUDA=emu, CI stage 2), skipped elsewhere."""
import math
import re

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from _agree import HYP, random_logits, same
from _bad import BN, BS, TH, V5, L, case, check_bad_input, noncontig, with_value
from _cases import SIZES, TOL, entropy_oracle, k_values, rows_for
from _device import (
    LOGIT_DTYPES,
    REAL,
    D,
    _deferred_error,
    _poisoned_outputs,
    close,
    logits,
    on_device,
)
from _dlpack import EmuCuda
from conftest import to_numpy
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from heterospec import ops

# ---- against brute-force expectations, C core and NumPy twin (fixture `impl`) --------------------------------------


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


# ---- C core against the NumPy twin on random (hypothesis) inputs ---------------------------------------------------


def test_agree_topk_entropy(c_ops, ref_ops):
    rng = np.random.default_rng(101)
    for trial in range(200):
        v = int(rng.choice([1, 2, 7, 33, 111, 1000]))
        n = int(rng.integers(0, 6))
        x = random_logits(rng, (n, v), rng.choice([np.float16, np.float32]), scale=rng.choice([0.1, 2.0, 30.0]))
        k = int(rng.integers(1, v + 1))
        t = float(rng.choice([1.0, 0.3, 2.5, 1e-3, 50.0]))
        same(c_ops.topk_entropy(x, k, t), ref_ops.topk_entropy(x, k, t), f"trial {trial}")


def test_agree_bucketize(c_ops, ref_ops):
    rng = np.random.default_rng(107)
    for trial in range(200):
        th = np.unique(rng.normal(size=int(rng.integers(0, 30))) * rng.choice([1e-3, 1, 1e6]))
        th = th.astype(rng.choice([np.float32, np.float64]))
        th = np.unique(th)  # float32 rounding can merge values
        vals = np.concatenate([rng.normal(size=50), th.astype(np.float64), [np.inf, -np.inf]])
        vals = vals.astype(rng.choice([np.float32, np.float64]))
        same(c_ops.bucketize(vals, th), ref_ops.bucketize(vals, th))


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


# ---- batched calls equal to the same calls row by row --------------------------------------------------------------


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


# ---- bad input: the documented exception, naming the argument ------------------------------------------------------


CASES = []
case(CASES, "te-int-logits", TypeError, "logits", lambda m: m.topk_entropy(L.astype(np.int32), 2))
case(CASES, "te-float64-logits", TypeError, "logits", lambda m: m.topk_entropy(L.astype(np.float64), 2))
case(CASES, "te-str-logits", TypeError, "logits", lambda m: m.topk_entropy("logits", 2))
case(CASES, "te-1d", ValueError, "logits", lambda m: m.topk_entropy(L[0], 2))
case(CASES, "te-4d", ValueError, "logits", lambda m: m.topk_entropy(L[None, None], 2))  # 3-D is the batched form
case(CASES, "te-noncontig", ValueError, "logits", lambda m: m.topk_entropy(noncontig(L), 2))
case(CASES, "te-k-range", ValueError, "k",
     lambda m: m.topk_entropy(L, 0), lambda m: m.topk_entropy(L, 8), lambda m: m.topk_entropy(L, -1))
case(CASES, "te-k-float", TypeError, "k", lambda m: m.topk_entropy(L, 2.0))
case(CASES, "te-temperature", ValueError, "temperature",
     lambda m: m.topk_entropy(L, 2, 0.0), lambda m: m.topk_entropy(L, 2, -1.0),
     lambda m: m.topk_entropy(L, 2, float("nan")), lambda m: m.topk_entropy(L, 2, float("inf")),
     lambda m: m.topk_entropy(L, 2, 5e-324), lambda m: m.topk_entropy(L, 2, 9.9e-31))  # below 1e-30 (docs/ops.md)
case(CASES, "te-nan", ValueError, "logits", lambda m: m.topk_entropy(with_value(L, (1, 3), np.nan), 2))
case(CASES, "te-posinf", ValueError, "logits", lambda m: m.topk_entropy(with_value(L, (2, 0), np.inf), 2))
case(CASES, "te-all-neginf", ValueError, "logits", lambda m: m.topk_entropy(with_value(L, 1, -np.inf), 2))
case(CASES, "bu-int-values", TypeError, "values", lambda m: m.bucketize(np.arange(5), TH))
case(CASES, "bu-int-thresholds", TypeError, "thresholds", lambda m: m.bucketize(V5, np.arange(3)))
case(CASES, "bu-f16-values", TypeError, "values", lambda m: m.bucketize(V5.astype(np.float16), TH))
case(CASES, "bu-thresholds-order", ValueError, "thresholds",
     lambda m: m.bucketize(V5, np.array([0.0, -1.0])), lambda m: m.bucketize(V5, np.array([0.0, 0.0, 1.0])))
case(CASES, "bu-thresholds-nan", ValueError, "thresholds", lambda m: m.bucketize(V5, np.array([0.0, np.nan])))
case(CASES, "bu-values-nan", ValueError, "values", lambda m: m.bucketize(with_value(V5, 3, np.nan), TH))
case(CASES, "bu-values-2d", ValueError, "values", lambda m: m.bucketize(V5[:4].reshape(2, 2), TH))
case(CASES, "bu-noncontig", ValueError, "values", lambda m: m.bucketize(noncontig(V5), TH))


@pytest.mark.parametrize("fn,exc,arg", CASES)
def test_bad_input(impl, fn, exc, arg, request):
    check_bad_input(impl, fn, exc, arg, request)


def test_message_names_row_and_column(impl):
    x = with_value(L, (2, 5), np.nan)
    with pytest.raises(ValueError, match=r"^topk_entropy: argument 'logits'") as info:
        impl.topk_entropy(x, 2)
    msg = str(info.value)
    assert re.search(r"\b2\b", msg) and re.search(r"\b5\b", msg), msg
    with pytest.raises(ValueError, match=r"^expand: argument 'logits'") as info:
        impl.expand(with_value(L, 1, -np.inf), BS, BN, 2)
    assert re.search(r"\b1\b", str(info.value)), str(info.value)


# ---- on the device: CPU <-> CUDA parity (a real GPU, or the emulated build), device-side checks --------------------


@on_device
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("V,k", [(1, 1), (7, 3), (111, 10), (1000, 1), (1000, 1000), (3001, 64)])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_entropy_parity(dtype, V, k, ties):
    rng = np.random.default_rng(V * 7 + k)
    x = logits(rng, 3, V, ties)
    x[1, :: max(V // 5, 1)] = -np.inf
    x[1, 0] = 0.5
    dev, cpu = D.put_logits(x, dtype)
    for t in (1.0, 0.7):
        close(D.get(ops.topk_entropy(dev, k, t)), ops.topk_entropy(cpu, k, t).numpy())


@on_device
@pytest.mark.parametrize("N,T", [(0, 3), (1, 0), (100, 7), (1000, 1)])
def test_bucketize_parity(N, T):
    rng = np.random.default_rng(N + T)
    v = rng.normal(size=N)
    t = np.sort(rng.normal(size=T))
    if N:
        v[: min(N, T)] = t[: min(N, T)] if T else v[:0]
    np.testing.assert_array_equal(D.get(ops.bucketize(D.put(v), D.put(t))), ops.bucketize(v, t))


@on_device
@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize("V,k", [(111, 10), (3001, 64), (3001, 300)])   # split rows, and k above the split path's
def test_batched_topk_entropy_on_the_device_equals_the_cpu_batch(dtype, V, k):
    rng = np.random.default_rng(V + k)
    B, N = 3, 2
    x = logits(rng, B * N, V, ties=True)
    x[3, ::5] = -np.inf
    dx, cpu_x = D.put_logits(x, dtype)
    dx = dx.reshape(B, N, V) if REAL else EmuCuda(D.get(dx).reshape(B, N, V), bf16=dtype == "bfloat16")
    dev = D.get(ops.topk_entropy(dx, k, 0.8))
    assert dev.shape == (B, N)
    close(dev, D.get(ops.topk_entropy(cpu_x.reshape(B, N, V), k, 0.8)))


@on_device
@pytest.mark.parametrize("V,k", [(8192, 64), (8192, 100)] + ([(40000, 100)] if REAL else []))
@pytest.mark.parametrize("ties", [False, True])
def test_topk_entropy_merge_at_and_past_its_shared_memory_sort(V, k, ties):
    """The split topk_entropy's merge takes the k best of the row's C * k candidates from a shared-memory sort up to
    2,048 (8192 x 64 in the emulation: 32 chunks, the sort at its largest) and by binary-search ranks past it
    (8192 x 100 in the emulation, 40000 x 100 on a GPU).  One row, one dtype: the rest is the batched test's."""
    rng = np.random.default_rng(V * 3 + k + ties)
    x = logits(rng, 1, V, ties)
    dev, cpu = D.put_logits(x, "float32")
    close(D.get(ops.topk_entropy(dev, k, 0.8)), ops.topk_entropy(cpu, k, 0.8))


@on_device
def test_a_refused_topk_entropy_row_is_zero_and_the_others_are_the_cpus(monkeypatch):
    _poisoned_outputs(monkeypatch)
    for k in (3, 300):
        x = np.random.default_rng(k).normal(0, 1, (3, 500)).astype(np.float32)
        clean = x.copy()
        x[1, 4] = np.nan
        dev, _ = D.put_logits(x, "float32")
        got = D.get(ops.topk_entropy(dev, k, check=False))
        want = ops.topk_entropy(clean, k)
        assert got[1] == 0.0
        np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], rtol=1e-5)
        _deferred_error(r"argument 'logits' expected finite values .*got nan at \[1, 4\]")
