"""EAGLE-3 draft checkpoints on disk: reading a checkpoint directory strictly, and writing one.

:meth:`Eagle3Draft.from_pretrained <heterospec.models.draft.module.Eagle3Draft.from_pretrained>` reads with
:func:`read_config` and :func:`read_state`, :meth:`~heterospec.models.draft.module.Eagle3Draft.save_pretrained`
writes with :func:`write_checkpoint`.  This file needs from the module only its parameter names and
shapes, which the caller passes in, so the imports go config <- checkpoint <- module.

Checkpoint layouts read (config.json plus one of):
``model.safetensors``; ``model.safetensors.index.json`` + shards; ``pytorch_model.bin`` (read ONLY with
``torch.load(weights_only=True, map_location="cpu")``); ``pytorch_model.bin.index.json`` + shards.  Key
names are normalised to SafeAILab's: a leading ``model.`` is stripped (vLLM / SGLang style prefixes),
and ``layers.0.`` becomes ``midlayer.`` (speculators / vLLM).  Engine-internal stacked weights
(``qkv_proj``, ``gate_up_proj``) exist only inside vLLM / SGLang after loading -- their own EAGLE-3
loaders read separate ``q/k/v_proj`` and ``gate/up_proj`` from checkpoints -- so they are not split here;
a checkpoint holding them is rejected with a hint.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from .config import Eagle3Config

# state-dict keys a checkpoint may leave out: the embedding (the target's stands in) and the vocabulary maps
OPTIONAL_KEYS = ("embed_tokens.weight", "d2t", "t2d")


def read_config(path) -> Eagle3Config:
    """The config of the checkpoint directory ``path``; a missing directory or config.json raises
    FileNotFoundError, an unreadable or invalid config ValueError."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Eagle3Draft.from_pretrained: {path} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"Eagle3Draft.from_pretrained: {config_file} does not exist")
    try:
        return Eagle3Config.from_dict(_read_json(config_file))
    except ValueError as e:
        if str(config_file) in str(e):
            raise
        raise ValueError(f"{config_file}: {e}") from None


def read_state(path, config: Eagle3Config, expected, target=None):
    """The weights of the checkpoint directory ``path`` checked against ``config`` and ``expected`` (the
    module's {state-dict name: shape}) and, when given, the HF causal LM ``target``: every problem is
    collected and raised as ONE ValueError (see :meth:`Eagle3Draft.from_pretrained` for the rules).

    Returns ``(values, embedding, target_embedding)``: ``values`` {name: tensor} for every expected name
    but ``embed_tokens.weight``, with ``d2t`` / ``t2d`` resolved (identity when Vd == V, ``t2d`` derived
    from ``d2t`` when absent); ``embedding`` the checkpoint's ``embed_tokens.weight`` or else the target's
    input embedding; ``target_embedding`` the target's input embedding (None without a target)."""
    path = Path(path)
    raw, problems = _read_weights(path)
    sd = _canonical_names(raw, problems)
    c = config
    V, Vd, H, T = c.vocab_size, c.draft_vocab_size, c.hidden_size, c.target_hidden_size

    target_embedding, target_flagged = None, False
    if target is not None:
        before = len(problems)
        target_embedding = _check_target(c, target, problems)
        target_flagged = len(problems) > before

    required = set(expected) - set(OPTIONAL_KEYS)
    if Vd != V:
        required.add("d2t")
    for k in sorted(required - set(sd)):
        problems.append(f"missing key: {k}" + (" (the draft->target vocabulary map, needed because "
                                               f"draft_vocab_size {Vd} != vocab_size {V})" if k == "d2t" else ""))
    for k in sorted(set(sd) - set(expected)):
        problems.append(f"unexpected key: {k} (from {sd[k][1]}){_unexpected_hint(k, c)}")
    for k in sorted(set(sd) & set(expected)):
        t, src = sd[k]
        if tuple(t.shape) != expected[k]:
            problems.append(f"wrong shape for {k} (from {src}): expected {list(expected[k])}, got {list(t.shape)}")
        elif k == "d2t" and (t.is_floating_point() or t.dtype == torch.bool or t.is_complex()):
            problems.append(f"d2t must hold integers, got {t.dtype}")
        elif k == "t2d" and (t.is_floating_point() or t.is_complex()):
            problems.append(f"t2d must be bool, got {t.dtype}")
        elif k not in ("d2t", "t2d") and not t.is_floating_point():
            problems.append(f"{k} must be a floating-point tensor, got {t.dtype}")

    # the embedding
    embedding = None
    if "embed_tokens.weight" in sd:
        embedding = sd["embed_tokens.weight"][0]
    elif target is None:
        problems.append("the checkpoint has no embed_tokens.weight: pass target= (the HF target model) to "
                        "take its input embedding")
    elif T != H:
        problems.append(f"the checkpoint has no embed_tokens.weight, and the target's embedding cannot "
                        f"be used because target_hidden_size ({T}) != hidden_size ({H})")
    elif target_embedding is not None and tuple(target_embedding.shape) == (V, H):
        embedding = target_embedding
    elif target_embedding is not None and not target_flagged:  # (else already explained above)
        problems.append(f"the checkpoint has no embed_tokens.weight and the target's input embedding is "
                        f"{list(target_embedding.shape)}, not [{V}, {H}]")

    # the vocabulary maps
    d2t = t2d = None
    if problems and Vd == V:
        pass          # (the identity maps are [V]: not allocated for a checkpoint already refused)
    elif Vd == V:
        d2t = torch.zeros(Vd, dtype=torch.int64)
        t2d = torch.ones(V, dtype=torch.bool)
        got = sd.get("d2t")
        if got is not None and tuple(got[0].shape) == (Vd,) and bool(torch.any(got[0] != 0)):
            warnings.warn("Eagle3Draft.from_pretrained: draft_vocab_size == vocab_size, so the checkpoint's "
                          "non-identity d2t is ignored (identity map, as SafeAILab's EaModel does)",
                          stacklevel=3)
    elif "d2t" in sd and tuple(sd["d2t"][0].shape) == (Vd,) and not sd["d2t"][0].is_floating_point():
        d2t = sd["d2t"][0].to(torch.int64)
        mapped = torch.arange(Vd) + d2t
        if int(mapped.min()) < 0 or int(mapped.max()) >= V:
            bad = int(((mapped < 0) | (mapped >= V)).sum())
            problems.append(f"d2t maps {bad} draft ids outside the target vocabulary [0, {V})")
        else:
            derived = torch.zeros(V, dtype=torch.bool)
            derived[mapped] = True
            got = sd.get("t2d")
            if got is None:
                t2d = derived
            elif tuple(got[0].shape) == (V,) and not got[0].is_floating_point():
                t2d = got[0] != 0
                if not torch.equal(t2d, derived):
                    problems.append(f"t2d disagrees with d2t: t2d marks {int(t2d.sum())} target ids, the ids "
                                    f"d2t maps to are {int(derived.sum())} (and must be exactly those)")

    if len(problems) == 1:
        raise ValueError(f"cannot load the EAGLE-3 draft from {path}: {problems[0]}")
    if problems:
        raise ValueError(f"cannot load the EAGLE-3 draft from {path}:\n" + "\n".join(f"  - {p}" for p in problems))

    values = {k: t for k, (t, _) in sd.items() if k in expected and k not in OPTIONAL_KEYS}
    values["d2t"], values["t2d"] = d2t, t2d
    return values, embedding, target_embedding


def write_checkpoint(path, config: Eagle3Config, state, dtype: torch.dtype, *, save_embedding: bool = False) -> None:
    """Write ``config.json`` (:meth:`Eagle3Config.to_dict` plus ``torch_dtype``) and ``model.safetensors``
    holding ``state`` (a module's state dict, SafeAILab names).  ``embed_tokens.weight`` is written only
    when target_hidden_size != hidden_size (the target's embedding cannot stand in for it) or
    ``save_embedding`` is true."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = config
    keep_embedding = save_embedding or c.target_hidden_size != c.hidden_size
    tensors = {}
    for k, t in state.items():
        if k == "embed_tokens.weight" and not keep_embedding:
            continue
        tensors[k] = t.detach().to("cpu").contiguous().clone()
    cfg = c.to_dict()
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(path / "config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------------
# checkpoint reading
# ------------------------------------------------------------------------------------------------------

def _read_json(file):
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None


# bytes per element of every safetensors dtype (sub-byte dtypes are refused by name)
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_ST_MAX_HEADER = 100 << 20   # the safetensors format's own limit on the header's size


def _check_safetensors_header(file):
    """Read the header of a safetensors file (its first 8 + n bytes, n bounded by the file's size) and check it
    against the file before anything is loaded: a known dtype, a shape of non-negative ints, and data offsets
    that span exactly shape x dtype bytes inside the file without overlapping.  A lie is a one-line ValueError
    naming the file and the tensor; nothing is allocated beyond the header's real bytes."""
    def bad(what):
        return ValueError(f"cannot read the safetensors file {file}: {what}")

    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _ST_MAX_HEADER):
            raise bad(f"the header claims {n} bytes, but the file has {size - 8} after the length"
                      + (f" (and the format's limit is {_ST_MAX_HEADER})" if n > _ST_MAX_HEADER else ""))
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    data = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r}: expected an object with dtype, shape and data_offsets, got {info!r}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ST_BYTES:
            raise bad(f"tensor {name!r}: dtype {dtype!r} is not one heterospec reads ({', '.join(_ST_BYTES)})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                 for d in shape)):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} do not lie inside the {data} data bytes")
        want = _ST_BYTES[dtype]
        for d in shape:
            want *= d
        if offsets[1] - offsets[0] != want:
            raise bad(f"tensor {name!r}: shape {shape} of {dtype} is {want} bytes, but data_offsets {offsets} "
                      f"span {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (b0, e0, a), (b1, e1, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise bad(f"tensors {a!r} and {b!r} overlap in the data (bytes {b1}-{min(e0, e1)})")


def _load_safetensors(file):
    from safetensors.torch import load_file

    _check_safetensors_header(file)
    try:
        return load_file(str(file), device="cpu")
    except Exception as e:  # noqa: BLE001 -- any failure of the reader means an unreadable file
        raise ValueError(f"cannot read the safetensors file {file}: {e}") from None


def _load_bin(file):
    try:
        obj = torch.load(str(file), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise ValueError(
            f"cannot read {file} with torch.load(weights_only=True): {type(e).__name__}: {e}\n"
            f"Only plain tensor state dicts are accepted; pickled objects are never executed. Convert the "
            f"checkpoint to safetensors with a loader you trust.") from None
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in obj.items()):
        raise ValueError(f"{file} does not hold a flat {{name: tensor}} state dict "
                         f"(got {type(obj).__name__})")
    return dict(obj)


def _shard_path(root, name, index_file):
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ValueError(f"{index_file}: invalid shard file name {name!r}")
    p = (root / name).resolve()
    if root.resolve() not in p.parents:
        raise ValueError(f"{index_file}: shard {name!r} lies outside the checkpoint directory")
    if not p.is_file():
        raise ValueError(f"{index_file}: shard file {p} does not exist or is unreadable")
    return p


def _read_index(root, index, loader, problems):
    meta = _read_json(index)
    wmap = meta.get("weight_map") if isinstance(meta, Mapping) else None
    if not isinstance(wmap, Mapping) or not wmap:
        raise ValueError(f"{index}: no 'weight_map' object")
    out = {}
    for shard in sorted(set(wmap.values()), key=str):
        file = _shard_path(root, shard, index)
        for k, v in loader(file).items():
            if k in out:
                problems.append(f"duplicate key {k}: in {out[k][1]} and in {shard}")
                continue
            if wmap.get(k) != shard:
                problems.append(f"key {k} is in shard {shard} but {index.name} "
                                + (f"places it in {wmap[k]}" if k in wmap else "does not list it"))
            out[k] = (v, shard)
    for k in sorted(set(wmap) - set(out)):
        problems.append(f"{index.name} lists {k} in {wmap[k]}, which does not contain it")
    return out


def _read_weights(root):
    """-> ({raw name: (tensor, file name)}, problems).  The first layout found wins, in the order
    model.safetensors, model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json.
    Unreadable files raise ValueError naming them."""
    problems = []
    for name, loader, sharded in (("model.safetensors", _load_safetensors, False),
                                  ("model.safetensors.index.json", _load_safetensors, True),
                                  ("pytorch_model.bin", _load_bin, False),
                                  ("pytorch_model.bin.index.json", _load_bin, True)):
        file = root / name
        if not file.is_file():
            continue
        if sharded:
            return _read_index(root, file, loader, problems), problems
        return {k: (v, name) for k, v in loader(file).items()}, problems
    raise FileNotFoundError(f"no weights in {root}: expected model.safetensors, model.safetensors.index.json, "
                            f"pytorch_model.bin or pytorch_model.bin.index.json")


_LAYER0 = re.compile(r"^layers\.0\.")


def _canonical_name(name):
    if name.startswith("model."):
        name = name[len("model."):]
    return _LAYER0.sub("midlayer.", name)


def _canonical_names(raw, problems):
    """Rename every key to SafeAILab's; two keys that land on the same name are a problem."""
    out, origin = {}, {}
    for k in sorted(raw):
        t, src = raw[k]
        name = _canonical_name(k)
        if name in out:
            problems.append(f"duplicate key after renaming: {origin[name]!r} and {k!r} both mean {name!r}")
            continue
        out[name], origin[name] = (t, src), k
    return out


def _unexpected_hint(key, c):
    m = re.match(r"^(?:midlayers|layers)\.(\d+)\.", key)
    if m and m.group(1) != "0":
        return " -- a further decoder layer: only one layer is built"
    if ".qkv_proj." in key or ".gate_up_proj." in key:
        return " -- an engine-internal stacked weight; checkpoints store q/k/v_proj and gate/up_proj separately"
    if key.startswith("input_norm.") and not c.norm_before_fc:
        return " -- the config does not set norm_before_fc"
    if key.startswith("fc_norm.") and not c.fc_norm:
        return " -- the config does not set fc_norm"
    if re.search(r"self_attn\.[qk]_norm\.", key) and not c.qk_norm:
        return " -- QK-norm weights, but the config does not enable qk_norm"
    if key.endswith(".bias"):
        return " -- biases are not supported"
    return ""


def _check_target(c, target, problems):
    """Compare the draft config with a HF causal LM; returns its input embedding weight (or None)."""
    tcfg = getattr(target, "config", None)
    if tcfg is not None and hasattr(tcfg, "get_text_config"):
        tcfg = tcfg.get_text_config()
    try:
        emb = target.get_input_embeddings().weight
    except Exception as e:  # noqa: BLE001
        problems.append(f"target has no usable input embedding ({type(e).__name__}: {e})")
        emb = None
    tV = getattr(tcfg, "vocab_size", None)
    tH = getattr(tcfg, "hidden_size", None)
    tL = getattr(tcfg, "num_hidden_layers", None)
    if tV is None and emb is not None:
        tV = emb.shape[0]
    if tV != c.vocab_size:
        problems.append(f"vocabulary mismatch: the draft's vocab_size is {c.vocab_size}, the target's {tV}")
    elif emb is not None and emb.shape[0] != c.vocab_size:
        problems.append(f"vocabulary mismatch: the target's input embedding has {emb.shape[0]} rows, the draft's "
                        f"vocab_size is {c.vocab_size}")
    if tH != c.target_hidden_size:
        problems.append(f"hidden size mismatch: the draft's target_hidden_size is {c.target_hidden_size} "
                        f"(the width of each fused tap), the target's hidden_size {tH}")
    if not isinstance(tL, int):
        problems.append("the target config has no num_hidden_layers: cannot check the tap layers")
    else:
        try:
            c.tap_layers(tL)
        except ValueError as e:
            problems.append(str(e))
    return emb
