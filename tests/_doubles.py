"""Test doubles with the Eagle3Draft calling convention: ``fuse(taps)``,
``forward(hidden, input_ids, position_ids, past_kv=None, attn_mask=None) -> (logits, h_out, (k, v))`` (the
trace recorder's dynamic cache) and the engine's static-cache pair ``new_cache(capacity)``,
``step(hidden, input_ids, position_ids, cache, slots, attn_mask) -> h2`` and ``head(h2) -> (logits, h_out)``
(here h2 is the logits themselves), for a batch of one request (the engine's batched form at batch 1).

OracleDraft proposes the target's own next tokens: for every fed row it runs the target on exactly the
context that row can see (the committed tokens, plus the row's tree ancestors, plus its own token), so its
top-1 child is the target's greedy choice and long paths get accepted -- the loop's cache compaction is
exercised as hard as it gets.  Its "KV cache" is the fed token ids themselves.

NoisyDraft is a deterministic pseudo-random draft (logits from a hash of the token and position): it
accepts rarely, which exercises rejection at every depth.
"""
import torch


class _DoubleBase(torch.nn.Module):
    def __init__(self, hidden_size, vocab_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long))
        self.first = self.pending = None

    def fuse(self, taps):
        return torch.zeros(taps.shape[0], taps.shape[1], self.hidden_size, device=taps.device)

    def new_cache(self, capacity, batch=1):
        return torch.zeros(2, batch, 1, capacity, 1, device=self.d2t.device)

    def step(self, hidden, input_ids, position_ids, cache, slots, attn_mask):
        # the engine's batched form: [B, n] ids and positions, [B, n, W] mask, [n] or [B, n] slots.  The "keys" are
        # the fed token ids; the first "value" of a row holds its token 0 (begin_sequence), which is never fed and
        # so moves with the row when finished rows leave the batch
        B, S = input_ids.shape
        assert attn_mask.dim() == 3 and attn_mask.shape[0] == B, "a [B, n, W] mask"
        slots = slots.reshape(-1, S).expand(B, S)
        cache[0, torch.arange(B, device=cache.device).view(B, 1), 0, slots, 0] = input_ids.float()
        if self.pending is not None:
            cache[1, :, 0, 0, 0] = self.pending.view(-1).float()
            self.pending = None
        return self._logits(cache[0, :, 0, :, 0].long(), attn_mask, input_ids, position_ids,
                            cache[1, :, 0, 0, 0].long())

    def head(self, h2):
        return h2.float(), torch.zeros(*h2.shape[:-1], self.hidden_size, device=h2.device)

    def forward(self, hidden, input_ids, position_ids, past_kv=None, attn_mask=None):
        ids, mask, kv = self._rows(past_kv, input_ids, attn_mask)
        first = self.first.view(-1)[:1] if self.first is not None else ids.new_zeros(1)
        logits = self._logits(ids.unsqueeze(0), mask.unsqueeze(0), input_ids, position_ids, first)
        return logits, torch.zeros(1, input_ids.shape[1], self.hidden_size), kv

    @staticmethod
    def _rows(past_kv, input_ids, attn_mask):
        past = (past_kv[0][0, 0, :, 0].long() if past_kv is not None
                else torch.zeros(0, dtype=torch.long, device=input_ids.device))
        ids = torch.cat([past, input_ids[0].long()])
        P, S = past.shape[0], input_ids.shape[1]
        if attn_mask is None:
            attn_mask = torch.ones(S, P + S, dtype=torch.bool, device=input_ids.device).tril(diagonal=P)
        kv = ids.view(1, 1, -1, 1).float()
        return ids, attn_mask, (kv, kv)


class OracleDraft(_DoubleBase):
    def __init__(self, target, boost=30.0):
        super().__init__(target.config.hidden_size, target.config.vocab_size)
        self.d2t = self.d2t.to(next(target.parameters()).device)
        self.target = target
        self.boost = boost

    def begin_sequence(self, input_ids):
        # [B, S]: each request's prompt from column 0.  Row t of the draft sees tokens 1..t+1 (EAGLE's shift);
        # token 0 comes from here, into the cache with the next step
        self.first = input_ids[:, :1].long()
        self.pending = self.first

    @torch.no_grad()
    def _logits(self, ids, mask, input_ids, position_ids, first):
        B, S = input_ids.shape
        mask = mask.bool()
        # row (b, s)'s context: token 0, then the ids its mask shows, in order (a stable sort puts the shown
        # positions first); one right-padded batch of B * S rows with zeros, built without a loop over the rows
        # (each boolean index was a host sync, which made the GPU's chi-square and greedy tests slow); a causal
        # model's logits at a row's last real token ignore the padding
        shown = mask.sum(-1)                                                         # [B, S]
        width = int(shown.max()) if S else 0
        order = torch.argsort((~mask).to(torch.int32), dim=-1, stable=True)[..., :width]
        seen = torch.gather(ids.long().unsqueeze(1).expand(B, S, ids.shape[-1]), 2, order)
        picked = torch.where(torch.arange(width, device=ids.device) < shown.unsqueeze(-1), seen, 0)
        batch = torch.cat([first.view(-1, 1, 1).expand(B, S, 1), picked], -1).view(B * S, width + 1)
        out = self.target(batch).logits.float().view(B, S, width + 1, -1)
        logits = out.gather(2, shown.view(B, S, 1, 1).expand(B, S, 1, out.shape[-1])).squeeze(2)
        # the target's argmax boosted: the same top-1, confident enough that the greedy chain wins the
        # Top-N rerank
        top = logits.argmax(-1, keepdim=True)
        return logits.scatter(-1, top, logits.gather(-1, top) + self.boost)


class NoisyDraft(_DoubleBase):
    def __init__(self, hidden_size, vocab_size, seed=0):
        super().__init__(hidden_size, vocab_size)
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("table", torch.randn(vocab_size, vocab_size, generator=g) * 3.0)

    def _logits(self, ids, mask, input_ids, position_ids, first):
        B, S = input_ids.shape
        return self.table[input_ids.long()] + 0.1 * position_ids.float().reshape(-1, S, 1).expand(B, S, 1)


class StretchDraft(OracleDraft):
    """Heterogeneous contexts: in easy stretches (alternating blocks of ``period`` positions) it is the
    confident oracle, in hard ones a confidently-unsure noisy guesser, so the path entropy separates them."""

    def __init__(self, target, period=8, seed=0):
        super().__init__(target)
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("table", torch.randn(target.config.vocab_size, target.config.vocab_size, generator=g) * 0.5)
        self.to(next(target.parameters()).device)
        self.period = period

    @torch.no_grad()
    def _logits(self, ids, mask, input_ids, position_ids, first):
        B, S = input_ids.shape
        logits = super()._logits(ids, mask, input_ids, position_ids, first)
        hard = ((position_ids.reshape(-1, S).expand(B, S) // self.period) % 2 == 1).unsqueeze(-1)
        return torch.where(hard, self.table[input_ids.long()], logits)


class ScriptDraft(_DoubleBase):
    """A draft that is right because it knows the answer: row at position p (fed the token at p + 1)
    proposes ``script[p + 2]``, the reference continuation loaded with :meth:`load` (in place: the buffer
    keeps its address, as recorded CUDA graphs need).  Every ``miss_every``-th position it ranks a wrong
    token first and the right one second, so rejections and sibling acceptance happen too.  Pure device
    tensor ops on its inputs and buffers: capturable in a CUDA graph, unlike OracleDraft."""

    def __init__(self, vocab_size, length=1024, miss_every=5, boost=20.0):
        super().__init__(8, vocab_size)
        self.register_buffer("script", torch.zeros(length, dtype=torch.long))
        self.miss_every, self.boost = miss_every, boost

    def load(self, sequence):
        seq = torch.as_tensor(sequence, dtype=torch.long).reshape(-1)
        self.script.zero_()
        self.script[: seq.shape[0]].copy_(seq.to(self.script.device))
        return self

    def _logits(self, ids, mask, input_ids, position_ids, first):
        B, S = input_ids.shape
        p = position_ids.reshape(-1, S).expand(B, S)
        right = self.script[(p + 2).clamp(max=self.script.shape[0] - 1)].unsqueeze(-1)
        wrong = (right + 1) % self.vocab_size
        miss = ((p % self.miss_every) == (self.miss_every - 2)).unsqueeze(-1)
        logits = torch.zeros(B, S, self.vocab_size, device=p.device)
        logits.scatter_(-1, right, torch.where(miss, self.boost / 2, self.boost))
        return logits.scatter_(-1, wrong, torch.where(miss, self.boost, 0.0))


class BatchScriptDraft(_DoubleBase):
    """ScriptDraft for a batch (issue 29): one reference sequence per request, recognised from the request's
    first fed tokens (its draft cache row holds the fed ids, and a row is fed its prompt from position 0), so
    the double keeps working when finished rows are dropped from the batch.  A row at position p proposes
    its script's ``[p + 2]``; at every position p with ``(p + shift) % miss_every == 0`` it ranks a wrong token
    first, where ``shift`` differs per request, so rows accept different lengths in the same cycle.  Eager
    only (it reads the cache on the host)."""

    KEY = 3

    def __init__(self, vocab_size, miss_every=4, boost=20.0):
        super().__init__(8, vocab_size)
        self.miss_every, self.boost = miss_every, boost
        self.scripts = {}

    def load(self, sequences):
        """``sequences``: each request's prompt followed by its reference continuation (1-D)."""
        self.scripts = {}
        for i, seq in enumerate(sequences):
            seq = [int(t) for t in torch.as_tensor(seq).reshape(-1)]
            self.scripts[tuple(seq[1:1 + self.KEY])] = (seq, i)
        return self

    def step(self, hidden, input_ids, position_ids, cache, slots, attn_mask):
        B, S = input_ids.shape
        slots = slots.view(1, -1).expand(B, S) if slots.dim() == 1 else slots
        for b in range(B):
            cache[0, b, 0, slots[b], 0] = input_ids[b].float()
        logits = torch.zeros(B, S, self.vocab_size, device=input_ids.device)
        pos = position_ids.reshape(-1, S).expand(B, S)
        for b in range(B):
            seq, shift = self.scripts[tuple(int(t) for t in cache[0, b, 0, :self.KEY, 0].tolist())]
            for s in range(S):
                p = int(pos[b, s])
                right = seq[min(p + 2, len(seq) - 1)]
                wrong = (right + 1) % self.vocab_size
                if (p + shift) % self.miss_every == 0:
                    logits[b, s, wrong], logits[b, s, right] = self.boost, self.boost / 2
                else:
                    logits[b, s, right] = self.boost
        return logits


class BatchTableDraft(_DoubleBase):
    """ScriptDraft for a batch of a fixed size: row b of the batch follows ``scripts[b]`` (its prompt then its
    reference continuation, loaded in place), and at every position p with ``(p + b) % miss_every == 0`` it
    ranks a wrong token first, so rows accept different lengths in the same cycle.  Pure device tensor ops,
    capturable in a CUDA graph (unlike BatchScriptDraft, which reads its cache on the host); a row is its
    batch row, so finished rows must be masked, not dropped (what the recorded engine does)."""

    def __init__(self, vocab_size, rows, length=512, miss_every=4, boost=20.0):
        super().__init__(8, vocab_size)
        self.register_buffer("scripts", torch.zeros(rows, length, dtype=torch.long))
        self.miss_every, self.boost = miss_every, boost

    def load(self, sequences):
        self.scripts.zero_()
        for b, seq in enumerate(sequences):
            seq = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
            self.scripts[b, : seq.shape[0]].copy_(seq.to(self.scripts.device))
        return self

    def step(self, hidden, input_ids, position_ids, cache, slots, attn_mask):
        B, S = input_ids.shape
        p = position_ids.reshape(-1, S).expand(B, S)
        rows = torch.arange(B, device=p.device).view(B, 1)
        right = self.scripts[:B].gather(1, (p + 2).clamp(max=self.scripts.shape[1] - 1))
        wrong = (right + 1) % self.vocab_size
        miss = ((p + rows) % self.miss_every) == 0
        logits = torch.zeros(B, S, self.vocab_size, device=p.device)
        logits.scatter_(2, right.unsqueeze(-1), torch.where(miss, self.boost / 2, self.boost).unsqueeze(-1))
        logits.scatter_(2, wrong.unsqueeze(-1), torch.where(miss, self.boost, 0.0).unsqueeze(-1))
        return logits
