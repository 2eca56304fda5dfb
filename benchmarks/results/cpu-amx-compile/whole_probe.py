"""TargetAdapter.verify with the whole model compiled (dynamic=False) over our StaticKV, fp32, capacity 512,
against eager with window 192 and the regional compile=True. 1 and 6 rows. median ms."""
import sys, time, torch
from heterospec.models import cpu_gemm
from heterospec.models.default import default_target
from heterospec.models.target import TargetAdapter
torch.manual_seed(0)
mode = sys.argv[1]
model, tok = default_target()
if "freeze" in mode:
    import torch._inductor.config as ic
    ic.freezing = True
tgt = TargetAdapter(model, capture_taps=True, compile=(mode == "regional"))
if mode.startswith("whole"):
    tgt._call = torch.compile(model, dynamic=False)
tgt.allocate(512)
ids = torch.randint(0, model.config.vocab_size, (1, 64))
tgt.prefill(ids)
p = cpu_gemm.PackedLinears([model], choice=cpu_gemm.choose([model])) if mode == "eager" else cpu_gemm.PackedLinears([])
p.prepare()
def median_ms(fn, reps=15):
    t = time.perf_counter(); fn(); first = time.perf_counter() - t
    for _ in range(2): fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return first, 1e3 * sorted(ts)[reps // 2]
for n in (1, 6):
    toks, depths = torch.arange(100, 100 + n), torch.arange(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    with p:
        first, ms = median_ms(lambda: tgt.verify(toks, depths, mask, None if mode != "eager" else 192))
    print(mode, n, "rows first s", round(first, 1), "median ms", round(ms, 2), flush=True)
if mode.startswith("whole"):
    from torch._inductor.utils import run_and_get_code
