import time, sys
from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.engine import tree as T
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
target, tok, draft = default_pair()
xs = [encode(tok, p) for p in demo_prompts()[:6]]
new_sh = T.DraftState._step_head
def old_sh(self, hidden, ids, pos, slots, allowed, last=None, taps=None):
    if taps is not None: hidden, taps = self.draft.fuse(taps), None
    return new_sh(self, hidden, ids, pos, slots, allowed, last)
pol = default_policy() if sys.argv[1] == "hs" else Policy.static(*map(int, sys.argv[1].split(",")))
e = HeteroSpec(target, draft, pol, max_length=512)
e.generate(xs[0], max_new_tokens=8)
res = {}
for rnd in range(4):
    for name, fn in (("old", old_sh), ("new", new_sh)) if rnd % 2 == 0 else (("new", new_sh), ("old", old_sh)):
        T.DraftState._step_head = fn
        t = time.perf_counter(); new = 0; outs = []
        for x in xs:
            out, st = e.generate(x, max_new_tokens=96); new += st.new_tokens; outs.append(out.tolist())
        el = time.perf_counter() - t
        res.setdefault(name, []).append((new / el, outs))
        print(rnd, name, f"{new/el:.1f} tok/s", flush=True)
print("same outputs:", all(o == res["old"][0][1] for r in res.values() for _, o in r))
import statistics
print("median ratio new/old:", statistics.median(n[0] / o[0] for n, o in zip(res["new"], res["old"])))
