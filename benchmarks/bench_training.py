"""How fast the default pair's head recipe runs on this machine (issue 27.2), every column in one run.

    python benchmarks/bench_training.py [--prompts 64] [--gen-batch 64] [--steps 6] [--device cpu] [--out r.json]

1. Answer generation (HF ``generate``, greedy, batched with left padding, static cache, 256 new tokens) of the
   same ``--prompts`` prompts of the committed training list (benchmarks/answers/, past the answered shards'
   prompts is fine: never a benchmark question) in float32 and in bfloat16: answer tokens/s, and how often
   the bfloat16 answer's token is the float32 target's greedy token at the same prefix (one teacher-forced
   float32 forward over the bfloat16 answers: the agreement ``train-draft --answers`` reports).
2. The features of those sequences by one teacher-forced float32 forward (taps and top-k log-probs): positions/s;
   and reading them back from the feature cache, which is what an epoch after the first costs instead.
3. Training steps of the recipe (warm start from the shipped head, 7 TTT steps, batches of ``--batch`` sequences)
   with the head's forward in float32 and under bfloat16 autocast: positions/s (prompt + answer positions,
   the unit the loss runs over).
"""
import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # a checkout without pip install
ANSWERS = os.path.join(HERE, "answers", "smollm2-135m-instruct")


def main(argv=None):
    import numpy as np
    import torch

    from heterospec.models.answers import AnswerStore, answer
    from heterospec.models.default import DEFAULT_HEAD, default_target
    from heterospec.models.train import load_records, save_records, teacher_forced, train_draft

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", default=ANSWERS)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--first", type=int, default=None,
                    help="index of the first prompt of the list to use (default: past every answered shard)")
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the answer store's setting")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    m = AnswerStore.read_manifest(a.answers)
    listed = AnswerStore.read_prompts(a.answers)
    first = a.first if a.first is not None else (max([int(k) for k in m["shards"]] + [-1]) + 1) * m["shard_size"]
    model, tok = default_target(device=a.device)
    from heterospec.tools.prompts import encode

    ids = []
    for t in listed["prompts"][first:]:             # as collection does: prompts over 1,024 tokens are skipped
        p = encode(tok, t, listed.get("chat_template", True)).view(-1).numpy()
        if p.size <= a.max_prompt_tokens:
            ids.append(p)
        if len(ids) == a.prompts:
            break
    gen = dict(m["generation"])
    gen["max_new_tokens"] = a.max_new_tokens or gen["max_new_tokens"]
    res = {"machine": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "device": a.device, "prompts": len(ids), "first_prompt": first,
           "gen_batch": a.gen_batch, "max_new_tokens": gen["max_new_tokens"], "prompt_tokens": int(sum(p.size for p in ids))}

    answers = {}
    for dtype in ("float32", "bfloat16"):
        mdl = model if dtype == "float32" else copy.deepcopy(model).to(torch.bfloat16)   # model stays float32
        t0 = time.perf_counter()
        ans = answer(mdl, ids, max_new_tokens=gen["max_new_tokens"], eos_token_id=gen["eos_token_id"],
                     batch_size=a.gen_batch)
        s = time.perf_counter() - t0
        n = int(sum(x.size for x in ans))
        answers[dtype] = ans
        res[f"answer_{dtype}"] = {"seconds": s, "answer_tokens": n, "tokens_per_s": n / s}
        print(f"answers {dtype}: {n} tokens in {s:.0f} s = {n / s:.1f} tokens/s", flush=True)
        del mdl

    seqs = [(torch.from_numpy(np.concatenate([p, x])), int(p.size)) for p, x in zip(ids, answers["bfloat16"])]
    positions = int(sum(q.numel() for q, _ in seqs))
    t0 = time.perf_counter()
    records, agree, total = teacher_forced(model, seqs, topk=32)
    s = time.perf_counter() - t0
    same = sum(int(np.array_equal(x, y)) for x, y in zip(answers["float32"], answers["bfloat16"]))
    res["agreement"] = {"positions_equal_to_fp32_greedy": agree / total, "answer_positions": total,
                        "answers_identical": same, "answers": len(ids)}
    res["features"] = {"seconds": s, "positions": positions, "positions_per_s": positions / s}
    print(f"bfloat16 answers: {agree / total:.2%} of {total} positions are the float32 greedy token; "
          f"{same}/{len(ids)} answers identical", flush=True)
    print(f"features: {positions} positions in {s:.0f} s = {positions / s:.0f} positions/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "features.pt")
        save_records(path, records)
        t0 = time.perf_counter()
        load_records(path)
        s = time.perf_counter() - t0
        res["features_cached"] = {"seconds": s, "positions_per_s": positions / s,
                                  "bytes": os.path.getsize(path)}
        print(f"features from the cache: {s:.1f} s = {positions / s:.0f} positions/s "
              f"({os.path.getsize(path) / positions:.0f} bytes per position)", flush=True)
        mean_len = positions / len(records)      # batches are random draws: steps x batch x mean length
        for autocast in (None, "bfloat16"):
            at = {}
            train_draft(model, None, os.path.join(tmp, f"head-{autocast}"), records=records, steps=a.steps,
                        batch_size=a.batch, init_head=DEFAULT_HEAD, ttt_steps=7, lr=5e-4, autocast=autocast,
                        val_fraction=0.0, log_every=1, progress=lambda step, n, *r: at.__setitem__(step, r[-1]))
            s = at[a.steps] - at[1]                 # steps 2..N: the first one warms up
            pos = (a.steps - 1) * a.batch * mean_len
            key = f"train_{autocast or 'float32'}"
            res[key] = {"seconds": s, "steps": a.steps - 1, "batch": a.batch, "positions_per_s": pos / s}
            print(f"training ({autocast or 'float32'} forward): {a.steps - 1} steps of {a.batch} in {s:.0f} s = "
                  f"{pos / s:.0f} positions/s", flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
