"""The cycle's fixed-shape steps recorded once and replayed: one CUDA graph per tree shape (the paper's DGO).

A dynamic tree changes shape every cycle; a captured graph needs fixed shapes and fixed addresses.  The
engine therefore cuts the cycle into steps whose shapes depend only on a small key (the policy's plans: base
depth, extra levels, kept nodes, bucket), keeps every value that crosses from one step or cycle to the next
in a static device tensor (prefix length, root token, the root's draft logits and state, the Philox offset,
the KV caches), and records each step once per model pair, length budget and sampling settings:

* ``("cycle", extra, keep)``: a whole cycle (tree growth, verification tree, target forward, acceptance,
  commit, draft catch-up) for policies without bins -- EAGLE-3's static tree, and ``ar`` (a root-only tree);
* ``("base",)`` + ``("finish", extra, keep)``: for HeteroSpec, the tree up to the base depth and its path
  entropy, then -- after the host reads the bin at the declared "bin" sync point -- the rest of the cycle
  for that bin's plan.

:class:`StepGraphs` records and replays them.  ``emulate=True`` runs the same plumbing on any device without
CUDA graphs: a "capture" runs the step once and keeps its outputs, a "replay" runs it again and copies the
new values into the kept outputs, so a later step that reads a step's outputs reads them where a real
replay would have written them; and a replay that reads memory from outside the step that the capture did
not read (a tensor rebound between cycles, which a real graph would read at its old address) is an error.
The CPU tests use it to prove the static-buffer engine equals the eager one; that a real replay equals
eager decoding is tested on a GPU (tests/engine/test_graphs.py under ``.ci/gpu``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref

import torch

from .. import ops

# bytes of heterospec's module workspace reserved before any capture: a graph records the workspace's
# address, so it must never be regrown while graphs that use it exist
WORKSPACE_BYTES = 64 << 20


def tensors_of(obj):
    """The tensors of a step's outputs (tensors, tuples, lists, dicts and dataclasses of them), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_of(x)]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in tensors_of(obj[k])]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_of(getattr(obj, f.name))]
    return []


def _storage(t):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):      # meta / fake tensors hold no memory
        return None


def _reads(fn):
    """Run ``fn`` and return (its result, the storages of the tensors it read that it did not create): the
    memory a recorded graph of ``fn`` would read from outside itself.  Only aten ops are seen."""
    from torch.utils._python_dispatch import TorchDispatchMode

    created, external = set(), set()

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # constants made from Python scalars (x[i] = False, ...) are lifted fresh on every call: baked
            # into a recording, not memory it reads
            lifted = func.overloadpacket.__name__.startswith("lift_fresh")
            for t in () if lifted else tensors_of([args, kwargs or {}]):
                ptr = _storage(t)
                if ptr is not None and ptr not in created:
                    external.add(ptr)
            out = func(*args, **(kwargs or {}))
            for t in tensors_of(out):
                ptr = _storage(t)
                if ptr is not None and ptr not in external:
                    created.add(ptr)
            return out

    with Reads():
        out = fn()
    return out, external


# device index -> [[cudaStream_t, weak reference to the owner using it], ...]: capture_stream's streams
_STREAMS = {}


def stream_for(index, owner):
    """A stream of heterospec's own on device ``index`` (its cudaStream_t) for ``owner``'s captures, used by no
    other live owner: the first whose last owner is gone, else a new one (:func:`heterospec.ops.cuda_new_stream`;
    never destroyed, so a stream handle is never reused by CUDA for another stream while torch still keys
    state by it).

    Why not torch's capture stream: torch keeps one cuBLAS workspace per (handle, stream), first allocated
    inside whichever graph's memory pool was being captured, and every later capture on that stream records
    the same address; destroying *any* graph captured on a stream drops that stream's workspace and releases
    the graph's pool.  With every recorded set on torch's one capture stream, dropping one set (the least
    recently used, another engine closing, a calibration's timing graph) could free the workspace that the
    live sets' replays still write to.  One stream per live owner keeps each workspace with the graphs that
    use it, and they die together."""
    slots = _STREAMS.setdefault(index, [])
    for slot in slots:
        if slot[1]() is None:
            slot[1] = weakref.ref(owner)
            return slot[0]
    ptr = ops.cuda_new_stream(index)
    slots.append([ptr, weakref.ref(owner)])
    return ptr


def capture_stream(device, owner):
    """:func:`stream_for` as a ``torch.cuda.ExternalStream`` of ``device``; None for a device other than CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.ExternalStream(stream_for(index, owner), device=torch.device("cuda", index))


class StepGraphs:
    """Recorded steps by key.  ``capture(key, fn)`` records ``fn`` (a step that reads and writes only static
    tensors and the outputs of earlier captured steps) and returns its outputs; ``replay(key)`` runs the
    recording and returns the same output objects, now holding this run's values.  On a CUDA ``device`` the
    steps are captured (and should be warmed up) on :attr:`stream`, a stream of this set's own
    (:func:`stream_for`)."""

    def __init__(self, emulate=False, device=None):
        self.emulate = emulate
        self.stream = capture_stream(device, self) if not emulate and device is not None else None
        self._steps = {}
        self._reads = {}         # emulation: the outside memory each step read when it was captured
        self.captured = []       # keys in capture order
        self.capture_s = 0.0     # warm-up and capture time, set by the caller that ran both
        self.replays = 0

    def __len__(self):
        return len(self._steps)

    def capture(self, key, fn):
        if key in self._steps:
            raise ValueError(f"StepGraphs: step {key!r} is already captured")
        if self.emulate:
            out, reads = _reads(fn)
            self._steps[key] = (fn, out)
            self._reads[key] = reads
        else:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=self.stream):
                out = fn()
            self._steps[key] = (g, out)
        self.captured.append(key)
        return out

    def replay(self, key):
        step, out = self._steps[key]
        if self.emulate:
            new, reads = _reads(step)
            stale = reads - self._reads[key]
            if stale:
                # a graph replays the addresses it recorded: a tensor the step now reads from outside that it
                # did not read at capture (a Python attribute rebound to a new tensor, a tensor made per call)
                # would be read from its old, recorded address instead
                raise RuntimeError(f"StepGraphs: step {key!r} read {len(stale)} tensor(s) from outside that it did "
                                   f"not read when it was recorded; a CUDA graph would read the recorded ones "
                                   f"(update static tensors in place: copy_, fill_)")
            dst, src = tensors_of(out), tensors_of(new)
            if len(dst) != len(src):
                raise RuntimeError(f"StepGraphs: step {key!r} returned {len(src)} tensors, it captured {len(dst)}")
            for a, b in zip(dst, src):
                if a is not b:
                    a.copy_(b)
        else:
            step.replay()
        self.replays += 1
        return out

    def clear(self):
        self._steps.clear()
        self._reads.clear()
        self.captured.clear()


@contextlib.contextmanager
def no_collection_while_recording():
    """Collect Python's garbage now, then keep the cyclic collector off while the steps are warmed up and
    captured.  torch's ``torch.cuda.graph`` no longer collects on entry (only under
    ``torch.compiler.config.force_cudagraph_gc``), so a dead engine held only by a reference cycle (an
    exception's traceback holds its frames, and they hold the engine) can be collected in the middle of a
    capture: destroying its graphs releases their memory pools and cuBLAS workspaces, CUDA calls a capture
    forbids, and the capture fails ("operation failed due to a previous error during capture", or
    CUBLAS_STATUS_EXECUTION_FAILED).  The sixth GPU window saw it in test_nonfinite after earlier tests had
    raised from a recorded engine."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def warm_up(device, fns, stream=None):
    """Run each function once eagerly before capture (cuBLAS handles, lazy buffers, our workspace), on a side
    stream as torch's capture rules ask (``stream``: the one the capture will use).  Returns their outputs."""
    if torch.device(device).type != "cuda":
        return [fn() for fn in fns]
    side = stream if stream is not None else torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        outs = [fn() for fn in fns]
    torch.cuda.current_stream(device).wait_stream(side)
    return outs
