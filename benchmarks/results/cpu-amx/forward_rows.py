"""One target forward (TargetAdapter.verify on the static cache after a 64-token prompt, window 192) over n rows,
median ms, with torch's default linear, every linear packed (oneDNN), and the measured choice (cpu_gemm 'auto'):
the default target in float32 (or the dtype given).  python benchmarks/results/cpu-amx/forward_rows.py [bfloat16]"""
import sys
import time

import torch

from heterospec.models import cpu_gemm
from heterospec.models.default import default_target
from heterospec.models.target import TargetAdapter

torch.manual_seed(0)
dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
model, tok = default_target(dtype=dtype)
print(dtype)
tgt = TargetAdapter(model, capture_taps=True)
tgt.allocate(256)
ids = torch.randint(0, model.config.vocab_size, (1, 64))
tgt.prefill(ids)
paths = {"default": cpu_gemm.PackedLinears([]), "packed": cpu_gemm.PackedLinears([model]),
         "auto": cpu_gemm.PackedLinears([model], choice=cpu_gemm.choose([model]))}
for p in paths.values():
    p.prepare()


def median_ms(fn, reps=15):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[reps // 2]


print("rows  " + "  ".join(f"{k:>8}" for k in paths))
for n in (1, 2, 4, 6, 8, 12, 16, 24):
    toks, depths = torch.arange(100, 100 + n), torch.arange(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    row = []
    for name, p in paths.items():
        with p:
            row.append(median_ms(lambda: tgt.verify(toks, depths, mask, 192)))
    print(f"{n:4d}  " + "  ".join(f"{v:8.2f}" for v in row), flush=True)
