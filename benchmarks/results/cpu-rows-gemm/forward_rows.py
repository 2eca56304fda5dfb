"""One target forward (TargetAdapter.verify on the static cache after a 64-token prompt, window 192) over n rows,
median ms of 15, on each CPU matrix path forced (torch's default, oneDNN packed, the few-rows kernel 'rows') and
the measured choice (cpu_gemm 'auto'), the default target in float32; the paths take turns row count by row count.
PYTHONPATH=. python benchmarks/results/cpu-rows-gemm/forward_rows.py (from the repository root)"""

import torch

from benchmarks.profile_cycle import median_ms
from heterospec.models import cpu_gemm
from heterospec.models.default import default_target
from heterospec.models.target import TargetAdapter

torch.manual_seed(0)
model, tok = default_target(dtype=torch.float32)
tgt = TargetAdapter(model, capture_taps=True)
tgt.allocate(256)
tgt.prefill(torch.randint(0, model.config.vocab_size, (1, 64)))
paths = {"default": cpu_gemm.PackedLinears([]), "onednn": cpu_gemm.PackedLinears([model], path="onednn"),
         "rows": cpu_gemm.PackedLinears([model], path="rows"),
         "auto": cpu_gemm.PackedLinears([model], choice=cpu_gemm.choose([model]))}
for p in paths.values():
    p.prepare()
print("auto:", paths["auto"].describe())


print("rows  " + "  ".join(f"{k:>8}" for k in paths))
with torch.no_grad():
    for n in (1, 2, 4, 6, 8, 12, 16, 24, 48):
        toks, depths = torch.arange(100, 100 + n), torch.arange(n)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        row = []
        for name, p in paths.items():
            with p:
                row.append(median_ms(lambda: tgt.verify(toks, depths, mask, 192), reps=15))
        print(f"{n:4d}  " + "  ".join(f"{v:8.2f}" for v in row), flush=True)
