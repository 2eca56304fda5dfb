"""``heterospec bench``: the paper's evaluation as one command, every method side by side in one run.

One process, one model load.  Each question is answered by every method in turn before the next question
(so drift of the machine during the run touches all methods alike), with the same prompt, settings and
seed.  MT-bench's second turn is asked after the method's own first answer (EAGLE's evaluation does the
same).  Methods:

- ``ar``: autoregressive decoding through the same loop (one verification call per token);
- ``eagle3``: EAGLE-3's static dynamic tree (depth 7, top_k 10, 60 verified nodes);
- ``eagle3-tuned``: the static tree that is fastest on *this* machine, chosen on tuning prompts (never the
  benchmark's) before the run: a trace of the tuning prompts is replayed for a grid of (depth, nodes) with a
  cost model measured here, and the best few by predicted speed are then timed for real -- EAGLE's
  ``total_token=-1`` auto-tune times forwards the same way, but only over the node count;
- ``heterospec-paper``: the paper's fixed rule (alpha = ceil(depth/2), gamma = 0.3/0.6/1.0) on the profile's
  entropy bins;
- ``heterospec``: the calibrated profile (``heterospec calibrate``);
- ``heterospec-tuned``: HeteroSpec calibrated on ``eagle3-tuned``'s base tree, on the same tuning prompts
  and cost model (entropy bins fitted on the trace at that base depth, per-bin extra depth and kept nodes
  optimised) -- HeteroSpec on top of the machine's best static tree rather than EAGLE-3's default one.

and the strongest baselines a HuggingFace user already has, no draft, timed with the same timer on the same
prompts and budget (DESIGN.md §7), through ``model.generate`` with the same EOS ids, ``max_new_tokens``
and temperature semantics (top-k and top-p off, nothing else from the model's generation config):

- ``hf``: greedy (sampling at T > 0) with the default dynamic cache;
- ``hf-static``: ``cache_implementation="static"``; transformers compiles the forward (CUDA graphs) where
  its own criterion says so (on CUDA, not on the CPU), and whether it did is recorded; the warm-up sizes
  the static cache for the longest conversation of the run, so the timed calls reuse one compiled shape;
- ``hf-lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens=10``).

They have no verification calls, tau or time split: those are ``None`` in the JSON and '–' in the tables.

Metrics (DESIGN.md §7): tokens/s = new tokens (up to and including EOS) / decoding wall time (prefill
included, after a warm-up whose time is reported apart; CUDA events on a GPU); speedup = the mean over
questions of (the method's tokens/s / ar's), a question's tokens/s pooling its turns as EAGLE's ``speed.py``
does; speedup over HF = the same ratio against the strongest HuggingFace baseline of the run (of ``hf``,
``hf-static``, ``hf-lookup``, the one with the best mean tokens/s); tau = committed tokens / verification calls (the
bonus token counts); verification calls and verified tokens; per entropy bin the share of cycles and the
mean accepted length; the time split into prefill / drafting / verifying / ops / the rest of the loop.
At temperature 0 every method's tokens are checked against the first method's, and any difference is
reported as a MISMATCH (exit status 1).

Outputs in ``--out``: ``results.json`` (every number, the settings, the machine and versions),
``results.md`` (tables laid out like the paper's Table 1), ``answers.jsonl`` (EAGLE-style answer records)
and PNG plots (``speedup.png``, ``tau_vs_verified.png``, ``bins.png``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter

from ..measure import DeviceTimer, machine_info
from . import ProgressBar
from .prompts import encode_turn, read_prompts

SCHEMA = "heterospec.bench/1"
HF_METHODS = ("hf", "hf-static", "hf-lookup")
METHODS = ("ar", *HF_METHODS, "eagle3", "eagle3-tuned", "heterospec-paper", "heterospec", "heterospec-tuned")
BENCHMARKS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")
LABELS = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "alpaca": "Alpaca",
          "sum": "CNN/DM"}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the tuning prompts of the default pair: the calibration prompts its profile was fitted on (not benchmarks)
DEFAULT_TUNE_PROMPTS = os.path.join(REPO, "benchmarks", "data", "smollm2_calib_prompts.jsonl")
TUNE_DEPTHS = (1, 2, 3, 4, 5, 6, 7, 8)
TUNE_NODES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 60)


# ---- questions ----------------------------------------------------------------------------------------------

def benchmark_files(d):
    """The five benchmark files in directory ``d`` (the paper's order), or [] when one is missing."""
    files = [os.path.normpath(os.path.join(d, n + ".jsonl")) for n in BENCHMARKS]
    return files if all(os.path.isfile(f) for f in files) else []


def default_question_files():
    """The five benchmark files of ../shared/data/benchmarks (next to the working directory or the
    checkout), or [] when neither has them."""
    for root in (os.getcwd(), REPO):
        files = benchmark_files(os.path.join(root, "..", "shared", "data", "benchmarks"))
        if files:
            return files
    return []


def question_paths(args):
    """--questions as files: a directory stands for its five benchmark files (an error if one is missing)."""
    paths = []
    for p in args or []:
        if os.path.isdir(p):
            files = benchmark_files(p)
            if not files:
                raise ValueError(f"argument --questions: expected a question file or a directory holding "
                                 f"{', '.join(n + '.jsonl' for n in BENCHMARKS)}, got the directory {p!r} without them")
            paths += files
        else:
            paths.append(p)
    return paths


def _bench_name(path):
    base = os.path.basename(path)
    stem = base[:-len(".jsonl")] if base.endswith(".jsonl") else os.path.splitext(base)[0]
    if stem == "question":  # EAGLE's layout: data/<bench>/question.jsonl
        stem = os.path.basename(os.path.dirname(os.path.abspath(path))) or stem
    return stem


def load_questions(paths, limit=None):
    """{benchmark name: [{"question_id", "turns"}]} from EAGLE ``question.jsonl`` files, the first
    ``limit`` questions of each."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"load_questions: argument 'limit' expected an int >= 1, got {limit!r}")
    out = {}
    for path in paths:
        name = _bench_name(path)
        if name in out:
            raise ValueError(f"load_questions: argument 'paths' has two files named {name!r}")
        try:
            f = open(path)
        except OSError as e:
            raise ValueError(f"load_questions: cannot read question file {str(path)!r}: {e}") from None
        qs = []
        with f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"load_questions: {path}:{lineno} is not JSON: {e}") from None
                turns = rec.get("turns") if isinstance(rec, dict) else None
                if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
                    raise ValueError(f"load_questions: {path}:{lineno} expected an EAGLE question record with "
                                     f"'turns': a non-empty list of strings, got {line.strip()[:80]!r}")
                qs.append({"question_id": rec.get("question_id", len(qs)), "turns": turns})
                if limit is not None and len(qs) >= limit:
                    break
        if not qs:
            raise ValueError(f"load_questions: no questions in {str(path)!r}")
        out[name] = qs
    return out


# ---- methods ----------------------------------------------------------------------------------------------

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
    drafts = False

    def as_dict(self):
        return {"baseline": "transformers model.generate", "cache_implementation": self.cache_implementation or "dynamic",
                "prompt_lookup_num_tokens": self.prompt_lookup_num_tokens}


HF_BASELINES = {"hf": HFMethod("hf"), "hf-static": HFMethod("hf-static", cache_implementation="static"),
                "hf-lookup": HFMethod("hf-lookup", prompt_lookup_num_tokens=10)}


def build_methods(names, *, draft=None, profile=None, tuned=None, tuned_profile=None):
    """[(name, Policy or HFMethod)] for ``names`` (a subset of :data:`METHODS`, in the given order).
    ``profile``: the calibrated Policy (for ``heterospec``, and the bins of ``heterospec-paper``); ``tuned``:
    the Policy of ``eagle3-tuned``; ``tuned_profile``: that of ``heterospec-tuned``."""
    from ..policy import Policy

    check_method_names(names)
    out = []
    for n in names:
        if n in HF_BASELINES:
            out.append((n, HF_BASELINES[n]))
            continue
        if n != "ar" and draft is None:
            raise ValueError(f"bench: method {n!r} needs a draft head (--draft)")
        if n == "ar":
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
            pol = profile if n == "heterospec" else Policy.paper(profile.depth, profile.top_k, profile.total_tokens,
                                                                 profile.thresholds)
        out.append((n, pol))
    return out


def parse_tree(text):
    """'DEPTH,TOP_K,NODES' -> Policy.static."""
    from ..policy import Policy

    try:
        d, k, n = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"bench: argument '--tuned-tree' expected DEPTH,TOP_K,NODES (three ints), got {text!r}") from None
    return Policy.static(d, k, n)


def tune_static_tree(target, draft, prompt_ids, tr, *, cost_model, depths=TUNE_DEPTHS, nodes=TUNE_NODES,
                     measure=3, timer=None, progress=None, cuda_graphs=False):
    """The fastest static tree on this machine for ``prompt_ids`` (tuning prompts), ``tr`` their recorded
    trace (:func:`heterospec.trace.record`, at least ``max(depths)`` levels): every (depth, nodes) of the
    grid is replayed with ``cost_model``; the ``measure`` best by predicted speed are then decoded for real
    (greedy, ``tr.max_new_tokens`` tokens) and the fastest measured one wins.  Returns (Policy, report)."""
    from ..policy import Policy
    from ..engine.loop import HeteroSpec

    timer = timer or DeviceTimer("cpu")
    top_k = tr.top_k
    if max(depths) > tr.levels:
        raise ValueError(f"tune_static_tree: argument 'depths' goes to {max(depths)}, the trace has {tr.levels} levels")
    grid = []
    for d in depths:
        for n in nodes:
            r = tr.replay(Policy.static(d, top_k, n), cost_model=cost_model)
            grid.append({"depth": d, "top_k": top_k, "nodes": n, "tau": r.tau,
                         "predicted_tokens_per_s": r.tokens_per_s})
    grid.sort(key=lambda g: -(g["predicted_tokens_per_s"] or 0.0))
    measured = []
    for j, g in enumerate(grid[:measure]):
        pol = Policy.static(g["depth"], top_k, g["nodes"])
        new, secs = 0, 0.0
        longest = max(ids.shape[1] for ids in prompt_ids) + tr.max_new_tokens
        with HeteroSpec(target, draft, pol, cuda_graphs=cuda_graphs, max_length=longest) as hs:
            hs.generate(prompt_ids[0], max_new_tokens=8)  # warm-up (and recording, with cuda_graphs)
            for ids in prompt_ids:
                (_, st), dt = timer(lambda: hs.generate(ids, max_new_tokens=tr.max_new_tokens))
                new += st.new_tokens
                secs += dt
        measured.append(dict(g, measured_tokens_per_s=new / secs if secs else 0.0))
        if progress:
            progress("tuning: timing", j + 1, min(measure, len(grid)))
    best = max(measured, key=lambda g: g["measured_tokens_per_s"])
    report = {"prompts": len(prompt_ids), "max_new_tokens": tr.max_new_tokens, "grid": grid, "measured": measured,
              "chosen": {"depth": best["depth"], "top_k": top_k, "nodes": best["nodes"]}}
    return Policy.static(best["depth"], top_k, best["nodes"]), report


def calibrate_on(tr, base, cost_model):
    """HeteroSpec calibrated on the static tree ``base`` with the trace ``tr``: entropy bins fitted at the
    base depth (paper Eq. 2, as ``heterospec calibrate``), per-bin extra depth and kept nodes optimised.
    Returns (Policy, report)."""
    from ..tune.optimise import optimise_policy
    from ..tune.bins import fit_thresholds

    x, y = tr.features(base.depth, base.total_tokens)
    th = tuple(fit_thresholds(x, y, depth=3, min_leaf=max(5, len(x) // 50)))
    # extra depth up to the paper's alpha + 1 (its Table 3 range)
    pol, pred = optimise_policy(tr, cost_model, base_depth=base.depth, total_tokens=base.total_tokens, thresholds=th,
                                max_extra=math.ceil(base.depth / 2) + 1)
    pol = type(pol)(pol.depth, pol.top_k, pol.total_tokens, pol.thresholds, pol.extra, pol.keep, name="heterospec-tuned")
    return pol, {"positions": int(len(x)), "thresholds": list(th), "extra": list(pol.extra), "keep": list(pol.keep),
                 "predicted_tokens_per_s": pred}


# ---- HuggingFace baselines ------------------------------------------------------------------------------------

@dataclasses.dataclass
class BaselineStats:
    """What a ``model.generate`` call tells us: the new tokens (up to and including EOS) and, for
    ``hf-static``'s warm-up, whether transformers compiled the forward (None: not known)."""

    new_tokens: int = 0
    compiled: bool | None = None


def _eos_list(eos_token_id):
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


@contextlib.contextmanager
def _plain_model(model):
    """The model as a user has it during a baseline's call:
    - its generation config swapped for transformers' defaults, so that nothing from the checkpoint's config
      (repetition penalty, min length, its EOS or sampling defaults, ...) changes what the baseline decodes,
      which is what our engine decodes (every setting is passed explicitly);
    - no forward hooks on its modules: the open engines of the other methods capture the draft's hidden
      states with forward pre-hooks on the target's layers, which would cost the baseline time (and break
      the graph transformers compiles on CUDA).
    Both are put back afterwards."""
    import collections

    from transformers import GenerationConfig

    saved = model.generation_config
    stashed = []
    for m in model.modules():
        for attr in _HOOK_DICTS:
            d = getattr(m, attr, None)
            if d:
                stashed.append((m, attr, d))
                setattr(m, attr, collections.OrderedDict())
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved
        for m, attr, d in stashed:
            setattr(m, attr, d)


@contextlib.contextmanager
def _compile_spy(model, seen):
    """Records in ``seen`` each decision of transformers' own auto-compile criterion
    (``_valid_auto_compile_criteria``, transformers 5.x) during the block; records nothing where the
    installed transformers has no such method."""
    orig = getattr(type(model), "_valid_auto_compile_criteria", None)
    if orig is None:
        yield
        return

    def spy(*a, **kw):
        r = orig(model, *a, **kw)
        seen.append(bool(r))
        return r

    model._valid_auto_compile_criteria = spy
    try:
        yield
    finally:
        del model._valid_auto_compile_criteria


class HFGenerate:
    """A :class:`HFMethod` with the call shape of ``HeteroSpec.generate``: ``generate(input_ids,
    max_new_tokens=, temperature=, seed=, eos_token_id=) -> (sequences [1, S + new], BaselineStats)``.
    Greedy at temperature 0, else sampling at that temperature with top-k and top-p off (as the engine's
    defaults), seeded with ``torch.manual_seed(seed)``; stops at ``eos_token_id`` (an int or a list; none:
    no EOS stop) or after ``max_new_tokens`` tokens, EOS included in the count; ``min_new_tokens`` unset."""

    def __init__(self, model, method, *, pad_token_id=0):
        self.model, self.method, self.pad_token_id = model, method, pad_token_id

    def generate(self, input_ids, *, max_new_tokens, temperature=0.0, seed=None, eos_token_id=None,
                 cache_len=None, stop_after=None):
        """``cache_len`` / ``stop_after`` (the warm-up): size the static cache for ``cache_len`` positions
        (transformers keeps the largest size it has seen for later calls) and stop after ``stop_after`` new
        tokens."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        eos = _eos_list(eos_token_id)
        n_prompt = input_ids.shape[1]
        kw = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0, "eos_token_id": eos or None,
              "pad_token_id": self.pad_token_id}
        if temperature > 0:
            kw.update(temperature=float(temperature), top_k=0, top_p=1.0)
        if self.method.cache_implementation:
            kw["cache_implementation"] = self.method.cache_implementation
        if self.method.prompt_lookup_num_tokens:
            kw["prompt_lookup_num_tokens"] = self.method.prompt_lookup_num_tokens
        if cache_len is not None:
            kw["max_new_tokens"] = max(max_new_tokens, cache_len - n_prompt)
        if stop_after is not None:
            class _StopAfter(StoppingCriteria):
                def __call__(self, ids, scores, **_):
                    return torch.full((ids.shape[0],), ids.shape[1] >= n_prompt + stop_after, dtype=torch.bool,
                                      device=ids.device)

            kw["stopping_criteria"] = StoppingCriteriaList([_StopAfter()])
        if seed is not None:
            torch.manual_seed(int(seed))
        seen = []
        with torch.no_grad(), _plain_model(self.model), _compile_spy(self.model, seen):
            seq = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kw)
        new = seq[0, n_prompt:].tolist()
        # the same stop as the engine's, whatever the transformers version does past an EOS or the budget
        # (5.23 already crops prompt-lookup's accepted tokens at both)
        n = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        n = min(n, max_new_tokens if stop_after is None else stop_after)
        return seq[:, :n_prompt + n], BaselineStats(new_tokens=n, compiled=any(seen) if seen else None)

    def close(self):
        pass


def static_cache_len(tokenizer, questions, max_new_tokens, chat=True, max_positions=None):
    """Positions enough for the longest conversation of ``questions`` (every turn's prompt with earlier
    answers of ``max_new_tokens`` tokens, plus a margin for re-tokenising them), capped at
    ``max_positions``: ``hf-static``'s warm-up sizes the static cache with it, so that no timed call
    allocates a new one (on CUDA that is a recompile inside the timing)."""
    longest = 0
    for qs in questions.values():
        for q in qs:
            n = len(q["turns"])
            ids = encode_turn(tokenizer, q["turns"], [""] * (n - 1), chat)
            longest = max(longest, ids.shape[1] + n * (max_new_tokens + 16))
    return min(longest, max_positions) if max_positions else longest


# ---- the run ------------------------------------------------------------------------------------------------

def run_bench(target, tokenizer, draft, methods, questions, *, max_new_tokens=512, temperature=0.0, seed=0,
              device="cpu", warmup_tokens=32, chat=True, eos_token_id=None, progress=None, cuda_graphs=False):
    """Answer every question with every method (questions outer, methods inner).  Returns
    {"temperature", "files": {bench: {method: metrics}}, "mean": {method: metrics}, "mismatches": [...],
    "warmup_s": {method: seconds}, "strongest_hf": name or None, "hf_static": {...} (with hf-static),
    "answers": [records]}.  ``methods``: [(name, Policy or HFMethod)] (:func:`build_methods`).
    ``cuda_graphs``: passed to our engines (sized once for the longest conversation, so each tree shape is
    recorded once, in the warm-up); capture time is kept out of the timings and reported as "capture_s"."""
    from ..engine.loop import HeteroSpec

    timer = DeviceTimer(device)
    total_steps = sum(len(q["turns"]) for qs in questions.values() for q in qs) * len(methods)
    step = 0
    engines = {}
    warmup_s = {}
    compiled = []
    eos = _eos_list(eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    cache_len = None
    engine_len = None
    if cuda_graphs:
        engine_len = static_cache_len(tokenizer, questions, max_new_tokens, chat,
                                      getattr(target.config, "max_position_embeddings", None))
    capture_s = {}
    if any(getattr(m, "cache_implementation", None) == "static" for _, m in methods):
        cache_len = static_cache_len(tokenizer, questions, max_new_tokens, chat,
                                     getattr(target.config, "max_position_embeddings", None))
    try:
        for name, pol in methods:
            if isinstance(pol, HFMethod):
                engines[name] = HFGenerate(target, pol, pad_token_id=pad)
            else:
                engines[name] = HeteroSpec(target, draft if pol.drafts else None, pol, cuda_graphs=cuda_graphs,
                                           max_length=engine_len)
        if warmup_tokens:
            first = next(iter(questions.values()))[0]
            ids = encode_turn(tokenizer, first["turns"], [], chat).to(device)
            for name, pol in methods:
                kw = {}
                if isinstance(pol, HFMethod) and pol.cache_implementation == "static":
                    kw = {"cache_len": cache_len, "stop_after": warmup_tokens}  # compiles (where it does)
                (_, st), warmup_s[name] = timer(lambda: engines[name].generate(
                    ids, max_new_tokens=warmup_tokens, temperature=temperature, seed=seed, **kw))
                capture_s[name] = capture_s.get(name, 0.0) + getattr(st, "capture_s", 0.0)
                if kw and st.compiled is not None:
                    compiled.append(st.compiled)
        per_q = {b: {n: [] for n, _ in methods} for b in questions}  # one record per question
        answers = []
        for b, qs in questions.items():
            for qi, q in enumerate(qs):
                for name, _ in methods:
                    rec = {"question_id": q["question_id"], "turns": [], "ids": [], "new_tokens": [],
                           "wall_time": [], "stats": []}
                    texts = []
                    for t in range(len(q["turns"])):
                        if progress is not None:
                            progress(f"{b} q{qi + 1}/{len(qs)} turn {t + 1} {name}", step, total_steps)
                        ids = encode_turn(tokenizer, q["turns"], texts, chat).to(device)
                        turn_seed = (seed * 1_000_003 + qi * 16 + t) % 2**62
                        (seq, st), dt = timer(lambda: engines[name].generate(
                            ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=turn_seed,
                            eos_token_id=eos_token_id))
                        if getattr(st, "capture_s", 0.0):   # recorded in this call: apart from decoding time
                            dt -= st.capture_s
                            capture_s[name] = capture_s.get(name, 0.0) + st.capture_s
                        new = seq[0, ids.shape[1]:].tolist()
                        texts.append(tokenizer.decode(new, skip_special_tokens=True))
                        rec["ids"].append(new)
                        rec["new_tokens"].append(st.new_tokens)
                        rec["wall_time"].append(dt)
                        rec["stats"].append(st)
                        if name == "hf-static" and getattr(st, "compiled", None) is not None:
                            compiled.append(st.compiled)
                        step += 1
                    rec["turns"] = texts
                    per_q[b][name].append(rec)
                    answers.append({"bench": b, "question_id": q["question_id"], "method": name,
                                    "turns": texts, "new_tokens": rec["new_tokens"], "wall_time": rec["wall_time"]})
        if progress is not None:
            progress("done", total_steps, total_steps)
    finally:
        for hs in engines.values():
            hs.close()
    names = [n for n, _ in methods]
    files = {b: {n: _metrics(per_q[b][n], per_q[b]["ar"] if "ar" in names else None) for n in names}
             for b in questions}
    mean = {n: _mean_row([files[b][n] for b in questions]) for n in names}
    strongest = add_speedup_over_hf(files, mean)
    mism = mismatch_report(per_q, names) if temperature == 0 else []
    out = {"temperature": temperature, "files": files, "mean": mean, "mismatches": mism, "warmup_s": warmup_s,
           "strongest_hf": strongest, "cuda_graphs": cuda_graphs, "capture_s": capture_s}
    if "hf-static" in names:
        out["hf_static"] = {"compiled": any(compiled) if compiled else None, "static_cache_len": cache_len,
                            "warmup_s": warmup_s.get("hf-static"), "device": str(device)}
    out["answers"] = answers
    return out


def _metrics(recs, ar_recs):
    """One method on one benchmark file, from its per-question records.  A HuggingFace baseline (stats
    without verification calls) gets None for tau, the counts and the time split."""
    new = sum(sum(r["new_tokens"]) for r in recs)
    secs = sum(sum(r["wall_time"]) for r in recs)
    stats = [s for r in recs for s in r["stats"]]
    if not all(hasattr(s, "cycles") for s in stats):
        row = _metrics([dict(r, stats=[]) for r in recs], ar_recs)
        row.update(turns=len(stats), tau=None, verification_calls=None, verified_tokens=None,
                   verified_per_new_token=None, time_split_s=None, time_split_share=None,
                   host_ms_per_cycle=None)
        return row
    cycles = sum(s.cycles for s in stats)
    committed = sum(s.committed for s in stats)
    verified = sum(s.verified_tokens for s in stats)
    bins, bin_acc, bin_s = Counter(), Counter(), Counter()
    for s in stats:
        bins.update(s.bins)
        bin_acc.update(s.bin_accepted)
        bin_s.update(s.bin_s)
    split = {k: sum(getattr(s, k + "_s", 0.0) for s in stats) for k in ("prefill", "draft", "verify", "ops", "graph",
                                                                   "idle")}
    total = sum(s.total_s for s in stats)
    split["loop"] = max(0.0, total - sum(split.values()))  # the Python loop, streaming, stopping checks
    # host time per cycle outside the declared sync points (on a GPU: what is left to remove by CUDA graphs)
    host_ms = (1000.0 * sum(s.total_s - s.prefill_s - s.sync_s for s in stats) / cycles) if cycles else None
    def per_question(rs):  # a question's tokens/s pools its turns (EAGLE's speed.py)
        return [sum(r["new_tokens"]) / sum(r["wall_time"]) if sum(r["wall_time"]) else 0.0 for r in rs]

    q_tps = per_question(recs)
    speedup = None
    if ar_recs is not None:
        ar_tps = per_question(ar_recs)
        ratios = [a / b for a, b in zip(q_tps, ar_tps) if b > 0]
        speedup = sum(ratios) / len(ratios) if ratios else None
    return {
        "questions": len(recs), "turns": len(stats), "new_tokens": new, "seconds": secs,
        "tokens_per_s": new / secs if secs else 0.0, "speedup": speedup,
        "tau": committed / cycles if cycles else 0.0, "verification_calls": cycles, "verified_tokens": verified,
        "verified_per_new_token": verified / new if new else 0.0,
        "bins": _bin_summary(bins, bin_acc, bin_s),
        "time_split_s": split, "time_split_share": {k: v / total if total else 0.0 for k, v in split.items()},
        "host_ms_per_cycle": host_ms,
        "per_question_tokens_per_s": q_tps,
    }


def _bin_summary(cycles, accepted, seconds):
    """{"bin": cycles, share, mean_accepted, seconds, tau, tokens_per_s} from per-bin Counters of cycles,
    accepted draft tokens and wall seconds: tau and tokens/s count the committed tokens (accepted + the
    bonus) of the bin's cycles, over those cycles' time (each cycle up to its accepted-tokens sync)."""
    total = sum(cycles.values())
    return {str(k): {"cycles": c, "share": c / total, "mean_accepted": accepted[k] / c, "seconds": seconds[k],
                     "tau": 1 + accepted[k] / c,
                     "tokens_per_s": (accepted[k] + c) / seconds[k] if seconds[k] > 0 else None}
            for k, c in sorted(cycles.items(), key=lambda kc: int(kc[0]))}


def _pooled_bins(per_file):
    """:func:`_bin_summary` pooled over files' ``bins`` dicts (weighted by their cycles)."""
    cyc, acc, sec = Counter(), Counter(), Counter()
    for bins in per_file:
        for k, v in bins.items():
            cyc[k] += v["cycles"]
            acc[k] += v["mean_accepted"] * v["cycles"]
            sec[k] += v.get("seconds") or 0.0
    return _bin_summary(cyc, acc, sec)


def _mean_row(rows):
    """The paper's "Mean" column: the mean of the per-benchmark speedups and taus; totals of the counts
    (None where they do not apply)."""
    def mean(k):
        v = [r[k] for r in rows if r.get(k) is not None]
        return sum(v) / len(v) if v else None

    def total(k):
        return None if any(r[k] is None for r in rows) else sum(r[k] for r in rows)

    return {"speedup": mean("speedup"), "tau": None if any(r["tau"] is None for r in rows) else mean("tau"),
            "tokens_per_s": sum(r["tokens_per_s"] for r in rows) / len(rows),
            "verification_calls": total("verification_calls"), "verified_tokens": total("verified_tokens"),
            "new_tokens": sum(r["new_tokens"] for r in rows)}


def speedup_over(files, name, baseline):
    """Method ``name`` against method ``baseline`` in a run's ``files`` ({bench: {method: metrics}}): per file
    the mean over questions of (name's tokens/s / baseline's), as the speedup over ar.  Returns
    ({bench: ratio or None}, the mean over the files that have one, or None)."""
    per = {}
    for b, rows in files.items():
        ratios = [a / c for a, c in zip(rows[name]["per_question_tokens_per_s"],
                                         rows[baseline]["per_question_tokens_per_s"]) if c > 0]
        per[b] = sum(ratios) / len(ratios) if ratios else None
    vals = [v for v in per.values() if v is not None]
    return per, (sum(vals) / len(vals) if vals else None)


def add_speedup_over_hf(files, mean):
    """The strongest HuggingFace baseline present (of :data:`HF_METHODS`, the best mean tokens/s in
    ``mean``), and every row's ``speedup_over_hf`` set in place (:func:`speedup_over` that baseline): per
    file in ``files``, the mean over files in ``mean``.  With no HF baseline the rows get None and the
    result is None."""
    hf = [n for n in HF_METHODS if n in mean]
    best = max(hf, key=lambda n: mean[n]["tokens_per_s"]) if hf else None
    for n in mean:
        per, avg = speedup_over(files, n, best) if best is not None else ({b: None for b in files}, None)
        for b in files:
            files[b][n]["speedup_over_hf"] = per[b]
        mean[n]["speedup_over_hf"] = avg
    return best


def mismatch_report(per_q, names):
    """[{bench, question_id, turn, method, reference, first_diff}]: every (question, turn) where a method's
    tokens differ from the first method's."""
    bad = []
    ref_name = names[0]
    for b, by_method in per_q.items():
        for name in names[1:]:
            for ref, rec in zip(by_method[ref_name], by_method[name]):
                for t, (a, c) in enumerate(zip(ref["ids"], rec["ids"])):
                    if a != c:
                        pos = next((k for k, (x, y) in enumerate(zip(a, c)) if x != y), min(len(a), len(c)))
                        bad.append({"bench": b, "question_id": rec["question_id"], "turn": t, "method": name,
                                    "reference": ref_name, "first_diff": pos})
    return bad


# ---- reports ------------------------------------------------------------------------------------------------

def _fmt(v, spec, suffix=""):
    return "–" if v is None else format(v, spec) + suffix


def markdown(result):
    """Markdown tables laid out like the paper's Table 1, one pair per temperature."""
    lines = []
    s = result["settings"]
    lines.append(f"Target {result['models']['target']}, draft {result['models']['draft']}; {s['device']} "
                 f"{s['dtype']}, max_new_tokens {s['max_new_tokens']}, up to {s['limit'] or 'all'} questions per file, "
                 f"seed {s['seed']}; {result['machine']['summary']}.")
    lines.append("")
    for run in result["runs"]:
        benches = list(run["files"])
        names = list(run["mean"])
        cols = [LABELS.get(b, b) for b in benches] + ["Mean"]
        hf = run.get("strongest_hf")
        if hf:
            lines.append(f"**Temperature {run['temperature']:g}: speedup over ar, over {hf} (the strongest HuggingFace "
                         f"baseline in this run, {run['mean'][hf]['tokens_per_s']:.1f} tokens/s mean) and tau**")
            lines.append("")
            lines.append("| Method | " + " | ".join(f"{c} speedup | {c} vs {hf} | {c} τ" for c in cols) + " |")
            lines.append("|---|" + "---:|---:|---:|" * len(cols))
        else:
            lines.append(f"**Temperature {run['temperature']:g}: speedup over ar and tau**")
            lines.append("")
            lines.append("| Method | " + " | ".join(f"{c} speedup | {c} τ" for c in cols) + " |")
            lines.append("|---|" + "---:|---:|" * len(cols))
        for n in names:
            cells = [run["files"][b][n] for b in benches] + [run["mean"][n]]
            lines.append(f"| {n} | " + " | ".join(
                f"{_fmt(c['speedup'], '.2f', 'x')} | " + (f"{_fmt(c.get('speedup_over_hf'), '.2f', 'x')} | " if hf else "")
                + _fmt(c["tau"], ".2f") for c in cells) + " |")
        lines.append("")
        lines.append(f"**Temperature {run['temperature']:g}: verification calls and verified tokens; tokens/s**")
        lines.append("")
        tcols = cols[:-1] + ["Total"]  # counts add up over the files
        lines.append("| Method | " + " | ".join(f"{c} calls | {c} verified" for c in tcols) + " | tokens/s (mean) |")
        lines.append("|---|" + "---:|---:|" * len(cols) + "---:|")
        for n in names:
            cells = [run["files"][b][n] for b in benches] + [run["mean"][n]]
            lines.append(f"| {n} | " + " | ".join(f"{_fmt(c['verification_calls'], 'd')} | {_fmt(c['verified_tokens'], 'd')}"
                                                  for c in cells) + f" | {run['mean'][n]['tokens_per_s']:.1f} |")
        lines.append("")
        lines.append(f"**Temperature {run['temperature']:g}: time split (share of decoding time) and entropy bins**")
        lines.append("")
        lines.append("| Method | Benchmark | prefill | draft | verify | ops | graphs | idle | loop | host ms/cycle | bin shares (mean accepted) |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for n in names:
            for b in benches:
                m = run["files"][b][n]
                sh = m["time_split_share"] or {}
                bins = ", ".join(f"{k}: {v['share']:.2f} ({v['mean_accepted']:.2f})" for k, v in m["bins"].items())
                lines.append(f"| {n} | {LABELS.get(b, b)} | " + " | ".join(
                    _fmt(sh.get(k), ".2f") for k in ("prefill", "draft", "verify", "ops", "graph", "idle", "loop"))
                    + f" | {_fmt(m.get('host_ms_per_cycle'), '.2f')} | {bins or '–'} |")
        lines.append("")
        binned = [n for n in names if any(run["files"][b][n]["bins"] for b in benches)]
        if binned:
            lines.append(f"**Temperature {run['temperature']:g}: per entropy bin, measured (all files pooled)**")
            lines.append("")
            lines.append("| Method | bin | share of cycles | tau | tokens/s in the bin's cycles |")
            lines.append("|---|---:|---:|---:|---:|")
            for n in binned:
                for k, v in _pooled_bins([run["files"][b][n]["bins"] for b in benches]).items():
                    lines.append(f"| {n} | {k} | {v['share']:.3f} | {v['tau']:.2f} | {_fmt(v['tokens_per_s'], '.1f')} |")
            lines.append("")
            lines.append("τ and tokens/s of a bin count the committed tokens (accepted + the bonus) of the cycles in "
                         "that bin, over those cycles' wall time (drafting, verification and the ops up to the "
                         "accepted-tokens sync; the prefill is outside every bin).")
            lines.append("")
        if run.get("cuda_graphs"):
            caps = {n: v for n, v in (run.get("capture_s") or {}).items() if v}
            lines.append(f"Our engines ran recorded steps (cuda_graphs={run['cuda_graphs']!r}): the graphs column is "
                         f"the time in replayed steps (draft, verify and ops inside them), idle the device's idle "
                         f"time between replays; recording took "
                         + (", ".join(f"{n} {v:.2f} s" for n, v in caps.items()) or "no time in this run")
                         + " (untimed in the tables).")
            lines.append("")
        if run.get("warmup_s"):
            lines.append("Warm-up before the timed run (untimed in the tables): " + ", ".join(
                f"{n} {v:.2f} s" for n, v in run["warmup_s"].items()) + ".")
            lines.append("")
        st = run.get("hf_static")
        if st:
            how = {True: "compiled by transformers (its auto-compile criterion held)",
                   False: "not compiled (transformers' auto-compile criterion did not hold: it compiles on CUDA, "
                          "XPU or TPU, not on a CPU; run uncompiled, as a user gets it)",
                   None: "compilation not known (this transformers has no auto-compile criterion to ask)"}[st["compiled"]]
            lines.append(f"hf-static on {st['device']}: static cache of {st['static_cache_len']} positions, {how}"
                         + (f"; its warm-up (compiling, where it compiles) took {st['warmup_s']:.2f} s." if
                            st.get("warmup_s") is not None else "; no warm-up (compiling, where it compiles, is timed)."))
            lines.append("")
        if any(n in HF_METHODS for n in names):
            lines.append("HuggingFace baselines (hf, hf-static, hf-lookup) draft nothing: tau, verification calls and the "
                         "time split do not apply (–).")
            lines.append("")
        if run["temperature"] == 0:
            if run["mismatches"]:
                lines.append(f"**MISMATCH: {len(run['mismatches'])} outputs differ from {run['mismatches'][0]['reference']}'s.**")
            else:
                lines.append(f"Identical greedy outputs across {', '.join(names)} on every question and turn.")
            lines.append("")
    if result.get("tuning"):
        c = result["tuning"]["chosen"]
        lines.append(f"eagle3-tuned: depth {c['depth']}, top_k {c['top_k']}, {c['nodes']} nodes "
                     f"({result['tuning'].get('how', '')}).")
        h = result["tuning"].get("heterospec_tuned")
        if h:
            lines.append("")
            lines.append(f"heterospec-tuned: on that base tree, entropy bins {', '.join(f'{t:.3g}' for t in h['thresholds'])}; "
                         f"per-bin extra depth {h['extra']}, kept nodes {h['keep']} (fitted on {h['positions']} "
                         f"positions of the tuning trace).")
    return "\n".join(lines) + "\n"


def plots(result, out_dir):
    """speedup.png, tau_vs_verified.png and bins.png for the first run (temperature) of ``result``;
    returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for run in result["runs"]:
        suffix = "" if run is result["runs"][0] else f"_t{run['temperature']:g}"
        benches, names = list(run["files"]), list(run["mean"])
        labels = [LABELS.get(b, b) for b in benches] + ["Mean"]
        # 1. speedup by benchmark and method
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(labels), 3.6))
        w = 0.8 / len(names)
        for j, n in enumerate(names):
            vals = [run["files"][b][n]["speedup"] or 0.0 for b in benches] + [run["mean"][n]["speedup"] or 0.0]
            ax.bar([i + (j - (len(names) - 1) / 2) * w for i in range(len(labels))], vals, w, label=n)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel("speedup over ar")
        ax.set_title(f"speedup, temperature {run['temperature']:g}")
        ax.legend(fontsize=7, ncol=min(len(names), 5), loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
        paths.append(_save(fig, os.path.join(out_dir, f"speedup{suffix}.png")))
        # 2. tau against verified tokens (per benchmark, one marker per method)
        fig, ax = plt.subplots(figsize=(5.2, 3.8))
        for n in names:
            if any(run["files"][b][n]["tau"] is None for b in benches):
                continue  # the HuggingFace baselines verify nothing
            xs = [run["files"][b][n]["verified_per_new_token"] for b in benches]
            ys = [run["files"][b][n]["tau"] for b in benches]
            ax.plot(xs, ys, "o", label=n)
            for x, y, b in zip(xs, ys, benches):
                ax.annotate(LABELS.get(b, b), (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax.set_xlabel("verified tokens per generated token")
        ax.set_ylabel("tau (tokens per verification call)")
        ax.set_title(f"acceptance vs verification cost, temperature {run['temperature']:g}")
        ax.legend(fontsize=7)
        paths.append(_save(fig, os.path.join(out_dir, f"tau_vs_verified{suffix}.png")))
        # 3. entropy-bin distribution per benchmark (methods with bins)
        binned = [n for n in names if any(run["files"][b][n]["bins"] for b in benches)]
        fig, axes = plt.subplots(1, max(1, len(binned)), figsize=(1.2 + 3.2 * max(1, len(binned)), 3.6), squeeze=False)
        for ax, n in zip(axes[0], binned or [None]):
            if n is None:
                ax.text(0.5, 0.5, "no method with entropy bins", ha="center", va="center")
                ax.set_axis_off()
                continue
            allbins = sorted({int(k) for b in benches for k in run["files"][b][n]["bins"]})
            bottom = [0.0] * len(benches)
            for k in allbins:
                v = [run["files"][b][n]["bins"].get(str(k), {}).get("share", 0.0) for b in benches]
                ax.bar(range(len(benches)), v, bottom=bottom, label=f"bin {k}")
                bottom = [a + c for a, c in zip(bottom, v)]
            ax.set_xticks(range(len(benches)), [LABELS.get(b, b) for b in benches], fontsize=7)
            ax.set_ylabel("share of cycles")
            ax.set_title(n)
            ax.legend(fontsize=6)
        paths.append(_save(fig, os.path.join(out_dir, f"bins{suffix}.png")))
    return paths


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_outputs(result, answers, out_dir, make_plots=True):
    """results.json, results.md, answers.jsonl (and the plots) in ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.md"),
             os.path.join(out_dir, "answers.jsonl")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(result))
    with open(paths[2], "w") as f:
        for a in answers:
            f.write(json.dumps(a) + "\n")
    if make_plots:
        paths += plots(result, out_dir)
    return paths


# ---- the command ------------------------------------------------------------------------------------------

def _bar(desc="", redraws=10):
    """A :class:`ProgressBar` with the runner's and the tuning's ``progress(what, i, n)`` call shape: ``what``
    after the rate, or as the description with ``desc`` empty."""
    bar = ProgressBar(desc, redraws=redraws)
    return lambda what, i, n: bar(i, n, **({"postfix": what} if desc else {"desc": what}))


def report(path, out=None):
    """``heterospec bench --report results.json``: write results.md and the plots again next to a saved
    results.json (e.g. after changing the plots), without running anything."""
    out = out or sys.stdout
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"heterospec bench: --report expected a results.json, could not read {path!r}: {e}") from None
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        raise SystemExit(f"heterospec bench: --report expected a {SCHEMA} results.json, got schema "
                         f"{result.get('schema') if isinstance(result, dict) else type(result).__name__!r}")
    d = os.path.dirname(os.path.abspath(path))
    with open(os.path.join(d, "results.md"), "w") as f:
        f.write(markdown(result))
    written = [os.path.join(d, "results.md")] + plots(result, d)
    print(markdown(result), file=out)
    print(f"wrote {', '.join(written)}", file=out)
    return 0


def main(args, out=None):
    """The ``heterospec bench`` command; returns the exit status (1 on a temperature-0 mismatch)."""
    import torch

    out = out or sys.stdout
    if args.report:
        return report(args.report, out)
    from ..policy.profile import load_profile
    from ..models.default import DEFAULT_HEAD, DEFAULT_PROFILE, load_pair

    t_start = time.perf_counter()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"heterospec bench: --device {args.device} but torch sees no CUDA device")
    for t in args.temperature:
        if not (math.isfinite(t) and t >= 0):
            raise SystemExit(f"heterospec bench: --temperature expected values >= 0, got {t}")
    if args.max_new_tokens < 1:
        raise SystemExit(f"heterospec bench: --max-new-tokens expected an int >= 1, got {args.max_new_tokens}")
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        check_method_names(names)
    except ValueError as e:  # a usage error: one line, exit status 2 (as argparse's)
        print(f"heterospec {e}", file=sys.stderr)  # e: "bench: argument 'methods' ..."
        raise SystemExit(2) from None
    try:
        paths = question_paths(args.questions) or default_question_files()
    except ValueError as e:
        print(f"heterospec bench: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if not paths:
        raise SystemExit("heterospec bench: no question files: ../shared/data/benchmarks is not here; pass "
                         "--questions PATH [PATH ...] (EAGLE question.jsonl format)")
    try:
        questions = load_questions(paths, args.limit)
    except ValueError as e:
        raise SystemExit(f"heterospec bench: {e}") from None
    if args.draft is None and args.target == "default":
        args.draft = DEFAULT_HEAD
    if args.draft is None and any(n != "ar" and n not in HF_METHODS for n in names):
        raise SystemExit("heterospec bench: --draft PATH is required for methods other than ar and the hf baselines")
    profile_path = args.profile or (DEFAULT_PROFILE if args.draft in (DEFAULT_HEAD, "default") else None)
    profile = load_profile(profile_path)[0] if profile_path else None
    # the cheap checks before the models load
    try:
        if args.tuned_tree:
            parse_tree(args.tuned_tree)
    except ValueError as e:
        raise SystemExit(f"heterospec bench: {e}") from None
    if profile is None and {"heterospec", "heterospec-paper"} & set(names):
        raise SystemExit("heterospec bench: methods heterospec and heterospec-paper need a calibrated profile "
                         "(--profile; heterospec calibrate writes one), or leave them out with --methods")
    graphs = getattr(args, "graphs", False)   # --cuda-graphs, resolved and checked by the CLI
    torch.manual_seed(args.seed)
    tokenizer, target, draft = load_pair(args, args.device)
    timer = DeviceTimer(args.device)
    tuning, tuned, tuned_profile = None, None, None
    if "eagle3-tuned" in names or "heterospec-tuned" in names:
        tuning, tuned, tuned_profile = _tune(args, names, tokenizer, target, draft, timer)
    try:
        methods = build_methods(names, draft=draft, profile=profile, tuned=tuned, tuned_profile=tuned_profile)
    except ValueError as e:
        raise SystemExit(f"heterospec bench: {e}") from None
    nq = {b: len(qs) for b, qs in questions.items()}
    print(f"heterospec bench: {', '.join(names)} on {', '.join(f'{b} ({n})' for b, n in nq.items())}; "
          f"max_new_tokens {args.max_new_tokens}, temperature {', '.join(f'{t:g}' for t in args.temperature)}, "
          f"{args.device} {args.dtype}", file=out, flush=True)
    runs, answers = [], []
    for temp in args.temperature:
        r = run_bench(target, tokenizer, draft, methods, questions, max_new_tokens=args.max_new_tokens,
                      temperature=temp, seed=args.seed, device=args.device, warmup_tokens=args.warmup_tokens,
                      chat=not args.no_chat_template, eos_token_id=tokenizer.eos_token_id,
                      progress=_bar("bench", redraws=20), cuda_graphs=graphs)
        answers += [dict(a, temperature=temp) for a in r.pop("answers")]
        runs.append(r)
    policies = {n: p.as_dict() if isinstance(p, HFMethod) else
                {"depth": p.depth, "top_k": p.top_k, "total_tokens": p.total_tokens, "thresholds": list(p.thresholds),
                 "extra": list(p.extra), "keep": list(p.keep)}
                for n, p in methods}
    result = {
        "schema": SCHEMA,
        "command": "heterospec bench " + " ".join(getattr(args, "argv", []) or []),
        "settings": {"methods": names, "questions": {b: os.path.abspath(p) for b, p in zip(questions, paths)},
                     "limit": args.limit, "max_new_tokens": args.max_new_tokens, "temperatures": args.temperature,
                     "seed": args.seed, "device": args.device, "dtype": args.dtype, "cuda_graphs": graphs,
                     "warmup_tokens": args.warmup_tokens, "chat_template": not args.no_chat_template,
                     "eos_token_id": tokenizer.eos_token_id},
        "models": {"target": "SmolLM2-135M-Instruct" if args.target == "default" else str(args.target),
                   "draft": str(args.draft), "profile": profile_path},
        "methods": policies, "tuning": tuning, "machine": machine_info(args.device), "runs": runs,
        "seconds": time.perf_counter() - t_start,
    }
    written = write_outputs(result, answers, args.out, make_plots=not args.no_plots)
    print(markdown(result), file=out)
    status = 0
    for run in runs:
        for m in run["mismatches"]:
            status = 1
            print(f"MISMATCH at temperature 0: {m['method']} differs from {m['reference']} on {m['bench']} question "
                  f"{m['question_id']} turn {m['turn'] + 1} at new token {m['first_diff']}", file=out)
    print(f"wrote {', '.join(written)} (total {result['seconds']:.0f} s)", file=out)
    return status


def _tune(args, names, tokenizer, target, draft, timer):
    """eagle3-tuned's tree (searched, or --tuned-tree) and heterospec-tuned's calibration on it, both on the
    tuning prompts.  Returns (report, tuned Policy, heterospec-tuned Policy or None)."""
    from ..tune.costs import profile_costs
    from ..tune.trace import record

    given = parse_tree(args.tuned_tree) if args.tuned_tree else None
    tuning = {"how": "given with --tuned-tree"} if given else {}
    if given is not None and "heterospec-tuned" not in names:
        return dict(tuning, chosen={"depth": given.depth, "top_k": given.top_k, "nodes": given.total_tokens}), given, None
    tp = args.tune_prompts or (DEFAULT_TUNE_PROMPTS if os.path.exists(DEFAULT_TUNE_PROMPTS) else None)
    if tp is None:
        raise SystemExit("heterospec bench: eagle3-tuned and heterospec-tuned need --tune-prompts PATH (prompts that "
                         "are not benchmark questions), or, for eagle3-tuned alone, --tuned-tree DEPTH,TOP_K,NODES")
    if draft is None:
        raise SystemExit("heterospec bench: tuning needs a draft head (--draft)")
    t0 = time.perf_counter()
    texts = read_prompts([tp], args.tune_limit)
    ids = [encode_turn(tokenizer, [t], [], not args.no_chat_template).to(args.device) for t in texts]
    bar = _bar()
    deepest = given.depth if given else max(TUNE_DEPTHS)
    tr = record(target, draft, ids, max_new_tokens=args.tune_max_new_tokens, top_k=given.top_k if given else 10,
                levels=deepest + math.ceil(deepest / 2) + 1, progress=lambda i, n: bar("tuning: trace", i, n))
    graphs = getattr(args, "graphs", False)
    cost = profile_costs(target, draft, reps=2, graphs=graphs)   # what the engine that is timed pays
    if given is None:
        tuned, tuning = tune_static_tree(target, draft, ids, tr, cost_model=cost, timer=timer, progress=bar,
                                         cuda_graphs=graphs)
        tuning["how"] = (f"replayed {len(TUNE_DEPTHS) * len(TUNE_NODES)} static trees on a trace of {len(ids)} tuning "
                         f"prompts from {os.path.basename(tp)} with a cost model measured here"
                         f"{' on captured forwards' if graphs else ''}, then timed the best 3")
    else:
        tuned = given
        tuning["chosen"] = {"depth": given.depth, "top_k": given.top_k, "nodes": given.total_tokens}
    hs_tuned = None
    if "heterospec-tuned" in names:
        hs_tuned, tuning["heterospec_tuned"] = calibrate_on(tr, tuned, cost)
    tuning.update(prompts_file=tp, cost_model=cost.to_dict(), seconds=time.perf_counter() - t0)
    return tuning, tuned, hs_tuned


def add_arguments(p):
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or an HF model directory")
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--draft", default=None, help="EAGLE-3 head directory (default with --target default: the shipped head)")
    p.add_argument("--profile", default=None, help="calibrated profile for heterospec / heterospec-paper "
                                                   "(default: the shipped head's)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--questions", nargs="+", default=None,
                   help="EAGLE question.jsonl files, or a directory of the five benchmark files (default: "
                        "the five of ../shared/data/benchmarks)")
    p.add_argument("--limit", type=int, default=None, help="questions per file")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one run per value, e.g. 0 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="our engines' steps recorded once per tree shape and replayed as CUDA graphs "
                        "(auto: on with a CUDA --device)")
    p.add_argument("--warmup-tokens", type=int, default=32, help="untimed tokens per method before the run")
    p.add_argument("--tune-prompts", default=None, help="prompts for eagle3-tuned and heterospec-tuned (never benchmark "
                                                        "questions; default: the calibration prompts in a checkout)")
    p.add_argument("--tune-limit", type=int, default=8)
    p.add_argument("--tune-max-new-tokens", type=int, default=64)
    p.add_argument("--tuned-tree", default=None, help="DEPTH,TOP_K,NODES for eagle3-tuned instead of tuning")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--out", default="bench-out", help="output directory")
    p.add_argument("--report", default=None, metavar="RESULTS_JSON",
                   help="only write results.md and the plots again from a saved results.json")
