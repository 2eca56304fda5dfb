"""Our batched autoregressive decoding (`ar`) on the demo prompts (cycled to B rows), 64 new tokens, EOS off:
decode-only tokens/s (the prefill subtracted), the best of 3 calls.  Run against two checkouts in alternated processes:
    PYTHONPATH=<checkout> python benchmarks/results/avx2-rows/batch_decode.py LABEL B"""
import time, sys, torch
from heterospec import HeteroSpec, Policy, default_pair
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
target, tok, draft = default_pair()
ps = demo_prompts()
B = int(sys.argv[2])
xs = [encode(tok, ps[i % len(ps)])[0].tolist() for i in range(B)]
S = max(map(len, xs))
ids = torch.tensor([[tok.pad_token_id or 0] * (S - len(x)) + x for x in xs]); am = torch.tensor([[0] * (S - len(x)) + [1] * len(x) for x in xs])
out = {}
for name, pol, d in (("ar", Policy.autoregressive(), None),):   # (HeteroSpec alone was too noisy here)
    e = HeteroSpec(target, d, pol, max_length=512)
    e.generate(ids, attention_mask=am, max_new_tokens=8)
    best = 0
    for r in range(3):
        t = time.perf_counter(); o, st = e.generate(ids, attention_mask=am, max_new_tokens=64, eos_token_id=[]); dt = time.perf_counter() - t
        best = max(best, sum(len(x) for x in o) / (dt - st.prefill_s))
    out[name] = best
print(sys.argv[1], f"batch {B}", " ".join(f"{k} {v:.1f} tok/s" for k, v in out.items()))
