"""Our `ar` eager against our `ar` with compile=True (inductor), its linears packed (cpu_gemm auto) and not: the
default pair in float32 on the CPU, the same 3 built-in demo prompts x 96 new tokens (EOS stops), each engine
warmed up first, then 4 rounds taking turns; the tokens of the three compared.  Ran on a probe branch whose
compile=True kept the packed linears through a custom operator (not kept, see RESULTS); on main the second
engine is the third one.  python benchmarks/results/cpu-avx2-compile/compiled_ar3.py"""
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
        HeteroSpec(model, None, Policy.autoregressive(), compile=True, max_length=512) as c, \
        HeteroSpec(model, None, Policy.autoregressive(), compile=True, cpu_gemm=False, max_length=512) as u:
    t0 = time.perf_counter()
    rate(c)
    print("compiled warm-up s", f"{time.perf_counter() - t0:.1f}", c.cpu_gemm, flush=True)
    rate(u)
    rate(e)
    for r in range(4):
        a, oa = rate(e)
        b, ob = rate(c)
        m, om = rate(u)
        print(r, "ar", f"{a:.2f}", "ar compiled, packed", f"{b:.2f}", "ar compiled, torch linear", f"{m:.2f}",
              "same tokens", oa == ob == om, flush=True)
