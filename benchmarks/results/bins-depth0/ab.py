"""One process, alternated rounds: ar and HeteroSpec with each profile given on the command line, greedy, on the
demo's 3 prompts and the 10 held-out questions (5 gsm8k + 5 alpaca seed, first turns), 128 new tokens; tokens/s per
round (new tokens over the decoding time of the whole set) and whether every method's outputs equal ar's.
    python benchmarks/results/bins-depth0/ab.py ROUNDS OLD.json NEW.json"""
import json, statistics, sys, time

import heterospec
from heterospec import Policy
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode

rounds, profiles = int(sys.argv[1]), sys.argv[2:]
target, tok, draft = heterospec.default_pair()
texts = list(demo_prompts()[:3])
for f in ("gsm8k_heldout", "alpaca_seed_heldout"):
    with open(f"benchmarks/data/heldout/{f}.jsonl") as fh:
        texts += [json.loads(line)["turns"][0] for line in fh][:5]
ids = [encode(tok, t) for t in texts]
methods = [("ar", Policy.autoregressive())] + [(p, Policy.from_profile(p)) for p in profiles]
engines = {name: heterospec.HeteroSpec(target, draft, pol, max_length=1024) for name, pol in methods}
for e in engines.values():
    e.generate(ids[0], max_new_tokens=16)
speed = {name: [] for name, _ in methods}
tau = {}
outs = {}
for r in range(rounds):
    for name, _ in (methods if r % 2 == 0 else methods[::-1]):
        e, n, cyc, t = engines[name], 0, 0, time.perf_counter()
        got = []
        for i in ids:
            s, st = e.generate(i, max_new_tokens=128)
            n += s.shape[1] - i.shape[1]; cyc += st.cycles; got.append(s.tolist())
        speed[name].append(n / (time.perf_counter() - t)); tau[name] = n / cyc; outs[name] = got
    print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in speed.items()), flush=True)
for name, _ in methods:
    print(f"{name}: median {statistics.median(speed[name]):.1f} tok/s over {rounds} rounds, tau {tau[name]:.2f}, "
          f"x ar {statistics.median(speed[name]) / statistics.median(speed['ar']):.3f}, "
          f"outputs {'identical to ar' if outs[name] == outs['ar'] else 'DIFFER from ar'}")
