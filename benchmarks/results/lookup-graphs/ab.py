"""A/B of the prompt-lookup graft on the CPU: the default pair with chains of 4 from 2-3-token matches
(bench's LOOKUP), the benchmark files' first questions, 128 new tokens, greedy; generate time only.  Run with
PYTHONPATH pointing at the checkout to time; prints one JSON line (tokens/s per method, outputs' digest)."""
import hashlib
import json
import sys
import time

import torch

from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.tools.prompts import encode

torch.set_num_threads(2)
target, tok, draft = default_pair()
B = "/work/shared/data/benchmarks/"
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
ps = []
for f in ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum"):
    qs = [json.loads(line) for line in open(B + f + ".jsonl")][:n]
    ps += [encode(tok, q["turns"][0]) for q in qs]
out = {}
for name, d, pol in [("lookup", None, Policy.autoregressive()), ("heterospec-lookup", draft, default_policy())]:
    with HeteroSpec(target, d, pol, max_length=2048, prompt_lookup_num_tokens=4, max_matching_ngram_size=3,
                    min_matching_ngram_size=2) as hs:
        hs.generate(ps[0], max_new_tokens=16)
        toks, secs, h = 0, 0.0, hashlib.sha256()
        for p in ps:
            t0 = time.perf_counter()
            seq, st = hs.generate(p, max_new_tokens=128)
            secs += time.perf_counter() - t0
            toks += st.new_tokens
            h.update(str(seq.tolist()).encode())
    out[name] = {"tokens_per_s": round(toks / secs, 2), "digest": h.hexdigest()[:12]}
print(json.dumps(out))
