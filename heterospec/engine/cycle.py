"""One lossless speculative cycle, read top to bottom.  Every step runs on the model's device:

  1-4. ``base``: the drafter grows the root expansion and the policy's base depth on the draft's static
       cache; the path entropy of the most confident candidate comes back (device tensor).  The host then
       reads it at the sync point "bin" and the policy picks the bin's extra depth and kept nodes
       (:meth:`heterospec.policy.Policy.plan`) -- only for policies with bins;
  5.   ``finish``: the drafter grows the extra levels and makes the verification tree (``ops.select`` +
       ``ops.build_tree``, device outputs, padded to a bucket);
  6.   the target's forward over the tree on its static cache (``TargetAdapter.verify``, 4D tree mask);
  7.   acceptance: ``ops.verify_greedy`` / ``ops.verify_sample`` with device outputs (the accepted path,
       padded, its length and the next token, never copied to the host here);
  8.   commit: the drafter catches up on the accepted positions straight from the padded path
       (``follow``; fixed shape per tree shape), then ``TargetAdapter.commit`` (``ops.kv_compact`` with the
       prefix length as a device tensor), and the next root is written in place.
The host loop (:mod:`.loop`) then reads the accepted tokens at the sync point "accepted".

Autoregressive decoding is the same cycle with a drafter that drafts nothing (:class:`~.tree.NoDraft`).
With recorded steps (``record``) the same ``base`` and ``finish`` are captured once per tree shape and
replayed (:mod:`.graphs`): one replay per cycle, or two around the "bin" sync point.  Every tensor a recorded
step reads or writes across steps and cycles lives at a fixed address in :class:`CycleState`, in the
drafter's static buffers or in the target's static cache.
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict

import torch

from .. import ops
from . import health, sync
from .graphs import WORKSPACE_BYTES, StepGraphs, warm_up

# recorded step sets kept at once, one per sampling setting (each holds its own graph memory pool): the least
# recently used is dropped beyond this, so a sweep over temperatures cannot exhaust GPU memory
MAX_GRAPH_SETS = 4


@dataclasses.dataclass
class CycleState:
    """The cycle's own fixed-address state (read and written in place by recorded steps)."""

    root: torch.Tensor     # [1] int64: the next tree's root token
    seed: torch.Tensor     # [1] int64: the Philox key of sampled acceptance
    offset: torch.Tensor   # [1] int64: the Philox counter, advanced by each verify_sample
    bad: torch.Tensor      # [1] int64: the target's logits were not finite in this call (:mod:`.health`)

    @classmethod
    def on(cls, device):
        return cls(*(torch.zeros(1, dtype=torch.long, device=device) for _ in range(4)))


class RecordedCycle:
    """What the cycle of one request (:class:`Cycle`) and of a batch (``engine.batch.BatchCycle``) share: the
    recording of their steps -- ``base`` (binned policies) and ``finish(g, a, b, settings)`` for each shape
    ``(a, b)`` of :meth:`shapes` -- on dummy state, kept per sampling settings (at most ``MAX_GRAPH_SETS``,
    least recently used dropped) until the caches are reallocated, and their replay.  A subclass sets
    ``target`` (a TargetAdapter), ``drafter`` (None: nothing drafted), ``policy``, ``binned``, ``device`` and
    ``emulate``, and provides ``finish``, ``shapes`` and ``reset`` (the state a step starts from when warmed up
    and captured)."""

    def _init_recordings(self):
        self._recorded = OrderedDict()    # sampling settings -> StepGraphs, least recently used first
        self._capacity = None

    def base(self, clock=None):
        """Steps 1-4 of a binned policy: the root expansion and the base depth -> (Growth, path entropy: [1],
        or [batch])."""
        g = self.drafter.grow(None, self.policy.depth, self.target.prefix)
        if clock is not None:
            clock.lap("draft_s")
        return g, g.path_entropy()

    def capacity_key(self):
        """What the recordings depend on: the caches' sizes (recorded anew when they are reallocated)."""
        return (self.target.capacity, getattr(self.drafter, "base", 0))

    def dummy_state(self):
        """A prefill and the draft's catch-up on one-token dummy prompts (the real prefill overwrites them)."""
        B, dev = self.target.batch, self.device
        one = torch.zeros((B, 1), dtype=torch.long, device=dev)
        _, taps = self.target.prefill(one)
        if self.drafter is not None:
            self.drafter.prime(taps, one, torch.zeros(B, dtype=torch.long, device=dev))

    def step_key(self, shape):
        return ("finish" if self.binned else "cycle",) + tuple(shape)

    def run_base(self, steps, clock):
        """Steps 1-4, eager (``steps`` None) or replayed -> (Growth or None, path entropy on the device)."""
        if steps is None:
            return self.base(clock)
        _, entropy = steps.replay(("base",))
        clock.lap("graph_s")
        return None, entropy

    def run_finish(self, steps, g, a, b, settings, window, clock):
        """Steps 5-8 for the shape ``(a, b)``, eager or replayed (its recording)."""
        if steps is None:
            return self.finish(g, a, b, settings, window, clock)
        out = steps.replay(self.step_key((a, b)))
        clock.lap("graph_s")
        return out

    def record(self, settings):
        """Warm up and record every step for these sampling settings on dummy state (the prompt's prefill
        overwrites it; capture time is reported apart from decoding).  Returns (StepGraphs, whether they were
        recorded by this call)."""
        dev = self.device
        capacity = self.capacity_key()
        if self._capacity != capacity:
            self._recorded.clear()
            self._capacity = capacity
        steps = self._recorded.get(settings)
        if steps is not None:
            self._recorded.move_to_end(settings)
            return steps, False
        while len(self._recorded) >= MAX_GRAPH_SETS:     # drop the least recently used set and its memory pool
            self._recorded.popitem(last=False)
        steps = StepGraphs(emulate=self.emulate)
        t0 = time.perf_counter()
        with sync.outside_cycle():
            if dev.type == "cuda":
                ops.cuda_reserve(dev, WORKSPACE_BYTES)
            self.dummy_state()
            shapes = self.shapes()

            def run_all():
                for a, b in shapes:
                    self.reset()
                    base = self.base() if self.binned else None
                    self.finish(base[0] if base else None, a, b, settings)

            warm_up(dev, [run_all, run_all])
            self.reset()
            base = steps.capture(("base",), self.base) if self.binned else None
            for a, b in shapes:
                self.reset()
                steps.capture(self.step_key((a, b)),
                              lambda a=a, b=b: self.finish(base[0] if base else None, a, b, settings))
            self.reset()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        steps.capture_s = time.perf_counter() - t0
        self._recorded[settings] = steps
        return steps, True

    def drop_recordings(self):
        self._recorded.clear()


class Cycle(RecordedCycle):
    """The steps of one cycle for a target (a ``TargetAdapter``), a drafter (``DraftState`` or ``NoDraft``)
    and a policy, and their recordings per sampling setting (shapes: the policy's plans)."""

    def __init__(self, target, drafter, policy, buckets, device, emulate=False):
        self.target, self.drafter, self.policy, self.buckets, self.device = target, drafter, policy, buckets, device
        self.binned = policy.binned
        self.state = CycleState.on(device)
        self.emulate = emulate
        self._init_recordings()

    # ---- the steps (fixed shapes per plan: run eagerly, or recorded once and replayed) -----------------

    def finish(self, g, extra, keep, settings, window=None, clock=None):
        """Steps 5-8 for one plan on the Growth ``g`` of :meth:`base` (None: grow the whole tree from the
        root).  Returns ([length, next token, path tokens (R), target flag, draft flag] int64 on the device, real
        tree size); a flag is set when that model's logits were not finite (:mod:`.health`)."""
        lap = clock.lap if clock is not None else (lambda field: None)
        dr, tgt, st = self.drafter, self.target, self.state
        check = self.device.type != "cuda"
        # 5: the rest of the tree, the verification tree
        g = dr.grow(g, extra if g is not None else self.policy.depth + extra, tgt.prefix)
        tokens, parents, depths, mask, size = dr.tree(g, keep, st.root, self.buckets)
        lap("draft_s")
        # 6: the target's forward
        logits, vtaps = tgt.verify(tokens, depths, mask, window)
        health.mark(st.bad, logits)
        lap("verify_s")
        # 7: acceptance
        sample, temperature, top_k, top_p = settings
        if sample:
            path, length, nxt, _ = ops.verify_sample(
                tokens, parents, logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=st.seed,
                offset=st.offset, check=check, device_outputs=True, advance_offset=True)
        else:
            path, length, nxt = ops.verify_greedy(tokens, parents, logits, check=check, device_outputs=True)
        # 8: the draft catches up on the accepted positions (before the prefix moves), then the commit
        kept = path[:dr.rows(g, tokens.shape[0])].clamp(min=0)
        path_tokens = tokens[kept]
        lap("ops_s")
        dr.follow(vtaps, kept, path_tokens, length, nxt, tgt.prefix)
        lap("draft_s")
        if size == 1:
            tgt.prefix += 1
        else:
            tgt.commit(path, length, check=check)
        st.root.copy_(nxt.view(1))
        lap("ops_s")
        return torch.cat([length.view(1), nxt.view(1), path_tokens, st.bad, dr.bad]), size

    # ---- recording (RecordedCycle.record) -------------------------------------------------------------

    def shapes(self):
        """(extra levels, kept nodes) of every plan; a policy without bins has one."""
        plans = self.policy.plans()
        return plans if self.binned else plans[:1]

    def reset(self):
        self.target.prefix.fill_(1)
        self.state.root.zero_()
        self.state.bad.zero_()
        self.drafter.bad.zero_()
