"""Chain profiles: entropy bins and a draft length per bin for an engine that verifies chains (vLLM's EAGLE
proposer with :mod:`heterospec.integrations.vllm`), fitted on a trace of full-length chains.

A trace holds, for every request-step, the per-position top-K entropies of a chain drafted to ``D`` tokens and
the number of those tokens the target accepted (at temperature 0 the accepted count of any shorter chain of the
same draft is ``min(accepted, L)``: acceptance is a prefix).  A :class:`ChainCost` prices a step: a share per
request, a share per verified token, and one per drafted position.  :func:`fit_chain_policy` then searches:

* fixed lengths L = 1 .. D (what vLLM offers: ``num_speculative_tokens``), and
* for the path entropy summed over the first p = 1, 2, 3 positions: the paper's depth-3 regression tree on it
  (:func:`heterospec.tune.bins.fit_thresholds`, 8 bins) and, for each number of drafted positions D' >= p,
  each bin's length in 0 .. D' by coordinate ascent on the trace's predicted tokens per second,

and returns the best as a :class:`~heterospec.policy.Policy` whose :meth:`~heterospec.policy.Policy.chain_lengths`
are those lengths (``depth = p - 1``; bin b keeps ``L_b + 1`` nodes with ``max(0, L_b - p)`` extra levels), with
the prediction for every candidate.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from ..policy import Policy
from .bins import fit_thresholds


@dataclasses.dataclass(frozen=True)
class ChainCost:
    """Seconds of one request-step: ``step`` + ``per_token`` x verified tokens (the drafts kept and the token
    they follow) + ``per_position`` x drafted positions."""

    step: float
    per_token: float
    per_position: float

    def seconds(self, kept, drafted):
        return self.step + self.per_token * (np.asarray(kept) + 1) + self.per_position * drafted

    def to_dict(self):
        return dataclasses.asdict(self)


def predicted_rate(accepted, lengths, drafted, cost):
    """Tokens per second over a trace whose request-steps keep ``lengths`` (per step) of ``drafted``
    positions: each commits min(accepted, length) + 1 tokens."""
    lengths = np.asarray(lengths)
    tokens = np.minimum(accepted, lengths) + 1
    return float(tokens.sum() / cost.seconds(lengths, drafted).sum())


def _best_lengths(accepted, bins, nbins, drafted, cost, sweeps=4):
    """Each bin's length in 0 .. drafted maximising the trace's predicted rate (coordinate ascent, starting
    from every bin at ``drafted``) -> (lengths per bin, rate)."""
    L = np.full(nbins, drafted)
    rate = predicted_rate(accepted, L[bins], drafted, cost)
    for _ in range(sweeps):
        changed = False
        for b in range(nbins):
            if not (bins == b).any():
                continue
            for n in range(drafted + 1):
                trial = L.copy()
                trial[b] = n
                r = predicted_rate(accepted, trial[bins], drafted, cost)
                if r > rate + 1e-12:
                    L, rate, changed = trial, r, True
        if not changed:
            break
    return L, rate


def chain_policy(lengths, thresholds=(), positions=None, *, top_k=10, name="vllm-chain"):
    """The Policy whose chain lengths are ``lengths`` (one per bin; ``positions``: the drafted positions whose
    entropy picks the bin, default the longest length)."""
    lengths = [int(n) for n in lengths]
    p = positions or max(max(lengths), 1)
    if len(lengths) == 1 and not thresholds:
        return Policy(p - 1, top_k, lengths[0] + 1, name=name)
    return Policy(p - 1, top_k, max(lengths) + 1, tuple(float(t) for t in thresholds),
                  tuple(max(0, n - p) for n in lengths), tuple(n + 1 for n in lengths), name=name)


def fit_chain_policy(entropy, accepted, cost, *, top_k=10, positions=(1, 2, 3), depth=3, min_leaf=None):
    """Fit a chain profile on a trace (module doc): ``entropy`` [N, D] per-position top-K entropies of full chains
    of D tokens, ``accepted`` [N] their accepted counts (0 .. D), ``cost`` a :class:`ChainCost`.  Returns
    (Policy, num_speculative_tokens it needs, report: every candidate's predicted tokens/s)."""
    entropy = np.asarray(entropy, np.float64)
    accepted = np.asarray(accepted, np.int64)
    if entropy.ndim != 2 or accepted.shape != (entropy.shape[0],) or entropy.shape[0] == 0:
        raise ValueError(f"fit_chain_policy: arguments 'entropy' [N, D] and 'accepted' [N] expected matching, non-empty "
                         f"shapes, got {entropy.shape} and {accepted.shape}")
    N, D = entropy.shape
    if accepted.min() < 0 or accepted.max() > D:
        raise ValueError(f"fit_chain_policy: argument 'accepted' expected counts in [0, {D}], got "
                         f"[{accepted.min()}, {accepted.max()}]")
    min_leaf = min_leaf or max(10, N // 40)
    report = {"fixed": {}, "binned": {}}
    best = None
    for L in range(1, D + 1):
        r = predicted_rate(accepted, np.full(N, L), L, cost)
        report["fixed"][L] = r
        if best is None or r > best[0]:
            best = (r, chain_policy([L], top_k=top_k), L)
    for p in positions:
        if p > D:
            continue
        x = entropy[:, :p].sum(1)
        thresholds = [float(t) for t in fit_thresholds(x, accepted.astype(np.float64), depth=depth,
                                                       min_leaf=min_leaf)]
        if not thresholds:
            continue
        bins = (x[:, None] > np.asarray(thresholds)[None, :]).sum(1)
        for drafted in range(p, D + 1):
            lengths, r = _best_lengths(accepted, bins, len(thresholds) + 1, drafted, cost)
            report["binned"][f"p={p},D={drafted}"] = {"rate": r, "lengths": lengths.tolist(),
                                                     "thresholds": list(thresholds)}
            if r > best[0]:
                best = (r, chain_policy(lengths, thresholds, p, top_k=top_k), drafted)
    rate, policy, need = best
    report["chosen"] = {"rate": rate, "num_speculative_tokens": need, "lengths": list(policy.chain_lengths()),
                        "positions": policy.depth + 1, "thresholds": list(policy.thresholds)}
    return policy, need, report


# ---- the trace the vLLM plugin records (HETEROSPEC_VLLM_RECORD), read against the run's own outputs -----------

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
    """A :class:`ChainCost` from a trace's steps: the verification step's seconds fitted
    as a + b x verified tokens (least squares, over steps of the same batch), shared per request; drafting as
    the median propose time per request and drafted position."""
    if len(steps) < 8:
        raise ValueError(f"fit_cost: expected at least 8 consecutive steps of the same requests, got {len(steps)}")
    gap, verified, reqs, draft = (np.asarray(c, np.float64) for c in zip(*steps))
    b, a = np.polyfit(verified, gap, 1)
    B = float(np.median(reqs))
    return ChainCost(step=max(float(a), 0.0) / B, per_token=max(float(b), 0.0),
                     per_position=float(np.median(draft / reqs)) / max_tokens)
