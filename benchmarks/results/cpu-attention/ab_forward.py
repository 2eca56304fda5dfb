"""The target's forward through two builds of heterospec._gemm in one process: the default pair's decoder switched
between them in blocks (each block: one call discarded, then 3 timed), blocks alternated for ROUNDS rounds.  Cases:
a prompt's prefill at 48, 200 and 800 tokens, and a one-token step after 100 and 1,000 cached tokens; transformers'
own forward of the 800-token prompt in the same process for scale.  The previous build is any _gemm .so file:
    python benchmarks/results/cpu-attention/ab_forward.py OLD_GEMM_SO [ROUNDS]"""
import gc
import importlib.util
import sys
import time

import torch

import heterospec._gemm as current
from heterospec import HeteroSpec, Policy, default_pair
from heterospec.models import cpu_decoder

# (loading an extension module under a name puts it in sys.modules: put the current build back)
spec = importlib.util.spec_from_file_location("heterospec._gemm", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
sys.modules["heterospec._gemm"] = current
assert old is not current
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
target, tok, draft = default_pair()
hs = HeteroSpec(target, None, Policy.autoregressive(), max_length=2048)
tgt = hs.cycle.target
tgt.allocate(1700)
decs = [o for o in gc.get_objects() if isinstance(o, cpu_decoder._Packed)]
assert decs and all(d._g is current for d in decs)
builds = {"before": old, "after": current}
ids = torch.randint(0, 49152, (1, 1000), generator=torch.Generator().manual_seed(0))


def once(case):
    kind, n = case
    if kind == "prefill":
        t = time.perf_counter()
        tgt.prefill(ids[:, :n])
        return time.perf_counter() - t
    one = torch.tensor([[17]])
    tgt.prefix.fill_(n)
    t = time.perf_counter()
    tgt.verify(one, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, 1, dtype=torch.bool), n + 16)
    return time.perf_counter() - t


cases = [("prefill", 48), ("prefill", 200), ("prefill", 800), ("step", 100), ("step", 1000)]
res = {(c, b): [] for c in cases for b in builds}
hf = []
for r in range(rounds):
    for c in cases:
        if c[0] == "step":
            tgt.prefill(ids)
        for b in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
            for d in decs:
                d._g = builds[b]
            once(c)
            res[(c, b)] += [once(c) for _ in range(3 if c[0] == "prefill" else 15)]
    with torch.no_grad():
        t = time.perf_counter()
        target(ids[:, :800], use_cache=False, logits_to_keep=1)
        hf.append(time.perf_counter() - t)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {rounds} rounds; ms: min / median")
for c in cases:
    a, b = sorted(res[(c, "before")]), sorted(res[(c, "after")])
    name = f"prefill of {c[1]} tokens" if c[0] == "prefill" else f"one-token step after {c[1]}"
    print(f"{name:28s} before {1e3 * a[0]:8.1f} / {1e3 * a[len(a) // 2]:8.1f}   after {1e3 * b[0]:8.1f} / "
          f"{1e3 * b[len(b) // 2]:8.1f}   after/before (median) {b[len(b) // 2] / a[len(a) // 2]:.2f}")
hf.sort()
print(f"transformers' forward of the 800-token prompt: {1e3 * hf[0]:.1f} / {1e3 * hf[len(hf) // 2]:.1f}")
