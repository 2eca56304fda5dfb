"""Models: the EAGLE-3 draft and its checkpoint formats (:mod:`.draft`), the HuggingFace target's taps
(:mod:`.target`), the embedded default pair (:mod:`.default`) and head training (:mod:`.train`)."""
