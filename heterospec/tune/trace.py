"""Traces: record once, replay any policy exactly.

Greedy output does not depend on the tree policy, and the draft tree at an output position depends only on
the prefix.  So :func:`record` decodes each prompt greedily once and, at every position of the output,
grows the *maximal* draft tree (base depth + the largest extension considered).  Candidates are numbered
level by level, so the tree any policy would grow there (fewer levels) is a prefix of the recorded arrays,
and :meth:`Trace.replay` can walk the output as the live loop would -- entropy -> bin -> extra depth and kept
nodes -> selected subtree -> accepted length = the longest tree path matching the greedy output -> next
cycle after the accepted tokens and the bonus token -- without running a model.
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import torch

from .. import ops
from ..engine import GenerationStats, HeteroSpec
from ..models.target import TargetAdapter, _decoder_layers

TRACE_VERSION = 1


# ---- the recorded trees --------------------------------------------------------------------------------


@dataclasses.dataclass
class CandidateTree:
    """All candidates of one cycle's draft tree, numbered level by level (the root expansion's K first,
    then K*K per level), so the tree grown to fewer levels is a prefix of these arrays."""

    tokens: np.ndarray        # int64 [M] target-vocabulary ids
    scores: np.ndarray        # float32 [M] cumulative log-probabilities
    parents: np.ndarray       # int64 [M] candidate index of the parent, -1 under the root
    row_entropy: np.ndarray   # float32 [1 + fed rows]: top-K entropy of each draft row (row 0: the root)
    row_of: np.ndarray        # int64 [M] fed row of a candidate that became a beam, else -1
    level_best: np.ndarray    # int64 [levels + 1]: the best-scoring candidate of each level
    top_k: int

    def size(self, levels):
        """Number of candidates in the tree grown to ``levels`` levels after the root expansion."""
        return self.top_k + self.top_k * self.top_k * levels

    def path_entropy(self, levels):
        """Cumulative top-K entropy (paper Eq. 1) along P* at ``levels``: P* is the path to the
        best-scoring candidate of that level; the sum runs over the distributions that produced its tokens
        (the root row and the row of every ancestor).  A walk over depth, not over nodes."""
        rows = []
        c = int(self.parents[self.level_best[levels]])
        while c >= 0:
            rows.append(1 + int(self.row_of[c]))
            c = int(self.parents[c])
        h = float(self.row_entropy[0])
        for r in reversed(rows):  # root-down, in float64: the engine's order, so both pick the same bin
            h += float(self.row_entropy[r])
        return h


def grow_tree(draft, kv, root_logits, h_root, P, K, base_depth, d2t, decide=None, stats=None):
    """Grow one cycle's draft tree on the host for a trace (EAGLE-2/3 dynamic tree, one draft forward +
    one ``ops.expand`` per level; the engine grows the same tree on the device, heterospec.engine.tree).  ``kv`` is the draft cache of the committed prefix (P positions); ``root_logits`` [1, Vd] and
    ``h_root`` [1, H] are the draft's output at the last committed position.  After ``base_depth`` levels
    ``decide(path_entropy)`` (if given) returns how many extra levels to grow."""
    t1 = time.perf_counter()
    tok, sc, par, ent, beams = ops.expand(root_logits.float().cpu().numpy(), np.zeros(1, np.float32),
                                          np.full(1, -1, np.int64), K, d2t, 0)
    ops_s = time.perf_counter() - t1
    draft_s = 0.0
    tokens, scores, parents, src = [tok], [sc], [par], [np.full(K, -1, np.int64)]
    row_entropy = [ent]                  # per fed row: entropy of its distribution (row 0: the root)
    row_of = np.full(K, -1, np.int64)    # candidate -> fed tree row (-1: not fed)
    level_best = [int(beams[0])]
    h_rows = h_root                      # hidden inputs by source row: index 0 = the root's output
    dev = h_root.device
    tree_mask = torch.zeros((0, 0), dtype=torch.bool, device=dev)
    n_rows, offset, level, depth = 0, K, 0, base_depth
    candidate = None
    while level < depth:
        level += 1
        all_scores = np.concatenate(scores)
        all_tokens = np.concatenate(tokens)
        all_parents = np.concatenate(parents)
        all_src = np.concatenate(src)
        # the beams' inputs: their own token, the draft output of the row that produced them
        t0 = time.perf_counter()
        parent_rows = np.where(all_parents[beams] >= 0, row_of[np.maximum(all_parents[beams], 0)], -1)
        prow = torch.from_numpy(parent_rows).to(dev)
        new_mask = torch.zeros((K, n_rows + K), dtype=torch.bool, device=dev)
        if n_rows:
            has = prow >= 0
            new_mask[has, :n_rows] = tree_mask[prow[has]]
        new_mask[:, n_rows:] = torch.eye(K, dtype=torch.bool, device=dev)
        full_mask = torch.cat([torch.ones((K, P), dtype=torch.bool, device=dev), new_mask], dim=1)
        hid = h_rows[torch.from_numpy(all_src[beams] + 1).to(dev)].unsqueeze(0)
        ids = torch.from_numpy(all_tokens[beams]).to(dev).view(1, K)
        pos = torch.full((1, K), P + level - 1, dtype=torch.long, device=dev)
        lg, hl, kv = draft(hid, ids, pos, past_kv=kv, attn_mask=full_mask)
        draft_s += time.perf_counter() - t0
        # bookkeeping of the fed rows
        grown = torch.zeros((n_rows + K, n_rows + K), dtype=torch.bool, device=dev)
        grown[:n_rows, :n_rows] = tree_mask
        grown[n_rows:] = new_mask
        tree_mask = grown
        row_of = np.concatenate([row_of, np.full(K * K, -1, np.int64)])
        row_of[beams] = n_rows + np.arange(K)
        h_rows = torch.cat([h_rows, hl[0]], dim=0)
        t1 = time.perf_counter()
        tok, sc, par, ent, nbeams = ops.expand(lg[0].float().cpu().numpy(), all_scores[beams], beams, K, d2t,
                                               offset)
        ops_s += time.perf_counter() - t1
        tokens.append(tok), scores.append(sc), parents.append(par), row_entropy.append(ent)
        src.append(n_rows + np.repeat(np.arange(K), K))  # each child's hidden: its parent beam's row
        n_rows += K
        offset += K * K
        beams = nbeams
        level_best.append(int(nbeams[0]))
        if level == base_depth and decide is not None:
            candidate = CandidateTree(np.concatenate(tokens), None, np.concatenate(parents),
                                      np.concatenate(row_entropy), row_of, np.array(level_best), K)
            depth = base_depth + decide(candidate.path_entropy(base_depth))
    if stats is not None:
        stats.draft_s += draft_s
        stats.ops_s += ops_s
    return CandidateTree(np.concatenate(tokens), np.concatenate(scores), np.concatenate(parents),
                         np.concatenate(row_entropy), row_of, np.array(level_best, dtype=np.int64), K)



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
                    if policy.thresholds:
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
            for f in ("tokens", "scores", "parents", "row_entropy", "row_of", "level_best"):
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
            fields = [data[f"p{i}_{f}"] for f in ("tokens", "scores", "parents", "row_entropy", "row_of", "level_best")]
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
def record(target, draft, prompts, *, max_new_tokens, top_k=10, levels=11, progress=None):
    """Decode each prompt ([1, S] tensors) greedily and record, at every cycle position of the output,
    the maximal draft tree with ``levels`` levels after the root expansion (the base depth plus the
    largest extension any replayed policy may use)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"record: argument 'max_new_tokens' expected an int >= 2, got {max_new_tokens!r}")
    ar = HeteroSpec(target)
    taps_layers = draft.config.tap_layers(len(_decoder_layers(target))) if hasattr(draft, "config") else None
    adapter = TargetAdapter(target, tap_layers=taps_layers, capture_taps=True)
    d2t = None
    if getattr(draft, "d2t", None) is not None and bool(torch.any(draft.d2t != 0)):
        d2t = draft.d2t.detach().cpu().numpy().astype(np.int64)
    out_prompts, outputs, trees = [], [], []
    try:
        for i, prompt in enumerate(prompts):
            S = prompt.shape[1]
            # the greedy continuation, long enough for the last cycles' acceptance past the budget
            seq, _ = ar.generate(prompt, max_new_tokens=max_new_tokens + levels + 2)
            seq = seq.to(prompt.device)  # generate returns host ids; the target may live on a GPU
            out = seq[0, S:].cpu().numpy().astype(np.int64)
            _, taps = adapter.prefill(seq)  # the target's taps of every position, in one forward
            if hasattr(draft, "begin_sequence"):
                draft.begin_sequence(prompt)
            kv, done, per_pos = None, 0, []
            for t in range(max_new_tokens - 1):
                P = S + t  # committed positions in the target cache when out[t] is the root
                hidden = draft.fuse(taps[:, done:P])
                ids = seq[:, done + 1:P + 1]
                pos = torch.arange(done, P, device=seq.device).view(1, -1)
                logits, h, kv = draft(hidden, ids, pos, past_kv=kv, attn_mask=None)
                done = P
                per_pos.append(grow_tree(draft, kv, logits[0, -1:], h[0, -1:], P, top_k, levels, d2t))
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


__all__ = ["Trace", "CandidateTree", "record"]
