"""heterospec: lossless speculative decoding (EAGLE-3 drafts, HeteroSpec entropy-adaptive trees) on a C core.

The tree operations live in :mod:`heterospec.ops` (C core) and :mod:`heterospec.reference` (pure NumPy
twin with identical semantics); see docs/ops.md for their exact definitions.
"""
from ._types import VerifyTree

__version__ = "0.1.0"

_LAZY = {  # the torch/transformers side loads on first use, so `import heterospec` needs only NumPy
    "HeteroSpec": ("engine", "HeteroSpec"),
    "GenerationStats": ("engine", "GenerationStats"),
    "custom_generate": ("engine", "custom_generate"),
    "Policy": ("policy", "Policy"),
    "Eagle3Draft": ("models.draft", "Eagle3Draft"),
    "Eagle3Config": ("models.draft", "Eagle3Config"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module 'heterospec' has no attribute {name!r}")


def build_info():
    """What the C core was compiled with: ``{"cuda": bool, "version": str, "compiler": str, ...}``."""
    from . import _C

    info = dict(_C.build_info())
    info["package_version"] = __version__
    return info


__all__ = ["VerifyTree", "build_info", "__version__", *_LAZY]
