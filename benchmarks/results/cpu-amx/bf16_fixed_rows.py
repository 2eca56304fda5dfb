"""Is a bfloat16 linear row-invariant on this machine when every call has the same number of rows M?  Per layer
shape of the default pair and path, for M = 2, 4, 8, 16, 32: 8 probe rows, each placed at 3 positions of an
M-row call among random other rows (twice), compared bit for bit with the probe row's result at position 0 of
the first call.  python benchmarks/results/cpu-amx/bf16_fixed_rows.py"""
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
        packed = cpu_gemm._packed(lin, 4)
        paths = {"default": lambda a: torch.nn.functional.linear(a, lin.weight, lin.bias),
                 "packed": lambda a: torch.ops.mkldnn._linear_pointwise(a, packed, lin.bias, "none", [], "")}
        line = []
        for name, f in paths.items():
            ok = []
            for M in (2, 4, 8, 16, 32):
                good = True
                for p in range(8):
                    probe = torch.randn(1, lin.in_features, generator=gen).to(torch.bfloat16)
                    ref = None
                    for trial in range(2):
                        for pos in (0, M // 2, M - 1):
                            x = torch.randn(M, lin.in_features, generator=gen).to(torch.bfloat16)
                            x[pos] = probe[0]
                            y = f(x)[pos]
                            ref = y if ref is None else ref
                            good = good and torch.equal(y, ref)
                ok.append(f"M={M}:{'ok' if good else 'no'}")
            line.append(f"{name} " + " ".join(ok))
        print(f"{k:24s} " + "; ".join(line), flush=True)
