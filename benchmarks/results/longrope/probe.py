"""The engine on tiny random LongRoPE targets (a Phi-3, whose generate recomputes its cache at the switch, and a
Llama with LongRoPE, whose does not), switching at position 24: greedy tokens and the raw logits of five methods
against HF's own generate, for prompts below, at and past the switch (24 new tokens).  Correctness only.
python benchmarks/results/longrope/probe.py   (OK: same tokens and logits within 1e-4; the number: max |logit diff|)"""
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
import torch, transformers
warnings.filterwarnings("ignore")
from _doubles import OracleDraft, NoisyDraft
from _models import THRESHOLDS
from heterospec import HeteroSpec, Policy
try:
    from heterospec.models.target import rope_switch
except ImportError:          # the engine before the fix
    rope_switch = lambda m: "unknown"
V, AT = 64, 24
RP = dict(rope_type="longrope", long_factor=[1.0, 3.0, 9.0, 27.0], short_factor=[1.0, 1.1, 1.2, 1.3],
          original_max_position_embeddings=AT)


def mk(arch):
    torch.manual_seed(0)
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, attn_implementation="sdpa", pad_token_id=0, max_position_embeddings=256)
    if arch == "phi3":
        m = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw, original_max_position_embeddings=AT,
                                                                 rope_parameters=dict(RP)))
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, rope_parameters=dict(RP)))
    m = m.eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40)
    m.generation_config.eos_token_id = None
    return m


print("transformers", transformers.__version__)
for arch in ("phi3", "llama"):
    m = mk(arch)
    print(arch, "rope_switch:", rope_switch(m))
    for PL in (10, 20, 23, 24, 25, 30):
        p = torch.randint(0, V, (1, PL), generator=torch.Generator().manual_seed(PL))
        o = m.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                       pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        ref = o.sequences[0, PL:].tolist()
        rl = torch.stack(o.logits, 1)[0]
        res = []
        for label, d, pol, kw in (("ar", None, Policy.autoregressive(), {}),
                                  ("oracle", OracleDraft(m), Policy.static(5, 3, 16), {}),
                                  ("noisy", NoisyDraft(32, V), Policy.static(4, 4, 12), {}),
                                  ("hetero", NoisyDraft(32, V, seed=3), Policy.paper(4, 4, 20, THRESHOLDS), {}),
                                  ("lookup", None, Policy.autoregressive(), dict(prompt_lookup_num_tokens=4))):
            with HeteroSpec(m, d, pol, cuda_graphs=False) as hs:
                out, st = hs.generate(p, max_new_tokens=24, eos_token_id=[], output_logits=True, **kw)
            got = out[0, PL:].tolist()
            err = float((st.logits - rl).abs().max())
            res.append(f"{label}:{'OK' if got == ref and err < 1e-4 else 'DIFF'}({err:.1e})")
        print(f"  prompt {PL:2d}", " ".join(res), flush=True)
