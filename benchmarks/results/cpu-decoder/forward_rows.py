"""One target forward on heterospec's decoder against transformers' (logits diff), a tree row against a one-row step,
and the decoder's forward time over 1/6/12 rows after a 40-token prompt (fp32).  PYTHONPATH=. python benchmarks/results/cpu-decoder/forward_rows.py"""
import time, torch
from heterospec.models.default import default_target
from heterospec.models.cpu_decoder import CpuDecoder
model, tok = default_target()
dec = CpuDecoder(model)
cfg = model.config
S = 40
ids = torch.randint(0, 40000, (1, S))
with torch.no_grad():
    ref = model(ids).logits[0]
kv = torch.zeros(1, 2, cfg.num_hidden_layers, cfg.num_key_value_heads, 128, cfg.hidden_size // cfg.num_attention_heads)
cols = torch.arange(S)
allowed = cols.view(1, -1) <= cols.view(-1, 1)
lg, taps = dec.forward(ids, cols.view(1, S), cols, allowed, kv, taps=[2, 15, 27])
print("max abs diff", (lg[0] - ref).abs().max().item(), "ref scale", ref.abs().max().item(), "argmax equal", (lg[0].argmax(-1) == ref.argmax(-1)).all().item())
# one-row step vs row in a call: row-invariance
x = torch.randint(0, 40000, (1, 1))
a = torch.zeros(1, 128, dtype=torch.bool); a[0, :S + 1] = True
l1, _ = dec.forward(x, torch.tensor([[S]]), torch.tensor([S]), a, kv.clone())
x3 = torch.cat([x, torch.randint(0, 40000, (1, 2))], 1)
a3 = torch.zeros(3, 128, dtype=torch.bool); a3[:, :S] = True; a3[0, S] = True; a3[1, S] = a3[1, S+1] = True; a3[2, S] = a3[2, S+2] = True
l3, _ = dec.forward(x3, torch.tensor([[S, S+1, S+1]]), torch.tensor([S, S+1, S+2]), a3, kv.clone())
print("row-invariant", torch.equal(l1[0, 0], l3[0, 0]))
for rows in (1, 6, 12):
    xr = torch.randint(0, 40000, (1, rows)); ar = torch.zeros(rows, 128, dtype=torch.bool); ar[:, :S + rows] = True
    kk = kv.clone()
    for rep in range(3):
        t = time.perf_counter()
        for _ in range(10):
            dec.forward(xr, torch.arange(S, S + rows).view(1, -1), torch.arange(S, S + rows), ar, kk)
        el = (time.perf_counter() - t) / 10
    print(rows, "rows forward ms", round(el * 1e3, 2))
