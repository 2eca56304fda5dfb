"""ar, the shipped CPU profile and static trees (argument 2 absent) or the --top-k-tree 2 profile (argument 2 "profile")
on the first 6 demo prompts x 96 tokens, in the order fwd or rev (argument 1): (tokens/s, tau), and whether the outputs agree."""
import os, sys, time

from heterospec import HeteroSpec, Policy
from heterospec.models.default import default_pair
from heterospec.policy.profile import default_policy, load_profile
from heterospec.tools.prompts import encode
from heterospec.tools.demo import demo_prompts
pair = default_pair()
target, tok, draft = pair.target, pair.tokenizer, pair.draft
prompts = [encode(tok, p) for p in demo_prompts()[:6]]
pols = [("ar", Policy.autoregressive()), ("shipped", default_policy("cpu"))]
if len(sys.argv) > 2 and sys.argv[2] == "profile":   # the profile calibrated with --top-k-tree 2, beside this script
    pols += [("k2cal", load_profile(os.path.join(os.path.dirname(__file__), "profile.json"))[0]), ("s1-2-3", Policy.static(1, 2, 3))]
else:
    pols += [("s1-10-3", Policy.static(1, 10, 3)), ("s1-2-3", Policy.static(1, 2, 3)), ("s1-3-4", Policy.static(1, 3, 4))]
if sys.argv[1] == "rev": pols = pols[::-1]
res, outs = {}, {}
for name, pol in pols:
    eng = HeteroSpec(target, draft if name != "ar" else None, pol)
    eng.generate(prompts[0], max_new_tokens=16)
    t = time.perf_counter(); n = 0; o = []; cyc = 0
    for p in prompts:
        out, st = eng.generate(p, max_new_tokens=96)
        o.append(out[0, p.shape[1]:].tolist()); n += out.shape[1] - p.shape[1]; cyc += st.cycles
    res[name] = (round(n / (time.perf_counter() - t), 1), round(n / cyc, 2)); outs[name] = o
print(sys.argv[1], res, "same" if all(v == outs["ar"] for v in outs.values()) else "DIFFER", flush=True)
