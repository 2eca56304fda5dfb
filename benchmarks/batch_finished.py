"""Finished rows of a batch: dropped from the caches, or masked in place -- which is faster (issue 29)?

The default pair decodes the same batch of chat prompts (first turns of the benchmark questions, whose
answers end at different lengths) with ``finished_rows="drop"`` and ``"mask"``, alternately, ``--reps`` times
each; the outputs must be identical.  Prints and writes the median tokens/s of each.

    python -m benchmarks.batch_finished [--batch-size 8] [--max-new-tokens 96] [--reps 3] [--out DIR]
"""
import argparse
import json
import os
import statistics
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default="ar,eagle3,heterospec")
    ap.add_argument("--questions", nargs="+", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from heterospec import HeteroSpec
    from heterospec.measure import machine_info
    from heterospec.models.default import DEFAULT_PROFILE, load_pair
    from heterospec.policy import Policy
    from heterospec.policy.profile import load_profile
    from heterospec.tools.bench.batched import batch_prompts
    from heterospec.tools.bench.questions import default_question_files, load_questions, question_paths

    paths = question_paths(args.questions) if args.questions else default_question_files()
    qs = load_questions(paths, -(-args.batch_size // len(paths)))
    tok, target, draft = load_pair(argparse.Namespace(target="default", dtype="float32", draft="default",
                                                      gguf_file=None))
    prompts = [p[0] for p in batch_prompts(tok, qs, True, args.batch_size)[:args.batch_size]]
    policies = {"ar": (None, None), "eagle3": (draft, Policy.static(7, 10, 60)),
                "heterospec": (draft, load_profile(DEFAULT_PROFILE)[0])}
    out = {"machine": machine_info("cpu")["summary"], "batch_size": args.batch_size,
           "max_new_tokens": args.max_new_tokens, "reps": args.reps, "methods": {}}
    for name in args.methods.split(","):
        d, pol = policies[name]
        with HeteroSpec(target, d, pol) as hs, torch.no_grad():
            hs.generate(prompts, max_new_tokens=8, eos_token_id=tok.eos_token_id)       # warm-up
            runs = {"drop": [], "mask": []}
            seqs = {}
            for _ in range(args.reps):
                for mode in ("drop", "mask"):
                    t0 = time.perf_counter()
                    outs, st = hs.generate(prompts, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
                                           finished_rows=mode)
                    runs[mode].append(st.new_tokens / (time.perf_counter() - t0))
                    seqs[mode] = [o.tolist() for o in outs]
            if seqs["drop"] != seqs["mask"]:
                raise SystemExit(f"{name}: drop and mask decoded different tokens")
            lengths = [len(s) - len(p) for s, p in zip(seqs["drop"], prompts)]
            row = {m: statistics.median(v) for m, v in runs.items()}
            row.update(all_runs=runs, new_tokens_per_row=lengths)
            out["methods"][name] = row
            print(f"{name}: drop {row['drop']:.1f} tokens/s, mask {row['mask']:.1f} tokens/s "
                  f"(mask / drop {row['mask'] / row['drop']:.2f}); new tokens per row {lengths}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "finished.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
