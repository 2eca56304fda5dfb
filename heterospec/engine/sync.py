"""The cycle's declared host synchronisation points.

A cycle may wait for the device only here: after the base depth, to read the path entropy that picks the
entropy bin (``"bin"``, policies with bins only), and after acceptance, to read the accepted tokens for
streaming, EOS and stopping criteria (``"accepted"``); and in a call with logits processors, around them
(``"processors"``: they read each tree, and the draft's beams at each level, on the host, :mod:`.processors`);
and with a target whose linear-attention states advance over each row's accepted nodes, at the commit
(``"states"``: the accepted counts, ``TargetAdapter.commit``; eager only).
Prompt lookup adds none: its chains are made from the tokens read at "accepted" and grafted on the device
(:mod:`.lookup`).  Everything between stays on the device.  Tests
wrap a whole generate call in :func:`forbid_host_transfers` to prove it (tests/engine/test_engine_device.py).
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch

_state = threading.local()


def _allowed():
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def point(name, stats=None):
    """Mark a declared sync point; time spent inside counts as ``stats.sync_s``."""
    _state.depth = getattr(_state, "depth", 0) + 1
    counts = getattr(_state, "counts", None)
    if counts is not None:
        counts.append(name)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _state.depth -= 1
        if stats is not None:
            stats.sync_s += time.perf_counter() - t0


@contextlib.contextmanager
def outside_cycle():
    """Host work the engine does before or after the cycles (prefill, the first token, results)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


# the Tensor methods that copy device data to the host (or block on it)
_TRANSFERS = ("cpu", "numpy", "item", "tolist", "__int__", "__float__", "__bool__", "__index__")
# the aten ops that read device data on the host inside torch's own C++ (indexing with a 0-d integer tensor
# calls item(); boolean masks call nonzero; ...): invisible to the method patches above, and each one a
# host sync on a GPU -- and an error inside CUDA-graph capture
_SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal", "_unique",
             "_unique2", "unique_dim", "unique_consecutive", "bincount", "histc")


def _host_read(func, args, kwargs):
    """The name of the host read ``func(*args, **kwargs)`` makes inside torch, or None."""
    name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    if name in _SYNC_OPS:
        return name
    # repeats given as a tensor without output_size: the output length is read on the host
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor") \
            and (kwargs or {}).get("output_size") is None:
        return "repeat_interleave (tensor repeats, no output_size)"
    # boolean-mask indexing turns the mask into indices with nonzero
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        masks = [i for i in (args[1] or ()) if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
        if masks:
            return f"{name} with a boolean mask"
    return None


def _no_sync_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoSync(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = _host_read(func, args, kwargs)
            if name is not None and not _allowed():
                raise AssertionError(f"aten::{name} (a host read inside torch) inside the decoding cycle, outside "
                                     f"the declared sync points")
            return func(*args, **(kwargs or {}))

    return NoSync()


@contextlib.contextmanager
def forbid_host_transfers(record=None):
    """Make every host transfer of a tensor raise unless it happens inside :func:`point` or
    :func:`outside_cycle` (for tests; patches ``torch.Tensor``, and a dispatch mode catches the aten ops that
    read device values inside torch's C++, e.g. indexing with a 0-d tensor).  ``record``, a list, receives
    the names of the sync points passed, in order."""
    saved = {name: getattr(torch.Tensor, name) for name in _TRANSFERS}

    def guard(name, fn):
        def wrapped(self, *a, **kw):
            if not _allowed():
                raise AssertionError(f"host transfer Tensor.{name}() inside the decoding cycle, outside the "
                                     f"declared sync points")
            return fn(self, *a, **kw)

        return wrapped

    _state.counts = record
    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, guard(name, fn))
        with _no_sync_mode():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        _state.counts = None
