"""ar and HeteroSpec (the shipped CPU profile) on the first 4 demo prompts x 96 tokens: tokens/s, ms a cycle and a hash of
the outputs.  One process per build, alternated: PYTHONPATH=<a copy of heterospec/ built at a commit> python ab.py A"""
import time, torch, sys, hashlib
from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.tools.demo import demo_prompts
target, tok, draft = default_pair()
xs=[]
for p in demo_prompts()[:4]:
    x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
    xs.append(x["input_ids"] if not torch.is_tensor(x) else x)
engs = {"ar": HeteroSpec(target, None, Policy.autoregressive(), max_length=512), "hs": HeteroSpec(target, draft, default_policy(), max_length=512)}
for e in engs.values(): e.generate(xs[0], max_new_tokens=8)
res = []
h = hashlib.sha256()
for name, e in engs.items():
    toks = 0; t = time.perf_counter(); cyc = 0
    for x in xs:
        o, st = e.generate(x, max_new_tokens=96); toks += o.shape[1] - x.shape[1]; cyc += st.cycles
        h.update(str(o.tolist()).encode())
    el = time.perf_counter() - t
    res.append(f"{name} {toks/el:6.1f} tok/s ({1e3*el/cyc:5.2f} ms/cycle)")
print(sys.argv[1], " | ".join(res), h.hexdigest()[:12], flush=True)
