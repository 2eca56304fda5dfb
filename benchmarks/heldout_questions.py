"""Write the held-out question files of benchmarks/data/heldout/ (EAGLE question.jsonl format), for speed
tables on text the project never tuned on: no benchmark question, no calibration prompt, and none of the
prompts the shipped head's committed answers were generated from (the first 4,096 of the seeded shuffle in
benchmarks/answers/smollm2-135m-instruct/prompts.json.gz: the 1,792 used, with margin).

    python benchmarks/heldout_questions.py --train-dir ../shared/data/train [--n 10] [--seed 42]

- gsm8k_heldout.jsonl: grade-school math, GSM8K training questions (MIT, openai/grade-school-math);
- alpaca_seed_heldout.jsonl: open-ended instructions, the Self-Instruct seed tasks Alpaca used (CC BY-NC 4.0,
  tatsu-lab/stanford_alpaca), instruction and input joined as the Alpaca benchmark file does.

The choice is seeded, so the files are reproducible from the same inputs; they are committed, so a clone
needs no ../shared."""
import argparse
import gzip
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
EXCLUDE_TRAINED = 4096


def _norm(text):
    return " ".join(text.split())


def _seen():
    """Normalised texts of every prompt the project tuned or trained on, or benchmarks with."""
    seen = set()
    pool = json.load(gzip.open(os.path.join(HERE, "answers", "smollm2-135m-instruct", "prompts.json.gz")))
    seen.update(_norm(p) for p in pool["prompts"][:EXCLUDE_TRAINED])
    for line in open(os.path.join(HERE, "data", "smollm2_calib_prompts.jsonl")):
        if line.strip():
            seen.add(_norm(json.loads(line)["prompt"]))
    qdir = os.path.join(HERE, "data", "questions")
    for name in os.listdir(qdir):
        if name.endswith(".jsonl"):
            for line in open(os.path.join(qdir, name)):
                if line.strip():
                    seen.update(_norm(t) for t in json.loads(line)["turns"])
    return seen


def _pick(texts, seen, n, seed, category):
    fresh = [t for t in dict.fromkeys(texts) if _norm(t) not in seen and 20 <= len(t) <= 600]
    random.Random(seed).shuffle(fresh)
    return [{"question_id": i, "category": category, "turns": [t]} for i, t in enumerate(fresh[:n])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-dir", required=True, help="the folder with gsm8k_train.jsonl and alpaca_seed_tasks.jsonl")
    ap.add_argument("--n", type=int, default=10, help="questions per file")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", default=os.path.join(HERE, "data", "heldout"))
    args = ap.parse_args()
    seen = _seen()
    gsm = [json.loads(line)["question"] for line in open(os.path.join(args.train_dir, "gsm8k_train.jsonl"))
           if line.strip()]
    alpaca = []
    for line in open(os.path.join(args.train_dir, "alpaca_seed_tasks.jsonl")):
        if line.strip():
            task = json.loads(line)
            inp = (task.get("instances") or [{}])[0].get("input", "")
            alpaca.append(task["instruction"] + (f"\n\n{inp}" if inp else ""))
    os.makedirs(args.out, exist_ok=True)
    for name, records in (("gsm8k_heldout.jsonl", _pick(gsm, seen, args.n, args.seed, "math")),
                          ("alpaca_seed_heldout.jsonl", _pick(alpaca, seen, args.n, args.seed, "instruction"))):
        with open(os.path.join(args.out, name), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        print(f"{name}: {len(records)} questions")


if __name__ == "__main__":
    main()
