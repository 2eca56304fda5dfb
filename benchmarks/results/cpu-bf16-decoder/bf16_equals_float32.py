"""A bfloat16 target on our CPU decoder against transformers' float32 generate of the same weights (2026-12-07).

The default target loaded in bfloat16 (its GGUF's weights rounded to bf16, as a bf16 checkpoint holds them) and
the shipped head in bf16; the 10 held-out questions of ``heterospec bench`` (5 per file, chat template, greedy,
128 new tokens).  For each question: our engine's ``ar`` and ``heterospec`` on the bf16 model (cpu_decoder='auto':
float32 arithmetic over the 16-bit weights), transformers' greedy ``generate`` on ``copy.deepcopy(model).float()``
(the same weights in float32) and on the bf16 model itself.  Printed: per question whether each equals the float32
``generate``, and the first differing new token where not.
Run from the repository root: python benchmarks/results/cpu-bf16-decoder/bf16_equals_float32.py
"""
import copy

import torch

from heterospec import HeteroSpec, default_policy
from heterospec.models.default import default_pair
from heterospec.tools.bench.questions import load_questions
from heterospec.tools.prompts import encode_turn

FILES = ["benchmarks/data/heldout/gsm8k_heldout.jsonl", "benchmarks/data/heldout/alpaca_seed_heldout.jsonl"]
NEW = 128


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main():
    target, tok, draft = default_pair(dtype=torch.bfloat16)
    full = copy.deepcopy(target).float()
    counts = {"ar": 0, "heterospec": 0, "hf bf16": 0}
    n = 0
    with HeteroSpec(target) as ar, HeteroSpec(target, draft, default_policy()) as hs:
        print("engines:", ar.cpu_decoder, "|", hs.cpu_decoder)
        for name, qs in load_questions(FILES, limit=5).items():
            for q in qs:
                ids = encode_turn(tok, q["turns"][:1], [])
                with torch.no_grad():
                    want = full.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.eos_token_id)
                    hf16 = target.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.eos_token_id)
                want = want[0, ids.shape[1]:].tolist()
                got = {"ar": ar.generate(ids, max_new_tokens=NEW)[0][0, ids.shape[1]:].tolist(),
                       "heterospec": hs.generate(ids, max_new_tokens=NEW)[0][0, ids.shape[1]:].tolist(),
                       "hf bf16": hf16[0, ids.shape[1]:].tolist()}
                n += 1
                line = []
                for k, v in got.items():
                    d = first_diff(v, want)
                    counts[k] += d is None
                    line.append(f"{k} {'same' if d is None else f'differs at new token {d}'}")
                print(f"{name} q{q['question_id']}: " + ", ".join(line), flush=True)
    print(f"equal to transformers' float32 generate of the same weights, of {n}: "
          + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
