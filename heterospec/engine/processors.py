"""Logits processors inside the speculative cycle, losslessly.

A processor in HuggingFace's sense (``processor(input_ids [n, L], scores [n, V]) -> scores``: a repetition penalty,
no repeated n-grams, banned words, a minimum length, ...) changes the target's next-token distribution as a
function of the tokens before the position.  Speculation stays exact with it when every node of a verification
tree is processed with its own context: the request's tokens so far, then the tree path down to that node.  The
acceptance rule (greedy argmax, or the sampled residual rule) then verifies the processed distribution, which is
what a plain loop would have sampled from at that position, so the output is the processed target's own.  The
draft's distributions are processed the same way (:func:`apply_draft`: the root expansion and each beam with its
own path), so it proposes what the processed target is likely to pick; that changes only how many tokens a
cycle accepts, never what it commits.

:func:`check` validates a ``logits_processor`` argument; :func:`apply` processes a batch of trees' logits (the
prefill's last position is a tree of one node).  A request's nodes of equal context length go to its processors as
one batch, so a processor must compute each row from that row's own tokens and scores (the ones HuggingFace's
``generate`` builds from a generation config do; :func:`heterospec.custom_generate` admits only those).  It runs
on the host between the target's forward and the acceptance, and before each of the draft's expansions (the
declared sync point "processors"), so a call with processors runs the eager cycle, never recorded steps.

A repetition penalty alone (HuggingFace's ``RepetitionPenaltyLogitsProcessor``, the one a generation config's
``repetition_penalty`` gives, and the most common processor there) runs on the device instead (:func:`on_device`,
:func:`penalise`, :func:`see`): each row's context as a set of ids in ``CycleState.seen``, each node's path from the
tree's ancestor mask, fixed shapes and no host read, so such calls keep their recorded steps; the draft's
distributions are penalised the same way (:func:`penalise_draft`, each beam's path from the growth's parents).

"""
from __future__ import annotations

import math

import torch

from . import sync


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


def with_penalty(repetition_penalty, processors, batch, skips=None):
    """``generate``'s ``repetition_penalty`` (None or 1.0: off; else a finite value > 0) as HuggingFace's
    ``RepetitionPenaltyLogitsProcessor`` in front of the ``logits_processor`` argument (one list for every request,
    or one per request) -> that argument; ``skips``: each row's left padding, which the penalty skips as HF's
    ``generate`` makes it skip (its ``prompt_ignore_length``; then one list per request)."""
    if repetition_penalty is None or repetition_penalty == 1.0:
        return processors
    if isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, (int, float)) \
            or not math.isfinite(repetition_penalty) or repetition_penalty <= 0:
        raise ValueError(f"generate: argument 'repetition_penalty' expected None or a finite value > 0 (1: off), "
                         f"got {repetition_penalty!r}")
    from transformers import RepetitionPenaltyLogitsProcessor

    items = [] if processors is None else (list(processors) if isinstance(processors, (list, tuple)) else [processors])
    per_row = len(items) == batch and bool(items) and all(isinstance(x, (list, tuple)) for x in items)
    if not per_row and not any(skips or ()):
        return [RepetitionPenaltyLogitsProcessor(float(repetition_penalty))] + items
    rows = [list(x) for x in items] if per_row else [items] * batch
    return [[RepetitionPenaltyLogitsProcessor(float(repetition_penalty), prompt_ignore_length=int(n) or None)] + row
            for row, n in zip(rows, skips or [0] * batch)]


def _paths(tokens, parents, wanted, root=-1):
    """The tokens below the root down to each index of ``wanted`` (lists), walking ``parents`` (host lists) up to
    -1 or to ``root`` (a tree's node 0, whose token is the context's last)."""
    memo = {}

    def path(c):
        if c < 0 or c == root:
            return []
        if c not in memo:
            memo[c] = path(parents[c]) + [tokens[c]]
        return memo[c]

    return [path(c) for c in wanted]


def apply(processors, contexts, tokens, parents, n_real, logits):
    """The processed logits of a batch of verification trees: ``processors`` (a tuple of callables per row, as
    :func:`check` gives them; each call sees one row's nodes of one context length), ``contexts`` (a host list per
    row: the request's input ids, padding included where the caller passed it, and its tokens so far, ending with
    the root's token), ``tokens`` / ``parents`` [B, T] (each row's tree, node 0 the root), ``n_real`` [B] real nodes
    per row, ``logits`` [B, T, V] the target's -> float32 [B, T, V]: node i of row b processed with
    ``contexts[b]`` + the tokens on its path below the root, padding nodes (i >= n_real[b], never read by the
    acceptance) as they were."""
    with sync.point("processors"):   # the trees, read on the host
        return _apply(processors, contexts, tokens, parents, n_real, logits)


def _apply(processors, contexts, tokens, parents, n_real, logits):
    tok, par, nn = tokens.tolist(), parents.tolist(), n_real.view(-1).tolist()
    out = logits.to(torch.float32, copy=True)
    _process(processors, contexts, [_paths(tok[b], par[b], range(nn[b]), root=0) for b in range(len(nn))], out)
    return out


def _process(processors, contexts, paths, scores):
    """The one processing step of :func:`apply` and :func:`apply_draft`: entry j of row b of ``scores`` [B, N, V]
    (float32, written in place) through row b's processors with ``contexts[b]`` + ``paths[b][j]``, for the entries
    ``paths`` lists; a row's entries of one context length as one batch."""
    V = scores.shape[-1]
    dev = scores.device
    groups = {}   # (row, context length) -> [(entry, ids)]
    for b, row in enumerate(paths):
        for j, p in enumerate(row):
            ids = contexts[b] + p
            groups.setdefault((b, len(ids)), []).append((j, ids))
    for (b, _), items in groups.items():
        entries = torch.tensor([x[0] for x in items], dtype=torch.long, device=dev)
        ids = torch.tensor([x[1] for x in items], dtype=torch.long, device=dev)
        got = scores[b, entries]
        for p in processors[b]:
            got = p(ids, got)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (len(items), V):
            raise ValueError(f"generate: argument 'logits_processor' expected each processor to return scores of "
                             f"shape {(len(items), V)}, got {getattr(got, 'shape', type(got).__name__)}")
        scores[b, entries] = got.to(torch.float32)

def _beam_paths(g, B):
    """Each row's beams' tokens below the root, from a Growth's candidates (None: the root expansion)."""
    if g is None:
        return [[[]] for _ in range(B)]
    tokens, _, parents = g.candidates()
    tok, par, beams = tokens.tolist(), parents.tolist(), g.beams.tolist()
    return [_paths(tok[b], par[b], beams[b]) for b in range(B)]


def apply_draft(processors, contexts, vocab, g, logits, d2t=None):
    """The draft's logits [B, K, Vd] processed as :func:`apply` processes the target's: distribution k of row b
    (the root expansion's when ``g`` is None, else the beam ``g.beams[b, k]``'s) with ``contexts[b]`` + the tokens on
    its path below the root.  The draft's vocabulary is scattered into the target's (``vocab`` ids; draft id j is
    target id j + d2t[j]), every other id at -inf, processed there and gathered back -> float32 [B, K, Vd]."""
    with sync.point("processors"):   # the beams' paths, read on the host
        return _apply_draft(processors, contexts, vocab, g, logits, d2t)


def _apply_draft(processors, contexts, vocab, g, logits, d2t):
    B, K, Vd = logits.shape
    dev = logits.device
    tid = torch.arange(Vd, device=dev) + (d2t.to(dev) if d2t is not None else 0)
    full = torch.full((B, K, vocab), -float("inf"), dtype=torch.float32, device=dev)
    full[:, :, tid] = logits.to(torch.float32)
    _process(processors, contexts, _beam_paths(g, B), full)
    return full[:, :, tid]


_PENALTY = "RepetitionPenaltyLogitsProcessor"


def on_device(rows):
    """:func:`check`'s rows -> (penalty, ids each row's penalty skips at its start) when every row's processors are
    one HuggingFace ``RepetitionPenaltyLogitsProcessor`` of one penalty (its ``prompt_ignore_length`` None, an int,
    or one int per row): the penalty then runs on the device (:func:`penalise`); else None, and the processors run
    on the host (:func:`apply`)."""
    if not rows or any(len(r) != 1 or type(r[0]).__name__ != _PENALTY for r in rows):
        return None
    penalties = {r[0].penalty for r in rows}
    if len(penalties) != 1 or not isinstance(next(iter(penalties)), float):
        return None
    skips = []
    for b, (p,) in enumerate(rows):
        n = p.prompt_ignore_length
        if isinstance(n, torch.Tensor):
            if n.dim() != 1 or n.numel() != len(rows):
                return None
            with sync.outside_cycle():      # a per-row tensor of HuggingFace's, perhaps on the device
                n = n.tolist()[b]
        skips.append(int(n or 0))
    return penalties.pop(), skips


def seen_from(contexts, skips, seen):
    """``seen`` [B, V + 1] (``CycleState.seen``) set to each row's ids of ``contexts`` (host lists) past its
    first ``skips[b]``: one host-to-device copy; ids past the logits' width go to the sink column, as HuggingFace's
    processor drops them."""
    V = seen.shape[1] - 1
    rows = [[min(max(t, 0), V) for t in ctx[n:]] or [V] for ctx, n in zip(contexts, skips)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [V] * (width - len(r)) for r in rows], dtype=torch.long, device="cpu")
    seen.zero_()
    seen.scatter_(1, ids.to(seen.device, non_blocking=True), True)


def penalise(logits, tokens, tmask, seen, penalty):
    """HuggingFace's repetition penalty on every node of a batch of trees: ``logits`` [B, T, V] float32, node i of
    row b divided by ``penalty`` (multiplied where negative) at the ids of its context -- ``seen[b]`` (the
    request's, [B, V + 1] bool) and the tokens of the nodes ``tmask`` [B, T, T] (ancestor-or-self; node 0 the root,
    the context's last token) gives it -> a new [B, T, V] tensor.  Fixed shapes on the device, no host read."""
    B, T, V = logits.shape
    hit = _context_hits(seen, T)
    hit.scatter_(2, torch.where(tmask, tokens.clamp(max=V).unsqueeze(1).expand(B, T, T), V), True)
    return _penalised(logits, hit[..., :V], penalty)


def _context_hits(seen, n):
    """Each row's ``seen`` [B, V + 1] copied for ``n`` distributions -> [B, n, V + 1] bool, to add paths to."""
    B, W = seen.shape
    return seen.unsqueeze(1).expand(B, n, W).clone()


def _penalised(logits, hit, penalty):
    """HuggingFace's repetition penalty where ``hit``: divided by ``penalty``, multiplied where negative."""
    return torch.where(hit, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def see(seen, path_tokens, length):
    """The accepted path's first ``length[b]`` tokens ([B, R] / [B]; the root first) join each row's ``seen``."""
    R = path_tokens.shape[1]
    take = torch.arange(R, device=path_tokens.device).unsqueeze(0) < length.unsqueeze(1)
    seen.scatter_(1, torch.where(take, path_tokens.clamp(max=seen.shape[1] - 1), seen.shape[1] - 1), True)


def penalise_draft(seen, root, penalty, g, logits, d2t=None):
    """The draft's logits [B, K, Vd] penalised as :func:`penalise` penalises the target's (a
    :meth:`.tree.DraftState.grow` ``process``): distribution k of row b -- the root expansion's when ``g`` is None,
    else the beam ``g.beams[b, k]``'s -- at the ids of ``seen[b]``, the row's ``root`` token ([B]) and the tokens
    on the beam's path below the root (walked up the growth's parents, one gather a level); draft id j is target
    id j + d2t[j].  Fixed shapes on the device."""
    B, K, Vd = logits.shape
    V = seen.shape[1] - 1
    hit = _context_hits(seen, K)
    hit.scatter_(2, root.clamp(max=V).view(B, 1, 1).expand(B, K, 1), True)
    if g is not None:
        tokens, _, parents = g.candidates()
        at = g.beams
        for _ in range(g.level + 1):
            safe = at.clamp(min=0)
            hit.scatter_(2, torch.where(at >= 0, tokens.gather(1, safe).clamp(max=V), V).unsqueeze(-1), True)
            at = torch.where(at >= 0, parents.gather(1, safe), at)
    tid = torch.arange(Vd, device=logits.device)
    if d2t is not None:
        tid = tid + d2t.to(logits.device)
    return _penalised(logits, hit.gather(2, tid.view(1, 1, Vd).expand(B, K, Vd)), penalty)
