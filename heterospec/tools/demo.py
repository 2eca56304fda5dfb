"""``heterospec demo``: the default pair (SmolLM2-135M-Instruct + the shipped EAGLE-3 head) decoding a
handful of built-in prompts with autoregressive decoding, EAGLE-3's static tree and HeteroSpec, through one
loop, with the greedy outputs checked to be identical and a table of the speed of each.

Everything here is also a library call (:func:`compare`), which the tests run on tiny random models.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

from . import ProgressBar
from .. import measure
from ..models.default import DATA_DIR, DEFAULT_HEAD, DEFAULT_PROFILE, load_pair as _load_pair
from ..policy.profile import shipped_profile
from .prompts import encode as _encode

DEMO_PROMPTS = os.path.join(DATA_DIR, "demo_prompts.json")


def demo_prompts():
    """The built-in prompts (written for the demo; none comes from a benchmark file)."""
    with open(DEMO_PROMPTS) as f:
        return json.load(f)["prompts"]


@dataclass
class MethodResult:
    name: str
    sequences: list = field(default_factory=list)   # [1, S + new] int64 tensors, one per prompt
    new_tokens: int = 0
    seconds: float = 0.0
    cycles: int = 0
    verified_tokens: int = 0
    committed: int = 0                             # tokens committed by verification calls (tau's numerator)
    per_prompt_tps: list = field(default_factory=list)
    baseline: bool = False                         # HuggingFace's generate: no verification calls, no tau

    @property
    def tokens_per_s(self):
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self):
        return self.committed / self.cycles if self.cycles else 0.0


def default_methods(draft, policy=None, depth=7, top_k=10, total_tokens=60):
    """[(name, Policy or HFMethod)]: ar, hf (the target's own ``generate``, what a user has already), lookup (our
    prompt lookup, no draft: ``bench``'s method of that name), eagle3 (static tree: depth 7, top_k 10, 60 nodes)
    and, when a HeteroSpec ``policy`` is given, heterospec and heterospec-lookup (its trees with the lookup's
    chain grafted on)."""
    from ..policy import Policy
    from .bench.methods import HF_BASELINES

    methods = [("ar", Policy.autoregressive()), ("hf", HF_BASELINES["hf"]), ("lookup", Policy.autoregressive())]
    if draft is not None:
        methods.append(("eagle3", Policy.static(depth, top_k, total_tokens)))
        if policy is not None:
            methods += [("heterospec", policy), ("heterospec-lookup", policy)]
    return methods


def heterospec_policy(choice, default_profile=None, default_what=None):
    """The HeteroSpec policy for ``choice``: a profile path (``heterospec calibrate --out``), ``"paper"``
    (the paper's rule on the entropy bins of ``default_profile``), or None (``default_profile``'s
    calibrated policy, described as ``default_what``).  Returns (Policy or None, description)."""
    from ..policy.profile import load_profile
    from ..policy import Policy

    if choice and choice != "paper":
        return load_profile(choice)[0], f"calibrated profile {choice}"
    if default_profile is None or not os.path.exists(default_profile):
        return None, "no profile for this head (run heterospec calibrate and pass --policy PROFILE)"
    calibrated = load_profile(default_profile)[0]
    if choice == "paper":
        return (Policy.paper(calibrated.depth, calibrated.top_k, calibrated.total_tokens, calibrated.thresholds),
                f"the paper's rule on the bins of {default_profile}")
    return calibrated, default_what or f"calibrated profile {default_profile}"


def compare(target, draft, input_ids_list, methods, *, max_new_tokens=128, eos_token_id=None, streamer=None,
            stream_method=None, warmup_tokens=8, progress=None, cuda_graphs=False, cpu_decoder="auto"):
    """Run every method on every prompt (one loop, same settings): a :class:`Comparison`, {name: MethodResult}.
    ``methods``: [(name, Policy or HFMethod)]; an HFMethod runs the target's own ``generate`` (no verification
    calls, so no tau), with the same EOS (None: the model's) and budget.

    A short untimed warm-up per method comes first.  The methods take turns prompt by prompt (the order rotated
    from one prompt to the next), so a slow spell of the machine (a background job) is shared among them
    instead of landing on one.  ``streamer`` (e.g. transformers' TextStreamer) streams the first prompt's
    answer of ``stream_method`` (default: the last method).  ``progress(name, i, n, streaming)`` is called
    before each prompt of each method.  ``cuda_graphs``, ``cpu_decoder``: passed to our engines
    (:class:`HeteroSpec`), with each method's own options beyond its policy (``bench``'s
    :func:`~heterospec.tools.bench.methods.engine_options`: the prompt lookup of ``lookup`` and
    ``heterospec-lookup``); the untimed warm-up records their steps."""
    from contextlib import ExitStack

    from ..engine.loop import HeteroSpec, eos_ids
    from .bench.baselines import HFGenerate
    from .bench.methods import HFMethod, engine_options

    stream_method = stream_method or methods[-1][0]
    results = Comparison((name, MethodResult(name, baseline=isinstance(pol, HFMethod))) for name, pol in methods)
    names = [name for name, _ in methods]
    eos_token_id = eos_ids(target, eos_token_id)   # the model's when None, for HF's generate as for ours
    gen_config = getattr(target, "generation_config", None)
    pad = getattr(gen_config, "pad_token_id", None)
    pad = pad if pad is not None else (eos_token_id[0] if eos_token_id else 0)

    def engine(name, policy):
        if isinstance(policy, HFMethod):
            return HFGenerate(target, policy, pad_token_id=pad)
        return HeteroSpec(target, draft if policy.drafts else None, policy, cuda_graphs=cuda_graphs,
                          cpu_decoder=cpu_decoder, **engine_options(name))

    with ExitStack() as stack:
        engines = {}
        for name, policy in methods:
            e = engine(name, policy)
            engines[name] = stack.enter_context(e) if isinstance(e, HeteroSpec) else e
        # what our engines' forwards ran on (the drafting one's, which names the draft too)
        results.cpu_decoder = next((e.cpu_decoder for e in reversed(list(engines.values()))
                                    if isinstance(e, HeteroSpec)), None)
        if warmup_tokens:
            for hs in engines.values():
                hs.generate(input_ids_list[0], max_new_tokens=warmup_tokens, eos_token_id=eos_token_id)
        for i, ids in enumerate(input_ids_list):
            r = i % len(names)
            for name in names[r:] + names[:r]:
                res = results[name]
                s = streamer if (streamer is not None and i == 0 and name == stream_method) else None
                if progress is not None:
                    progress(name, i, len(input_ids_list), s is not None)
                t0 = time.perf_counter()
                kw = {} if s is None else {"streamer": s}
                seq, st = engines[name].generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, **kw)
                dt = time.perf_counter() - t0
                res.sequences.append(seq.cpu())
                res.new_tokens += st.new_tokens
                res.seconds += dt
                res.cycles += getattr(st, "cycles", 0)            # HF's generate reports new tokens only
                res.verified_tokens += getattr(st, "verified_tokens", 0)
                res.committed += getattr(st, "committed", 0)
                res.per_prompt_tps.append(st.new_tokens / dt if dt else 0.0)
                if s is not None:
                    print(file=sys.stdout, flush=True)  # end the streamed answer's line
    return results


class Comparison(dict):
    """{method name: MethodResult}, in the order the methods were given (what :func:`compare` returns).  In
    Jupyter it displays as :meth:`table`.  ``cpu_decoder``: what our engines' forwards ran on (their
    ``HeteroSpec.cpu_decoder``), or None without one of ours."""

    cpu_decoder = None

    def mismatches(self):
        """[(method, prompt index, first differing position)] against the first method's outputs."""
        names = list(self)
        ref = self[names[0]].sequences
        bad = []
        for name in names[1:]:
            for i, (a, b) in enumerate(zip(ref, self[name].sequences)):
                a, b = a.view(-1).tolist(), b.view(-1).tolist()
                if a != b:
                    pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    bad.append((name, i, pos))
        return bad

    def table(self):
        """The markdown table: method, tokens/s, its spread over the prompts, speed against the first method and
        against HuggingFace's ``generate`` (a method named "hf", when there is one), tau, calls, verified tokens."""
        names = list(self)
        base, hf = self[names[0]], self.get("hf")

        def ratio(r, ref):
            return f"{r.tokens_per_s / ref.tokens_per_s:.2f}x" if ref is not None and ref.tokens_per_s else "-"

        head = f"| method | tokens/s | per prompt (min-max) | x {names[0]} |" + (" x HF generate |" if hf else "")
        lines = [head + " tau | verification calls | verified tokens |",
                 "|---|---:|---:|---:|" + ("---:|" if hf else "") + "---:|---:|---:|"]
        for n in names:
            r = self[n]
            spread = f"{min(r.per_prompt_tps):.1f}-{max(r.per_prompt_tps):.1f}" if r.per_prompt_tps else "-"
            calls = ("-", "-", "-") if r.baseline else (f"{r.tau:.2f}", str(r.cycles), str(r.verified_tokens))
            lines.append(f"| {n} | {r.tokens_per_s:.1f} | {spread} | {ratio(r, base)} |"
                         + (f" {ratio(r, hf)} |" if hf else "") + " " + " | ".join(calls) + " |")
        return "\n".join(lines)

    def _repr_markdown_(self):
        return self.table()


def run(args, out=None):
    """The ``heterospec demo`` command.  Returns the process exit status (1 when outputs differ)."""
    out = sys.stdout if out is None else out   # the stdout of the call, not of the import
    import torch

    from transformers import TextStreamer

    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"heterospec demo: --device {device} but torch sees no CUDA device")
    t0 = time.perf_counter()
    draft_dir = args.draft or (DEFAULT_HEAD if args.target == "default" else None)
    if draft_dir is None:
        raise SystemExit("heterospec demo: --draft PATH is required with a --target other than 'default'")
    if not os.path.exists(os.path.join(draft_dir, "config.json")):
        raise SystemExit(f"heterospec demo: no EAGLE-3 head at {draft_dir!r} (expected config.json and weights)")
    args.draft = draft_dir
    tokenizer, target, draft = _load_pair(args, device)
    target_name = "SmolLM2-135M-Instruct" if args.target == "default" else str(args.target)
    hs_policy, hs_what = heterospec_policy(args.policy, *(shipped_profile(args.device, draft_dir)
                                                          if draft_dir == DEFAULT_HEAD else (None, None)))
    methods = default_methods(draft, hs_policy)
    texts = [args.prompt] if args.prompt else demo_prompts()[: args.num_prompts]
    ids = [_encode(tokenizer, t).to(device) for t in texts]
    load_s = time.perf_counter() - t0
    print(f"heterospec demo: target {target_name}, draft {draft_dir}, {device} {args.dtype}, "
          f"{len(texts)} prompts x {args.max_new_tokens} new tokens, greedy (loaded in {load_s:.1f} s)", file=out)
    th = f"; entropy bins {', '.join(f'{t:.3g}' for t in hs_policy.thresholds)}" if hs_policy is not None else ""
    print(f"  eagle3: static tree depth 7, top_k 10, 60 nodes; heterospec: {hs_what}{th}", file=out)
    # --cuda-graphs as generate takes it: 'auto' stays 'auto' (on with a CUDA device, eager if recording fails)
    graphs = {"on": True, "off": False, "auto": "auto"}[getattr(args, "cuda_graphs", "off")]
    if str(device).startswith("cuda"):
        print(f"  our engines: {'CUDA graphs (recorded in the warm-up)' if graphs else 'the eager engine'} "
              f"(--cuda-graphs {getattr(args, 'cuda_graphs', 'off')})", file=out)
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    bar, names, done = ProgressBar(), [n for n, _ in methods], [0]

    def progress(name, i, n, streaming):   # before prompt i of method name: the (method, prompt) runs done so far
        if streaming:   # the answer streams to the terminal: no bar on its lines
            bar.clear()
            print(f"[{name}, streamed] >>> {texts[0]}\n", file=out, flush=True)
        else:
            bar(done[0], len(names) * n, desc=f"prompt {i + 1}/{n}: {name}")
        done[0] += 1

    shown = "heterospec" if "heterospec" in names else names[-1]   # the method whose first answer is shown
    results = compare(target, draft, ids, methods, max_new_tokens=args.max_new_tokens,
                      eos_token_id=tokenizer.eos_token_id, streamer=streamer, stream_method=shown,
                      progress=progress, cuda_graphs=graphs, cpu_decoder=getattr(args, "decoder", "auto"))
    bar(len(names) * len(ids), len(names) * len(ids), desc="done")
    if args.no_stream:
        first = results[shown].sequences[0]
        print(f"[{shown}] >>> {texts[0]}\n", file=out)
        print(tokenizer.decode(first[0, ids[0].shape[1]:], skip_special_tokens=True), file=out)
    print(file=out)
    bad = greedy_check(results.mismatches(), list(results), args.dtype, results.cpu_decoder,
                       [x.shape[1] for x in ids], len(texts), out)
    if results.cpu_decoder not in (None, "off"):
        print(f"our engines' forwards: cpu_decoder {results.cpu_decoder}", file=out)
    print(file=out)
    print(results.table(), file=out)
    print(f"\n(total {time.perf_counter() - t0:.0f} s; tokens/s = new tokens / decoding time, after a warm-up; "
          f"tau = tokens committed per verification call)", file=out)
    busy = measure.load_warning()
    if busy:
        print(busy, file=out)
    return 1 if bad else 0


def greedy_check(bad, names, dtype, decoder, starts, prompts, out):
    """Print the demo's greedy check: ``bad`` (method, prompt, position) from :meth:`Comparison.mismatches`,
    ``starts`` each prompt's length; returns the mismatches that fail the demo.  A half-precision model on our CPU
    decoder (``decoder`` not 'off') is computed in float32, its output its float32 copy's: transformers' own half
    arithmetic ("hf") is another computation, so its differences are printed as notes, not failures
    (:func:`.bench.methods.other_arithmetic`, the rule bench shares)."""
    from .bench.methods import arithmetic_note, other_arithmetic

    theirs = [b for b in bad if other_arithmetic((b[0], names[0]), dtype, decoder)]
    bad = [b for b in bad if b not in theirs]
    for name, i, pos in theirs:
        print(f"note: {name} differs from ar on prompt {i} at new token {pos - starts[i]}: {arithmetic_note(dtype)}",
              file=out)
    for name, i, pos in bad:
        print(f"MISMATCH: {name} differs from ar on prompt {i} at new token {pos - starts[i]}", file=out)
    if not bad:
        same = [n for n in names if not any(n == b[0] for b in theirs)]
        print(f"identical greedy outputs across {', '.join(same)} on all {prompts} prompts", file=out)
    return bad


# ---- heterospec demo --synthetic: one cycle of the C core, no model ----------------------------------------


def _peaked_logits(rng, rows, vocab, sharpness):
    """Logits whose softmax puts most mass on a few tokens, like a trained LM's."""
    import numpy as np

    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    hot = rng.integers(0, vocab, size=(rows, 4))
    for r in range(rows):
        x[r, hot[r]] += sharpness * np.array([3.0, 2.0, 1.0, 0.5], dtype=np.float32)
    return x


def synthetic_cycle(vocab=49152, k=10, depth=6, n_keep=59, seed=0, out=None):
    """One EAGLE-3 style cycle on synthetic logits: grow the draft tree level by level and read the top-k
    entropy summed along the most confident path (HeteroSpec Eq. 1) as the engine does, rerank, build the verification tree,
    accept greedily and by lossless sampling, and compact a KV cache.  Returns a dict of what happened."""
    import sys

    import numpy as np

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
