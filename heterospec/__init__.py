"""heterospec: lossless speculative decoding (EAGLE-3 drafts, HeteroSpec entropy-adaptive trees) on a C core.

The tree operations live in :mod:`heterospec.ops` (C core) and :mod:`heterospec.reference` (pure NumPy
twin with identical semantics); see docs/ops.md for their exact definitions.
"""
from ._types import VerifyTree

__version__ = "0.1.0"


def build_info():
    """What the C core was compiled with: ``{"cuda": bool, "version": str, "compiler": str, ...}``."""
    from . import _C

    info = dict(_C.build_info())
    info["package_version"] = __version__
    return info


__all__ = ["VerifyTree", "build_info", "__version__"]
