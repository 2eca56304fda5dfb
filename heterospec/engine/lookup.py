"""Prompt lookup inside the cycle: each request's context (its prompt and the tokens it has so far) proposes a
chain of tokens by n-gram matching, and the chain is grafted onto the cycle's verification tree as one more
branch from the root.  The target verifies it with the draft's nodes in the same forward, and the acceptance
(greedy or sampled) is unchanged, so the output stays the target's own: a chain is a deterministic proposal like
any tree node (``ops.verify_sample``'s point-mass siblings), and grafting never puts two siblings with one token.

- :class:`NgramIndex`: one request's host index of its context's n-grams (most recent occurrence of each), kept
  up to date as tokens are committed; :meth:`NgramIndex.propose` is HuggingFace's prompt-lookup rule (the longest
  suffix of at most ``max_ngram`` tokens that occurred before, the ``num_tokens`` tokens that followed it), taking
  the most recent occurrence where HuggingFace takes the first (a repeated phrase continues as it did last), and
  with vLLM's lower bound on the suffix (``min_ngram``: one-token matches propose the wrong token most of the time).
- :func:`graft`: merge each row's chain into its padded tree (step 5's output) on the host: follow the chain down
  the tree while a child holds its next token, then hang the rest below that node; the result is padded by the
  verification tree's one padding rule (:func:`.tree.verification_tree`).

The graft reads the trees on the host, at the declared sync point ``"lookup"`` (free on the CPU; one read a cycle
on a GPU, where calls with a lookup run the eager cycle: a chain's length is known on the host only)."""
from __future__ import annotations

import numpy as np
import torch


def check(num_tokens, max_ngram, min_ngram, default=(0, 2, 1), who="generate"):
    """``(prompt_lookup_num_tokens, max_matching_ngram_size, min_matching_ngram_size)`` -> (L, longest n, shortest
    n), each None taken from ``default`` (an engine's own, else HuggingFace's: off, 2 and 1); L 0 turns it off.  A
    one-line ValueError naming ``who``'s argument for a bad value."""
    given = (num_tokens, max_ngram, min_ngram)
    names = ("prompt_lookup_num_tokens", "max_matching_ngram_size", "min_matching_ngram_size")
    for name, v, lo in zip(names, given, (0, 1, 1)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo or v > 64):
            raise ValueError(f"{who}: argument '{name}' expected None or an int in [{lo}, 64], got {v!r}")
    L, hi, lo = (int(d if v is None else v) for v, d in zip(given, default))
    if lo > hi:
        raise ValueError(f"{who}: argument 'min_matching_ngram_size' expected at most max_matching_ngram_size "
                         f"({hi}), got {lo}")
    return L, hi, lo


class NgramIndex:
    """One request's context and the last start of every n-gram (n = ``min_ngram`` .. ``max_ngram``) that ends
    before its last token (so the suffix being matched never matches itself)."""

    def __init__(self, context, max_ngram, min_ngram=1):
        self.ctx = list(context)
        self.n, self.lo = max_ngram, min_ngram
        self.last = [dict() for _ in range(max_ngram + 1)]   # last[n][ngram] = its latest start
        self.done = 0                                        # n-grams ending before position done are indexed

    def extend(self, tokens):
        self.ctx.extend(tokens)

    def _index(self):
        ctx, end = self.ctx, len(self.ctx) - 1
        for e in range(self.done, end):                      # every n-gram ending at position e
            for n in range(self.lo, min(self.n, e + 1) + 1):
                self.last[n][tuple(ctx[e - n + 1:e + 1])] = e - n + 1
        self.done = max(self.done, end)

    def propose(self, num_tokens):
        """The ``num_tokens`` (or fewer) tokens that followed the latest earlier occurrence of the longest suffix
        (of ``min_ngram`` to ``max_ngram`` tokens) of the context that occurred before; [] when none did."""
        self._index()
        ctx = self.ctx
        for n in range(min(self.n, len(ctx) - 1), self.lo - 1, -1):
            start = self.last[n].get(tuple(ctx[len(ctx) - n:]))
            if start is not None:
                return ctx[start + n:start + n + num_tokens]
        return []


def graft(tokens, parents, depths, mask, n_real, chains, T):
    """Each row's ``chains[b]`` (host list) merged into its tree, padded to ``T`` nodes.  ``tokens``, ``parents``,
    ``depths`` [B, T0], ``mask`` [B, T0, T0] and ``n_real`` [B] as :func:`.tree.verification_tree` returns them;
    ``T`` >= each row's real size plus its chain.  Row b's first ``n_real[b]`` nodes stay as they are; the chain
    walks down from the root through the children that already hold its tokens, and its remaining tokens become
    new nodes after them, each the child of the one before.  Returns the same five (the tensors on their device)
    and each row's real size as a host list."""
    dev = tokens.device
    tk, pa, de, mk = (t.cpu().numpy() for t in (tokens, parents, depths, mask))
    nr = n_real.cpu().numpy()
    B = tk.shape[0]
    # the one padding rule: a padding node holds its row's root token at depth 1 and sees the root and itself
    out_tk = np.repeat(tk[:, :1], T, axis=1)
    out_pa = np.zeros((B, T), dtype=pa.dtype)
    out_de = np.ones((B, T), dtype=de.dtype)
    out_mk = np.zeros((B, T, T), dtype=bool)
    out_mk[:, :, 0] = True
    out_mk[:, np.arange(T), np.arange(T)] = True
    sizes = []
    for b in range(B):
        n = int(nr[b])
        out_tk[b, :n], out_pa[b, :n], out_de[b, :n] = tk[b, :n], pa[b, :n], de[b, :n]
        out_mk[b, :n] = False
        out_mk[b, :n, :n] = mk[b, :n, :n]
        cur, i = 0, 0
        chain = chains[b]
        while i < len(chain):                       # down the tree while a child already holds the chain's token
            kids = np.flatnonzero((pa[b, cur + 1:n] == cur) & (tk[b, cur + 1:n] == chain[i]))
            if not kids.size:
                break
            cur, i = cur + 1 + int(kids[0]), i + 1
        for t in chain[i:]:                         # the rest: a new node under the last one
            out_tk[b, n], out_pa[b, n], out_de[b, n] = t, cur, out_de[b, cur] + 1
            out_mk[b, n] = False
            out_mk[b, n, :n] = out_mk[b, cur, :n]
            out_mk[b, n, n] = True
            cur, n = n, n + 1
        sizes.append(n)
    new = [torch.from_numpy(a).to(dev) for a in (out_tk, out_pa, out_de, out_mk)]
    return (*new, torch.tensor(sizes, dtype=n_real.dtype, device=dev), sizes)
