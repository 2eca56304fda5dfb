"""Replay of one trace (28 calibration prompts x 128 tokens, recorded on the 2-core AMD EPYC) with the AVX2 profile's
cost model: the shipped profile before the fix, the bins refitted, the kept-node grid widened; and the first drafted
token's acceptance by decile of the root expansion's top-K entropy.
    python benchmarks/results/bins-depth0/predict.py TRACE OLD_PROFILE.json"""
import json, sys

import numpy as np

from heterospec.policy import Policy
from heterospec.policy.profile import CostModel
from heterospec.tune.bins import fit_bins
from heterospec.tune.optimise import optimise_policy
from heterospec.tune.trace import Trace

tr = Trace.load(sys.argv[1])
prof = json.load(open(sys.argv[2]))
cost = CostModel.from_dict(prof["cost_model"])
p = prof["policy"]
old = Policy(p["depth"], p["top_k"], p["total_tokens"], tuple(p["thresholds"]), tuple(p["extra"]), tuple(p["keep"]))
x, y = tr.features(0, 2, target="accepted")
print(f"{len(x)} positions; first drafted token accepted at {y.mean():.3f}")
qs = np.quantile(x, np.linspace(0, 1, 11))
for lo, hi in zip(qs[:-1], qs[1:]):
    m = (x >= lo) & (x <= hi)
    print(f"  root top-K entropy {lo:.3f}-{hi:.3f}: accepted {y[m].mean():.2f}")
th, target, _ = fit_bins(tr, 0, 2)
frozen, _ = optimise_policy(tr, cost, base_depth=0, total_tokens=2, thresholds=th, keep_grid=[2])
new, _ = optimise_policy(tr, cost, base_depth=0, total_tokens=2, thresholds=th)
for name, pol in (("ar", Policy.autoregressive()), ("shipped before (bins of a constant rank)", old),
                  (f"bins on the {target} length, kept nodes {{2}}", frozen),
                  (f"bins on the {target} length, kept nodes 1-4", new)):
    r = tr.replay(pol, cost_model=cost)
    print(f"{name}: predicted {r.tokens_per_s:.1f} tok/s, tau {r.tau:.3f}, thresholds "
          f"{[round(t, 3) for t in pol.thresholds]}, keep {pol.keep}, shares "
          f"{[round(v['share'], 2) for v in r.per_bin().values()]}")
