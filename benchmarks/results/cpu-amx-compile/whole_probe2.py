"""As whole_probe.py, with the cache as separate per-layer tensors (a StaticKV subclass for the probe)."""
import sys, time, torch
from heterospec.models import cpu_gemm, target as T
from heterospec.models.default import default_target
from heterospec.models.target import TargetAdapter
from heterospec.models.draft.module import write_at
torch.manual_seed(0)
mode = sys.argv[1]
model, tok = default_target()
if "freeze" in mode:
    import torch._inductor.config as ic
    ic.freezing = True

class LayerKV(T.StaticKV):
    def __init__(self, kv):
        super().__init__(kv)
        self.ks = [kv[:, 0, i].clone() for i in range(kv.shape[2])]
        self.vs = [kv[:, 1, i].clone() for i in range(kv.shape[2])]
    def update(self, key_states, value_states, layer_idx, *a, **k):
        kk, vv = self.ks[layer_idx], self.vs[layer_idx]
        write_at(kk, self.slots, key_states)
        write_at(vv, self.slots, value_states)
        return kk, vv

tgt = TargetAdapter(model, capture_taps=True)
tgt._call = torch.compile(model, dynamic=False)
tgt.allocate(512)
ids = torch.randint(0, model.config.vocab_size, (1, 64))
tgt.prefill(ids)
tgt.cache = LayerKV(tgt.kv)
def median_ms(fn, reps=15):
    t = time.perf_counter(); fn(); first = time.perf_counter() - t
    for _ in range(2): fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return first, 1e3 * sorted(ts)[reps // 2]
for n in (1, 6, 12):
    toks, depths = torch.arange(100, 100 + n), torch.arange(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    first, ms = median_ms(lambda: tgt.verify(toks, depths, mask, None))
    print(mode, n, "rows first s", round(first, 1), "median ms", round(ms, 2), flush=True)
