"""Cycle steps 1-5 on the device: draft catch-up, tree growth with the entropy bin after the base depth,
Top-N selection and the verification tree padded to its bucket.

Draft cache layout (one static tensor, see ``Eagle3Draft.new_cache``): columns ``[0, base)`` hold the
committed positions, columns ``[base, base + K * levels)`` are the scratch rows of this cycle's tree (level
by level, K beams each).  Tree rows never touch the committed part, so nothing has to be undone after
verification: the next catch-up simply writes the accepted positions.

Candidates are numbered as EAGLE numbers them: the root expansion's K first, then K*K per level, so the
tree grown to fewer levels is a prefix of the arrays.  Every shape here depends only on (K, level, kept
nodes, bucket): fixed per tree shape, as CUDA graphs need.  State that crosses from one step to the next
lives in static buffers (the root's logits and state after catch-up) or in a :class:`Growth` whose tensors
are a captured step's outputs; no step mutates a Python object it was given, so a captured step replays
exactly what it recorded.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import ops


@dataclasses.dataclass(frozen=True)
class Growth:
    """A candidate tree grown ``level`` levels past the root expansion (device tensors, one per level)."""

    tokens: tuple             # int64 [K] (root expansion), then [K*K] per level
    scores: tuple             # float32 cumulative log-probabilities, same shapes
    parents: tuple            # int64 candidate index of the parent (-1 under the root)
    cum_h: torch.Tensor       # float64 path entropy (Eq. 1, summed root-down) of the last level's candidates
    beams: torch.Tensor       # int64 [K] the last level's K best candidates (global numbering)
    prev_offset: int          # the last level's first candidate index
    offset: int               # the next level's first candidate index
    level: int                # expansion levels after the root expansion

    def candidates(self):
        """(tokens, scores, parents) of every candidate, concatenated level by level."""
        return torch.cat(self.tokens), torch.cat(self.scores), torch.cat(self.parents)

    def path_entropy(self):
        """The path entropy of the most confident candidate of the last level (a [1] float64 tensor; an
        index_select, since indexing with a 0-d tensor would read the index on the host)."""
        return self.cum_h.index_select(0, self.beams[:1] - self.prev_offset)


def candidate_count(top_k, levels):
    """Candidates of a tree grown ``levels`` levels past the root expansion."""
    return top_k + top_k * top_k * levels


class DraftState:
    """The draft's static cache and the per-cycle scratch buffers, allocated once per capacity."""

    def __init__(self, draft, top_k, max_levels, d2t):
        self.draft, self.K, self.d2t = draft, top_k, d2t
        self.max_levels = max_levels
        self.base = 0
        self.cache = None
        self.root_logits = None   # [1, Vd] float32: the root's draft logits, written by catch_up
        self.root_h = None        # [1, H]: the root's draft state, written by catch_up

    def allocate(self, capacity, device, hidden_size):
        """Room for ``capacity`` committed positions plus the scratch rows of the deepest tree."""
        if self.cache is not None and capacity <= self.base:
            return
        K, R = self.K, self.K * self.max_levels
        self.base = capacity
        self.cache = self.draft.new_cache(capacity + R)
        self.cols = torch.arange(capacity + R, device=device)
        self.anc = torch.zeros((max(R, 1), max(R, 1)), dtype=torch.bool, device=device)  # scratch ancestry
        self.h_rows = torch.zeros((1 + R, hidden_size), dtype=self.draft_dtype(), device=device)
        self.row_of = torch.zeros(candidate_count(K, self.max_levels), dtype=torch.long, device=device)
        self.eyeK = torch.eye(K, dtype=torch.bool, device=device)
        self.zero_score = torch.zeros(1, dtype=torch.float32, device=device)
        self.no_parent = torch.full((1,), -1, dtype=torch.long, device=device)
        self.zero_row = torch.zeros(1, dtype=torch.long, device=device)

    def draft_dtype(self):
        return getattr(self.draft, "dtype", torch.float32)

    def catch_up(self, taps, ids, prefix, last):
        """Feed the committed positions prefix .. prefix+R-1 (taps [1, R, 3H] of the target, ids [1, R] the
        token after each); rows past the accepted ones are garbage the mask never shows later.  ``last``
        ([1] int64): the row whose output expands the root.  Writes the static ``root_logits`` [1, Vd] and
        ``root_h`` [1, H] (allocated by the first call, which must not be inside a graph capture)."""
        d = self.draft
        R = ids.shape[1]
        rows = prefix + self.cols[:R]
        allowed = self.cols.view(1, -1) <= rows.view(-1, 1)           # causal over the committed part
        allowed[:, self.base:] = False
        h2 = d.step(d.fuse(taps), ids, rows.view(1, R), self.cache, rows, allowed)
        logits, h = d.head(h2.index_select(1, last))
        if self.root_logits is None or self.root_logits.shape != logits[0].shape:
            self.root_logits = torch.empty_like(logits[0])
            self.root_h = torch.empty_like(h[0])
        self.root_logits.copy_(logits[0])
        self.root_h.copy_(h[0])
        return self.root_logits, self.root_h

    def start(self):
        """Expand the root (the static ``root_logits`` / ``root_h``): a Growth with 0 levels."""
        K, check = self.K, self.root_logits.device.type != "cuda"
        tok, sc, par, ent, beams = ops.expand(self.root_logits, self.zero_score, self.no_parent, K, self.d2t, 0,
                                              check=check)
        self.h_rows[0] = self.root_h[0]
        # Eq. 1 summed root-down in float64 along each candidate's path
        return Growth((tok,), (sc,), (par,), ent.double().expand(K), beams, 0, K, 0)

    def grow(self, g, levels, prefix):
        """Grow ``levels`` more levels (EAGLE-2/3 dynamic tree: one draft step and one ``ops.expand`` per
        level) on top of ``g``; returns a new Growth (``g`` is left as it is)."""
        d, K, check = self.draft, self.K, prefix.device.type != "cuda"
        tokens, scores, parents = list(g.tokens), list(g.scores), list(g.parents)
        cum_h, beams, prev_offset, offset, level = g.cum_h, g.beams, g.prev_offset, g.offset, g.level
        for _ in range(levels):
            level += 1
            r0 = (level - 1) * K                                        # this level's scratch rows
            local = beams - prev_offset                                 # beams within the previous level
            self.anc[r0:r0 + K] = False                                 # rows of an earlier cycle
            if level == 1:
                src = self.zero_row.expand(K)                           # the root's output
            else:
                prow = self.row_of[parents[-1][local]]                  # the fed row of each beam's parent
                src = prow + 1
                self.anc[r0:r0 + K, :r0] = self.anc[prow, :r0]          # the parent's ancestors and itself
            self.anc[r0:r0 + K, r0:r0 + K] = self.eyeK
            self.row_of[beams] = r0 + self.cols[:K]
            allowed = torch.empty((K, self.cols.shape[0]), dtype=torch.bool, device=beams.device)
            allowed[:, :self.base] = self.cols[:self.base] < prefix
            allowed[:, self.base:] = self.anc[r0:r0 + K]
            slots = self.base + r0 + self.cols[:K]
            ids = tokens[-1][local].view(1, K)
            pos = (prefix + (level - 1)).expand(K).view(1, K)
            h2 = d.step(self.h_rows[src].unsqueeze(0), ids, pos, self.cache, slots, allowed)
            logits, h_out = d.head(h2)
            self.h_rows[1 + r0:1 + r0 + K] = h_out[0]
            tok, sc, par, ent, beams_next = ops.expand(logits[0], scores[-1][local], beams, K, self.d2t, offset,
                                                       check=check)
            cum_h = (cum_h[local] + ent.double()).repeat_interleave(K)
            tokens.append(tok), scores.append(sc), parents.append(par)
            prev_offset, offset, beams = offset, offset + K * K, beams_next
        return Growth(tuple(tokens), tuple(scores), tuple(parents), cum_h, beams, prev_offset, offset, level)


def bucket_for(size, buckets):
    """The smallest bucket >= size (size itself without buckets or past the largest)."""
    if buckets:
        for b in buckets:
            if b >= size:
                return b
    return size


def tree_size(top_k, levels, keep):
    """Real nodes (root included) of the verification tree kept from a tree grown ``levels`` levels."""
    return min(keep - 1, candidate_count(top_k, levels)) + 1


def verification_tree(g, keep, root, buckets):
    """Steps 5: ``ops.select`` keeps the best ``keep - 1`` candidates of the Growth ``g``, ``ops.build_tree``
    makes the tree (device outputs, root token written from the device), then the tree is padded to its
    bucket.

    Padding nodes are children of the root carrying the token of node 1, the root's first child: greedy
    acceptance takes the lowest-index matching child and sampling skips a token already rejected at that
    node, so a padding node is never accepted and costs no random draw.  Each padding row sees the root
    and itself only.  Returns (tokens, parents, depths, mask) of the padded tree and the real node count."""
    cand_tokens, cand_scores, cand_parents = g.candidates()
    n = tree_size(len(g.beams), g.level, keep) - 1
    check = root.device.type != "cuda"
    sel = ops.select(cand_scores, n, check=check)
    tree, _, _ = ops.build_tree(cand_tokens, cand_parents, sel, 0, check=check, device_outputs=True)
    tokens, parents, depths, mask = tree.tokens, tree.parents, tree.depths, tree.mask
    tokens[0] = root[0]
    size = n + 1
    B = bucket_for(size, buckets) if n >= 1 else size
    if B > size:
        pad = B - size
        tokens = torch.cat([tokens, tokens[1:2].expand(pad)])
        parents = torch.cat([parents, torch.zeros(pad, dtype=parents.dtype, device=parents.device)])
        depths = torch.cat([depths, torch.ones(pad, dtype=depths.dtype, device=depths.device)])
        full = torch.zeros((B, B), dtype=torch.bool, device=mask.device)
        full[:size, :size] = mask
        full[size:, 0] = True
        full[size:, size:] = torch.eye(pad, dtype=torch.bool, device=mask.device)
        mask = full
    return tokens, parents, depths, mask, size
