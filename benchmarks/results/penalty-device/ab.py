"""A repetition penalty alone: on the device (this commit) against the host path (HuggingFace's processor called
per tree node, forced here by turning processors.on_device off), alternated in one process on the default pair
(float32, CPU decoder), the six demo prompts x 96 tokens, greedy, penalty 1.3; outputs checked equal across the two
paths and to HF's generate with repetition_penalty=1.3 (first two prompts).
python benchmarks/results/penalty-device/ab.py [ROUNDS]"""
import statistics
import sys
import time

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.engine import processors
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
NEW = 96
target, tok, draft = default_pair()
xs = [encode(tok, p) for p in demo_prompts()]
real_on_device = processors.on_device
engines = {"ar": HeteroSpec(target, None, Policy.autoregressive()),
           "heterospec": HeteroSpec(target, draft, default_policy())}
pen = [RepetitionPenaltyLogitsProcessor(1.3)]
for x in xs[:2]:
    ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                          repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
    for hs in engines.values():
        assert hs.generate(x, max_new_tokens=NEW, eos_token_id=[], logits_processor=pen)[0].tolist() == ref.tolist()
print("outputs equal HF's generate(repetition_penalty=1.3) on 2 prompts")
res = {}
outs = {}
for r in range(ROUNDS):
    for path in ("host", "device"):
        processors.on_device = real_on_device if path == "device" else (lambda rows: None)
        for name, hs in engines.items():
            toks = secs = cyc = 0
            for i, x in enumerate(xs):
                t0 = time.perf_counter()
                out, st = hs.generate(x, max_new_tokens=NEW, eos_token_id=[], logits_processor=pen)
                secs += time.perf_counter() - t0
                toks += st.new_tokens
                cyc += st.cycles
                prev = outs.setdefault((name, i), out.tolist())
                assert prev == out.tolist(), (name, i, path)
            res.setdefault((name, path), []).append(toks / secs)
            print(f"round {r} {name:10s} {path:6s} {toks / secs:7.1f} tok/s  tau {toks / cyc:.2f}", flush=True)
print("median tokens/s (min-max) over rounds:")
for (name, path), v in sorted(res.items()):
    print(f"  {name:10s} {path:6s} {statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})")
