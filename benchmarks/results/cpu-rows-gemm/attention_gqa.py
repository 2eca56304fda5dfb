"""One target forward (TargetAdapter.verify, float32, cpu_gemm 'rows') over n rows after a prompt of P tokens, with
transformers' sdpa (key/value heads repeated per layer) against gqa_sdpa_attention (read in place), the two taking
turns; median ms of 15.  PYTHONPATH=. python benchmarks/results/cpu-rows-gemm/attention_gqa.py (from the repository root)"""

import torch

from benchmarks.profile_cycle import median_ms
from heterospec.models import cpu_gemm
from heterospec.models.default import default_target
from heterospec.models.target import TargetAdapter, attention_window

torch.manual_seed(0)
model, tok = default_target(dtype=torch.float32)
rows = cpu_gemm.PackedLinears([model], path="rows")
rows.prepare()


print("prompt  rows  window  repeated  in-place")
with torch.no_grad(), rows:
    for P in (64, 400):
        tgt = TargetAdapter(model, capture_taps=True)
        tgt.allocate(P + 64)
        tgt.prefill(torch.randint(0, model.config.vocab_size, (1, P)))
        for n in (1, 6, 12):
            toks, depths = torch.arange(100, 100 + n), torch.arange(n)
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            W = attention_window("cpu", P + 1, n)
            res = []
            for gqa in (False, True):
                tgt._gqa = gqa
                res.append(median_ms(lambda: tgt.verify(toks, depths, mask, W), reps=15))
            print(f"{P:6d}  {n:4d}  {W:6d}  {res[0]:8.2f}  {res[1]:8.2f}", flush=True)
