"""The drafters: cycle steps 1-5 and the draft's side of step 8 on the device.  :class:`DraftState` (an
EAGLE-3 draft): draft catch-up, tree growth with the path entropy after the base depth, Top-N selection and
the verification tree padded to its bucket; :class:`NoDraft` (autoregressive decoding): the root alone.
Both answer the same calls (``prime``, ``grow``, ``tree``, ``rows``, ``follow``), so the cycle
(:mod:`.cycle`) has no branch on whether there is a draft.

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

import torch

from .. import ops
from ..growth import Growth, candidate_count
from . import health


class DraftState:
    """The draft's static cache and the per-cycle scratch buffers, allocated once per capacity."""

    batch = None   # one request: unbatched buffers (BatchDraftState: a leading [batch] dimension on each)

    def __init__(self, draft, top_k, max_levels, d2t):
        self.draft, self.K, self.d2t = draft, top_k, d2t
        self.max_levels = max_levels
        self.base = 0
        self.cache = None
        self.root_logits = None   # [1, Vd] float32: the root's draft logits, written by catch_up
        self.root_h = None        # [1, H]: the root's draft state, written by catch_up
        self.bad = None           # [1] int64 (a batch: [batch]): the draft's logits were not finite (engine.health)

    def allocate(self, capacity, device):
        """Room for ``capacity`` committed positions plus the scratch rows of the deepest tree."""
        if self.cache is not None and capacity <= self.base:
            return
        K, R = self.K, self.K * self.max_levels
        lead = () if self.batch is None else (self.batch,)
        self.base = capacity
        self.cache = self.draft.new_cache(capacity + R, self.batch or 1)
        self.cols = torch.arange(capacity + R, device=device)
        self.anc = torch.zeros(lead + (max(R, 1), max(R, 1)), dtype=torch.bool, device=device)  # scratch ancestry
        hidden_size = self.draft.config.hidden_size if hasattr(self.draft, "config") else self.draft.hidden_size
        self.h_rows = torch.zeros(lead + (1 + R, hidden_size), dtype=self.draft_dtype(), device=device)
        self.row_of = torch.zeros(lead + (candidate_count(K, self.max_levels),), dtype=torch.long, device=device)
        self.eyeK = torch.eye(K, dtype=torch.bool, device=device)
        self.zero_score = torch.zeros(lead + (1,), dtype=torch.float32, device=device)
        self.no_parent = torch.full(lead + (1,), -1, dtype=torch.long, device=device)
        self.zero_row = torch.zeros(1, dtype=torch.long, device=device)
        self.bad = torch.zeros(self.batch or 1, dtype=torch.long, device=device)

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
        return self._store_root(logits[0], h[0])

    def _store_root(self, logits, h):
        """Write the root's draft logits and state into the static ``root_logits`` / ``root_h`` in place, so that
        a recorded step reads them where the recording wrote them (allocated by the first call, which must not
        be inside a graph capture, or anew when the batch changed: ``keep_rows``)."""
        if self.root_logits is None or self.root_logits.shape != logits.shape:
            self.root_logits, self.root_h = torch.empty_like(logits), torch.empty_like(h)
        self.root_logits.copy_(logits)
        health.mark(self.bad, logits)
        self.root_h.copy_(h)
        return self.root_logits, self.root_h

    def prime(self, taps, ids, last, prompt=None):
        """The draft's catch-up on a whole prefix from position 0 (after the target's prefill): ``taps``
        [1, S, 3H], ``ids`` [1, S] the token after each position, ``last`` [1] the row that expands the root;
        a draft with ``begin_sequence`` is told the ``prompt`` first."""
        if prompt is not None and hasattr(self.draft, "begin_sequence"):
            self.draft.begin_sequence(prompt)
        self.catch_up(taps, ids, torch.zeros_like(last), last)

    def rows(self, g, tree_size):
        """Positions a cycle may commit, the catch-up's fixed row count: the tree's depth (``g.level + 2``:
        the root expansion, the levels, the bonus token), at most the tree's size."""
        return min(tree_size, g.level + 2)

    def follow(self, vtaps, kept, path_tokens, length, nxt, prefix):
        """Step 8's draft side: catch up on the accepted positions straight from the padded path, before the
        prefix moves.  ``kept`` [R]: the path's tree rows (padding clamped to the root), ``path_tokens`` their
        tokens, ``length`` [1] the accepted count including the root, ``nxt`` [1] the bonus token."""
        ids = torch.cat([path_tokens[1:], nxt.view(1)])
        last = (length - 1).view(1)
        ids.scatter_(0, last, nxt.view(1))
        self.catch_up(vtaps[:, kept], ids.view(1, -1), prefix, last)

    def tree(self, g, keep, root, buckets):
        """Step 5 on the Growth ``g``: :func:`verification_tree`."""
        return verification_tree(g, keep, root, buckets)

    def start(self):
        """Expand the root (the static ``root_logits`` / ``root_h``): a Growth with 0 levels."""
        g = Growth.root(self.root_logits, self.K, self.d2t, zero_score=self.zero_score, no_parent=self.no_parent,
                        check=self.root_logits.device.type != "cuda")
        self.h_rows[0] = self.root_h[0]
        return g

    def grow(self, g, levels, prefix):
        """Grow ``levels`` more levels (EAGLE-2/3 dynamic tree: one draft step and one ``ops.expand`` per
        level) on top of ``g`` (None: the root expansion first); returns a new Growth (``g`` is left as it
        is).  Growing a levels then b more is growing a + b at once: the trace records level by level."""
        if g is None:
            g = self.start()
        if not levels:
            return g
        d, K, check = self.draft, self.K, prefix.device.type != "cuda"
        for _ in range(levels):
            level = g.level + 1
            r0 = (level - 1) * K                                        # this level's scratch rows
            local = g.local_beams()                                     # beams within the previous level
            self.anc[r0:r0 + K] = False                                 # rows of an earlier cycle
            if level == 1:
                src = self.zero_row.expand(K)                           # the root's output
            else:
                prow = self.row_of[g.parents[-1][local]]                # the fed row of each beam's parent
                src = prow + 1
                self.anc[r0:r0 + K, :r0] = self.anc[prow, :r0]          # the parent's ancestors and itself
            self.anc[r0:r0 + K, r0:r0 + K] = self.eyeK
            self.row_of[g.beams] = r0 + self.cols[:K]
            allowed = torch.empty((K, self.cols.shape[0]), dtype=torch.bool, device=g.beams.device)
            allowed[:, :self.base] = self.cols[:self.base] < prefix
            allowed[:, self.base:] = self.anc[r0:r0 + K]
            slots = self.base + r0 + self.cols[:K]
            ids = g.tokens[-1][local].view(1, K)
            pos = (prefix + (level - 1)).expand(K).view(1, K)
            h2 = d.step(self.h_rows[src].unsqueeze(0), ids, pos, self.cache, slots, allowed)
            logits, h_out = d.head(h2)
            self.h_rows[1 + r0:1 + r0 + K] = h_out[0]
            health.mark(self.bad, logits)
            g = g.extend(logits[0], self.d2t, check=check)
        return g


class BatchDraftState(DraftState):
    """:class:`DraftState` over a batch of requests (issue 29): one static draft cache of ``batch`` rows
    ([2, batch, kv_heads, capacity + K * levels, head_dim]), each row with its own committed prefix; every
    buffer gains a leading ``[batch]`` dimension and the Growth is batched (``ops.expand``'s batched form).
    The scratch columns of a cycle's tree are the same columns in every row, so growth writes them with one
    ``index_copy_``; the catch-up writes each row at its own prefix.  Row b computes what :class:`DraftState`
    computes for request b alone."""

    def __init__(self, draft, top_k, max_levels, d2t, batch):
        super().__init__(draft, top_k, max_levels, d2t)
        self.batch = batch

    def keep_rows(self, idx):
        """Keep the requests ``idx`` (a [b'] int64 tensor of row numbers, ascending) and drop the others: the
        finished requests of a batch stop costing work."""
        self.batch = int(idx.shape[0])
        self.cache = self.cache.index_select(1, idx)
        for name in ("anc", "h_rows", "row_of", "zero_score", "no_parent", "root_logits", "root_h", "bad"):
            setattr(self, name, getattr(self, name).index_select(0, idx))

    def catch_up(self, taps, ids, prefix, last):
        """Feed each row's positions prefix[b] .. prefix[b]+R-1 (taps [B, R, 3H], ids [B, R]); ``last`` [B]: the
        row whose output expands each request's root.  Writes ``root_logits`` [B, 1, Vd] and ``root_h`` [B, 1, H]."""
        d = self.draft
        B, R = ids.shape
        rows = prefix.view(B, 1) + self.cols[:R]                       # [B, R]: each request's own columns
        allowed = self.cols.view(1, 1, -1) <= rows.view(B, R, 1)          # causal over the committed part
        allowed[:, :, self.base:] = False
        h2 = d.step(d.fuse(taps), ids, rows, self.cache, rows, allowed)
        sel = h2.gather(1, last.view(B, 1, 1).expand(B, 1, h2.shape[-1]))
        logits, h = d.head(sel)
        return self._store_root(logits, h)

    def start(self):
        g = Growth.root(self.root_logits, self.K, self.d2t, zero_score=self.zero_score, no_parent=self.no_parent,
                        check=self.root_logits.device.type != "cuda")
        self.h_rows[:, 0] = self.root_h[:, 0]
        return g

    def grow(self, g, levels, prefix):
        if g is None:
            g = self.start()
        d, B, K, check = self.draft, self.batch, self.K, prefix.device.type != "cuda"
        H = self.h_rows.shape[-1]
        for _ in range(levels):
            level = g.level + 1
            r0 = (level - 1) * K                                        # this level's scratch rows (every request)
            local = g.local_beams()                                     # [B, K]
            self.anc[:, r0:r0 + K] = False
            if level == 1:
                src = torch.zeros((B, K), dtype=torch.long, device=prefix.device)
            else:
                prow = self.row_of.gather(1, g.parents[-1].gather(1, local))   # the fed row of each beam's parent
                src = prow + 1
                self.anc[:, r0:r0 + K, :r0] = self.anc[:, :, :r0].gather(1, prow.view(B, K, 1).expand(B, K, r0))
            self.anc[:, r0:r0 + K, r0:r0 + K] = self.eyeK
            self.row_of.scatter_(1, g.beams, (r0 + self.cols[:K]).expand(B, K))
            allowed = torch.empty((B, K, self.cols.shape[0]), dtype=torch.bool, device=prefix.device)
            allowed[:, :, :self.base] = self.cols[:self.base].view(1, 1, -1) < prefix.view(B, 1, 1)
            allowed[:, :, self.base:] = self.anc[:, r0:r0 + K]
            slots = self.base + r0 + self.cols[:K]
            ids = g.tokens[-1].gather(1, local)
            pos = (prefix + (level - 1)).view(B, 1).expand(B, K)
            h2 = d.step(self.h_rows.gather(1, src.view(B, K, 1).expand(B, K, H)), ids, pos, self.cache, slots,
                        allowed)
            logits, h_out = d.head(h2)
            self.h_rows[:, 1 + r0:1 + r0 + K] = h_out
            health.mark(self.bad, logits)
            g = g.extend(logits, self.d2t, check=check)
        return g

    def follow(self, vtaps, kept, path_tokens, length, nxt, prefix):
        """The draft side of the commit, per request: ``kept`` [B, R] each path's tree rows (padding clamped to
        the root), ``path_tokens`` [B, R], ``length`` [B] accepted counts including the root, ``nxt`` [B]."""
        B = kept.shape[0]
        ids = torch.cat([path_tokens[:, 1:], nxt.view(B, 1)], dim=1)
        last = (length - 1).clamp(min=0)          # a masked (finished) row commits 0: its catch-up is never read
        ids.scatter_(1, last.view(B, 1), nxt.view(B, 1))
        taps = vtaps.gather(1, kept.unsqueeze(-1).expand(-1, -1, vtaps.shape[-1]))
        self.catch_up(taps, ids, prefix, last)


class NoDraft:
    """Autoregressive decoding as a drafter that drafts nothing: every tree is the root alone, nothing to
    catch up."""

    base = 0

    def __init__(self, device):
        self.parents = torch.full((1,), -1, dtype=torch.long, device=device)
        self.depths = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.ones((1, 1), dtype=torch.bool, device=device)
        self.bad = torch.zeros(1, dtype=torch.long, device=device)   # never set: nothing drafted

    def allocate(self, capacity, device):
        pass

    def prime(self, taps, ids, last, prompt=None):
        pass

    def grow(self, g, levels, prefix):
        return None

    def tree(self, g, keep, root, buckets):
        return root, self.parents, self.depths, self.mask, 1

    def rows(self, g, tree_size):
        return 1

    def follow(self, vtaps, kept, path_tokens, length, nxt, prefix):
        pass


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
