"""A shape in bfloat16 (random weights made in bf16, scale_rehearsal's build_target): a prompt's prefill and one decode
step, of our engine's `ar` (our CPU decoder) and of transformers' own bf16 model, apart (the rehearsal's tokens/s
include the prefill).  A step is (33 new tokens - 1 new token) / 32 after a 128-token prompt, ours through
HeteroSpec.generate, transformers' through its generate (its dynamic cache; greedy).  Best of 3 each (2026-12-07).
Run from the repository root: PYTHONPATH=. python benchmarks/results/cpu-gemma/step_and_prefill.py SHAPE
"""
import sys
import time

import torch

from benchmarks.scale_rehearsal import build_target
from heterospec import HeteroSpec, Policy


def best(fn, n=3):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


shape = sys.argv[1]
m = build_target(shape, "cpu", torch.bfloat16)


def hf(ids, new):
    with torch.no_grad():
        m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                   pad_token_id=0, eos_token_id=None)


with HeteroSpec(m, None, Policy.autoregressive()) as hs:
    print(shape, "bfloat16;", hs.cpu_decoder)
    for L in (128, 512):
        ids = torch.randint(0, 1000, (1, L))
        hs.generate(ids, max_new_tokens=2)
        ours = best(lambda: hs.generate(ids, max_new_tokens=1))     # the prefill (and its one token)
        with torch.no_grad():
            theirs = best(lambda: m(ids, logits_to_keep=1))
        print(f"prefill of {L} tokens: ours {ours * 1e3:.0f} ms, transformers' bf16 forward {theirs * 1e3:.0f} ms")
    ids = torch.randint(0, 1000, (1, 128))
    hs.generate(ids, max_new_tokens=4)
    a = best(lambda: hs.generate(ids, max_new_tokens=1))
    b = best(lambda: hs.generate(ids, max_new_tokens=33))
    hf(ids, 4)
    c = best(lambda: hf(ids, 1))
    d = best(lambda: hf(ids, 33))
    print(f"one decode step after a 128-token prompt (33 tokens minus 1, / 32): ours {(b - a) / 32 * 1e3:.1f} ms, "
          f"transformers' bf16 generate {(d - c) / 32 * 1e3:.1f} ms")
