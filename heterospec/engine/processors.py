"""Logits processors inside the speculative cycle, losslessly.

A processor in HuggingFace's sense (``processor(input_ids [n, L], scores [n, V]) -> scores``: a repetition penalty,
no repeated n-grams, banned words, a minimum length, ...) changes the target's next-token distribution as a
function of the tokens before the position.  Speculation stays exact with it when every node of a verification
tree is processed with its own context: the request's tokens so far, then the tree path down to that node.  The
acceptance rule (greedy argmax, or the sampled residual rule) then verifies the processed distribution, which is
what a plain loop would have sampled from at that position, so the output is the processed target's own.  The
draft is not processed: what it proposes only decides how many tokens a cycle accepts.

:func:`check` validates a ``logits_processor`` argument; :func:`apply` processes a batch of trees' logits (the
prefill's last position is a tree of one node).  A request's nodes of equal context length go to its processors as
one batch, so a processor must compute each row from that row's own tokens and scores (the ones HuggingFace's
``generate`` builds from a generation config do; :func:`heterospec.custom_generate` admits only those).  It runs
on the host between the target's forward and the acceptance (the declared sync point "processors"), so a call
with processors runs the eager cycle, never recorded steps.
"""
from __future__ import annotations

import torch


def check(processors, batch):
    """``processors``: None, one callable, a list of them (a ``LogitsProcessorList``) for every request, or ``batch``
    such lists, one per request -> a list of ``batch`` tuples of callables, each applied in order to its request
    (a one-line ValueError otherwise); ``[]`` without any."""
    if processors is None:
        return []
    items = list(processors) if isinstance(processors, (list, tuple)) else [processors]
    per_row = len(items) == batch and all(isinstance(x, (list, tuple)) for x in items)
    rows = [list(x) for x in items] if per_row else [items] * batch
    for row in rows:
        for i, p in enumerate(row):
            if not callable(p):
                raise ValueError(f"generate: argument 'logits_processor' expected callables (input_ids, scores) -> "
                                 f"scores, got {type(p).__name__} at position {i}")
    rows = [tuple(r) for r in rows]
    return rows if any(rows) else []


def _paths(tokens, parents, n):
    """Each real node's tokens below the root (the root's own token is the context's last): lists, node by node."""
    paths = [None] * n
    paths[0] = []

    def path(i):
        if paths[i] is None:
            paths[i] = path(parents[i]) + [tokens[i]]
        return paths[i]

    return [path(i) for i in range(n)]


def apply(processors, contexts, tokens, parents, n_real, logits):
    """The processed logits of a batch of verification trees: ``processors`` (a tuple of callables per row, as
    :func:`check` gives them; each call sees one row's nodes of one context length), ``contexts`` (a host list per
    row: the request's input ids, padding included where the caller passed it, and its tokens so far, ending with
    the root's token),
    ``tokens`` / ``parents`` [B, T] (each row's tree, node 0 the root), ``n_real`` [B] real nodes per row, ``logits``
    [B, T, V] the target's -> float32 [B, T, V]: node i of row b processed with ``contexts[b]`` + the tokens on its
    path below the root, padding nodes (i >= n_real[b], never read by the acceptance) as they were."""
    B, T, V = logits.shape
    tok, par, nn = tokens.tolist(), parents.tolist(), n_real.view(-1).tolist()
    groups = {}   # (row, context length) -> [(row, node, ids)]
    for b in range(B):
        for i, p in enumerate(_paths(tok[b], par[b], nn[b])):
            ids = contexts[b] + p
            groups.setdefault((b, len(ids)), []).append((b, i, ids))
    out = logits.to(torch.float32, copy=True)
    dev = logits.device
    for items in groups.values():
        rows = torch.tensor([x[0] for x in items], dtype=torch.long, device=dev)
        nodes = torch.tensor([x[1] for x in items], dtype=torch.long, device=dev)
        ids = torch.tensor([x[2] for x in items], dtype=torch.long, device=dev)
        scores = out[rows, nodes]
        for p in processors[items[0][0]]:
            scores = p(ids, scores)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (len(items), V):
            raise ValueError(f"generate: argument 'logits_processor' expected each processor to return scores of "
                             f"shape {(len(items), V)}, got {getattr(scores, 'shape', type(scores).__name__)}")
        out[rows, nodes] = scores.to(torch.float32)
    return out
