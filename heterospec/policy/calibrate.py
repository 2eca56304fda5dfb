"""Calibration: a hardware cost model, the per-bin optimiser and JSON profiles.

* :func:`profile_costs` times, on this machine, one target verification forward as a function of tree
  tokens and context length and one draft level as a function of beam width, and fits
  ``verify(n, ctx) = a + b*n + c*ctx + d*n*ctx`` and ``level(beam) = e + f*beam`` by least squares.
  Replay then predicts tokens per second as new tokens / sum over cycles of
  (verify(nodes, ctx) + (levels + 1) * level(top_k) + ops overhead).
* :func:`optimise_policy` starts from the paper's rule and, bin by bin, picks the extra depth and kept
  node count that maximise the replayed predicted speed over the whole trace; bins interact through the
  cycle boundaries, so it sweeps the bins until no choice changes.
* Profiles are JSON: the policy, the cost model, and the model pair / machine they were made for.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import math
import platform
import time
import warnings

import numpy as np

from ..policy import Policy

PROFILE_VERSION = 1


@dataclasses.dataclass
class CostModel:
    """Seconds per cycle as a function of verified tree tokens, context length, draft levels and beam."""

    verify: tuple = (0.0, 0.0, 0.0, 0.0)   # a, b, c, d of a + b*n + c*ctx + d*n*ctx
    level: tuple = (0.0, 0.0)              # e, f of e + f*beam
    overhead: float = 0.0                  # per-cycle host work (ops, Python)

    def __call__(self, nodes, context, levels, beam):
        a, b, c, d = self.verify
        e, f = self.level
        t = a + b * nodes + c * context + d * nodes * context + self.overhead
        if beam:
            t += (levels + 1) * (e + f * beam)
        return max(t, 1e-9)

    def to_dict(self):
        return {"verify": list(self.verify), "level": list(self.level), "overhead": self.overhead}

    @classmethod
    def from_dict(cls, d):
        return cls(tuple(float(v) for v in d["verify"]), tuple(float(v) for v in d["level"]),
                   float(d.get("overhead", 0.0)))


# ---- a device-synchronised clock ------------------------------------------------------------------------


def synchronize(device):
    """Wait until the work queued on ``device`` has finished: ``torch.cuda.synchronize`` on CUDA,
    ``torch.accelerator.synchronize`` on other accelerators (torch >= 2.6; else the backend module's own
    ``synchronize`` when it has one), nothing on the CPU (whose ops run synchronously) or meta.
    ``device``: a ``torch.device``, a string such as ``"cuda:1"``, or anything with a ``.type``."""
    import torch

    kind = getattr(device, "type", None)
    if kind is None:
        device = torch.device(device)
        kind = device.type
    if kind in ("cpu", "meta"):
        return
    if kind == "cuda":
        torch.cuda.synchronize(device)
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)
        return
    backend = getattr(torch, kind, None)
    if backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize()


class DeviceTimer:
    """Wall-clock seconds of work on ``device``, synchronised at both ends so that a GPU is timed doing
    the work and not only queueing it: the device is synchronised before the start is read (so earlier
    queued work is not counted) and before the stop is read (so the timed work has finished).

    ``with timer: ...`` then ``timer.seconds``, or ``result, seconds = timer(fn, *args, **kwargs)``."""

    def __init__(self, device):
        self.device = device
        self.seconds = None
        self._t0 = None

    def __enter__(self):
        synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            synchronize(self.device)
            self.seconds = time.perf_counter() - self._t0
        return False

    def __call__(self, fn, *args, **kwargs):
        with self:
            result = fn(*args, **kwargs)
        return result, self.seconds


def device_timer(device):
    """A :class:`DeviceTimer` for ``device`` (a torch device, a string, or a module's ``.device``)."""
    return DeviceTimer(device)


def _place(module):
    """(device, floating dtype) of a module: its ``.device`` / ``.dtype`` when it declares them, else its
    first parameter or buffer (the first floating one for the dtype); CPU / the default dtype without any."""
    import torch

    tensors = list(module.parameters()) + list(module.buffers()) if isinstance(module, torch.nn.Module) else []
    device = getattr(module, "device", None)
    if not isinstance(device, torch.device):
        device = tensors[0].device if tensors else torch.device("cpu")
    dtype = getattr(module, "dtype", None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.get_default_dtype())
    return device, dtype


def _median_time(fn, reps, device):
    fn()  # warm-up
    timer = device_timer(device)
    return float(np.median([timer(fn)[1] for _ in range(reps)]))


def _recorded(fn, device):
    """``fn`` recorded in a CUDA graph after an eager warm-up; returns the replay (what the recorded engine
    pays for the same work)."""
    import torch

    from ..engine.graphs import warm_up

    warm_up(device, [fn, fn])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def profile_costs(target, draft=None, *, tree_tokens=(1, 2, 4, 8, 16, 32, 64, 128), contexts=(64, 256),
                  beams=(1, 2, 4, 8, 10), reps=3, graphs=False, cpu_gemm="auto"):
    """Measure this machine and fit a :class:`CostModel` (see the module docstring).  Every input is made
    on the model's own device (the draft's inputs in its dtype too), and every timed region is
    synchronised with the device at both ends (:class:`DeviceTimer`).  ``graphs=True`` (a CUDA model)
    times each verify forward and draft level as a replayed CUDA graph -- the costs of the engine with
    ``cuda_graphs`` -- instead of eager calls.  ``cpu_gemm``: time the linear layers the way the engine runs
    them with the same setting (:mod:`heterospec.models.cpu_gemm`)."""
    from ..models import cpu_gemm as gemm

    with gemm.for_models(cpu_gemm, target, draft):
        return _profile_costs(target, draft, tree_tokens, contexts, beams, reps, graphs)


def _profile_costs(target, draft, tree_tokens, contexts, beams, reps, graphs):
    import torch

    from ..models.target import TargetAdapter

    adapter = TargetAdapter(target, capture_taps=False)
    device, _ = _place(target)
    if graphs and device.type != "cuda":
        raise ValueError(f"profile_costs: argument 'graphs' expected False for a model on {device} (CUDA graphs "
                         f"need a CUDA device), got True")
    timer = device_timer(device)
    vocab = target.config.vocab_size
    allocate = getattr(adapter, "allocate", None)  # a static cache: sized once for the largest prompt + tree
    if allocate is not None:
        allocate(max(contexts) + max(tree_tokens))
    rows = []
    try:
        for ctx in contexts:
            prompt = torch.randint(0, vocab, (1, ctx), device=device)
            for n in tree_tokens:
                tokens = torch.randint(0, vocab, (n,), device=device)
                depths = torch.arange(n, device=device).clamp(max=8)
                mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()

                def forward():
                    return adapter.verify(tokens, depths, mask)

                adapter.prefill(prompt)
                call = _recorded(forward, device) if graphs else forward

                def run():
                    adapter.prefill(prompt)
                    return timer(call)[1]

                run()
                rows.append((n, ctx, float(np.median([run() for _ in range(reps)]))))
    finally:
        adapter.close()
    X = np.array([[1.0, n, c, n * c] for n, c, _ in rows])
    y = np.array([t for _, _, t in rows])
    verify = tuple(float(v) for v in np.linalg.lstsq(X, y, rcond=None)[0])
    level = (0.0, 0.0)
    if draft is not None:
        h = getattr(getattr(draft, "config", None), "hidden_size", None) or draft.hidden_size
        d_device, d_dtype = _place(draft)
        pts = []
        for beam in beams:
            hid = torch.zeros(1, beam, h, dtype=d_dtype, device=d_device)
            ids = torch.zeros(1, beam, dtype=torch.long, device=d_device)
            pos = torch.full((1, beam), 64, dtype=torch.long, device=d_device)
            with torch.no_grad():
                def one_level():
                    return draft(hid, ids, pos)

                call = _recorded(one_level, d_device) if graphs else one_level
                pts.append((beam, _median_time(call, reps, d_device)))
        A = np.array([[1.0, b] for b, _ in pts])
        level = tuple(float(v) for v in np.linalg.lstsq(A, np.array([t for _, t in pts]), rcond=None)[0])
    return CostModel(verify, level, 0.0)


def optimise_policy(trace, cost_model, *, base_depth=None, total_tokens=None, thresholds=(), max_extra=None,
                    keep_grid=None, max_sweeps=4):
    """Per-bin (extra depth, kept nodes) maximising the replayed predicted tokens/s, starting from the
    paper's rule; bins past the paper's three start at (0, total_tokens) and are optimised too."""
    K = trace.top_k
    base = base_depth if base_depth is not None else trace.levels - math.ceil(trace.levels / 3)
    N = total_tokens or 60
    max_extra = trace.levels - base if max_extra is None else min(max_extra, trace.levels - base)
    nbins = len(thresholds) + 1
    paper = Policy.paper(base, K, N, thresholds)
    extra = [paper.extra[b] if b < 3 else 0 for b in range(nbins)]
    extra = [min(e, max_extra) for e in extra]
    keep = [paper.keep[b] if b < 3 else N for b in range(nbins)]
    grid = sorted(set(keep_grid or [max(2, round(N * g)) for g in (0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.2)]) | set(keep))

    def score(ex, kp):
        pol = Policy(base, K, N, tuple(thresholds), tuple(ex), tuple(kp), name="calibrated")
        return trace.replay(pol, cost_model=cost_model).predicted_tokens_per_s or 0.0

    best = score(extra, keep)
    for _ in range(max_sweeps):
        changed = False
        for b in range(nbins):
            for e in range(max_extra + 1):
                for k in grid:
                    ex, kp = list(extra), list(keep)
                    ex[b], kp[b] = e, k
                    s = score(ex, kp)
                    if s > best * (1 + 1e-9):
                        best, extra, keep, changed = s, ex, kp, True
        if not changed:
            break
    return Policy(base, K, N, tuple(thresholds), tuple(extra), tuple(keep), name="calibrated"), best


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
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
        "notes": notes or {},
    }
    with open(path, "w") as f:
        json.dump(d, f, indent=1)


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
    check_profile_pair(d, path, target=target, draft=draft)
    return policy, cost, d
