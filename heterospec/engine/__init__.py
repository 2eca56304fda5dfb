"""The decoding engine: one speculative cycle (DESIGN.md §3) over static, device-resident state."""
from .loop import GenerationStats, HeteroSpec, custom_generate

__all__ = ["HeteroSpec", "GenerationStats", "custom_generate"]
