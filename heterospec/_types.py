"""Small result types shared by the C-backed ops and the NumPy reference."""
from typing import Any, NamedTuple

# The ops every implementation (heterospec.ops: C core; heterospec.reference: NumPy) provides, with the
# same names and semantics (docs/ops.md).
OP_NAMES = (
    "topk_entropy",
    "expand",
    "select",
    "build_tree",
    "verify_greedy",
    "verify_sample",
    "kv_compact",
    "bucketize",
    "philox4x32",
    "philox_uniform",
)


class VerifyTree(NamedTuple):
    """The verification tree built by ``build_tree``.

    ``tokens[n+1]``, ``parents[n+1]``, ``depths[n+1]`` (int64), ``mask[n+1, n+1]`` (bool, ancestor-or-self)
    and ``retrieve[L, D+1]`` (int64, one root->leaf row per leaf, padded with -1). Node 0 is the root.
    Arrays come from the library of the inputs (NumPy or torch).
    """

    tokens: Any
    parents: Any
    depths: Any
    mask: Any
    retrieve: Any
