# The decoder C calls per cycle, by row count: CODED=1 python runs.py ar hs 1,2,3 (CODED=0: float32 packing)
import time, sys, collections
import os
from heterospec.models import cpu_gemm
cpu_gemm.pack_rows.__defaults__ = (os.environ.get("CODED") == "1",)
from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.models import cpu_decoder as cd
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
target, tok, draft = default_pair()
xs = [encode(tok, p) for p in demo_prompts()[:4]]
rec = collections.defaultdict(list)
orig = cd._Packed._run
def wrapped(self, h, emb, cos, sin, B, n, *a, **k):
    t = time.perf_counter(); r = orig(self, h, emb, cos, sin, B, n, *a, **k)
    rec[(type(self).__name__, B * n)].append(time.perf_counter() - t); return r
cd._Packed._run = wrapped
for arg in sys.argv[1:]:
    pol = {"hs": default_policy(), "ar": Policy.autoregressive()}.get(arg) or Policy.static(*map(int, arg.split(",")))
    e = HeteroSpec(target, None if arg == "ar" else draft, pol, max_length=512)
    e.generate(xs[0], max_new_tokens=8); rec.clear()
    cyc = 0; tot = 0
    for x in xs:
        out, st = e.generate(x, max_new_tokens=96); cyc += st.cycles; tot += st.total_s - st.prefill_s
    print(arg, "cycles", cyc, f"cycle {1e3*tot/cyc:.2f} ms")
    csum = 0
    for k, v in sorted(rec.items(), key=lambda kv: -sum(kv[1])):
        if len(v) < 20: continue
        csum += sum(v)
        print("  ", k, len(v), f"per call {1e3*sum(v)/len(v):.3f} ms  per cycle {1e3*sum(v)/cyc:.3f} ms")
    print(f"   C per cycle {1e3*csum/cyc:.2f} ms, rest {1e3*(tot-csum)/cyc:.2f} ms")
