"""Estimate what an n-gram (prompt lookup) branch added to the draft tree would add to tau, from the cycles of real
runs: per cycle, the tree's accepted drafts vs the lookup chain's accepted length on the known greedy output."""
import json, sys, collections, torch
from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.engine import cycle as cy
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
target, tok, draft = default_pair()
B = "/work/shared/data/benchmarks/"
sets = {"demo": [encode(tok, p) for p in demo_prompts()]}
for f in ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum"):
    qs = [json.loads(l) for l in open(B + f + ".jsonl")][:int(sys.argv[2])]
    sets[f] = [encode(tok, q["turns"][0]) for q in qs]
pol = default_policy() if sys.argv[1] == "hs" else Policy.static(7, 10, 60)
e = HeteroSpec(target, draft, pol, max_length=2048)
lens = []
orig = cy.Cycle.finish
def fin(self, *a, **k):
    out = orig(self, *a, **k); lens.append(int(out[0, 0])); return out
cy.Cycle.finish = fin

def lookup(ctx, L, nmax=3, nmin=1):
    for n in range(nmax, nmin - 1, -1):
        if len(ctx) <= n: continue
        key = ctx[-n:]
        for s in range(len(ctx) - n - 1, -1, -1):
            if ctx[s:s + n] == key:
                return ctx[s + n: s + n + L]
    return []

for name, xs in sets.items():
    tot_cyc = tot_new = 0; gain = {L: 0 for L in (2, 4, 8)}; hit = {L: 0 for L in (2, 4, 8)}; matched = 0
    for x in xs:
        lens.clear()
        out, st = e.generate(x, max_new_tokens=128, eos_token_id=tok.eos_token_id)
        out = out.view(-1).tolist() if hasattr(out, "view") else out
        prompt = x.view(-1).tolist()
        gen = out[len(prompt):] if out[:len(prompt)] == prompt else out
        p = 0
        for ln in lens:
            ctx = prompt + gen[:p + 1]
            for L in gain:
                prop = lookup(ctx, L)
                a = 0
                for t, g in zip(prop, gen[p + 1:]):
                    if t != g: break
                    a += 1
                if L == 4 and prop: matched += 1
                if a > ln - 1: gain[L] += a - (ln - 1); hit[L] += 1
            p += ln
        tot_cyc += len(lens); tot_new += p
    tau = tot_new / tot_cyc
    print(f"{name:10s} cycles {tot_cyc:5d} tau {tau:.2f} match {matched/tot_cyc:.2f} " + " ".join(
        f"L{L}: +{gain[L]/tot_cyc:.3f} tok/cyc ({hit[L]/tot_cyc:.2f} cyc) tau~{(tot_new)/(tot_cyc - gain[L]/max(tau,1)):.2f}" for L in gain), flush=True)
