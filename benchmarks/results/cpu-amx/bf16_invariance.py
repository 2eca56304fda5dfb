"""Which bfloat16 matrix paths are row-invariant on this machine (a row's result the same in a call over 1, 2, 3,
7, 17 or 40 rows, a one-row call padded to two; cpu_gemm.check_invariant), per layer shape of the default pair:
torch's default linear and oneDNN's packed weight.  Ran before 637fbf2, when _invariant_forward padded a one-row call
to two and ran larger calls as they were; since 637fbf2 it runs every call in blocks of 8 rows.
python benchmarks/results/cpu-amx/bf16_invariance.py"""
import torch

from heterospec.models import cpu_gemm
from heterospec.models.default import default_pair

target, tok, draft = default_pair(dtype=torch.bfloat16)
seen = {}
for lin in cpu_gemm._linears([target, draft]):
    k = cpu_gemm.shape_key(lin)
    if k in seen:
        continue
    seen[k] = [cpu_gemm.check_invariant(cpu_gemm._invariant_forward(lin, p), lin)
               for p in (None, cpu_gemm._packed(lin, 4))]
    print(f"{k:24s} default {'invariant' if seen[k][0] else 'NOT invariant':14s} packed "
          f"{'invariant' if seen[k][1] else 'NOT invariant'}", flush=True)
