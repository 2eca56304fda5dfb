"""HeteroSpec's entropy-binned drafting inside vLLM (issue 30): per request and per step, vLLM's own EAGLE-3
proposer drafts a chain of ``num_speculative_tokens`` tokens, and this plugin keeps only as many of them as the
request's entropy bin allows -- all of them where the draft is sure of itself, fewer where it is not (the
paper's DED and TNP, for a chain).  Verification is vLLM's own rejection sampler, unchanged, so the output is
vLLM's own: greedy output equals vLLM without speculation, sampled output keeps the target's distribution.

How it works, per ``propose`` call of vLLM's ``EagleProposer`` (one per scheduler step, for the whole batch):

1. every drafted position's logits go through ``ops.topk_entropy`` (our C/CUDA op, on vLLM's tensors, on their
   device) as vLLM computes them (``_sample_draft_tokens``), before vLLM picks its draft token from them;
2. the chain's path entropy is the sum of its first ``depth + 1`` positions
   (:func:`heterospec.growth.chain_path_entropy`), its bin ``ops.bucketize`` against the profile's thresholds,
   and the bin's draft length :meth:`heterospec.policy.Policy.chain_lengths` -- all on the device;
3. the drafted tokens and the lengths come to the host in one read for the batch (vLLM's runner reads the
   drafts there anyway), and each request's list is cut to its length (possibly empty: no drafts this step).

vLLM's scheduler, its EAGLE input preparation and its rejection sampler all take per-request draft counts.
vLLM 0.32 verifies chains only (no token trees), so the plugin drafts chains.

Use: ``pip install "heterospec[vllm]"`` registers :func:`register` under vLLM's ``vllm.general_plugins`` entry
point; it does nothing unless ``HETEROSPEC_VLLM_PROFILE`` names a profile (``heterospec calibrate``'s JSON, or
one fitted from vLLM's own runs by :func:`calibrate_chain`), so installing heterospec never changes vLLM's
behaviour by itself.  Then vLLM's own options select EAGLE-3 as usual::

    HETEROSPEC_VLLM_PROFILE=profile.json python serve.py   # LLM(..., speculative_config={"method": "eagle3",
                                                           #      "model": head, "num_speculative_tokens": 8})

``num_speculative_tokens`` is the deepest chain any bin may keep (lengths above it are cut to it) and must
cover the ``depth + 1`` positions the path entropy sums.  Optional: ``HETEROSPEC_VLLM_STATS`` (a JSON file the
proposer keeps up to date: bins chosen, tokens drafted and kept), ``HETEROSPEC_VLLM_RECORD`` (a JSON-lines trace
for :func:`calibrate_chain`: the full chains, their per-position entropies, and random kept lengths).
"""
from __future__ import annotations

import json
import os
import random
import time

import numpy as np

ENV_PROFILE = "HETEROSPEC_VLLM_PROFILE"
ENV_STATS = "HETEROSPEC_VLLM_STATS"
ENV_RECORD = "HETEROSPEC_VLLM_RECORD"
ENV_SEED = "HETEROSPEC_VLLM_SEED"


class ChainSchedule:
    """A policy read for chain drafts: the path entropy over the first ``depth + 1`` drafted positions (top-K
    entropy with the policy's ``top_k``), its bin, and the bin's draft length (at most ``max_tokens``,
    vLLM's ``num_speculative_tokens``)."""

    def __init__(self, policy, max_tokens):
        if not isinstance(max_tokens, int) or max_tokens < policy.depth + 1:
            raise ValueError(f"heterospec vLLM plugin: num_speculative_tokens expected an int >= {policy.depth + 1} "
                             f"(the profile's path entropy sums depth + 1 = {policy.depth + 1} drafted positions), "
                             f"got {max_tokens!r}")
        self.policy = policy
        self.positions = policy.depth + 1
        self.top_k = policy.top_k
        self.max_tokens = max_tokens
        self.lengths_host = tuple(min(n, max_tokens) for n in policy.chain_lengths())
        self._on = {}

    @classmethod
    def from_profile(cls, path, max_tokens):
        from ..policy.profile import load_profile

        try:
            policy, _, _ = load_profile(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"heterospec vLLM plugin: {ENV_PROFILE} expected a heterospec profile JSON, got "
                             f"{path!r} ({type(e).__name__}: {e})") from None
        return cls(policy, max_tokens)

    def _tables(self, device):
        import torch

        key = str(device)
        if key not in self._on:
            self._on[key] = (torch.tensor(self.policy.thresholds, dtype=torch.float64, device=device),
                             torch.tensor(self.lengths_host, dtype=torch.long, device=device))
        return self._on[key]

    def step_entropy(self, logits):
        """The top-K entropy of each row of one drafted position's logits [N, V] -> float32 [N] (device)."""
        from .. import ops

        return ops.topk_entropy(logits, self.top_k, check=logits.device.type != "cuda")

    def lengths(self, step_entropy):
        """``step_entropy`` [B, D] (D >= depth + 1) -> (bins, draft lengths), int64 [B] each, on its device."""
        import torch

        from .. import ops
        from ..growth import chain_path_entropy

        thresholds, lengths = self._tables(step_entropy.device)
        h = chain_path_entropy(step_entropy, self.positions)
        if thresholds.numel() == 0:
            bins = torch.zeros(h.shape, dtype=torch.long, device=h.device)
        else:
            bins = ops.bucketize(h, thresholds, check=h.device.type != "cuda").long()
        return bins, lengths[bins]


def _write_json(path, obj):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def proposer_class():
    """vLLM's ``EagleProposer`` with HeteroSpec's per-request draft lengths (imports vLLM)."""
    import torch
    from vllm.v1.spec_decode.eagle import EagleProposer

    class HeteroSpecEagleProposer(EagleProposer):
        heterospec = True

        def __init__(self, vllm_config, device, runner=None):
            super().__init__(vllm_config, device, runner)
            self.hs_runner = runner
            spec = vllm_config.speculative_config
            self.hs_active = spec.method == "eagle3"
            if not self.hs_active:
                return
            for flag in ("use_heterogeneous_vocab", "use_local_argmax_reduction", "parallel_drafting"):
                if getattr(spec, flag, False):
                    raise ValueError(f"heterospec vLLM plugin: speculative_config {flag} expected False (the plugin "
                                     f"reads every drafted position's logits), got True")
            if runner is not None and getattr(runner, "use_async_scheduling", False):
                raise ValueError("heterospec vLLM plugin: async_scheduling expected False (per-request draft "
                                 "lengths go back to the scheduler as lists, which vLLM's async path does not "
                                 "take), got True; pass LLM(..., async_scheduling=False)")
            self.hs_schedule = ChainSchedule.from_profile(os.environ[ENV_PROFILE], spec.num_speculative_tokens)
            self.hs_steps = []
            D = spec.num_speculative_tokens
            self.hs_stats = {"calls": 0, "requests": 0, "drafted": 0, "kept": 0, "empty": 0,
                             "bins": [0] * len(self.hs_schedule.lengths_host), "kept_at": [0] * D,
                             "lengths": list(self.hs_schedule.lengths_host), "positions": self.hs_schedule.positions,
                             "num_speculative_tokens": D}
            self.hs_stats_path = os.environ.get(ENV_STATS)
            self.hs_record_path = os.environ.get(ENV_RECORD)
            self.hs_rng = random.Random(int(os.environ.get(ENV_SEED, "0")))

        def _sample_draft_tokens(self, hidden_states, sampling_metadata):
            if not self.hs_active:
                return super()._sample_draft_tokens(hidden_states, sampling_metadata)
            # vLLM's own choice from the same logits, after their entropy (its probabilistic path divides the
            # logits by the temperature in place)
            logits = self.model.compute_logits(hidden_states)
            self.hs_steps.append(self.hs_schedule.step_entropy(logits))
            if not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy:
                return logits.argmax(dim=-1), None
            return self._sample_from_logits(logits, sampling_metadata)

        def propose(self, num_speculative_tokens, *args, **kwargs):
            if not self.hs_active:
                return super().propose(num_speculative_tokens, *args, **kwargs)
            self.hs_steps = []
            t0 = time.perf_counter()
            ids = super().propose(num_speculative_tokens, *args, **kwargs)
            B, D = ids.shape
            if D < self.hs_schedule.positions or len(self.hs_steps) != D:
                return ids                      # a shorter step (vLLM's own schedule): nothing to decide
            ent = torch.stack([e[:B] for e in self.hs_steps], 1)
            bins, lengths = self.hs_schedule.lengths(ent)
            rec = self.hs_record_path is not None
            if rec:       # calibration: random kept lengths, so that the cost of each length is seen
                lengths = torch.tensor([self.hs_rng.randint(0, D) for _ in range(B)], dtype=torch.long,
                                       device=ids.device)
            cols = [ids.long(), lengths.view(B, 1), bins.view(B, 1)]
            if rec:
                cols.append(kwargs["next_token_ids"].long().view(B, 1)[:B])
            host = torch.cat(cols, 1).tolist()  # the one host read of the step
            out = [row[:row[D]] for row in host]
            st = self.hs_stats
            st["calls"] += 1
            st["requests"] += B
            st["drafted"] += B * D
            for row in host:
                n = row[D]
                st["kept"] += n
                st["empty"] += n == 0
                st["bins"][row[D + 1]] += 1
                for j in range(n):
                    st["kept_at"][j] += 1
            if self.hs_stats_path:
                _write_json(self.hs_stats_path, st)
            if rec:
                with open(self.hs_record_path, "a") as f:
                    f.write(json.dumps({"t0": t0, "t1": time.perf_counter(), "req_ids": list(self.hs_runner.input_batch.req_ids[:B]),
                                        "next": [row[D + 2] for row in host], "drafts": [row[:D] for row in host],
                                        "lengths": [row[D] for row in host],
                                        "entropy": ent.double().tolist()}) + "\n")
            return out

    return HeteroSpecEagleProposer


def register():
    """vLLM's general-plugin entry point (run in every vLLM process): with ``HETEROSPEC_VLLM_PROFILE`` set, vLLM's
    model runner builds :func:`proposer_class`'s proposer wherever it would build its ``EagleProposer``
    (``method="eagle3"`` only: other methods are left as they are).  Without it, nothing changes."""
    path = os.environ.get(ENV_PROFILE)
    if not path:
        return
    ChainSchedule.from_profile(path, 10**6)      # a bad profile: one line, in the process that called vLLM
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")   # the proposer hook is the V1 runner's
    import vllm.v1.worker.gpu_model_runner as gmr

    if not getattr(gmr.EagleProposer, "heterospec", False):
        gmr.EagleProposer = proposer_class()


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
    memory on the CPU backend), ``enforce_eager`` (no compilation: a faster start)) -> {"versions", "runs": one per
    batch size: {"batch", "tokens", "seconds", "new_tokens", "spec" (vLLM's counters over the timed part),
    "plugin" (the plugin's, when it is on)}}.  The plugin is on when this process's ``HETEROSPEC_VLLM_PROFILE``
    is set."""
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
              enforce_eager=bool(cfg.get("enforce_eager", False)))
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
        p = subprocess.run([python or sys.executable, "-m", "heterospec.integrations.vllm", "run", src, dst],
                           env=env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not os.path.exists(dst):
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"vLLM run failed (exit {p.returncode}):\n{tail}")
        with open(dst) as f:
            return json.load(f)


# ---- calibration from vLLM's own runs -----------------------------------------------------------------------

def read_trace(path, outputs, max_tokens):
    """A calibration trace (``HETEROSPEC_VLLM_RECORD``) against the run's greedy outputs (``outputs``: each
    prompt's new tokens, in prompt order; requests appear in the trace in that order) -> (entropy [N, D],
    accepted [N], steps: [(seconds between this propose and the next, verified tokens, requests, propose
    seconds)], checks: {"matched", "misaligned", "censored"}).  A request-step's full chain is accepted up to
    its first token that differs from the output (at temperature 0 the output is the target's greedy
    continuation); steps whose chain runs past the output's end are left out (censored), and a request whose
    recorded next token disagrees with the output is dropped from there on (misaligned)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    order = {}
    for r in records:
        for rid in r["req_ids"]:
            order.setdefault(rid, len(order))
    if len(order) != len(outputs):
        raise ValueError(f"read_trace: expected {len(outputs)} requests in {path}, got {len(order)}")
    pos = {rid: 1 for rid in order}        # output tokens already known when the request's next propose runs
    dead = set()
    ent, acc = [], []
    checks = {"matched": 0, "misaligned": 0, "censored": 0}
    for r in records:
        for rid, nxt, draft, kept, h in zip(r["req_ids"], r["next"], r["drafts"], r["lengths"], r["entropy"]):
            if rid in dead:
                continue
            out, n = outputs[order[rid]], pos[rid]
            if n > len(out) or out[n - 1] != nxt:
                checks["misaligned"] += 1
                dead.add(rid)
                continue
            if n + max_tokens > len(out):
                checks["censored"] += 1
                dead.add(rid)
                continue
            a = 0
            while a < max_tokens and draft[a] == out[n + a]:
                a += 1
            ent.append(h[:max_tokens])
            acc.append(a)
            checks["matched"] += 1
            pos[rid] = n + min(a, kept) + 1
    steps = []
    for r, q in zip(records, records[1:]):
        if q["req_ids"] == r["req_ids"]:       # the same requests go on: the gap is their verification step
            steps.append((q["t0"] - r["t1"], sum(r["lengths"]) + len(r["lengths"]), len(r["lengths"]),
                          r["t1"] - r["t0"]))
    return np.asarray(ent, np.float64).reshape(-1, max_tokens), np.asarray(acc, np.int64), steps, checks


def fit_cost(steps, max_tokens):
    """A :class:`~heterospec.tune.chain.ChainCost` from a trace's steps: the verification step's seconds fitted
    as a + b x verified tokens (least squares, over steps of the same batch), shared per request; drafting as
    the median propose time per request and drafted position."""
    from ..tune.chain import ChainCost

    if len(steps) < 8:
        raise ValueError(f"fit_cost: expected at least 8 consecutive steps of the same requests, got {len(steps)}")
    gap, verified, reqs, draft = (np.asarray(c, np.float64) for c in zip(*steps))
    b, a = np.polyfit(verified, gap, 1)
    B = float(np.median(reqs))
    return ChainCost(step=max(float(a), 0.0) / B, per_token=max(float(b), 0.0),
                     per_position=float(np.median(draft / reqs)) / max_tokens)


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
    from ..tune.chain import chain_policy, fit_chain_policy

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
    """``python -m heterospec.integrations.vllm calibrate ...`` (a chain profile from vLLM's own run) or ``run
    CONFIG.json RESULT.json`` (one :func:`run_config`, what :func:`run_vllm` starts)."""
    import argparse
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"] and len(argv) == 3:
        with open(argv[1]) as f:
            cfg = json.load(f)
        _write_json(argv[2], run_config(cfg))
        return 0
    p = argparse.ArgumentParser(prog="python -m heterospec.integrations.vllm",
                                description="heterospec's vLLM plugin: fit a chain profile from vLLM's own run")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate", help="record full chains in vLLM and fit entropy bins and a draft length per bin")
    c.add_argument("--target", required=True, help="the target's HuggingFace directory (what vLLM serves)")
    c.add_argument("--draft", required=True, help="the EAGLE-3 head's directory")
    c.add_argument("--prompts", nargs="+", required=True, help="prompt files (JSON lines or text; not benchmark questions)")
    c.add_argument("--limit", type=int, default=24, help="prompts used (default 24)")
    c.add_argument("--out", required=True, help="the profile JSON to write")
    c.add_argument("--max-tokens", type=int, default=6, help="the longest chain recorded and allowed (default 6)")
    c.add_argument("--batch", type=int, default=1, help="requests decoded together, as you will serve them (default 1)")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--top-k", type=int, default=10, help="K of the top-K entropy (default 10)")
    c.add_argument("--no-chat-template", action="store_true")
    args = p.parse_args(argv)
    for name in ("limit", "max_tokens", "batch", "max_new_tokens", "top_k"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: expected an int >= 1, got {getattr(args, name)}")
    for name in ("target", "draft"):
        if not os.path.exists(os.path.join(getattr(args, name), "config.json")):
            p.error(f"argument --{name}: expected a model directory with a config.json, got {getattr(args, name)!r}")
    from transformers import AutoTokenizer

    from ..tools.prompts import encode_turn, read_prompts

    tok = AutoTokenizer.from_pretrained(args.target)
    texts = read_prompts(args.prompts, args.limit)
    prompts = [encode_turn(tok, [t], [], not args.no_chat_template)[0].tolist() for t in texts]
    policy, need, report = calibrate_chain(args.target, args.draft, prompts, args.out, max_tokens=args.max_tokens,
                                           batch=args.batch, max_new_tokens=args.max_new_tokens, top_k=args.top_k)
    ch = report["chosen"]
    print(f"wrote {args.out}: chain lengths {ch['lengths']} over {len(ch['thresholds']) + 1} bin(s), the path "
          f"entropy of the first {ch['positions']} position(s); pass num_speculative_tokens={need}; predicted "
          f"{ch['rate']:.1f} tokens/s against {max(report['fixed'].values()):.1f} for the best fixed length "
          f"({report['request_steps']} request-steps, {report['checks']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
