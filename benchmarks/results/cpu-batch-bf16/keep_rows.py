"""A batch's drop of finished rows, the target cache alone: the old whole-cache index_select against the in-place
gap-filled move of the committed columns (TargetAdapter.keep_rows), 64 rows of the default target's cache shape
in bf16 at 1,288 columns, rows dropped at the front, middle and end, 300 or 700 columns committed.  Min of 3.
python benchmarks/results/cpu-batch-bf16/keep_rows.py"""
import time

import torch

from heterospec.engine.requests import gap_filled

B, L, H, C, D = 64, 30, 3, 1288, 64
kv = torch.randn(B, 2, L, H, C, D, dtype=torch.bfloat16)


def best(fn):
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * min(ts)


for dropped in ([0], [31], [63], [3, 17, 40, 41]):
    keep = [r for r in range(B) if r not in dropped]
    idx = torch.tensor(keep)
    old = best(lambda: kv.index_select(0, idx))
    order = gap_filled(keep, B)
    line = f"dropped {dropped}: index_select (old) {old:6.1f} ms"
    for used in (300, 700):
        def move():
            for i, r in enumerate(order):
                if r != i:
                    kv[i, :, :, :, :used].copy_(kv[r, :, :, :, :used])
        line += f"  in place, {used} columns {best(move):6.1f} ms"
    print(line, flush=True)
