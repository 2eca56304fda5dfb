"""A batch's requests on their way in: prompts left-padded as a HuggingFace tokenizer pads them, the attention
mask checked (each row's prompt length), the memory a batch's caches may take, and host lists copied to the
device without a sync.  Used by the host loop (:mod:`.loop`) and the batched cycle (:mod:`.batch`)."""
from __future__ import annotations

import torch


def left_pad(prompts, pad_token_id, device):
    """A list of prompts (1-D int sequences, or [1, S] tensors) -> (ids [B, S], attention_mask [B, S]) left-padded
    as a HuggingFace tokenizer pads a batch for generation."""
    rows = []
    for i, p in enumerate(prompts):
        t = torch.as_tensor(p).reshape(-1)
        if t.numel() == 0:
            raise ValueError(f"generate: argument 'input_ids' expected a token in every prompt, got an empty "
                             f"prompt at index {i}")
        if not _integer(t.dtype):
            raise ValueError(f"generate: argument 'input_ids' expected integer token ids in every prompt, got "
                             f"{t.dtype} at index {i}")
        rows.append(t.to("cpu", torch.long))
    S = max(r.numel() for r in rows)
    ids = torch.full((len(rows), S), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), S), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, S - r.numel():] = r
        mask[b, S - r.numel():] = 1
    return ids.to(device), mask.to(device)


def _integer(dtype):
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_ids(input_ids, vocab):
    """One-line errors for prompts that are not token ids of a ``vocab``-token model: a float or bool tensor, or an
    id outside [0, vocab) at any position, the padding included (the prefill embeds every position) -- which would
    otherwise fail inside the embedding, or read past it on a GPU."""
    if not _integer(input_ids.dtype):
        raise ValueError(f"generate: argument 'input_ids' expected integer token ids, got {input_ids.dtype}")
    if input_ids.numel() and vocab is not None:
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"generate: argument 'input_ids' expected token ids in [0, {vocab}) (the target's "
                             f"vocabulary) at every position, the padding included, got {lo if lo < 0 else hi}")


def check_mask(input_ids, attention_mask):
    """The prompts' lengths (a host list) from a left-padded ``attention_mask`` [B, S] of 0/1; one-line errors
    for a wrong shape, an empty row or padding after a token."""
    if input_ids.shape[1] < 1:
        raise ValueError("generate: argument 'input_ids' expected at least one token, got 0")
    if attention_mask is None:
        return [input_ids.shape[1]] * input_ids.shape[0]
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"generate: argument 'attention_mask' expected a torch.Tensor of the shape of input_ids "
                         f"{tuple(input_ids.shape)}, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"generate: argument 'attention_mask' expected the shape of input_ids "
                         f"{tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    m = attention_mask.detach().to("cpu", torch.long)
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("generate: argument 'attention_mask' expected only 0 and 1, got other values")
    lengths = m.sum(1).tolist()
    for b, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"generate: argument 'attention_mask' expected at least one token per row, got an "
                             f"empty row {b}")
        if bool((m[b, m.shape[1] - n:] != 1).any()):
            raise ValueError(f"generate: argument 'attention_mask' expected left padding (zeros only before the "
                             f"tokens), got a zero after a token in row {b}")
    return lengths


def to_device(values, device, dtype=torch.long):
    """A host list as a tensor on ``device``.  On a GPU through pinned memory with a non-blocking copy:
    ``torch.tensor(values, device="cuda")`` synchronises the stream, which inside a cycle would wait for the
    draft's work already launched (a third host sync per cycle)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True).to(device, non_blocking=True)


def gap_filled(keep, batch):
    """The order in which a batch of ``batch`` rows keeps the rows ``keep`` (ascending) when the others finish:
    each kept row below ``len(keep)`` stays where it is, and the kept rows past it fill the finished rows' places
    below it, in order.  The fewest rows move (one per finished row below the new size, none when the last rows
    finish), and each comes from past the new size, so a cache can move them in place
    (:meth:`~heterospec.models.target.TargetAdapter.keep_rows`)."""
    n = len(keep)
    if any(not 0 <= r < batch for r in keep) or sorted(set(keep)) != list(keep):
        raise ValueError(f"gap_filled: argument 'keep' expected ascending distinct rows of [0, {batch}), got {keep}")
    kept = set(keep)
    order = list(range(n))
    holes = [i for i in range(n) if i not in kept]
    for h, r in zip(holes, [r for r in keep if r >= n]):
        order[h] = r
    return order
