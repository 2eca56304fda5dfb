"""One target forward (TargetAdapter.verify, float32, cpu_gemm 'rows') over n rows after a prompt of P tokens, with
transformers' sdpa (key/value heads repeated per layer) against gqa_sdpa_attention (read in place), the two taking
turns; median ms of 15.  python benchmarks/results/cpu-rows-gemm/attention_gqa.py"""
import time

import torch

from heterospec.models import cpu_gemm
from heterospec.models.default import default_target
from heterospec.models.target import TargetAdapter, attention_window

torch.manual_seed(0)
model, tok = default_target(dtype=torch.float32)
rows = cpu_gemm.PackedLinears([model], path="rows")
rows.prepare()


def median_ms(fn, reps=15):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[reps // 2]


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
                res.append(median_ms(lambda: tgt.verify(toks, depths, mask, W)))
            print(f"{P:6d}  {n:4d}  {W:6d}  {res[0]:8.2f}  {res[1]:8.2f}", flush=True)
