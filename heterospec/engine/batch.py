"""Decoding a batch of requests (issue 29): B prompts in the rows of the same static caches, each row with its
own prefix length, entropy bin, tree and accepted path, lossless per row.

One batched cycle, for the rows still decoding:

  1-4. the batched drafter (:class:`~.tree.BatchDraftState`) grows the root expansion and the base depth for
       every row; a binned policy reads the rows' path entropies at the sync point "bin" (one host read for
       the batch) and plans each row (:meth:`heterospec.policy.Policy.plan`);
  5.   the drafter grows the deepest extra depth any row needs; each row keeps its own tree from the
       candidates of its own depth (``ops.select`` / ``ops.build_tree`` with per-row sizes), and the ragged
       trees are padded to the cycle's largest (a bucket on a GPU).  Padding nodes sit past each row's
       node count ``n[b]``, which the acceptance ops never read, so padding is never accepted;
  6.   one target forward over the ``[B, T]`` trees (``TargetAdapter.verify``, per-row slots and positions);
  7.   per-row acceptance: ``ops.verify_greedy`` / ``ops.verify_sample`` in their batched forms (Philox key
       and counter per row, so a row's draws never depend on its neighbours);
  8.   commit: the drafter's per-row catch-up, then ``TargetAdapter.commit`` (``ops.kv_compact``'s per-row
       form), and the accepted tokens come back at the sync point "accepted" (one host read for the batch).

Rows that finish (EOS or ``max_new_tokens``) are dropped from the caches at the end of the cycle in which
they finish, so they stop costing work (``keep_rows``), or masked (``finished_rows="mask"``).

The steps are :class:`BatchCycle`'s, on fixed-address state, so that the recorded engine (CUDA graphs, or
their emulation) records them once per (batch size, extra levels, padded tree size) and replays them: the
per-row plan the host makes at the "bin" sync point (each row's kept nodes and candidate count, whether it is
finished) goes into a static device tensor before the replay.  A graph's batch is fixed, so with recorded
steps finished rows are masked.
"""
from __future__ import annotations

import time

import torch

from .. import ops
from ..growth import candidate_count
from ..measure import PhaseClock
from ..models.target import TargetAdapter, attention_window
from . import health, requests, sync
from .cycle import RecordedCycle
from .stats import GenerationStats
from .tree import BatchDraftState, bucket_for, tree_size

# batch sizes whose recorded steps (and static caches) the recorded engine keeps at once
MAX_BATCH_CYCLES = 2


def batch_tree(g, n, m, root, T, check):
    """Step 5 for a batch: row b keeps its best ``n[b]`` candidates among its first ``m[b]`` (the candidates of
    its own depth; a tree grown to fewer levels is a prefix of the arrays) -- ``n``, ``m`` int64 [B] on the
    device -- and the ragged trees are padded to ``T`` nodes (the cycle's largest tree, or its bucket; 1: every
    tree is its root).  Padding node i of a row carries the row's root token at depth 1 and sees the root and
    itself.  Returns (tokens, parents, depths, mask [B, T, T], the real sizes ``n + 1``)."""
    B = root.shape[0]
    dev = root.device
    cols = torch.arange(T, device=dev)
    real = cols.view(1, T) < (n + 1).view(B, 1)
    if T > 1:
        cand_tokens, cand_scores, cand_parents = g.candidates()
        width = min(T - 1, cand_scores.shape[-1])
        sel = ops.select(cand_scores, n, m=m, width=width, check=check)
        tree, _, _ = ops.build_tree(cand_tokens, cand_parents, sel, root, n=n, check=check)
        tokens, parents, depths, mask = tree.tokens, tree.parents, tree.depths, tree.mask
        if T > width + 1:
            pad = T - width - 1
            tokens = torch.cat([tokens, tokens.new_full((B, pad), -1)], 1)
            parents = torch.cat([parents, parents.new_full((B, pad), -1)], 1)
            depths = torch.cat([depths, depths.new_full((B, pad), -1)], 1)
            mask = torch.nn.functional.pad(mask, (0, pad, 0, pad))
    else:
        tokens = root.view(B, 1).clone()
        parents = torch.full((B, 1), -1, dtype=torch.long, device=dev)
        depths = torch.zeros((B, 1), dtype=torch.long, device=dev)
        mask = torch.ones((B, 1, 1), dtype=torch.bool, device=dev)
    tokens = torch.where(real, tokens, root.view(B, 1))
    depths = torch.where(real, depths, torch.ones_like(depths))
    parents = torch.where(real, parents, torch.zeros_like(parents))
    pad_rows = ~real
    mask = mask & real.view(B, 1, T) & real.view(B, T, 1)
    mask[:, :, 0] |= pad_rows
    mask |= torch.eye(T, dtype=torch.bool, device=dev).view(1, T, T) & pad_rows.view(B, T, 1)
    return tokens, parents, depths, mask, n + 1


class BatchCycle(RecordedCycle):
    """The batched cycle's device steps for ``batch`` requests, on fixed-address state: the target's static
    cache of ``batch`` rows (``TargetAdapter(batch=...)``), the batched drafter (:class:`BatchDraftState`), and
    per-row tensors -- the next roots, the Philox keys and counters, and ``rows`` ([3, batch] int64: each row's
    kept nodes ``n`` (root excluded), its candidate count ``m`` and whether it is finished), which the host
    writes before each cycle's tree is made.  Every shape of a step depends only on (extra levels grown, padded
    tree size ``T``), so the steps run eagerly or are recorded once per such key and replayed (:mod:`.graphs`,
    like :class:`~.cycle.Cycle` for one request): a graph of a fixed batch, with finished rows masked."""

    def __init__(self, hs, batch):
        pol = hs.policy
        self.policy, self.device, self.buckets = pol, hs.device, hs.buckets
        self.drafting, self.binned = hs._drafting, hs._drafting and pol.binned
        self.emulate = hs.cuda_graphs == "emulate"
        self.target = TargetAdapter(hs.target.model, tap_layers=hs.target.tap_layers, capture_taps=self.drafting,
                                 batch=batch, invariant=hs.target.invariant)
        self.drafter = (BatchDraftState(hs.draft, pol.top_k, hs._levels, hs._drafter.d2t, batch)
                   if self.drafting else None)
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=self.device)
        self.root, self.seed, self.offset, self.rows = z(batch), z(batch), z(batch), z(3, batch)
        self.bad = z(batch)   # per row: the target's logits were not finite in this call (engine.health)
        self._init_recordings()

    @property
    def batch(self):
        return self.target.batch

    def close(self):
        self.target.close()
        self.drop_recordings()

    def allocate(self, need):
        self.target.allocate(need)
        if self.drafter is not None:
            self.drafter.allocate(need, self.device)

    def keep_rows(self, idx):
        """Keep the requests ``idx`` ([b'] int64, ascending): the eager engine's dropped finished rows (a
        recorded step keeps its batch)."""
        self.target.keep_rows(idx)
        if self.drafter is not None:
            self.drafter.keep_rows(idx)
        self.root, self.seed, self.offset, self.bad = self.root[idx], self.seed[idx], self.offset[idx], self.bad[idx]
        self.rows = self.rows.index_select(1, idx)

    def set_rows(self, n, m, finished):
        """The host's per-row plan for this cycle (host lists): kept nodes without the root, candidate counts,
        finished flags -- one copy to the device, not a sync (:func:`.requests.to_device`)."""
        self.rows.copy_(requests.to_device([n, m, finished], self.device))

    def shapes(self):
        """The (extra levels, padded tree size) a cycle of this policy can take: the deepest extra depth and the
        largest tree of any two rows (one of them still decoding, the other perhaps finished: a root-only tree),
        which covers every batch."""
        if not self.drafting:
            return [(0, 1)]
        K, depth = self.policy.top_k, self.policy.depth
        live = {(e, tree_size(K, depth + e, keep)) for e, keep in self.policy.plans()}
        out = set()
        for e1, s1 in live:
            for e2, s2 in live | {(0, 1)}:
                s = max(s1, s2)
                out.add((max(e1, e2), bucket_for(s, self.buckets) if s > 1 else 1))
        return sorted(out)

    # ---- the steps --------------------------------------------------------------------------------------

    def finish(self, g, extra, T, settings, window=None, clock=None):
        """Steps 5-8 on the Growth ``g`` of :meth:`base` (None: grow the whole tree from the root): ``extra``
        more levels, each row's tree from ``rows`` padded to ``T``, the target's forward, per-row acceptance
        (finished rows commit nothing) and commit -> [B, 4 + R] int64 on the device: each row's accepted length
        (root included), next token, path tokens (R), then its target's and its draft's non-finite flags
        (:mod:`.health`)."""
        lap = clock.lap if clock is not None else (lambda field: None)
        tgt, dr, B = self.target, self.drafter, self.batch
        check = self.device.type != "cuda"
        n, m, masked = self.rows[0], self.rows[1], self.rows[2] != 0
        if dr is not None:
            g = dr.grow(g, extra if g is not None else self.policy.depth + extra, tgt.prefix)
        tokens, parents, depths, tmask, n_real = batch_tree(g, n, m, self.root, T, check)
        lap("draft_s")
        logits, vtaps = tgt.verify(tokens, depths, tmask, window)
        health.mark(self.bad, logits, n_real)
        lap("verify_s")
        sample, temperature, top_k, top_p = settings
        if sample:
            path, length, nxt, _ = ops.verify_sample(tokens, parents, logits, temperature=temperature, top_k=top_k,
                                                     top_p=top_p, seed=self.seed, offset=self.offset, n=n_real,
                                                     check=check, advance_offset=True)
        else:
            path, length, nxt = ops.verify_greedy(tokens, parents, logits, n=n_real, check=check)
        length = length.masked_fill(masked, 0)              # a finished row commits nothing
        path = path.masked_fill(masked.view(B, 1), -1)
        R = min(T, self.policy.levels + 2) if dr is not None else 1
        kept = path[:, :R].clamp(min=0)
        path_tokens = tokens.gather(1, kept)
        lap("ops_s")
        if dr is not None:
            dr.follow(vtaps, kept, path_tokens, length, nxt, tgt.prefix)
            lap("draft_s")
        if T == 1:
            tgt.prefix += (~masked).long()
        else:
            tgt.commit(path, length, check=check)
        self.root.copy_(nxt)
        lap("ops_s")
        flags = torch.stack([self.bad, dr.bad if dr is not None else torch.zeros_like(self.bad)], 1)
        return torch.cat([length.view(B, 1), nxt.view(B, 1), path_tokens, flags], 1)

    # ---- recording (RecordedCycle.record): ("base",), then ("finish", extra, T) per shape, or ("cycle", ...)

    def reset(self):
        self.target.prefix.fill_(1)
        self.root.zero_()
        self.rows.zero_()
        self.clear_flags()

    def clear_flags(self):
        self.bad.zero_()
        if self.drafter is not None:
            self.drafter.bad.zero_()


def _cycle_for(hs, B, need, graphs):
    """The BatchCycle of a call with its caches allocated for ``need`` positions (a one-line error before any
    decoding when they cannot fit).  The eager engine makes one per call; the recorded engine keeps one per
    batch size (at most ``MAX_BATCH_CYCLES``, least recently used dropped) with its recordings, as the batch-1
    engine keeps its own."""
    kept = hs._batch_cycles
    if graphs and B in kept:
        cyc = kept.pop(B)
        kept[B] = cyc
        if need <= cyc.target.capacity:
            return cyc
    else:
        cyc = BatchCycle(hs, B)
    dev = hs.device
    # the target's cache twice: dropping finished rows copies the kept rows before the old cache is freed (the
    # draft's cache, far smaller, fits in that bound too)
    nbytes = cyc.target.cache_bytes(need) * 2
    free = requests.available_bytes(dev)
    error = None
    if free is not None and nbytes > free:
        error = (f"generate: argument 'input_ids' expected a batch whose static caches fit the {dev} memory "
                 f"available ({free / 2**30:.2f} GiB), got {B} prompts needing about {nbytes / 2**30:.2f} GiB "
                 f"({need} positions per row)")
    else:
        try:
            cyc.allocate(need)
        except RuntimeError as e:   # an allocation the device cannot hold after all, before any decoding
            error = (f"generate: argument 'input_ids' expected a batch whose static caches fit the {dev} memory, "
                     f"got {B} prompts of {need} positions per row ({type(e).__name__})")
    if error is not None:
        kept.pop(B, None)
        cyc.close()
        raise ValueError(error)
    if graphs:
        kept[B] = cyc
        while len(kept) > MAX_BATCH_CYCLES:
            kept.pop(next(iter(kept))).close()
    return cyc


def _raise_flagged(hs, flags, alive, done, rows, prefix_host):
    """The first live request whose target or draft logits were not finite this cycle (:mod:`.health`)."""
    models = [("target", hs.target.model), ("draft", hs.draft)]
    for f, a in zip(flags, alive):
        if not done[a]:
            health.raise_flagged(f, models, rows[a].cycles + 1, prefix_host[a], hs.device, row=a)


def generate_batch(hs, input_ids, attention_mask, lengths, *, max_new_tokens, temperature, top_k, top_p, eos, seed,
                   finished="drop", stop=None):
    """The batched loop of :meth:`HeteroSpec.generate` (``lengths``: :func:`.requests.check_mask`'s) -> (per-row lists of
    new tokens, per-row GenerationStats, the batch's GenerationStats).  ``finished``: "drop" (a finished row
    leaves the caches at the end of its cycle) or "mask" (it stays, with a root-only tree whose commit is
    zeroed, so the shapes stay those of the whole batch -- what a recorded step of fixed batch needs: with
    recorded steps finished rows are always masked).  ``stop``: None, or a function of one request's tokens
    (its prompt and the new tokens, a host list) that says it is done (the stopping criteria), asked after
    every new token of that request."""
    dev, pol = hs.device, hs.policy
    B, S = input_ids.shape
    drafting = hs._drafting
    sample = temperature > 0
    settings = (True, float(temperature), int(top_k), float(top_p)) if sample else (False, 0.0, 0, 1.0)
    graphs = bool(hs.cuda_graphs)
    if graphs:
        finished = "mask"
    if isinstance(seed, (list, tuple)):           # its length is checked by HeteroSpec.generate
        seeds = [int(s) for s in seed]
    else:
        with sync.outside_cycle():
            base = int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,), device="cpu").item())
        seeds = [base + b for b in range(B)]       # row b draws as the prompt alone with seed + b
    bad = [s for s in seeds if not 0 <= s < 2**63]
    if bad:
        raise ValueError(f"generate: argument 'seed' expected seeds in [0, 2**63) for every row (row b uses seed + b), "
                         f"got {bad[0]}")
    need = hs._capacity(S, max_new_tokens)
    if finished == "mask":
        # a finished row keeps its prefix, which its last cycle may have taken up to levels + 1 tokens past the
        # budget, and still verifies a tree there every cycle
        need += hs._levels + 2
    if hs.max_length is not None and need > hs._capacity(0, hs.max_length) + (hs._levels + 2) * (finished == "mask"):
        raise ValueError(f"generate: prompt ({S}) + max_new_tokens ({max_new_tokens}) = {S + max_new_tokens} "
                         f"exceed the static caches' max_length ({hs.max_length}) given to HeteroSpec")
    if graphs:
        need = max(need, hs._capacity(0, hs.max_length or 0) + hs._levels + 2)
        if hs.max_length is None:
            need = -(-need // 256) * 256      # fewer distinct capacities: each one is recorded anew
    total = hs._new_stats(graphs)
    rows = [hs._new_stats(graphs) for _ in range(B)]
    clock = PhaseClock(dev, total)
    with sync.outside_cycle():
        cyc = _cycle_for(hs, B, need, graphs)
    tgt, dr = cyc.target, cyc.drafter
    steps = None
    try:
        with sync.outside_cycle():
            if graphs:
                steps = hs._record(cyc, settings, total)
                if steps is None:                       # 'auto' after a failed recording: eager from now on
                    graphs = False
                    hs._batch_cycles.pop(B, None)         # closed below, as an eager call's
            start = time.perf_counter()
            mask = attention_mask.to(dev) if attention_mask is not None else None
            last_logits, taps = tgt.prefill(input_ids.to(dev), attention_mask=mask)
            if B == 1:
                last_logits = last_logits.view(1, -1)
            health.check_prefill(last_logits, tgt.model, S)
            cyc.clear_flags()
            cyc.seed.copy_(torch.tensor(seeds, dtype=torch.long))
            cyc.offset.zero_()
            if sample:
                zeros = torch.zeros((B, 1), dtype=torch.long, device=dev)
                _, _, root, draws = ops.verify_sample(zeros, zeros - 1, last_logits.view(B, 1, -1),
                                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                                      seed=cyc.seed, offset=cyc.offset)
                cyc.offset.copy_(draws)                # the cycles' uniforms follow the prefill's, per row
            else:
                root = torch.argmax(last_logits, dim=-1)
            cyc.root.copy_(root)
            roots = root.tolist()
            total.prefill_s = time.perf_counter() - start
        generated = [[r] for r in roots]
        alive = list(range(B))
        if stop is not None:
            with sync.outside_cycle():
                prompts_host = [row[S - n:] for row, n in zip(input_ids.tolist(), lengths)]
        done = [r in eos or max_new_tokens <= 1 or (stop is not None and stop(prompts_host[a] + [r]))
                for a, r in enumerate(roots)]
        for a in range(B):
            if done[a]:
                rows[a].total_s = time.perf_counter() - start
        if drafting and not all(done):
            clock.start()
            front = input_ids.to(dev).gather(1, (torch.tensor([S - n for n in lengths], device=dev).view(B, 1)
                                                 + torch.arange(S, device=dev)).clamp(max=S - 1))
            ids = torch.cat([front[:, 1:], front[:, :1]], dim=1)
            last = torch.tensor([n - 1 for n in lengths], dtype=torch.long, device=dev)
            ids.scatter_(1, last.view(B, 1), cyc.root.view(B, 1))
            dr.prime(taps, ids, last)
            clock.lap("draft_s")
        prefix_host = list(lengths)
        K = pol.top_k
        batch_calls = 0
        first = True
        while True:
            keep = [i for i, a in enumerate(alive) if not done[a]]
            if not keep:
                break
            if finished == "drop" and len(keep) < len(alive):   # finished rows stop costing work
                cyc.keep_rows(requests.to_device(keep, dev))
                alive = [alive[i] for i in keep]
            if first or not graphs:
                clock.start()
            else:
                clock.lap("idle_s")       # the device idles between the last cycle's replay and this one's
            first = False
            g = None
            try:
                if cyc.binned:
                    g, entropy = cyc.run_base(steps, clock)
                    with sync.point("bin", total):
                        ent = entropy.tolist()
                    plans = [pol.plan(e) if not done[a] else (None, 0, 1) for e, a in zip(ent, alive)]
                    if graphs:
                        clock.lap("idle_s")
                elif drafting:
                    plans = [(None, 0, pol.total_tokens) if not done[a] else (None, 0, 1) for a in alive]
                else:
                    plans = [(None, 0, 1)] * len(alive)
                extra = max(p[1] for p in plans)
                levels = [pol.depth + p[1] for p in plans]
                sizes = [tree_size(K, lv, p[2]) if drafting else 1 for lv, p in zip(levels, plans)]
                T = bucket_for(max(sizes), hs.buckets) if max(sizes) > 1 else 1
                cyc.set_rows([s - 1 for s in sizes], [candidate_count(K, lv) if drafting else 0 for lv in levels],
                             [int(done[a]) for a in alive])
                # on the CPU the eager target attends over the used columns only; a recording keeps the whole cache
                window = None if graphs else attention_window(dev, max(prefix_host[a] for a in alive) + 1, T)
                acc = cyc.run_finish(steps, g, extra, T, settings, window, clock)
            except ValueError:   # on the CPU the ops refuse non-finite logits mid-cycle: say which model's
                with sync.outside_cycle():
                    flags = [[int(t), int(d)] for t, d in zip(cyc.bad.tolist(), dr.bad.tolist() if dr is not None
                                                              else [0] * len(alive))]
                _raise_flagged(hs, flags, alive, done, rows, prefix_host)
                raise
            with sync.point("accepted", total):
                host = acc.tolist()
            _raise_flagged(hs, [row[-2:] for row in host], alive, done, rows, prefix_host)
            clock.flush()
            batch_calls += 1
            for j, a in enumerate(alive):
                if done[a]:
                    continue
                row = host[j]
                n_acc = row[0] - 1
                st = rows[a]
                st.cycles += 1
                st.verified_tokens += sizes[j]
                st.accepted_hist[n_acc] += 1
                b = plans[j][0]
                if b is not None:
                    st.bins[b] += 1
                    st.bin_accepted[b] += n_acc
                    st.bin_verified[b] += sizes[j]
                prefix_host[a] += n_acc + 1
                for t in row[3:3 + n_acc] + [row[1]]:
                    generated[a].append(t)
                    if (t in eos or len(generated[a]) >= max_new_tokens
                            or (stop is not None and stop(prompts_host[a] + generated[a]))):
                        done[a] = True
                        st.total_s = time.perf_counter() - start     # this request's latency
                        break
        if dev.type == "cuda":
            ops.cuda_check(dev)
    finally:
        if not graphs:
            cyc.close()
    for st, gen in zip(rows, generated):
        st.new_tokens = len(gen)
    # the batch's counts are the rows' pooled (cycles: request-cycles, so tau is the mean tokens per row per
    # call); its times are the batch's own
    pooled = GenerationStats.pooled(rows)
    for f in ("new_tokens", "cycles", "verified_tokens", "accepted_hist", "bins", "bin_accepted", "bin_verified"):
        setattr(total, f, getattr(pooled, f))
    total.batch_calls = batch_calls
    total.total_s = time.perf_counter() - start
    total.per_row = rows
    for st in rows:
        st.prefill_s = total.prefill_s
        st.graphs = total.graphs
    return generated, rows, total
