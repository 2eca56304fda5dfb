"""ar, heterospec with the draft's step on the C layer (cpu_decoder's draft layout) and heterospec with the draft's
torch modules (their linears on cpu_gemm, as before), all three with the target on the decoder: the 4 first demo
prompts x 96 tokens, 3 rounds after a warm-up, in turn, per-cycle draft time from the engine's stats, outputs
compared.  PYTHONPATH=. python benchmarks/results/cpu-draft/engines.py"""
import time

import torch

from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.models import cpu_decoder
from heterospec.tools.demo import demo_prompts

target, tok, draft = default_pair()
pol = default_policy()
xs = []
for p in demo_prompts()[:4]:
    x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
    xs.append(x["input_ids"] if not torch.is_tensor(x) else x)
engines = {"ar": HeteroSpec(target, None, Policy.autoregressive(), max_length=512),
           "hs-c-draft": HeteroSpec(target, draft, pol, max_length=512)}
real = cpu_decoder.for_draft
cpu_decoder.for_draft = lambda setting, d: None      # the engine as it was: the draft's modules on cpu_gemm
engines["hs-torch-draft"] = HeteroSpec(target, draft, pol, max_length=512)
cpu_decoder.for_draft = real
for n, e in engines.items():
    print(n, "| cpu_decoder:", e.cpu_decoder, "| cpu_gemm:", e.cpu_gemm)
    e.generate(xs[0], max_new_tokens=8)
res = {}
for rnd in range(3):
    for n, e in engines.items():
        t = time.perf_counter()
        toks = cyc = 0
        dr = 0.0
        outs = []
        for x in xs:
            out, st = e.generate(x, max_new_tokens=96)
            toks += out.shape[1] - x.shape[1]
            outs.append(out[0, x.shape[1]:].tolist())
            dr += st.draft_s
            cyc += st.cycles
        el = time.perf_counter() - t
        res.setdefault(n, []).append(outs)
        print(rnd, n, f"{toks / el:.1f} tok/s, draft {1e3 * dr / cyc:.2f} ms a cycle, {cyc} cycles", flush=True)
print("outputs equal to ar's in every round:", {n: all(r == res["ar"][0] for r in res[n]) for n in res})
