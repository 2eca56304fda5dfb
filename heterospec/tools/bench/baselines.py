"""The HuggingFace baselines run: :class:`HFGenerate`, an :class:`~.methods.HFMethod` through
``model.generate`` with the call shape of ``HeteroSpec.generate``.

They are timed with the same timer on the same prompts and budget as our methods (docs/design.md, "Measuring"), with the
same EOS ids, ``max_new_tokens`` and temperature semantics (top-k and top-p off, nothing else from the
model's generation config).  ``hf-static``: transformers compiles the forward (CUDA graphs) where its own
criterion says so (on CUDA, not on the CPU); ``hf-compiled``: on every device.  Whether it did is recorded
(:class:`BaselineStats`); the run's warm-up sizes the static cache for the longest conversation, so the timed
calls reuse one compiled shape.  They have no verification calls, tau or time split."""
from __future__ import annotations

import collections
import contextlib
import dataclasses


@dataclasses.dataclass
class BaselineStats:
    """What a ``model.generate`` call tells us: the new tokens (up to and including EOS) and, with a static
    cache, whether transformers compiled the forward (None: not known)."""

    new_tokens: int = 0
    compiled: bool | None = None


def eos_list(eos_token_id):
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


@contextlib.contextmanager
def _plain_model(model):
    """The model as a user has it during a baseline's call:
    - its generation config swapped for transformers' defaults, so that nothing from the checkpoint's config
      (repetition penalty, min length, its EOS or sampling defaults, ...) changes what the baseline decodes,
      which is what our engine decodes (every setting is passed explicitly);
    - no forward hooks on its modules: the open engines of the other methods capture the draft's hidden
      states with forward pre-hooks on the target's layers, which would cost the baseline time (and break
      the graph transformers compiles on CUDA).
    Both are put back afterwards."""
    from transformers import GenerationConfig

    saved = model.generation_config
    stashed = []
    for m in model.modules():
        for attr in _HOOK_DICTS:
            d = getattr(m, attr, None)
            if d:
                stashed.append((m, attr, d))
                setattr(m, attr, collections.OrderedDict())
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved
        for m, attr, d in stashed:
            setattr(m, attr, d)


@contextlib.contextmanager
def _compile_spy(model, seen):
    """Records in ``seen`` each decision of transformers' own auto-compile criterion
    (``_valid_auto_compile_criteria``, transformers 5.x) during the block; records nothing where the
    installed transformers has no such method."""
    orig = getattr(type(model), "_valid_auto_compile_criteria", None)
    if orig is None:
        yield
        return

    def spy(*a, **kw):
        r = orig(model, *a, **kw)
        seen.append(bool(r))
        return r

    model._valid_auto_compile_criteria = spy
    try:
        yield
    finally:
        del model._valid_auto_compile_criteria


def compile_everywhere():
    """transformers' ``CompileConfig`` (its defaults, as ``generate`` uses on CUDA) with the flag that lifts its
    device criterion: the static cache's forward compiled on a CPU too."""
    import transformers

    cc = getattr(transformers, "CompileConfig", None)
    if cc is None or not hasattr(cc, "_compile_all_devices"):
        raise RuntimeError(f"bench: method 'hf-compiled' expected a transformers whose CompileConfig has "
                           f"_compile_all_devices, got transformers {transformers.__version__}")
    cfg = cc()
    cfg._compile_all_devices = True
    return cfg


class HFGenerate:
    """A :class:`HFMethod` with the call shape of ``HeteroSpec.generate``: ``generate(input_ids,
    max_new_tokens=, temperature=, seed=, eos_token_id=) -> (sequences [1, S + new], BaselineStats)``.
    Greedy at temperature 0, else sampling at that temperature with top-k and top-p off (as the engine's
    defaults), seeded with ``torch.manual_seed(seed)``; stops at ``eos_token_id`` (an int or a list; none:
    no EOS stop) or after ``max_new_tokens`` tokens, EOS included in the count; ``min_new_tokens`` unset."""

    def __init__(self, model, method, *, pad_token_id=0):
        self.model, self.method, self.pad_token_id = model, method, pad_token_id

    def generate(self, input_ids, *, max_new_tokens, temperature=0.0, seed=None, eos_token_id=None,
                 cache_len=None, stop_after=None, attention_mask=None):
        """``cache_len`` / ``stop_after`` (the warm-up): size the static cache for ``cache_len`` positions
        (transformers keeps the largest size it has seen for later calls) and stop after ``stop_after`` new
        tokens.  A batch (``input_ids`` [B, S] left-padded with ``attention_mask``, as transformers batches
        prompts): returns (each row's new tokens, a list of lists, and the BaselineStats of the batch, its
        ``new_tokens`` summed over the rows)."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        eos = eos_list(eos_token_id)
        n_prompt = input_ids.shape[1]
        kw = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0, "eos_token_id": eos or None,
              "pad_token_id": self.pad_token_id}
        if temperature > 0:
            kw.update(temperature=float(temperature), top_k=0, top_p=1.0)
        if self.method.cache_implementation:
            kw["cache_implementation"] = self.method.cache_implementation
        if self.method.prompt_lookup_num_tokens:
            kw["prompt_lookup_num_tokens"] = self.method.prompt_lookup_num_tokens
        if self.method.compile_all_devices:
            kw["compile_config"] = compile_everywhere()
        if cache_len is not None:
            kw["max_new_tokens"] = max(max_new_tokens, cache_len - n_prompt)
        if stop_after is not None:
            class _StopAfter(StoppingCriteria):
                def __call__(self, ids, scores, **_):
                    return torch.full((ids.shape[0],), ids.shape[1] >= n_prompt + stop_after, dtype=torch.bool,
                                      device=ids.device)

            kw["stopping_criteria"] = StoppingCriteriaList([_StopAfter()])
        if seed is not None:
            torch.manual_seed(int(seed))
        seen = []
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        with torch.no_grad(), _plain_model(self.model), _compile_spy(self.model, seen):
            seq = self.model.generate(input_ids, attention_mask=mask, **kw)
        budget = max_new_tokens if stop_after is None else stop_after
        rows = []
        for new in seq[:, n_prompt:].tolist():
            # the same stop as the engine's, whatever the transformers version does past an EOS or the budget
            # (5.23 already crops prompt-lookup's accepted tokens at both); a batch pads a finished row after it
            n = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
            rows.append(new[:min(n, budget)])
        compiled = any(seen) if seen else None
        if input_ids.shape[0] > 1:
            return rows, BaselineStats(new_tokens=sum(len(r) for r in rows), compiled=compiled)
        n = len(rows[0])
        return seq[:, :n_prompt + n], BaselineStats(new_tokens=n, compiled=compiled)

    def close(self):
        pass
