"""One tree row's attention in bfloat16 as exact_keys_attention calls it (q [1, kv_heads 3, rep 3, D 64] over c
keys [1, 3, c, 64], SmolLM2-135M's shapes): torch's flash SDPA (what runs now), SDPA's math backend, and the
math written out (bf16 matmuls, fp32 softmax); and 5 such rows in one flash call (each row a batch entry).
Median µs over 200 calls; and whether each way gives a row the same bits as a view of the cache (strided keys)
and as a gathered copy.  python benchmarks/results/cpu-amx/attention_row.py"""
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from benchmarks.profile_cycle import median_ms  # noqa: E402

sdpa = torch.nn.functional.scaled_dot_product_attention
gen = torch.Generator().manual_seed(0)


def med_us(fn):
    return 1e3 * median_ms(fn, reps=200, warm=10)


def flash(q, k, v):
    return sdpa(q, k, v, scale=0.125)


def math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v, scale=0.125)


def written(q, k, v):
    s = torch.matmul(q, k.transpose(-1, -2)) * 0.125
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


for c in (100, 300, 600):
    cache = torch.randn(1, 3, 1024, 64, generator=gen).to(torch.bfloat16)
    vals = torch.randn(1, 3, 1024, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(5, 3, 3, 64, generator=gen).to(torch.bfloat16)
    kv, vv = cache[:, :, :c], vals[:, :, :c]                     # a view: the one-row step's keys
    kc, vc = kv.contiguous(), vv.contiguous()                     # a gathered copy: a tree row's keys
    line = [f"c={c}"]
    for name, f in (("flash", flash), ("math", math), ("written", written)):
        us = med_us(lambda: f(q[:1], kc, vc))
        same = torch.equal(f(q[:1], kv, vv), f(q[:1], kc, vc))
        line.append(f"{name} {us:7.1f} us (view = copy: {same})")
    g5 = med_us(lambda: flash(q, kc.expand(5, -1, -1, -1).contiguous(), vc.expand(5, -1, -1, -1).contiguous()))
    grouped = flash(q, kc.expand(5, -1, -1, -1).contiguous(), vc.expand(5, -1, -1, -1).contiguous())
    alone = all(torch.equal(grouped[i], flash(q[i:i + 1], kc, vc)[0]) for i in range(5))
    line.append(f"flash, 5 rows as batch entries {g5:7.1f} us (each row = alone: {alone})")
    print("; ".join(line), flush=True)
