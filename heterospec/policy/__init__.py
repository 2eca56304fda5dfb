"""Tree-shape policies: EAGLE-3's static tree, HeteroSpec's per-bin rule and calibrated profiles.

A :class:`Policy` is a pure value the engine reads each cycle (:meth:`Policy.plan`: path entropy -> bin ->
extra levels and kept nodes); :mod:`.profile` stores a calibrated one as JSON with its cost model.  What
fits a policy (traces, replay, cost profiling, the optimiser) runs the engine, so it lives above it, in
:mod:`heterospec.tune`."""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

from .. import ops

GAMMA = (0.3, 0.6, 1.0)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Per-cycle tree shape.  ``thresholds`` (ascending, usually 7) bin the path entropy; ``extra[i]`` and
    ``keep[i]`` give bin i's extra draft levels and kept node count (root included); bins past the tables
    use (0, total_tokens)."""

    depth: int = 7
    top_k: int = 10
    total_tokens: int = 60
    thresholds: tuple = ()
    extra: tuple = ()
    keep: tuple = ()
    name: str = "static"
    PAPER_GAMMAS: ClassVar[tuple] = GAMMA   # γ of bins 0-2 in the paper's rule (:meth:`paper`)

    def __post_init__(self):
        for field, lo in (("depth", 0), ("top_k", 1), ("total_tokens", 1)):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"Policy: argument '{field}' expected an int >= {lo}, got {v!r}")
        th = tuple(float(t) for t in self.thresholds)
        if any(not a < b for a, b in zip(th, th[1:])) or any(math.isnan(t) for t in th):
            raise ValueError(f"Policy: argument 'thresholds' expected strictly ascending values, got {th}")
        object.__setattr__(self, "thresholds", th)
        object.__setattr__(self, "_bounds", np.asarray(th, np.float64))   # for ops.bucketize
        if len(self.extra) != len(self.keep):
            raise ValueError(f"Policy: arguments 'extra' and 'keep' expected the same length, got "
                             f"{len(self.extra)} and {len(self.keep)}")
        if any(e < 0 for e in self.extra) or any(k < 1 for k in self.keep):
            raise ValueError(f"Policy: expected extra >= 0 and keep >= 1, got {self.extra} / {self.keep}")

    @classmethod
    def static(cls, depth=7, top_k=10, total_tokens=60):
        """EAGLE-3's dynamic tree with a fixed shape (defaults of EaModel.from_pretrained)."""
        return cls(depth, top_k, total_tokens, name="eagle3")

    @classmethod
    def paper(cls, depth=7, top_k=10, total_tokens=60, thresholds=(), *, alpha=None, gammas=GAMMA):
        """HeteroSpec's rule (paper §4.3): α = ⌈depth/2⌉; bins 0-2 draft α−i more levels and keep
        round(γ_i·N) + (α−i) nodes, γ = 0.3, 0.6, 1.0; other bins unchanged.  ``alpha`` and ``gammas`` (one
        per low-entropy bin) override the paper's values for ablations.  Where α−i goes negative (α = 1 for
        depth ≤ 2, bin 2) it is taken as 0 (no extra level, no extra node).  A bin keeps at least the root: with
        a small N (a CPU's trees of 3 nodes) round(γ_i·N) can be 0."""
        alpha = math.ceil(depth / 2) if alpha is None else alpha
        extra = tuple(max(alpha - i, 0) for i in range(len(gammas)))
        keep = tuple(max(1, round(g * total_tokens) + e) for g, e in zip(gammas, extra))
        return cls(depth, top_k, total_tokens, tuple(thresholds), extra, keep, name="heterospec")

    @classmethod
    def from_profile(cls, path, *, target=None, draft=None):
        """The policy of a profile JSON (``heterospec calibrate --out``), checked as :func:`heterospec.policy.
        profile.load_profile` checks it (``target`` / ``draft``: model identities to warn on a mismatch)."""
        from .profile import load_profile

        return load_profile(path, target=target, draft=draft)[0]

    @classmethod
    def autoregressive(cls):
        return cls(0, 1, 1, name="ar")

    @property
    def drafts(self):
        """Whether the policy drafts at all (a tree of more than the root in some bin)."""
        return self.total_tokens > 1 or any(k > 1 for k in self.keep)

    @property
    def binned(self):
        """Whether the tree shape depends on the path entropy (a drafting policy with thresholds).  At depth 0
        the path is the root expansion's best candidate: its entropy is the root distribution's top-K entropy
        (paper Eq. 1 over a path of one token), and a bin's extra levels grow past the root expansion."""
        return self.drafts and bool(self.thresholds)

    @property
    def levels(self):
        """The most expansion levels after the root expansion any bin grows: ``depth + max(extra)``."""
        return self.depth + max(self.extra, default=0)

    def plans(self):
        """The distinct (extra levels, kept nodes) the policy can choose, sorted: one tree shape each."""
        if not self.drafts:
            return [(0, 1)]
        if not self.binned:
            return [(0, self.total_tokens)]
        plans = set(zip(self.extra, self.keep))
        if len(self.thresholds) + 1 > len(self.extra):
            plans.add((0, self.total_tokens))
        return sorted(plans)

    def chain_lengths(self):
        """Draft length per bin (``len(thresholds) + 1`` of them) when the draft is a chain, one token per level
        (vLLM's EAGLE proposer): a tree of ``keep`` nodes grown ``depth + extra`` levels past the root expansion
        has at most ``1 + depth + extra`` levels of tokens, so bin b drafts ``min(keep_b - 1, 1 + depth +
        extra_b)``; bins past the tables ``min(total_tokens - 1, 1 + depth)``.  The path entropy that picks the
        bin sums the first ``depth + 1`` positions (:func:`heterospec.growth.chain_path_entropy`)."""
        extra = tuple(self.extra) + (0,) * (len(self.thresholds) + 1 - len(self.extra))
        keep = tuple(self.keep) + (self.total_tokens,) * (len(self.thresholds) + 1 - len(self.keep))
        return tuple(min(k - 1, 1 + self.depth + e) for e, k in zip(extra, keep))[:len(self.thresholds) + 1]

    def plan(self, entropy):
        """-> (bin, extra levels, kept nodes including the root) for a path entropy.  The bin is
        ``ops.bucketize``'s: the number of thresholds the entropy exceeds."""
        if not self.thresholds:
            return 0, 0, self.total_tokens
        b = int(ops.bucketize(np.array([entropy], np.float64), self._bounds)[0])
        if b < len(self.extra):
            return b, self.extra[b], self.keep[b]
        return b, 0, self.total_tokens
