"""Running vLLM for heterospec (apart from the plugin, :mod:`heterospec.integrations.vllm`): one configuration
per process, since the plugin reads its environment when vLLM loads it (:func:`run_vllm` starts
``python -m heterospec.integrations.vllm_runner run CONFIG RESULT``, which is :func:`run_config`), and the chain
calibration from vLLM's own runs (:func:`calibrate_chain`, what ``heterospec calibrate --engine vllm`` runs: the
plugin records full chains, :mod:`heterospec.tune.chain` reads the trace and fits the profile)."""
from __future__ import annotations

import json
import os
import time

from .vllm import ENV_PROFILE, ENV_RECORD, ENV_STATS, _write_json


# ---- running vLLM: one configuration per process (the plugin reads its environment when vLLM loads it) ------

def _counters(metrics):
    """vLLM's speculative-decoding counters from ``LLM.get_metrics()``: drafts, draft tokens, accepted tokens and
    the accepted count per position."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    for m in metrics:
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * (len(vals) - len(acc)), vals)]
    return out


def _diff(after, before):
    out = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    pb = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pb)]
    return out


def _plugin_stats():
    path = os.environ.get(ENV_STATS)
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _stats_diff(after, before):
    if after is None:
        return None
    before = before or {}
    out = dict(after)
    for k in ("calls", "requests", "drafted", "kept", "empty"):
        out[k] = after[k] - before.get(k, 0)
    for k in ("bins", "kept_at"):
        out[k] = [a - b for a, b in zip(after[k], before.get(k, [0] * len(after[k])))]
    return out


def run_config(cfg):
    """Run vLLM once, in this process, for ``cfg`` (a dict: ``target``, ``prompts`` (token id lists),
    ``max_new_tokens``, ``batches`` (a list of batch sizes: the prompts go to vLLM that many at a time, each
    size timed apart after its own warm-up), optional ``draft`` + ``k`` (EAGLE-3 with k draft tokens),
    ``temperature``, ``seed``, ``dtype``, ``warmup_tokens``, ``max_model_len``, ``memory_fraction`` (of the host's
    memory on the CPU backend), ``enforce_eager`` (no compilation: a faster start), ``in_process`` (vLLM's engine
    core and its one worker in this process instead of two more: each of those imports vLLM again, about 30 of
    the 80 s a run takes on our 2-core CPU; the same engine, scheduler, model runner and plugin, but no overlap
    of scheduling with the forward, so leave it off where tokens/s matter)) -> {"versions", "runs": one per
    batch size: {"batch", "tokens", "seconds", "new_tokens", "spec" (vLLM's counters over the timed part),
    "plugin" (the plugin's, when it is on)}}.  The plugin is on when this process's ``HETEROSPEC_VLLM_PROFILE``
    is set."""
    in_process = bool(cfg.get("in_process", False))
    if in_process:   # read by vLLM when it builds the engine client
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    spec = None
    if cfg.get("draft") and cfg.get("k"):
        spec = {"method": "eagle3", "model": cfg["draft"], "num_speculative_tokens": int(cfg["k"])}
    prompts = [{"prompt_token_ids": list(p)} for p in cfg["prompts"]]
    longest = max(len(p) for p in cfg["prompts"])
    llm = LLM(model=cfg["target"], dtype=cfg.get("dtype", "float32"), seed=int(cfg.get("seed") or 0),
              max_model_len=int(cfg.get("max_model_len") or longest + cfg["max_new_tokens"] + 64),
              speculative_config=spec, disable_log_stats=False, async_scheduling=False,
              # on the CPU backend the fraction of the host's memory vLLM reserves (its default, 0.92, refuses
              # to start beside anything else)
              gpu_memory_utilization=float(cfg.get("memory_fraction", 0.3)),
              enforce_eager=bool(cfg.get("enforce_eager", False)),
              **({"distributed_executor_backend": "uni"} if in_process else {}))
    temperature = float(cfg.get("temperature", 0.0))
    runs = []
    for B in cfg.get("batches", [1]):
        warm = int(cfg.get("warmup_tokens", 8))
        if warm:
            llm.generate(prompts[:B], SamplingParams(max_tokens=warm, temperature=0.0), use_tqdm=False)
        before, pbefore = _counters(llm.get_metrics()), _plugin_stats()
        outs = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), B):
            group = prompts[i:i + B]
            # sampling draws from vLLM's generator seeded by ``seed`` (per-request seeds fail on vLLM 0.32's
            # CPU backend: "CPU Generator does not use offset")
            sps = SamplingParams(max_tokens=int(cfg["max_new_tokens"]), temperature=temperature)
            outs += llm.generate(group, sps, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        runs.append({"batch": B, "tokens": tokens, "seconds": seconds, "new_tokens": sum(len(t) for t in tokens),
                     "spec": _diff(_counters(llm.get_metrics()), before),
                     "plugin": _stats_diff(_plugin_stats(), pbefore)})
    return {"runs": runs, "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                                       "transformers": transformers.__version__}}


def run_vllm(cfg, *, profile=None, record=None, python=None, timeout=1800):
    """:func:`run_config` in a fresh process (``python``: that interpreter, default this one), with the plugin
    on when ``profile`` is given (``record``: a calibration trace) -> its result.  A failure raises
    RuntimeError with the child's last output lines."""
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in (ENV_PROFILE, ENV_STATS, ENV_RECORD)}
    with tempfile.TemporaryDirectory() as tmp:
        for key, value in ((ENV_PROFILE, profile), (ENV_STATS, profile and os.path.join(tmp, "stats.json")),
                           (ENV_RECORD, record)):
            if value:
                env[key] = os.path.abspath(value)
        src, dst = os.path.join(tmp, "config.json"), os.path.join(tmp, "result.json")
        with open(src, "w") as f:
            json.dump(cfg, f)
        p = subprocess.run([python or sys.executable, "-m", "heterospec.integrations.vllm_runner", "run", src, dst],
                           env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not os.path.exists(dst):
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"vLLM run failed (exit {p.returncode}):\n{tail}")
        with open(dst) as f:
            return json.load(f)


def calibrate_chain(target, draft, prompts, out, *, max_tokens=6, batch=1, max_new_tokens=128, top_k=10,
                    python=None, progress=print):
    """Fit a chain profile for ``draft`` on ``target`` from vLLM's own run: the plugin records full chains of
    ``max_tokens`` drafts with random kept lengths (so that each length's cost is seen) over ``prompts`` (token
    id lists) at temperature 0, :func:`read_trace` and :func:`fit_cost` read it, and
    :func:`heterospec.tune.chain.fit_chain_policy` picks bins and lengths (or a fixed length, when no binning
    beats it on this trace).  Writes the profile to ``out`` (``heterospec calibrate``'s format) and returns
    (Policy, num_speculative_tokens to pass vLLM, report)."""
    import tempfile

    from ..policy.profile import save_profile
    from ..tune.chain import chain_policy, fit_chain_policy, fit_cost, read_trace

    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "probe.json")
        save_profile(probe, chain_policy([max_tokens], top_k=top_k, name="record"))
        trace = os.path.join(tmp, "trace.jsonl")
        cfg = dict(target=target, draft=draft, k=max_tokens, prompts=prompts, max_new_tokens=max_new_tokens,
                   batches=[batch], warmup_tokens=0, temperature=0.0)
        progress(f"calibrate: vLLM with {len(prompts)} prompts, chains of {max_tokens} drafts, batch {batch}")
        run = run_vllm(cfg, profile=probe, record=trace, python=python)
        result = run["runs"][0]
        entropy, accepted, steps, checks = read_trace(trace, result["tokens"], max_tokens)
    cost = fit_cost(steps, max_tokens)
    policy, need, report = fit_chain_policy(entropy, accepted, cost, top_k=top_k)
    report.update(checks=checks, cost=cost.to_dict(), request_steps=int(accepted.shape[0]),
                  mean_accepted_full=float(accepted.mean()), versions=run["versions"], batch=batch,
                  max_tokens=max_tokens, prompts=len(prompts), max_new_tokens=max_new_tokens)
    save_profile(out, policy, notes={"engine": "vllm", "num_speculative_tokens": need, "fit": report})
    return policy, need, report


def main(argv=None):
    """``python -m heterospec.integrations.vllm_runner run CONFIG.json RESULT.json``: one :func:`run_config`, what
    :func:`run_vllm` starts (not a user command: ``heterospec calibrate --engine vllm`` is)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["run"] or len(argv) != 3:
        print("usage: python -m heterospec.integrations.vllm_runner run CONFIG.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        cfg = json.load(f)
    _write_json(argv[2], run_config(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
