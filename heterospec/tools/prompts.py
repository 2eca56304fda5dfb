"""Prompts for the command-line tools: question files and the chat template."""
from __future__ import annotations

import json


def read_prompts(paths, limit=None):
    """Prompts from EAGLE question.jsonl files (first turn), JSON lines with a question/prompt/instruction
    field, or plain text (one prompt per line)."""
    out = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                if line.startswith("{"):
                    rec = json.loads(line)
                    text = (rec.get("turns") or [None])[0] or rec.get("question") or rec.get("prompt") or rec.get("instruction")
                    if not text:
                        raise SystemExit(f"heterospec: no turns/question/prompt/instruction field in a line of {path}")
                else:
                    text = line
                out.append(text)
                if limit is not None and len(out) >= limit:
                    return out
    return out


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
