# One process of the profile A/B: python ab_profile.py PROFILE.json -> ar and HeteroSpec tokens/s on 3 demo prompts x 96 tokens, and a digest of each method's outputs
import sys, time, torch, heterospec
from heterospec.tools import prompts as P
prof = sys.argv[1]

torch.manual_seed(0)
target, tok, draft = heterospec.default_pair()
from heterospec import Policy
qs = ["Explain in a short paragraph why the sky looks blue during the day and red at sunset.",
      "Write a Python function that checks whether a number is prime.", "What is 17 * 23? Explain."]
ids = [P.encode(tok, q) for q in qs]
res = {}
for name, pol in (("ar", Policy.autoregressive()), ("hs", heterospec.Policy.from_profile(prof))):
    with heterospec.HeteroSpec(target, draft, pol) as hs:
        hs.generate(ids[0], max_new_tokens=16)
        n = 0; t = time.perf_counter(); outs = []
        for i in ids:
            s, st = hs.generate(i, max_new_tokens=96); n += s.shape[1] - i.shape[1]; outs.append(s)
        dt = time.perf_counter() - t
        res[name] = (n / dt, [o.tolist() for o in outs])
import hashlib; print(prof[-30:], {k: round(v[0], 1) for k, v in res.items()}, hashlib.md5(str(res["ar"][1]).encode()).hexdigest()[:8], hashlib.md5(str(res["hs"][1]).encode()).hexdigest()[:8], flush=True)
