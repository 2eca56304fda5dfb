"""One forward of the default target on the decoder (cpu_decoder.CpuDecoder) over 1, 7 and 12 rows after 200 cached
positions: median ms of 15 (RESULTS, the GGUF target's own codes).  PYTHONPATH=<a build> python step.py"""
import time, torch, sys
from heterospec.models.default import default_target
from heterospec.models.cpu_decoder import CpuDecoder
t = default_target()
model = t[0] if isinstance(t, tuple) else t
dec = CpuDecoder(model)
c = model.config
cap = 512
kv = torch.zeros(1, 2, c.num_hidden_layers, c.num_key_value_heads, cap, c.hidden_size // c.num_attention_heads)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, c.vocab_size, (1, 200), generator=g)
pos = torch.arange(200).view(1, -1)
allowed = torch.tril(torch.ones(200, cap, dtype=torch.bool))
dec.forward(ids, pos, torch.arange(200), allowed, kv, keep=1)
res = {}
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 15):
    for n in (1, 7, 12):
        i = ids[:, :n]; p = (200 + torch.arange(n)).view(1, -1); sl = 200 + torch.arange(n)
        al = torch.zeros(n, cap, dtype=torch.bool); al[:, :200] = True; al[:, 200:200 + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        t0 = time.perf_counter(); dec.forward(i, p, sl, al, kv); res.setdefault(n, []).append(time.perf_counter() - t0)
print(" ".join(f"n={n}: {1e3*sorted(v)[len(v)//2]:.2f} ms (min {1e3*min(v):.2f})" for n, v in res.items()))
