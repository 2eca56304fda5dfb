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
they finish, so they stop costing work (``keep_rows``).  The recorded engine (CUDA graphs) is batch-1 only
for now: a batch runs the eager steps.
"""
from __future__ import annotations

import time

import torch

from .. import ops
from ..growth import candidate_count
from ..measure import PhaseClock
from ..models.target import TargetAdapter, attention_window
from . import sync
from .stats import GenerationStats
from .tree import BatchDraftState, bucket_for, tree_size


def left_pad(prompts, pad_token_id, device):
    """A list of prompts (1-D int sequences, or [1, S] tensors) -> (ids [B, S], attention_mask [B, S]) left-padded
    as a HuggingFace tokenizer pads a batch for generation."""
    rows = []
    for i, p in enumerate(prompts):
        t = torch.as_tensor(p, dtype=torch.long).reshape(-1) if not isinstance(p, torch.Tensor) else p.reshape(-1)
        if t.numel() == 0:
            raise ValueError(f"generate: argument 'input_ids' expected a token in every prompt, got an empty "
                             f"prompt at index {i}")
        rows.append(t.to("cpu", torch.long))
    S = max(r.numel() for r in rows)
    ids = torch.full((len(rows), S), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), S), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, S - r.numel():] = r
        mask[b, S - r.numel():] = 1
    return ids.to(device), mask.to(device)


def check_mask(input_ids, attention_mask):
    """The prompts' lengths (a host list) from a left-padded ``attention_mask`` [B, S] of 0/1; one-line errors
    for a wrong shape, an empty row or padding after a token."""
    if input_ids.shape[1] < 1:
        raise ValueError("generate: argument 'input_ids' expected at least one token, got 0")
    if attention_mask is None:
        return [input_ids.shape[1]] * input_ids.shape[0]
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"generate: argument 'attention_mask' expected a torch.Tensor of the shape of input_ids "
                         f"{tuple(input_ids.shape)}, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"generate: argument 'attention_mask' expected the shape of input_ids "
                         f"{tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    m = attention_mask.detach().to("cpu", torch.long)
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("generate: argument 'attention_mask' expected only 0 and 1, got other values")
    lengths = m.sum(1).tolist()
    for b, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"generate: argument 'attention_mask' expected at least one token per row, got an "
                             f"empty row {b}")
        if bool((m[b, m.shape[1] - n:] != 1).any()):
            raise ValueError(f"generate: argument 'attention_mask' expected left padding (zeros only before the "
                             f"tokens), got a zero after a token in row {b}")
    return lengths


def available_bytes(device):
    """Memory a new allocation can take on ``device``: free GPU memory, or the host's MemAvailable; None when
    it cannot be told."""
    if device.type == "cuda":   # free memory, and what torch's caching allocator holds without using it
        return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def to_device(values, device, dtype=torch.long):
    """A host list as a tensor on ``device``.  On a GPU through pinned memory with a non-blocking copy:
    ``torch.tensor(values, device="cuda")`` synchronises the stream, which inside a cycle would wait for the
    draft's work already launched (a third host sync per cycle)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def batch_tree(g, sizes, root, buckets, check):
    """Step 5 for a batch: row b keeps its best ``sizes[b] - 1`` candidates among the first
    ``candidate_count(K, levels[b])`` (the candidates of its own depth; a tree grown to fewer levels is a prefix
    of the arrays) -- ``sizes`` and ``levels`` host lists -- and the ragged trees are padded to the largest (its
    bucket).  Padding node i of a row carries the row's root token at depth 1 and sees the root and itself.
    Returns (tokens, parents, depths, mask [B, T, T], the real sizes as an int64 [B] tensor, T)."""
    sizes, levels = sizes
    B = len(sizes)
    dev = root.device
    width = max(sizes) - 1
    n = to_device([s - 1 for s in sizes], dev)
    T = bucket_for(width + 1, buckets) if width >= 1 else 1
    cols = torch.arange(T, device=dev)
    real = cols.view(1, T) < (n + 1).view(B, 1)
    if width >= 1:
        cand_tokens, cand_scores, cand_parents = g.candidates()
        K = g.beams.shape[-1]
        m = to_device([candidate_count(K, lv) for lv in levels], dev)
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
    return tokens, parents, depths, mask, n + 1, T


def generate_batch(hs, input_ids, attention_mask, lengths, *, max_new_tokens, temperature, top_k, top_p, eos, seed,
                   finished="drop", stop=None):
    """The batched loop of :meth:`HeteroSpec.generate` (``lengths``: :func:`check_mask`'s) -> (per-row lists of
    new tokens, per-row GenerationStats, the batch's GenerationStats).  ``finished``: "drop" (a finished row
    leaves the caches at the end of its cycle) or "mask" (it stays, with a root-only tree whose commit is
    zeroed, so the shapes stay those of the whole batch -- what a recorded step of fixed batch needs).  ``stop``:
    None, or a function of one request's tokens (its prompt and the new tokens, a host list) that says it is
    done (the stopping criteria), asked after every new token of that request."""
    dev, pol = hs.device, hs.policy
    B, S = input_ids.shape
    drafting = hs._drafting
    sample = temperature > 0
    check = dev.type != "cuda"
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
    if hs.max_length is not None and need > hs._capacity(0, hs.max_length):
        raise ValueError(f"generate: prompt ({S}) + max_new_tokens ({max_new_tokens}) = {S + max_new_tokens} "
                         f"exceed the static caches' max_length ({hs.max_length}) given to HeteroSpec")
    total = GenerationStats(graphs="off")
    rows = [GenerationStats(graphs="off") for _ in range(B)]
    clock = PhaseClock(dev, total)
    with sync.outside_cycle():
        tgt = TargetAdapter(hs.target.model, tap_layers=hs.target.tap_layers, capture_taps=drafting, batch=B)
        dr = None
        # the target's cache twice: dropping finished rows copies the kept rows before the old cache is freed
        # (the draft's cache, far smaller, fits in that bound too)
        nbytes = tgt.cache_bytes(need) * 2
        free = available_bytes(dev)
        if free is not None and nbytes > free:
            tgt.close()
            raise ValueError(f"generate: argument 'input_ids' expected a batch whose static caches fit the {dev} "
                             f"memory available ({free / 2**30:.2f} GiB), got {B} prompts needing about "
                             f"{nbytes / 2**30:.2f} GiB ({need} positions per row)")
        try:
            tgt.allocate(need)
        except RuntimeError as e:   # an allocation the device cannot hold after all, before any decoding
            tgt.close()
            raise ValueError(f"generate: argument 'input_ids' expected a batch whose static caches fit the {dev} "
                             f"memory, got {B} prompts of {need} positions per row ({type(e).__name__})") from None
    try:
        with sync.outside_cycle():
            if drafting:
                dr = BatchDraftState(hs.draft, pol.top_k, hs._levels, hs._drafter.d2t, B)
                dr.allocate(need, dev)
            start = time.perf_counter()
            mask = attention_mask.to(dev) if attention_mask is not None else None
            last_logits, taps = tgt.prefill(input_ids.to(dev), attention_mask=mask)
            if B == 1:
                last_logits = last_logits.view(1, -1)
            seed_t = torch.tensor(seeds, dtype=torch.long, device=dev)
            offset = torch.zeros(B, dtype=torch.long, device=dev)
            if sample:
                zeros = torch.zeros((B, 1), dtype=torch.long, device=dev)
                _, _, root, draws = ops.verify_sample(zeros, zeros - 1, last_logits.view(B, 1, -1),
                                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                                      seed=seed_t, offset=offset)
                offset = draws.clone()                 # the cycles' uniforms follow the prefill's, per row
            else:
                root = torch.argmax(last_logits, dim=-1)
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
            ids.scatter_(1, last.view(B, 1), root.view(B, 1))
            dr.prime(taps, ids, last)
            clock.lap("draft_s")
        prefix_host = list(lengths)
        levels_max = pol.levels
        batch_calls = 0
        while True:
            keep = [i for i, a in enumerate(alive) if not done[a]]
            if not keep:
                break
            if finished == "drop" and len(keep) < len(alive):   # finished rows stop costing work
                idx = to_device(keep, dev)
                tgt.keep_rows(idx)
                if dr is not None:
                    dr.keep_rows(idx)
                root, seed_t, offset = root[idx], seed_t[idx], offset[idx]
                alive = [alive[i] for i in keep]
            Ba = len(alive)
            clock.start()
            if drafting:
                g = dr.grow(None, pol.depth, tgt.prefix)
                clock.lap("draft_s")
                if pol.binned:
                    with sync.point("bin", total):
                        ent = g.path_entropy().tolist()
                    plans = [pol.plan(e) if not done[a] else (None, 0, 1) for e, a in zip(ent, alive)]
                else:
                    plans = [(None, 0, pol.total_tokens) if not done[a] else (None, 0, 1) for a in alive]
                extra = max(p[1] for p in plans)
                g = dr.grow(g, extra, tgt.prefix)
                levels = [pol.depth + p[1] for p in plans]
                sizes = [tree_size(pol.top_k, lv, p[2]) for lv, p in zip(levels, plans)]
                tokens, parents, depths, tmask, n_real, T = batch_tree(g, (sizes, levels), root, hs.buckets, check)
                clock.lap("draft_s")
            else:
                plans = [(None, 0, 1)] * Ba
                sizes = [1] * Ba
                tokens, parents, depths, tmask, n_real, T = batch_tree(None, ([1] * Ba, [0] * Ba), root,
                                                                       hs.buckets, check)
            masked = None
            if finished == "mask" and any(done[a] for a in alive):
                masked = to_device([done[a] for a in alive], dev, torch.bool)
            window = attention_window(dev, max(prefix_host[a] for a in alive) + 1, T)
            logits, vtaps = tgt.verify(tokens, depths, tmask, window)
            clock.lap("verify_s")
            if sample:
                path, length, nxt, _ = ops.verify_sample(tokens, parents, logits, temperature=temperature,
                                                         top_k=top_k, top_p=top_p, seed=seed_t, offset=offset,
                                                         n=n_real, check=check, advance_offset=True)
            else:
                path, length, nxt = ops.verify_greedy(tokens, parents, logits, n=n_real, check=check)
            if masked is not None:                          # a finished row commits nothing
                length = length.masked_fill(masked, 0)
                path = path.masked_fill(masked.view(Ba, 1), -1)
            R = min(T, levels_max + 2) if drafting else 1
            kept = path[:, :R].clamp(min=0)
            path_tokens = tokens.gather(1, kept)
            clock.lap("ops_s")
            if drafting:
                dr.follow(vtaps, kept, path_tokens, length, nxt, tgt.prefix)
                clock.lap("draft_s")
            if T == 1:
                tgt.prefix += 1 if masked is None else (~masked).long()
            else:
                tgt.commit(path, length, check=check)
            root = nxt.clone()
            clock.lap("ops_s")
            with sync.point("accepted", total):
                host = torch.cat([length.view(Ba, 1), nxt.view(Ba, 1), path_tokens], 1).tolist()
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
        tgt.close()
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
    return generated, rows, total

