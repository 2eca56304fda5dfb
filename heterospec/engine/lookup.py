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
- :func:`graft`: merge each row's chain into its padded tree (step 5's output) on the device: follow the chain
  down the tree while a child holds its next token, then hang the rest below that node, in the padding after the
  real nodes.  No host read and fixed shapes, so the eager cycle and a recorded step (CUDA graph) run the same
  code; the chains reach it through :class:`~.cycle.CycleState`'s ``chain`` buffer (:func:`pack`: one copy a
  cycle, made before the cycle from the tokens the host read at the sync point "accepted"), and a recorded step
  is recorded per chain length ``L``, its trees padded to the policy's sizes plus ``L``."""
from __future__ import annotations

import torch

# the longest chain (and n-gram) a call may ask for: the size of CycleState's chain buffer
MAX_TOKENS = 64


def check(num_tokens, max_ngram, min_ngram, default=(0, 2, 1), who="generate"):
    """``(prompt_lookup_num_tokens, max_matching_ngram_size, min_matching_ngram_size)`` -> (L, longest n, shortest
    n), each None taken from ``default`` (an engine's own, else HuggingFace's: off, 2 and 1); L 0 turns it off.  A
    one-line ValueError naming ``who``'s argument for a bad value."""
    given = (num_tokens, max_ngram, min_ngram)
    names = ("prompt_lookup_num_tokens", "max_matching_ngram_size", "min_matching_ngram_size")
    for name, v, lo in zip(names, given, (0, 1, 1)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo or v > MAX_TOKENS):
            raise ValueError(f"{who}: argument '{name}' expected None or an int in [{lo}, {MAX_TOKENS}], got {v!r}")
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


def pack(chains, num_tokens):
    """Each row's chain (host lists of at most ``num_tokens`` tokens) as rows [length, tokens..., zeros] of
    ``1 + num_tokens`` ints: what :meth:`.cycle.Cycle.set_chains` copies to the device."""
    return [[len(c), *c] + [0] * (num_tokens - len(c)) for c in chains]


def graft(tokens, parents, depths, mask, n_real, chain, length):
    """Each row's chain merged into its padded tree on the device, with no host read and fixed shapes (the same
    code in the eager cycle and inside a recorded step).  ``tokens``, ``parents``, ``depths`` [B, T], ``mask``
    [B, T, T] and ``n_real`` [B] as :func:`.tree.verification_tree` returns them, padded to ``T`` >= each row's
    real size plus its chain; ``chain`` [B, L] the chains' tokens, ``length`` [B] their lengths (0: none).  Row
    b's first ``n_real[b]`` nodes stay as they are; the chain's longest prefix that is a path from the root in
    the tree is followed (a node matches when it and each of its ancestors hold the chain's token at their
    depth; siblings hold distinct tokens, so at most one node matches at each depth), and the rest becomes new
    nodes in the padding right after the real ones, each the child of the one before, the first under the last
    matched node.  Returns the same five; past the new real sizes the padding is untouched."""
    B, T = tokens.shape
    L = chain.shape[1]
    dev = tokens.device
    cols = torch.arange(T, device=dev).view(1, T)
    n_real = n_real.view(B)
    length = length.view(B)
    # the nodes on the chain's path: each real node below the root at a depth the chain reaches whose token is
    # the chain's at that depth, with every ancestor below the root so too
    d = depths.clamp(min=1, max=L) - 1
    on = (cols >= 1) & (cols < n_real.view(B, 1)) & (depths <= length.view(B, 1)) & (tokens == chain.gather(1, d))
    off_path = mask & ~on.view(B, 1, T) & (cols >= 1).view(1, 1, T)
    on = on & ~off_path.any(2)
    deepest = torch.where(on, depths, torch.zeros_like(depths))
    matched, cur = deepest.max(1)                       # the deepest node on the path (the root when none is)
    # the rest of the chain: new node c = n_real + k holds chain token matched + k, k = 0 .. length - matched - 1
    k = cols - n_real.view(B, 1)
    new = (k >= 0) & (k < (length - matched).view(B, 1))
    at = (matched.view(B, 1) + k).clamp(min=0, max=max(L - 1, 0))
    tokens = torch.where(new, chain.gather(1, at), tokens)
    parents = torch.where(new, torch.where(k == 0, cur.view(B, 1), cols - 1), parents)
    depths = torch.where(new, depths.gather(1, cur.view(B, 1)) + k + 1, depths)
    # a new node sees its branch point's ancestors and the new nodes from the first one to itself
    branch = mask.gather(1, cur.view(B, 1, 1).expand(B, 1, T))                        # [B, 1, T]
    chain_cols = (cols.view(1, 1, T) >= n_real.view(B, 1, 1)) & (cols.view(1, 1, T) <= cols.view(1, T, 1))
    mask = torch.where(new.view(B, T, 1), branch | chain_cols, mask)
    return tokens, parents, depths, mask, n_real + (length - matched)
