"""Does emulating transformers' bfloat16 rounding buy fidelity to transformers' own bf16 forward? (2026-12-07)

The default target (SmolLM2-135M-Instruct, its GGUF's weights rounded to bf16), 200 random token ids, one prefill
through transformers' bf16 forward (sdpa) as the reference.  Compared with it:
- a float32 forward that rounds to bf16 wherever torch's bf16 forward rounds (each linear's output, the norm's
  two products, the rotation's products and sum, attention's output, the residual adds, silu and its product;
  mode 1 also rounds the softmax's weights before P @ V, as torch's CPU flash attention does);
- transformers' own bf16 forward of the first 100 tokens only (the same model, another row count);
- a one-token step at position 150 on the cache of a 150-token prefill;
- the same weights in float32 (``model.float()``).
Printed: the fraction of logits bit-identical to the reference, and of positions whose argmax agrees.
Run from the repository root: python benchmarks/results/cpu-bf16-decoder/bf16_rounding_probe.py
"""
import torch

from heterospec.models.default import default_target

torch.manual_seed(0)
res = default_target(dtype=torch.bfloat16)
m = res[0] if isinstance(res, tuple) else res
print(type(m).__name__, next(m.parameters()).dtype, m.config._attn_implementation)
cfg = m.config
H, nh, kvh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
D = H // nh


def r(x):
    return x.to(torch.bfloat16).float()


def rms(x, w, eps):
    v = (x * x).mean(-1, keepdim=True)
    return r(w.float() * r(x * torch.rsqrt(v + eps)))


def lin(x, W):
    return r(x @ W.float().t())


def rot_half(x):
    return torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)


def emulated(ids, mode):
    T = ids.shape[1]
    h = m.model.embed_tokens(ids).float()[0]
    cos, sin = m.model.rotary_emb(m.model.embed_tokens(ids), torch.arange(T)[None])
    cos, sin = cos.float()[0], sin.float()[0]
    for L in m.model.layers:
        a = L.self_attn
        x = rms(h, L.input_layernorm.weight, cfg.rms_norm_eps)
        q = lin(x, a.q_proj.weight).view(T, nh, D).transpose(0, 1)
        k = lin(x, a.k_proj.weight).view(T, kvh, D).transpose(0, 1)
        v = lin(x, a.v_proj.weight).view(T, kvh, D).transpose(0, 1)
        q = r(r(q * cos) + r(rot_half(q) * sin))
        k = r(r(k * cos) + r(rot_half(k) * sin))
        k, v = k.repeat_interleave(nh // kvh, 0), v.repeat_interleave(nh // kvh, 0)
        s = (q @ k.transpose(1, 2)) * (D ** -0.5)
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        l = p.sum(-1, keepdim=True)
        if mode == 1:
            p = r(p)
        o = r((p @ v) / l).transpose(0, 1).reshape(T, H)
        h = r(h + lin(o, a.o_proj.weight))
        x = rms(h, L.post_attention_layernorm.weight, cfg.rms_norm_eps)
        act = r(torch.nn.functional.silu(lin(x, L.mlp.gate_proj.weight)))
        h = r(h + lin(r(act * lin(x, L.mlp.up_proj.weight)), L.mlp.down_proj.weight))
    return lin(rms(h, m.model.norm.weight, cfg.rms_norm_eps), m.lm_head.weight)


def agree(name, a, b):
    print(f"{name}: identical logits {(a == b).float().mean().item():.3f}, "
          f"argmax agrees {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.3f}")


ids = torch.randint(100, 40000, (1, 200), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    ref = m(ids).logits.float()[0]
    for mode in (0, 1):
        agree(f"bf16 rounding emulated in float32 (mode {mode})", emulated(ids, mode), ref)
    agree("transformers bf16, a prefill of the first 100 tokens", m(ids[:, :100]).logits.float()[0], ref[:100])
    out = m(ids[:, :150], use_cache=True)
    step = m(ids[:, 150:151], past_key_values=out.past_key_values).logits.float()[0]
    agree("transformers bf16, a one-token step at position 150", step, ref[150:151])
    agree("the same weights in float32", m.float()(ids).logits[0], ref)
