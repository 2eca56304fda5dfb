"""Tree operations of EAGLE-3 / HeteroSpec speculative decoding, on heterospec's C core.

Every function here has a pure-NumPy twin of the same name and signature in :mod:`heterospec.reference`;
docs/ops.md defines both exactly.  Inputs may be NumPy arrays or torch tensors (imported zero-copy
through DLPack; torch is never linked) or any object with ``__dlpack__`` or the buffer protocol; Python
lists are converted with NumPy.  Outputs are allocated with the library of the first array argument, so a
NumPy input gives NumPy outputs and a torch tensor gives torch tensors on its device.  Arrays must be
C-contiguous: nothing is copied silently.

Errors: wrong type or dtype -> TypeError; wrong ndim, shape relation, range, order, non-finite logits,
non-contiguous or mixed-device arrays -> ValueError; refused tensor import -> BufferError.  Every message
names the op and the argument and says what was expected and what was given.

CUDA tensors (torch or CuPy) run the kernels of csrc/cuda/ when the extension was built with them
(``heterospec.build_info()["cuda"]``), with the same semantics.  Every op then takes:

- ``stream``: a CUDA stream (``torch.cuda.Stream``, a CuPy stream, or a raw ``cudaStream_t`` int); by
  default the current torch (or CuPy) stream of the input's device.  It is also handed to the producer's
  ``__dlpack__(stream=...)`` so its pending work is ordered before ours.
- ``check`` (default True): synchronise the stream after the launch and raise the device-side value checks
  (NaN logits, a non-closed selection...).  Pass ``check=False`` for an asynchronous call (and inside CUDA
  graph capture); errors then surface at the next checked call or at :func:`cuda_check`.
- ``device_outputs`` (build_tree, verify_greedy, verify_sample; default False): return results that would
  otherwise need a host synchronisation as device arrays instead (see each op), so a whole cycle can run,
  and be captured in a CUDA graph, without one.  Works for CPU arrays too (then they are NumPy/torch CPU).

Scratch memory on the GPU is one module-owned buffer per device, grown outside graph capture (run an op
once before capturing, or call :func:`cuda_reserve`); calls from two host threads on two streams of one
device at the same time would share it and are not supported.
"""
from __future__ import annotations

import operator

import numpy as np

from ._native import _C
from ._types import MIN_TEMPERATURE, OP_NAMES, VerifyTree, is_decoding_temperature, sequence_as_array

__all__ = [*OP_NAMES, "VerifyTree", "KVTensors", "MIN_TEMPERATURE", "is_decoding_temperature"]


def _np_alloc(shape, dtype):
    return np.empty(shape, dtype=dtype)


_torch_allocs = {}
_ALLOCATORS = {}  # array type -> alloc(like) factory, for array libraries beyond NumPy/torch/CuPy (tests)


def _allocator(like):
    """An ``alloc(shape, dtype_name)`` that allocates outputs with ``like``'s library and device."""
    lib = type(like).__module__.partition(".")[0]
    if lib == "cupy":
        import cupy

        def alloc(shape, dtype, _device=like.device):
            with _device:
                return cupy.empty(shape, dtype=dtype)

        return alloc
    if lib != "torch":
        factory = _ALLOCATORS.get(type(like))
        return factory(like) if factory is not None else _np_alloc
    device = like.device
    alloc = _torch_allocs.get(device)
    if alloc is None:
        import torch

        dtypes = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}

        def alloc(shape, dtype, _device=device):
            return torch.empty(shape, dtype=dtypes[dtype], device=_device)

        _torch_allocs[device] = alloc
    return alloc


def _stream(like, stream):
    """The cudaStream_t (int) a call on ``like`` runs on, or None for arrays not on a CUDA device."""
    if stream is not None:
        for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        if isinstance(stream, bool) or not isinstance(stream, int):
            raise TypeError(f"argument 'stream' expected a CUDA stream or an int, got {type(stream).__name__}")
        return stream
    lib = type(like).__module__.partition(".")[0]
    if lib == "torch":
        if like.device.type != "cuda":
            return None
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the raw handle, without a Stream object
        if raw is not None:
            index = like.device.index
            return raw(torch.cuda.current_device() if index is None else index)
        return torch.cuda.current_stream(like.device).cuda_stream
    if lib == "cupy":
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return None


def cuda_check(device=0, stream=None):
    """Synchronise ``stream`` (default: torch's current stream of ``device``) and raise the first device-side
    error recorded by ``check=False`` calls on that device since the last check."""
    index = getattr(device, "index", device)
    index = 0 if index is None else int(index)
    if stream is None:
        try:
            import torch

            stream = torch.cuda.current_stream(index).cuda_stream if torch.cuda.is_available() else 0
        except ImportError:
            stream = 0
    _C.cuda_check(index, _stream(None, stream))


def cuda_reserve(device, nbytes):
    """Grow the module's GPU workspace on ``device`` to ``nbytes`` now, before capturing a CUDA graph.  Returns
    (the workspace's bytes, how many earlier workspaces are kept): a workspace replaced by a larger one is never
    freed, since graphs recorded with it still read its address."""
    index = getattr(device, "index", device)
    return _C.cuda_reserve(0 if index is None else int(index), int(nbytes))


def cuda_new_stream(device):
    """A new non-blocking CUDA stream on ``device`` (its ``cudaStream_t`` as an int, for
    ``torch.cuda.ExternalStream``).  heterospec never destroys it: the engine gives each live set of recorded
    graphs a stream of its own and hands a stream on only once the set that used it is gone
    (:func:`heterospec.engine.graphs.capture_stream`)."""
    index = getattr(device, "index", device)
    return _C.cuda_new_stream(0 if index is None else int(index))


_arr = sequence_as_array


def _logits_arr(x, op, name):
    """Logits given as a Python list become float32 (np.asarray would make float64, which no logits op takes,
    and the error would name a dtype the caller never wrote)."""
    if not isinstance(x, (list, tuple)):
        return x
    try:
        return np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: argument '{name}' expected numbers (a list of rows of logits), got "
                        f"{type(x).__name__} that is not one") from None


def _batched(x, ndim):
    """Whether ``x``, an op's leading array, carries the batch dimension (``ndim`` dimensions in the batched form).

    The C binding takes the batch-first form only; for an unbatched call (False) it views every per-request array
    with a leading batch dimension of 1 and returns outputs without it (shape bookkeeping on the imported views:
    no copy, no indexing of the caller's tensors).  None (an array type without ``ndim``) lets the binding read the
    number of dimensions from the import."""
    nd = getattr(x, "ndim", None)
    return None if nd is None else nd == ndim


def topk_entropy(logits, k, temperature=1.0, *, stream=None, check=True):
    """Per-row entropy (nats) of softmax over the ``k`` largest logits divided by ``temperature``.

    ``logits[N, V]`` float16/bfloat16/float32 -> ``float32[N]``.  The per-step term of HeteroSpec's Eq. 1.
    Batched: ``logits[batch, N, V]`` -> ``float32[batch, N]``, row by row.
    """
    logits = _logits_arr(logits, "topk_entropy", "logits")
    return _C.topk_entropy(logits, k, temperature, _allocator(logits), _stream(logits, stream), check,
                           _batched(logits, 3))


def expand(logits, beam_scores, beam_nodes, k, d2t=None, node_offset=0, *, stream=None, check=True):
    """One level of the EAGLE-2/3 dynamic tree.

    ``logits[B, Vd]``, ``beam_scores[B]``, ``beam_nodes[B]`` -> ``(tokens[B*k] int64, scores[B*k] float32,
    parents[B*k] int64, entropy[B] float32, next_beams[k] int64)``.  Candidate ``b*k + j`` is row b's j-th
    most likely token (ties to the lower id), numbered ``node_offset + b*k + j``; its token is mapped through
    ``d2t`` (draft->target offsets) when given; its score is ``beam_scores[b] + log_softmax(logits[b])[id]``;
    its parent is ``beam_nodes[b]``.  ``next_beams`` are the node numbers of the k best scores.

    Batched: ``logits[batch, B, Vd]``, ``beam_scores`` / ``beam_nodes`` ``[batch, B]`` -> every output with a
    leading batch dimension (``tokens[batch, B*k]`` ... ``next_beams[batch, k]``), row b as the unbatched
    call on row b (``d2t`` and ``node_offset`` shared by the rows).
    """
    logits = _logits_arr(logits, "expand", "logits")
    return _C.expand(
        logits, _arr(beam_scores), _arr(beam_nodes), k, _arr(d2t), node_offset, _allocator(logits),
        _stream(logits, stream), check, _batched(logits, 3),
    )


def select(scores, n, *, m=None, width=None, stream=None, check=True):
    """Indices of the ``n`` highest ``scores[M]`` (ties to the lower index), in ascending order -> int64[n].
    Batched: ``scores[batch, M]`` with the same ``n`` for every row -> ``int64[batch, n]``, row by row.

    Per-row sizes (batched only): ``n`` an int64 ``[batch]`` array and/or ``m`` an int64 ``[batch]`` array (row b
    selects among its first ``m[b]`` scores), both on the scores' device -> ``int64[batch, width]`` (``width``
    defaults to M for an array ``n``, to ``n`` for an int), row b's first ``n[b]`` entries as the unbatched call
    on ``scores[b, :m[b]]`` gives them, the rest -1.
    """
    scores = _arr(scores)
    return _C.select(scores, _arr(n), _arr(m), width, _allocator(scores), _stream(scores, stream), check,
                     _batched(scores, 2))


def build_tree(tokens, parents, selected, root_token, *, n=None, stream=None, check=True, device_outputs=False):
    """Verification tree of a parent-closed selection of candidates -> :class:`VerifyTree`.

    ``tokens[M]``, ``parents[M]`` (candidate index or -1), ``selected[n]`` (strictly ascending) ->
    ``VerifyTree(tokens[n+1], parents[n+1], depths[n+1], mask[n+1, n+1] bool, retrieve[L, D+1])`` with node 0
    the root (``root_token``), the ancestor-or-self mask and one root->leaf row per leaf padded with -1.

    With ``device_outputs=True``: ``(VerifyTree, num_leaves, max_depth)`` where ``retrieve`` is padded to
    ``[n+1, n+1]`` (rows past the leaves all -1) and the two counts are 0-d arrays, so no host sync is needed.
    On CUDA without it, ``retrieve`` is a ``[:L, :D+1]`` view of the padded rows.

    Batched: ``tokens`` / ``parents`` ``[batch, M]``, ``selected[batch, N]`` with ``n`` (int64 ``[batch]`` on the
    inputs' device, or None for N) valid entries per row and ``root_token`` an int or an int64 ``[batch]`` array
    -> always ``(VerifyTree(tokens[batch, N+1], ..., mask[batch, N+1, N+1], retrieve[batch, N+1, N+1]),
    num_leaves[batch], max_depth[batch])``: row b's first ``n[b]+1`` nodes are the unbatched call's on that
    row's first ``n[b]`` entries, the rest -1 (mask False); ``device_outputs`` does not apply.
    """
    tokens = _arr(tokens)
    batched = _batched(tokens, 2)
    root_token = root_token if batched is False else _arr(root_token)  # an unbatched call's root is an int
    out = _C.build_tree(tokens, _arr(parents), _arr(selected), root_token, _arr(n), _allocator(tokens),
                        _stream(tokens, stream), check, device_outputs, batched)
    if len(out) == 7:  # batched, or device_outputs: the padded tree and its two counts
        return VerifyTree(*out[:5]), out[5], out[6]
    return VerifyTree(*out)


def verify_greedy(tree_tokens, tree_parents, target_logits, *, n=None, stream=None, check=True, device_outputs=False):
    """Greedy acceptance: ``(path int64[len], next_token int)``.

    From node 0, repeatedly moves to the child (lowest index first) whose token is the argmax of the
    target's logits at the current node; ``next_token`` is the argmax at the last node.  The accepted tokens
    plus ``next_token`` are exactly the target's greedy continuation.

    With ``device_outputs=True``: ``(path[n] padded with -1, length, next_token)``, the last two 0-d int64
    arrays on the input's device (no host sync on CUDA).

    Batched (the C ABI's batch-first form): ``tree_tokens``, ``tree_parents`` ``[batch, T]``, ``target_logits``
    ``[batch, T, V]``, ``n`` None (every row has T nodes) or an int64 ``[batch]`` array on the inputs' device
    (nodes per row; the rest of a row is ignored).  Returns arrays on the inputs' device: ``(path [batch, T]
    padded with -1, length [batch], next_token [batch])``; each row is what the unbatched call gives for
    that row's first ``n[b]`` nodes.  ``device_outputs`` does not apply (batched results are always arrays).
    """
    target_logits = _logits_arr(target_logits, "verify_greedy", "target_logits")
    tree_tokens = _arr(tree_tokens)
    return _C.verify_greedy(tree_tokens, _arr(tree_parents), target_logits, _arr(n), _allocator(tree_tokens),
                            _stream(tree_tokens, stream), check, device_outputs, _batched(tree_tokens, 2))


def verify_sample(
    tree_tokens, tree_parents, target_logits, *, temperature, top_k=0, top_p=1.0, seed, offset, n=None,
    stream=None, check=True, device_outputs=False, advance_offset=False, min_p=0.0,
):
    """Lossless tree acceptance under sampling: ``(path int64[len], next_token int, draws int)``.

    Recursive rejection sampling with point-mass sibling proposals against the target distribution warped
    in HuggingFace order (temperature, top-k, top-p, then min-p: a token whose probability after the others is
    below ``min_p`` times the largest is removed; 0 disables it).  Uniforms come from Philox4x32-10 keyed by ``seed``
    with counter ``offset + draw index``; ``draws`` says how many were used (advance ``offset`` by it).
    The emitted tokens follow the warped target distribution exactly.

    With ``device_outputs=True``: ``(path[n] padded with -1, length, next_token, draws)``, the last three 0-d
    int64 arrays.  ``seed`` and ``offset`` may also be 1-element int64 tensors on the device of the logits (their
    int64 bits are the uint64 value).  On CUDA they are read when the kernel runs, so a captured graph can be
    replayed with new values; with ``advance_offset=True`` the kernel adds ``draws`` to the ``offset`` tensor, so
    each replay draws fresh uniforms.  On the CPU (a NumPy array or torch CPU tensor) they are read when the op
    runs, and ``advance_offset=True`` writes ``offset + draws`` back into the (writable) ``offset`` tensor the
    same way.

    Batched: trees and logits as in :func:`verify_greedy`; ``seed`` and ``offset`` each a Python int (the
    same for every row) or an int64 ``[batch]`` array on the inputs' device (per row; ``advance_offset=True``
    needs ``offset`` as an array and advances each row by its own draws).  Returns ``(path [batch, T] padded
    with -1, length, next_token, draws)``, the last three ``[batch]``; row b equals the unbatched call on row
    b with ``seed[b]``, ``offset[b]``.
    """
    target_logits = _logits_arr(target_logits, "verify_sample", "target_logits")
    tree_tokens = _arr(tree_tokens)
    return _C.verify_sample(
        tree_tokens, _arr(tree_parents), target_logits, _arr(n), temperature, top_k, top_p, seed, offset,
        _allocator(tree_tokens), _stream(tree_tokens, stream), check, device_outputs, advance_offset,
        _batched(tree_tokens, 2), min_p,
    )


def kv_compact(tensors, prefix_len, slots, *, stream=None, check=True):
    """In place, for every tensor ``[..., S, D]`` of ``tensors``: row ``prefix_len + slots[i]`` moves to
    ``prefix_len + i``.  ``slots`` strictly ascending with ``slots[i] >= i``, optionally padded with -1 (entries
    from the first -1 on are ignored and must all be -1: the padded ``path`` of ``verify_*(device_outputs=True)``
    can be passed as is).  All tensors are validated before any is modified.  On CUDA all tensors move in one
    launch (pass one stacked tensor or the list of every layer's keys and values).

    ``tensors``: a list or tuple of arrays, or a :class:`KVTensors` (imported once: no per-call import).
    ``prefix_len``: an int, or an int64 array with exactly one element (shape ``[]`` or ``[1]``) on the device
    of ``slots``, read when the op runs (on CUDA by the kernel, never copied to the host: the call can be
    captured in a CUDA graph and replayed after the tensor's value changes; a negative value is a device-side
    error, raised at ``check`` / :func:`cuda_check`, and moves nothing).

    Batched: ``slots[batch, m]`` (each row -1-padded on its own), every tensor ``[batch, ..., S, D]`` and
    ``prefix_len`` an int or an int64 ``[batch]`` array (on CUDA read by the kernel): request b's rows of every
    tensor move as the unbatched call with ``slots[b]`` and ``prefix_len[b]`` would move them; every request is
    checked before any row moves, and an error names the first failing request's problem."""
    slots = _arr(slots)
    if isinstance(tensors, KVTensors):
        tensors = tensors._c
    _C.kv_compact(tensors, prefix_len, slots, _stream(slots, stream), check, _batched(slots, 2))


class KVTensors:
    """The tensors of :func:`kv_compact` (a list or tuple of ``[..., S, D]`` arrays, all on one device), validated
    and imported once, as ``kv_compact`` would per call: pass it to ``kv_compact`` in place of the list so a
    static cache's per-cycle commit costs one launch and no per-tensor import.  It keeps references to the
    tensors (and their DLPack exports), so their storage stays alive while it does.  ``stream``: the CUDA stream
    handed to the producers' ``__dlpack__`` at import (default: the current stream of the first tensor's
    device); later writes to the tensors must be ordered before each ``kv_compact`` call by the caller, as for
    any in-place op on the call's stream."""

    __slots__ = ("_c",)

    def __init__(self, tensors, *, stream=None):
        first = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) else None
        self._c = _C.KVTensors(tensors, _stream(first, stream))

    @property
    def tensors(self):
        """The tensors, as a tuple."""
        return self._c.tensors

    def __len__(self):
        return len(self._c)

    def __repr__(self):
        return f"KVTensors({len(self)} tensors)"


def bucketize(values, thresholds, *, stream=None, check=True):
    """Bin of each value = number of (strictly ascending) thresholds it exceeds -> int32[N]."""
    values = _arr(values)
    return _C.bucketize(values, _arr(thresholds), _allocator(values), _stream(values, stream), check)


def _words(name, words, count):
    try:
        out = [operator.index(w) for w in words]
        if any(isinstance(w, (bool, np.bool_)) for w in words):   # ints, not bools (as every op's int argument)
            raise TypeError
    except TypeError:
        raise TypeError(f"philox4x32: argument '{name}' expected {count} integer words, got {words!r}") from None
    if len(out) != count or any(w < 0 or w > 0xFFFFFFFF for w in out):
        raise ValueError(f"philox4x32: argument '{name}' expected {count} uint32 words, got {words!r}")
    return out


def philox4x32(counter, key):
    """The Philox4x32-10 bijection: 4 uint32 counter words and 2 key words -> 4 uint32 words."""
    c = _words("counter", counter, 4)
    k = _words("key", key, 2)
    return _C.philox4x32(*c, *k)


def philox_uniform(n, *, seed, offset):
    """The uniforms ``verify_sample`` draws: ``u_j = x0 * 2**-32`` of Philox4x32-10 at counter
    ``offset + j`` keyed by ``seed``, j < n -> float64[n] (NumPy)."""
    return _C.philox_uniform(n, seed, offset, _np_alloc)
