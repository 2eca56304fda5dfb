"""rows_linear: the few-rows float32 matrix product of ``cpu_gemm='rows'`` (the extension heterospec._gemm,
csrc/gemm/rows.h), bit for bit; and find_codes, the search for the block codes a weight decodes from
(csrc/gemm/codes.c).

Each output is a chain of fused multiply-adds over k in order, each rounded once to float32, then + bias:
``acc = fma(x[m, k], w[n, k], acc)`` for k = 0 .. K-1 from acc = +0, ``y[m, n] = acc + bias[n]``.  NumPy has no
float32 fma, so each step is computed in float64 (the product of two float32 values is exact there) and rounded
to float32; where that double rounding could differ from one rounding -- the float64 sum lies within its own
rounding error of a point halfway between two float32 values, about once in 2^29 steps -- the step is decided
exactly with fractions.  So this is the exact result, not a tolerance.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np


def _fma32(a, b, c):
    """float32 arrays -> fma(a, b, c) rounded once to float32, elementwise (broadcasting)."""
    a, b, c = np.broadcast_arrays(np.asarray(a, np.float32), np.asarray(b, np.float32), np.asarray(c, np.float32))
    shape = a.shape
    a, b, c = (np.array(v).reshape(-1) for v in (a, b, c))
    with np.errstate(over="ignore", invalid="ignore"):
        s = a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)
        r = s.astype(np.float32)
        # the float32 neighbours of s and the point halfway between them (exact in float64)
        other = np.where(r.astype(np.float64) <= s, np.nextafter(r, np.float32(np.inf)),
                         np.nextafter(r, np.float32(-np.inf)))
        mid = (r.astype(np.float64) + other.astype(np.float64)) / 2
        near = np.isfinite(s) & np.isfinite(mid) & (np.abs(s - mid) <= np.spacing(np.abs(s)))
    for i in zip(*np.nonzero(near)):   # rare: decide exactly
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo, hi = sorted((float(r[i]), float(other[i])))
        half = (Fraction(lo) + Fraction(hi)) / 2
        if exact == 0:
            r[i] = np.float32(0.0) if not (np.signbit(a[i] * b[i]) and np.signbit(c[i])) else np.float32(-0.0)
        elif exact < half:
            r[i] = np.float32(lo)
        elif exact > half:
            r[i] = np.float32(hi)
        else:   # a tie: to the even significand
            r[i] = np.float32(lo) if int(np.float32(lo).view(np.uint32)) % 2 == 0 else np.float32(hi)
    return r.reshape(shape)


def rows_linear(x, w, bias=None):
    """x [M, K] float32, w [N, K] float32, bias [N] float32 or None -> y [M, N] float32: y = x w^T (+ bias),
    each sum in the kernel's order (the module's docstring)."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"rows_linear: argument 'w' expected [N, {x.shape[-1]}] for x of shape {x.shape}, "
                         f"got {w.shape}")
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for k in range(x.shape[1]):
        acc = _fma32(x[:, k, None], w[None, :, k], acc)
    if bias is not None:
        acc = (acc + np.asarray(bias, np.float32)[None, :]).astype(np.float32)
    return acc


# rows.h's block codecs: codec -> (k per scale, least and greatest code, an offset?)
CODE_FORMS = {2: (32, 0, 15, True), 1: (32, -128, 127, False), 5: (16, -128, 127, True), 6: (32, 0, 31, True),
              7: (16, -128, 127, False)}
_NEG_ZERO = np.uint32(0x80000000)


def _exact_gcd(v):
    """v [B, S] float64 (>= 0, finite) -> [B]: the greatest d with every value of a row an integer multiple of it,
    exactly (the gcd of their odd parts times the least of their powers of two); 0 for a row of zeros."""
    mant, exp = np.frexp(v)
    ints = (mant * 2.0 ** 53).astype(np.int64)            # v = ints * 2^(exp - 53), exactly
    low = ints & -ints                                    # the lowest set bit (0 for 0)
    tz = np.log2(np.where(low > 0, low, 1).astype(np.float64)).astype(np.int64)
    odd, e = ints >> tz, exp.astype(np.int64) - 53 + tz
    nz = ints != 0
    g = np.gcd.reduce(np.where(nz, odd, 0), axis=1)
    emin = np.where(nz, e, 1 << 30).min(axis=1)
    return np.where(g > 0, np.ldexp(g.astype(np.float64), np.where(g > 0, emin, 0)), 0.0)


def _scales(x, codec, negz, lo, hi, amax):
    """The scales codes.c tries for blocks x [B, size] -> [(signed form? [B] bool, d [B] float64), ...] (the order
    does not matter here: a block has codes when any of them fits)."""
    _, lo_code, hi_code, offset = CODE_FORMS[codec]
    signed = lo_code < 0
    block_sg = signed & (np.full(len(x), not offset) | negz)   # (codes.c's: signed codes without an offset, or a -0)
    yes = np.ones(len(x), bool)
    x64 = x.astype(np.float64)
    out = []
    if not signed:   # Q4_1's (Q5_1's) float16 scales: the nearest to (max - min) / 15 (31) and its neighbours
        h = ((hi - lo) / np.float32(hi_code)).astype(np.float16).view(np.int16).astype(np.int32)
        for step in (0, 1, -1):
            hh = h + step
            d = np.where(hh >= 0, hh, 0).astype(np.int16).view(np.float16).astype(np.float64)
            out.append((block_sg, np.where(np.isfinite(d), d, 0.0)))
    forms = [block_sg] + ([yes] if signed else [])
    for sg in forms:   # the greatest common divisor of the least and the greatest distance from the base
        dist = np.where(sg[:, None], np.abs(x64), x64 - lo.astype(np.float64)[:, None])
        near = np.where(dist > 0, dist, np.inf).min(axis=1)
        near = np.where(np.isfinite(near), near, 0.0)
        out.append((sg, _exact_gcd(np.stack([near, dist.max(axis=1)], 1))))
        if sg is block_sg:
            out += [(sg, near / a) for a in range(1, 9)]
    if signed:   # the greatest magnitude over the largest codes of Q8_0, Q4_0, Q5_0 and Q6_K
        out += [(yes, amax.astype(np.float64) / over) for over in (127, 8, 16, 32)]
    srt = np.sort(x, axis=1).astype(np.float64)   # the least gap between two values, over 1 to 8
    gaps = np.where(np.diff(srt, axis=1) > 0, np.diff(srt, axis=1), np.inf).min(axis=1)
    gaps = np.where(np.isfinite(gaps), gaps, 0.0)
    out += [(block_sg, gaps / t) for t in range(1, 9)]
    for sg in forms:   # the greatest common divisor of all the values (signed) or their distances from the least
        out.append((sg, _exact_gcd(np.where(sg[:, None], np.abs(x64), (x - lo[:, None]).astype(np.float64)))))
    return out


def find_codes(codec, w):
    """The NumPy twin of heterospec._gemm's ``find_codes`` (csrc/gemm/codes.c): the codes of ``codec`` (2 Q4, 1 Q8,
    5 Q8X, 6 Q5, 7 Q8H) that decode to the float32 weight ``w`` [N, K] bit for bit -- every block of 32 (Q8X, Q8H:
    16) along k ``d * q + m`` (Q8, Q8H: ``d * q``) with q in the codec's range, and d * q exact where m is added (Q4:
    d has at most 20 significant bits) -- as (q [N, K] int8, d [N, K / size] float32, m the same or None for Q8 and
    Q8H), or None when some block has none.  The same blocks have codes here and there; the codes themselves may
    differ."""
    size, lo_code, hi_code, offset = CODE_FORMS[codec]
    w = np.ascontiguousarray(w, np.float32)
    n, k = w.shape
    if k % 32:
        raise ValueError(f"find_codes: argument 'w' expected k a multiple of 32, got {k}")
    x = w.reshape(-1, size)
    bits = x.view(np.uint32)
    negz = (bits == _NEG_ZERO).any(axis=1)
    q_out = np.zeros(x.shape, np.int8)
    d_out, m_out = np.zeros(len(x), np.float32), np.zeros(len(x), np.float32)
    open_ = np.isfinite(x).all(axis=1)
    if not open_.all():
        return None
    if CODE_FORMS[codec][1] < 0:   # zeros of both signs: the scale +0, the codes -1 at each -0, the offset -0
        z = (x == 0).all(axis=1) & negz
        q_out[z] = -(bits[z] == _NEG_ZERO).astype(np.int8)
        m_out[z] = np.float32(-0.0)
        open_ &= ~z
    lo, hi, amax = x.min(axis=1), x.max(axis=1), np.abs(x).max(axis=1)
    with np.errstate(all="ignore"):
        for sg, d64 in _scales(x, codec, negz, lo, hi, amax):
            d = np.where(sg & negz, -d64, d64).astype(np.float32)
            m = np.where(sg, np.where(negz, np.float32(-0.0), np.float32(0.0)), lo).astype(np.float32)
            base = np.where(sg, np.float32(0.0), lo).astype(np.float32)
            c = np.where(d[:, None] != 0, np.rint((x - base[:, None]) / d[:, None]), 0)
            # (+ 0: an int8 code has no -0, so a code 0 times a negative scale is -0 as the kernel decodes it)
            c = np.clip(np.nan_to_num(c, nan=lo_code), lo_code, hi_code).astype(np.float32) + np.float32(0.0)
            v = (d[:, None] * c).astype(np.float32)
            if offset:
                v = (v + m[:, None]).astype(np.float32)
            ok = open_ & np.isfinite(d) & (v.view(np.uint32) == bits).all(axis=1)
            if codec == 2:
                ok &= (d.view(np.uint32) & 0xF) == 0
            elif offset:   # d * q exact: d's significant bits and the largest code's length at most 24
                mant = (d.view(np.uint32) & 0x7FFFFF) | 0x800000
                sig = np.where(d != 0, 24 - np.log2((mant & -mant).astype(np.float64)).astype(np.int64), 0)
                most = np.abs(c).max(axis=1).astype(np.int64)
                length = np.where(most > 0, np.floor(np.log2(np.maximum(most, 1))) + 1, 0).astype(np.int64)
                ok &= sig + length <= 24
            q_out[ok], d_out[ok], m_out[ok] = c[ok].astype(np.int8), d[ok], m[ok]
            open_ &= ~ok
            if not open_.any():
                break
        else:
            if open_.any():
                return None
    nb = k // size
    return q_out.reshape(n, k), d_out.reshape(n, nb), m_out.reshape(n, nb) if offset else None
