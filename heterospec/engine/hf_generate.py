"""``model.generate(..., custom_generate=heterospec.custom_generate)``: the engine behind HuggingFace's
generate loop."""
from __future__ import annotations

import torch

from .loop import HeteroSpec

# warpers the acceptance applies itself (verify_sample: temperature, then top-k, top-p and min-p, as HuggingFace
# orders them; min-p with the warper's own min_p); LogitNormalization
# (renormalize_logits) is a log-softmax: the same distribution, nothing to do
_WARPERS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"}
_SAME = {"LogitNormalization"}
# processors that compute each row from that row's own ids and scores: applied per tree node with its own path
# (heterospec.engine.processors), losslessly.  Any other (a row index, a model call, warpers we do not apply) is
# refused rather than silently ignored.
_PER_POSITION = {"RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
                 "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
                 "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
                 "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "ExponentialDecayLengthPenalty",
                 "InfNanRemoveLogitsProcessor"}
# criteria the engine applies itself (max_new_tokens, the EOS ids); any other (max_time, stop strings, a user's own)
# is asked per row after every new token
_OWN_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria"}


def split_processors(logits_processor, batch):
    """HuggingFace's processor list -> each row's per-position processors to apply per tree node, in order (a list
    of ``batch`` lists); a one-line ValueError naming any processor that cannot be applied losslessly here (one that
    is not a function of each row's own tokens, or that comes after the warpers, whose order the acceptance fixes).
    A repetition penalty that skips each row's padding (``prompt_ignore_length``, one length per row, as
    ``generate`` makes it from the attention mask) becomes one penalty per row with that row's length."""
    rows, refused, warped = [[] for _ in range(batch)], [], False
    for p in logits_processor or []:
        name = type(p).__name__
        skip = getattr(p, "prompt_ignore_length", None)
        if name in _WARPERS:
            warped = True
        elif name in _SAME:
            continue
        elif name not in _PER_POSITION or warped:
            refused.append(name)
        elif isinstance(skip, torch.Tensor):
            if skip.numel() != batch or name != "RepetitionPenaltyLogitsProcessor":
                refused.append(name)
                continue
            for row, n in zip(rows, skip.tolist()):
                row.append(type(p)(p.penalty, prompt_ignore_length=int(n)))
        else:
            for row in rows:
                row.append(p)
    if refused:
        raise ValueError(
            f"custom_generate: argument 'logits_processor' expected processors computed from each row's own tokens "
            f"before the temperature / top-k / top-p warpers ({', '.join(sorted(_PER_POSITION))}), got {refused}, "
            f"which speculative acceptance cannot reproduce losslessly; remove them from the generation config (a "
            f"processor of your own that computes each row from its own tokens goes to HeteroSpec.generate("
            f"logits_processor=...))")
    return rows


def _min_p(logits_processor):
    """The ``min_p`` of HuggingFace's ``MinPLogitsWarper`` in the list (the generation config's, or one passed in),
    None without one."""
    found = [p for p in logits_processor or [] if type(p).__name__ == "MinPLogitsWarper"]
    return float(found[-1].min_p) if found else None


def custom_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                    draft=None, policy=None, seed=None, streamer=None, cuda_graphs=False, cpu_decoder="auto",
                    disable_by_batch_size=None, stop_strings=None, tokenizer=None, **model_kwargs):
    """``model.generate(input_ids, custom_generate=heterospec.custom_generate, draft=..., policy=...)``.

    Needs a transformers release whose ``generate`` accepts a callable ``custom_generate`` (5.x; tested
    with 5.23).  Honours max_new_tokens / max_length, do_sample, temperature, top_k, top_p, min_p and the eos ids
    of the generation config, and the per-position processors it builds (repetition penalty, no repeated
    n-grams, bad words, sequence bias, minimum lengths, suppressed or forced tokens, length decay: each tree node
    processed with its own path, so the output is still the processed target's own; the call then runs the eager
    cycle, except for a repetition penalty alone, which runs on the device); refuses any other processor with a
    ValueError.  ``prompt_lookup_num_tokens`` and
    ``max_matching_ngram_size`` run prompt lookup inside our cycle (a chain grafted onto the draft's tree, or the
    whole tree without a draft; :meth:`HeteroSpec.generate`), batches included.  A batch of prompts comes left-padded
    with its ``attention_mask``, as HuggingFace pads prompts for generation: every row decodes on its own,
    losslessly, and the result is what HuggingFace returns for a batch -- [B, S + the longest generation], each
    row's input, its new tokens, then the generation config's ``pad_token_id`` (else its first EOS id) after
    the row finished.  Other stopping criteria are asked per row (each with that row's own tokens); a streamer
    takes batch 1.
    ``cuda_graphs`` as in :class:`HeteroSpec`, but False by default here where :class:`HeteroSpec` defaults to
    'auto': each call builds its engine, so it would record its graphs anew (0.4-1.6 s for the default pair on an
    H200); for many calls keep one ``HeteroSpec`` instead (a batch runs the eager steps).  ``cpu_decoder`` and
    ``disable_by_batch_size`` as in :class:`HeteroSpec` (the decoder's packed weights are made once per model and
    kept for later calls).  Returns the sequences; with the generation config's ``return_dict_in_generate``, a
    ``GenerateDecoderOnlyOutput`` as HuggingFace's generate returns it, with ``logits`` (``output_logits``: the
    target's raw logits each new token was decided from) and ``scores`` (``output_scores``: those logits through
    the call's processors and warpers, HuggingFace's own objects applied to each step's ids as its loop applies
    them), each a tuple of one [B, V] tensor per new column; a row that already finished holds a distribution
    certain of the padding token there (0 at ``pad_token_id``, -inf elsewhere), where HuggingFace holds the logits
    of its padded continuation.  Attentions and hidden states are refused in one line.

    Stop strings: transformers 5.x's ``generate`` keeps the ``tokenizer`` argument from a ``custom_generate``
    callable, so ``stop_strings=[...], tokenizer=tok`` cannot reach the engine this way; pass
    ``stopping_criteria=StoppingCriteriaList([StopStringCriteria(tok, [...])])`` (asked per row after every new
    token: the same output), or call :meth:`HeteroSpec.generate` with ``stop_strings`` and ``tokenizer``.  A
    ``stop_strings`` argument without a tokenizer is refused in one line saying so."""
    gc = generation_config
    beams = getattr(gc, "num_beams", 1) or 1
    if beams != 1:
        raise ValueError(f"custom_generate: argument 'num_beams' expected 1 (speculative decoding reproduces greedy "
                         f"or sampled decoding, not beam search), got {beams}")
    if stop_strings is not None and tokenizer is None:
        raise ValueError("custom_generate: argument 'stop_strings' expected the tokenizer beside it, which "
                         "transformers' generate does not pass to a custom_generate callable; pass stopping_criteria="
                         "StoppingCriteriaList([StopStringCriteria(tokenizer, stop_strings)]) instead (the same "
                         "output), or HeteroSpec.generate(stop_strings=..., tokenizer=...)")
    _check_model_inputs(model_kwargs)
    procs = split_processors(logits_processor, input_ids.shape[0])
    as_dict = bool(getattr(gc, "return_dict_in_generate", False))
    for name in ("output_attentions", "output_hidden_states"):
        if as_dict and getattr(gc, name, False):
            raise ValueError(f"custom_generate: argument '{name}' expected False (the speculative cycle keeps no "
                             f"per-step attentions or hidden states), got True")
    want_logits = as_dict and bool(getattr(gc, "output_logits", False) or getattr(gc, "output_scores", False))
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
        seq, stats = hs.generate(
            input_ids, attention_mask=mask, pad_token_id=int(pad), max_new_tokens=max_new,
            temperature=float(gc.temperature if gc.temperature is not None else 1.0) if sample else 0.0,
            top_k=int(gc.top_k or 0) if sample else 0, top_p=float(gc.top_p if gc.top_p is not None else 1.0) if sample else 1.0,
            min_p=_min_p(logits_processor) if sample else None,
            eos_token_id=eos, stopping_criteria=criteria, streamer=streamer, seed=seed, logits_processor=procs,
            prompt_lookup_num_tokens=getattr(gc, "prompt_lookup_num_tokens", None),
            max_matching_ngram_size=getattr(gc, "max_matching_ngram_size", None), output_logits=want_logits,
            stop_strings=stop_strings, tokenizer=tokenizer)
    seq = seq.to(input_ids.device)
    if not as_dict:
        return seq
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    logits = scores = None
    if want_logits:
        rows = stats.per_row or [stats]
        logits = _steps([r.logits for r in rows], seq.shape[1] - input_ids.shape[1], int(pad))
        if getattr(gc, "output_scores", False):
            scores = _scores(logits, [r.logits.shape[0] for r in rows], seq, input_ids.shape[1], logits_processor,
                             int(pad))
        if not getattr(gc, "output_logits", False):
            logits = None
    return GenerateDecoderOnlyOutput(sequences=seq, scores=scores, logits=logits)


# the tensors generate hands a custom_generate that the engine rebuilds from input_ids itself (positions from the
# attention mask, its own cache); any other tensor or non-empty container (pixel_values, image_grid_thw,
# inputs_embeds, input_features, transformers' precomputed mm_encoder_outputs of an image, a token_type_ids that marks
# image tokens, ...) is an input the engine would ignore, so it is refused
_REBUILT = {"attention_mask", "position_ids", "cache_position"}


def _check_model_inputs(model_kwargs):
    """A one-line ValueError naming the first model input the engine cannot take (it decodes ``input_ids`` alone:
    a vision-language model's text generation, not its images)."""
    for name, value in model_kwargs.items():
        if name in _REBUILT:
            continue
        if isinstance(value, torch.Tensor):
            if name == "token_type_ids" and not bool(value.any()):
                continue                  # all text (Gemma 3's processor marks image tokens with 1)
            got = f"a tensor of shape {tuple(value.shape)}"
        elif isinstance(value, (dict, list, tuple)) and len(value) > 0:
            got = f"a {type(value).__name__} of {len(value)} ({', '.join(map(str, list(value)[:3]))})" \
                if isinstance(value, dict) else f"a {type(value).__name__} of {len(value)}"
        else:
            continue
        raise ValueError(f"custom_generate: argument '{name}' expected None (the speculative engine decodes "
                         f"input_ids alone: text, no images, audio or embeddings), got {got}")


def _pad_row(like, pad):
    """A [V] row certain of the padding token: what a finished row's step holds."""
    row = torch.full(like.shape[-1:], float("-inf"), dtype=like.dtype, device=like.device)
    row[pad] = 0.0
    return row


def _steps(per_row, N, pad):
    """Each row's [n_b, V] logits -> a tuple of N [B, V] tensors, one per new column (a finished row's steps
    certain of ``pad``)."""
    done = _pad_row(per_row[0], pad)
    return tuple(torch.stack([x[t] if t < x.shape[0] else done for x in per_row]) for t in range(N))


def _scores(logits, counts, seq, S, logits_processor, pad):
    """HuggingFace's ``scores``: step t's logits through the processor list with the ids before it (``seq[:,
    :S + t]``), as its sampling loop calls them; finished rows' steps stay certain of ``pad``."""
    out = []
    ids = seq.to(logits[0].device) if logits else seq
    done = _pad_row(logits[0], pad) if logits else None
    for t, lt in enumerate(logits):
        st = lt.clone()
        for proc in logits_processor or []:
            st = proc(ids[:, :S + t], st)
        for b, n in enumerate(counts):
            if t >= n:
                st[b] = done
        out.append(st)
    return tuple(out)
