"""``model.generate(..., custom_generate=heterospec.custom_generate)``: the engine behind HuggingFace's
generate loop."""
from __future__ import annotations

import torch

from .loop import HeteroSpec

# processors that only warp the distribution the way verify_sample already does (we apply those ourselves);
# anything else changes the distribution per position (penalties, bans, forced tokens, min length...) and
# is refused rather than silently ignored
_WARPERS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
_OWN_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria", "MaxTimeCriteria"}


def custom_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                    draft=None, policy=None, seed=None, streamer=None, cuda_graphs=False, cpu_decoder="auto",
                    disable_by_batch_size=None, **model_kwargs):
    """``model.generate(input_ids, custom_generate=heterospec.custom_generate, draft=..., policy=...)``.

    Needs a transformers release whose ``generate`` accepts a callable ``custom_generate`` (5.x; tested
    with 5.23).  Honours max_new_tokens / max_length, do_sample, temperature, top_k, top_p and the eos ids
    of the generation config; refuses logits processors that would change the distribution per position
    (repetition penalty, bad words, min length, ...) with a ValueError.  A batch of prompts comes left-padded
    with its ``attention_mask``, as HuggingFace pads prompts for generation: every row decodes on its own,
    losslessly, and the result is what HuggingFace returns for a batch -- [B, S + the longest generation], each
    row's input, its new tokens, then the generation config's ``pad_token_id`` (else its first EOS id) after
    the row finished.  Other stopping criteria are asked per row (each with that row's own tokens); a streamer
    takes batch 1.
    ``cuda_graphs`` as in :class:`HeteroSpec`, but False by default here where :class:`HeteroSpec` defaults to
    'auto': each call builds its engine, so it would record its graphs anew (0.4-1.6 s for the default pair on an
    H200); for many calls keep one ``HeteroSpec`` instead (a batch runs the eager steps).  ``cpu_decoder`` and
    ``disable_by_batch_size`` as in :class:`HeteroSpec` (the decoder's packed weights are made once per model and
    kept for later calls).  Returns the sequences."""
    gc = generation_config
    extra = [type(p).__name__ for p in (logits_processor or []) if type(p).__name__ not in _WARPERS]
    if extra:
        raise ValueError(
            f"custom_generate: logits processors {extra} would change the target's distribution per position, "
            f"which speculative acceptance cannot reproduce losslessly; remove them from the generation config"
        )
    mask = model_kwargs.get("attention_mask")
    if gc.max_new_tokens is not None:
        max_new = gc.max_new_tokens
    else:
        max_new = gc.max_length - input_ids.shape[1]
    sample = bool(gc.do_sample)
    eos = gc.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in torch.as_tensor(eos).view(-1)])
    criteria = [c for c in (stopping_criteria or []) if type(c).__name__ not in _OWN_CRITERIA]
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
    if isinstance(pad, (list, tuple)) or (isinstance(pad, torch.Tensor) and pad.numel() != 1):
        pad = int(torch.as_tensor(pad).view(-1)[0])
    with HeteroSpec(model, draft, policy, cuda_graphs=cuda_graphs, cpu_decoder=cpu_decoder,
                    disable_by_batch_size=disable_by_batch_size) as hs:
        seq, _ = hs.generate(
            input_ids, attention_mask=mask, pad_token_id=int(pad), max_new_tokens=max_new,
            temperature=float(gc.temperature if gc.temperature is not None else 1.0) if sample else 0.0,
            top_k=int(gc.top_k or 0) if sample else 0, top_p=float(gc.top_p if gc.top_p is not None else 1.0) if sample else 1.0,
            eos_token_id=eos, stopping_criteria=criteria, streamer=streamer, seed=seed)
    return seq.to(input_ids.device)
