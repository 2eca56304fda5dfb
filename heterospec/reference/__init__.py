"""Pure NumPy reference implementation of every op in docs/ops.md.

This package is the *executable specification*: each function follows the text of docs/ops.md step by step
and favours clarity over speed (while staying vectorised where that is natural).  The C core
(``heterospec.ops``) must agree with it: integers exactly, floats to float32 rounding.

It is laid out per op family, like the C core's files (csrc/core/):

* ``entropy.py``: topk_entropy and bucketize (entropy.c);
* ``tree.py``: expand, select and build_tree (tree.c);
* ``verify.py``: verify_greedy and verify_sample, and the Philox4x32-10 generator they draw from, philox4x32
  and philox_uniform (verify.c);
* ``kv.py``: kv_compact and KVTensors (kv.c);
* ``gemm.py``: rows_linear, the few-rows float32 matrix product of ``cpu_gemm='rows'`` (csrc/gemm/rows.c), bit
  for bit (a kernel of heterospec._gemm, not of heterospec.ops), and find_codes, the search for the block codes
  that decode to a weight (csrc/gemm/codes.c);
* ``decoder.py``: the pieces of ``cpu_decoder``'s forward (csrc/gemm/decoder.c: dot16, exp, rmsnorm, attend,
  rotate, silu_mul) and the whole forward from them (decoder_layers; the EAGLE-3 draft's step and head:
  draft_layer), bit for bit;
* ``_common.py``: the argument checks and helpers the families share (common.c).

Every public name is re-exported here: use ``heterospec.reference.<op>``, not the family modules.

Conventions (see docs/ops.md, "Conventions"):

* inputs may be NumPy arrays or anything ``np.asarray`` accepts (torch CPU tensors included; bfloat16 is
  not supported here because NumPy has no bfloat16 -> TypeError); outputs are always NumPy;
* logits are converted to float32 (then widened to float64 exactly); reductions accumulate in float64;
* non-C-contiguous arrays are refused (ValueError) -- we never copy silently;
* every error message starts with ``<op>: argument '<name>'`` and says what was expected and given;
* the signatures are those of heterospec.ops.  `stream` and `check` concern CUDA launches and are accepted and
  ignored here (NumPy runs synchronously and raises at once); `device_outputs` gives the padded,
  host-sync-free result form of the CUDA path, so code written for it runs on the twin too.
"""
from __future__ import annotations

# re-exports (noqa: __all__ names the ops through OP_NAMES, which pyflakes cannot see into); MIN_TEMPERATURE and
# sequence_as_array stay importable as they were from the single-file module this package replaced
from .._types import MIN_TEMPERATURE, OP_NAMES, VerifyTree, sequence_as_array  # noqa: F401
from .entropy import bucketize, topk_entropy  # noqa: F401
from .decoder import attend, decoder_layers, dot16, draft_layer, rmsnorm, rotate, silu_mul  # noqa: F401
from .gemm import find_codes, rows_linear  # noqa: F401
from .kv import KVTensors, kv_compact  # noqa: F401
from .tree import build_tree, expand, select  # noqa: F401
from .verify import philox4x32, philox_uniform, verify_greedy, verify_sample  # noqa: F401

__all__ = [*OP_NAMES, "VerifyTree", "KVTensors", "rows_linear", "find_codes", "attend", "decoder_layers", "dot16",
           "draft_layer", "rmsnorm", "rotate", "silu_mul"]
