"""Average acceptance length tau of a head for the default target, per benchmark file.

    python benchmarks/measure_tau.py [--draft DIR] [--limit 10] [--max-new-tokens 256] [--out tau.json]

Greedy (temperature 0), EAGLE-3's static tree (depth 7, top_k 10, 60 nodes) unless --policy is given,
stopping at the tokenizer's EOS; the first turn of the first --limit questions of each file in
../shared/data/benchmarks, with the chat template.  tau = tokens committed per verification call (the
bonus token counts), pooled over the file's prompts.
"""
import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # a checkout without pip install
BENCH = os.path.join(HERE, "..", "..", "shared", "data", "benchmarks")
FILES = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")


def main():
    import torch

    from heterospec import HeteroSpec, Policy
    from heterospec.models.default import DEFAULT_HEAD
    from heterospec.tools.prompts import encode as _encode
    from heterospec.models.draft import Eagle3Draft
    from heterospec.models.default import default_target

    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=DEFAULT_HEAD)
    ap.add_argument("--bench-dir", default=BENCH)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--policy", default=None, help="a profile JSON instead of the static tree")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tok = default_target()
    draft = Eagle3Draft.from_pretrained(a.draft, target=model, dtype=torch.float32)
    if a.policy:
        from heterospec.policy.profile import load_profile

        policy = load_profile(a.policy)[0]
    else:
        policy = Policy.static(7, 10, 60)
    rows = {}
    with HeteroSpec(model, draft, policy) as hs:
        for name in FILES:
            qs = [json.loads(line) for line in open(os.path.join(a.bench_dir, name + ".jsonl")) if line.strip()]
            committed = cycles = new = 0
            secs = 0.0
            for i, q in enumerate(qs[: a.limit]):
                ids = _encode(tok, q["turns"][0])
                t0 = time.perf_counter()
                _, st = hs.generate(ids, max_new_tokens=a.max_new_tokens, eos_token_id=tok.eos_token_id)
                secs += time.perf_counter() - t0
                committed += st.committed
                cycles += st.cycles
                new += st.new_tokens
                print(f"\r{name} {i + 1}/{min(a.limit, len(qs))}: tau so far {committed / max(cycles, 1):.2f}",
                      end="", file=sys.stderr, flush=True)
            rows[name] = {"tau": committed / max(cycles, 1), "new_tokens": new, "cycles": cycles,
                          "tokens_per_s": new / secs if secs else 0.0, "prompts": min(a.limit, len(qs))}
            print(file=sys.stderr)
    mean = sum(r["tau"] for r in rows.values()) / len(rows)
    print("| benchmark | tau | new tokens | verification calls | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['tau']:.2f} | {r['new_tokens']} | {r['cycles']} | {r['tokens_per_s']:.1f} |")
    print(f"| mean | {mean:.2f} | | | |")
    if a.out:
        json.dump({"rows": rows, "mean_tau": mean, "draft": a.draft, "policy": policy.name,
                   "settings": vars(a), "machine": platform.platform(), "processor": platform.processor(),
                   "torch": torch.__version__, "threads": torch.get_num_threads()}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
