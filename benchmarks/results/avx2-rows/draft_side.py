"""The draft's side of a cycle on the CPU for two static trees (EAGLE-3's 7/10/60, and depth 1 / top 10 / 4 nodes: a
3-row catch-up and one level of 10 beams): tokens/s, the draft phase's ms a cycle and tau on 4 demo prompts x 64 tokens.
Run against two checkouts in alternated processes: PYTHONPATH=<checkout> python draft_side.py LABEL"""
import sys, time
from heterospec import HeteroSpec, Policy, default_pair
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
target, tok, draft = default_pair()
xs = [encode(tok, p) for p in demo_prompts()[:4]]
out = []
for name, pol in (("eagle3 7/10/60", Policy.static()), ("static 1/10/4", Policy.static(1, 10, 4))):
    e = HeteroSpec(target, draft, pol, max_length=512)
    e.generate(xs[0], max_new_tokens=8)
    tok_n = 0; t = 0.0; cyc = 0; dr = 0.0
    for x in xs:
        o, st = e.generate(x, max_new_tokens=64); tok_n += st.new_tokens; t += st.total_s - st.prefill_s; cyc += st.cycles; dr += st.draft_s
    out.append(f"{name}: {tok_n / t:.1f} tok/s, draft {1e3 * dr / cyc:.2f} ms/cycle, tau {tok_n / cyc:.2f}")
print(sys.argv[1], " | ".join(out))
