"""One decode forward of the default target in fp32 on a static cache, 1 and 6 rows: eager, torch.compile
(inductor defaults), torch.compile with inductor freezing. Median ms of 30 calls."""
import sys, time, statistics, torch
from transformers import StaticCache
from heterospec.models.default import default_target
mode = sys.argv[1]
model, tok = default_target()
model.eval()
if mode == "freeze":
    import torch._inductor.config as ic
    ic.freezing = True
cache = StaticCache(config=model.config, max_cache_len=512)
prompt = torch.randint(0, 49152, (1, 64))
with torch.no_grad():
    model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(64), use_cache=True)
fwd = model.forward if mode == "eager" else torch.compile(model.forward, dynamic=False)
res = {}
with torch.no_grad():
    for rows in (1, 6):
        ids = torch.randint(0, 49152, (1, rows))
        pos = torch.arange(64, 64 + rows)
        t0 = time.perf_counter()
        fwd(input_ids=ids, past_key_values=cache, cache_position=pos, position_ids=pos[None], use_cache=True)
        first = time.perf_counter() - t0
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            out = fwd(input_ids=ids, past_key_values=cache, cache_position=pos, position_ids=pos[None], use_cache=True)
            ts.append(time.perf_counter() - t0)
        res[rows] = (first, statistics.median(ts) * 1e3)
        print(mode, rows, "rows: first call s", round(first, 1), "median ms", round(res[rows][1], 2), flush=True)
