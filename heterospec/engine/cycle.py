"""One lossless speculative cycle for a batch of requests (batch 1 is a batch of one), read top to bottom.
Every step runs on the model's device:

  1-4. ``base``: the drafter grows the root expansion and the policy's base depth for every row on the
       draft's static cache; the path entropies of each row's most confident candidate come back (a device
       tensor [B]).  The host then reads them at the sync point "bin" (one read for the batch) and the policy
       plans each row (:meth:`heterospec.policy.Policy.plan`) -- only for policies with bins;
  5.   ``finish``: the drafter grows the deepest extra depth any row needs, and each row keeps its own tree
       from the candidates of its own depth (:func:`~.tree.verification_tree`: ``ops.select`` and
       ``ops.build_tree`` with per-row sizes); the ragged trees are padded to the cycle's largest (a bucket on
       a GPU) by the one padding rule: past each row's node count, which the acceptance ops never read; with
       prompt lookup, each row's chain is grafted on in the padding (:func:`.lookup.graft`, on the device);
  6.   one target forward over the ``[B, T]`` trees (``TargetAdapter.verify``, per-row slots and positions);
  7.   per-row acceptance: ``ops.verify_greedy`` / ``ops.verify_sample`` with device outputs (Philox key and
       counter per row, so a row's draws never depend on its neighbours);
  8.   commit: the drafter catches up on each row's accepted positions straight from the padded path (fixed
       shape per tree shape), then ``TargetAdapter.commit`` (``ops.kv_compact``'s per-row form, the prefixes
       as device tensors), and the next roots are written in place.
The host loop (:mod:`.loop`) then reads the accepted tokens at the sync point "accepted" (one read).

Autoregressive decoding is the same cycle with a drafter that drafts nothing (:class:`~.tree.NoDraft`).
With recorded steps the same ``base`` and ``finish`` are captured once per (extra levels, padded tree size)
and replayed (:mod:`.graphs`): one replay per cycle, or two around the "bin" sync point.  Every tensor a
recorded step reads or writes across steps and cycles lives at a fixed address in :class:`CycleState`, in the
drafter's static buffers or in the target's static cache; the per-row plan the host makes at the "bin" sync
point goes into ``CycleState.rows`` before the replay.  A graph's batch is fixed, so with recorded steps
finished rows are masked (they verify their root alone and commit nothing).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict

import torch

from .. import ops
from . import lookup, processors, requests, sync
from .graphs import WORKSPACE_BYTES, StepGraphs, no_collection_while_recording, warm_up
from .tree import NoDraft, bucket_for, tree_size, verification_tree

# recorded step sets kept at once, one per sampling setting (each holds its own graph memory pool): the least
# recently used is dropped beyond this, so a sweep over temperatures cannot exhaust GPU memory
MAX_GRAPH_SETS = 4


@dataclasses.dataclass
class CycleState:
    """The cycle's own fixed-address state, one entry per request (read and written in place by recorded
    steps)."""

    root: torch.Tensor     # [B] int64: each row's next tree root token
    seed: torch.Tensor     # [B] int64: each row's Philox key of sampled acceptance
    offset: torch.Tensor   # [B] int64: each row's Philox counter, advanced by each verify_sample
    bad: torch.Tensor      # [B] int64: the target's logits of that row were not finite in this call (:mod:`.health`)
    rows: torch.Tensor     # [3, B] int64: the host's plan per row -- kept nodes (root excluded), candidate
    #                        count, finished -- written before each cycle's tree is made
    chain: torch.Tensor    # [B, 1 + lookup.MAX_TOKENS] int64: each row's prompt-lookup chain, [length, tokens...]
    seen: torch.Tensor     # [B, V + 1] bool: the ids a repetition penalty counts in each row's context (the last
    #                        column a sink for ids it does not count: processors.penalise)

    @classmethod
    def on(cls, device, batch, vocab):
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)   # noqa: E731
        return cls(z(batch), z(batch), z(batch), z(batch), z(3, batch), z(batch, 1 + lookup.MAX_TOKENS),
                   torch.zeros((batch, vocab + 1), dtype=torch.bool, device=device))

    def keep(self, idx):
        """The state of the rows ``idx`` alone (the eager engine drops finished rows)."""
        return CycleState(self.root[idx], self.seed[idx], self.offset[idx], self.bad[idx],
                          self.rows.index_select(1, idx), self.chain[idx], self.seen[idx])


class Cycle:
    """The steps of one cycle for ``batch`` requests: a target adapter on a static cache of ``batch`` rows
    (``TargetAdapter`` in its batched form), a drafter of the same batch (:class:`~.tree.DraftState` or
    :class:`~.tree.NoDraft`), a policy, and :class:`CycleState`.  Every shape of a step depends only on (extra
    levels grown, padded tree size ``T``), so the steps run eagerly or are recorded once per such key --
    ``base`` (binned policies) and ``finish`` per shape of :meth:`shapes` -- on dummy state, kept per sampling
    setting (at most ``MAX_GRAPH_SETS``, least recently used dropped) until the caches are reallocated, and
    replayed.  ``owns_target``: :meth:`close` closes the adapter too (a batch's own; the engine's batch-1
    cycle shares the engine's adapter)."""

    def __init__(self, target, drafter, policy, buckets, device, emulate=False, owns_target=False):
        self.target, self.drafter, self.policy, self.buckets, self.device = target, drafter, policy, buckets, device
        self.drafting = not isinstance(drafter, NoDraft)
        self.binned = self.drafting and policy.binned
        self.emulate = emulate
        self.owns_target = owns_target
        head = target.model.get_output_embeddings()    # the logits' width: the ids a penalty can touch
        vocab = head.weight.shape[0] if head is not None else target.model.config.vocab_size
        self.state = CycleState.on(device, target.batch, vocab)
        self._recorded = OrderedDict()    # sampling settings -> StepGraphs, least recently used first
        self._capacity = None

    @property
    def batch(self):
        return self.target.batch

    def close(self):
        if self.owns_target:
            self.target.close()
        self.drop_recordings()

    def allocate(self, need):
        """Room in both static caches for ``need`` positions per row (kept when already large enough)."""
        self.target.allocate(need)
        self.drafter.allocate(need, self.device)

    def keep_rows(self, order, used=None):
        """Keep the requests ``order`` (a host list, row ``order[i]`` becoming row i, in
        :func:`.requests.gap_filled`'s order): the eager engine's dropped finished rows (a recorded step keeps its
        batch); ``used``: the target cache's columns the kept rows have committed (a host int, None: all)."""
        idx = requests.to_device(order, self.device)
        self.target.keep_rows(order, idx, used)
        self.drafter.keep_rows(idx)
        self.state = self.state.keep(idx)

    def set_rows(self, n, m, finished):
        """The host's per-row plan for this cycle (host lists): kept nodes without the root, candidate counts,
        finished flags -- one copy to the device, not a sync (:func:`.requests.to_device`)."""
        self.state.rows.copy_(requests.to_device([n, m, finished], self.device))

    def set_chains(self, chains, L):
        """Each row's prompt-lookup chain for this cycle (host lists of at most ``L`` tokens, [] for none) into
        ``state.chain`` -- one copy to the device, not a sync."""
        self.state.chain[:, :1 + L].copy_(requests.to_device(lookup.pack(chains, L), self.device))

    def clear_flags(self):
        self.state.bad.zero_()
        self.drafter.bad.zero_()

    # ---- the steps (fixed shapes per key: run eagerly, or recorded once and replayed) -------------------

    def base(self, clock=None, draft_process=None, settings=None):
        """Steps 1-4 of a binned policy: the root expansion and the base depth -> (Growth, path entropy [B]);
        ``draft_process``: the draft's logits processors (:meth:`.tree.DraftState.grow`'s ``process``), else
        the settings' repetition penalty on the device (:meth:`_draft_penalty`)."""
        g = self.drafter.grow(None, self.policy.depth, self.target.prefix,
                              draft_process or self._draft_penalty(settings))
        if clock is not None:
            clock.lap("draft_s")
        return g, g.path_entropy()

    def finish(self, g, extra, T, settings, window=None, clock=None, process=None, draft_process=None, chain=0,
               keep_logits=False):
        """Steps 5-8 on the Growth ``g`` of :meth:`base` (None: grow the whole tree from the root): ``extra``
        more levels, each row's tree from ``state.rows`` padded to ``T``, the target's forward, per-row
        acceptance (finished rows commit nothing) and commit -> [B, 5 + R] int64 on the device: each row's
        accepted length (root included), next token, path tokens (R), real tree size (its chain included), then
        its target's and its draft's non-finite flags (:mod:`.health`).  ``process``: None, or ``(tokens, parents,
        n_real, logits) -> logits`` applied between the forward and the acceptance (logits processors,
        :mod:`.processors`; eager only), and ``draft_process`` to the draft's distributions as :meth:`base` applies
        it.  ``chain``: the prompt-lookup chains' length ``L`` (0: none): each row's chain in ``state.chain``
        (:meth:`set_chains`) is grafted onto its tree on the device (:func:`.lookup.graft`; ``T`` counts it).
        ``keep_logits``: returns (that, the target's raw logits at each row's path nodes [B, R, V] float32) --
        before ``process``, the rows its new tokens were decided from, the first ``length`` of them real."""
        lap = clock.lap if clock is not None else (lambda field: None)
        tgt, dr, st, B = self.target, self.drafter, self.state, self.batch
        check = self.device.type != "cuda"
        n, m, masked = st.rows[0], st.rows[1], st.rows[2] != 0
        # 5: the rest of the trees, the verification trees
        g = dr.grow(g, extra if g is not None else self.policy.depth + extra, tgt.prefix,
                    draft_process or self._draft_penalty(settings))
        tokens, parents, depths, tmask, n_real = verification_tree(g, n, m, st.root, T, check)
        if chain:
            tokens, parents, depths, tmask, n_real = lookup.graft(tokens, parents, depths, tmask, n_real,
                                                                  st.chain[:, 1:1 + chain], st.chain[:, 0])
        lap("draft_s")
        # 6: the target's forward
        logits, vtaps = tgt.verify(tokens, depths, tmask, window, bad=st.bad, real=n_real)
        lap("verify_s")
        raw = logits
        sample, temperature, top_k, top_p, min_p, penalty = settings
        if penalty != 1.0:
            logits = processors.penalise(logits, tokens, tmask, st.seen, penalty)
        if process is not None:
            logits = process(tokens, parents, n_real, logits)
        # 7: acceptance
        if sample:
            path, length, nxt, _ = ops.verify_sample(tokens, parents, logits, temperature=temperature, top_k=top_k,
                                                     top_p=top_p, min_p=min_p, seed=st.seed, offset=st.offset,
                                                     n=n_real, check=check, advance_offset=True)
        else:
            path, length, nxt = ops.verify_greedy(tokens, parents, logits, n=n_real, check=check)
        length = length.masked_fill(masked, 0)              # a finished row commits nothing
        path = path.masked_fill(masked.view(B, 1), -1)
        R = min(T, self.policy.levels + 2) if self.drafting else 1   # positions a cycle may commit: the catch-up's rows
        if chain:                                                     # a chain's path: its tokens and the root
            R = min(T, max(R, 1 + chain))
        kept = path[:, :R].clamp(min=0)
        path_tokens = tokens.gather(1, kept)
        path_logits = raw.gather(1, kept.unsqueeze(-1).expand(-1, -1, raw.shape[-1])).float() if keep_logits else None
        if penalty != 1.0:                                            # the accepted tokens join each row's context
            processors.see(st.seen, path_tokens, length)
        lap("ops_s")
        # 8: the draft catches up on the accepted positions (before the prefixes move), then the commit
        dr.follow(vtaps, kept, path_tokens, length, nxt, tgt.prefix)
        lap("draft_s")
        if T == 1:
            tgt.prefix += (~masked).long()
        elif tgt.stateful:        # linear-attention states advance over each row's accepted nodes, counted on the host
            with sync.point("states"):
                tgt.commit(path, length, check=check)
        else:
            tgt.commit(path, length, check=check)
        st.root.copy_(nxt)
        lap("ops_s")
        flags = torch.stack([st.bad, dr.bad], 1)
        out = torch.cat([length.view(B, 1), nxt.view(B, 1), path_tokens, n_real.view(B, 1), flags], 1)
        return (out, path_logits) if keep_logits else out

    def _draft_penalty(self, settings):
        """The draft's side of the settings' repetition penalty (their last entry; 1.0: none): its distributions
        penalised on the device with each beam's own path (:func:`.processors.penalise_draft`), else None."""
        if settings is None or settings[-1] == 1.0:
            return None
        return functools.partial(processors.penalise_draft, self.state.seen, self.state.root, settings[-1])

    def shapes(self, chain=0):
        """The (extra levels, padded tree size) a cycle of this policy can take: one row's plans; with more rows,
        the deepest extra depth and the largest tree of any two rows (one of them still decoding, the other
        perhaps finished: a root-only tree), which covers every batch; ``chain``: room for prompt-lookup chains
        of that length past the largest tree."""
        if not self.drafting:
            return [(0, bucket_for(1 + chain, self.buckets) if chain else 1)]
        K, depth = self.policy.top_k, self.policy.depth
        plans = self.policy.plans() if self.binned else self.policy.plans()[:1]
        live = {(e, tree_size(K, depth + e, keep)) for e, keep in plans}
        pairs = [((e1, s1), (e2, s2)) for e1, s1 in live for e2, s2 in live | {(0, 1)}] if self.batch > 1 else \
            [(x, x) for x in live]
        out = set()
        for (e1, s1), (e2, s2) in pairs:
            s = max(s1, s2)
            out.add((max(e1, e2), bucket_for(s + chain, self.buckets) if s + chain > 1 else 1))
        return sorted(out)

    # ---- recording: ("base",), then ("finish", extra, T) per shape, or ("cycle", extra, T) -----------------

    def reset(self):
        """The state a step starts from when warmed up and captured."""
        self.target.prefix.fill_(1)
        self.state.root.zero_()
        self.state.rows.zero_()
        self.state.chain.zero_()
        self.state.seen.zero_()
        self.clear_flags()

    def capacity_key(self):
        """What the recordings depend on: the caches' sizes (recorded anew when they are reallocated)."""
        return (self.target.capacity, self.drafter.base)

    def dummy_state(self):
        """A prefill and the draft's catch-up on one-token dummy prompts (the real prefill overwrites them)."""
        B, dev = self.batch, self.device
        one = torch.zeros((B, 1), dtype=torch.long, device=dev)
        _, taps = self.target.prefill(one)
        self.drafter.prime(taps, one, torch.zeros(B, dtype=torch.long, device=dev))

    def step_key(self, shape):
        return ("finish" if self.binned else "cycle",) + tuple(shape)

    def run_base(self, steps, clock, draft_process=None, settings=None):
        """Steps 1-4, eager (``steps`` None) or replayed -> (Growth or None, path entropies on the device)."""
        if steps is None:
            return self.base(clock, draft_process, settings)
        _, entropy = steps.replay(("base",))
        clock.lap("graph_s")
        return None, entropy

    def run_finish(self, steps, g, extra, T, settings, window, clock, process=None, draft_process=None, chain=0,
                   keep_logits=False):
        """Steps 5-8 for the shape ``(extra, T)``, eager or replayed (its recording, made by :meth:`record` with
        the same ``chain`` and ``keep_logits``); ``process`` (logits processors) only eager."""
        if steps is None:
            return self.finish(g, extra, T, settings, window, clock, process, draft_process, chain, keep_logits)
        if process is not None or draft_process is not None:
            raise RuntimeError("Cycle.run_finish: logits processors run in the eager cycle only")
        out = steps.replay(self.step_key((extra, T)))
        clock.lap("graph_s")
        return out

    def record(self, settings, chain=0, keep_logits=False):
        """Warm up and record every step for these sampling settings, prompt-lookup chain length (0: none) and
        kept logits (:meth:`finish`) on dummy state (the prompt's prefill overwrites it; capture time is reported
        apart from decoding).  Returns (StepGraphs, whether they were recorded by this call)."""
        dev = self.device
        capacity = self.capacity_key()
        if self._capacity != capacity:
            self._recorded.clear()
            self._capacity = capacity
        key = (settings, chain, keep_logits)
        steps = self._recorded.get(key)
        if steps is not None:
            self._recorded.move_to_end(key)
            return steps, False
        while len(self._recorded) >= MAX_GRAPH_SETS:     # drop the least recently used set and its memory pool
            self._recorded.popitem(last=False)
        steps = StepGraphs(emulate=self.emulate, device=dev)
        t0 = time.perf_counter()
        with sync.outside_cycle(), no_collection_while_recording():
            if dev.type == "cuda":
                ops.cuda_reserve(dev, WORKSPACE_BYTES)
            self.dummy_state()
            shapes = self.shapes(chain)

            def run_all():
                for a, b in shapes:
                    self.reset()
                    base = self.base(settings=settings) if self.binned else None
                    self.finish(base[0] if base else None, a, b, settings, chain=chain, keep_logits=keep_logits)

            warm_up(dev, [run_all, run_all], steps.stream)
            self.reset()
            base = steps.capture(("base",), lambda: self.base(settings=settings)) if self.binned else None
            for a, b in shapes:
                self.reset()
                steps.capture(self.step_key((a, b)),
                              lambda a=a, b=b: self.finish(base[0] if base else None, a, b, settings, chain=chain,
                                                           keep_logits=keep_logits))
            self.reset()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        steps.capture_s = time.perf_counter() - t0
        self._recorded[key] = steps
        return steps, True

    def drop_recordings(self):
        self._recorded.clear()
