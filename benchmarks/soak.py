"""Long and repeated runs on the default pair (issue 31, item 3): resident memory while decoding.

Phase A: one greedy generation of ``--long`` new tokens (EOS ignored) with the HeteroSpec engine (the shipped head
and its calibrated profile), the process's resident set size read every ``--every`` tokens from a streamer.
Phase B: ``--calls`` consecutive ``generate`` calls of ``--new`` tokens on the same engine, cycling over the demo
prompts, the resident set size read after each call.  Then every output is compared, token for token, with a fresh
engine's for the same prompt (phase A's with autoregressive decoding on a fresh engine, which is the target's own
greedy output), and the engine's static caches are checked to have kept the size they were declared with.

Writes ``<out>/soak.json`` (every sample, the caches, the machine) and ``<out>/soak.png`` (both phases' memory).

    python benchmarks/soak.py --out benchmarks/results/soak-cpu
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RssStreamer:
    """Counts tokens; reads the resident set size every ``every`` tokens."""

    def __init__(self, every):
        self.every, self.n, self.samples, self.t0 = every, -1, [], time.perf_counter()

    def put(self, t):
        if self.n < 0:          # the prompt
            self.n = 0
            return
        self.n += int(t.numel())
        if self.n % self.every == 0 or self.n == 1:
            self.samples.append((self.n, round(rss_mb(), 2), round(time.perf_counter() - self.t0, 3)))

    def end(self):
        self.samples.append((self.n, round(rss_mb(), 2), round(time.perf_counter() - self.t0, 3)))


def caches(hs):
    """The static caches' declared size (positions) and their bytes."""
    t = hs.target
    return {"target_capacity": t.capacity, "target_cache_bytes": t.cache_bytes(t.capacity),
            "draft_capacity": getattr(hs.cycle.drafter, "base", 0),
            "recorded_sets": len(hs.cycle._recorded), "batch_cycles": len(hs._batch_cycles)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=int, default=4096, help="new tokens of phase A's generation")
    ap.add_argument("--every", type=int, default=32, help="phase A's sampling period, in tokens")
    ap.add_argument("--calls", type=int, default=200, help="phase B's consecutive generate calls")
    ap.add_argument("--new", type=int, default=32, help="new tokens per phase B call")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch

    from heterospec import Eagle3Draft, HeteroSpec, Policy
    from heterospec.models.default import DEFAULT_HEAD, DEFAULT_PROFILE, default_target
    from heterospec.tools.demo import demo_prompts, heterospec_policy
    from heterospec.tools.prompts import encode

    torch.manual_seed(0)
    target, tok = default_target()
    draft = Eagle3Draft.from_pretrained(DEFAULT_HEAD, target=target, dtype=target.dtype)
    policy, what = heterospec_policy(None, DEFAULT_PROFILE)
    prompts = [encode(tok, p) for p in demo_prompts()]
    out = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0]},
           "settings": {**vars(args), "policy": what, "dtype": "float32", "greedy": True}}
    rss0 = rss_mb()

    # ---- phase A: one long generation ------------------------------------------------------------------------
    hs = HeteroSpec(target, draft, policy)
    s = RssStreamer(args.every)
    t0 = time.perf_counter()
    long_seq, stats = hs.generate(prompts[0], max_new_tokens=args.long, streamer=s)
    long_s = time.perf_counter() - t0
    out["A"] = {"samples": s.samples, "seconds": round(long_s, 1), "tokens": int(stats.new_tokens),
                "tau": round(stats.tau, 3), "caches": caches(hs), "rss_before_mb": round(rss0, 1)}
    print(f"A: {stats.new_tokens} tokens in {long_s:.0f} s (tau {stats.tau:.2f}), rss {s.samples[0][1]:.0f} -> "
          f"{s.samples[-1][1]:.0f} MB", flush=True)

    # ---- phase B: many calls on the same engine ----------------------------------------------------------------
    rows, outs = [], []
    declared = None
    for i in range(args.calls):
        p = prompts[i % len(prompts)]
        seq, st = hs.generate(p, max_new_tokens=args.new)
        outs.append(seq[0, p.shape[1]:].tolist())
        c = caches(hs)
        declared = declared or c
        rows.append((i, round(rss_mb(), 2), c["target_capacity"], c["target_cache_bytes"]))
    out["B"] = {"samples": rows, "caches_first": declared, "caches_last": caches(hs)}
    print(f"B: {args.calls} calls, rss {rows[0][1]:.0f} -> {rows[-1][1]:.0f} MB", flush=True)
    hs.close()

    # ---- the same tokens as a fresh engine ------------------------------------------------------------------------
    with HeteroSpec(target, draft, policy) as fresh:
        want = [fresh.generate(p, max_new_tokens=args.new)[0][0, p.shape[1]:].tolist() for p in prompts]
    bad_calls = [i for i, o in enumerate(outs) if o != want[i % len(prompts)]]
    with HeteroSpec(target, None, Policy.autoregressive()) as ar:
        ar_seq, _ = ar.generate(prompts[0], max_new_tokens=args.long)
    out["identical"] = {"B_calls_differing_from_a_fresh_engine": bad_calls,
                        "A_equals_autoregressive": ar_seq[0].tolist() == long_seq[0].tolist()}
    print(f"identical: {out['identical']}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(out, os.path.join(args.out, "soak.png"))
    return 0 if not bad_calls and out["identical"]["A_equals_autoregressive"] else 1


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    xs, ys = zip(*[(n, r) for n, r, _ in out["A"]["samples"]])
    a.plot(xs, ys, lw=1.2)
    a.set_xlabel("tokens generated (one call)")
    a.set_ylabel("resident set size (MB)")
    a.set_title(f"A: one {out['settings']['long']}-token generation")
    xs, ys = zip(*[(i, r) for i, r, _, _ in out["B"]["samples"]])
    b.plot(xs, ys, lw=1.2, color="tab:orange")
    b.set_xlabel("generate call")
    b.set_title(f"B: {out['settings']['calls']} calls of {out['settings']['new']} tokens")
    for ax in (a, b):
        lo = min(min(y for _, y, *_ in out["A"]["samples"]), min(r for _, r, *_ in out["B"]["samples"]))
        hi = max(max(y for _, y, *_ in out["A"]["samples"]), max(r for _, r, *_ in out["B"]["samples"]))
        ax.set_ylim(lo - 20, hi + 20)
        ax.grid(alpha=0.3)
    m = out["machine"]
    fig.suptitle(f"heterospec soak, SmolLM2-135M-Instruct + shipped head, fp32 greedy, {m['cpus']} CPUs, "
                 f"torch {m['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
