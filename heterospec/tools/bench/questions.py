"""The benchmark questions: EAGLE ``question.jsonl`` files (``{"question_id", "turns": [...]}`` a line), the
five benchmarks of the paper's Table 1 and where their files are found."""
from __future__ import annotations

import json
import os

BENCHMARKS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")
LABELS = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "alpaca": "Alpaca",
          "sum": "CNN/DM"}
# the checkout this package sits in (heterospec/tools/bench/ is three levels down)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def benchmark_files(d):
    """The five benchmark files in directory ``d`` (the paper's order), or [] when one is missing."""
    files = [os.path.normpath(os.path.join(d, n + ".jsonl")) for n in BENCHMARKS]
    return files if all(os.path.isfile(f) for f in files) else []


# where the five benchmark files are found without --questions: the checkout's copy (benchmarks/data/questions,
# with their sources and licences), then ../shared/data/benchmarks beside the working directory or the checkout
QUESTION_DIRS = (os.path.join("benchmarks", "data", "questions"), os.path.join("..", "shared", "data", "benchmarks"))


def default_question_files():
    """The five benchmark files of a checkout (benchmarks/data/questions) or of ../shared/data/benchmarks (next to
    the working directory or the checkout), or [] when none has them (an installed package without a checkout)."""
    for rel in QUESTION_DIRS:
        for root in (REPO, os.getcwd()):
            files = benchmark_files(os.path.join(root, rel))
            if files:
                return files
    return []


def question_paths(args):
    """--questions as files: a directory stands for its five benchmark files (an error if one is missing)."""
    paths = []
    for p in args or []:
        if os.path.isdir(p):
            files = benchmark_files(p)
            if not files:
                raise ValueError(f"argument --questions: expected a question file or a directory holding "
                                 f"{', '.join(n + '.jsonl' for n in BENCHMARKS)}, got the directory {p!r} without them")
            paths += files
        else:
            paths.append(p)
    return paths


def _bench_name(path):
    base = os.path.basename(path)
    stem = base[:-len(".jsonl")] if base.endswith(".jsonl") else os.path.splitext(base)[0]
    if stem == "question":  # EAGLE's layout: data/<bench>/question.jsonl
        stem = os.path.basename(os.path.dirname(os.path.abspath(path))) or stem
    return stem


def load_questions(paths, limit=None):
    """{benchmark name: [{"question_id", "turns"}]} from EAGLE ``question.jsonl`` files, the first
    ``limit`` questions of each."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"load_questions: argument 'limit' expected an int >= 1, got {limit!r}")
    out = {}
    for path in paths:
        name = _bench_name(path)
        if name in out:
            raise ValueError(f"load_questions: argument 'paths' has two files named {name!r}")
        try:
            f = open(path)
        except OSError as e:
            raise ValueError(f"load_questions: cannot read question file {str(path)!r}: {e}") from None
        qs = []
        with f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"load_questions: {path}:{lineno} is not JSON: {e}") from None
                turns = rec.get("turns") if isinstance(rec, dict) else None
                if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
                    raise ValueError(f"load_questions: {path}:{lineno} expected an EAGLE question record with "
                                     f"'turns': a non-empty list of strings, got {line.strip()[:80]!r}")
                qs.append({"question_id": rec.get("question_id", len(qs)), "turns": turns})
                if limit is not None and len(qs) >= limit:
                    break
        if not qs:
            raise ValueError(f"load_questions: no questions in {str(path)!r}")
        out[name] = qs
    return out
