"""The bodies of ``heterospec generate``, ``calibrate`` and ``train-draft`` (``demo`` is :mod:`.demo`, ``bench``
:mod:`.bench`); :mod:`.cli` parses and dispatches, :mod:`.checks` checks the arguments first."""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time

from ..models.default import DEFAULT_HEAD, load_pair
from . import ProgressBar
from .checks import pair_identity, resolve_generate, target_name, _records_dir
from .prompts import (SELF, OverlapGuard, encode, encode_many, encode_turn, read_conversations, read_prompts,
                      self_written_prompts)


def processors_for(no_repeat_ngram_size):
    """HuggingFace's processor for ``generate``'s --no-repeat-ngram-size (None: off; --repetition-penalty goes to
    ``HeteroSpec.generate``'s own ``repetition_penalty``)."""
    from transformers import NoRepeatNGramLogitsProcessor

    return [NoRepeatNGramLogitsProcessor(int(no_repeat_ngram_size))] if no_repeat_ngram_size > 0 else None


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
    procs = processors_for(getattr(args, "no_repeat_ngram_size", 0))
    print(f"[{args.method}] {args.policy_what}", file=out)
    lo, hi = getattr(args, "lookup_ngram", (2, 3))
    with HeteroSpec(target, draft if policy.drafts else None, policy, cuda_graphs=graphs,
                    cpu_decoder=getattr(args, "decoder", "auto"),
                    prompt_lookup_num_tokens=getattr(args, "prompt_lookup", 0),
                    max_matching_ngram_size=hi, min_matching_ngram_size=lo) as hs:
        seq, stats = hs.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, min_p=getattr(args, "min_p", 0.0),
                                 eos_token_id=eos, streamer=streamer,
                                 seed=args.seed, logits_processor=procs,
                                 repetition_penalty=getattr(args, "repetition_penalty", 1.0),
                                 stop_strings=getattr(args, "stop", None), tokenizer=tokenizer)
    print(f"\n[{args.method}] {stats.summary()}", file=out)
    return seq, stats


def calibrate_cmd(args, out=None):
    """Record a trace on the prompts, fit the entropy bins, measure this machine, optimise per bin, save
    the profile, print the per-bin table and draw the figure (``--engine vllm``: :func:`calibrate_vllm_cmd`)."""
    out = sys.stdout if out is None else out   # the stdout of the call, not of the import
    if getattr(args, "engine", "heterospec") == "vllm":
        return calibrate_vllm_cmd(args, out)
    import math

    from ..tune.optimise import optimise_policy
    from ..tune.costs import profile_costs
    from ..policy.profile import save_profile
    from ..policy import Policy
    from ..tune.bins import fit_bins
    from ..tune.trace import record

    if not args.draft:
        raise SystemExit("heterospec calibrate: --draft PATH is required")
    texts = read_prompts(args.prompts, args.max_prompts)     # before the models load: an empty file says so at once
    if not texts:
        raise SystemExit("heterospec calibrate: no prompts found in " + ", ".join(args.prompts))
    tokenizer, target, draft = load_pair(args, args.device)
    ids = [encode(tokenizer, t, not args.no_chat_template).to(args.device) for t in texts]
    levels = args.depth + max(1, math.ceil(args.depth / 2))   # the extra levels the bins may grow (1 at depth 0)
    search = getattr(args, "search_base_tree", False)
    if search:  # the trace must hold the deepest tree of the search grid and its extra levels
        from .bench.tuning import TUNE_DEPTHS

        levels = max(levels, max(TUNE_DEPTHS) + math.ceil(max(TUNE_DEPTHS) / 2) + 1)

    bar = ProgressBar("recording traces")
    trace = record(target, draft, ids, max_new_tokens=args.max_new_tokens, top_k=args.top_k_tree, levels=levels,
                   progress=bar, cpu_decoder=getattr(args, "decoder", "auto"))
    bar.close()
    print("measuring this machine's costs (verify, the draft's side, the host's overhead) ...", file=sys.stderr,
          flush=True)
    cost = profile_costs(target, draft, reps=2, graphs=getattr(args, "graphs", False),
                         cpu_decoder=getattr(args, "decoder", "auto"),
                         report=lambda line: print(line, file=out, flush=True))
    searched = None
    if search:
        # the static base tree that is fastest here, as bench's eagle3-tuned finds it: every (depth, nodes) of the
        # grid replayed on the trace with this machine's cost model, the best 3 decoded for real
        from ..measure import DeviceTimer
        from .bench.tuning import tune_static_tree

        base, searched = tune_static_tree(target, draft, ids[: args.search_prompts], trace, cost_model=cost,
                                          timer=DeviceTimer(args.device), cuda_graphs=getattr(args, "graphs", False),
                                          cpu_decoder=getattr(args, "decoder", "auto"))
        args.depth, args.total_tokens = base.depth, base.total_tokens
        print(f"base tree searched on this machine: depth {base.depth}, top_k {base.top_k}, {base.total_tokens} nodes "
              f"({len(searched['grid'])} trees replayed, {len(searched['measured'])} timed on "
              f"{min(len(ids), args.search_prompts)} prompts)", file=out)
    thresholds, fitted_on, x = fit_bins(trace, args.depth, args.total_tokens, target=args.fit_target)
    if fitted_on != args.fit_target:
        print(f"entropy bins fitted on the accepted length: the {args.fit_target} target never varies at this base "
              f"tree (depth {args.depth}, {args.total_tokens} nodes)", file=out)
    policy, predicted = optimise_policy(trace, cost, base_depth=args.depth, total_tokens=args.total_tokens,
                                        thresholds=thresholds)
    static = trace.replay(Policy.static(args.depth, args.top_k_tree, args.total_tokens), cost_model=cost)
    paper = trace.replay(Policy.paper(args.depth, args.top_k_tree, args.total_tokens, thresholds), cost_model=cost)
    calibrated = trace.replay(policy, cost_model=cost)
    ar = trace.replay(Policy.autoregressive(), cost_model=cost)   # the same outputs without a draft
    t_id, d_id = pair_identity(args, target)
    save_profile(args.out, policy, cost, target=t_id, draft=d_id,
                 notes={"prompts": len(texts), "positions": int(len(x)), "fit_target": fitted_on,
                        "predicted_tokens_per_s": {"static": static.tokens_per_s,
                                                   "paper": paper.tokens_per_s,
                                                   "calibrated": calibrated.tokens_per_s,
                                                   "autoregressive": ar.tokens_per_s},
                        "target_name": target_name(args),   # what a person calls it, never a path
                        "per_bin": {str(b): {"cycles": v["cycles"], "mean_accepted": v["mean_accepted"],
                                             "mean_nodes": v["mean_nodes"], "predicted_tokens_per_s": v["tokens_per_s"]}
                                    for b, v in calibrated.per_bin().items()},
                        **({"base_tree_search": searched} if searched is not None else {})})
    print(f"entropy thresholds: {', '.join(f'{t:.4g}' for t in thresholds)}", file=out)
    print(bin_table(calibrated, policy), file=out)
    for label, r in (("static EAGLE-3", static), ("paper rule", paper), ("calibrated", calibrated),
                     ("autoregressive", ar)):
        print(f"{label}: tau {r.tau:.2f}, calls {r.cycles}, verified tokens {r.verified_tokens}, "
              f"predicted {r.tokens_per_s:.1f} tok/s", file=out)
    png = str(args.out).rsplit(".", 1)[0] + ".png"
    _figure(png, x, thresholds, calibrated)
    print(f"profile: {args.out}; figure: {png}", file=out)
    thin = thin_bins_warning(calibrated.per_bin(), len(texts))
    if thin:
        print(thin, file=sys.stderr)
    if ar.tokens_per_s > calibrated.tokens_per_s:
        print(f"heterospec calibrate: warning: autoregressive decoding is predicted faster on this machine "
              f"({ar.tokens_per_s:.1f} against {calibrated.tokens_per_s:.1f} tokens/s for the calibrated trees, "
              f"tau {calibrated.tau:.2f}): with this head, speculation does not pay here; decode with "
              f"Policy.autoregressive() (heterospec generate --method ar), or bring a head accepted more often", file=sys.stderr)
    return policy


MIN_BIN_CYCLES = 50   # fewer cycles than this in a bin leave its mean acceptance, and so its plan, to noise


def calibrate_vllm_cmd(args, out):
    """``calibrate --engine vllm``: a chain profile for vLLM's EAGLE-3 proposer with the plugin, from vLLM's own
    run on the prompts (:func:`heterospec.integrations.vllm_runner.calibrate_chain`)."""
    from transformers import AutoTokenizer

    from ..integrations.vllm_runner import calibrate_chain

    tok = AutoTokenizer.from_pretrained(args.target)
    texts = read_prompts(args.prompts, args.max_prompts or 24)
    if not texts:
        raise SystemExit("heterospec calibrate: no prompts found in " + ", ".join(args.prompts))
    prompts = [encode_turn(tok, [t], [], not args.no_chat_template)[0].tolist() for t in texts]
    policy, need, report = calibrate_chain(args.target, args.draft, prompts, args.out, max_tokens=args.max_chain,
                                           batch=args.batch, max_new_tokens=args.max_new_tokens,
                                           top_k=args.top_k_tree, progress=lambda m: print(m, file=sys.stderr))
    ch = report["chosen"]
    print(f"wrote {args.out}: chain lengths {ch['lengths']} over {len(ch['thresholds']) + 1} bin(s), the path "
          f"entropy of the first {ch['positions']} position(s); pass num_speculative_tokens={need}; predicted "
          f"{ch['rate']:.1f} tokens/s against {max(report['fixed'].values()):.1f} for the best fixed length "
          f"({report['request_steps']} request-steps, {report['checks']})", file=out)


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
    """The prompts of --data (files, 'sharegpt', self:N), shuffled with --seed: each conversation's first turn."""
    return [c[0] for c in _conversations(args, target, tokenizer)]


def _guard(args):
    """The benchmark questions training must never see: a clone's five benchmark files and --exclude's."""
    return OverlapGuard.default(getattr(args, "exclude", None) or ())


def _conversations(args, target, tokenizer):
    """The conversations of --data (lists of user turns: files, 'sharegpt', self:N as single turns), shuffled
    with --seed; a conversation with a turn that overlaps a benchmark question is refused whole."""
    import random

    files = [d for d in args.data if not d.startswith(SELF)]
    convs = read_conversations(files) if files else []
    for d in args.data:
        if d.startswith(SELF):  # prompts the target writes for itself
            convs += [[t] for t in self_written_prompts(target, tokenizer, int(d[len(SELF):]), seed=args.seed,
                                                        batch_size=max(16, args.gen_batch_size),
                                                        deadline=getattr(args, "deadline", None))]
    guard = _guard(args)
    if guard.files:   # never a prompt that overlaps a benchmark question
        before = len(convs)
        convs = [c for c in convs if not any(guard.overlaps(t) for t in c)]
        print(f"train-draft: {before - len(convs)} of {before} prompts refused: they overlap a question of "
              f"{len(guard.files)} benchmark file(s) ({guard.questions} questions)", file=sys.stderr)
    else:
        print("train-draft: no benchmark files here to keep out of training (a clone's benchmarks/data/questions, "
              "or --exclude FILES)", file=sys.stderr)
    if not convs:
        raise SystemExit("heterospec train-draft: no prompts found in " + ", ".join(args.data))
    random.Random(args.seed).shuffle(convs)
    return convs


def collect_answers(args, target, tokenizer, progress, out, collect=True):
    """--answers DIR: the answer store for the training prompts (the list kept in DIR/prompts.json.gz, made from
    --data on the first run), with the shards covering the first --max-prompts prompts (all without it) answered
    when ``collect`` (none started past --time-limit)."""
    import torch

    from ..models.answers import AnswerStore
    from ..policy.profile import model_identity

    saved = AnswerStore.read_prompts(args.answers)
    grown = None
    if saved is not None:
        texts = saved["prompts"]
        later = saved.get("later_turns") or {}
        if args.add_prompts:
            grown = add_prompts(args, target, tokenizer, saved, out)
            texts, later = grown["prompts"], grown["later_turns"]
    else:
        convs = _conversations(args, target, tokenizer)
        texts = [c[0] for c in convs]
        later = {str(i): c[1:] for i, c in enumerate(convs) if len(c) > 1}   # answered after the first turn's
    ids = encode_many(tokenizer, texts, not args.no_chat_template)
    adtype = getattr(torch, args.answer_dtype) if args.answer_dtype else target.dtype
    n_saved = len(saved["prompts"]) if saved is not None else len(ids)
    store = AnswerStore.open(args.answers, prompt_ids=ids[:n_saved],
                             target=model_identity(target.config, target_name(args)),
                             dtype=str(adtype).replace("torch.", ""), max_new_tokens=args.max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, shard_size=args.shard_size,
                             vocab_size=target.config.vocab_size, prompt_texts=texts[:n_saved],
                             texts=None if saved is not None else {"data": list(args.data), "seed": args.seed,
                                                                   "chat_template": not args.no_chat_template,
                                                                   "prompts": texts, "later_turns": later})
    if store.retokenized:
        import transformers

        print(f"{args.answers}: this machine's tokenizer (transformers {transformers.__version__}) splits some "
              f"listed prompt differently from the machine that listed them; the list is the same (its texts' "
              f"sha256), and each answered shard keeps the ids it was answered from", file=out, flush=True)
    if grown is not None:
        for k in store.extend(ids, grown, prompt_texts=texts):
            print(f"{args.answers}: shard {k} was the old list's short last shard; it is answered again with the "
                  f"prompts now in its range", file=out, flush=True)
            drop_later_turns(args.answers, k)   # they were built on the answers just removed
    limit = args.max_prompts
    todo = [k for k in range(store.n_shards(limit)) if not os.path.exists(store.shard_path(k))] if collect else []
    print(f"{args.answers}: {len(store.present())} of {store.n_shards()} shards answered "
          f"({store.answer_tokens()} answer tokens); {len(todo)} to answer now", file=out, flush=True)
    answerer = target
    if adtype != target.dtype and collect:
        import copy

        answerer = copy.deepcopy(target).to(adtype)   # the target stays as loaded, for the features

    def log(k, seconds, ntok):   # k: a shard's index, or a later-turn store's name
        name = f"shard {k}" if isinstance(k, int) else k
        print(f"{name}: {ntok} answer tokens in {seconds:.0f} s ({ntok / seconds:.1f} tokens/s, "
              f"{answerer.dtype}, batch {args.gen_batch_size}, {torch.get_num_threads()} threads)", file=out, flush=True)

    # a list saved before the benchmark check (or by another version) is checked here: such a prompt is never
    # answered, so never trained on (the committed list holds one GSM8K training question that shares 13 words
    # with a benchmark question)
    guard = _guard(args) if saved is not None else None
    refused = set(i for i, t in enumerate(texts) if guard.overlaps(t)) if guard is not None and guard.files else set()
    if refused:
        print(f"{args.answers}: {len(refused)} saved prompt(s) overlap a benchmark question and are never answered",
              file=out, flush=True)
    if todo:
        if later:   # the conversations begun in earlier runs go on first: their later turns before new shards
            later_turn_stores(args, answerer, tokenizer, store, texts, later, adtype, collect, out, log)
        store.collect(answerer, ids, batch_size=args.gen_batch_size, limit=limit,
                      keep=lambda i: ids[i].size <= args.max_prompt_tokens and i not in refused,
                      progress=lambda k, i, n: progress(i, n), log=log, deadline=args.deadline)
    stores = [store] + later_turn_stores(args, answerer, tokenizer, store, texts, later, adtype, collect, out, log)
    del answerer
    return stores, ids


LATER = "later-turns"   # inside --answers: one store per answered shard and turn (shard-NNNNN-turn-T)


def add_prompts(args, target, tokenizer, saved, out):
    """--add-prompts: the saved prompt list (``prompts.json.gz``'s dict) grown by --data's conversations.  Each
    conversation claims an unclaimed entry of the list with its first turn, in list order: the entry gains the
    conversation's later turns unless it has some, or its shard has later-turn stores already (their prompt lists
    are pinned); a conversation with no such entry is appended.  So the same --data twice adds nothing, and a
    list made from first turns alone gets its conversations' later turns.  Returns the new dict (``added``
    records each call's sources and counts)."""
    import collections

    from ..models.answers import AnswerStore

    convs = _conversations(args, target, tokenizer)     # the benchmark guard applied, shuffled with --seed
    texts = list(saved["prompts"])
    later = dict(saved.get("later_turns") or {})
    size = AnswerStore.read_manifest(args.answers)["shard_size"]
    base = os.path.join(args.answers, LATER)
    answered = {int(d[6:11]) for d in os.listdir(base) if d.startswith("shard-")} if os.path.isdir(base) else set()
    free = collections.defaultdict(collections.deque)
    for i, t in enumerate(texts):
        free[t].append(i)
    appended = turns = locked = 0
    for c in convs:
        if free.get(c[0]):
            i = free[c[0]].popleft()
            if len(c) > 1 and str(i) not in later:
                if i // size in answered:
                    locked += 1
                    continue
                later[str(i)] = list(c[1:])
                turns += len(c) - 1
        else:
            if len(c) > 1:
                later[str(len(texts))] = list(c[1:])
                turns += len(c) - 1
            texts.append(c[0])
            appended += 1
    print(f"{args.answers}: --add-prompts: {appended} prompts appended to the {len(saved['prompts'])} there, "
          f"{turns} later turns added" + (f"; {locked} conversations' later turns left out (their shard has "
                                           f"later-turn stores already)" if locked else ""), file=out, flush=True)
    grown = dict(saved, prompts=texts, later_turns=later)
    grown["added"] = list(saved.get("added", [])) + [{"data": list(args.data), "seed": args.seed,
                                                      "prompts": appended, "later_turns": turns}]
    return grown


def later_turn_stores(args, answerer, tokenizer, store, texts, later, adtype, collect, out, log):
    """The later turns of multi-turn prompts, each answered after the target's own answers to the turns before
    it: for every answered shard of ``store`` and turn t = 2, 3, ..., a store of its own (``--answers``/
    later-turns/shard-NNNNN-turn-T, one shard) whose prompts are the conversations of that shard with a t-th turn,
    rendered with the chat template as [turn 1, answer 1, ..., turn t]; answered when ``collect``.  Returns the
    stores there (answered or not), by shard and turn.

    Turn by turn: every shard's turn-t store is made before any turn t+1, and the stores still to answer at a
    turn are answered together (``AnswerStore.collect_together``): a shard's late turns hold a few conversations
    each, which alone would run at a batch of one or two (1,744 stores for the committed list's 109 shards, 944
    of them under 8 prompts).

    An answered turn store records the sha256s of the answer shards its prompts were built from (``built_on``:
    the first turns' shard, then each earlier turn's); while they are unchanged it is opened as it is, so a run
    over answered shards decodes and renders nothing.  Otherwise (a store being answered, or one written
    before the record) its prompts are rendered again from the answers and checked against its manifest."""
    from ..models.answers import AnswerStore

    if not later:
        return []
    base = os.path.join(args.answers, LATER)
    common = dict(target=store.manifest["target"], dtype=store.manifest["dtype"], max_new_tokens=args.max_new_tokens,
                  eos_token_id=tokenizer.eos_token_id, vocab_size=store.manifest["vocab_size"])
    # per shard still going: the sha256s its next turn is built on, its turn stores, its answers (decoded when needed)
    going = {k: {"chain": [store.shard_sha256(k)], "mine": [], "answers": None}
             for k in store.present() if k < store.n_shards(args.max_prompts)}
    made = {k: [] for k in going}   # every shard's turn stores, answered or not
    answering, last, turn = collect, 0.0, 2
    while going:
        now, jobs = {}, []
        for k, g in going.items():
            d = os.path.join(base, f"shard-{k:05d}-turn-{turn}")
            s = _answered_turn(d, g["chain"], common)
            if s is None:
                if not os.path.exists(os.path.join(d, "manifest.json")) and not answering:
                    continue
                if not _turn_goes_on(store, k, g["mine"], later, turn):   # nothing to decode for
                    continue
                if g["answers"] is None:
                    g["answers"] = _turn_answers(tokenizer, store, k, g["mine"])
                convs = sorted(i for i in g["answers"] if len(later.get(str(i), ())) >= turn - 1)
                prompt_ids = [encode_turn(tokenizer, [texts[i]] + later[str(i)][:turn - 1], g["answers"][i],
                                          not args.no_chat_template).view(-1).numpy() for i in convs]
                rendered = [[[texts[i]] + later[str(i)][:turn - 1], g["answers"][i]] for i in convs]
                s = AnswerStore.open(d, prompt_ids=prompt_ids, shard_size=max(1, len(convs)), prompt_texts=rendered,
                                     texts={"shard": k, "turn": turn, "conversations": convs,
                                            "prompts": [later[str(i)][turn - 2] for i in convs]}, **common)
                if answering and not s.present():
                    jobs.append((s, prompt_ids, lambda j, p=prompt_ids: p[j].size <= args.max_prompt_tokens))
            now[k] = s
        if jobs:
            answered, last = AnswerStore.collect_together(
                answerer, jobs, batch_size=args.gen_batch_size, deadline=args.deadline, last=last,
                log=lambda part, seconds, ntok, t=turn: log(f"{LATER} turn {t} ({len(part)} stores, "
                                                          f"{sum(x.manifest['prompts'] for x in part)} prompts)",
                                                          seconds, ntok))
            answering = len(answered) == len(jobs)   # cut by the deadline: no later turn starts either
        going = {k: going[k] for k in now}
        for k, s in now.items():
            g = going[k]
            g["mine"].append(s)
            made[k].append(s)
            if not s.present():
                del going[k]
                continue
            if s.manifest.get("built_on") != g["chain"]:
                s.manifest["built_on"] = g["chain"]
                s._write_manifest()
            if g["answers"] is not None:   # the conversations answered at this turn go on, with that answer
                g["answers"] = _with_turn(tokenizer, g["answers"], s)
            g["chain"] = g["chain"] + [s.shard_sha256(0)]
        turn += 1
    stores = [s for k in sorted(made) for s in made[k]]
    if stores:
        n = sum(s.manifest["prompts"] for s in stores)
        print(f"{args.answers}: {n} later turns of multi-turn prompts in {len(stores)} stores under {LATER}/ "
              f"({sum(s.answer_tokens() for s in stores)} answer tokens)", file=out, flush=True)
    return stores


def _answered_turn(directory, built_on, common):
    """The answered turn store in ``directory`` when it was built on exactly the answer shards ``built_on``
    (sha256s) with these settings, else None."""
    from ..models.answers import AnswerStore

    path = os.path.join(directory, "manifest.json")
    if not os.path.exists(path):
        return None
    m = AnswerStore.read_manifest(directory)
    g = m.get("generation", {})
    if (m.get("built_on") != built_on or m.get("target") != common["target"] or m.get("dtype") != common["dtype"]
            or g.get("max_new_tokens") != common["max_new_tokens"] or g.get("eos_token_id") != common["eos_token_id"]
            or "00000" not in m.get("shards", {})):
        return None
    s = AnswerStore(directory, m)
    return s if s.present() == [0] else None


def drop_later_turns(answers, k):
    """Remove the later-turn stores of shard ``k`` of the answer store in ``answers`` (built on its answers,
    which are being replaced)."""
    for d in glob.glob(os.path.join(glob.escape(os.path.join(answers, LATER)), f"shard-{k:05d}-turn-*")):
        shutil.rmtree(d)


def _turn_rows(s):
    """[(conversation, ids, answer start)] of the answered turn store ``s``."""
    from ..models.answers import AnswerStore

    convs = AnswerStore.read_prompts(s.directory)["conversations"]
    return [(convs[j], seq, start) for j, seq, start in s.load_shard(0)]


def _turn_goes_on(store, k, earlier, later, turn):
    """Whether a conversation of ``store``'s shard ``k`` has a turn ``turn`` to ask after the answered turn
    stores ``earlier``: read from the shards' prompt indices, nothing decoded."""
    going = [i for i, _, _ in (_turn_rows(earlier[-1]) if earlier else store.load_shard(k))]
    return any(len(later.get(str(i), ())) >= turn - 1 for i in going)


def _with_turn(tokenizer, answers, s):
    """``answers`` ({conversation: answer texts}) of the conversations answered in turn store ``s``, each with
    that answer added."""
    got = {i: tokenizer.decode(seq[start:], skip_special_tokens=True) for i, seq, start in _turn_rows(s)}
    return {i: answers[i] + [got[i]] for i in answers if i in got}


def _turn_answers(tokenizer, store, k, earlier):
    """{conversation: [answer text of turn 1, 2, ...]} for the conversations of ``store``'s shard ``k`` still
    going after the turn stores ``earlier`` (turns 2, 3, ... of that shard, answered)."""
    answers = {i: [tokenizer.decode(seq[start:], skip_special_tokens=True)] for i, seq, start in store.load_shard(k)}
    for s in earlier:
        answers = _with_turn(tokenizer, answers, s)
    return answers


def answer_records(args, target, store, out, sub=None, limit="args"):
    """The training records of --answers: each answered shard's features by one teacher-forced forward of the
    target (in --dtype), cached in --features (``sub``: a folder of it, for a later-turn store; ``limit``: the
    prompts used, default --max-prompts); with --on-the-fly the answers alone, as token ids (the features are
    computed batch by batch in training)."""
    from ..models.default import _cache_dir
    from ..models.train import store_features

    limit = args.max_prompts if limit == "args" else limit
    if args.on_the_fly:
        records = [{"ids": ids, "start": start} for k in store.present() if k < store.n_shards(limit)
                   for _, ids, start in store.load_shard(k)]
        if not records and sub is None:
            raise SystemExit(f"heterospec train-draft: {args.answers} holds no answered shard yet (run with "
                             f"--collect-only first)")
        print(f"{store.directory}: {len(records)} sequences, {store.answer_tokens()} answer tokens (features on the "
              f"fly)", file=out, flush=True)
        return records

    ident = store.manifest["target"]
    dtype = str(target.dtype).replace("torch.", "")
    cache = args.features or os.path.join(_cache_dir(), "features",
                                          f"{ident['name']}-{ident['config_sha256'][:12]}-{dtype}")
    cache = cache if sub is None else os.path.join(cache, sub)
    t0 = time.time()

    def log(k, seconds, positions, cached):
        what = "cached" if cached else f"computed in {seconds:.0f} s ({positions / max(seconds, 1e-9):.0f} positions/s)"
        print(f"features of shard {k}: {positions} positions, {what}", file=out, flush=True)

    records, agree, total = store_features(target, store, cache, ident, topk=args.topk, limit=limit, log=log)
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
    args.deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    tokenizer, target, _ = load_pair(args, args.device)

    train_line, answering = ProgressBar("training"), ProgressBar("the target answers the prompts")

    def progress(step, steps, loss, accs, elapsed):
        train_line(step, steps, postfix=f"loss {loss:.3f} acc/step {' '.join(f'{a:.2f}' for a in accs)}")

    if args.answers:
        # a training run answers only what --max-prompts asks for; without it, it trains on the answered shards
        stores, ids = collect_answers(args, target, tokenizer, answering, out,
                                      collect=args.collect_only or args.max_prompts is not None)
        answering.close()
        if args.collect_only:
            return
        records = answer_records(args, target, stores[0], out)
        for s in stores[1:]:   # the later turns (their first --max-prompts is not a limit: each is one shard)
            if s.present():
                records += answer_records(args, target, s, out, sub=os.path.basename(s.directory), limit=None)
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
                on_the_fly=bool(args.answers and args.on_the_fly), deadline=args.deadline, topk=args.topk,
                head_options={k: True for k in ("fc_norm", "norm_hidden_out") if getattr(args, k, False)},
                init_head=None if args.init_head is None else
                (DEFAULT_HEAD if args.init_head == "default" else args.init_head))
    train_line.close()
    print(f"draft written to {args.out} (training curves: {os.path.join(args.out, 'training_curves.png')})", file=out)
