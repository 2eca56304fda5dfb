"""The decoding engine: one speculative cycle (docs/design.md, "The cycle") over static, device-resident state,
for every batch size (batch 1 is a batch of one).

- :mod:`.cycle`: the cycle's steps in order (draft, verification tree, verify, accept, commit) on ``[B]`` state
  and their recording per tree shape (:mod:`.graphs`);
- :mod:`.tree`: the drafters (``DraftState``: catch-up and growth on the draft's static cache; ``NoDraft``:
  autoregressive decoding) and the verification tree with its one padding rule;
- :mod:`heterospec.models.target`: the target's side (verify forward, KV commit);
- :mod:`.loop`: ``HeteroSpec``: checks, caches, prefill, the one host loop with its declared sync points
  (:mod:`.sync`), streaming, EOS and stopping; :mod:`.requests`: the requests' padding and masks;
- :mod:`.processors` and :mod:`.lookup`: logits processors per tree node (eager cycle), and prompt lookup's
  n-gram chains grafted onto the trees on the device (eager and recorded);
- :mod:`.health`: a model's non-finite logits, flagged in the cycle and raised as one error;
- :mod:`.stats`: what a call reports; :mod:`.hf_generate`: ``custom_generate`` for HF's generate().
"""
from .health import NonFiniteLogitsError
from .hf_generate import custom_generate
from .loop import HeteroSpec
from .stats import GenerationStats

__all__ = ["HeteroSpec", "GenerationStats", "NonFiniteLogitsError", "custom_generate"]
