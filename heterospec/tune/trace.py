"""Traces: record once, replay any policy exactly.

Greedy output does not depend on the tree policy, and the draft tree at an output position depends only on
the prefix.  So :func:`record` decodes each prompt greedily once and, at every position of the output, grows
the *maximal* draft tree (base depth + the largest extension considered) with the engine's own drafter
(:class:`heterospec.engine.tree.DraftState`, level by level), keeping a host copy of its candidates and, after
every level, the engine's own path entropy and best candidate.  Candidates are numbered level by level, so
the tree any policy would grow there (fewer levels) is a prefix of the recorded arrays, and
:meth:`Trace.replay` can walk the output as the live loop would -- entropy -> bin -> extra depth and kept
nodes -> selected subtree -> accepted length = the longest tree path matching the greedy output -> next
cycle after the accepted tokens and the bonus token -- without running a model.

The draft's inputs are the target's taps of one forward over the whole output, where live decoding has them
from tree verifications: the same values up to float rounding.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

from .. import ops
from ..engine import GenerationStats, HeteroSpec
from ..engine.tree import DraftState
from ..models import cpu_decoder as decoder
from ..models.target import TargetAdapter, _decoder_layers

TRACE_VERSION = 2
_TREE_FIELDS = ("tokens", "scores", "parents", "path_h", "level_best")


@dataclasses.dataclass
class CandidateTree:
    """All candidates of one cycle's draft tree, numbered level by level (the root expansion's K first,
    then K*K per level), so the tree grown to fewer levels is a prefix of these arrays: a host copy of the
    engine's :class:`~heterospec.growth.Growth`."""

    tokens: np.ndarray        # int64 [M] target-vocabulary ids
    scores: np.ndarray        # float32 [M] cumulative log-probabilities
    parents: np.ndarray       # int64 [M] candidate index of the parent, -1 under the root
    path_h: np.ndarray        # float64 [levels + 1]: Growth.path_entropy() after each level
    level_best: np.ndarray    # int64 [levels + 1]: the best-scoring candidate of each level
    top_k: int

    def size(self, levels):
        """Number of candidates in the tree grown to ``levels`` levels after the root expansion."""
        return self.top_k + self.top_k * self.top_k * levels

    def path_entropy(self, levels):
        """The engine's path entropy (paper Eq. 1 along P*, :meth:`Growth.path_entropy`) at ``levels``."""
        return float(self.path_h[levels])


@dataclasses.dataclass
class Trace:
    meta: dict
    prompts: list          # int64 arrays, one per prompt
    outputs: list          # int64 arrays: the greedy continuation, longer than max_new_tokens by the depth
    trees: list            # per prompt: a list of CandidateTree, one per cycle position t (root = outputs[t])

    @property
    def top_k(self):
        return int(self.meta["top_k"])

    @property
    def levels(self):
        return int(self.meta["levels"])

    @property
    def max_new_tokens(self):
        return int(self.meta["max_new_tokens"])

    # ---- replay -------------------------------------------------------------------------------------

    def replay(self, policy, cost_model=None):
        """Walk every recorded output as the live loop with ``policy`` would (greedy, no EOS) and return its
        :class:`~heterospec.engine.GenerationStats` (the type ``generate`` returns); with a cost model
        (``cost_model(tree_tokens, context_len, levels, beam)`` -> seconds per cycle) its times are the
        predicted ones (``total_s``, ``bin_s``, ``tokens_per_s``; ``predicted`` is True)."""
        drafts = policy.drafts
        if drafts:
            if policy.top_k != self.top_k:
                raise ValueError(f"replay: argument 'policy' expected top_k = {self.top_k} (the trace's), "
                                 f"got {policy.top_k}")
            if policy.levels > self.levels:
                raise ValueError(f"replay: argument 'policy' needs {policy.levels} levels, the trace has {self.levels}")
        stats = GenerationStats(predicted=cost_model is not None)
        for prompt, out, trees in zip(self.prompts, self.outputs, self.trees):
            n_new = self.max_new_tokens
            stats.new_tokens += n_new
            t = 0
            while t + 1 < n_new:
                b, levels = None, 0
                if drafts:
                    tree = trees[t]
                    keep = policy.total_tokens
                    levels = policy.depth
                    if policy.binned:            # as the engine decides
                        b, extra, keep = policy.plan(tree.path_entropy(policy.depth))
                        levels += extra
                    m = tree.size(levels)
                    sel = ops.select(tree.scores[:m], min(keep - 1, m))
                    accepted = _accepted_length(tree.tokens[:m], tree.parents[:m], sel, out[t + 1:])
                    nodes = sel.shape[0] + 1
                else:
                    accepted, nodes = 0, 1
                stats.cycles += 1
                stats.verified_tokens += nodes
                stats.accepted_hist[accepted] += 1
                cost = (cost_model(nodes, len(prompt) + t, levels, self.top_k if drafts else 0)
                        if cost_model is not None else 0.0)
                stats.total_s += cost
                if b is not None:
                    stats.bins[b] += 1
                    stats.bin_accepted[b] += accepted
                    stats.bin_verified[b] += nodes
                    stats.bin_s[b] += cost
                t += accepted + 1
        return stats

    # ---- features for fitting bins ------------------------------------------------------------------

    def features(self, base_depth, total_tokens, target="rank"):
        """(x, y) over every recorded position for a static tree (base_depth, total_tokens):
        x = cumulative top-K entropy along P* at the base depth; y = ``"rank"``: the rank (0 = best) of P*'s
        final candidate among the selected Top-N by score (the paper's TCR-like target), or ``"accepted"``:
        the accepted length of that tree at the position."""
        if target not in ("rank", "accepted"):
            raise ValueError(f"features: argument 'target' expected 'rank' or 'accepted', got {target!r}")
        xs, ys = [], []
        for out, trees in zip(self.outputs, self.trees):
            for t, tree in enumerate(trees):
                xs.append(tree.path_entropy(base_depth))
                m = tree.size(base_depth)
                sel = ops.select(tree.scores[:m], min(total_tokens - 1, m))
                if target == "accepted":
                    ys.append(_accepted_length(tree.tokens[:m], tree.parents[:m], sel, out[t + 1:]))
                else:
                    leaf = tree.level_best[base_depth]
                    ys.append(int(np.sum(tree.scores[sel] > tree.scores[leaf])))
        return np.asarray(xs, np.float64), np.asarray(ys, np.float64)

    # ---- files ----------------------------------------------------------------------------------------

    def save(self, path):
        """``path`` + ``.npz`` (arrays) and ``path`` + ``.json`` (metadata)."""
        arrays = {}
        for i, (p, o, trees) in enumerate(zip(self.prompts, self.outputs, self.trees)):
            arrays[f"p{i}_prompt"] = p
            arrays[f"p{i}_output"] = o
            for f in _TREE_FIELDS:
                arrays[f"p{i}_{f}"] = np.stack([getattr(tr, f) for tr in trees]) if trees else np.zeros((0,))
        np.savez_compressed(str(path) + ".npz", **arrays)
        with open(str(path) + ".json", "w") as f:
            json.dump({**self.meta, "version": TRACE_VERSION, "n_prompts": len(self.prompts)}, f, indent=1)

    @classmethod
    def load(cls, path):
        try:
            with open(str(path) + ".json") as f:
                meta = json.load(f)
            data = np.load(str(path) + ".npz")
        except (OSError, ValueError) as e:
            raise ValueError(f"Trace.load: could not read the trace at {path!r}: {e}") from None
        if meta.get("version") != TRACE_VERSION:
            raise ValueError(f"Trace.load: expected trace version {TRACE_VERSION}, got {meta.get('version')!r}")
        prompts, outputs, trees = [], [], []
        for i in range(int(meta["n_prompts"])):
            prompts.append(data[f"p{i}_prompt"])
            outputs.append(data[f"p{i}_output"])
            fields = [data[f"p{i}_{f}"] for f in _TREE_FIELDS]
            trees.append([CandidateTree(*(a[j] for a in fields), int(meta["top_k"])) for j in range(fields[0].shape[0])])
        return cls(meta, prompts, outputs, trees)


def _accepted_length(tokens, parents, selected, continuation):
    """Longest path of the selected subtree whose tokens equal the greedy continuation (what
    verify_greedy accepts there).  A walk over depth."""
    in_tree = np.zeros(tokens.shape[0], dtype=bool)
    in_tree[selected] = True
    node, n = -1, 0
    while n < len(continuation):
        hit = np.flatnonzero(in_tree & (parents == node) & (tokens == continuation[n]))
        if hit.size == 0:
            break
        node, n = int(hit[0]), n + 1
    return n


@torch.no_grad()
def record(target, draft, prompts, *, max_new_tokens, top_k=10, levels=11, progress=None, cpu_decoder="auto"):
    """Decode each prompt ([1, S] tensors) greedily and record, at every cycle position of the output,
    the maximal draft tree with ``levels`` levels after the root expansion (the base depth plus the
    largest extension any replayed policy may use), grown by the engine's drafter (``cpu_decoder``: the engines'
    setting, for the greedy decoding and the draft's steps)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"record: argument 'max_new_tokens' expected an int >= 2, got {max_new_tokens!r}")
    ar = HeteroSpec(target, cuda_graphs=False, cpu_decoder=cpu_decoder)   # the eager engine, as calibration decodes
    taps_layers = draft.config.tap_layers(len(_decoder_layers(target))) if hasattr(draft, "config") else None
    adapter = TargetAdapter(target, tap_layers=taps_layers, capture_taps=True)
    dev = next(target.parameters()).device
    d2t = getattr(draft, "d2t", None)
    d2t = d2t.detach().to(dev, torch.long) if d2t is not None and bool(torch.any(d2t != 0)) else None
    # a batch of one, its steps on the engines' own path
    ds = DraftState(draft, top_k, levels, d2t, fast=decoder.for_draft(cpu_decoder, draft))
    out_prompts, outputs, trees = [], [], []
    try:
        for i, prompt in enumerate(prompts):
            S = prompt.shape[1]
            # the greedy continuation, long enough for the last cycles' acceptance past the budget
            seq, _ = ar.generate(prompt, max_new_tokens=max_new_tokens + levels + 2, eos_token_id=[])
            seq = seq.to(dev)  # generate returns host ids; the target may live on a GPU
            out = seq[0, S:].cpu().numpy().astype(np.int64)
            _, taps = adapter.prefill(seq)  # the target's taps of every position, in one forward
            ds.allocate(S + max_new_tokens, dev)
            per_pos = []
            for t in range(max_new_tokens - 1):
                P = S + t  # committed positions when out[t] (= seq[P]) is the root
                if t == 0:
                    ds.prime(taps[:, :S], seq[:, 1:S + 1], torch.full((1,), S - 1, dtype=torch.long, device=dev),
                             prompt=prompt)
                else:      # the position the previous root was committed at
                    ds.catch_up(taps[:, P - 1:P], seq[:, P:P + 1], torch.full((1,), P - 1, dtype=torch.long, device=dev),
                                torch.zeros(1, dtype=torch.long, device=dev))
                per_pos.append(_grown(ds, torch.full((1,), P, dtype=torch.long, device=dev), levels))
            out_prompts.append(prompt[0].cpu().numpy().astype(np.int64))
            outputs.append(out)
            trees.append(per_pos)
            if progress is not None:
                progress(i + 1, len(prompts))
    finally:
        ar.close()
        adapter.close()
    meta = {"top_k": top_k, "levels": levels, "max_new_tokens": max_new_tokens,
            "target": getattr(target.config, "_name_or_path", "") or type(target).__name__,
            "draft": str(getattr(getattr(draft, "config", None), "name_or_path", "") or type(draft).__name__)}
    return Trace(meta, out_prompts, outputs, trees)


def _grown(ds, prefix, levels):
    """The engine's tree at one position, grown one level at a time (growing a then b levels is growing a + b:
    the engine grows the base depth, then a bin's extra levels), as a host CandidateTree."""
    g = ds.grow(None, 0, prefix)
    path_h, best = [g.path_entropy()], [g.beams[:, 0]]
    for _ in range(levels):
        g = ds.grow(g, 1, prefix)
        path_h.append(g.path_entropy())
        best.append(g.beams[:, 0])
    tokens, scores, parents = (x[0].cpu().numpy() for x in g.candidates())      # the batch's one row
    return CandidateTree(tokens.astype(np.int64), scores.astype(np.float32), parents.astype(np.int64),
                         torch.cat(path_h).cpu().numpy().astype(np.float64),
                         torch.cat(best).cpu().numpy().astype(np.int64), ds.K)


__all__ = ["Trace", "CandidateTree", "record"]
