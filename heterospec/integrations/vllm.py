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
one fitted from vLLM's own runs by ``heterospec calibrate --engine vllm``), so installing heterospec never
changes vLLM's behaviour by itself.  Then vLLM's own options select EAGLE-3 as usual::

    HETEROSPEC_VLLM_PROFILE=profile.json python serve.py   # LLM(..., speculative_config={"method": "eagle3",
                                                           #      "model": head, "num_speculative_tokens": 8})

``num_speculative_tokens`` is the deepest chain any bin may keep (lengths above it are cut to it) and must
cover the ``depth + 1`` positions the path entropy sums.  Optional: ``HETEROSPEC_VLLM_STATS`` (a JSON file the
proposer keeps up to date: bins chosen, tokens drafted and kept), ``HETEROSPEC_VLLM_RECORD`` (a JSON-lines trace
for the chain calibration in :mod:`heterospec.integrations.vllm_runner`: the full chains, their per-position
entropies, and random kept lengths).
"""
from __future__ import annotations

import json
import os
import random
import time

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


if __name__ == "__main__":
    raise SystemExit("python -m heterospec.integrations.vllm: the chain calibration is `heterospec calibrate "
                     "--engine vllm --target DIR --draft DIR --prompts FILE --out PROFILE` now")
