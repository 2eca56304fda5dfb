"""heterospec inside other engines.  :mod:`.vllm`: HeteroSpec's entropy-binned draft lengths for vLLM's EAGLE-3
proposer, loaded through vLLM's plugin entry point (``pip install "heterospec[vllm]"``).  Nothing here is
imported by the rest of the package; each module imports its engine only when that engine calls it."""
