"""How well a cost model predicts this machine (issue 28.4): predicted against measured tokens/s, per method
and per entropy bin, for two cost models side by side, in one run.

On the default pair (float32, greedy, ``cpu_gemm`` as the engine sets it) and the first ``--prompts`` calibration
prompts, ``--max-new-tokens`` each (no EOS, as a trace replays):

1. the cost models: ``old`` = the one stored in ``--old-profile`` (default: the shipped profile), ``new`` =
   :func:`heterospec.tune.profile_costs` measured now (or read from ``--new-profile``);
2. a trace recorded on the prompts, replayed for ``ar``, EAGLE-3's static tree and the profiles' policies with each
   cost model: predicted tokens/s of the decoding cycles, whole run and per bin;
3. the engine decoding the same prompts with the same policies: measured tokens/s of the decoding cycles
   (``total_s - prefill_s``), and per bin (``GenerationStats.per_bin``: each cycle up to its accepted-tokens sync).

    python benchmarks/cost_model_check.py [--old-profile PATH] [--policy-profile PATH ...] [--out results.json]
"""
import argparse
import json
import time

import torch

from heterospec import HeteroSpec, Policy
from heterospec.engine import GenerationStats
from heterospec.measure import machine_info
from heterospec.models.default import DEFAULT_HEAD, DEFAULT_PROFILE, default_target
from heterospec.models.draft import Eagle3Draft
from heterospec.policy.profile import load_profile
from heterospec.tools.prompts import encode, read_prompts
from heterospec.tune import profile_costs, record

CALIB = "benchmarks/data/smollm2_calib_prompts.jsonl"


def measured(target, draft, policy, ids, max_new_tokens):
    with HeteroSpec(target, draft if policy.drafts else None, policy) as hs:
        hs.generate(ids[0], max_new_tokens=8)            # warm-up
        return GenerationStats.pooled([hs.generate(x, max_new_tokens=max_new_tokens)[1] for x in ids])


def rate(stats):
    return stats.new_tokens / (stats.total_s - stats.prefill_s) if stats.total_s > stats.prefill_s else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-profile", default=DEFAULT_PROFILE, help="the profile whose cost model is 'old'")
    ap.add_argument("--new-profile", default=None, help="take 'new' from this profile instead of measuring it")
    ap.add_argument("--policy-profile", action="append", default=[],
                    help="a profile whose policy to check as well (repeatable; --old-profile's is always checked)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    target, tok = default_target()
    draft = Eagle3Draft.from_pretrained(DEFAULT_HEAD, target=target, dtype=torch.float32)
    shipped, old, _ = load_profile(a.old_profile)
    policies = {"profile": shipped}
    for i, path in enumerate(a.policy_profile):
        policies[f"profile {i + 2}"] = load_profile(path)[0]
    t0 = time.perf_counter()
    new = load_profile(a.new_profile)[1] if a.new_profile else profile_costs(target, draft)
    profile_s = time.perf_counter() - t0
    ids = [encode(tok, p) for p in read_prompts([CALIB], a.prompts)]
    print(f"{machine_info()['summary']}; {len(ids)} prompts x {a.max_new_tokens} new tokens; cost profiling "
          f"{profile_s:.0f} s", flush=True)
    print(f"old: {old}\nnew: {new}", flush=True)
    levels = max(Policy.static().levels, *(p.levels for p in policies.values()))
    trace = record(target, draft, ids, max_new_tokens=a.max_new_tokens, top_k=shipped.top_k, levels=levels)

    methods = {"ar": Policy.autoregressive(), "eagle3 7/10/60": Policy.static(), **policies}
    res = {"machine": machine_info(), "old": old.to_dict(), "new": new.to_dict(), "methods": {}, "bins": {}}
    print("\n| method | measured tokens/s | predicted, old model | predicted, new model | τ measured / replayed |")
    print("|---|---:|---:|---:|---:|")
    for name, pol in methods.items():
        live = measured(target, draft, pol, ids, a.max_new_tokens)
        p_old, p_new = trace.replay(pol, cost_model=old), trace.replay(pol, cost_model=new)
        row = {"measured": rate(live), "old": p_old.tokens_per_s, "new": p_new.tokens_per_s,
               "tau": live.tau, "tau_replay": p_new.tau}
        res["methods"][name] = row
        print(f"| {name} | {row['measured']:.1f} | {row['old']:.1f} | {row['new']:.1f} | "
              f"{row['tau']:.2f} / {row['tau_replay']:.2f} |", flush=True)
        if pol.binned:
            bins_live, bins_old, bins_new = live.per_bin(), p_old.per_bin(), p_new.per_bin()
            res["bins"][name] = {b: {"cycles": lv["cycles"], "cycles_replay": bins_new.get(b, {}).get("cycles"),
                                     "nodes": lv["mean_nodes"], "measured": lv["tokens_per_s"],
                                     "old": bins_old.get(b, {}).get("tokens_per_s"),
                                     "new": bins_new.get(b, {}).get("tokens_per_s")}
                                 for b, lv in sorted(bins_live.items())}
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for name, bins in res["bins"].items():
        print(f"\nper bin of {name} (tokens/s of the bin's cycles):\n")
        print("| bin | cycles live / replay | nodes | measured | predicted, old | predicted, new |")
        print("|---:|---:|---:|---:|---:|---:|")
        for b, r in bins.items():
            print(f"| {b} | {r['cycles']} / {r['cycles_replay']} | {r['nodes']:.0f} | {fmt(r['measured'])} | "
                  f"{fmt(r['old'])} | {fmt(r['new'])} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
