"""What min-p costs a sampled cycle on the CPU: HeteroSpec (shipped CPU profile) and our `ar` on the default pair
(float32), the six demo prompts x 96 tokens, temperature 0.8, top-p 0.9 or 1.0, without and with min-p 0.05, 3 rounds
alternated in one process, seed 0.  python benchmarks/results/min-p-cpu/cost.py [ROUNDS]
cost.log: min-p as the four warpers applied to the logits in torch before the acceptance (with top-p < 1 a sort over
the vocabulary per tree node); cost-in-verify.log: min-p inside ops.verify_sample (the same script, later code)."""
import statistics
import sys
import time

from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
target, tok, draft = default_pair()
xs = [encode(tok, p) for p in demo_prompts()]
engines = {"ar": HeteroSpec(target, None, Policy.autoregressive()),
           "heterospec": HeteroSpec(target, draft, default_policy())}
for hs in engines.values():
    hs.generate(xs[0], max_new_tokens=8, temperature=0.8, top_p=0.9, min_p=0.05, seed=0)
res = {}
for r in range(ROUNDS):
    for top_p, min_p in ((0.9, None), (0.9, 0.05), (1.0, None), (1.0, 0.05)):
        for name, hs in engines.items():
            toks = secs = cyc = 0
            for x in xs:
                t0 = time.perf_counter()
                _, st = hs.generate(x, max_new_tokens=96, eos_token_id=[], temperature=0.8, top_p=top_p,
                                    min_p=min_p, seed=0)
                secs += time.perf_counter() - t0
                toks += st.new_tokens
                cyc += st.cycles
            res.setdefault((name, top_p, min_p), []).append(toks / secs)
            print(f"round {r} {name:10s} top_p {top_p} min_p {min_p!s:5s} {toks / secs:7.1f} tok/s  "
                  f"tau {toks / cyc:.2f}", flush=True)
print("median tokens/s (min-max) over rounds:")
for (name, top_p, min_p), v in sorted(res.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
    print(f"  {name:10s} top_p {top_p} min_p {min_p!s:5s} {statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})")
