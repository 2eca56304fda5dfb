import json, sys, time
from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
target, tok, draft = default_pair()
B = "/work/shared/data/benchmarks/"
sets = {"demo": [encode(tok, p) for p in demo_prompts()]}
for f in ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum"):
    sets[f] = [encode(tok, json.loads(l)["turns"][0]) for l in list(open(B + f + ".jsonl"))[:3]]
ar = HeteroSpec(target, None, Policy.autoregressive(), max_length=2048)
hs = HeteroSpec(target, draft, default_policy(), max_length=2048)
def kw(L, hi, lo): return dict(prompt_lookup_num_tokens=L, max_matching_ngram_size=hi, min_matching_ngram_size=lo)
cfgs = [("ar", ar, {}), ("hs", hs, {})] + [(f"{n} L{L} n{lo}-{hi}", e, kw(L, hi, lo)) for n, e in (("ar", ar), ("hs", hs))
        for L, hi, lo in ((4, 3, 2), (4, 3, 3), (8, 3, 3), (10, 2, 1))]
NEW = 128
refs = {k: [ar.generate(x, max_new_tokens=NEW, eos_token_id=tok.eos_token_id)[0] for x in xs] for k, xs in sets.items()}
res = {}
for rnd in range(int(sys.argv[1])):
    for name, e, k in cfgs:
        for sname, xs in sets.items():
            r = res.setdefault((name, sname), [0, 0.0, 0, 0, True])
            for x, ref in zip(xs, refs[sname]):
                out, st = e.generate(x, max_new_tokens=NEW, eos_token_id=tok.eos_token_id, **k)
                r[4] &= bool(out.shape == ref.shape and (out == ref).all())
                r[0] += st.new_tokens; r[1] += st.total_s; r[2] += st.cycles; r[3] += st.committed
    print("round", rnd, flush=True)
names = list(sets)
print("| config | " + " | ".join(names) + " | all |")
base = {s: res[("ar", s)][0] / res[("ar", s)][1] for s in names}
for name, _, _ in cfgs:
    cells = []
    for s in names:
        r = res[(name, s)]
        cells.append(f"{r[0]/r[1]/base[s]:.2f}x tau {r[3]/r[2]:.2f}" + ("" if r[4] else " DIFF"))
    tot = sum(res[(name, s)][0] for s in names) / sum(res[(name, s)][1] for s in names)
    btot = sum(res[("ar", s)][0] for s in names) / sum(res[("ar", s)][1] for s in names)
    print(f"| {name} | " + " | ".join(cells) + f" | {tot/btot:.2f}x ({tot:.1f} tok/s) |")
