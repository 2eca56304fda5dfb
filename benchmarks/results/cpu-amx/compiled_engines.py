"""Our engines eager against compile=True on this machine: `ar` and `heterospec` (shipped CPU profile), the default
pair in float32, the same 3 built-in demo prompts x 96 new tokens (EOS stops), each engine warmed up first, then
3 rounds taking turns; the tokens of all four compared.  python benchmarks/results/cpu-amx/compiled_engines.py"""
import json
import time

import torch

from heterospec import HeteroSpec, Policy, default_policy
from heterospec.models.default import default_pair

model, tok, draft = default_pair()
policy = default_policy()
prompts = json.load(open("heterospec/data/demo_prompts.json"))["prompts"][:3]
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
       for p in prompts]
ids = [i["input_ids"] if not torch.is_tensor(i) else i for i in ids]
eos = tok.eos_token_id


def rate(e):
    toks, t, outs = 0, 0.0, []
    for x in ids:
        t0 = time.perf_counter()
        s, _ = e.generate(x, max_new_tokens=96, eos_token_id=eos)
        t += time.perf_counter() - t0
        toks += s.shape[1] - x.shape[1]
        outs.append(s[0].tolist())
    return toks / t, outs


engines = {
    "ar": HeteroSpec(model, None, Policy.autoregressive(), max_length=512),
    "ar compiled": HeteroSpec(model, None, Policy.autoregressive(), compile=True, max_length=512),
    "heterospec": HeteroSpec(model, draft, policy, max_length=512),
    "heterospec compiled": HeteroSpec(model, draft, policy, compile=True, max_length=512),
}
for name, e in engines.items():
    t0 = time.perf_counter()
    rate(e)
    print(name, "warm-up s", f"{time.perf_counter() - t0:.1f}", e.cpu_gemm, flush=True)
for r in range(3):
    res = {n: rate(e) for n, e in engines.items()}
    outs = [o for _, o in res.values()]
    print(r, "  ".join(f"{n} {v:.2f}" for n, (v, _) in res.items()), "same tokens", all(o == outs[0] for o in outs),
          flush=True)
