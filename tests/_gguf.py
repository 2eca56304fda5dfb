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
