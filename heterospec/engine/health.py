"""Non-finite logits from the models, caught in the cycle and raised as one clear error.

A target or a draft that produces NaN or +inf logits (an fp16 overflow does this, so does a broken checkpoint),
or a row of only -inf, has no distribution to verify against: no token could be called the model's own.  Every
forward of the cycle ORs one flag per model and per request into a fixed-address device tensor: the target adapter
and the drafter are handed the tensor with each forward and apply
:func:`heterospec.models.finite.mark_nonfinite` (one ``amax`` over the vocabulary, no host read, so recorded steps
keep it), or the same rule inside the CPU decoder's own call.  The flags travel with the accepted tokens at the
sync point "accepted", and the loop raises :class:`NonFiniteLogitsError` naming the model, the cycle and the
position before any token of that cycle is committed, streamed or returned.

On the CPU the ops themselves refuse such logits while the cycle runs (a ``ValueError`` naming the op's
argument, row and column); the loop then reads the flags and raises the same error from it
(:func:`raise_flagged`).  On a GPU the ops' own device-side records of the same logits are cleared, so the
next call starts clean.
"""
from __future__ import annotations

import torch

from .. import ops
from ..models.finite import mark_nonfinite
from . import sync


class NonFiniteLogitsError(FloatingPointError):
    """A model produced NaN or +inf logits (or a row of only -inf): the message names the model, the cycle and
    the position."""


def describe(model):
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        dtype = p.dtype if p is not None else None
    return type(model).__name__ + (f" ({str(dtype).replace('torch.', '')})" if dtype is not None else "")


def error(who, model, cycle, position, row=None):
    """The one-line error for ``who`` ("target" or "draft")."""
    req = f" for request {row}" if row is not None else ""
    when = "in the prefill" if cycle == 0 else f"in cycle {cycle}"
    hint = " (float16 overflows at 65504: load the models in bfloat16 or float32)" if \
        describe(model).endswith("(float16)") else ""
    return NonFiniteLogitsError(
        f"generate: the {who} model {describe(model)} produced non-finite logits (NaN, +inf, or a row of only -inf) "
        f"{when}{req}, at position {position}; no token was committed from it{hint}")


def check_prefill(logits, model, position):
    """The prefill's last logits (read on the host, outside the cycle): raise if they are not finite."""
    bad = torch.zeros(logits.shape[0] if logits.dim() > 1 else 1, dtype=torch.long, device=logits.device)
    mark_nonfinite(bad, logits.view(bad.shape[0], -1))
    with sync.outside_cycle():
        rows = [i for i, x in enumerate(bad.tolist()) if x]
    if rows:
        raise error("target", model, 0, position, rows[0] if bad.shape[0] > 1 else None)


def clear_device(device):
    """Drop the ops' device-side error records of this call's check=False launches (they refused the same
    logits): the caller raises the clearer error."""
    if device.type == "cuda":
        try:
            ops.cuda_check(device)
        except Exception:
            pass


def raise_flagged(flags, models, cycle, position, device, row=None):
    """``flags``: host ints, one per (role, model) of ``models``, of one request (``row``: its number in a batch).
    Raises the first flagged model's error (after clearing the ops' device-side records); returns if none."""
    for (who, model), bad in zip(models, flags):
        if bad:
            clear_device(device)
            raise error(who, model, cycle, position, row)
