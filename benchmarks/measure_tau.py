"""Average acceptance length tau of a head for the default target, per benchmark file.

    python benchmarks/measure_tau.py [--draft DIR] [--limit 10] [--max-new-tokens 256] [--device cpu]
                                     [--batch 1] [--out tau.json]

Greedy (temperature 0), EAGLE-3's static tree (depth 7, top_k 10, 60 nodes) unless --policy is given,
stopping at the tokenizer's EOS; the first turn of the first --limit questions of each of the five benchmark
files (the checkout's benchmarks/data/questions, else ../shared/data/benchmarks), with the chat template.
tau = tokens committed per verification call (the bonus token counts), pooled over the file's prompts;
first-step acceptance = the share of verification calls that accept at least one draft token.  ``--batch N``
decodes N questions of a file at once (the batched engine: each row's output is its prompt's alone, so tau
is the same up to the draft's low bits; a GPU's way to measure in seconds).
"""
import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # a checkout without pip install
FILES = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")


def default_bench_dir():
    """The five benchmark files: the checkout's copy (it travels with the working tree), else ../shared's."""
    for d in (os.path.join(HERE, "data", "questions"), os.path.join(HERE, "..", "..", "shared", "data", "benchmarks")):
        if all(os.path.isfile(os.path.join(d, f + ".jsonl")) for f in FILES):
            return os.path.normpath(d)
    return os.path.join(HERE, "data", "questions")


def measure(hs, tokenizer, bench_dir, *, limit=10, max_new_tokens=256, batch=1, progress=True, chat=True):
    """{file: {tau, first_step_acceptance, new_tokens, cycles, tokens_per_s, prompts}} for the five files with
    the engine ``hs`` (a :class:`~heterospec.HeteroSpec`), and the mean tau."""
    from heterospec.tools.prompts import encode

    rows = {}
    for name in FILES:
        with open(os.path.join(bench_dir, name + ".jsonl")) as f:
            qs = [json.loads(line) for line in f if line.strip()][:limit]
        committed = cycles = new = none = 0
        secs = 0.0
        for b0 in range(0, len(qs), batch):
            ids = [encode(tokenizer, q["turns"][0], chat).view(-1) for q in qs[b0: b0 + batch]]
            t0 = time.perf_counter()
            _, st = hs.generate(ids if len(ids) > 1 else ids[0].view(1, -1), max_new_tokens=max_new_tokens,
                                eos_token_id=tokenizer.eos_token_id)
            secs += time.perf_counter() - t0
            committed += st.committed
            cycles += st.cycles
            new += st.new_tokens
            none += st.accepted_hist.get(0, 0)
            if progress:
                print(f"\r{name} {min(b0 + batch, len(qs))}/{len(qs)}: tau so far {committed / max(cycles, 1):.2f}",
                      end="", file=sys.stderr, flush=True)
        rows[name] = {"tau": committed / max(cycles, 1), "first_step_acceptance": 1 - none / max(cycles, 1),
                      "new_tokens": new, "cycles": cycles, "tokens_per_s": new / secs if secs else 0.0,
                      "prompts": len(qs)}
        if progress:
            print(file=sys.stderr)
    return rows, sum(r["tau"] for r in rows.values()) / len(rows)


def table(rows, mean):
    lines = ["| benchmark | tau | first-step acceptance | new tokens | verification calls | tokens/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tau']:.2f} | {r.get('first_step_acceptance', float('nan')):.2f} | "
                     f"{r['new_tokens']} | {r['cycles']} | {r['tokens_per_s']:.1f} |")
    lines.append(f"| mean | {mean:.2f} | "
                 f"{sum(r.get('first_step_acceptance', 0) for r in rows.values()) / len(rows):.2f} | | | |")
    return "\n".join(lines)


def main(argv=None):
    import torch

    from heterospec import HeteroSpec, Policy
    from heterospec.models.default import DEFAULT_HEAD, default_target
    from heterospec.models.draft import Eagle3Draft

    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=DEFAULT_HEAD)
    ap.add_argument("--bench-dir", default=default_bench_dir())
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--policy", default=None, help="a profile JSON instead of the static tree")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=1, help="questions of a file decoded at once")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    model, tok = default_target(device=a.device, dtype=dtype)
    draft = Eagle3Draft.from_pretrained(a.draft, target=model, dtype=dtype, device=a.device)
    if a.policy:
        from heterospec.policy.profile import load_profile

        policy = load_profile(a.policy)[0]
    else:
        policy = Policy.static(7, 10, 60)
    with HeteroSpec(model, draft, policy) as hs:
        rows, mean = measure(hs, tok, a.bench_dir, limit=a.limit, max_new_tokens=a.max_new_tokens, batch=a.batch)
    print(table(rows, mean))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "mean_tau": mean, "draft": a.draft, "policy": policy.name,
                       "settings": vars(a), "machine": platform.platform(), "processor": platform.processor(),
                       "torch": torch.__version__, "threads": torch.get_num_threads()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
