"""The few-rows float32 matrix kernel (heterospec._gemm, ``cpu_gemm='rows'``) against its NumPy reference
(heterospec.reference.rows_linear), bit for bit: on every instruction set this CPU has (and the portable loop),
one thread and two, any row count, odd shapes, a bias, strided rows; and the reference's exact rounding
itself against fractions."""
import importlib.util
import os
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from heterospec.models import cpu_gemm  # noqa: E402
from heterospec.reference import rows_linear  # noqa: E402
from heterospec.reference.gemm import _fma32  # noqa: E402

G = cpu_gemm._rows_module()
needs = pytest.mark.skipif(G is None, reason="heterospec._gemm was not built here")
ISAS = range(G.isa_best() + 1) if G is not None else ()


def kernel(x, w, bias=None, isa=None, threads=0, ldx=None):
    """y = x w^T (+ bias) through heterospec._gemm directly; ``ldx``: x's rows taken from a wider array."""
    m, k = x.shape
    n = w.shape[0]
    wt = torch.from_numpy(np.ascontiguousarray(w))
    wp = torch.empty(G.packed_floats(n, k))
    G.pack(wt.data_ptr(), k, wp.data_ptr(), n, k)
    wide = np.zeros((m, ldx or k), np.float32) + np.float32(7.0)   # the gap past k: never read
    wide[:, :k] = x
    xt = torch.from_numpy(wide)
    y = torch.full((m, n + 3), -1.0)                                  # 3 columns past n: never written
    bt = None if bias is None else torch.from_numpy(bias)
    G.linear(xt.data_ptr(), ldx or k, wp.data_ptr(), 0 if bt is None else bt.data_ptr(), y.data_ptr(), n + 3, m, n,
             k, G.isa_best() if isa is None else isa, threads)
    assert (y[:, n:] == -1.0).all()
    return y[:, :n].numpy()


def test_the_kernel_is_built_where_the_sanitized_run_expects_it():
    """CI's sanitized stage builds heterospec._gemm with ASan and runs this file: a missing build skips nothing."""
    if os.environ.get("HETEROSPEC_EXPECT_SANITIZERS") == "1":
        assert G is not None


def exact_fma32(a, b, c):
    """fma(a, b, c) rounded once to float32, with fractions (ties to even)."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    r = np.float32(float(exact))            # within one float32 step of the answer
    cands = sorted({r, np.nextafter(r, np.float32(-np.inf)), np.nextafter(r, np.float32(np.inf))}, key=float)
    best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.uint32)) % 2))
    return np.float32(best)


def test_the_references_fma_rounds_once():
    one_ulp12 = np.float32(1 + 2 ** -12)   # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: halfway between two float32s
    assert _fma32(one_ulp12, one_ulp12, np.float32(0)) == np.float32(1 + 2 ** -11)              # tie: even
    # + 2^-60: just above halfway, where a float64 sum (then float32) would round twice and go down
    assert _fma32(one_ulp12, one_ulp12, np.float32(2 ** -60)) == np.float32(1 + 2 ** -11 + 2 ** -23)
    assert _fma32(one_ulp12, one_ulp12, np.float32(-(2 ** -60))) == np.float32(1 + 2 ** -11)
    rng = np.random.default_rng(0)
    a = rng.standard_normal(3000).astype(np.float32)
    b = rng.standard_normal(3000).astype(np.float32)
    c = np.concatenate([rng.standard_normal(1000), -(a[1000:2000].astype(np.float64) * b[1000:2000]),
                        rng.standard_normal(1000) * 1e-6]).astype(np.float32)
    got = _fma32(a, b, c)
    assert [float(v) for v in got] == [float(exact_fma32(*t)) for t in zip(a, b, c)]


@needs
def test_the_kernel_rounds_the_crafted_case_once():
    """acc = 2^-60 after k = 0, then fma((1 + 2^-12), (1 + 2^-12), acc): one rounding goes up."""
    x = np.array([[2 ** -30, 1 + 2 ** -12]], np.float32)
    w = np.array([[2 ** -30, 1 + 2 ** -12]], np.float32)
    for isa in ISAS:
        assert kernel(x, w, isa=isa)[0, 0] == np.float32(1 + 2 ** -11 + 2 ** -23) == rows_linear(x, w)[0, 0]


@needs
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 17, 3), (13, 100, 37), (7, 40, 576), (2, 33, 1536),
                                   (25, 48, 20), (12, 130, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_equals_rows_linear_bit_for_bit(m, n, k, bias):
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    ref = rows_linear(x, w, b)
    for isa in ISAS:
        for threads in (1, 2, 3):
            np.testing.assert_array_equal(kernel(x, w, b, isa, threads), ref, err_msg=f"isa {isa}, {threads} threads")
    np.testing.assert_array_equal(kernel(x, w, b, ldx=k + 5), ref)
    # and a row's bits never depend on the other rows of the call
    for i in range(m):
        np.testing.assert_array_equal(kernel(x[i:i + 1], w, b), ref[i:i + 1])


@needs
def test_the_kernel_keeps_non_finite_values_in_their_rows_and_columns():
    x = np.ones((3, 8), np.float32)
    w = np.ones((20, 8), np.float32)
    x[1, 2] = np.nan
    w[17, 0] = np.inf
    for isa in ISAS:
        y = kernel(x, w, isa=isa)
        np.testing.assert_array_equal(y, rows_linear(x, w))
        assert np.isnan(y[1]).all() and np.isinf(y[[0, 2], 17]).all()
        assert (y[[0, 2]][:, [c for c in range(20) if c != 17]] == 8.0).all()


@needs
def test_an_empty_sum_is_the_bias():
    b = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(kernel(np.zeros((2, 0), np.float32), np.zeros((5, 0), np.float32), b),
                                  np.stack([b, b]))


@needs
def test_the_kernel_refuses_an_instruction_set_this_cpu_lacks():
    with pytest.raises(ValueError, match=r"linear: argument 'isa' expected 0 to \d on this CPU, got 7"):
        G.linear(8, 1, 8, 0, 8, 1, 1, 1, 1, 7, 1)
    with pytest.raises(TypeError, match="linear: expected 11 integer arguments, got 2"):
        G.linear(1, 2)
    with pytest.raises(ValueError, match="linear: argument 'x' expected the address of CPU memory, got 0"):
        G.linear(0, 1, 8, 0, 8, 1, 1, 1, 1, 0, 1)
    with pytest.raises(ValueError, match="linear: argument 'y' expected the address of CPU memory, got 0"):
        G.linear(8, 1, 8, 0, 0, 1, 1, 1, 1, 0, 1)
    with pytest.raises(ValueError, match="pack: argument 'wp' expected the address of CPU memory, got 0"):
        G.pack(8, 1, 0, 1, 1)


# ---- block codes (rows.h's HSG_Q8 / HSG_Q4): a GGUF checkpoint's weights, read as their codes ------------------

from tests._gguf import q4_1, q5_k, q6_k, q8_0  # noqa: E402


def coded_kernel(x, w, bias=None, isa=None, threads=0, codec=None):
    """y = x w^T (+ bias) with w packed as block codes by cpu_gemm.pack_rows (asserting that it is)."""
    m, k = x.shape
    n = w.shape[0]
    wp = cpu_gemm.pack_rows(torch.from_numpy(np.ascontiguousarray(w)), coded=True)
    assert cpu_gemm.packed_codec(wp) == codec
    assert wp.numel() == G.packed_bytes({"Q8": 1, "Q4": 2, "Q8X": 5, "Q5": 6, "Q8H": 7}[codec], n, k) < 4 * n * k
    y = torch.full((m, n), -1.0)
    bt = None if bias is None else torch.from_numpy(bias)
    G.linear(torch.from_numpy(x).data_ptr(), k, wp.data_ptr(), 0 if bt is None else bt.data_ptr(), y.data_ptr(), n, m,
             n, k, G.isa_best() if isa is None else isa, threads)
    return y.numpy()


@needs
@pytest.mark.parametrize("codec,make", [("Q4", q4_1), ("Q8", q8_0), ("Q5", q5_k), ("Q8H", q6_k)])
# every tile a call of up to 6 rows takes as it is (AVX2: one row, 2 rows, one panel of 3-5 rows in one pass, 6 rows in
# two; AVX-512 likewise), 7-10 rows (AVX2: two such tiles on the codes), then more (the codes decoded once,
# then the float tiles)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (2, 48, 96), (3, 40, 64), (4, 40, 64), (5, 33, 576), (6, 130, 96),
                                   (7, 33, 576), (8, 48, 64), (10, 40, 96), (11, 33, 64), (13, 130, 96), (25, 20, 32)])
def test_coded_weights_give_the_bits_of_their_floats(codec, make, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    w = make(rng.standard_normal((n, k)) * 0.05)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    found = cpu_gemm.block_codes(torch.from_numpy(w))
    assert found is not None and cpu_gemm.CODECS[found[0]] == codec
    # the codes decode to every weight exactly, by the format's own formula (NumPy here)
    _, q, d, off = (v.numpy() if hasattr(v, "numpy") else v for v in found)
    size = k // d.shape[1]
    assert size == (16 if codec == "Q8H" else 32)
    dd = np.repeat(d, size, axis=1)
    decoded = q * dd if off is None else q * dd + np.repeat(off, size, axis=1)
    assert decoded.astype(np.float32).tobytes() == w.tobytes()
    ref = rows_linear(x, w, b)
    for isa in ISAS:
        for threads in (1, 2):
            np.testing.assert_array_equal(coded_kernel(x, w, b, isa, threads, codec), ref,
                                          err_msg=f"isa {isa}, {threads} threads")
    for i in range(m):   # row-invariant, as the float panels
        np.testing.assert_array_equal(coded_kernel(x[i:i + 1], w, b, codec=codec), ref[i:i + 1])


@needs
def test_the_real_gguf_quantizers_weights_are_read_as_their_codes():
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((48, 128)) * 0.02).astype(np.float32)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    for kind, codec in ((T.Q4_1, "Q4"), (T.Q8_0, "Q8")):
        deq = quants.dequantize(quants.quantize(w, kind), kind).astype(np.float32)
        assert cpu_gemm.CODECS[cpu_gemm.block_codes(torch.from_numpy(deq))[0]] == codec
        np.testing.assert_array_equal(coded_kernel(x, deq, codec=codec), rows_linear(x, deq))


# ggml type -> the codec its dequantized weights are read as (rows.h), decided by the format's formula: Q4_1 and
# Q4_K are d * q + m with q in 0..15 (Q4), Q5_1 and Q5_K the same with q in 0..31 (Q5); Q4_0, Q5_0 and Q8_0 are
# d * q with a signed q (Q8: Q4_0 and Q5_0 write their codes 0..15 / 0..31 minus 8 / 16 and have a -0 where d < 0,
# which an offset cannot give); Q6_K and Q3_K the same with a scale per 16 weights (Q8H); Q2_K has an offset per 16
# too (Q8X)
GGUF_CODECS = {"Q4_0": "Q8", "Q4_1": "Q4", "Q5_0": "Q8", "Q5_1": "Q5", "Q8_0": "Q8", "Q2_K": "Q8X", "Q3_K": "Q8H",
               "Q4_K": "Q4", "Q5_K": "Q5", "Q6_K": "Q8H",
               # the grid formats: a scale per 32 (IQ4_XS: d * (ls - 32), exact) times a grid's small signed integers
               # (IQ4_NL's and IQ4_XS's table up to 127, IQ3_XXS's up to 62, IQ2_XXS's 8, 25, 43) is Q8; per 16
               # (IQ2_XS, IQ2_S) Q8H; IQ3_S's odd values 1..15 with signs are 16 levels a step 2 d apart, IQ1_S's
               # grid -1, 0, 1 plus a shift of 1/8 is 3 levels d apart, and the ternary formats' d * (-1, 0, 1) too:
               # Q4's codes above an offset
               "IQ4_NL": "Q8", "IQ4_XS": "Q8", "IQ3_XXS": "Q8", "IQ2_XXS": "Q8", "IQ2_XS": "Q8H", "IQ2_S": "Q8H",
               "IQ3_S": "Q4", "IQ1_S": "Q4", "TQ1_0": "Q4", "TQ2_0": "Q4"}


@needs
@pytest.mark.parametrize("kind", sorted(GGUF_CODECS))
def test_the_k_quants_and_older_gguf_formats_are_read_as_codes(kind):
    """Every ggml block format gguf-py dequantizes with a formula d * q + m: random blocks in the file's own layout,
    dequantized by gguf-py (transformers' loader), read back as codes that decode to every bit (by the codec's
    formula in NumPy) and through the kernel on every instruction set give rows_linear's bits."""
    pytest.importorskip("gguf.quants")
    from tests._gguf import random_blocks

    rng = np.random.default_rng(sorted(GGUF_CODECS).index(kind))
    w, _ = random_blocks(kind, 40, 512, rng)
    found = cpu_gemm.block_codes(torch.from_numpy(w))
    assert found is not None and cpu_gemm.CODECS[found[0]] == GGUF_CODECS[kind]
    size = 16 if GGUF_CODECS[kind] in ("Q8X", "Q8H") else 32
    q, d, off = (None if v is None else v.numpy() for v in found[1:])
    decoded = q.astype(np.float32) * np.repeat(d, size, axis=1)
    if off is not None:
        decoded = (decoded + np.repeat(off, size, axis=1)).astype(np.float32)
    assert decoded.tobytes() == w.tobytes()
    for m in (1, 4, 7, 13):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        b = rng.standard_normal(40).astype(np.float32)
        ref = rows_linear(x, w, b)
        for isa in ISAS:
            np.testing.assert_array_equal(coded_kernel(x, w, b, isa, 2, GGUF_CODECS[kind]), ref,
                                          err_msg=f"{kind}, {m} rows, isa {isa}")


@needs
def test_q8x_keeps_signed_zeros_and_refuses_an_inexact_product():
    """A half-block of zeros of both signs (a zero scale times signed codes) and one of -0s (a negative scale's code
    0) are Q8X's to the bit; pack_codes refuses a code times a scale that rounds (rows.h: d * q exact)."""
    rng = np.random.default_rng(11)
    w = (rng.integers(-32, 32, (16, 64)) * np.float32(2 ** -9)).astype(np.float32)
    w[0, :16] = np.where(rng.random(16) < 0.5, np.float32(-0.0), np.float32(0.0))
    w[1, 16:32] = np.float32(-0.0) * rng.integers(1, 5, 16).astype(np.float32)
    w[1, 16:32][::3] = np.float32(-3 * 2 ** -9)               # -0s beside codes of a negative scale
    w[2, 32:48] = (np.arange(16) * np.float32(3 * 2 ** -9) + np.float32(0.25)).astype(np.float32)   # an offset
    x = rng.standard_normal((3, 64)).astype(np.float32)
    assert cpu_gemm.CODECS[cpu_gemm.block_codes(torch.from_numpy(w))[0]] == "Q8X"
    for isa in ISAS:
        np.testing.assert_array_equal(coded_kernel(x, w, None, isa, 1, "Q8X"), rows_linear(x, w))
    q = torch.full((1, 32), 127, dtype=torch.int8)
    d = torch.tensor([[1.0 + 2 ** -20, 1.0]])                # 127 * d needs 27 significant bits: it rounds
    out = torch.empty(G.packed_bytes(5, 1, 32), dtype=torch.uint8)
    with pytest.raises(ValueError, match="pack_codes: .* 5 \\(Q8X.* got codec 5, k 32.*an inexact product"):
        G.pack_codes(5, q.data_ptr(), d.data_ptr(), torch.zeros(1, 2).data_ptr(), out.data_ptr(), 1, 32)
    assert G.packed_bytes(5, 17, 64) == 64 + 2 * 2 * 768


@needs
def test_weights_that_are_not_exactly_codes_stay_floats():
    rng = np.random.default_rng(3)
    plain = rng.standard_normal((70, 64)).astype(np.float32)
    nudged = q4_1(plain)
    nudged[69, 5] = np.nextafter(nudged[69, 5], np.float32(1))   # one weight of the last row off by one ulp
    nan = q8_0(plain)
    nan[0, 0] = np.nan
    negzero = q8_0(plain)
    negzero[3, 7:9] = np.float32(-0.0), np.float32(0.0)              # no scale gives a block both zeros
    odd_k = q4_1(rng.standard_normal((8, 64)))[:, :48]               # k not a multiple of 32
    for w in (plain, nudged, nan, negzero, odd_k):
        wt = torch.from_numpy(np.ascontiguousarray(w))
        assert cpu_gemm.block_codes(wt) is None
        assert cpu_gemm.packed_codec(cpu_gemm.pack_rows(wt, coded=True)) == "F32"
    assert cpu_gemm.packed_codec(cpu_gemm.pack_rows(torch.from_numpy(q4_1(plain)), coded=False)) == "F32"


@needs
def test_the_kernel_refuses_a_packed_copy_of_another_shape_or_none():
    wp = cpu_gemm.pack_rows(torch.ones(20, 8))
    x, y = torch.ones(2, 8), torch.empty(2, 21)
    with pytest.raises(ValueError, match=r"linear: argument 'wp' expected a packed copy of a 21 x 8 weight"):
        G.linear(x.data_ptr(), 8, wp.data_ptr(), 0, y.data_ptr(), 21, 2, 21, 8, 0, 1)
    junk = torch.zeros(1000)
    with pytest.raises(ValueError, match=r"linear: argument 'wp' expected a packed copy of a 20 x 8 weight"):
        G.linear(x.data_ptr(), 8, junk.data_ptr(), 0, y.data_ptr(), 21, 2, 20, 8, 0, 1)
    q, d = torch.full((4, 32), 16, dtype=torch.int8), torch.ones(4, 1)
    out = torch.empty(G.packed_bytes(2, 4, 32), dtype=torch.uint8)
    with pytest.raises(ValueError, match="pack_codes: arguments 'codec', 'q', 'd' and 'm' expected codec 1"):
        G.pack_codes(2, q.data_ptr(), d.data_ptr(), d.data_ptr(), out.data_ptr(), 4, 32)   # a Q4 code of 16
    with pytest.raises(ValueError, match="pack_codes: .* got codec 1, k 48"):
        G.pack_codes(1, q.data_ptr(), d.data_ptr(), 0, out.data_ptr(), 4, 48)
    assert G.packed_bytes(2, 4, 48) == -1 and G.packed_bytes(8, 4, 32) == -1 and G.packed_bytes(6, 4, 48) == -1
    assert G.packed_bytes(2, 17, 64) == 64 + 2 * 2 * 384 and G.packed_bytes(1, 16, 32) == 64 + 576
    # Q5: d, m (64 bytes each), 256 bytes of low halves and 64 of bit 4 per block of 32 x 16 weights
    assert G.packed_bytes(6, 17, 64) == 64 + 2 * 2 * 448
    assert G.packed_bytes(7, 17, 64) == 64 + 2 * 2 * 640   # Q8H: d[2][16] floats, then int8 codes [32][16]
    q5 = torch.full((4, 32), 31, dtype=torch.int8)
    out5 = torch.empty(G.packed_bytes(6, 4, 32), dtype=torch.uint8)
    G.pack_codes(6, q5.data_ptr(), d.data_ptr(), d.data_ptr(), out5.data_ptr(), 4, 32)   # codes up to 31
    q5[2, 7] = 32
    with pytest.raises(ValueError, match=r"pack_codes: .* 6 \(Q5, with m, codes 0..31\).* got codec 6, k 32, codes out"):
        G.pack_codes(6, q5.data_ptr(), d.data_ptr(), d.data_ptr(), out5.data_ptr(), 4, 32)
    q5[2, 7] = 31
    fine = torch.full((4, 1), 1.0 + 2 ** -20)   # (kept alive: the call reads it by address)
    with pytest.raises(ValueError, match="pack_codes: .* got codec 6, k 32"):   # 31 * d needs 25 significant bits
        G.pack_codes(6, q5.data_ptr(), fine.data_ptr(), d.data_ptr(), out5.data_ptr(), 4, 32)


@needs
@pytest.mark.parametrize("codec,dtype", [("F16", torch.float16), ("BF16", torch.bfloat16)])
@pytest.mark.parametrize("m,n,k", [(1, 16, 7), (3, 48, 33), (5, 40, 64), (8, 40, 64), (10, 33, 100), (13, 33, 100)])
def test_float16_and_bfloat16_valued_weights_give_the_bits_of_their_floats(codec, dtype, m, n, k):
    """A float16 head or a bfloat16 checkpoint loaded in float32: 2 bytes a weight, the same bits; subnormals and
    signed zeros included."""
    rng = np.random.default_rng(m + n + k)
    w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05).to(dtype)
    w.view(-1)[:4] = torch.tensor([0.0, -0.0, 2 ** -20, -(2 ** -24)], dtype=torch.float32).to(dtype)
    if dtype == torch.bfloat16:
        w.view(-1)[4] = 2 ** -40   # no float16 value: bfloat16's range (a bfloat16 weight may also be float16's)
    w = w.float().numpy()
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    wp = cpu_gemm.pack_rows(torch.from_numpy(w), coded=True)
    assert cpu_gemm.packed_codec(wp) == codec and wp.numel() == 64 + -(-n // 16) * 16 * k * 2
    ref = rows_linear(x, w, b)
    for isa in ISAS:
        for threads in (1, 2):
            y = torch.empty(m, n)
            G.linear(torch.from_numpy(x).data_ptr(), k, wp.data_ptr(), torch.from_numpy(b).data_ptr(), y.data_ptr(), n,
                     m, n, k, isa, threads)
            np.testing.assert_array_equal(y.numpy(), ref, err_msg=f"isa {isa}, {threads} threads")
    with pytest.raises(ValueError, match="pack_half: arguments 'codec' and 'h' expected codec 3 .* got codec 2"):
        G.pack_half(2, wp.data_ptr(), wp.data_ptr(), 1, 1)
    inf = torch.tensor([[float("inf")]], dtype=dtype).view(torch.int16)
    with pytest.raises(ValueError, match="a value that is not finite"):
        G.pack_half({"F16": 3, "BF16": 4}[codec], inf.data_ptr(), wp.data_ptr(), 1, 1)


def c_codes(codec, w):
    """heterospec._gemm's find_codes on a float32 array: (q, d, m or None) as NumPy arrays, or None."""
    wt = torch.from_numpy(np.ascontiguousarray(w, np.float32))
    n, k = wt.shape
    size = 16 if codec in (5, 7) else 32
    q, d = torch.empty((n, k), dtype=torch.int8), torch.empty((n, k // size))
    m = torch.empty_like(d) if codec not in (1, 7) else None
    if not G.find_codes(codec, wt.data_ptr(), q.data_ptr(), d.data_ptr(), 0 if m is None else m.data_ptr(), n, k):
        return None
    return q.numpy(), d.numpy(), None if m is None else m.numpy()


def decodes_to(codec, found, w):
    """Whether the codes (q, d, m) decode to w bit for bit by the codec's formula (d * q exact where m is added)."""
    q, d, m = found
    size = 16 if codec in (5, 7) else 32
    v = (q.astype(np.float32) * np.repeat(d, size, axis=1)).astype(np.float32)
    if m is not None:
        v = (v + np.repeat(m, size, axis=1)).astype(np.float32)
    return v.tobytes() == np.ascontiguousarray(w, np.float32).tobytes()


def search_cases():
    """Weights whose blocks have codes of some codec, of none, or of some only: every GGUF block format, the formats'
    own quantizers, both fused in one matrix, float weights, and the edge cases of the search (zeros of both signs,
    constant blocks, -0s under negative scales, a weight one ulp off, tiny and huge scales, non-finite values)."""
    from tests._gguf import q4_k, q6_k

    rng = np.random.default_rng(21)
    cases = {"q4_1": q4_1(rng.standard_normal((24, 96)) * 0.05), "q8_0": q8_0(rng.standard_normal((24, 96)) * 0.05),
             "q4_k": q4_k(rng.standard_normal((8, 256)) * 0.05), "q6_k": q6_k(rng.standard_normal((8, 256)) * 0.05),
             "floats": rng.standard_normal((8, 64)).astype(np.float32)}
    cases["fused"] = np.concatenate([cases["q4_k"], cases["q6_k"]])
    if importlib.util.find_spec("gguf") is not None:
        from tests._gguf import random_blocks

        for kind in sorted(GGUF_CODECS):
            cases[kind] = random_blocks(kind, 6, 256, rng)[0]
    edge = (rng.integers(-32, 32, (8, 64)) * np.float32(2 ** -9)).astype(np.float32)
    edge[0, :16] = np.where(rng.random(16) < 0.5, np.float32(-0.0), np.float32(0.0))   # zeros of both signs
    edge[1, :32] = np.float32(0.75)                                                     # a constant block
    edge[2, 16:32] = np.float32(-3 * 2 ** -9) * rng.integers(0, 5, 16).astype(np.float32)   # -0s, negative scale
    edge[3, 32:] = np.float32(2 ** -140) * rng.integers(-5, 6, 32).astype(np.float32)   # subnormal weights
    edge[4, :32] = np.float32(2 ** 100) * rng.integers(-100, 100, 32).astype(np.float32)   # a huge scale
    cases["edge"] = edge
    # odd multiples of 2^-10 and 128 of them: no int8 codes under a positive scale (nor an offset's 0..255 above -31)
    cases["a code of 128"] = np.tile(np.float32(2 ** -10) * np.r_[np.arange(-31, 31, 2), 128].astype(np.float32), (2, 2))
    cases["edge, a weight one ulp off"] = edge.copy()
    cases["edge, a weight one ulp off"][7, 40] = np.nextafter(edge[7, 40], np.float32(1))
    cases["edge, a NaN"] = edge.copy()
    cases["edge, a NaN"][5, 3] = np.nan
    return cases


@needs
@pytest.mark.parametrize("codec", [2, 6, 1, 7, 5])
def test_the_codes_search_finds_codes_where_its_numpy_twin_does(codec):
    """find_codes (csrc/gemm/codes.c) against heterospec.reference.find_codes on the same weights: codes found by
    both or by neither, and where found, both decode to every weight (their codes may differ)."""
    from heterospec.reference import find_codes

    found = set()
    for name, w in search_cases().items():
        ours, ref = c_codes(codec, w), find_codes(codec, w)
        assert (ours is None) == (ref is None), f"{name}: C found {ours is not None}, NumPy {ref is not None}"
        if ours is not None:
            assert decodes_to(codec, ours, w) and decodes_to(codec, ref, w), name
            found.add(name)
    # the cases made here (the GGUF formats' own table is the test above), by their formulas: Q4 holds Q4_1's and
    # Q4_K's 16 levels above an offset, and Q5 (32 levels) them too; Q8 Q8_0's signed codes, and Q8H them, Q6_K's
    # (a scale per 16) and the edge rows' (integers times powers of two per 16, no offset); Q8X, a scale and an
    # offset per 16, all but the float weights and the blocks with a NaN or a weight one ulp off (and the 128 shares
    # its half with codes 1..29 above their least)
    expected = {2: {"q4_1", "q4_k"}, 6: {"q4_1", "q4_k"}, 1: {"q8_0"}, 7: {"q8_0", "q6_k", "edge"},
                5: {"q4_1", "q8_0", "q4_k", "q6_k", "fused", "edge", "a code of 128"}}[codec]
    assert found - set(GGUF_CODECS) == expected


@needs
def test_the_search_stops_at_a_block_without_codes_anywhere_and_its_codes_do_not_depend_on_threads():
    rng = np.random.default_rng(9)
    w = torch.from_numpy(q4_1(rng.standard_normal((200, 64))))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.block_codes(w)
        torch.set_num_threads(2)
        two = cpu_gemm.block_codes(w)
    finally:
        torch.set_num_threads(threads)
    assert one[0] == two[0] == 2 and all(torch.equal(a, b) for a, b in zip(one[1:], two[1:]))
    w[190, 3] = torch.nextafter(w[190, 3], torch.tensor(1.0))   # a weight of a late row off by one ulp
    assert cpu_gemm.block_codes(w) is None
    with pytest.raises(ValueError, match="find_codes: arguments 'codec' and 'k' expected codec 1 .* got codec 3, k 64"):
        G.find_codes(3, w.data_ptr(), w.data_ptr(), w.data_ptr(), w.data_ptr(), 200, 64)
    with pytest.raises(ValueError, match="find_codes: argument 'm' expected an address for codec 2, got 0"):
        G.find_codes(2, w.data_ptr(), w.data_ptr(), w.data_ptr(), 0, 200, 64)


@needs
def test_rows_of_two_k_quants_in_one_matrix_take_the_codec_that_holds_both():
    """q, k (Q4_K) and v (Q6_K) fused into one matrix: its first rows alone are Q4's, the whole is Q8X's (a scale
    and an offset per 16 hold both), to the bit; and Q5_K_M's Q5_1 rows with Q8_0 ones."""
    from tests._gguf import q4_k, q6_k

    rng = np.random.default_rng(12)
    w = np.concatenate([q4_k(rng.standard_normal((100, 256)) * 0.05), q6_k(rng.standard_normal((40, 256)) * 0.05)])
    assert cpu_gemm.CODECS[cpu_gemm.block_codes(torch.from_numpy(w[:100]))[0]] == "Q4"
    codec, q, d, m = cpu_gemm.block_codes(torch.from_numpy(w))
    assert cpu_gemm.CODECS[codec] == "Q8X"
    decoded = (q.numpy().astype(np.float32) * np.repeat(d.numpy(), 16, 1) + np.repeat(m.numpy(), 16, 1))
    assert decoded.astype(np.float32).tobytes() == w.tobytes()
    # Q5_1 rows (codes above an offset) and Q8_0 ones (signed codes up to 127, a scale per 32) as Q5_K_M fuses them
    if importlib.util.find_spec("gguf") is not None:
        from tests._gguf import random_blocks

        w = np.concatenate([random_blocks("Q5_1", 100, 256, rng)[0], random_blocks("Q8_0", 40, 256, rng)[0]])
        codec, q, d, m = cpu_gemm.block_codes(torch.from_numpy(w))
        assert cpu_gemm.CODECS[codec] == "Q8X"
        decoded = (q.numpy().astype(np.float32) * np.repeat(d.numpy(), 16, 1) + np.repeat(m.numpy(), 16, 1))
        assert decoded.astype(np.float32).tobytes() == w.tobytes()
