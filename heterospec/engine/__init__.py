"""The decoding engine: one speculative cycle (DESIGN.md §3) over static, device-resident state.

- :mod:`.tree`: steps 1-5 (draft catch-up and growth on the draft's static cache, the entropy bin, Top-N
  selection, the verification tree padded to its bucket);
- :mod:`heterospec.models.target`: steps 6 and 8 on the target (verify forward, KV commit);
- :mod:`.loop`: the cycle itself, acceptance (step 7), its two declared sync points (:mod:`.sync`),
  streaming, EOS and stopping;
- :mod:`.stats`: what a call reports; :mod:`.hf_generate`: ``custom_generate`` for HF's generate().
"""
from .hf_generate import custom_generate
from .loop import HeteroSpec
from .stats import GenerationStats

__all__ = ["HeteroSpec", "GenerationStats", "custom_generate"]
