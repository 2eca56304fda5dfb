"""The one rule for logits no token can be verified against: a row holding a NaN or a +inf, or only -inf
(:func:`mark_nonfinite`, torch on any device, recorded steps included).  heterospec's CPU decoder applies the same rule
inside its own call (``hsd_nonfinite`` in csrc/gemm/decoder.c), while the rows are in cache; the engine's health
checks (:mod:`heterospec.engine.health`) read the flags either writes."""
from __future__ import annotations

import torch


def mark_nonfinite(bad, logits, n=None):
    """``bad |= (some row of logits has NaN, +inf, or only -inf)``, in place, on the device.  ``bad``: [1] for
    one request (``logits`` [..., V]), or [B] for a batch (``logits`` [B, ..., V]); ``n`` ([B], optional): only
    each request's first ``n[b]`` rows count (``logits`` [B, T, V]: the rest is padding no op reads)."""
    flagged = ~torch.isfinite(logits.amax(-1))
    if n is not None:
        flagged &= torch.arange(flagged.shape[1], device=flagged.device) < n.view(-1, 1)
    flagged = flagged.reshape(bad.shape[0], -1).any(1) if flagged.dim() else flagged.view(1)
    bad.bitwise_or_(flagged.long())   # every flag tensor is int64 (the dtype of the tensor read at "accepted")
