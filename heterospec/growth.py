"""The one definition of the draft tree's growth and of the path entropy, over ``ops.expand``.

EAGLE-2/3's dynamic tree grows level by level: the root's draft distribution is expanded into its K best
children, then each level feeds the K best candidates so far (the beams) to the draft and expands each of
their distributions into K children (``ops.expand``).  Candidates are numbered as EAGLE numbers them: the
root expansion's K first, then K*K per level, so a tree grown to fewer levels is a prefix of the arrays.

HeteroSpec's path entropy (paper Eq. 1) is the top-K entropy summed root-down, in float64, over the
distributions that produced the tokens of P*, the path to the most confident candidate of the last level:
:meth:`Growth.path_entropy`.  Each candidate carries the sum along its own path (``cum_h``), so reading it
for the best candidate costs one index and never a walk.

:class:`Growth` works on NumPy arrays (the synthetic demo) and on torch tensors on any device (the engine's
:class:`heterospec.engine.tree.DraftState`, which supplies each level's logits from the draft and its own
static buffers): same numbers, one code path.  No step reads a device value on the host.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import ops


def chain_path_entropy(step_entropy, positions):
    """The path entropy (Eq. 1) of a chain draft, one token per position (vLLM's EAGLE proposer): the top-K
    entropies of the distributions that drafted its first ``positions`` tokens, summed in float64 -- for a
    chain, the path P* is the chain itself.  ``step_entropy``: [batch, D] (``ops.topk_entropy`` of each drafted
    position's logits), D >= positions -> [batch] float64, on the input's device."""
    if step_entropy.shape[-1] < positions:
        raise ValueError(f"chain_path_entropy: argument 'step_entropy' expected at least {positions} drafted "
                         f"positions, got {step_entropy.shape[-1]}")
    return _f64(step_entropy[..., :positions]).sum(-1)


def candidate_count(top_k, levels):
    """Candidates of a tree grown ``levels`` levels past the root expansion."""
    return top_k + top_k * top_k * levels


def _is_numpy(x):
    return isinstance(x, np.ndarray)


def _f64(x):
    return x.astype(np.float64) if _is_numpy(x) else x.double()


def _repeat(x, k):
    """Each element k times in a row, along the last axis (NumPy's ``repeat``, torch's ``repeat_interleave``)."""
    return np.repeat(x, k, axis=-1) if _is_numpy(x) else x.repeat_interleave(k, dim=-1)


def _cat(xs):
    if _is_numpy(xs[0]):
        return np.concatenate(xs, axis=-1)
    import torch

    return torch.cat(xs, dim=-1)


def _take(x, idx):
    """``x[idx]``, or row by row for a batch (``x[b, idx[b]]``; never a host read of ``idx``)."""
    if idx.ndim == 1:
        return x[idx]
    return np.take_along_axis(x, idx, 1) if _is_numpy(x) else x.gather(1, idx)


@dataclasses.dataclass(frozen=True)
class Growth:
    """A candidate tree grown ``level`` levels past the root expansion (arrays or tensors, one per level).

    Batched (a batch of requests, each its own tree): every array has a leading ``[batch]`` dimension
    (``beams`` ``[batch, K]``, each level's tokens ``[batch, K*K]`` ...), and row b is the unbatched growth of
    request b (``ops.expand``'s batched form; ``d2t`` and the candidate numbering shared by the rows)."""

    tokens: tuple             # int64 [K] (root expansion), then [K*K] per level
    scores: tuple             # float32 cumulative log-probabilities, same shapes
    parents: tuple            # int64 candidate index of the parent (-1 under the root)
    cum_h: object             # float64 path entropy (Eq. 1, summed root-down) of the last level's candidates
    beams: object             # int64 [K] the last level's K best candidates (global numbering)
    prev_offset: int          # the last level's first candidate index
    offset: int               # the next level's first candidate index
    level: int                # expansion levels after the root expansion

    @classmethod
    def root(cls, logits, top_k, d2t=None, *, zero_score=None, no_parent=None, check=True):
        """Expand the root's draft logits [1, Vd] (batched: [batch, 1, Vd]): a Growth with 0 levels.
        ``zero_score`` ([1] float32 zero; batched [batch, 1]) and ``no_parent`` ([1] int64 -1; [batch, 1]) may be
        given as static tensors (a recorded step reads them at fixed addresses); NumPy ones are made otherwise."""
        if zero_score is None:
            lead = logits.shape[:-1]
            zero_score, no_parent = np.zeros(lead, np.float32), np.full(lead, -1, np.int64)
        tok, sc, par, ent, beams = ops.expand(logits, zero_score, no_parent, top_k, d2t, 0, check=check)
        return cls((tok,), (sc,), (par,), _repeat(_f64(ent), top_k), beams, 0, top_k, 0)

    def local_beams(self):
        """The beams' indices within the last level."""
        return self.beams - self.prev_offset

    def extend(self, logits, d2t=None, *, check=True):
        """One more level: ``logits`` [K, Vd] ([batch, K, Vd]) are the draft's outputs for the beams, in beam
        order."""
        K = self.beams.shape[-1]
        local = self.local_beams()
        tok, sc, par, ent, beams = ops.expand(logits, _take(self.scores[-1], local), self.beams, K, d2t,
                                              self.offset, check=check)
        cum_h = _repeat(_take(self.cum_h, local) + _f64(ent), K)
        return Growth(self.tokens + (tok,), self.scores + (sc,), self.parents + (par,), cum_h, beams,
                      self.offset, self.offset + K * K, self.level + 1)

    def candidates(self):
        """(tokens, scores, parents) of every candidate, concatenated level by level."""
        return _cat(self.tokens), _cat(self.scores), _cat(self.parents)

    def path_entropy(self):
        """The path entropy of the most confident candidate of the last level, as a [1] float64 array or
        tensor (on a device an ``index_select``: indexing with a 0-d tensor would read the index on the host);
        batched, one per request: [batch]."""
        if self.beams.ndim == 2:
            return _take(self.cum_h, self.beams[:, :1] - self.prev_offset)[:, 0]
        best = self.beams[:1] - self.prev_offset
        return self.cum_h[best] if _is_numpy(self.cum_h) else self.cum_h.index_select(0, best)
