"""What transformers' GGUF loader makes of a quantized tensor, written here from the GGUF format's definitions
(ggml's reference quantizers; the dequantization gguf-py and transformers apply): each block of 32 weights along a
row quantized to Q4_1 (d = (max - min) / 15 and m = min as float16, codes trunc((x - min) / d + 0.5) in 0..15,
weights d * q + m in float32) or to Q8_0 (d = max |x| / 127 as float16, codes round(x / d), weights q * d).  The
tests need a float32 weight of exactly that kind without a GGUF file."""
import numpy as np


def q4_1(w):
    w = np.asarray(w, np.float32)
    b = w.reshape(-1, 32)
    lo, hi = b.min(1, keepdims=True), b.max(1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.trunc((b - lo) * inv + np.float32(0.5)).clip(0, 15).astype(np.float32)
    d16, m16 = d.astype(np.float16).astype(np.float32), lo.astype(np.float16).astype(np.float32)
    return (d16 * q + m16).astype(np.float32).reshape(w.shape)


def q8_0(w):
    w = np.asarray(w, np.float32)
    b = w.reshape(-1, 32)
    d = np.abs(b).max(1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.sign(b * inv) * np.floor(np.abs(b * inv) + np.float32(0.5))   # round half away from zero (roundf)
    q = q.astype(np.int8).astype(np.float32)                               # int8 codes, as stored (no -0)
    return (q * d.astype(np.float16).astype(np.float32)).astype(np.float32).reshape(w.shape)


def quantize_like_gguf(model):
    """Every linear weight of a transformers model (rows of a multiple of 32; a mixture's experts, [E, N, K], each
    expert's) as Q4_1 decodings and the input embedding and output layer as Q8_0 decodings, in place, as a Q4_1 GGUF
    checkpoint loads (SmolLM2's)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() not in (2, 3) or p.shape[-1] % 32:
                continue
            codes = q8_0 if ("embed" in name or "lm_head" in name) else q4_1
            w = p.detach().cpu().numpy().reshape(-1, p.shape[-1])
            p.copy_(torch.from_numpy(codes(w).reshape(p.shape)))
    return model


# the float16 fields of each block (byte offsets), after ggml's block structs (ggml-common.h); the other bytes
# (codes, packed sub-block scales) take any value
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              # the grid formats (d first) and the ternary ones (d last); not IQ1_M (its d is spread over the
              # scales' nibbles) nor MXFP4 (a power-of-two byte)
              "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_S": (0,), "IQ3_XXS": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,),
              "IQ2_S": (0,), "IQ1_S": (0,), "TQ2_0": (64,), "TQ1_0": (52,)}


def random_blocks(kind, n, k, rng, scale=1e-3, signed=True):
    """An [n, k] float32 weight as transformers loads a GGUF tensor of ggml type ``kind`` (a name of F16_FIELDS):
    random bytes in ggml's block layout (codes and sub-block scales uniform, the float16 super-scales of magnitude
    ``scale`` and random sign where ``signed``), dequantized by gguf-py's own ``dequantize``, as transformers'
    loader does.  Returns (weights, the raw blocks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    assert k % block == 0
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    if kind == "Q8_0":   # ggml's Q8_0 codes are round(x / d) with d = max |x| / 127: never -128
        raw[:, 2:] = np.where(raw[:, 2:] == 128, 129, raw[:, 2:])
    for off in F16_FIELDS[kind]:
        v = (rng.uniform(0.5, 2.0, len(raw)) * scale).astype(np.float16)
        if signed and off == 0 and kind in ("Q4_0", "Q5_0", "Q8_0"):
            v = v * np.where(rng.random(len(raw)) < 0.5, -1, 1).astype(np.float16)
        raw[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    w = dequantize(raw.reshape(n, -1), qtype).astype(np.float32)
    assert w.shape == (n, k)
    return w, raw


def _group(k):
    """The weights along a row that share the K-quants' float16 super-scales: 256, or fewer where k is no multiple
    of 256 (ggml falls back to another format there; a test wants the values alone)."""
    return min(256, k) if k % min(256, k) == 0 else next(g for g in (128, 64, 32) if k % g == 0)


def q4_k(w, top=15):
    """Q4_K's values, after ggml's reference quantizer in outline (ggml-quants.c): per block of 32 a scale
    (max + mn) / 15 and a min mn = max(0, -min), both quantized to 6 bits against the float16 super-scales d =
    max scale / 63 and dmin = max mn / 63 of each group of up to 256 along the row; codes round((x + m) / s) in 0..15;
    the weights gguf-py's dequantization makes: (d * sc) * q - (dmin * m) in float32.  ``top`` 31: Q5_K's."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    g = _group(k)
    b = w.reshape(n, k // g, g // 32, 32)
    mn = np.maximum(0, -b.min(-1, keepdims=True))
    sc = (b.max(-1, keepdims=True) + mn) / np.float32(top)
    d = (sc.max(-2, keepdims=True) / np.float32(63)).astype(np.float16).astype(np.float32)
    dmin = (mn.max(-2, keepdims=True) / np.float32(63)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        isc = np.where(d > 0, np.clip(np.rint(sc / d), 0, 63), 0).astype(np.float32)
        imn = np.where(dmin > 0, np.clip(np.rint(mn / dmin), 0, 63), 0).astype(np.float32)
        a, dm = d * isc, dmin * imn
        q = np.where(a > 0, np.clip(np.rint((b + dm) / a), 0, top), 0).astype(np.float32)
    return (a * q - dm).astype(np.float32).reshape(n, k)


def q5_k(w):
    """Q5_K's values: :func:`q4_k`'s with codes in 0..31."""
    return q4_k(w, 31)


def q6_k(w):
    """Q6_K's values, in outline: per block of 16 a signed scale (the value of largest magnitude over -32),
    quantized to an int8 against the float16 super-scale d = max |scale| / 127 (sign kept in the int8) of each
    group of up to 256; codes round(x / s) in -32..31; weights (d * sc) * q in float32, so a code 0 under a negative
    scale is -0, as gguf-py's dequantization gives."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    g = _group(k)
    b = w.reshape(n, k // g, g // 16, 16)
    big = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
    scale = big / np.float32(-32)
    d = (np.abs(scale).max(-2, keepdims=True) / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.clip(np.rint(scale / d), -128, 127), 0).astype(np.int8).astype(np.float32)
        a = d * sc
        q = np.where(a != 0, np.clip(np.rint(b / a), -32, 31), 0).astype(np.int8).astype(np.float32)   # no -0
    return (a * q).astype(np.float32).reshape(n, k)


def k_quantize_like_gguf(model):
    """As :func:`quantize_like_gguf`, a Q4_K_M checkpoint's mix: the MLP's down projection, the value projection,
    the input embedding and the output layer as Q6_K, every other linear weight as Q4_K."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() not in (2, 3) or p.shape[-1] % 32:
                continue
            six = any(s in name for s in ("embed", "lm_head", "down", "v_proj"))
            w = p.detach().cpu().numpy().reshape(-1, p.shape[-1])
            p.copy_(torch.from_numpy((q6_k if six else q4_k)(w).reshape(p.shape)))
    return model
