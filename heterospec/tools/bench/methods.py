"""The methods ``heterospec bench`` compares, by name: :data:`METHODS`, :func:`build_methods`.

Our engine (one loop, :class:`heterospec.HeteroSpec`), a :class:`~heterospec.policy.Policy` each:

- ``ar``: autoregressive decoding through the same loop (one verification call per token);
- ``eagle3``: EAGLE-3's static dynamic tree (depth 7, top_k 10, 60 verified nodes);
- ``eagle3-tuned``: the static tree that is fastest on *this* machine, chosen on tuning prompts (never the
  benchmark's) before the run (:func:`heterospec.tools.bench.tuning.tune_static_tree`): a trace of the tuning
  prompts is replayed for a grid of (depth, nodes) with a cost model measured here, and the best few by
  predicted speed are then timed for real -- EAGLE's ``total_token=-1`` auto-tune times forwards the same
  way, but only over the node count;
- ``heterospec-paper``: the paper's fixed rule (alpha = ceil(depth/2), gamma = 0.3/0.6/1.0) on the profile's
  entropy bins;
- ``heterospec``: the calibrated profile (``heterospec calibrate``);
- ``heterospec-tuned``: HeteroSpec calibrated on ``eagle3-tuned``'s base tree, on the same tuning prompts
  and cost model (:func:`heterospec.tools.bench.tuning.calibrate_on`: entropy bins fitted on the trace at
  that base depth, per-bin extra depth and kept nodes optimised) -- HeteroSpec on top of the machine's best
  static tree rather than EAGLE-3's default one;
- ``lookup``: prompt lookup in our cycle, no draft (:data:`LOOKUP`; ``hf-lookup``'s method on our engine);
- ``heterospec-lookup``: ``heterospec`` with the prompt-lookup chain grafted onto its trees (:data:`LOOKUP`).

and the strongest baselines a HuggingFace user already has, no draft (:data:`HF_BASELINES`, an
:class:`HFMethod` each, run by :mod:`.baselines`):

- ``hf``: greedy (sampling at T > 0) with the default dynamic cache;
- ``hf-static``: ``cache_implementation="static"`` (transformers compiles its forward where its own criterion
  says so: on CUDA, not on a CPU);
- ``hf-compiled``: the same static cache, compiled on every device (transformers' ``CompileConfig`` with its
  ``_compile_all_devices`` flag, which transformers keeps for compiling on a CPU).  On CUDA it is ``hf-static``
  under another name; on a CPU it is the fastest ``generate`` a HuggingFace user can get, and its compilation
  takes minutes (211 s for the default pair on a 2-core CPU), so it is not among the defaults
  (:data:`DEFAULT_METHODS`): ask for it with ``--methods``;
- ``hf-lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens=10``).
"""
from __future__ import annotations

import dataclasses

from ...policy import Policy

HF_METHODS = ("hf", "hf-static", "hf-compiled", "hf-lookup")
METHODS = ("ar", *HF_METHODS, "eagle3", "eagle3-tuned", "heterospec-paper", "heterospec", "heterospec-tuned", "lookup",
           "heterospec-lookup")
# our engine's prompt lookup per method: HeteroSpec's (prompt_lookup_num_tokens, max_matching_ngram_size,
# min_matching_ngram_size) -- see engine_options.  Chosen on a 2-core CPU (benchmarks/results/lookup-cpu): chains of
# 4 from matches of 2-3 tokens; HuggingFace's 10 from matches of 1-2 tokens verified rows that were mostly rejected
# (0.80x our ar there, against 1.20x)
LOOKUP = {"lookup": (4, 3, 2), "heterospec-lookup": (4, 3, 2)}
# bench's default --methods: every method but hf-compiled (minutes of compilation; the same as hf-static on CUDA) and
# the prompt-lookup methods of our engine (ask for them with --methods)
DEFAULT_METHODS = tuple(n for n in METHODS if n not in ("hf-compiled", *LOOKUP))


def engine_options(name):
    """The HeteroSpec constructor's options of our method ``name`` beyond its Policy: its prompt lookup."""
    if name not in LOOKUP:
        return {}
    n, hi, lo = LOOKUP[name]
    return {"prompt_lookup_num_tokens": n, "max_matching_ngram_size": hi, "min_matching_ngram_size": lo}


def check_method_names(names):
    bad = [n for n in names if n not in METHODS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"bench: argument 'methods' expected distinct names from {', '.join(METHODS)}, got "
                         f"{', '.join(names) if names else 'none'}")


@dataclasses.dataclass(frozen=True)
class HFMethod:
    """A HuggingFace ``model.generate`` baseline (no draft): its cache and prompt-lookup setting."""

    name: str
    cache_implementation: str | None = None  # None: transformers' default dynamic cache
    prompt_lookup_num_tokens: int | None = None
    compile_all_devices: bool = False  # compile the static cache's forward on a CPU too (transformers' CompileConfig)
    drafts = False

    def as_dict(self):
        return {"baseline": "transformers model.generate", "cache_implementation": self.cache_implementation or "dynamic",
                "prompt_lookup_num_tokens": self.prompt_lookup_num_tokens,
                "compile": "on every device" if self.compile_all_devices else "transformers' criterion"}


def static_hf(method):
    """Whether ``method`` (a Policy or an HFMethod) is an HF baseline on a static cache (hf-static, hf-compiled):
    its warm-up sizes the cache for the timed calls, and transformers may compile it."""
    return isinstance(method, HFMethod) and method.cache_implementation == "static"


HF_BASELINES = {"hf": HFMethod("hf"), "hf-static": HFMethod("hf-static", cache_implementation="static"),
                "hf-compiled": HFMethod("hf-compiled", cache_implementation="static", compile_all_devices=True),
                "hf-lookup": HFMethod("hf-lookup", prompt_lookup_num_tokens=10)}


def other_arithmetic(pair, dtype, decoder):
    """Whether a greedy difference between the methods named in ``pair`` is one of arithmetic, not a failure:
    a half-precision model (``dtype`` bfloat16 or float16) that our engines compute in float32 on our CPU decoder
    (``decoder``: their ``HeteroSpec.cpu_decoder``, not None or 'off'; its output is the model's float32 copy's)
    against one of transformers' own ``generate`` baselines (:data:`HF_BASELINES`), which rounds as the half
    dtype does.  Every other difference at temperature 0 is a failure (the demo's and bench's one rule)."""
    half = str(dtype).removeprefix("torch.") in ("bfloat16", "float16")
    return half and decoder not in (None, "off") and any(n in HF_BASELINES for n in pair)


def split_mismatches(mismatches, dtype, decoders):
    """(failures, notes) of a run's greedy ``mismatches`` ([{"method", "reference", ...}]): notes are the
    differences :func:`other_arithmetic` calls arithmetic.  ``decoders``: our engines' ``cpu_decoder`` values."""
    decoder = next((d for d in decoders if d not in (None, "off")), "off")
    notes = [m for m in mismatches if other_arithmetic((m["method"], m["reference"]), dtype, decoder)]
    return [m for m in mismatches if m not in notes], notes


def arithmetic_note(dtype):
    """Why a difference :func:`other_arithmetic` names is no failure, in words (the demo and bench print it)."""
    dtype = str(dtype).removeprefix("torch.")
    return (f"transformers' generate rounds in {dtype}; our engines compute the {dtype} weights in float32 "
            f"(ar equals transformers' float32 generate of them)")


def build_methods(names, *, draft=None, profile=None, tuned=None, tuned_profile=None):
    """[(name, Policy or HFMethod)] for ``names`` (a subset of :data:`METHODS`, in the given order).
    ``profile``: the calibrated Policy (for ``heterospec``, and the bins of ``heterospec-paper``); ``tuned``:
    the Policy of ``eagle3-tuned``; ``tuned_profile``: that of ``heterospec-tuned``."""
    check_method_names(names)
    out = []
    for n in names:
        if n in HF_BASELINES:
            out.append((n, HF_BASELINES[n]))
            continue
        if n not in ("ar", "lookup") and draft is None:
            raise ValueError(f"bench: method {n!r} needs a draft head (--draft)")
        if n in ("ar", "lookup"):
            pol = Policy.autoregressive()
        elif n == "eagle3":
            pol = Policy.static(7, 10, 60)
        elif n == "eagle3-tuned":
            if tuned is None:
                raise ValueError("bench: method 'eagle3-tuned' needs a tuned tree (tuning prompts or --tuned-tree)")
            pol = tuned
        elif n == "heterospec-tuned":
            if tuned_profile is None:
                raise ValueError("bench: method 'heterospec-tuned' needs tuning prompts (--tune-prompts)")
            pol = tuned_profile
        else:
            if profile is None:
                raise ValueError(f"bench: method {n!r} needs a calibrated profile (--profile; heterospec calibrate "
                                 f"writes one)")
            pol = profile if n in ("heterospec", "heterospec-lookup") else Policy.paper(
                profile.depth, profile.top_k, profile.total_tokens, profile.thresholds)
        out.append((n, pol))
    return out


def parse_tree(text):
    """'DEPTH,TOP_K,NODES' -> Policy.static."""
    try:
        d, k, n = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"bench: argument '--tuned-tree' expected DEPTH,TOP_K,NODES (three ints), got {text!r}") from None
    return Policy.static(d, k, n)


def method_dict(method, name=None):
    """results.json's ``methods`` entry of a method of :func:`build_methods`: an HFMethod's settings, or the
    Policy's tree, entropy bins and per-bin plans (and the prompt lookup of our method ``name``)."""
    if isinstance(method, HFMethod):
        return method.as_dict()
    return {"depth": method.depth, "top_k": method.top_k, "total_tokens": method.total_tokens,
            "thresholds": list(method.thresholds), "extra": list(method.extra), "keep": list(method.keep),
            **engine_options(name)}
