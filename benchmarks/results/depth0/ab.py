import time, sys, statistics
from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
target, tok, draft = default_pair()
n = int(sys.argv[1]); rounds = int(sys.argv[2]); specs = sys.argv[3:]
xs = [encode(tok, p) for p in demo_prompts()[:n]]
def pol(s):
    if s == "ar": return Policy.autoregressive()
    if s == "shipped": return default_policy()
    if s.endswith(".json"): return Policy.from_profile(s)
    return Policy.static(*map(int, s.split(",")))
eng = {s: HeteroSpec(target, None if s == "ar" else draft, pol(s), max_length=1024) for s in specs}
for e in eng.values(): e.generate(xs[0], max_new_tokens=8)
res = {s: [] for s in specs}; outs = {}
for r in range(rounds):
    order = specs if r % 2 == 0 else specs[::-1]
    for s in order:
        t = time.perf_counter(); new = 0; cyc = 0; o = []
        for x in xs:
            out, st = eng[s].generate(x, max_new_tokens=96); new += st.new_tokens; cyc += st.cycles; o.append(out.tolist())
        el = time.perf_counter() - t
        res[s].append(new / el); outs.setdefault(s, o)
        print(r, s, f"{new/el:.1f} tok/s tau {new/cyc:.2f}", flush=True)
print("outputs equal:", all(o == outs[specs[0]] for o in outs.values()))
for s in specs:
    print(f"{s:40s} median {statistics.median(res[s]):.1f} tok/s  x ar {statistics.median(a/b for a, b in zip(res[s], res['ar'])) if 'ar' in res else 0:.3f}")
