"""tau of the shipped head with its linear weights rounded to Q8_0 / Q4_1 decodings (tests/_gguf.py's quantizers)
against the float16 head, on the five benchmark files: python benchmarks/results/draft-codes/qtau.py LIMIT TOKENS"""
import copy
import json
import os
import sys
import time

import torch

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]
from tests._gguf import q8_0, q4_1
from measure_tau import measure, default_bench_dir
from heterospec import HeteroSpec, Policy, default_pair, default_policy
target, tok, draft = default_pair()
def quant(d, fn):
    d = copy.deepcopy(d)
    with torch.no_grad():
        for m in d.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.from_numpy(fn(m.weight.numpy())))
    return d
drafts = {"f16": draft, "q8_0": quant(draft, q8_0), "q4_1": quant(draft, q4_1)}
pols = {"cpu-profile": default_policy(), "7/10/60": Policy.static()}
limit, mnt = int(sys.argv[1]), int(sys.argv[2])
out = {}
for pn, pol in pols.items():
    for dn, d in drafts.items():
        hs = HeteroSpec(target, d, pol, max_length=2048)
        t = time.perf_counter()
        r, mean = measure(hs, tok, default_bench_dir(), limit=limit, max_new_tokens=mnt, progress=False)
        el = time.perf_counter() - t
        taus = {f: round(v["tau"], 3) for f, v in r.items()}
        fsa = {f: round(v["first_step_acceptance"], 3) for f, v in r.items()}
        tps = sum(v["new_tokens"] for v in r.values()) / el
        print(pn, dn, hs.cpu_decoder, f"mean tau {mean:.3f} {tps:.1f} tok/s", taus, "fsa", fsa, flush=True)
        out[f"{pn}/{dn}"] = {"taus": taus, "first_step": fsa, "mean_tau": mean, "seconds": el, "tokens_per_s": tps}
json.dump(out, open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"tau-{limit}x{mnt}.json"), "w"), indent=1)
