"""Issue 43.3 on the CPU, on a small slice first: the head options at equal data -- the draft vocabulary (8K / 16K /
32K most frequent answer tokens) and EAGLE-3.1's two normalisations (``fc_norm``: a norm on each fused tap;
``norm_hidden_out``: the post-norm state fed back) -- each head trained from scratch on the same answered prompts
(the first ``--prompts`` of the committed answers of the default target, their features by one teacher-forced
forward), the same steps, seed and validation split, then tau measured with EAGLE-3's static tree (7/10/60) on
the first ``--limit`` questions of the benchmark files (greedy, ``--max-new-tokens``).

    python benchmarks/head_options.py --prompts 512 --steps 200 --limit 4 --max-new-tokens 64 --out DIR

A slice this small says which options are worth the GPU's data, not what they give at 50x the data.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"8K": (8192, {}), "16K": (16384, {}), "32K": (32768, {}),
            "8K+fc_norm": (8192, {"fc_norm": True}), "8K+norm_hidden_out": (8192, {"norm_hidden_out": True}),
            "8K+both": (8192, {"fc_norm": True, "norm_hidden_out": True})}
FILES = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")


def tau_per_file(target, tok, head, files, limit, max_new_tokens):
    import torch

    from heterospec import HeteroSpec, Policy
    from heterospec.tools.prompts import encode

    out = {}
    with torch.no_grad(), HeteroSpec(target, head, Policy.static(7, 10, 60)) as hs:
        for name in files:
            with open(os.path.join(HERE, "data", "questions", name + ".jsonl")) as f:
                qs = [json.loads(line) for line in f if line.strip()][:limit]
            committed = cycles = 0
            for q in qs:
                _, st = hs.generate(encode(tok, q["turns"][0]), max_new_tokens=max_new_tokens,
                                    eos_token_id=tok.eos_token_id)
                committed, cycles = committed + st.committed, cycles + st.cycles
            out[name] = committed / max(cycles, 1)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=512, help="the first N prompts of the committed answers")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    ap.add_argument("--files", default=",".join(FILES))
    ap.add_argument("--limit", type=int, default=4, help="questions per benchmark file")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch

    from heterospec.measure import machine_info
    from heterospec.models.answers import AnswerStore
    from heterospec.models.default import _cache_dir, default_target
    from heterospec.models.draft import Eagle3Draft
    from heterospec.models.train import store_features, train_draft

    torch.manual_seed(0)
    target, tok = default_target()
    answers = os.path.join(HERE, "answers", "smollm2-135m-instruct")
    store = AnswerStore(answers, AnswerStore.read_manifest(answers))
    ident = store.manifest["target"]
    cache = os.path.join(_cache_dir(), "features", f"{ident['name']}-{ident['config_sha256'][:12]}-float32")
    t0 = time.perf_counter()
    records, _, total = store_features(target, store, cache, ident, topk=32, limit=args.prompts)
    print(f"{len(records)} sequences, {total} answer tokens ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    rows = {}
    os.makedirs(args.out, exist_ok=True)
    for name in args.variants.split(","):
        vd, opts = VARIANTS[name]
        d = os.path.join(args.out, name)
        t = time.perf_counter()
        train_draft(target, None, d, records=records, draft_vocab_size=vd, steps=args.steps, lr=args.lr,
                    ttt_steps=args.ttt_steps, batch_size=args.batch_size, seed=0, val_fraction=0.05,
                    eval_every=max(1, args.steps // 4), autocast="bfloat16", head_options=opts)
        train_s = time.perf_counter() - t
        log = json.load(open(os.path.join(d, "training_log.json")))
        head = Eagle3Draft.from_pretrained(d, target=target, dtype=torch.float32)
        taus = tau_per_file(target, tok, head, args.files.split(","), args.limit, args.max_new_tokens)
        rows[name] = {"draft_vocab": vd, "options": opts, "train_s": round(train_s, 1),
                      "best_val_loss": log["best_val_loss"], "tau": taus,
                      "mean_tau": sum(taus.values()) / len(taus)}
        print(f"{name}: val loss {log['best_val_loss']:.4f}, mean tau {rows[name]['mean_tau']:.3f} "
              f"({', '.join(f'{k} {v:.2f}' for k, v in taus.items())}), trained in {train_s:.0f} s",
              file=sys.stderr, flush=True)
    result = {"machine": machine_info("cpu"), "settings": vars(args), "sequences": len(records),
              "answer_tokens": total, "rows": rows}
    with open(os.path.join(args.out, "head_options.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"{result['machine'].get('summary', '')}; the first {args.prompts} committed prompts "
             f"({len(records)} sequences, {total} answer tokens), {args.steps} steps of {args.batch_size}, TTT "
             f"{args.ttt_steps}, lr {args.lr}, bf16 autocast, from scratch, seed 0; tau: static 7/10/60, greedy, "
             f"{args.limit} questions per file, {args.max_new_tokens} new tokens", "",
             "| head | best val loss | mean tau | " + " | ".join(args.files.split(",")) + " | train s |",
             "|---|---:|---:|" + "---:|" * len(args.files.split(",")) + "---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['best_val_loss']:.4f} | {r['mean_tau']:.3f} | "
                     + " | ".join(f"{r['tau'][f]:.2f}" for f in args.files.split(",")) + f" | {r['train_s']:.0f} |")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "head_options.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
