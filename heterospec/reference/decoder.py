"""The pieces of ``cpu_decoder``'s forward (the extension heterospec._gemm, csrc/gemm/decoder.h) in NumPy, bit for
bit: the 16-lane dot product, exp, RMSNorm, one row's attention, SiLU-times-up, the rotation, the non-finite row
rule; and a whole decoder forward built from them (:func:`decoder_layers`, with :func:`rows_linear` for the matrix
products).

Every step is one float32 operation rounded once: NumPy's float32 add, multiply, divide and sqrt round
correctly, and fused multiply-adds go through the exact :func:`~heterospec.reference.gemm._fma32`.  So this is
the kernel's result, not an approximation of it (the tests hold the kernel to it on every instruction set).
"""
from __future__ import annotations

import numpy as np

from .gemm import _fma32, rows_linear

f32 = np.float32


def dot16(a, b):
    """a, b [..., d] float32 -> [...]: lane l sums elements l, l+16, ... by fused multiply-adds in order from +0;
    the 16 lanes are then added as l + (l+8), + (l+4), + (l+2), + (l+1)."""
    a, b = np.broadcast_arrays(np.asarray(a, f32), np.asarray(b, f32))
    d = a.shape[-1]
    acc = np.zeros(a.shape[:-1] + (16,), f32)
    for c in range(0, d, 16):
        w = min(16, d - c)
        acc[..., :w] = _fma32(a[..., c:c + w], b[..., c:c + w], acc[..., :w])
    for half in (8, 4, 2, 1):
        acc = (acc[..., :half] + acc[..., half:2 * half]).astype(f32)
    return acc[..., 0]


def nonfinite(x):
    """x [..., V] -> [...] bool: the row holds a NaN or a +inf, or every value is -inf (the engine's non-finite
    logits rule, which the forward applies to the logits it writes)."""
    x = np.asarray(x, f32)
    return np.isnan(x).any(-1) | (x == np.inf).any(-1) | (x == -np.inf).all(-1)


def exp(x):
    """float32 exp as the kernel computes it: x clamped to [-87, 88] (below -87: 0; NaN stays NaN), k = round(x / ln
    2), r = x - k ln 2 in two fused steps, Cephes' degree-6 polynomial, times 2^k."""
    x = np.asarray(x, f32)
    with np.errstate(invalid="ignore", over="ignore"):
        xc = np.clip(x, f32(-87.0), f32(88.0))
        xc = np.where(np.isnan(xc), f32(0.0), xc).astype(f32)
        t = (xc * f32(1.44269504088896341)).astype(f32)
        k = ((t + f32(12582912.0)).astype(f32) - f32(12582912.0)).astype(f32)
        r = _fma32(k, f32(-0.693359375), xc)
        r = _fma32(k, f32(2.12194440e-4), r)
        p = np.full_like(r, f32(1.9875691500e-4))
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = _fma32(p, r, f32(c))
        y = (_fma32(p, (r * r).astype(f32), r) + f32(1.0)).astype(f32)
        scale = ((k.astype(np.int32) + 127) << 23).astype(np.int32).view(f32)
        y = (y * scale).astype(f32)
        return np.where(x < -87.0, f32(0.0), np.where(np.isnan(x), x, y)).astype(f32)


def rmsnorm(x, w, eps):
    """x [..., d] -> w * (x * (1 / sqrt(dot16(x, x) / d + eps))), each step rounded to float32."""
    x = np.asarray(x, f32)
    var = (dot16(x, x) / f32(x.shape[-1])).astype(f32)
    r = (f32(1.0) / np.sqrt((var + f32(eps)).astype(f32))).astype(f32)
    return (np.asarray(w, f32) * (x * r[..., None]).astype(f32)).astype(f32)


def attend(q, k, v, allowed, scale):
    """One query row of one head: q [d], k and v [W, d], allowed [W] bool -> [d]: s_j = dot16(q, k_j) * scale over
    the allowed j in order, p = exp(s - max s), out = (sum_j p_j v_j, fused in order of j) / (sum_j p_j in order)."""
    q = np.asarray(q, f32)
    cols = np.nonzero(np.asarray(allowed, bool))[0]
    out = np.zeros(q.shape[-1], f32)
    if len(cols) == 0:
        return out
    s = (dot16(q[None, :], np.asarray(k, f32)[cols]) * f32(scale)).astype(f32)
    p = exp((s - s.max()).astype(f32))
    total = f32(0.0)
    for pj in p:
        total = f32(total + pj)
    for pj, j in zip(p, cols):
        out = _fma32(pj, np.asarray(v, f32)[j], out)
    return (out / total).astype(f32)


def rotate(x, cos, sin):
    """transformers' rotation, one rounding per operation: x * cos + rotate_half(x) * sin."""
    x = np.asarray(x, f32)
    h = x.shape[-1] // 2
    rh = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return ((x * np.asarray(cos, f32)).astype(f32) + (rh * np.asarray(sin, f32)).astype(f32)).astype(f32)


def silu_mul(g, u):
    """g / (1 + exp(-g)) * u, each step rounded to float32."""
    g = np.asarray(g, f32)
    return ((g / (f32(1.0) + exp(-g)).astype(f32)).astype(f32) * np.asarray(u, f32)).astype(f32)


def _layer(L, x, h, eps, scale, heads, kv_heads, cos, sin, cache, slots, allowed):
    """One layer after its input norm: attention input ``x`` [n, X], residual stream ``h`` [n, H]; the keys and
    values written into ``cache`` [2, kv_heads, W', d] at ``slots``.  Returns the new residual stream."""
    n = x.shape[0]
    d = cache.shape[-1]
    group = heads // kv_heads

    def lin(x, name):
        return rows_linear(x, L[name], L.get(name + "_b"))

    q = lin(x, "q").reshape(n, heads, d)
    k = lin(x, "k").reshape(n, kv_heads, d)
    v = lin(x, "v").reshape(n, kv_heads, d)
    if L.get("q_norm") is not None:
        q = rmsnorm(q, L["q_norm"], eps)
    if L.get("k_norm") is not None:
        k = rmsnorm(k, L["k_norm"], eps)
    q = rotate(q, cos[:, None, :], sin[:, None, :])
    k = rotate(k, cos[:, None, :], sin[:, None, :])
    for r, s in enumerate(slots):
        cache[0, :, s] = k[r]
        cache[1, :, s] = v[r]
    W = allowed.shape[1]
    att = np.stack([np.concatenate([attend(q[r, a], cache[0, a // group, :W], cache[1, a // group, :W], allowed[r],
                                           scale) for a in range(heads)]) for r in range(n)])
    h = (h + lin(att, "o")).astype(f32)
    x = rmsnorm(h, L["ln2"], eps)
    return (h + lin(silu_mul(lin(x, "gate"), lin(x, "up")), "down")).astype(f32)


def decoder_layers(layers, final_norm, head, eps, scale, heads, kv_heads, h, cos, sin, cache, slots, allowed):
    """The kernel's whole forward for the rows of one request, in NumPy (slow: for the tests' tiny models).

    ``layers``: per layer a dict of float32 arrays ``ln1, ln2, q, k, v, o, gate, up, down`` ([out, in] weights) and
    optionally ``q_b, k_b, v_b, o_b, gate_b, up_b, down_b, q_norm, k_norm``; ``head``: (weight [V, H], bias or
    None); ``h`` [n, H]: the rows' embeddings; ``cos``/``sin`` [n, d]; ``cache`` [layers, 2, kv_heads, W', d]: the
    request's keys and values, written in place at columns ``slots`` [n]; ``allowed`` [n, W] bool (W <= W').
    Returns logits [n, V] float32."""
    h = np.array(h, f32)
    for i, L in enumerate(layers):
        h = _layer(L, rmsnorm(h, L["ln1"], eps), h, eps, scale, heads, kv_heads, cos, sin, cache[i], slots, allowed)
    return rows_linear(rmsnorm(h, final_norm, eps), head[0], head[1])


def fuse(taps, fc, fc_b, eps, in_norm=None, fc_norms=None):
    """The draft's fusion of the target's taps as the kernel computes it: ``taps`` [n, 3T] -> [n, H]: rmsnorm over
    the whole row with ``in_norm`` [3T] where given, then over each third with ``fc_norms`` (3 x [T]) where given,
    then ``fc`` [H, 3T] (+ ``fc_b``) by :func:`rows_linear`."""
    x = np.asarray(taps, f32)
    if in_norm is not None:
        x = rmsnorm(x, in_norm, eps)
    if fc_norms is not None:
        x = np.concatenate([rmsnorm(part, w, eps) for part, w in zip(np.split(x, 3, axis=-1), fc_norms)], -1)
    return rows_linear(x, fc, fc_b)


def draft_layer(layer, hidden_norm, final_norm, head, eps, scale, heads, kv_heads, e, h, cos, sin, cache, slots,
                allowed, *, residual_normed=False, head_normed=True, out_normed=False):
    """The kernel's EAGLE-3 draft step and head (decoder.h's draft layout) for the rows of one request: the layer's
    attention input is [rmsnorm(e, ln1), rmsnorm(h, hidden_norm)] (``e`` [n, H] the tokens' embeddings, ``h``
    [n, H] the fed-in states), its residual stream starts at ``h`` (``residual_normed``: at its norm); ``cache``
    [2, kv_heads, W', d]; the rest as :func:`decoder_layers`.  Returns (logits [n, V]: the head over the final
    norm's rows, or over the raw rows without ``head_normed``; the states [n, H]: the raw rows, or the final
    norm's with ``out_normed``)."""
    h = np.array(h, f32)
    hn = rmsnorm(h, hidden_norm, eps)
    x = np.concatenate([rmsnorm(e, layer["ln1"], eps), hn], -1)
    h2 = _layer(layer, x, hn if residual_normed else h, eps, scale, heads, kv_heads, cos, sin, cache, slots, allowed)
    normed = rmsnorm(h2, final_norm, eps)
    return rows_linear(normed if head_normed else h2, head[0], head[1]), (normed if out_normed else h2)
