"""The decoder over a prompt of 16 / 48 / 256 / 512 rows, float32 panels (`f32`) or the codes (`coded`): best ms of
3.  python prefill.py f32|coded"""
import time, torch, functools, sys
from heterospec.models import cpu_gemm
if sys.argv[1] == "f32":
    cpu_gemm.pack_rows = functools.partial(cpu_gemm.pack_rows, coded=False)
from heterospec.models.default import default_target
from heterospec.models.cpu_decoder import CpuDecoder
t = default_target(); model = t[0] if isinstance(t, tuple) else t
dec = CpuDecoder(model); c = model.config; cap = 600
kv = torch.zeros(1, 2, c.num_hidden_layers, c.num_key_value_heads, cap, 64)
for n in (16, 48, 256, 512):
    ids = torch.randint(0, c.vocab_size, (1, n)); pos = torch.arange(n).view(1, -1)
    al = torch.tril(torch.ones(n, cap, dtype=torch.bool))
    ts=[]
    for r in range(3):
        t0=time.perf_counter(); dec.forward(ids, pos, torch.arange(n), al, kv, keep=1); ts.append(time.perf_counter()-t0)
    print(sys.argv[1], n, f"{1e3*min(ts):.0f} ms", dec.codecs)
