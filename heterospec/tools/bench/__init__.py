"""``heterospec bench``: the paper's evaluation as one command, every method side by side in one run.

One process, one model load; each question is answered by every method in turn, with the same prompt,
budget, seed and timer, and at temperature 0 every method's tokens are checked against the first method's
(a difference is reported as a MISMATCH, exit status 1).  One concern a module, each importing only those
above it in this list (and the layers below the tools):

- :mod:`.questions`: the EAGLE ``question.jsonl`` files and the paper's five benchmarks;
- :mod:`.methods`: the methods by name (``ar``, ``eagle3``, ``eagle3-tuned``, ``heterospec-paper``,
  ``heterospec``, ``heterospec-tuned`` and the HuggingFace baselines ``hf``, ``hf-static``, ``hf-lookup``),
  what each one is;
- :mod:`.baselines`: the HuggingFace baselines run through ``model.generate``;
- :mod:`.tuning`: ``eagle3-tuned``'s static tree searched on this machine, ``heterospec-tuned``'s calibration;
- :mod:`.metrics`: the numbers of a run (tokens/s, speedups, tau, verification calls, entropy bins, time
  split) and the identical-output check;
- :mod:`.runner`: :func:`run_bench`, the run itself;
- :mod:`.report`: ``results.json``, ``results.md``, ``answers.jsonl``, the plots and ``--report``;
- :mod:`.command`: the command's flags and :func:`main`.

The names other code uses are imported here (not :func:`.report.report`, which would hide the module)."""
from .baselines import BaselineStats, HFGenerate
from .command import DEFAULT_TUNE_PROMPTS, add_arguments, main
from .methods import (DEFAULT_METHODS, HF_BASELINES, HF_METHODS, LOOKUP, METHODS, HFMethod, build_methods,
                      check_method_names, engine_options, method_dict, parse_tree)
from .metrics import add_speedup_over_hf, mismatch_report, pooled_bins, speedup_over
from .questions import BENCHMARKS, LABELS, load_questions, question_paths
from .report import SCHEMA, markdown, plots, write_outputs
from .runner import run_bench, static_cache_len
from .tuning import TUNE_DEPTHS, TUNE_NODES, calibrate_on, tune_static_tree
from ..prompts import encode_turn  # the chat template of a turn, as the bench encodes it (tests, notebooks)

__all__ = ["BENCHMARKS", "BaselineStats", "DEFAULT_METHODS", "DEFAULT_TUNE_PROMPTS", "HF_BASELINES", "HF_METHODS", "HFGenerate",
           "HFMethod", "LABELS", "LOOKUP", "METHODS", "SCHEMA", "TUNE_DEPTHS", "TUNE_NODES", "add_arguments",
           "add_speedup_over_hf", "build_methods", "calibrate_on", "check_method_names", "encode_turn", "engine_options",
           "load_questions", "main", "markdown", "method_dict", "mismatch_report", "parse_tree", "plots", "pooled_bins",
           "question_paths", "run_bench", "speedup_over", "static_cache_len", "tune_static_tree", "write_outputs"]
