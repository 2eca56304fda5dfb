"""The target's verify step (our C decoder) at 1-10 rows, one request, 200 committed positions, attention window 256:
the fastest of 9 rounds of 3 calls per row count.  Run against two checkouts in alternated processes:
    PYTHONPATH=<checkout> python benchmarks/results/avx2-rows/forward_rows.py LABEL"""
import sys
import time

import torch

from heterospec import HeteroSpec, Policy, default_pair
target, tok, draft = default_pair()
hs = HeteroSpec(target, None, Policy.autoregressive(), max_length=512)
tgt = hs.cycle.target
tgt.allocate(400)
tgt.prefill(torch.randint(0, 49152, (1, 200)))
ns = (1,2,3,4,5,6,7,8,10)
res = {n: [] for n in ns}
for r in range(9):
    for n in ns:
        tokens = torch.randint(0, 49152, (1, n)); depths = torch.arange(n).view(1,n); mask = torch.ones(1,n,n,dtype=torch.bool).tril()
        tgt.prefix.fill_(200); tgt.verify(tokens, depths, mask, 256)
        t=time.perf_counter()
        for _ in range(3):
            tgt.prefix.fill_(200); tgt.verify(tokens, depths, mask, 256)
        res[n].append((time.perf_counter()-t)/3)
one = min(res[1])
print(sys.argv[1], " ".join(f"{n}:{1e3*min(v):.2f}ms({min(v)/one:.2f}x)" for n,v in res.items()))
