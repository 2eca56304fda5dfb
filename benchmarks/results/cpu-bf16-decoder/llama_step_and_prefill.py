"""Llama-3.2-1B's shape in bfloat16 (random weights made in bf16, scale_rehearsal's build_target): one decode step
of our CPU decoder against the copy-bandwidth floor, and a prompt's prefill, ours against transformers' own bf16
forward (2026-12-07).  The rehearsal's tokens/s and "cycle ms" include the prompt's prefill; this separates them.
Run from the repository root: PYTHONPATH=. python benchmarks/results/cpu-bf16-decoder/llama_step_and_prefill.py
"""
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


m = build_target("llama-3.2-1b", "cpu", torch.bfloat16)
with HeteroSpec(m, None, Policy.autoregressive()) as hs:
    print(hs.cpu_decoder)
    for L in (128, 512):
        ids = torch.randint(0, 1000, (1, L))
        hs.generate(ids, max_new_tokens=2)
        ours = best(lambda: hs.generate(ids, max_new_tokens=1))     # the prefill (and its one token)
        with torch.no_grad():
            hf = best(lambda: m(ids, logits_to_keep=1))
        print(f"prefill of {L} tokens: ours {ours * 1e3:.0f} ms, transformers' bf16 forward {hf * 1e3:.0f} ms")
    ids = torch.randint(0, 1000, (1, 128))
    hs.generate(ids, max_new_tokens=4)
    a = best(lambda: hs.generate(ids, max_new_tokens=1))
    b = best(lambda: hs.generate(ids, max_new_tokens=33))
    print(f"one decode step after a 128-token prompt: {(b - a) / 32 * 1e3:.1f} ms (33 tokens minus 1, / 32)")
