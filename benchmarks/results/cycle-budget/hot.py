import time, collections
from heterospec import HeteroSpec, Policy, default_pair
from heterospec.models import cpu_decoder as cd
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
target, tok, draft = default_pair()
xs = [encode(tok, p) for p in demo_prompts()[:2]]
rec = collections.defaultdict(list)
orig = cd.CpuDraft.step_head
def wrapped(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k); t1 = time.perf_counter()
    orig(self, *a, **k); t2 = time.perf_counter()   # repeat hot (same slots: overwrites same cache rows)
    rec["cold"].append(t1 - t); rec["hot"].append(t2 - t1); return r
cd.CpuDraft.step_head = wrapped
e = HeteroSpec(target, draft, Policy.static(1, 2, 3), max_length=512)
e.generate(xs[0], max_new_tokens=8); rec.clear()
for x in xs: e.generate(x, max_new_tokens=64)
for k, v in rec.items(): v.sort(); print(k, len(v), f"median {1e3*v[len(v)//2]:.3f} ms")
