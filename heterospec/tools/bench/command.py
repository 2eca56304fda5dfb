"""The ``heterospec bench`` command: :func:`add_arguments` (its flags) and :func:`main` (checks the
arguments, loads the pair once, tunes ``eagle3-tuned`` / ``heterospec-tuned`` where asked, runs every
temperature with :func:`.runner.run_bench` and writes the outputs with :mod:`.report`)."""
from __future__ import annotations

import math
import os
import sys
import time

from ...measure import DeviceTimer, load_warning, machine_info
from .. import CPU_DECODER_HELP, GGUF_HELP, ProgressBar
from ..prompts import encode_turn, read_prompts
from .methods import (DEFAULT_METHODS, HF_METHODS, METHODS, arithmetic_note, build_methods, check_method_names,
                      method_dict, parse_tree)
from .questions import REPO, default_question_files, load_questions, question_paths
from .report import SCHEMA, markdown, report, write_outputs
from .batched import batch_markdown, batch_plot, batch_prompts, parse_batch_sizes, run_batch_bench
from .runner import run_bench
from .tuning import TUNE_DEPTHS, TUNE_NODES, calibrate_on, tune_static_tree

# the tuning prompts of the default pair: the calibration prompts its profile was fitted on (not benchmarks)
DEFAULT_TUNE_PROMPTS = os.path.join(REPO, "benchmarks", "data", "smollm2_calib_prompts.jsonl")


def _bar(desc="", redraws=10):
    """A :class:`ProgressBar` with the runner's and the tuning's ``progress(what, i, n)`` call shape: ``what``
    after the rate, or as the description with ``desc`` empty."""
    bar = ProgressBar(desc, redraws=redraws)
    return lambda what, i, n: bar(i, n, **({"postfix": what} if desc else {"desc": what}))


def main(args, out=None):
    """The ``heterospec bench`` command; returns the exit status (1 on a temperature-0 mismatch)."""
    import torch

    out = out or sys.stdout
    if args.report:
        return report(args.report, out)
    from ...models.default import DEFAULT_HEAD, load_pair
    from ...policy.profile import load_profile, shipped_profile

    t_start = time.perf_counter()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"heterospec bench: --device {args.device} but torch sees no CUDA device")
    from ...ops import MIN_TEMPERATURE, is_decoding_temperature

    for t in args.temperature:
        if not is_decoding_temperature(t):
            raise SystemExit(f"heterospec bench: --temperature expected values 0 (greedy) or >= {MIN_TEMPERATURE:g}, "
                             f"got {t}")
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
        print("heterospec bench: error: argument --questions: expected question files, got none: this is not a "
              "checkout (its benchmarks/data/questions holds the five EAGLE files) and ../shared/data/benchmarks is "
              "not here; pass --questions PATH [PATH ...] (EAGLE question.jsonl format)", file=sys.stderr)
        raise SystemExit(2)
    try:
        questions = load_questions(paths, args.limit)
    except (ValueError, OSError) as e:   # an unreadable or malformed --questions file: a usage error
        print(f"heterospec bench: error: argument --questions: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.draft is None and args.target == "default":
        args.draft = DEFAULT_HEAD
    if args.draft is None and any(n not in ("ar", "lookup") and n not in HF_METHODS for n in names):
        raise SystemExit("heterospec bench: --draft PATH is required for methods other than ar, lookup and the hf "
                         "baselines")
    profile_path, profile_what = ((args.profile, f"--profile {args.profile}") if args.profile else
                                  shipped_profile(args.device) if args.draft in (DEFAULT_HEAD, "default") else
                                  (None, "no profile"))
    profile = load_profile(profile_path)[0] if profile_path else None
    if profile is not None and {"heterospec", "heterospec-paper", "heterospec-lookup"} & set(names):
        print(f"heterospec bench: heterospec's profile: {profile_what}", file=out, flush=True)
    # the cheap checks before the models load
    try:
        if args.tuned_tree:
            parse_tree(args.tuned_tree)
    except ValueError as e:
        raise SystemExit(f"heterospec bench: {e}") from None
    if profile is None and {"heterospec", "heterospec-paper", "heterospec-lookup"} & set(names):
        raise SystemExit("heterospec bench: methods heterospec, heterospec-paper and heterospec-lookup need a "
                         "calibrated profile (--profile; heterospec calibrate writes one), or leave them out with "
                         "--methods")
    graphs = getattr(args, "graphs", False)   # --cuda-graphs, resolved and checked by the CLI
    sizes = None
    if getattr(args, "batch_size", None):
        try:
            sizes = parse_batch_sizes(args.batch_size)
        except ValueError as e:
            print(f"heterospec {e}", file=sys.stderr)
            raise SystemExit(2) from None
        tuned_names = {"eagle3-tuned", "heterospec-tuned", "hf-lookup"} & set(names)
        if tuned_names:
            print(f"heterospec bench: argument '--batch-size' expected methods from ar, hf, hf-static, hf-compiled, eagle3, "
                  f"heterospec-paper, heterospec, got {', '.join(sorted(tuned_names))}", file=sys.stderr)
            raise SystemExit(2)
    torch.manual_seed(args.seed)
    tokenizer, target, draft = load_pair(args, args.device)
    if sizes is not None:
        return _batched(args, names, sizes, questions, tokenizer, target, draft, profile,
                        (profile_path, profile_what), out, t_start)
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
                      progress=_bar("bench", redraws=20), cuda_graphs=graphs, cpu_decoder=getattr(args, "decoder", "auto"))
        answers += [dict(a, temperature=temp) for a in r.pop("answers")]
        runs.append(r)
    policies = {n: method_dict(p, n) for n, p in methods}
    result = {
        "schema": SCHEMA,
        "command": "heterospec bench " + " ".join(getattr(args, "argv", []) or []),
        "settings": {"methods": names, "questions": {b: os.path.abspath(p) for b, p in zip(questions, paths)},
                     "limit": args.limit, "max_new_tokens": args.max_new_tokens, "temperatures": args.temperature,
                     "seed": args.seed, "device": args.device, "dtype": args.dtype, "cuda_graphs": graphs,
                     "cpu_decoder": getattr(args, "cpu_decoder", "auto"),
                     "warmup_tokens": args.warmup_tokens, "chat_template": not args.no_chat_template,
                     "eos_token_id": tokenizer.eos_token_id},
        "models": {"target": "SmolLM2-135M-Instruct" if args.target == "default" else str(args.target),
                   "draft": str(args.draft), "profile": profile_path, "profile_what": profile_what},
        "methods": policies, "tuning": tuning, "machine": machine_info(args.device), "runs": runs,
        "seconds": time.perf_counter() - t_start,
    }
    written = write_outputs(result, answers, args.out, make_plots=not args.no_plots)
    print(markdown(result), file=out)
    status = 0
    for run in runs:
        for m in run.get("other_arithmetic", []):
            print(f"note: {m['method']} differs from {m['reference']} on {m['bench']} question {m['question_id']} "
                  f"turn {m['turn'] + 1} at new token {m['first_diff']}: {arithmetic_note(args.dtype)}", file=out)
        for m in run["mismatches"]:
            status = 1
            print(f"MISMATCH at temperature 0: {m['method']} differs from {m['reference']} on {m['bench']} question "
                  f"{m['question_id']} turn {m['turn'] + 1} at new token {m['first_diff']}", file=out)
    print(f"wrote {', '.join(written)} (total {result['seconds']:.0f} s)", file=out)
    busy = load_warning()
    if busy:
        print(busy, file=out)
    return status


def _batched(args, names, sizes, questions, tokenizer, target, draft, profile, profile_src, out, t_start):
    """``--batch-size``: throughput against batch size (:mod:`.batched`), greedy; writes batch.json, batch.md and
    batch.png under --out.  ``profile_src``: (the profile's path, what it is).  Returns 1 when a greedy output
    differs from ar's."""
    profile_path, profile_what = profile_src
    import json

    try:
        methods = build_methods(names, draft=draft, profile=profile)
    except ValueError as e:
        raise SystemExit(f"heterospec bench: {e}") from None
    prompts = batch_prompts(tokenizer, questions, not args.no_chat_template, max(sizes))
    print(f"heterospec bench: {', '.join(names)} at batch sizes {', '.join(map(str, sizes))} on {len(prompts)} "
          f"prompts (first turns); max_new_tokens {args.max_new_tokens}, greedy, {args.device} {args.dtype}",
          file=out, flush=True)
    r = run_batch_bench(target, tokenizer, draft, methods, prompts, sizes, max_new_tokens=args.max_new_tokens,
                        device=args.device, eos_token_id=tokenizer.eos_token_id,
                        warmup_tokens=min(args.warmup_tokens, 16), progress=_bar("bench", redraws=20),
                        cuda_graphs=getattr(args, "graphs", False), cpu_decoder=getattr(args, "decoder", "auto"))
    r.update(command="heterospec bench " + " ".join(getattr(args, "argv", []) or []),
             machine=machine_info(args.device), dtype=args.dtype, methods={n: method_dict(p, n) for n, p in methods},
             profile=profile_path, profile_what=profile_what, seconds=time.perf_counter() - t_start)
    os.makedirs(args.out, exist_ok=True)
    header = (f"{r['machine'].get('summary', args.device)}; {args.dtype}, greedy, {args.max_new_tokens} new tokens "
              f"per request, {len(prompts)} prompts")
    md = batch_markdown(r, header)
    paths = [os.path.join(args.out, "batch.json"), os.path.join(args.out, "batch.md")]
    with open(paths[0], "w") as f:
        json.dump(r, f, indent=1, default=str)
    with open(paths[1], "w") as f:
        f.write(md + "\n")
    if not args.no_plots:
        paths.append(batch_plot(r, os.path.join(args.out, "batch.png")))
    print(md, file=out)
    for x in r["other_arithmetic"]:
        print(f"note: {x['method']} differs from ar at batch size {x['batch_size']} on prompt {x['prompt']} at new "
              f"token {x['first_diff']}: {arithmetic_note(args.dtype)}", file=out)
    for x in r["mismatches"]:
        print(f"MISMATCH at temperature 0: {x['method']} differs from ar at batch size {x['batch_size']} on prompt "
              f"{x['prompt']} at new token {x['first_diff']}", file=out)
    print(f"wrote {', '.join(paths)} (total {time.perf_counter() - t_start:.0f} s)", file=out)
    busy = load_warning()
    if busy:
        print(busy, file=out)
    return 1 if r["mismatches"] else 0


def _tune(args, names, tokenizer, target, draft, timer):
    """eagle3-tuned's tree (searched, or --tuned-tree) and heterospec-tuned's calibration on it, both on the
    tuning prompts.  Returns (report, tuned Policy, heterospec-tuned Policy or None)."""
    from ...tune.costs import profile_costs
    from ...tune.trace import record

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
                levels=deepest + math.ceil(deepest / 2) + 1, progress=lambda i, n: bar("tuning: trace", i, n),
                cpu_decoder=getattr(args, "decoder", "auto"))
    graphs = getattr(args, "graphs", False)
    # what the timed engine pays
    cost = profile_costs(target, draft, reps=2, graphs=graphs, cpu_decoder=getattr(args, "decoder", "auto"),
                         report=lambda line: print(f"heterospec bench: tuning: {line}", file=sys.stderr, flush=True))
    if given is None:
        tuned, tuning = tune_static_tree(target, draft, ids, tr, cost_model=cost, timer=timer, progress=bar,
                                         cuda_graphs=graphs, cpu_decoder=getattr(args, "decoder", "auto"))
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
    p.add_argument("--gguf-file", default=None, help=GGUF_HELP)
    p.add_argument("--draft", default=None, help="EAGLE-3 head directory (default with --target default: the shipped head)")
    p.add_argument("--profile", default=None, help="calibrated profile for heterospec / heterospec-paper "
                                                   "(default: the shipped head's)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(METHODS)} (default: all but hf-compiled, whose "
                        f"compilation takes minutes on a CPU and which is hf-static on CUDA, and our prompt-lookup "
                        f"methods lookup and heterospec-lookup)")
    p.add_argument("--questions", nargs="+", default=None,
                   help="EAGLE question.jsonl files, or a directory of the five benchmark files (default: "
                        "the checkout's benchmarks/data/questions, else ../shared/data/benchmarks)")
    p.add_argument("--limit", type=int, default=None, help="questions per file")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one run per value, e.g. 0 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="our engines' steps recorded once per tree shape and replayed as CUDA graphs "
                        "(auto: on with a CUDA --device)")
    p.add_argument("--cpu-decoder", default="auto", choices=["auto", "on", "off"], help=CPU_DECODER_HELP)
    p.add_argument("--warmup-tokens", type=int, default=32, help="untimed tokens per method before the run")
    p.add_argument("--tune-prompts", default=None, help="prompts for eagle3-tuned and heterospec-tuned (never benchmark "
                                                        "questions; default: the calibration prompts in a checkout)")
    p.add_argument("--tune-limit", type=int, default=8)
    p.add_argument("--batch-size", default=None, metavar="N[,N...]",
                   help="throughput against batch size instead of the per-question run: e.g. 1,4,16 (greedy; the "
                        "first turn of every question, repeated to the largest size; batch.json/.md/.png)")
    p.add_argument("--tune-max-new-tokens", type=int, default=64)
    p.add_argument("--tuned-tree", default=None, help="DEPTH,TOP_K,NODES for eagle3-tuned instead of tuning")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--out", default="bench-out", help="output directory")
    p.add_argument("--report", default=None, metavar="RESULTS_JSON",
                   help="only write results.md and the plots again from a saved results.json")
