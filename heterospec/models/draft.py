"""The EAGLE-3 draft model: config parsing, the one-layer draft, RoPE, and strict checkpoint I/O.

The draft is one Llama-style decoder layer whose attention input is 2H wide (the token embedding
concatenated with a hidden state), a fusion layer ``fc`` in front of it, and a reduced-vocabulary LM head
(see ``/work/shared/reference/eagle3.md`` section 1).  Parameter names are SafeAILab's (``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, ``embed_tokens``).

Calling convention (what the decoding loop uses)::

    draft = Eagle3Draft.from_pretrained(path, target)       # strict: every problem in one ValueError
    hidden = draft.fuse(taps)                                # [B, S, 3*T_H] -> [B, S, H]
    logits, h_out, (k, v) = draft(hidden, input_ids, position_ids, past_kv=None, attn_mask=None)
    #  logits [B, S, Vd] float32 over the DRAFT vocabulary; h_out [B, S, H]: feed it back as `hidden`;
    #  (k, v) [B, nkv, P+S, hd]: past + new keys (RoPE applied) / values -- crop by slicing dim 2.
    target_ids = draft.map_tokens(draft_ids)                 # ids + d2t[ids]
    taps = draft.config.tap_layers(num_target_layers)        # input-of-layer ids of the 3 taps

Config switches and what they mean here (each checked against the public source that introduced it):

* ``fc_norm`` (SpecForge "EAGLE 3.1", also vLLM/speculators): per-tap RMSNorm ``fc_norm.{0,1,2}`` [T_H]
  applied to each third of the taps before ``fc``.
* ``norm_before_fc`` (speculators / vLLM, e.g. RedHatAI gpt-oss heads; also read from ``eagle_config``
  like vLLM does for NVIDIA heads): one RMSNorm ``input_norm`` [3*T_H] over the concatenated taps.
  Mutually exclusive with ``fc_norm`` (speculators rejects the combination too).
* ``norm_before_residual`` (speculators / vLLM): the residual added after attention is
  ``hidden_norm(h)`` instead of ``h``.
* ``norm_output`` -- the same JSON key means two different things:

  - in a flat (SafeAILab / SpecForge style) config it is SpecForge's switch (default true):
    ``LlamaForCausalLMEagle3.compute_logits`` applies the final ``norm`` before ``lm_head`` only when it
    is true; the state fed back to the next draft step is always the pre-norm ``h2``.  It is stored as
    ``Eagle3Config.norm_output``.
  - in a ``speculators`` config (default false) it is the "Eagle 3.1" switch of speculators/vLLM: the
    logits are always ``lm_head(norm(h2))``, and when it is true the state fed back is the POST-norm
    ``norm(h2)`` (vLLM ``llama_eagle3.py``: ``aux_output = hidden_states if self.norm_output else
    hidden_prenorm``).  It is stored as ``Eagle3Config.norm_hidden_out`` (flat JSON key
    ``norm_hidden_out``, written by :meth:`Eagle3Draft.save_pretrained`).

  Caveat: vLLM reads a flat config's ``norm_output`` with the speculators meaning, so a SpecForge config
  that says ``"norm_output": true`` (e.g. SpecForge ``configs/qwen3-30B-A3B-eagle3.1.json``) means
  "standard head" to SpecForge and "feed back the post-norm state" to vLLM.  We follow the trainer that
  writes each format.  ``forward`` always returns in ``h_out`` the state to feed back, so callers never
  need to know which variant they hold.
* ``qk_norm``: Qwen3-style per-head RMSNorm ``midlayer.self_attn.{q,k}_norm`` [hd] on queries and keys
  before RoPE.  Set for speculators heads whose ``transformer_layer_config.model_type`` is ``qwen3``
  (speculators' ``Qwen3DecoderEagle3FirstLayer``; it is also the model type speculators assumes when
  none is given), or by a flat ``qk_norm`` key.

Tap layers: ``Eagle3Config.aux_layer_ids`` are always in the INPUT-of-layer convention (id i = the
residual stream entering target layer i = HF ``output_hidden_states[i]``).  A top-level
``eagle_aux_hidden_state_layer_ids`` (speculators / vLLM style) is used as is; ids under
``eagle_config`` (SGLang / SpecForge style) are output-of-layer ids and get +1.  ``None`` means the
EAGLE-3 default ``[2, L//2, L-3]``.

``num_hidden_layers`` other than 1 is accepted and kept in the config, but exactly one layer is built,
like SafeAILab's ``cnets.Model`` (the official ``yuhuili/EAGLE3-Vicuna1.3-13B`` config says 40).  A
checkpoint that really carries further layers (``layers.1.*``) is rejected by the strict loader.

Checkpoint layouts read by :meth:`Eagle3Draft.from_pretrained` (config.json plus one of):
``model.safetensors``; ``model.safetensors.index.json`` + shards; ``pytorch_model.bin`` (read ONLY with
``torch.load(weights_only=True, map_location="cpu")``); ``pytorch_model.bin.index.json`` + shards.  Key
names are normalised to SafeAILab's: a leading ``model.`` is stripped (vLLM / SGLang style prefixes),
and ``layers.0.`` becomes ``midlayer.`` (speculators / vLLM).  Engine-internal stacked weights
(``qkv_proj``, ``gate_up_proj``) exist only inside vLLM / SGLang after loading -- their own EAGLE-3
loaders read separate ``q/k/v_proj`` and ``gate/up_proj`` from checkpoints -- so they are not split here;
a checkpoint holding them is rejected with a hint.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Eagle3Config", "Eagle3Draft", "rope_inv_freq", "default_tap_layers"]

ROPE_TYPES = ("linear", "dynamic", "llama3")
NUM_TAPS = 3
# The three default taps [2, L//2, L-3] are distinct and ascending only from L = 7 on.
MIN_TARGET_LAYERS_FOR_DEFAULT_TAPS = 7


def default_tap_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default taps in the input-of-layer convention: ``[2, L//2, L-3]``.

    Raises ValueError when L < 7: below that the three taps are not distinct and ascending
    (L=6 gives [2, 3, 3], L=4 gives [2, 2, 1]), so a draft needs explicit ``aux_layer_ids``.
    """
    L = int(num_layers)
    if L < MIN_TARGET_LAYERS_FOR_DEFAULT_TAPS:
        raise ValueError(
            f"the default EAGLE-3 taps [2, L//2, L-3] need a target with at least "
            f"{MIN_TARGET_LAYERS_FOR_DEFAULT_TAPS} layers to be distinct and ascending, got L={L} "
            f"({[2, L // 2, L - 3]}); give the draft explicit eagle_aux_hidden_state_layer_ids")
    return [2, L // 2, L - 3]


# ------------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------------

class _Problems(list):
    """Collected config problems, raised together."""

    def raise_if_any(self, what):
        if self:
            raise ValueError(f"{what}:\n" + "\n".join(f"  - {p}" for p in self))


def _get_int(src, key, problems, *, default=None, required=False, prefix=""):
    if key not in src or src[key] is None:
        if required:
            problems.append(f"missing required key '{prefix}{key}'")
        return default
    v = src[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        problems.append(f"'{prefix}{key}' must be an integer, got {v!r}")
        return default
    return int(v)


def _get_float(src, key, problems, *, default=None, required=False, prefix=""):
    if key not in src or src[key] is None:
        if required:
            problems.append(f"missing required key '{prefix}{key}'")
        return default
    v = src[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        problems.append(f"'{prefix}{key}' must be a number, got {v!r}")
        return default
    return float(v)


def _get_bool(src, key, problems, *, default=False, prefix=""):
    if key not in src or src[key] is None:
        return default
    v = src[key]
    if not isinstance(v, bool):
        problems.append(f"'{prefix}{key}' must be true or false, got {v!r}")
        return default
    return v


def _normalise_rope_scaling(rs, max_position_embeddings, problems, prefix=""):
    """-> None or {"rope_type": t, <the type's parameters>}; unknown types are errors naming the type."""
    if rs is None:
        return None
    if not isinstance(rs, Mapping):
        problems.append(f"'{prefix}rope_scaling' must be an object or null, got {rs!r}")
        return None
    t1, t2 = rs.get("rope_type"), rs.get("type")
    if t1 is not None and t2 is not None and t1 != t2:
        problems.append(f"'{prefix}rope_scaling' has rope_type={t1!r} but type={t2!r}")
        return None
    rtype = t1 if t1 is not None else t2
    if rtype is None:
        problems.append(f"'{prefix}rope_scaling' names no type (neither 'rope_type' nor 'type')")
        return None
    if rtype == "default":
        return None
    if rtype not in ROPE_TYPES:
        problems.append(f"unsupported RoPE scaling type {rtype!r} in '{prefix}rope_scaling' "
                        f"(supported: {', '.join(ROPE_TYPES)})")
        return None
    prf = rs.get("partial_rotary_factor")
    if prf is not None and prf != 1 and prf != 1.0:
        problems.append(f"'{prefix}rope_scaling.partial_rotary_factor'={prf!r} is not supported (only 1.0)")
    p = prefix + "rope_scaling."
    out = {"rope_type": rtype}
    factor = _get_float(rs, "factor", problems, required=True, prefix=p)
    if factor is not None and factor <= 0:
        problems.append(f"'{p}factor' must be > 0, got {factor}")
    out["factor"] = factor
    if rtype == "llama3":
        out["low_freq_factor"] = _get_float(rs, "low_freq_factor", problems, required=True, prefix=p)
        out["high_freq_factor"] = _get_float(rs, "high_freq_factor", problems, required=True, prefix=p)
        # HF falls back to max_position_embeddings when original_max_position_embeddings is absent
        out["original_max_position_embeddings"] = _get_int(
            rs, "original_max_position_embeddings", problems, default=max_position_embeddings, prefix=p)
        lo, hi = out["low_freq_factor"], out["high_freq_factor"]
        if lo is not None and hi is not None and not (0 < lo <= hi):
            problems.append(f"'{p}low_freq_factor' ({lo}) and 'high_freq_factor' ({hi}) must satisfy "
                            f"0 < low <= high")
    return out


def read_rope(src, max_position_embeddings, problems, prefix="", default_theta=10000.0):
    """(rope_theta, rope_scaling) of a config dict, wherever its transformers release keeps them: transformers
    < 5 writes rope_theta + rope_scaling, transformers >= 5 writes rope_parameters.  Used for checkpoints and,
    by training, for the target's own config (so a head is trained with the target's RoPE base)."""
    rp = src.get("rope_parameters")
    if rp is not None and not isinstance(rp, Mapping):
        problems.append(f"'{prefix}rope_parameters' must be an object, got {rp!r}")
        rp = None
    theta = _get_float(src, "rope_theta", problems, default=None, prefix=prefix)
    if theta is None and rp is not None:
        theta = _get_float(rp, "rope_theta", problems, default=None, prefix=prefix + "rope_parameters.")
    rs = src.get("rope_scaling")
    if rs is None and rp is not None:
        rs = {k: v for k, v in rp.items() if k != "rope_theta"}
    return (default_theta if theta is None else theta), _normalise_rope_scaling(rs, max_position_embeddings,
                                                                                  problems, prefix)


def _read_layer_settings(src, problems, prefix=""):
    """The Llama-layer settings shared by both config formats (flat, or speculators'
    transformer_layer_config)."""
    out = {}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        out[key] = _get_int(src, key, problems, required=True, prefix=prefix)
    out["rms_norm_eps"] = _get_float(src, "rms_norm_eps", problems, required=True, prefix=prefix)
    out["num_key_value_heads"] = _get_int(src, "num_key_value_heads", problems,
                                          default=out["num_attention_heads"], prefix=prefix)
    out["head_dim"] = _get_int(src, "head_dim", problems, default=None, prefix=prefix)
    out["max_position_embeddings"] = _get_int(src, "max_position_embeddings", problems, default=2048,
                                              prefix=prefix)
    out["pad_token_id"] = _get_int(src, "pad_token_id", problems, default=None, prefix=prefix)
    out["num_hidden_layers"] = _get_int(src, "num_hidden_layers", problems, default=1, prefix=prefix)

    out["rope_theta"], out["rope_scaling"] = read_rope(src, out["max_position_embeddings"], problems, prefix)
    if (out["rope_scaling"] or {}).get("rope_type") == "dynamic" and src.get("max_position_embeddings") is None:
        problems.append(f"missing required key '{prefix}max_position_embeddings' (dynamic RoPE scaling needs it)")

    # things this implementation does not do: refuse them instead of computing something else
    act = src.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"'{prefix}hidden_act'={act!r} is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if src.get(key):
            problems.append(f"'{prefix}{key}' is true: biased projections are not supported")
    prf = src.get("partial_rotary_factor")
    if prf is not None and prf != 1 and prf != 1.0:
        problems.append(f"'{prefix}partial_rotary_factor'={prf!r} is not supported (only 1.0)")
    if src.get("use_sliding_window"):
        problems.append(f"'{prefix}use_sliding_window' is true: sliding-window attention is not supported")
    lt = src.get("layer_types")
    if isinstance(lt, (list, tuple)) and lt and lt[0] not in (None, "full_attention"):
        problems.append(f"'{prefix}layer_types'[0]={lt[0]!r} is not supported (only full attention)")
    return out


def _read_ids(v, key, problems):
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        problems.append(f"'{key}' must be a list of integers, got {v!r}")
        return None
    return [int(i) for i in v]


@dataclasses.dataclass
class Eagle3Config:
    """Shapes and switches of an EAGLE-3 draft (see the module docstring for the switches).

    ``head_dim`` None -> H // nh, ``num_key_value_heads`` None -> nh, ``draft_vocab_size`` None -> V,
    ``target_hidden_size`` None -> H.  ``rope_scaling`` is None or ``{"rope_type": t, ...}`` with t one of
    linear / dynamic / llama3 (``type`` is accepted as the key too).  ``aux_layer_ids`` are input-of-layer
    ids (None: the default taps, see :meth:`tap_layers`).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    pad_token_id: int | None = None
    num_hidden_layers: int = 1
    aux_layer_ids: list[int] | None = None
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = True
    norm_hidden_out: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        p = _Problems()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int) \
                and self.num_attention_heads > 0:
            if self.hidden_size % self.num_attention_heads:
                p.append(f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                         f"({self.num_attention_heads}): give head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings",
                     "num_hidden_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                p.append(f"{name} must be a positive integer, got {v!r}")
        if p:
            p.raise_if_any("invalid EAGLE-3 config")
        if self.num_attention_heads % self.num_key_value_heads:
            p.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                     f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            p.append(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            p.append(f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})")
        if not (isinstance(self.rms_norm_eps, (int, float)) and not isinstance(self.rms_norm_eps, bool)
                and self.rms_norm_eps > 0):
            p.append(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        else:
            self.rms_norm_eps = float(self.rms_norm_eps)
        if not (isinstance(self.rope_theta, (int, float)) and not isinstance(self.rope_theta, bool)
                and self.rope_theta > 0):
            p.append(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        else:
            self.rope_theta = float(self.rope_theta)
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling, self.max_position_embeddings, p)
        if self.pad_token_id is not None and (isinstance(self.pad_token_id, bool)
                                              or not isinstance(self.pad_token_id, int)):
            p.append(f"pad_token_id must be an integer or None, got {self.pad_token_id!r}")
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
            if (not isinstance(ids, (list, tuple)) or len(ids) != NUM_TAPS
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
                p.append(f"aux_layer_ids must be {NUM_TAPS} non-negative integers (input-of-layer ids), got {ids!r}")
            else:
                self.aux_layer_ids = [int(i) for i in ids]
        for name in ("fc_norm", "norm_before_fc", "norm_before_residual", "norm_output", "norm_hidden_out",
                     "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                p.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.fc_norm is True and self.norm_before_fc is True:
            p.append("fc_norm and norm_before_fc are mutually exclusive (per-tap norms vs one norm over the "
                     "concatenated taps)")
        p.raise_if_any("invalid EAGLE-3 config")

    # ---- parsing -------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping) -> "Eagle3Config":
        """Parse a draft ``config.json`` (flat SafeAILab / SpecForge / HF style, or the ``speculators``
        format).  Unknown keys are ignored; every missing required key and every invalid value is listed
        in one ValueError."""
        if not isinstance(d, Mapping):
            raise ValueError(f"EAGLE-3 config must be a JSON object, got {type(d).__name__}")
        p = _Problems()
        if "speculators_model_type" in d:
            kw = cls._parse_speculators(d, p)
            what = "invalid speculators EAGLE-3 config"
        else:
            kw = cls._parse_flat(d, p)
            what = "invalid EAGLE-3 config"
        p.raise_if_any(what)
        return cls(**kw)  # its own checks (divisibility, exclusive switches, ...) raise ValueError too

    @staticmethod
    def _parse_flat(d, p):
        kw = _read_layer_settings(d, p)
        dv = _get_int(d, "draft_vocab_size", p)
        tv = _get_int(d, "truncated_vocab_size", p)  # Nebius heads
        if dv is not None and tv is not None and dv != tv:
            p.append(f"draft_vocab_size ({dv}) and truncated_vocab_size ({tv}) disagree")
        kw["draft_vocab_size"] = dv if dv is not None else tv
        kw["target_hidden_size"] = _get_int(d, "target_hidden_size", p)
        ec = d.get("eagle_config")
        if ec is not None and not isinstance(ec, Mapping):
            p.append(f"'eagle_config' must be an object, got {ec!r}")
            ec = None
        ec = ec or {}
        if ec.get("use_aux_hidden_state") is False:
            p.append("'eagle_config.use_aux_hidden_state' is false: drafts without the fused target taps are "
                     "not supported")
        kw["fc_norm"] = _get_bool(d, "fc_norm", p)
        nbf = _get_bool(d, "norm_before_fc", p, default=None)
        if nbf is None:  # vLLM also reads it from eagle_config (NVIDIA heads)
            nbf = _get_bool(ec, "norm_before_fc", p, prefix="eagle_config.")
        kw["norm_before_fc"] = nbf
        kw["norm_before_residual"] = _get_bool(d, "norm_before_residual", p)
        kw["norm_output"] = _get_bool(d, "norm_output", p, default=True)  # SpecForge's meaning
        kw["norm_hidden_out"] = _get_bool(d, "norm_hidden_out", p)
        kw["qk_norm"] = _get_bool(d, "qk_norm", p)
        top = _read_ids(d.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids", p)
        nested = _read_ids(ec.get("eagle_aux_hidden_state_layer_ids"),
                           "eagle_config.eagle_aux_hidden_state_layer_ids", p)
        if top is not None:
            kw["aux_layer_ids"] = top                        # speculators / vLLM: input-of-layer already
        elif nested is not None:
            kw["aux_layer_ids"] = [i + 1 for i in nested]    # SGLang / SpecForge: output-of-layer ids
        return kw

    @staticmethod
    def _parse_speculators(d, p):
        smt = d.get("speculators_model_type")
        if smt != "eagle3":
            p.append(f"speculators_model_type {smt!r} is not supported (only 'eagle3')")
            return {}
        tl = d.get("transformer_layer_config")
        if tl is None:
            p.append("missing required key 'transformer_layer_config'")
            return {}
        if not isinstance(tl, Mapping):
            p.append(f"'transformer_layer_config' must be an object, got {tl!r}")
            return {}
        kw = _read_layer_settings(tl, p, prefix="transformer_layer_config.")
        # speculators builds its layer from the transformer_layer_config's model type, Qwen3 when unnamed
        mt = tl.get("model_type", "qwen3")
        if mt not in ("llama", "qwen3"):
            p.append(f"transformer_layer_config.model_type {mt!r} is not supported (llama or qwen3)")
        kw["qk_norm"] = mt == "qwen3"
        kw["draft_vocab_size"] = _get_int(d, "draft_vocab_size", p, required=True)
        kw["target_hidden_size"] = _get_int(d, "target_hidden_size", p)
        kw["norm_before_residual"] = _get_bool(d, "norm_before_residual", p)
        kw["norm_before_fc"] = _get_bool(d, "norm_before_fc", p)
        kw["fc_norm"] = _get_bool(d, "fc_norm", p)
        kw["norm_output"] = True
        kw["norm_hidden_out"] = _get_bool(d, "norm_output", p)  # speculators' "feed back post-norm"
        kw["aux_layer_ids"] = _read_ids(d.get("eagle_aux_hidden_state_layer_ids"),
                                        "eagle_aux_hidden_state_layer_ids", p)
        return kw

    def to_dict(self) -> dict:
        """A flat SafeAILab-style ``config.json`` dict (what :meth:`from_dict` reads back to an equal
        config).  Switches are written only when they differ from the flat format's defaults, so that
        engines that read the same keys with another meaning are not misled (see the module docstring)."""
        rs = None
        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            rs["type"] = rs["rope_type"]  # SafeAILab reads rope_scaling["type"]
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": rs,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
        }
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.aux_layer_ids is not None:
            d["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        for name in ("fc_norm", "norm_before_fc", "norm_before_residual", "norm_hidden_out", "qk_norm"):
            if getattr(self, name):
                d[name] = True
        if not self.norm_output:
            d["norm_output"] = False
        return d

    def tap_layers(self, num_target_layers: int) -> list[int]:
        """The input-of-layer ids of the three taps for a target with ``num_target_layers`` layers:
        ``aux_layer_ids`` if set (each must be in [0, L)), else ``[2, L//2, L-3]`` (needs L >= 7)."""
        L = int(num_target_layers)
        if self.aux_layer_ids is None:
            return default_tap_layers(L)
        bad = [i for i in self.aux_layer_ids if not 0 <= i < L]
        if bad:
            raise ValueError(f"draft tap layers {self.aux_layer_ids} (input-of-layer ids) must lie in [0, {L}) "
                             f"for a target with {L} layers; out of range: {bad}")
        return list(self.aux_layer_ids)


# ------------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------------

def rope_inv_freq(config: Eagle3Config, seq_len: int | None = None, device=None) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], float32, for ``config``'s rope_theta / rope_scaling.

    * default: ``1 / theta ** (2i / hd)``;
    * ``linear``: divided by ``factor`` (the same as dividing the positions by it);
    * ``dynamic`` (NTK): when ``seq_len`` > max_position_embeddings the base becomes
      ``theta * (factor * seq_len / max_pos - (factor - 1)) ** (hd / (hd - 2))``, else unchanged;
    * ``llama3``: wavelengths above ``original_max / low_freq_factor`` are divided by ``factor``, those
      below ``original_max / high_freq_factor`` are kept, and the band between is interpolated.
    """
    dim = config.head_dim
    base = config.rope_theta
    rs = config.rope_scaling or {}
    rtype = rs.get("rope_type", "default")
    mpe = config.max_position_embeddings
    if rtype == "dynamic" and seq_len is not None and seq_len > mpe:
        f = rs["factor"]
        base = base * ((f * seq_len / mpe) - (f - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    inv = 1.0 / (base ** exponents)
    if rtype == "linear":
        inv = inv / rs["factor"]
    elif rtype == "llama3":
        f, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        long_wave = wavelen > old / lo          # low frequencies: fully scaled
        short_wave = wavelen < old / hi         # high frequencies: untouched
        scaled = torch.where(long_wave, inv / f, inv)
        if hi != lo:
            s = (old / wavelen - lo) / (hi - lo)
            blend = (1 - s) * scaled / f + s * scaled
            scaled = torch.where(~long_wave & ~short_wave, blend, scaled)
        inv = scaled
    return inv


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


# ------------------------------------------------------------------------------------------------------
# modules
# ------------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in float32, cast back to the input dtype, then scaled."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c.rms_norm_eps)
            self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        eps = c.rms_norm_eps
        self.hidden_norm = RMSNorm(c.hidden_size, eps)
        self.input_layernorm = RMSNorm(c.hidden_size, eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps)
        self.mlp = _MLP(c)


_OPTIONAL_KEYS = ("embed_tokens.weight", "d2t", "t2d")


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft: ``fc`` (+ optional ``fc_norm`` / ``input_norm``), one ``midlayer``, ``norm``,
    ``lm_head`` over the draft vocabulary, the frozen target embedding ``embed_tokens``, and the vocabulary
    maps ``d2t`` (draft id -> target id offset, int64 [Vd]) and ``t2d`` (target id in the draft
    vocabulary, bool [V]).

    ``embed_tokens`` (a [V, H] tensor, optional) initialises the embedding; its storage is shared, not
    copied.  Without it the embedding is randomly initialised (tests, training from scratch).  The
    default ``d2t`` is zeros (identity) with ``t2d`` true on ids < Vd, which are consistent.
    """

    def __init__(self, config: Eagle3Config, embed_tokens: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(config, Eagle3Config):
            raise TypeError(f"Eagle3Draft: config must be an Eagle3Config, got {type(config).__name__}")
        c = self.config = config
        H, T, V, Vd = c.hidden_size, c.target_hidden_size, c.vocab_size, c.draft_vocab_size
        self.fc = nn.Linear(NUM_TAPS * T, H, bias=False)
        self.fc_norm = nn.ModuleList([RMSNorm(T, c.rms_norm_eps) for _ in range(NUM_TAPS)]) if c.fc_norm else None
        self.input_norm = RMSNorm(NUM_TAPS * T, c.rms_norm_eps) if c.norm_before_fc else None
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        if embed_tokens is not None:
            self.embed_tokens = nn.Embedding(V, H, _weight=self._check_embedding(embed_tokens), _freeze=True)
        else:
            self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(V) < Vd)
        self._inv_freq_cache = {}

    # ---- helpers -------------------------------------------------------------------------------------

    def _check_embedding(self, w):
        c = self.config
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"Eagle3Draft: embed_tokens must be a [{c.vocab_size}, {c.hidden_size}] tensor "
                             f"(vocab_size, hidden_size), got {getattr(w, 'shape', type(w).__name__)}")
        return w.detach()

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def _inv_freq(self, device, seq_len):
        rs = self.config.rope_scaling or {}
        if rs.get("rope_type") == "dynamic" and seq_len > self.config.max_position_embeddings:
            return rope_inv_freq(self.config, seq_len=seq_len, device=device)
        key = str(device)
        inv = self._inv_freq_cache.get(key)
        if inv is None:
            inv = self._inv_freq_cache[key] = rope_inv_freq(self.config, device=device)
        return inv

    # ---- the public calls ----------------------------------------------------------------------------

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """[B, S, 3*T_H] target taps (low, mid, high) -> [B, S, H]: ``fc_norm`` / ``input_norm`` if
        configured, then ``fc``.  The taps are cast to the draft's dtype."""
        c = self.config
        if not isinstance(taps, torch.Tensor) or taps.dim() != 3 or taps.shape[-1] != NUM_TAPS * c.target_hidden_size:
            raise ValueError(f"Eagle3Draft.fuse: taps must be [B, S, {NUM_TAPS * c.target_hidden_size}] "
                             f"(3 x target_hidden_size), got {getattr(taps, 'shape', type(taps).__name__)}")
        x = taps.to(self.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(NUM_TAPS, dim=-1))], dim=-1)
        return self.fc(x)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                attn_mask: torch.Tensor | None = None):
        """One draft step over S new rows.

        hidden [B, S, H]: fused taps (:meth:`fuse`) or the draft's own earlier ``h_out`` rows.
        input_ids [B, S]: TARGET-vocabulary ids (map draft ids with :meth:`map_tokens` first).
        position_ids [B, S] int64 (a [1, S] or [S] tensor is broadcast over the batch).
        past_kv: None or (k, v), each [B, nkv, P, hd], as returned by an earlier call (crop by slicing).
        attn_mask: None = causal over past + new (row s sees all P past keys and new keys <= s), or a bool
        tensor [S, P+S] (or [B, S, P+S]), True = may attend, used as is.  A row that may attend to
        nothing gives NaN.

        Returns ``(logits [B, S, Vd] float32, h_out [B, S, H], (k, v) [B, nkv, P+S, hd])``: the logits
        are ``lm_head(norm(h2))`` (``lm_head(h2)`` when ``config.norm_output`` is false), ``h_out`` is
        the state to feed back (``h2``, or ``norm(h2)`` when ``config.norm_hidden_out``), and k carries
        RoPE at its positions.  With dynamic RoPE beyond max_position_embeddings the frequencies depend on
        the largest position of the call (as in HF), so cached keys keep the frequencies they were made
        with.
        """
        c = self.config
        H, nkv, hd = c.hidden_size, c.num_key_value_heads, c.head_dim
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[-1] != H:
            hint = (" (target taps must go through fuse() first)"
                    if isinstance(hidden, torch.Tensor) and hidden.shape[-1] == NUM_TAPS * c.target_hidden_size
                    else "")
            raise ValueError(f"Eagle3Draft.forward: hidden must be [B, S, {H}], got "
                             f"{getattr(hidden, 'shape', type(hidden).__name__)}{hint}")
        B, S = hidden.shape[0], hidden.shape[1]
        if not isinstance(input_ids, torch.Tensor) or tuple(input_ids.shape) != (B, S):
            raise ValueError(f"Eagle3Draft.forward: input_ids must be [{B}, {S}], got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        if not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != S or position_ids.dim() > 2 \
                or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, B)):
            raise ValueError(f"Eagle3Draft.forward: position_ids must be [{B}, {S}], got "
                             f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
        if S == 0:
            raise ValueError("Eagle3Draft.forward: no rows (S = 0)")
        position_ids = position_ids.reshape(-1, S).expand(B, S)
        P = 0
        if past_kv is not None:
            if not isinstance(past_kv, (tuple, list)) or len(past_kv) != 2:
                raise ValueError("Eagle3Draft.forward: past_kv must be None or a (k, v) pair")
            pk, pv = past_kv
            if pk.dim() != 4 or tuple(pk.shape[:2]) != (B, nkv) or pk.shape[3] != hd or pk.shape != pv.shape:
                raise ValueError(f"Eagle3Draft.forward: past_kv tensors must both be [{B}, {nkv}, P, {hd}], got "
                                 f"{tuple(pk.shape)} and {tuple(pv.shape)}")
            P = pk.shape[2]
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool \
                    or attn_mask.shape[-2:] != (S, P + S) \
                    or attn_mask.dim() not in (2, 3) or (attn_mask.dim() == 3 and attn_mask.shape[0] != B):
                raise ValueError(f"Eagle3Draft.forward: attn_mask must be a bool tensor [{S}, {P + S}] "
                                 f"(or [{B}, {S}, {P + S}]), got {attn_mask.dtype} {tuple(attn_mask.shape)}")
            mask = attn_mask if attn_mask.dim() == 2 else attn_mask.unsqueeze(1)
            mask = mask.to(hidden.device)
        elif S > 1:
            mask = torch.ones(S, P + S, dtype=torch.bool, device=hidden.device).tril(diagonal=P)
        else:
            mask = None  # one new row sees everything

        q, k, v, h, hn = self._project(hidden, input_ids, position_ids)
        if P:
            k = torch.cat((past_kv[0].to(k.dtype), k), dim=2)
            v = torch.cat((past_kv[1].to(v.dtype), v), dim=2)
        logits, h_out = self.head(self._attend(q, k, v, mask, h, hn))
        return logits, h_out, (k, v)

    def _project(self, hidden, input_ids, position_ids):
        """The new rows' queries, keys (RoPE at their positions) and values [B, heads, S, hd], with the
        residual input h and its norm hn."""
        c = self.config
        B, S = hidden.shape[0], hidden.shape[1]
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        position_ids = position_ids.reshape(-1, S).expand(B, S)
        m = self.midlayer
        dtype = self.dtype
        h = hidden.to(dtype)
        e = self.embed_tokens(input_ids.to(self.embed_tokens.weight.device)).to(dtype)
        hn = m.hidden_norm(h)
        a = torch.cat((m.input_layernorm(e), hn), dim=-1)        # embedding first, hidden second

        att = m.self_attn
        q = att.q_proj(a).view(B, S, nh, hd)
        k = att.k_proj(a).view(B, S, nkv, hd)
        v = att.v_proj(a).view(B, S, nkv, hd).transpose(1, 2)
        if att.q_norm is not None:
            q, k = att.q_norm(q), att.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)

        # dynamic RoPE depends on the largest position: a host read (only for rope_type "dynamic")
        seq_len = int(position_ids.max()) + 1 if (c.rope_scaling or {}).get("rope_type") == "dynamic" else 0
        inv = self._inv_freq(q.device, seq_len)
        freqs = position_ids.to(q.device, torch.float32).unsqueeze(-1) * inv      # [B, S, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v, h, hn

    def _attend(self, q, k, v, mask, h, hn):
        """Attention of q over all keys k / values v [B, nkv, P+S, hd] under ``mask``, then the MLP: the
        layer output h2 [B, S, H]."""
        c = self.config
        B, S = q.shape[0], q.shape[2]
        m = self.midlayer
        rep = c.num_attention_heads // c.num_key_value_heads
        kr = k if rep == 1 else k.repeat_interleave(rep, dim=1)
        vr = v if rep == 1 else v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        o = m.self_attn.o_proj(o.transpose(1, 2).reshape(B, S, c.num_attention_heads * c.head_dim))
        h1 = (hn if c.norm_before_residual else h) + o
        return h1 + m.mlp(m.post_attention_layernorm(h1))

    def head(self, h2):
        """Layer output h2 [..., H] -> (logits [..., Vd] float32, h_out [..., H]): ``lm_head(norm(h2))``
        (``lm_head(h2)`` when ``config.norm_output`` is false) and the state to feed back (``h2``, or
        ``norm(h2)`` when ``config.norm_hidden_out``)."""
        c = self.config
        normed = self.norm(h2)
        logits = self.lm_head(normed if c.norm_output else h2).float()
        return logits, (normed if c.norm_hidden_out else h2)

    def new_cache(self, capacity, batch=1):
        """A static key/value cache for :meth:`step`: one [2, batch, nkv, capacity, hd] tensor in the draft's
        dtype on its device."""
        c = self.config
        return torch.zeros((2, batch, c.num_key_value_heads, capacity, c.head_dim), dtype=self.dtype,
                           device=self.device)

    def step(self, hidden, input_ids, position_ids, cache, slots, attn_mask):
        """One draft step on a static cache (the engine's path; no shape depends on the sequence length).

        hidden [B, S, H], input_ids [B, S] (target ids), position_ids [B, S] as in :meth:`forward`;
        ``cache`` from :meth:`new_cache`; this step's keys and values are written at cache columns
        ``slots`` [S] (int64, on the device); ``attn_mask`` bool [S, C] or [B, S, C] over all C cache columns
        (True = may attend; the rows' own columns included).  Returns the layer output h2 [B, S, H]: pass the
        rows you need through :meth:`head`."""
        q, k, v, h, hn = self._project(hidden, input_ids, position_ids)
        cache[0].index_copy_(2, slots, k.to(cache.dtype))
        cache[1].index_copy_(2, slots, v.to(cache.dtype))
        mask = attn_mask if attn_mask.dim() == 2 else attn_mask.unsqueeze(1)
        return self._attend(q, cache[0], cache[1], mask, h, hn)

    def map_tokens(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids: ``ids + d2t[ids]`` (int64, on ``d2t``'s device)."""
        ids = torch.as_tensor(draft_ids, device=self.d2t.device).long()
        return ids + self.d2t[ids]

    # ---- loading -------------------------------------------------------------------------------------

    @classmethod
    def _empty(cls, config, dtype, device):
        """The module with uninitialised storage (no random init of V x H tables)."""
        with torch.device("meta"):
            model = cls(config)
            # a placeholder, so that to_empty does not allocate a V x H table that is replaced anyway
            model.embed_tokens.weight = nn.Parameter(torch.empty(0, config.hidden_size), requires_grad=False)
        model = model.to(dtype)
        model.to_empty(device=device)
        model._inv_freq_cache = {}
        return model

    @classmethod
    def from_pretrained(cls, path, target=None, *, dtype: torch.dtype | None = None, device=None) -> "Eagle3Draft":
        """Load a draft checkpoint directory strictly.

        Reads ``config.json`` and the weights (layouts and name normalisation: see the module docstring).
        Every problem -- missing / unexpected / wrongly shaped / duplicate (after renaming) keys, a
        missing ``d2t`` while Vd != V, a ``d2t`` mapping outside the target vocabulary, a ``t2d`` that
        disagrees with ``d2t``, and with ``target`` (a HF causal LM) vocabulary / hidden-size / tap-layer
        mismatches -- is collected and raised as ONE ValueError.  Unreadable or corrupt files raise a
        ValueError naming the file; a missing directory, config or weight file raises FileNotFoundError.

        The embedding: the checkpoint's ``embed_tokens.weight`` if present, else
        ``target.get_input_embeddings().weight`` (shared, not copied, when dtype and device already match;
        impossible when target_hidden_size != hidden_size).  With no embedding anywhere this is an error.

        When Vd == V the vocabulary maps are the identity whatever the checkpoint holds (as SafeAILab's
        ``EaModel`` does: it deletes them); a non-identity ``d2t`` there is ignored with a warning.  When
        ``t2d`` is absent it is derived from ``d2t``.

        dtype: None = the target embedding's dtype when a target is given, else the checkpoint's (that of
        ``fc.weight``).  device: None = the target
        embedding's device when a target is given, else CPU.
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"Eagle3Draft.from_pretrained: {path} is not a directory")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"Eagle3Draft.from_pretrained: {config_file} does not exist")
        config = Eagle3Config.from_dict(_read_json(config_file))
        raw, problems = _read_weights(path)
        sd = _canonical_names(raw, problems)
        c = config
        V, Vd, H, T = c.vocab_size, c.draft_vocab_size, c.hidden_size, c.target_hidden_size

        target_embedding, target_flagged = None, False
        if target is not None:
            before = len(problems)
            target_embedding = _check_target(c, target, problems)
            target_flagged = len(problems) > before

        # expected names and shapes, from the module itself
        expected = {k: tuple(t.shape) for k, t in cls._meta_state(c).items()}
        required = set(expected) - set(_OPTIONAL_KEYS)
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
        if Vd == V:
            d2t = torch.zeros(Vd, dtype=torch.int64)
            t2d = torch.ones(V, dtype=torch.bool)
            got = sd.get("d2t")
            if got is not None and tuple(got[0].shape) == (Vd,) and bool(torch.any(got[0] != 0)):
                warnings.warn("Eagle3Draft.from_pretrained: draft_vocab_size == vocab_size, so the checkpoint's "
                              "non-identity d2t is ignored (identity map, as SafeAILab's EaModel does)",
                              stacklevel=2)
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

        if problems:
            raise ValueError(f"cannot load the EAGLE-3 draft from {path}:\n" + "\n".join(f"  - {p}" for p in problems))

        if dtype is None:  # the draft runs next to its target: take the target's dtype, as its device below
            dtype = target_embedding.dtype if target_embedding is not None else sd["fc.weight"][0].dtype
        if device is None:
            device = target_embedding.device if target_embedding is not None else torch.device("cpu")
        device = torch.device(device)
        model = cls._empty(c, dtype, device)
        values = {k: t for k, (t, _) in sd.items() if k in expected and k not in _OPTIONAL_KEYS}
        values["d2t"], values["t2d"] = d2t, t2d
        with torch.no_grad():
            own = dict(model.named_parameters())
            own.update(dict(model.named_buffers()))
            own.pop("embed_tokens.weight")
            assert set(own) == set(values), (set(own) ^ set(values))
            for k, t in values.items():
                own[k].copy_(t)
            w = embedding.detach()
            if w.dtype != dtype or w.device != device:
                w = w.to(device=device, dtype=dtype)
            model.embed_tokens.weight = nn.Parameter(w, requires_grad=False)
        return model

    @staticmethod
    def _meta_state(config):
        with torch.device("meta"):
            return Eagle3Draft(config).state_dict()

    def save_pretrained(self, path, *, save_embedding: bool = False) -> None:
        """Write ``config.json`` (:meth:`Eagle3Config.to_dict` plus ``torch_dtype``) and
        ``model.safetensors`` in SafeAILab names, ``d2t`` / ``t2d`` included.  ``embed_tokens.weight`` is
        written only when target_hidden_size != hidden_size (the target's embedding cannot stand in for
        it) or ``save_embedding`` is true.  Loading the result gives equal tensors and an equal config."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        c = self.config
        keep_embedding = save_embedding or c.target_hidden_size != c.hidden_size
        tensors = {}
        for k, t in self.state_dict().items():
            if k == "embed_tokens.weight" and not keep_embedding:
                continue
            tensors[k] = t.detach().to("cpu").contiguous().clone()
        cfg = c.to_dict()
        cfg["torch_dtype"] = str(self.dtype).replace("torch.", "")
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


def _load_safetensors(file):
    from safetensors.torch import load_file

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
