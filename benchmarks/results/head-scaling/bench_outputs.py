# Shared by the issue-27 diagnostics in this folder: the target's greedy outputs for the first questions of each
# benchmark file, and their teacher-forced features (one forward), float32.
import json

import numpy as np
import torch

from heterospec.models.answers import answer
from heterospec.models.train import teacher_forced
from heterospec.tools.prompts import encode

FILES = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")


def benchmark_outputs(model, tok, per_file=2, max_new_tokens=128):
    """-> (questions [(file, text)], prompt ids [np.int64], answers [np.int64], teacher-forced records)."""
    qs = []
    for f in FILES:
        qs += [(f, json.loads(line)["turns"][0]) for line in open(f"../shared/data/benchmarks/{f}.jsonl")
               if line.strip()][:per_file]
    ids = [encode(tok, q).view(-1).numpy() for _, q in qs]
    ans = answer(model, ids, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, batch_size=1)
    seqs = [(torch.from_numpy(np.concatenate([p, a])), int(p.size)) for p, a in zip(ids, ans)]
    recs, _, _ = teacher_forced(model, seqs, topk=1)
    return qs, ids, ans, recs
