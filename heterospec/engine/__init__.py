"""The decoding engine: one speculative cycle (docs/design.md, "The cycle") over static, device-resident state.

- :mod:`.cycle`: the cycle's steps in order (draft, verification tree, verify, accept, commit) and their
  recording per tree shape (:mod:`.graphs`);
- :mod:`.tree`: the drafters (``DraftState``: catch-up and growth on the draft's static cache, the
  verification tree padded to its bucket; ``NoDraft``: autoregressive decoding);
- :mod:`heterospec.models.target`: the target's side (verify forward, KV commit);
- :mod:`.loop`: ``HeteroSpec``: checks, caches, prefill, the host loop with its two declared sync points
  (:mod:`.sync`), streaming, EOS and stopping;
- :mod:`.health`: a model's non-finite logits, flagged in the cycle and raised as one error;
- :mod:`.stats`: what a call reports; :mod:`.hf_generate`: ``custom_generate`` for HF's generate().
"""
from .health import NonFiniteLogitsError
from .hf_generate import custom_generate
from .loop import HeteroSpec
from .stats import GenerationStats

__all__ = ["HeteroSpec", "GenerationStats", "NonFiniteLogitsError", "custom_generate"]
