"""Our heterospec cycle on the CPU, split: the engine's own draft / verify / ops times per cycle and the draft's
calls (catch-up, growth; the head's step, output layer and fusion), 2 chat prompts x 96 tokens, shipped profile."""
import time, collections
from heterospec import HeteroSpec
from heterospec.models.default import default_pair
from heterospec.tools.prompts import encode
from heterospec.policy.profile import load_profile
from heterospec.engine import tree
model, tok, draft = default_pair()
pol = load_profile("heterospec/data/smollm2-135m-instruct-eagle3/profile.json")[0]
T = collections.defaultdict(float); N = collections.Counter()
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[name] += time.perf_counter() - t; N[name] += 1; return r
    setattr(cls, name, g)
for n in ("catch_up", "grow"): wrap(tree.DraftState, n)
D = type(draft)
for n in ("step", "head", "fuse"): wrap(D, n)
xs = [encode(tok, p) for p in ("Explain how a rainbow forms, step by step.", "Write a short poem about autumn leaves.")]
with HeteroSpec(model, draft, pol) as hs:
    hs.generate(xs[0], max_new_tokens=16)
    T.clear(); N.clear()
    cyc = 0; tot = 0; dr = 0; ve = 0; ops_ = 0
    for x in xs:
        seq, st = hs.generate(x, max_new_tokens=96)
        cyc += st.cycles; tot += st.total_s - st.prefill_s; dr += st.draft_s; ve += st.verify_s; ops_ += st.ops_s
print("cycles", cyc, "ms/cycle", 1e3*tot/cyc, "draft", 1e3*dr/cyc, "verify", 1e3*ve/cyc, "ops", 1e3*ops_/cyc)
for k in T: print(k, N[k]/cyc, "calls/cycle", round(1e3*T[k]/cyc, 2), "ms/cycle", round(1e3*T[k]/N[k], 2), "ms/call")
