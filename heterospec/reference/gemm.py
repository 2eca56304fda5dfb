"""rows_linear: the few-rows float32 matrix product of ``cpu_gemm='rows'`` (the extension heterospec._gemm,
csrc/gemm/rows.h), bit for bit.

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
