"""Small result types and argument rules shared by the C-backed ops and the NumPy reference."""
import math
from typing import Any, NamedTuple

import numpy as np

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

# The smallest temperature topk_entropy and verify_sample take (csrc's HS_MIN_TEMPERATURE): any finite float32
# logit divided by it stays finite in float64, so softmax(x / T) never meets inf - inf.  Below it, decode greedily.
MIN_TEMPERATURE = 1e-30


def is_decoding_temperature(t):
    """Whether a decoding call (generate, the CLI) takes temperature ``t``: 0 (greedy), or finite and at least
    MIN_TEMPERATURE."""
    return isinstance(t, (int, float)) and math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)


def sequence_as_array(x):
    """A Python list or tuple given for an array argument becomes a NumPy array (a convenience for small arguments);
    arrays, tensors and scalars pass through untouched.  Both implementations apply it to the same arguments."""
    return np.asarray(x) if isinstance(x, (list, tuple)) else x


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
