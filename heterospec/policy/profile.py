"""Profiles: a calibrated :class:`~heterospec.policy.Policy` with the cost model it was fitted with, the model
pair it was fitted for and the machine it was measured on, as JSON.

* :class:`CostModel`: seconds per cycle as a function of verified tree tokens, context length, draft levels
  and beam width (fitted by :func:`heterospec.tune.profile_costs`, used by :meth:`heterospec.tune.Trace.replay`);
* :func:`model_identity` / :func:`head_identity`: a model's stable identity (never a path);
* :func:`save_profile` / :func:`load_profile` / :func:`check_profile_pair`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings

from . import Policy

PROFILE_VERSION = 1


@dataclasses.dataclass
class CostModel:
    """Seconds per cycle as a function of verified tree tokens, context length, draft levels and beam.

    ``verify`` (a, b, c, d): ``a + b*nodes + c*context + d*nodes*context``, or (a, b, c, d, knee, b0) with the
    nodes' term ``b0*min(nodes, knee) + b*max(nodes - knee, 0)``: a step that costs little per node up to the knee
    (rows that ride on the weights' read) and more past it (rows that compute); ``level``: the draft's side of a
    cycle, either (e, f, g, h) = ``levels*(e + f*beam) + g + h*beam`` (levels, and the root expansion, the
    verification tree and the catch-up once per cycle; what :func:`heterospec.tune.profile_costs` fits) or, in
    profiles from before issue 28.4, (e, f) = ``(levels + 1)*(e + f*beam)``; ``overhead``: per-cycle time
    outside those steps (acceptance, commit, the host loop)."""

    verify: tuple = (0.0, 0.0, 0.0, 0.0)
    level: tuple = (0.0, 0.0)
    overhead: float = 0.0

    def __post_init__(self):
        if len(self.verify) not in (4, 6) or len(self.level) not in (2, 4):
            raise ValueError(f"CostModel: expected 4 or 6 verify and 2 or 4 level coefficients, got "
                             f"{len(self.verify)} and {len(self.level)}")

    def verify_cost(self, nodes, context):
        """Seconds of the target's forward over a ``nodes``-token tree after ``context`` committed positions."""
        a, b, c, d = self.verify[:4]
        if len(self.verify) == 6:
            knee, b0 = self.verify[4:]
            node_term = b0 * min(nodes, knee) + b * max(nodes - knee, 0.0)
        else:
            node_term = b * nodes
        return a + node_term + c * context + d * nodes * context

    def draft(self, levels, beam):
        """Seconds of the draft's side of a cycle growing ``levels`` levels of ``beam`` beams (0: no draft)."""
        if not beam:
            return 0.0
        if len(self.level) == 2:
            e, f = self.level
            return (levels + 1) * (e + f * beam)
        e, f, g, h = self.level
        return levels * (e + f * beam) + g + h * beam

    def __call__(self, nodes, context, levels, beam):
        return max(self.verify_cost(nodes, context) + self.overhead + self.draft(levels, beam), 1e-9)

    def to_dict(self):
        return {"verify": list(self.verify), "level": list(self.level), "overhead": self.overhead}

    @classmethod
    def from_dict(cls, d):
        return cls(tuple(float(v) for v in d["verify"]), tuple(float(v) for v in d["level"]),
                   float(d.get("overhead", 0.0)))


# ---- profiles ----------------------------------------------------------------------------------------------


# The fields that fix a model's architecture and vocabulary: a profile's costs and bins hold for any copy of a model
# with the same values, wherever it is installed and whatever transformers adds to its config (not
# `architectures`: transformers 5.0 leaves it unset when converting a GGUF, 5.23 sets it).
_IDENTITY_FIELDS = ("model_type", "vocab_size", "draft_vocab_size", "hidden_size",
                    "target_hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")


def model_identity(config, name):
    """A model's stable identity for a profile: ``{"name", "config_sha256", "vocab_size"[, "draft_vocab_size"]}``.
    ``config``: a transformers config, an EAGLE-3 head's config, or a config dict (a head's config.json);
    ``name``: what a person would call it (a directory's base name, a hub id).  Never a path."""
    d = config if isinstance(config, dict) else (config.to_dict() if hasattr(config, "to_dict") else vars(config))
    core = {k: d[k] for k in _IDENTITY_FIELDS if k in d and d[k] is not None}
    # the RoPE base, wherever this transformers release keeps it (rope_theta, or rope_parameters in 5.x)
    rope = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta")
    if rope is not None:
        core["rope_theta"] = float(rope)
    blob = json.dumps(core, sort_keys=True, default=str).encode()
    ident = {"name": str(name), "config_sha256": hashlib.sha256(blob).hexdigest()}
    for k in ("vocab_size", "draft_vocab_size"):
        if isinstance(d.get(k), int):
            ident[k] = d[k]
    return ident


def head_identity(directory, name=None):
    """model_identity of an EAGLE-3 head directory (its config.json), named by the directory's base name."""
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    return model_identity(cfg, name or os.path.basename(os.path.normpath(str(directory))))


def save_profile(path, policy, cost_model=None, *, target=None, draft=None, notes=None):
    """Write a profile: the policy, the cost model, the model pair (``target`` / ``draft``: model_identity
    dicts) and the machine."""
    for what, ident in (("target", target), ("draft", draft)):
        if ident is not None and not isinstance(ident, dict):
            raise TypeError(f"save_profile: argument '{what}' expected a model_identity dict (never a path), "
                            f"got {type(ident).__name__}")
    d = {
        "version": PROFILE_VERSION,
        "policy": {"depth": policy.depth, "top_k": policy.top_k, "total_tokens": policy.total_tokens,
                   "thresholds": list(policy.thresholds), "extra": list(policy.extra), "keep": list(policy.keep),
                   "name": policy.name},
        "cost_model": cost_model.to_dict() if cost_model is not None else None,
        "model_pair": {"target": target, "draft": draft},
        "machine": _machine(),
        "notes": notes or {},
    }
    with open(path, "w") as f:
        json.dump(d, f, indent=1)


def _machine():
    """The machine fields of a profile: those of :func:`heterospec.measure.machine_info` that describe the
    hardware and the software that timed it."""
    from ..measure import machine_info

    info = machine_info()
    return {k: info[k] for k in ("platform", "processor", "cpu_model", "cpu_isa", "cpus", "torch", "summary") if k in info}


def _same_model(stored, given):
    """Whether a profile's stored model (an identity dict, or a string in profiles from before identities)
    is the given one (an identity dict or a string)."""
    if isinstance(stored, dict) and isinstance(given, dict):
        return stored.get("config_sha256") == given.get("config_sha256")
    name = lambda x: x.get("name") if isinstance(x, dict) else os.path.basename(os.path.normpath(str(x)))  # noqa: E731
    return name(stored) == name(given)


def check_profile_pair(raw, path, *, target=None, draft=None):
    """Warn when the profile ``raw`` (load_profile's third value) was calibrated for another target or draft
    (``target`` / ``draft``: model_identity dicts, or names)."""
    pair = raw.get("model_pair") or {}
    for what, given in (("target", target), ("draft", draft)):
        stored = pair.get(what)
        if given is not None and stored and not _same_model(stored, given):
            show = lambda x: x.get("name") if isinstance(x, dict) else x  # noqa: E731
            warnings.warn(f"load_profile: {str(path)!r} was calibrated for {what} {show(stored)!r}, not "
                          f"{show(given)!r} (its bins and tree shapes may not fit this pair)", stacklevel=3)


def load_profile(path, *, target=None, draft=None):
    """-> (Policy, CostModel or None, raw dict).  Warns when the profile was made for another model pair
    (``target`` / ``draft``: model_identity dicts or names; None skips the check)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"load_profile: could not read {str(path)!r} as JSON: {e}") from None
    if not isinstance(d, dict) or d.get("version") != PROFILE_VERSION:
        raise ValueError(f"load_profile: expected a heterospec profile (version {PROFILE_VERSION}) in {str(path)!r}, "
                         f"got version {d.get('version') if isinstance(d, dict) else type(d).__name__!r}")
    p = d.get("policy")
    missing = [k for k in ("depth", "top_k", "total_tokens", "thresholds", "extra", "keep") if not isinstance(p, dict) or k not in p]
    if missing:
        raise ValueError(f"load_profile: {str(path)!r} lacks policy fields {missing}")
    try:
        policy = Policy(int(p["depth"]), int(p["top_k"]), int(p["total_tokens"]), tuple(p["thresholds"]),
                        tuple(int(v) for v in p["extra"]), tuple(int(v) for v in p["keep"]),
                        name=p.get("name", "calibrated"))
        cost = CostModel.from_dict(d["cost_model"]) if d.get("cost_model") else None
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"load_profile: malformed profile {str(path)!r}: {e}") from None
    bins = len(policy.thresholds) + 1
    if policy.thresholds and len(policy.keep) > bins:
        raise ValueError(f"load_profile: malformed profile {str(path)!r}: policy fields 'extra' and 'keep' expected at "
                         f"most {bins} entries (one per bin of {len(policy.thresholds)} thresholds), got "
                         f"{len(policy.keep)}")
    check_profile_pair(d, path, target=target, draft=draft)
    return policy, cost, d


# a head's shipped profiles by device type: a profile's bins and tree shapes are fitted to its device's cost
# model (on a GPU a 60-node tree costs about what 12 do, on a 2-core CPU five times more), so each device type
# gets its own; a device type without one uses the CPU profile, and says so
PROFILE_FILES = {"cpu": "profile.json", "cuda": "profile-cuda.json"}
# and a CPU whose widest vector unit is AVX2 gets its own where the head ships one: its multiply-adds run at half
# AVX-512's width, so each verified row costs more of a step (about a quarter of the default target's one-row step
# on a 2-core AMD EPYC, a sixth with AVX-512), and the shapes that pay are smaller
CPU_ISA_FILES = {1: ("profile-cpu-avx2.json", "AVX2")}
# where a head has no profile calibrated on a GPU: one calibrated (on a CPU) around EAGLE-3's default tree, 7/10/60,
# whose bins fit a deep tree, before the CPU profile, whose searched base tree may be tiny (depth 1 for the default
# pair on a 2-core CPU, where verifying a token costs nearly what generating one does; a GPU verifies 60 for the
# price of one)
DEEP_BASE_FILE = "profile-eagle3-base.json"


def shipped_profile(device="cpu", head=None):
    """The profile that ships with ``head`` for ``device`` (a torch device or its name): ``(path or None,
    description)``.  A CPU whose widest unit is AVX2 uses ``profile-cpu-avx2.json`` where the head has one, else
    ``profile.json``.  CUDA uses ``profile-cuda.json`` (calibrated on an H100/H200) where the head has one, else
    the profile calibrated around EAGLE-3's 7/10/60 tree (``profile-eagle3-base.json``), else the CPU profile;
    None when the head ships no profile at all."""
    if head is None:
        from ..models.default import DEFAULT_HEAD as head
    kind = str(getattr(device, "type", device) or "cpu").split(":")[0]
    own = os.path.join(head, PROFILE_FILES.get(kind, PROFILE_FILES["cpu"]))
    cpu = os.path.join(head, PROFILE_FILES["cpu"])
    deep = os.path.join(head, DEEP_BASE_FILE)
    if kind == "cpu":
        from ..models.cpu_gemm import kernel_isa

        name, isa = CPU_ISA_FILES.get(kernel_isa(), (None, None))
        if name and os.path.exists(os.path.join(head, name)):
            return os.path.join(head, name), f"the shipped CPU profile for {isa} CPUs ({name})"
    if os.path.exists(own):
        return own, f"the shipped {'GPU' if kind == 'cuda' else 'CPU'} profile ({os.path.basename(own)})"
    if kind == "cuda" and os.path.exists(deep):
        return deep, (f"the shipped profile for EAGLE-3's 7/10/60 tree ({DEEP_BASE_FILE}, calibrated on a CPU; no "
                      f"profile calibrated on a cuda device ships with this head yet)")
    if os.path.exists(cpu):
        return cpu, (f"the shipped CPU profile ({os.path.basename(cpu)}; no profile calibrated on a {kind} device "
                     "ships with this head yet)")
    return None, "no shipped profile for this head (run heterospec calibrate and pass the profile)"


def default_policy(device="cpu", head=None):
    """HeteroSpec's :class:`Policy` for the default pair (or ``head``, a head directory that ships profiles) on
    ``device``: the calibrated profile that ships for that device type (:func:`shipped_profile` says which).
    Raises FileNotFoundError when the head ships none."""
    path, what = shipped_profile(device, head)
    if path is None:
        raise FileNotFoundError(f"{head}: {what}")
    return load_profile(path)[0]
