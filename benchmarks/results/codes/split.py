"""ar and HeteroSpec (the shipped profile) on the first 4 demo prompts x 96 tokens, 2 rounds: tokens/s and the
per-cycle split from the engine's stats (ms).  PYTHONPATH=<a build> python split.py"""
import time, torch
from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.tools.demo import demo_prompts
target, tok, draft = default_pair()
xs=[]
for p in demo_prompts()[:4]:
    x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
    xs.append(x["input_ids"] if not torch.is_tensor(x) else x)
engines = {"ar": HeteroSpec(target, None, Policy.autoregressive(), max_length=512),
           "hs": HeteroSpec(target, draft, default_policy(), max_length=512)}
for n,e in engines.items(): e.generate(xs[0], max_new_tokens=8)
for rnd in range(2):
  for n,e in engines.items():
    tot={}; toks=0; t=time.perf_counter()
    for x in xs:
        out, st = e.generate(x, max_new_tokens=96)
        toks += out.shape[1]-x.shape[1]
        for f in ("prefill_s","draft_s","verify_s","ops_s","sync_s","total_s","cycles"):
            tot[f]=tot.get(f,0)+getattr(st,f)
    el=time.perf_counter()-t
    c=tot["cycles"]
    print(rnd,n,f"{toks/el:.1f} tok/s", c, "cycles;", " ".join(f"{k[:-2]} {1e3*v/c:.2f}" for k,v in tot.items() if k.endswith("_s")), "host", f"{1e3*(tot['total_s']-tot['prefill_s']-tot['draft_s']-tot['verify_s']-tot['ops_s']-tot['sync_s'])/c:.2f}")
