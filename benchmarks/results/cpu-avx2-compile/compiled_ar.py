"""Our `ar` eager against our `ar` with compile=True (inductor), the default pair in float32 on the CPU: the same 3
built-in demo prompts x 96 new tokens (EOS stops), each engine warmed up on them first, then 3 rounds taking
turns; the tokens of the two compared.  Run from the repository root: python benchmarks/results/cpu-avx2-compile/compiled_ar.py"""
import json
import time

import torch

from heterospec import HeteroSpec, Policy
from heterospec.models.default import default_target

model, tok = default_target()
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


with HeteroSpec(model, None, Policy.autoregressive(), max_length=512) as e, \
        HeteroSpec(model, None, Policy.autoregressive(), compile=True, max_length=512) as c:
    t0 = time.perf_counter()
    rate(c)
    print("compiled warm-up s", f"{time.perf_counter() - t0:.1f}", flush=True)
    rate(e)
    for r in range(3):
        a, oa = rate(e)
        b, ob = rate(c)
        print(r, "ar", f"{a:.2f}", "ar compiled", f"{b:.2f}", "same tokens", oa == ob, flush=True)
