"""The engine on tiny random models of many transformers architectures: greedy output of `ar`, an oracle draft's
trees and a noisy draft's trees against HF's own generate (30-token prompt, 40 new tokens); for a model with a
sliding window, whether the window changes HF's output (the same weights with a window of 4096).  Correctness only.
python benchmarks/results/sliding-window/probe.py [ARCH ...]   (SHARPEN=1: the lm_head unscaled, as Gemma needs)"""
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
import torch, transformers
warnings.filterwarnings("ignore")
from _doubles import OracleDraft, NoisyDraft
from heterospec import HeteroSpec, Policy
V = 64
common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, attn_implementation="sdpa")
ARCHS = {
 "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
 "mistral-sw16": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
 "qwen2-sw": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
 "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8)),
 "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8, sliding_window=16, attn_implementation="eager")),
 "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=8, sliding_window=16)),
 "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
 "phi3-sw16": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, sliding_window=16)),
 "mixtral-sw16": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=16, num_local_experts=4, num_experts_per_tok=2)),
 "starcoder2-sw16": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=16)),
 "qwen3-sw": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, use_sliding_window=True, sliding_window=16, max_window_layers=2)),
 "exaone4-sw": ("Exaone4Config", "Exaone4ForCausalLM", dict(sliding_window=16, sliding_window_pattern=4)),
 "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
 "granite": ("GraniteConfig", "GraniteForCausalLM", dict()),
 "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict()),
 "cohere": ("CohereConfig", "CohereForCausalLM", dict()),
 "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=None)),
 "glm": ("GlmConfig", "GlmForCausalLM", dict(head_dim=8, pad_token_id=0)),
 "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2)),
 "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
 "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(pad_token_id=0)),
 "phi": ("PhiConfig", "PhiForCausalLM", dict()),
 "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict()),
 "olmo": ("OlmoConfig", "OlmoForCausalLM", dict()),
 "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(head_dim=8, intermediate_size_mlp=64, num_local_experts=2)),
 "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(head_dim=8)),
 "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=8)),
 "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(head_dim=8)),
 "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(head_dim=8, num_local_experts=4, sliding_window=16, attn_implementation="eager")),
}
only = sys.argv[1:] or list(ARCHS)
for name in only:
    cfgn, clsn, extra = ARCHS[name]
    try:
        Cfg, Cls = getattr(transformers, cfgn), getattr(transformers, clsn)
        kw = dict(common); kw.update(extra)
        torch.manual_seed(0)
        m = Cls(Cfg(**kw)).eval().float()
        m.generation_config.eos_token_id = None
        with torch.no_grad():
            for p in m.get_output_embeddings().parameters():
                p.mul_(float(os.environ.get("SHARPEN", "40")))
        g = torch.Generator().manual_seed(1)
        p = torch.randint(0, V, (1, 30), generator=g)
        ref = m.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=40, min_new_tokens=40,
                         pad_token_id=0, eos_token_id=None)[0, 30:].tolist()
        kw2 = dict(kw)
        if kw2.get("sliding_window"): kw2["sliding_window"] = 4096
        torch.manual_seed(0)
        m2 = Cls(Cfg(**kw2)).eval().float()
        m2.load_state_dict(m.state_dict())
        m2.generation_config.eos_token_id = None
        ref2 = m2.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=40, min_new_tokens=40,
                         pad_token_id=0, eos_token_id=None)[0, 30:].tolist()
        res = ["window-matters" if ref2 != ref else "window-no-effect"]
        for label, d, pol in (("ar", None, Policy.autoregressive()), ("oracle", OracleDraft(m), Policy.static(5, 3, 16)),
                              ("noisy", NoisyDraft(32, V), Policy.static(4, 4, 12))):
            with HeteroSpec(m, d, pol, cuda_graphs=False) as hs:
                out, st = hs.generate(p, max_new_tokens=40, eos_token_id=[])
            got = out[0, 30:].tolist()
            res.append(f"{label}:{'OK' if got == ref else 'DIFF@%d' % next(i for i,(a,b) in enumerate(zip(got, ref)) if a != b)}")
        print(f"{name:18s}", " ".join(res), flush=True)
    except Exception as e:
        print(f"{name:18s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
