import time, torch, sys
from heterospec import HeteroSpec, Policy
from heterospec.models.default import default_pair
from heterospec.policy.profile import default_policy
from heterospec.tools.prompts import encode
from heterospec.tools.demo import demo_prompts
pair = default_pair()
target, tok, draft = pair.target, pair.tokenizer, pair.draft
prompts = [encode(tok, p) for p in demo_prompts()[:6]]
pols = [("ar", Policy.autoregressive()), ("shipped", default_policy("cpu")), ("s1-10-3", Policy.static(1, 10, 3)), ("s1-2-3", Policy.static(1, 2, 3)), ("s1-3-4", Policy.static(1, 3, 4))]
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
