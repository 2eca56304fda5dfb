"""The pieces of ``cpu_decoder``'s forward (the extension heterospec._gemm, csrc/gemm/decoder.h) in NumPy, bit for
bit: the 16-lane dot product and sum, exp, RMSNorm, LayerNorm, one row's attention (soft-capped or not),
SiLU-times-up, gelu and its tanh form (alone or times up), relu, soft-capping, the rotation, the non-finite row
rule; and a whole decoder forward built from them
(:func:`decoder_layers`, with :func:`rows_linear` for the matrix products).

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


def sum16(x):
    """x [..., d] float32 -> [...]: lane l adds elements l, l+16, ... in order from +0; the lanes then added as
    :func:`dot16`'s."""
    x = np.asarray(x, f32)
    acc = np.zeros(x.shape[:-1] + (16,), f32)
    for c in range(0, x.shape[-1], 16):
        w = min(16, x.shape[-1] - c)
        acc[..., :w] = (acc[..., :w] + x[..., c:c + w]).astype(f32)
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


def layernorm(x, w, b, eps):
    """x [..., d] -> w * ((x - mean) * (1 / sqrt(var + eps))) (+ b), mean = sum16(x) / d, var = dot16 of the
    centred row / d, each step rounded to float32."""
    x = np.asarray(x, f32)
    d = f32(x.shape[-1])
    c = (x - (sum16(x) / d).astype(f32)[..., None]).astype(f32)
    r = (f32(1.0) / np.sqrt(((dot16(c, c) / d).astype(f32) + f32(eps)).astype(f32))).astype(f32)
    y = (np.asarray(w, f32) * (c * r[..., None]).astype(f32)).astype(f32)
    return y if b is None else (y + np.asarray(b, f32)).astype(f32)


def gelu(x):
    """gelu (erf) as the kernel computes it: q = erfc(z), z = |x| / sqrt 2, by Numerical Recipes' erfcc (t = 1 /
    (1 + z / 2), q = t exp(-z^2 - 1.26551223 + t (1.00002368 + ...)), with :func:`exp`), then x * 0.5 * q for x < 0
    and x * 0.5 * (2 - q) otherwise."""
    x = np.asarray(x, f32)
    z = (np.abs(x) * f32(0.70710678118654752)).astype(f32)
    t = (f32(1.0) / (f32(1.0) + (f32(0.5) * z).astype(f32))).astype(f32)
    p = np.full_like(z, f32(0.17087277))
    for c in (-0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418, 0.37409196, 1.00002368):
        p = (f32(c) + (t * p).astype(f32)).astype(f32)
    e = exp(((-(z * z).astype(f32) - f32(1.26551223)).astype(f32) + (t * p).astype(f32)).astype(f32))
    q = (t * e).astype(f32)
    half = (x * f32(0.5)).astype(f32)
    return np.where(x < 0, (half * q).astype(f32), (half * (f32(2.0) - q).astype(f32)).astype(f32)).astype(f32)


def gelu_tanh(x):
    """gelu's tanh form as the kernel computes it: x / (1 + exp(-2 u)), u = 0.7978845608 (x + 0.044715 x^3)."""
    x = np.asarray(x, f32)
    cube = ((x * x).astype(f32) * x).astype(f32)
    u = (f32(0.7978845608) * (x + (f32(0.044715) * cube).astype(f32)).astype(f32)).astype(f32)
    return (x / (f32(1.0) + exp((f32(-2.0) * u).astype(f32))).astype(f32)).astype(f32)


def softcap(x, cap):
    """cap * tanh(x / cap) as the kernel computes it: tanh(y) = 2 / (1 + exp(-2 y)) - 1 with :func:`exp`."""
    x = np.asarray(x, f32)
    e = exp((f32(-2.0) * (x / f32(cap)).astype(f32)).astype(f32))
    return (((f32(2.0) / (f32(1.0) + e).astype(f32)).astype(f32) - f32(1.0)).astype(f32) * f32(cap)).astype(f32)


def attend(q, k, v, allowed, scale, cap=0.0):
    """One query row of one head: q [d], k and v [W, d], allowed [W] bool -> [d]: s_j = dot16(q, k_j) * scale over
    the allowed j in order (soft-capped where ``cap``: :func:`softcap`), p = exp(s - max s), out = (sum_j p_j v_j,
    fused in order of j) / (sum_j p_j in order)."""
    q = np.asarray(q, f32)
    cols = np.nonzero(np.asarray(allowed, bool))[0]
    out = np.zeros(q.shape[-1], f32)
    if len(cols) == 0:
        return out
    s = (dot16(q[None, :], np.asarray(k, f32)[cols]) * f32(scale)).astype(f32)
    if cap:
        s = softcap(s, cap)
    p = exp((s - s.max()).astype(f32))
    total = f32(0.0)
    for pj in p:
        total = f32(total + pj)
    for pj, j in zip(p, cols):
        out = _fma32(pj, np.asarray(v, f32)[j], out)
    return (out / total).astype(f32)


def rotate(x, cos, sin, pairs=False):
    """transformers' rotation, one rounding per operation: x * cos + rotate_half(x) * sin; ``pairs``: GPT-J's
    rotate_every_two(x) = (-x1, x0, -x3, x2, ...) in place of rotate_half (cos and sin repeated per pair)."""
    x = np.asarray(x, f32)
    h = x.shape[-1] // 2
    if pairs:
        rh = np.stack([-x[..., 1::2], x[..., 0::2]], -1).reshape(x.shape)
    else:
        rh = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return ((x * np.asarray(cos, f32)).astype(f32) + (rh * np.asarray(sin, f32)).astype(f32)).astype(f32)


def silu_mul(g, u):
    """g / (1 + exp(-g)) * u, each step rounded to float32."""
    g = np.asarray(g, f32)
    return ((g / (f32(1.0) + exp(-g)).astype(f32)).astype(f32) * np.asarray(u, f32)).astype(f32)


def relu(x):
    """0 below 0, else x (a NaN stays)."""
    x = np.asarray(x, f32)
    return np.where(x < 0, f32(0.0), x).astype(f32)


ACTS = {"gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu}


def _norm(L, name, x, eps):
    """A layer's norm ``name`` of x: LayerNorm where the layer gives its bias (``name + '_b'``, maybe None), else
    RMSNorm; x itself where the layer has no such norm (OLMo 2: none before attention and MLP)."""
    if name not in L:
        return np.asarray(x, f32)
    if name + "_b" in L:
        return layernorm(x, L[name], L[name + "_b"], eps)
    return rmsnorm(x, L[name], eps)


MOE_NORM, MOE_TOPK_SOFTMAX = 1, 2   # decoder.h's moe bits


def route(logits, top_k, bits=0):
    """One row's routing as the kernel computes it: ``logits`` [E] -> (the top_k experts, descending, ties to the lower
    index, a NaN never chosen over a number; their weights [top_k] float32): the softmax of all E (max subtracted,
    :func:`exp`, summed in order) read at them, divided by their sum (in order) with ``MOE_NORM`` in ``bits``; with
    ``MOE_TOPK_SOFTMAX`` the softmax of the chosen logits alone (Granite MoE's)."""
    lg = np.asarray(logits, f32)
    sel = []
    for _ in range(top_k):
        best = -1
        for j in range(len(lg)):
            if j not in sel and (best < 0 or lg[j] > lg[best] or (np.isnan(lg[best]) and not np.isnan(lg[j]))):
                best = j
        sel.append(best)

    def total(v):
        t = f32(0.0)
        for x in v:
            t = f32(t + x)
        return t

    if bits & MOE_TOPK_SOFTMAX:
        w = exp((lg[sel] - lg[sel[0]]).astype(f32))
        return sel, (w / total(w)).astype(f32)
    mx = f32(-np.inf)
    for x in lg:
        mx = x if x > mx else mx
    p = exp((lg - mx).astype(f32))
    w = (p[sel] / total(p)).astype(f32)
    return sel, ((w / total(w)).astype(f32) if bits & MOE_NORM else w)


def _moe(L, x):
    """A mixture-of-experts MLP (``L``: ``router`` [E, H], ``experts`` [(gate, up, down)] per expert, ``top_k``,
    ``moe`` bits for :func:`route`; a shared expert's ``gate``, ``up``, ``down`` and ``shared_gate`` [1, H] where
    it has one): each row's chosen experts' SiLU-gated MLPs, out = 0 then out + (y * w) in ascending expert order,
    then + sigmoid(x . shared_gate) * the shared expert's MLP."""
    x = np.asarray(x, f32)
    logits = rows_linear(x, L["router"], None)
    chosen = [route(row, L["top_k"], L.get("moe", 0)) for row in logits]
    out = np.zeros_like(x)
    for e, (gate, up, down) in enumerate(L["experts"]):
        rows = [(r, w[list(sel).index(e)]) for r, (sel, w) in enumerate(chosen) if e in sel]
        if not rows:
            continue
        xs = x[[r for r, _ in rows]]
        y = rows_linear(silu_mul(rows_linear(xs, gate, None), rows_linear(xs, up, None)), down, None)
        for (r, w), yr in zip(rows, y):
            out[r] = (out[r] + (yr * w).astype(f32)).astype(f32)
    if "gate" in L:
        shared = _mlp({k: L[k] for k in ("gate", "up", "down")}, x, "silu")
        g = rows_linear(x, L["shared_gate"], None)
        sg = (f32(1.0) / (f32(1.0) + exp(-g)).astype(f32)).astype(f32)
        out = (out + (sg * shared).astype(f32)).astype(f32)
    return out


def _mlp(L, x, act):
    """down(silu(gate(x)) * up(x)), down(gelu_tanh(gate(x)) * up(x)) (``act`` "gelu_tanh_glu", Gemma's), or
    down(act(up(x))) with ``act`` "gelu" / "gelu_tanh" / "relu"; a mixture of experts where ``L`` has a ``router``
    (:func:`_moe`)."""
    def lin(x, name):
        return rows_linear(x, L[name], L.get(name + "_b"))

    if "router" in L:
        return _moe(L, x)
    if act == "silu":
        return lin(silu_mul(lin(x, "gate"), lin(x, "up")), "down")
    if act == "gelu_tanh_glu":
        return lin((gelu_tanh(lin(x, "gate")) * lin(x, "up")).astype(f32), "down")
    return lin(ACTS[act](lin(x, "up")), "down")


def _layer(L, x, h, eps, scale, heads, kv_heads, cos, sin, cache, slots, allowed, act="silu", parallel=False,
           pairs=False, attn_cap=0.0, res_mult=1.0, h_first=False):
    """One layer after its input norm: attention input ``x`` [n, X], residual stream ``h`` [n, H]; the keys and
    values written into ``cache`` [2, kv_heads, W', d] at ``slots``; the first ``cos.shape[-1]`` dimensions of
    each head rotated (None: no rotation; ``pairs``: :func:`rotate`'s).  ``parallel``: GPT-NeoX's residual,
    (mlp(norm2(h)) + attention) + h, or (mlp(x) + attention) + h where the layer has no ``ln2`` (Phi, GPT-J).
    ``post_attn`` / ``post_mlp`` in ``L`` (Gemma 2 and 3): RMSNorms of the attention's and the MLP's outputs before
    each is added.  ``attn_cap``: the scores' soft-capping (0: none); ``res_mult``: Granite's residual multiplier,
    h + (out * res_mult) at each add of a sequential layer; ``h_first``: the parallel residual summed as Cohere's,
    (h + attention) + mlp.  Returns the new residual stream."""
    n = x.shape[0]
    d = cache.shape[-1]
    group = heads // kv_heads

    def lin(x, name):
        return rows_linear(x, L[name], L.get(name + "_b"))

    q, k = lin(x, "q"), lin(x, "k")
    after = L.get("qk_after", False)   # (HunYuan: the q/k norms after the rotation)
    if L.get("qk_all") and not after:   # (OLMo 2: q and k normed over all their heads at once)
        q = rmsnorm(q, L["q_norm"], eps) if L.get("q_norm") is not None else q
        k = rmsnorm(k, L["k_norm"], eps) if L.get("k_norm") is not None else k
    q = q.reshape(n, heads, d)
    k = k.reshape(n, kv_heads, d)
    v = lin(x, "v").reshape(n, kv_heads, d)
    if L.get("q_norm") is not None and not L.get("qk_all") and not after:
        q = rmsnorm(q, L["q_norm"], eps)
    if L.get("k_norm") is not None and not L.get("qk_all") and not after:
        k = rmsnorm(k, L["k_norm"], eps)
    if cos is not None and not L.get("no_rot"):   # (SmolLM3's NoPE layers: no rotation)
        R = cos.shape[-1]
        q[..., :R] = rotate(q[..., :R], cos[:, None, :], sin[:, None, :], pairs)
        k[..., :R] = rotate(k[..., :R], cos[:, None, :], sin[:, None, :], pairs)
    if after:
        shape_q, shape_k = q.shape, k.shape
        if L.get("qk_all"):
            q, k = q.reshape(n, -1), k.reshape(n, -1)
        q = rmsnorm(q, L["q_norm"], eps).reshape(shape_q) if L.get("q_norm") is not None else q
        k = rmsnorm(k, L["k_norm"], eps).reshape(shape_k) if L.get("k_norm") is not None else k
    for r, s in enumerate(slots):
        cache[0, :, s] = k[r]
        cache[1, :, s] = v[r]
    W = allowed.shape[1]
    att = np.stack([np.concatenate([attend(q[r, a], cache[0, a // group, :W], cache[1, a // group, :W], allowed[r],
                                           scale, attn_cap) for a in range(heads)]) for r in range(n)])
    o = lin(att, "o")
    if parallel:
        m = _mlp(L, _norm(L, "ln2", h, eps) if "ln2" in L else x, act)
        return ((h + o).astype(f32) + m).astype(f32) if h_first else ((m + o).astype(f32) + h).astype(f32)
    if L.get("post_attn") is not None:
        o = rmsnorm(o, L["post_attn"], eps)
    rm = f32(res_mult)
    h = (h + (o * rm).astype(f32)).astype(f32)
    m = _mlp(L, _norm(L, "ln2", h, eps), act)
    if L.get("post_mlp") is not None:
        m = rmsnorm(m, L["post_mlp"], eps)
    return (h + (m * rm).astype(f32)).astype(f32)


def decoder_layers(layers, final_norm, head, eps, scale, heads, kv_heads, h, cos, sin, cache, slots, allowed,
                   act="silu", parallel=False, pairs=False, local=None, attn_cap=0.0, final_cap=0.0, res_mult=1.0,
                   logit_div=1.0, logit_mult=1.0, h_first=False):
    """The kernel's whole forward for the rows of one request, in NumPy (slow: for the tests' tiny models).

    ``layers``: per layer a dict of float32 arrays ``ln1, ln2, q, k, v, o, gate, up, down`` ([out, in] weights) and
    optionally ``q_b, k_b, v_b, o_b, gate_b, up_b, down_b, q_norm, k_norm`` (per head; over all heads with
    ``qk_all``; after the rotation with ``qk_after``), ``post_attn, post_mlp``, ``no_rot`` (True: the layer rotates
    nothing) and ``local``; a mixture of
    experts' ``router``, ``experts``, ``top_k``, ``moe`` and ``shared_gate`` in place of ``gate``, ``up``, ``down``
    (or with them: Qwen2-MoE's shared expert; :func:`_moe`); without ``ln1``
    and ``ln2`` the blocks read h itself (OLMo 2); ``ln1_b`` and ``ln2_b`` (a bias or None) make those norms
    LayerNorms; ``head``: (weight [V, H], bias or None); ``final_norm``: a weight, or
    (weight, bias or None) for a LayerNorm; ``h`` [n, H]: the rows' embeddings; ``cos``/``sin`` [n, R]: the
    rotation of each head's first R dimensions (None: none); ``cache`` [layers, 2, kv_heads, W', d]: the request's
    keys and values, written in place at columns ``slots`` [n]; ``allowed`` [n, W] bool (W <= W'); ``act``: "silu"
    (gate and up), "gelu_tanh_glu" (Gemma's, gate and up) or "gelu" / "gelu_tanh" / "relu" (up alone); ``parallel``:
    GPT-NeoX's parallel residual (a layer without ``ln2``: its MLP reads ``ln1``'s rows, Phi, GPT-J); ``pairs``:
    GPT-J's rotation of neighbours; ``local``: (allowed, cos, sin) for the layers with ``local`` set in their dict
    (a sliding window's columns, and its own rotation or None for the call's); ``attn_cap``, ``final_cap``: the
    scores' and the logits' soft-capping (0: none); ``res_mult``, ``logit_div``: Granite's residual multiplier
    (:func:`_layer`) and the logits' divisor (before any soft-capping); ``logit_mult``: Cohere's logit scale (before
    the division); ``h_first``: :func:`_layer`'s.  Returns logits [n, V] float32."""
    h = np.array(h, f32)
    for i, L in enumerate(layers):
        sees, c, s = (local[0], local[1] if local[1] is not None else cos, local[2] if local[2] is not None else sin) \
            if L.get("local") else (allowed, cos, sin)
        h = _layer(L, _norm(L, "ln1", h, eps), h, eps, scale, heads, kv_heads, c, s, cache[i], slots, sees,
                   act, parallel, pairs, attn_cap, res_mult, h_first)
    fin = layernorm(h, final_norm[0], final_norm[1], eps) if isinstance(final_norm, tuple) \
        else rmsnorm(h, final_norm, eps)
    logits = rows_linear(fin, head[0], head[1])
    if logit_mult != 1.0:
        logits = (logits * f32(logit_mult)).astype(f32)
    if logit_div != 1.0:
        logits = (logits / f32(logit_div)).astype(f32)
    return softcap(logits, final_cap) if final_cap else logits


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
