"""From how many rows on is a bfloat16 linear row-invariant on this machine?  Per layer shape of the default pair
and path (torch's default linear, oneDNN's packed weight): 40 random rows through one call, then the same rows
through calls of m rows for m = 1 .. 40 (each call's rows padded up to m with the next rows), and the row counts m
whose results differ bit for bit from the 40-row call.  python benchmarks/results/cpu-amx/bf16_min_rows.py"""
import torch

from heterospec.models import cpu_gemm
from heterospec.models.default import default_pair

target, tok, draft = default_pair(dtype=torch.bfloat16)
gen = torch.Generator().manual_seed(0)
seen = set()
with torch.no_grad():
    for lin in cpu_gemm._linears([target, draft]):
        k = cpu_gemm.shape_key(lin)
        if k in seen:
            continue
        seen.add(k)
        x = torch.randn(80, lin.in_features, generator=gen).to(torch.bfloat16)
        packed = cpu_gemm._packed(lin, 4)
        paths = {"default": lambda a: torch.nn.functional.linear(a, lin.weight, lin.bias),
                 "packed": lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, lin.bias, "none", [], "")}
        line = []
        for name, f in paths.items():
            whole = f(x[:40])
            bad = [m for m in range(1, 41) if not torch.equal(f(x[:m])[:m], whole[:m])]
            line.append(f"{name}: differ at m in {bad if len(bad) < 12 else str(bad[:12])[:-1] + ', ...]'}")
        print(f"{k:24s} " + "; ".join(line), flush=True)
