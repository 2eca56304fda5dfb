"""Training prompts at scale that never overlap a benchmark question (issue 43, item 1): the overlap check
(``OverlapGuard``: 13 words in a row, or a short question whole), the offline sources as conversations
(``training_conversations``), train-draft refusing overlapping prompts, and the committed prompt lists checked."""
import argparse
import gzip
import json
import os

import pytest

from heterospec.tools import commands
from heterospec.tools.prompts import BENCHMARK_DIR, OverlapGuard, training_conversations

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUESTION = ("Bella bought stamps at the post office. Some of the stamps had a snowflake design, some had a truck "
            "design, and some had a rose design.")


def _questions(tmp_path, *turns):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(turns)))
    return path


def test_thirteen_words_in_a_row_refuse_a_prompt_and_twelve_do_not(tmp_path):
    g = OverlapGuard([_questions(tmp_path, QUESTION)])
    words = QUESTION.split()
    assert g.overlaps("Here is a puzzle: " + " ".join(words[3:16]) + " ... and more")          # 13 words
    assert not g.overlaps("Here is a puzzle: " + " ".join(words[3:15]) + " ... and more")      # 12 words
    # case and punctuation do not hide it
    assert g.overlaps(" ".join(w.upper() + "," for w in words[:13]))
    assert not g.overlaps("What is 2 + 2?")


def test_a_short_question_refuses_a_prompt_that_contains_it_whole(tmp_path):
    g = OverlapGuard([_questions(tmp_path, "Name three primary colors please.", "Say hi.")])
    assert g.overlaps("Could you name three primary colors please? Thanks.")
    assert not g.overlaps("Could you name three primary colours please?")       # another word
    assert not g.overlaps("Say hi.")                                            # 2 words: below MIN_SHORT_WORDS
    assert not g.overlaps("Name three primary colorsplease")                    # words, not characters


def test_every_turn_of_a_benchmark_question_is_checked(tmp_path):
    path = tmp_path / "mt.jsonl"
    second = "Rewrite your previous response and start every sentence with the letter A please now"
    path.write_text(json.dumps({"question_id": 1, "turns": ["Compose a blog post about Hawaii.", second]}) + "\n")
    g = OverlapGuard([path])
    assert g.questions == 1 and g.overlaps("Now: " + second)


def _train_dir(tmp_path):
    d = tmp_path / "train"
    d.mkdir()
    (d / "gsm8k_train.jsonl").write_text(json.dumps({"question": QUESTION + " How many?", "answer": "20"}) + "\n"
                                         + json.dumps({"question": "Tom has 3 apples and eats one. How many?",
                                                       "answer": "2"}) + "\n")
    (d / "alpaca_seed_tasks.jsonl").write_text(json.dumps({"instruction": "Write a haiku.", "instances": [
        {"input": "", "output": "..."}]}) + "\n")
    share = tmp_path / "sharegpt.json"
    convs = [
        {"conversations": [{"from": "human", "value": "Hello there, how are you?"}, {"from": "gpt", "value": "Fine."},
                           {"from": "human", "value": "Tell me a joke."}, {"from": "gpt", "value": "..."}]},
        {"conversations": [{"from": "human", "value": "Hello there, how are you?"}]},                   # duplicate
        {"conversations": [{"from": "human", "value": "Explain gravity."}, {"from": "gpt", "value": "..."},
                           {"from": "human", "value": "Und auf Deutsch? Schön."}, {"from": "gpt", "value": "..."},
                           {"from": "human", "value": "Thanks."}]},                                     # cut at non-ASCII
        {"conversations": [{"from": "human", "value": "Quick one."}, {"from": "gpt", "value": "ok"},
                           {"from": "human", "value": "Solve: " + QUESTION}]},                          # refused
    ]
    share.write_text(json.dumps(convs)[:-1] + ', {"conversations": [{"from": "hu')               # cut off, as the package's
    return d, share


def test_training_conversations_keep_every_user_turn_and_drop_duplicates_and_overlaps(tmp_path):
    d, share = _train_dir(tmp_path)
    guard = OverlapGuard([_questions(tmp_path, QUESTION)])
    convs, report = training_conversations(str(d), sharegpt_path=str(share), guard=guard)
    by = {c["turns"][0]: c for c in convs}
    assert by["Hello there, how are you?"]["turns"] == ["Hello there, how are you?", "Tell me a joke."]
    assert by["Explain gravity."]["turns"] == ["Explain gravity."]
    assert "Quick one." not in by and not any(QUESTION in t for c in convs for t in c["turns"])
    assert report["sharegpt"] == {"kept": 2, "turns": 3, "duplicates": 1, "refused": 1}
    assert report["gsm8k-train"] == {"kept": 1, "turns": 1, "duplicates": 0, "refused": 1}
    assert report["alpaca-seed"]["kept"] == 1 and {c["source"] for c in convs} == {"sharegpt", "gsm8k-train",
                                                                                   "alpaca-seed"}


def test_train_draft_refuses_prompts_that_overlap_a_benchmark_question(tmp_path, capsys):
    data = tmp_path / "prompts.txt"
    data.write_text("What is the capital of France?\nSolve this: " + QUESTION + "\nWrite a short poem.\n")
    args = argparse.Namespace(data=[str(data)], exclude=[str(_questions(tmp_path, QUESTION))], seed=0)
    texts = commands._prompt_texts(args, None, None)
    assert sorted(texts) == ["What is the capital of France?", "Write a short poem."]
    assert "1 of 3 prompts refused" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.isdir(BENCHMARK_DIR), reason="benchmarks/data/questions is not next to the package")
def test_the_committed_prompt_lists_and_the_shipped_heads_answers_hold_no_benchmark_question():
    g = OverlapGuard.default()
    assert len(g.files) == 5 and g.questions == 400   # 80 questions a file
    with open(os.path.join(ROOT, "benchmarks", "data", "smollm2_train_prompts.jsonl")) as f:
        from heterospec.tools.prompts import record_prompt

        assert not [line for line in f if g.overlaps(record_prompt(json.loads(line)))]
    answers = os.path.join(ROOT, "benchmarks", "answers", "smollm2-135m-instruct")
    with gzip.open(os.path.join(answers, "prompts.json.gz"), "rt") as f:
        prompts = json.load(f)["prompts"]
    bad = [i for i, t in enumerate(prompts) if g.overlaps(t)]
    # one GSM8K training question shares 13 words with a benchmark question; its shard is not answered (and
    # train-draft now never answers it)
    assert bad == [9558]
    shard_size = json.load(open(os.path.join(answers, "manifest.json")))["shard_size"]
    assert not os.path.exists(os.path.join(answers, f"shard-{9558 // shard_size:05d}.npz"))
