"""The target's 211 linear layers alone through the rows kernel (1 and 6 rows), and one transformers forward (1 token, no
cache).  PYTHONPATH=. python benchmarks/results/cpu-decoder/linears_alone.py"""
import time, torch
from heterospec.models.default import default_target
from heterospec.models import cpu_gemm
model, tok = default_target()
lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
print(len(lins), "linears")
for rows in (1, 6):
    runs = []
    for lin in lins:
        runs.append((cpu_gemm._rows_linear(lin.out_features, cpu_gemm._packed(lin, 4, "rows"), None if lin.bias is None else lin.bias.detach()), lin.in_features))
    xs = {k: torch.randn(rows, k) for k in set(r[1] for r in runs)}
    for rep in range(3):
        t = time.perf_counter()
        for _ in range(10):
            for f, k in runs: f(xs[k])
        el = (time.perf_counter() - t) / 10
    print(rows, "rows: all linears ms", el * 1e3)
x = torch.randint(0, 1000, (1, 64))
with torch.no_grad():
    out = model(x, use_cache=True)
    pkv = out.past_key_values
    for rep in range(3):
        t = time.perf_counter()
        for _ in range(10):
            model(torch.tensor([[5]]), past_key_values=None, use_cache=False)
        print("hf 1-token no cache forward ms", (time.perf_counter() - t) / 10 * 1e3)
