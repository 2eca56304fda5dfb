import time
from heterospec import HeteroSpec, Policy, default_pair
from heterospec.engine import tree as T
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
target, tok, draft = default_pair()
xs = [encode(tok, p) for p in demo_prompts()[:3]]
new_sh = T.DraftState._step_head
rec = {"fuse": [], "c_new": [], "c_old": []}
def old_sh(self, hidden, ids, pos, slots, allowed, last=None, taps=None):
    if taps is not None:
        t = time.perf_counter(); hidden = self.draft.fuse(taps); t1 = time.perf_counter()
        r = new_sh(self, hidden, ids, pos, slots, allowed, last); t2 = time.perf_counter()
        rec["fuse"].append(t1 - t); rec["c_old"].append(t2 - t1); return r
    return new_sh(self, hidden, ids, pos, slots, allowed, last)
def new_timed(self, hidden, ids, pos, slots, allowed, last=None, taps=None):
    if taps is not None:
        t = time.perf_counter(); r = new_sh(self, hidden, ids, pos, slots, allowed, last, taps=taps)
        rec["c_new"].append(time.perf_counter() - t); return r
    return new_sh(self, hidden, ids, pos, slots, allowed, last)
e = HeteroSpec(target, draft, Policy.static(1, 2, 3), max_length=512)
e.generate(xs[0], max_new_tokens=8)
for rnd in range(2):
    for fn in (old_sh, new_timed):
        T.DraftState._step_head = fn
        for x in xs: e.generate(x, max_new_tokens=96)
for k, v in rec.items():
    v = sorted(v[5:]); print(k, len(v), f"median {1e3*v[len(v)//2]:.3f} ms mean {1e3*sum(v)/len(v):.3f}")
print(draft.fc, type(draft.fc).forward)
