"""The cycle's declared host synchronisation points.

A cycle may wait for the device only here: after the base depth, to read the path entropy that picks the
entropy bin (``"bin"``, policies with bins only), and after acceptance, to read the accepted tokens for
streaming, EOS and stopping criteria (``"accepted"``).  Everything between stays on the device.  Tests
wrap a whole generate call in :func:`forbid_host_transfers` to prove it (tests/test_engine_device.py).
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


@contextlib.contextmanager
def forbid_host_transfers(record=None):
    """Make every host transfer of a tensor raise unless it happens inside :func:`point` or
    :func:`outside_cycle` (for tests; patches ``torch.Tensor``).  ``record``, a list, receives the names of
    the sync points passed, in order."""
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
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        _state.counts = None
