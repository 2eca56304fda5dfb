"""The EAGLE-3 draft's config: :class:`Eagle3Config`, parsed from the ``config.json`` of each checkpoint
format (flat SafeAILab / SpecForge / HF style, or ``speculators``), the RoPE settings (:func:`read_rope`) and
the default tap layers (:func:`default_tap_layers`).

Plain Python, no torch: the draft module (``module.py``), its checkpoint I/O (``checkpoint.py``), the target
adapter (``heterospec/models/target.py``, for the default taps) and training (``heterospec/models/train.py``,
for :func:`read_rope`) all build on it.

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
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

ROPE_TYPES = ("linear", "dynamic", "llama3")
NUM_TAPS = 3
# The three default taps [2, L//2, L-3] are distinct and ascending only from L = 7 on.
MIN_TARGET_LAYERS_FOR_DEFAULT_TAPS = 7


def default_tap_layers(num_layers: int, *, strict: bool = True) -> list[int]:
    """EAGLE-3's default taps in the input-of-layer convention: ``[2, L//2, L-3]`` (the residual stream
    entering those target layers, as SafeAILab's reference, vLLM and SGLang pick them).  A draft config's
    explicit ``aux_layer_ids`` take precedence (:meth:`Eagle3Config.tap_layers`).

    Raises ValueError when L < 7: below that the three taps are not distinct and ascending
    (L=6 gives [2, 3, 3], L=4 gives [2, 2, 1]), so a draft needs explicit ``aux_layer_ids``.
    ``strict=False`` returns the formula's ids for any L (repeated, descending, or for L < 3 outside
    [0, L)): the target adapter's fallback when no EAGLE-3 config chooses the taps (no draft, or a draft
    that does not read them as EAGLE-3's); the adapter range-checks what it gets.
    """
    L = int(num_layers)
    if strict and L < MIN_TARGET_LAYERS_FOR_DEFAULT_TAPS:
        raise ValueError(
            f"the default EAGLE-3 taps [2, L//2, L-3] need a target with at least "
            f"{MIN_TARGET_LAYERS_FOR_DEFAULT_TAPS} layers to be distinct and ascending, got L={L} "
            f"({[2, L // 2, L - 3]}); give the draft explicit eagle_aux_hidden_state_layer_ids")
    return [2, L // 2, L - 3]


MAX_VOCAB = 1 << 24   # vocabulary sizes accepted from a config (the largest in use are about 2**18)


class _Problems(list):
    """Collected config problems, raised together."""

    def raise_if_any(self, what):
        if len(self) == 1:
            raise ValueError(f"{what}: {self[0]}")
        if self:
            raise ValueError(f"{what}:\n" + "\n".join(f"  - {p}" for p in self))


def _get_number(src, key, problems, *, integer, default=None, required=False, prefix=""):
    if key not in src or src[key] is None:
        if required:
            problems.append(f"missing required key '{prefix}{key}'")
        return default
    v = src[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and isinstance(v, float)
                                                                   and not v.is_integer()):
        problems.append(f"'{prefix}{key}' must be {'an integer' if integer else 'a number'}, got {v!r}")
        return default
    if integer and not -(1 << 31) <= v < 1 << 31:   # no size or id of a draft head comes near: a hostile file
        problems.append(f"'{prefix}{key}' must be an integer below 2**31 in size, got {v!r}")
        return default
    return int(v) if integer else float(v)


_get_int = functools.partial(_get_number, integer=True)
_get_float = functools.partial(_get_number, integer=False)


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
            elif name.endswith("vocab_size") and v > MAX_VOCAB:
                # the vocabulary buffers (t2d [vocab_size]) are allocated from the config alone, before any weight
                # says otherwise: no tokenizer comes near this, so a larger value is a broken or hostile file
                p.append(f"{name} must be at most {MAX_VOCAB}, got {v!r}")
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

