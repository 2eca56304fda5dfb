"""ar, the shipped CPU profile and a new one (argument 4, default: profile.json beside this script) on demo prompts
[argument 2, argument 3) x 96 tokens, in the order fwd or rev (argument 1): tokens/s, and whether the outputs agree."""
import os, sys, time

from heterospec import HeteroSpec, Policy
from heterospec.models.default import default_pair
from heterospec.policy.profile import default_policy, load_profile
from heterospec.tools.prompts import encode
from heterospec.tools.demo import demo_prompts
pair = default_pair()
target, tok, draft = pair.target, pair.tokenizer, pair.draft
which = sys.argv[1]
prompts = [encode(tok, p) for p in demo_prompts()[int(sys.argv[2]):int(sys.argv[3])]]
pols = [("ar", Policy.autoregressive()), ("shipped", default_policy("cpu")), ("new", load_profile(sys.argv[4] if len(sys.argv) > 4 else os.path.join(os.path.dirname(__file__), "profile.json"))[0])]
if which == "rev": pols = pols[::-1]
res, outs = {}, {}
for name, pol in pols:
    eng = HeteroSpec(target, draft if name != "ar" else None, pol)
    eng.generate(prompts[0], max_new_tokens=16)
    t = time.perf_counter(); n = 0; o = []
    for p in prompts:
        out = eng.generate(p, max_new_tokens=96)[0]
        o.append(out[0, p.shape[1]:].tolist()); n += out.shape[1] - p.shape[1]
    res[name] = n / (time.perf_counter() - t); outs[name] = o
print(which, {k: round(v, 1) for k, v in res.items()}, "same" if outs["ar"] == outs["shipped"] == outs["new"] else "DIFFER")
