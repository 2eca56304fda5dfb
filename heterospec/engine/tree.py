"""The drafters: cycle steps 1-5 and the draft's side of step 8 on the device, for a batch of requests (batch 1
is a batch of one).  :class:`DraftState` (an EAGLE-3 draft): draft catch-up and tree growth with the path
entropy after the base depth; :class:`NoDraft` (autoregressive decoding): nothing drafted.  Both answer the
same calls (``prime``, ``grow``, ``follow``, ``keep_rows``), so the cycle (:mod:`.cycle`) has no
branch on whether there is a draft.  :func:`verification_tree`: step 5, each row's Top-N tree from its growth,
padded to the cycle's size by the one padding rule.

Draft cache layout (one static tensor, see ``Eagle3Draft.new_cache``): columns ``[0, base)`` hold the
committed positions, columns ``[base, base + K * levels)`` are the scratch rows of this cycle's tree (level
by level, K beams each, the same columns in every row).  Tree rows never touch the committed part, so nothing
has to be undone after verification: the next catch-up simply writes the accepted positions.

Candidates are numbered as EAGLE numbers them: the root expansion's K first, then K*K per level, so the
tree grown to fewer levels is a prefix of the arrays.  Every shape here depends only on (batch, K, level,
padded tree size): fixed per tree shape, as CUDA graphs need.  State that crosses from one step to the next
lives in static buffers (the roots' logits and states after catch-up) or in a :class:`Growth` whose tensors
are a captured step's outputs; no step mutates a Python object it was given, so a captured step replays
exactly what it recorded.
"""
from __future__ import annotations

import torch

from .. import ops
from ..growth import Growth, candidate_count
from ..models.finite import mark_nonfinite


class DraftState:
    """The draft's static cache and the per-cycle scratch buffers of ``batch`` requests (batch 1 is a batch of
    one), allocated once per capacity: one static draft cache of ``batch`` rows ([2, batch, kv_heads,
    capacity + K * levels, head_dim]), each row with its own committed prefix; every buffer has a leading
    ``[batch]`` dimension and the Growth is batched (``ops.expand``'s batched form).  The scratch columns of
    a cycle's tree are the same columns in every row, so growth writes them with one write; the catch-up
    writes each row at its own prefix.  Row b computes what a batch of one computes for request b alone."""

    def __init__(self, draft, top_k, max_levels, d2t, batch=1, fast=None):
        self.draft, self.K, self.d2t = draft, top_k, d2t
        self.fast = fast          # the draft's step and head in one call of C (cpu_decoder.CpuDraft), or None
        self.fast_on = None       # fast runs this call's steps (asked at each prime; None: not yet)
        self.max_levels = max_levels
        self.batch = batch
        self.base = 0
        self.cache = None
        self.root_logits = None   # [batch, 1, Vd] float32: each root's draft logits, written by catch_up
        self.root_h = None        # [batch, 1, H]: each root's draft state, written by catch_up
        self.bad = None           # [batch] int64: the draft's logits were not finite (engine.health)

    def allocate(self, capacity, device):
        """Room for ``capacity`` committed positions plus the scratch rows of the deepest tree."""
        if self.cache is not None and capacity <= self.base:
            return
        B, K, R = self.batch, self.K, self.K * self.max_levels
        self.base = capacity
        # (the C layer's cache is float32 whatever the draft's dtype: it computes in float32, cpu_decoder)
        self.cache = self.draft.new_cache(capacity + R, B) if self.fast is None else \
            self.draft.new_cache(capacity + R, B, dtype=torch.float32)
        self.cols = torch.arange(capacity + R, device=device)
        self.anc = torch.zeros((B, max(R, 1), max(R, 1)), dtype=torch.bool, device=device)  # scratch ancestry
        hidden_size = self.draft.config.hidden_size if hasattr(self.draft, "config") else self.draft.hidden_size
        self.h_rows = torch.zeros((B, 1 + R, hidden_size), dtype=self.draft_dtype(), device=device)
        self.row_of = torch.zeros((B, candidate_count(K, self.max_levels)), dtype=torch.long, device=device)
        self.eyeK = torch.eye(K, dtype=torch.bool, device=device)
        self.zero_score = torch.zeros((B, 1), dtype=torch.float32, device=device)
        self.no_parent = torch.full((B, 1), -1, dtype=torch.long, device=device)
        self.bad = torch.zeros(B, dtype=torch.long, device=device)

    def draft_dtype(self):
        """The states' dtype: the draft's own, or float32 where the C layer runs it (it computes in float32)."""
        return torch.float32 if self.fast is not None else getattr(self.draft, "dtype", torch.float32)

    def keep_rows(self, idx):
        """Keep the requests ``idx`` (a [b'] int64 tensor of row numbers; row ``idx[i]`` becomes row i) and drop
        the others: the finished requests of a batch stop costing work."""
        self.batch = int(idx.shape[0])
        self.cache = self.cache.index_select(1, idx)
        for name in ("anc", "h_rows", "row_of", "zero_score", "no_parent", "root_logits", "root_h", "bad"):
            setattr(self, name, getattr(self, name).index_select(0, idx))

    def catch_up(self, taps, ids, prefix, last):
        """Feed each row's positions prefix[b] .. prefix[b]+R-1 (taps [B, R, 3H] of the target, ids [B, R] the
        token after each); rows past the accepted ones are garbage the mask never shows later.  ``last`` [B]:
        the row whose output expands each request's root.  Writes the static ``root_logits`` [B, 1, Vd] and
        ``root_h`` [B, 1, H]."""
        B, R = ids.shape
        rows = prefix.view(B, 1) + self.cols[:R]                       # [B, R]: each request's own columns
        allowed = self.cols.view(1, 1, -1) <= rows.view(B, R, 1)          # causal over the committed part
        allowed[:, :, self.base:] = False
        logits, h = self._step_head(None, ids, rows, rows, allowed, last, taps=taps)
        return self._store_root(logits, h)

    def _step_head(self, hidden, ids, pos, slots, allowed, last=None, taps=None):
        """One draft step on the cache from ``hidden`` (or from the target's ``taps``, fused by the draft first),
        then the head over its rows (or each request's row ``last`` [B]): (logits [B, rows, Vd], the states to
        feed back [B, rows, H]), the logits' non-finite rows flagged in ``bad`` -- in one call where ``fast`` runs
        it (not while a user's forward hook is set on the draft: its modules run then, and the hook with them;
        asked once per call, at :meth:`prime`)."""
        if self.fast is not None and self.fast.runs(self.fast_on):
            return self.fast.step_head(hidden, ids, pos, self.cache, slots, allowed, last,
                                       current=self.fast_on is not None, bad=self.bad, taps=taps)
        if taps is not None:
            hidden = self.draft.fuse(taps)
        elif hidden.dtype != getattr(self.draft, "dtype", hidden.dtype):   # (float32 states of a half draft's C layer)
            hidden = hidden.to(self.draft.dtype)
        h2 = self.draft.step(hidden, ids, pos, self.cache, slots, allowed)
        if last is not None:
            h2 = h2.gather(1, last.view(-1, 1, 1).expand(-1, 1, h2.shape[-1]))
        logits, h = self.draft.head(h2)
        mark_nonfinite(self.bad, logits)
        return logits, h

    def _store_root(self, logits, h):
        """Write the roots' draft logits and states into the static ``root_logits`` / ``root_h`` in place, so
        that a recorded step reads them where the recording wrote them (allocated by the first call, which must
        not be inside a graph capture, or anew when the batch changed: ``keep_rows``)."""
        if self.root_logits is None or self.root_logits.shape != logits.shape:
            self.root_logits, self.root_h = torch.empty_like(logits), torch.empty_like(h)
        self.root_logits.copy_(logits)
        self.root_h.copy_(h)
        return self.root_logits, self.root_h

    def prime(self, taps, ids, last, prompt=None):
        """The draft's catch-up on whole prefixes from position 0 (after the target's prefill): ``taps``
        [B, S, 3H], ``ids`` [B, S] the token after each position, ``last`` [B] the row that expands each root;
        a draft with ``begin_sequence`` is told the ``prompt`` first ([B, S]: each request's prompt from column 0,
        then whatever fills the row; the tests' oracle draft reads it)."""
        if prompt is not None and hasattr(self.draft, "begin_sequence"):
            self.draft.begin_sequence(prompt)
        self.fast_on = self.fast is not None and self.fast.usable()   # the C layer or the modules, for this call
        self.catch_up(taps, ids, torch.zeros_like(last), last)

    def follow(self, vtaps, kept, path_tokens, length, nxt, prefix):
        """Step 8's draft side, per request: catch up on the accepted positions straight from the padded paths,
        before the prefix moves.  ``kept`` [B, R]: each path's tree rows (padding clamped to the root),
        ``path_tokens`` [B, R] their tokens, ``length`` [B] the accepted counts including the root (0: a
        finished row, whose catch-up is never read), ``nxt`` [B] the bonus tokens."""
        B = kept.shape[0]
        ids = torch.cat([path_tokens[:, 1:], nxt.view(B, 1)], dim=1)
        last = (length - 1).clamp(min=0)
        ids.scatter_(1, last.view(B, 1), nxt.view(B, 1))
        taps = vtaps.gather(1, kept.unsqueeze(-1).expand(-1, -1, vtaps.shape[-1]))
        self.catch_up(taps, ids, prefix, last)

    def start(self, process=None):
        """Expand the roots (the static ``root_logits`` / ``root_h``): a Growth with 0 levels; ``process``: as
        :meth:`grow`'s."""
        logits = self.root_logits if process is None else process(None, self.root_logits, self.d2t)
        g = Growth.root(logits, self.K, self.d2t, zero_score=self.zero_score, no_parent=self.no_parent,
                        check=self.root_logits.device.type != "cuda")
        self.h_rows[:, 0] = self.root_h[:, 0]
        return g

    def grow(self, g, levels, prefix, process=None):
        """Grow ``levels`` more levels (EAGLE-2/3 dynamic tree: one draft step and one ``ops.expand`` per
        level, for every request at once) on top of ``g`` (None: the root expansion first); returns a new
        Growth (``g`` is left as it is).  Growing a levels then b more is growing a + b at once: the trace
        records level by level.  ``process``: None, or ``(g, logits [B, K, Vd], d2t) -> logits`` applied to the
        draft's distributions before each expansion (logits processors, :func:`.processors.apply_draft`; eager
        only)."""
        if g is None:
            g = self.start(process)
        B, K, check = self.batch, self.K, prefix.device.type != "cuda"
        H = self.h_rows.shape[-1]
        for _ in range(levels):
            level = g.level + 1
            r0 = (level - 1) * K                                        # this level's scratch rows (every request)
            local = g.local_beams()                                     # [B, K]: beams within the previous level
            self.anc[:, r0:r0 + K] = False                              # rows of an earlier cycle
            if level == 1:
                src = torch.zeros((B, K), dtype=torch.long, device=prefix.device)   # the root's output
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
            logits, h_out = self._step_head(self.h_rows.gather(1, src.view(B, K, 1).expand(B, K, H)), ids, pos,
                                            slots, allowed)
            self.h_rows[:, 1 + r0:1 + r0 + K] = h_out
            if process is not None:
                logits = process(g, logits, self.d2t)
            g = g.extend(logits, self.d2t, check=check)
        return g


class NoDraft:
    """Autoregressive decoding as a drafter that drafts nothing: every tree is the root alone, nothing to
    catch up (the same calls as :class:`DraftState`, so the cycle has no branch on whether there is a draft)."""

    base = 0

    def __init__(self, device, batch=1):
        self.batch = batch
        self.bad = torch.zeros(batch, dtype=torch.long, device=device)   # never set: nothing drafted

    def allocate(self, capacity, device):
        pass

    def keep_rows(self, idx):
        self.batch = int(idx.shape[0])
        self.bad = self.bad.index_select(0, idx)

    def prime(self, taps, ids, last, prompt=None):
        pass

    def grow(self, g, levels, prefix, process=None):
        return None

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


def verification_tree(g, n, m, root, T, check):
    """Step 5: row b keeps its best ``n[b]`` candidates among its first ``m[b]`` (the candidates of its own
    depth; a tree grown to fewer levels is a prefix of the arrays) -- ``n``, ``m`` int64 [B] on the device --
    through ``ops.select`` and ``ops.build_tree`` (device outputs, each row's root token written from the
    device), and the ragged trees are padded to ``T`` nodes (the cycle's largest tree, or its bucket; with ``g`` None
    or ``T`` 1 every tree is its root, padded to ``T``: room for a prompt-lookup chain).

    The one padding rule: padding node i of a row carries the row's root token at depth 1 and sees the root and
    itself.  Padding sits past each row's real size ``n[b] + 1``, which the acceptance ops are given and never
    read past, so padding is never accepted and costs no random draw.  Returns (tokens, parents, depths,
    mask [B, T, T], the real sizes ``n + 1``)."""
    B = root.shape[0]
    dev = root.device
    if T == 1:   # every tree is its root, always real (n >= 0): nothing to pad
        return (root.view(B, 1).clone(), torch.full((B, 1), -1, dtype=torch.long, device=dev),
                torch.zeros((B, 1), dtype=torch.long, device=dev), torch.ones((B, 1, 1), dtype=torch.bool, device=dev),
                n + 1)
    cols = torch.arange(T, device=dev)
    real = cols.view(1, T) < (n + 1).view(B, 1)
    if g is None:   # no draft: the root alone (n = 0), padded below (room for a prompt-lookup chain)
        width = 0
        tokens, parents = root.view(B, 1).clone(), torch.full((B, 1), -1, dtype=torch.long, device=dev)
        depths, mask = torch.zeros((B, 1), dtype=torch.long, device=dev), torch.ones((B, 1, 1), dtype=torch.bool,
                                                                                      device=dev)
    else:
        cand_tokens, cand_scores, cand_parents = g.candidates()
        width = min(T - 1, cand_scores.shape[-1])
        sel = ops.select(cand_scores, n, m=m, width=width, check=check)
        tree, _, _ = ops.build_tree(cand_tokens, cand_parents, sel, root, n=n, check=check)
        tokens, parents, depths, mask = tree.tokens, tree.parents, tree.depths, tree.mask
    if T > width + 1:
        pad = T - width - 1
        tokens = torch.cat([tokens, tokens.new_full((B, pad), -1)], 1)
        parents = torch.cat([parents, parents.new_full((B, pad), -1)], 1)
        depths = torch.cat([depths, depths.new_full((B, pad), -1)], 1)
        mask = torch.nn.functional.pad(mask, (0, pad, 0, pad))
    tokens = torch.where(real, tokens, root.view(B, 1))
    depths = torch.where(real, depths, torch.ones_like(depths))
    parents = torch.where(real, parents, torch.zeros_like(parents))
    pad_rows = ~real
    mask = mask & real.view(B, 1, T) & real.view(B, T, 1)
    mask[:, :, 0] |= pad_rows
    mask |= torch.eye(T, dtype=torch.bool, device=dev).view(1, T, T) & pad_rows.view(B, T, 1)
    return tokens, parents, depths, mask, n + 1
