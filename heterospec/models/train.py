"""Training an EAGLE-3 head for a target (``heterospec train-draft``).

Pipeline:
1. :func:`collect`: the target answers the training prompts itself (greedy, batched with left padding), and
   the same forwards record what training needs: the three taps of every position (float16) and the
   target's top-``topk`` log-probabilities at every answer position.  The head therefore learns the
   target's own distribution, and the target runs once per token.
2. the draft vocabulary = the ``draft_vocab_size`` most frequent tokens of those answers (ties to the lower
   id), sorted ascending; ``d2t[i] = used[i] - i`` and ``t2d[v] = v in used`` (EAGLE-3's construction).
3. the loss is the cross entropy between the target's distribution restricted to the draft vocabulary
   (its top-``topk`` entries inside the draft vocabulary, renormalised) and the head's, at every answer
   position whose target argmax lies in the draft vocabulary.
4. training-time test (EAGLE-3): ``ttt_steps`` unrolled steps over the same anchors.  Step 0 at anchor t
   takes the fused taps of position t with token t+1; step j takes step j-1's output feature at anchor t
   with token t+1+j at position t+j and predicts the target's distribution at position t+1+j.  Attention
   is what the head sees when it drafts: step j at anchor t attends to the step-0 keys of anchors <= t
   (the committed context) and to the keys of steps 1..j at anchor t (its own draft path).
5. ``norm`` and ``lm_head`` start from the target's final norm and its output rows of the draft
   vocabulary (when the widths agree); the rest is randomly initialised.
Checkpoints are ``save_pretrained`` directories plus ``trainer_state.pt`` (optimizer, step) for resume.
"""
from __future__ import annotations

import json
import math
import os
import time

import numpy as np
import torch

from .draft import Eagle3Config, Eagle3Draft
from .target import TargetAdapter, cache_kwarg


def build_vocab_maps(token_ids, vocab_size, draft_vocab_size):
    """(d2t int64 [Vd], t2d bool [V]) from the training tokens: the Vd most frequent ids (ties to the lower
    id), padded with the lowest unseen ids when fewer than Vd were seen, sorted ascending."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"build_vocab_maps: argument 'draft_vocab_size' expected 1..{vocab_size}, got {draft_vocab_size}")
    counts = np.bincount(np.asarray(token_ids, np.int64).ravel(), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, id ascending
    used = np.sort(order[:draft_vocab_size])
    d2t = used - np.arange(draft_vocab_size)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[used] = True
    return torch.from_numpy(d2t.astype(np.int64)), torch.from_numpy(t2d)


# the head switches a training run may set (EAGLE-3.1's normalisations; see train_draft)
HEAD_OPTIONS = ("fc_norm", "norm_hidden_out")


# the RoPE base of families whose config names none: GPT-J and CodeGen rotate with transformers' fixed base; the
# others place tokens by learned or sinusoidal absolute positions, and the draft's own rotary takes EAGLE's base
NO_ROPE_BASE = {"gptj": 10000.0, "codegen": 10000.0, "gpt2": 10000.0, "gpt_bigcode": 10000.0, "opt": 10000.0,
                "biogpt": 10000.0, "xglm": 10000.0, "ctrl": 10000.0, "gpt_neo": 10000.0}
# the target's MLP width under each family's name for it (GPT-2's n_inner: None means 4 x hidden)
MLP_WIDTH = ("intermediate_size", "ffn_hidden_size", "ffn_dim", "dff", "n_inner")


def _mlp_width(c):
    for name in MLP_WIDTH:
        if getattr(c, name, None):
            return int(getattr(c, name))
    ffn = getattr(c, "ffn_config", None)       # DBRX
    width = getattr(ffn, "ffn_hidden_size", None) or (ffn.get("ffn_hidden_size") if isinstance(ffn, dict) else None)
    return int(width) if width else 4 * c.hidden_size


def draft_config_for(target, draft_vocab_size, **overrides):
    """An EAGLE-3 config shaped after the target (one decoder layer of the target's width, its MLP width, heads and
    RoPE base; :data:`NO_ROPE_BASE` for the families whose config names none)."""
    from .draft.config import _Problems, read_rope

    c = target.config
    # the RoPE base and scaling as the loader reads them, under every transformers release (5.x keeps them in
    # rope_parameters: a getattr(c, "rope_theta", 10000) silently took 10000 for a 100000 target, issue 19)
    problems = _Problems()
    src = c.to_dict()
    per_type = src.get("rope_parameters")
    if isinstance(per_type, dict) and isinstance(per_type.get("full_attention"), dict):
        # Gemma 3: a RoPE per layer type; the draft's one layer sees every column, as the target's full layers do
        src = dict(src, rope_parameters=per_type["full_attention"], rope_scaling=None)
    theta, scaling = read_rope(src, c.max_position_embeddings, problems, "target config.", default_theta=None)
    problems.raise_if_any("draft_config_for: the target's RoPE settings")
    if theta is None:
        theta = NO_ROPE_BASE.get(getattr(c, "model_type", None))
    if theta is None and "rope_theta" not in overrides:
        raise ValueError("draft_config_for: the target's config has no RoPE base (rope_theta or "
                         "rope_parameters.rope_theta); pass rope_theta= explicitly")
    heads = c.num_attention_heads
    d = dict(hidden_size=c.hidden_size, intermediate_size=_mlp_width(c), num_attention_heads=heads,
             num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
             head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
             rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), rope_theta=None if theta is None else float(theta),
             rope_scaling=scaling, max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
             draft_vocab_size=draft_vocab_size)
    d.update(overrides)
    return Eagle3Config(**d)


# ---- 1. the target's own answers, taps and distributions ------------------------------------------------

@torch.no_grad()
def collect(target, prompts, max_new_tokens=128, eos_token_id=None, batch_size=16, topk=32, progress=None):
    """Batched greedy answers of ``target`` to ``prompts`` ([1, S] int tensors), one record per prompt:
    ``ids`` int64 [S] (prompt + answer), ``start`` (answer start), ``taps`` float16 [S-1, 3H] (positions
    0..S-2), ``top_ids`` int32 / ``top_lp`` float16 [S-1, topk]: the target's top log-probabilities at
    each position (rows before ``start - 1`` are unused zeros).  Records come back in prompt order."""
    from transformers import DynamicCache

    adapter = TargetAdapter(target, tap_layers=None)
    cache_kw = cache_kwarg(target)
    dev = next(target.parameters()).device
    V = target.config.vocab_size
    topk = min(topk, V)
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].shape[1])
    records = [None] * len(prompts)
    done = 0
    try:
        for b0 in range(0, len(order), batch_size):
            idx = order[b0: b0 + batch_size]
            ps = [prompts[i].view(-1) for i in idx]
            B, Smax = len(ps), max(p.numel() for p in ps)
            # left-padded on the target's device (one copy per prompt, no CPU batch moved afterwards)
            ids = torch.zeros(B, Smax, dtype=torch.long, device=dev)
            mask = torch.zeros(B, Smax, dtype=torch.long, device=dev)
            for r, p in enumerate(ps):
                ids[r, Smax - p.numel():] = p.to(dev)
                mask[r, Smax - p.numel():] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            try:
                cache = DynamicCache(config=target.config)
            except TypeError:  # older transformers
                cache = DynamicCache()
            out = target(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{cache_kw: cache})
            taps = [adapter._taps().to(torch.float16).cpu()]            # [B, Smax, 3H]
            lp = torch.log_softmax(out.logits[:, -1].float(), -1)
            tv, ti = lp.topk(topk, -1)
            tops_v, tops_i = [tv.to(torch.float16).cpu()], [ti.to(torch.int32).cpu()]
            nxt = lp.argmax(-1)
            gen = [nxt.cpu()]
            finished = torch.zeros(B, dtype=torch.bool, device=dev)
            if eos_token_id is not None:
                finished |= nxt == eos_token_id
            last = pos[:, -1]
            for _ in range(max_new_tokens - 1):
                if bool(finished.all()):
                    break
                mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], -1)
                last = last + 1
                out = target(input_ids=nxt.view(B, 1), attention_mask=mask, position_ids=last.view(B, 1),
                             use_cache=True, **{cache_kw: cache})
                taps.append(adapter._taps().to(torch.float16).cpu())
                lp = torch.log_softmax(out.logits[:, -1].float(), -1)
                tv, ti = lp.topk(topk, -1)
                tops_v.append(tv.to(torch.float16).cpu())
                tops_i.append(ti.to(torch.int32).cpu())
                nxt = torch.where(finished, nxt, lp.argmax(-1))
                gen.append(nxt.cpu())
                if eos_token_id is not None:
                    finished |= nxt == eos_token_id
            taps = torch.cat(taps, 1)
            gen = torch.stack(gen, 1)
            tops_v, tops_i = torch.stack(tops_v, 1), torch.stack(tops_i, 1)
            for r, i in enumerate(idx):
                g = gen[r]
                n = g.numel()
                if eos_token_id is not None:
                    hit = (g == eos_token_id).nonzero()
                    if hit.numel():
                        n = int(hit[0]) + 1
                Sp = ps[r].numel()
                S = Sp + n
                full_ids = torch.cat([ps[r].cpu(), g[:n]])
                t = taps[r, Smax - Sp: Smax - 1 + n]                      # positions 0..S-2
                top_lp = torch.zeros(S - 1, topk, dtype=torch.float16, device="cpu")   # records live on the host
                top_ids = torch.zeros(S - 1, topk, dtype=torch.int32, device="cpu")
                top_lp[Sp - 1:] = tops_v[r, :n]
                top_ids[Sp - 1:] = tops_i[r, :n]
                records[i] = dict(ids=full_ids, start=Sp, taps=t.clone(), top_ids=top_ids, top_lp=top_lp)
            done += B
            if progress is not None:
                progress(done, len(prompts))
    finally:
        adapter.close()
    return records


def collect_shards(target, prompts, directory, *, shard_size=256, max_new_tokens=128, eos_token_id=None,
                   batch_size=16, topk=32, progress=None, limit=None):
    """:func:`collect` in shards of ``shard_size`` prompts, each saved to ``directory/shard-NNNNN.pt`` as soon
    as it is answered (written to a temporary name, then renamed), so an interrupted run resumes at the first
    missing shard.  ``directory/manifest.json`` pins what the shards depend on (the prompts' ids, the shard
    size, ``max_new_tokens``, ``topk``): a directory written for other prompts or settings is refused, not mixed.
    ``limit`` answers only the shards that cover the first ``limit`` prompts.  Returns the records of those
    prompts, in prompt order."""
    import hashlib

    if shard_size < 1:
        raise ValueError(f"collect_shards: argument 'shard_size' expected an int >= 1, got {shard_size}")
    os.makedirs(directory, exist_ok=True)
    h = hashlib.sha256()
    for p in prompts:
        h.update(np.ascontiguousarray(p.view(-1).cpu().numpy(), dtype=np.int64).tobytes())
        h.update(b"|")
    manifest = {"prompts": len(prompts), "prompts_sha256": h.hexdigest(), "shard_size": shard_size,
                "max_new_tokens": max_new_tokens, "topk": topk}
    mpath = os.path.join(directory, "manifest.json")
    if os.path.exists(mpath):
        with open(mpath) as f:
            have = json.load(f)
        diff = [k for k in manifest if have.get(k) != manifest[k]]
        if diff:
            raise ValueError(f"collect_shards: {directory} holds answers for other prompts or settings "
                             f"({', '.join(f'{k}: {have.get(k)!r} there, {manifest[k]!r} now' for k in diff)}); "
                             f"use another directory")
    else:
        with open(mpath, "w") as f:
            json.dump(manifest, f, indent=1)
    n = len(prompts) if limit is None else min(limit, len(prompts))
    out = []
    for k in range(0, n, shard_size):
        path = os.path.join(directory, f"shard-{k // shard_size:05d}.pt")
        if os.path.exists(path):
            recs, _ = load_records(path)
        else:
            base = len(out)
            inner = None if progress is None else (lambda i, m, base=base: progress(base + i, n))
            recs = collect(target, prompts[k: k + shard_size], max_new_tokens, eos_token_id, batch_size=batch_size,
                           topk=topk, progress=inner)
            save_records(path + ".tmp", recs, {"first_prompt": k})
            os.replace(path + ".tmp", path)
        out += recs
        if progress is not None:
            progress(min(len(out), n), n)
    return out[:n]


@torch.no_grad()
def forced_features(target, adapter, ids, lengths, topk):
    """One teacher-forced forward of the target over right-padded sequences (``ids`` [B, L] on the target's
    device, row b real up to ``lengths[b]``): the taps of positions 0..L-2 as float16 [B, L-1, 3H] and the
    target's top-``topk`` log-probabilities of the next token there (float16 [B, L-1, topk], int32 ids), on
    that device.  What the cached records (:func:`teacher_forced`) and the on-the-fly batches of
    :func:`train_draft` both read: one rule for the features, rounded to float16 both ways."""
    B, L = ids.shape
    mask = (torch.arange(L, device=ids.device).view(1, L) < lengths.to(ids.device).view(B, 1)).long()
    out = target(input_ids=ids, attention_mask=mask, use_cache=False)
    taps = adapter._taps()[:, : L - 1].to(torch.float16)
    top_lp = torch.empty(B, L - 1, topk, dtype=torch.float16, device=ids.device)
    top_ids = torch.empty(B, L - 1, topk, dtype=torch.int32, device=ids.device)
    for r in range(B):      # a row at a time: a float32 copy of [L, V] logits, not of the batch's
        lp = torch.log_softmax(out.logits[r, : L - 1].float(), -1)
        tv, ti = lp.topk(topk, -1)
        top_lp[r], top_ids[r] = tv.to(torch.float16), ti.to(torch.int32)
    return taps, top_lp, top_ids


def _padded(seqs, device):
    """Right-padded [B, max S] int64 ids and the lengths [B] of 1-D id tensors."""
    lengths = torch.tensor([s.numel() for s in seqs], dtype=torch.long, device="cpu")
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long, device="cpu")
    for r, s in enumerate(seqs):
        ids[r, : s.numel()] = s
    return ids.to(device), lengths


@torch.no_grad()
def teacher_forced(target, seqs, topk=32, token_budget=2048, progress=None):
    """What training needs from the target, for answers already written (``seqs``: [(ids [S], start)]): one
    teacher-forced forward per batch of sequences (:func:`forced_features`; sorted by length, right-padded, at
    most ``token_budget`` positions a batch) instead of decoding token by token.  Returns (records as
    :func:`collect` writes them, agree, total): ``agree`` of the ``total`` answer positions have the target's
    argmax here (in its dtype now) equal to the answer's next token (how far the answers' own dtype agrees
    with this one's greedy)."""
    adapter = TargetAdapter(target, tap_layers=None)
    dev = next(target.parameters()).device
    topk = min(topk, target.config.vocab_size)
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][0].numel())
    records = [None] * len(seqs)
    agree = total = done = 0
    try:
        b0 = 0
        while b0 < len(order):
            b1 = b0 + 1
            while b1 < len(order) and (b1 - b0 + 1) * seqs[order[b1]][0].numel() <= token_budget:
                b1 += 1
            idx = order[b0:b1]
            ids, lengths = _padded([seqs[i][0] for i in idx], dev)
            taps, top_lp, top_ids = (t.cpu() for t in forced_features(target, adapter, ids, lengths, topk))
            for r, i in enumerate(idx):
                full, start = seqs[i]
                S = full.numel()
                tl = torch.zeros(S - 1, topk, dtype=torch.float16, device="cpu")   # rows before start - 1: zeros
                ti = torch.zeros(S - 1, topk, dtype=torch.int32, device="cpu")
                tl[start - 1:] = top_lp[r, start - 1: S - 1]
                ti[start - 1:] = top_ids[r, start - 1: S - 1]
                agree += int((ti[start - 1:, 0].long() == full[start:]).sum())
                total += S - start
                records[i] = dict(ids=full.clone(), start=start, taps=taps[r, : S - 1].clone(), top_ids=ti, top_lp=tl)
            done += len(idx)
            b0 = b1
            if progress is not None:
                progress(done, len(seqs))
    finally:
        adapter.close()
    return records, agree, total


def store_features(target, store, cache_dir, identity, *, topk=32, limit=None, token_budget=2048, progress=None,
                   log=None):
    """The training records of every answered shard of ``store`` (an :class:`~heterospec.models.answers.AnswerStore`)
    covering the first ``limit`` prompts, each shard's features computed once by :func:`teacher_forced` and cached
    in ``cache_dir/features-NNNNN.pt``, keyed by the shard's sha256, the target's ``identity``, its dtype and
    ``topk`` (a cache entry for anything else is recomputed).  Returns (records, agree, total) summed over the
    shards; ``log(k, seconds, positions, cached)`` hears of each shard."""
    os.makedirs(cache_dir, exist_ok=True)
    records, agree, total = [], 0, 0
    dtype = str(target.dtype).replace("torch.", "")
    for k in range(store.n_shards(limit)):
        info = store.manifest.get("shards", {}).get(f"{k:05d}")
        if info is None or not os.path.exists(store.shard_path(k)):
            continue
        key = {"answers_sha256": info["sha256"], "target": identity, "dtype": dtype, "topk": topk, "format": 1}
        path = os.path.join(cache_dir, f"features-{k:05d}.pt")
        t0 = time.perf_counter()
        recs = None
        if os.path.exists(path):
            recs, meta = load_records(path)
            if meta.get("key") != key:
                recs = None
        cached = recs is not None
        if recs is None:
            seqs = [(ids, start) for _, ids, start in store.load_shard(k)]
            recs, a, n = teacher_forced(target, seqs, topk=topk, token_budget=token_budget, progress=progress)
            save_records(path + ".tmp", recs, {"key": key, "agree": a, "total": n})
            os.replace(path + ".tmp", path)
            meta = {"agree": a, "total": n}
        agree += meta.get("agree", 0)
        total += meta.get("total", 0)
        records += recs
        if log is not None:
            log(k, time.perf_counter() - t0, sum(r["ids"].numel() for r in recs), cached)
    return records, agree, total


def save_records(path, records, meta=None):
    torch.save({"records": records, "meta": meta or {}}, path)


def load_records(path):
    d = torch.load(path, weights_only=True)
    return d["records"], d.get("meta", {})


# ---- 2. the head -------------------------------------------------------------------------------------

def head_from(path, target):
    """The head in ``path`` as a float32 CPU starting point for more training on ``target``: its weights and
    vocabulary maps, with the RoPE base and scaling taken from the target (:func:`draft_config_for`), which
    a head trained before that fix may lack (its positions then change meaning and training adapts them)."""
    draft = Eagle3Draft.from_pretrained(path, target=target, dtype=torch.float32, device="cpu")
    want = draft_config_for(target, draft.config.draft_vocab_size)
    draft.config.rope_theta, draft.config.rope_scaling = want.rope_theta, want.rope_scaling
    draft.config.max_position_embeddings = want.max_position_embeddings
    draft._inv_freq_cache.clear()
    return draft


@torch.no_grad()
def init_from_target(draft, target):
    """Start ``norm`` and ``lm_head`` from the target's final norm and its output rows of the draft
    vocabulary (the head then predicts in the target's own output space from the first step).  Skipped
    (False) when the widths differ."""
    c, tc = draft.config, target.config
    if c.hidden_size != tc.hidden_size:
        return False
    final_norm = getattr(getattr(target, "model", None), "norm", None)
    if final_norm is not None:
        draft.norm.weight.copy_(final_norm.weight.float())
    used = torch.nonzero(draft.t2d).view(-1)
    out = target.get_output_embeddings().weight
    draft.lm_head.weight.copy_(out[used.to(out.device)].to(draft.lm_head.weight.device, torch.float32))
    return True


def _batch(records, which, topk, t2d, tmap, forced=None):
    """Right-padded training tensors for the records ``which`` on the training device: the taps, the ids
    (with room for tokens t+1+j past the end), the draft ids of the target's top entries and their
    log-probabilities (-inf: not in the draft vocabulary), and ``valid`` (position p holds a trainable target:
    an answer position whose target argmax is in the draft vocabulary).  The features come from the records
    (cached: one host copy per tensor) or, with ``forced`` (target, adapter, device), from one teacher-forced
    forward of the target on the batch (:func:`forced_features`, on the fly)."""
    recs = [records[i] for i in which]
    ids, lengths = _padded([r["ids"] for r in recs], torch.device("cpu"))
    starts = torch.tensor([r["start"] for r in recs], dtype=torch.long, device="cpu")
    B, L = ids.shape[0], ids.shape[1] - 1
    if forced is not None:
        target, adapter, device = forced
        taps, top_lp, top_ids = forced_features(target, adapter, ids.to(device), lengths, topk)
    else:
        device = None
        H3 = recs[0]["taps"].shape[-1]
        cpu = torch.device("cpu")     # host records: the batch is built on the host, moved in one copy a tensor
        taps = torch.zeros(B, L, H3, dtype=torch.float16, device=cpu)
        top_lp = torch.zeros(B, L, topk, dtype=torch.float16, device=cpu)
        top_ids = torch.zeros(B, L, topk, dtype=torch.int32, device=cpu)
        for r, rec in enumerate(recs):
            n = rec["ids"].numel() - 1
            taps[r, :n], top_lp[r, :n], top_ids[r, :n] = rec["taps"], rec["top_lp"], rec["top_ids"]
    dev = taps.device
    ti = top_ids.long()
    inside = t2d.to(dev)[ti]
    p = torch.arange(L, device=dev).view(1, L)
    real = (p < (lengths.to(dev) - 1).view(B, 1)).unsqueeze(-1)     # the positions of each sequence
    tgt_d = torch.where(inside & real, tmap.to(dev)[ti], 0)
    tgt_w = torch.where(inside & real, top_lp.float(), -math.inf)
    answer = (p >= (starts.to(dev) - 1).view(B, 1)) & real[..., 0]
    valid = answer & inside[..., 0]
    ids = torch.cat([ids, torch.zeros(B, 8, dtype=torch.long, device="cpu")], 1).to(dev)
    return taps.float(), ids, tgt_d, tgt_w, valid


def ttt_loss(draft, taps, ids, tgt_d, tgt_w, valid, ttt_steps):
    """Mean over steps of the masked soft cross entropy; returns (loss, accuracy per step)."""
    B, L = taps.shape[0], taps.shape[1]
    dev = taps.device
    hidden = draft.fuse(taps)
    anchors = torch.arange(L, device=dev)
    past_k = past_v = None
    total, accs, n_steps = 0.0, [], 0
    eye = torch.eye(L, dtype=torch.bool, device=dev)
    if not 1 <= ttt_steps <= 8:
        raise ValueError(f"train_draft: argument 'ttt_steps' expected 1..8, got {ttt_steps}")
    for j in range(ttt_steps):
        if L - j - 1 <= 0:
            break
        positions = (anchors + j).view(1, L)
        if j == 0:
            mask = None  # causal
        else:
            mask = torch.cat([torch.ones(L, L, dtype=torch.bool, device=dev).tril()] + [eye] * j, dim=1)
        past = None if past_k is None else (past_k, past_v)
        logits, h, (k, v) = draft(hidden, ids[:, 1 + j: 1 + j + L], positions, past_kv=past, attn_mask=mask)
        past_k, past_v = k, v  # steps 0..j: the past of step j + 1
        # step j at anchor t predicts the target's distribution at position t + 1 + j
        keep = torch.zeros(B, L, dtype=torch.bool, device=dev)
        keep[:, : L - 1 - j] = valid[:, 1 + j:]
        if keep.any():
            w = torch.zeros(B, L, tgt_w.shape[-1], device=dev)
            d = torch.zeros(B, L, tgt_w.shape[-1], dtype=torch.long, device=dev)
            w[:, : L - 1 - j] = torch.softmax(tgt_w[:, 1 + j:], -1).nan_to_num(0.0)
            d[:, : L - 1 - j] = tgt_d[:, 1 + j:]
            logq = torch.log_softmax(logits.float(), dim=-1)
            ce = -(w * logq.gather(-1, d)).sum(-1)
            total = total + ce[keep].mean()
            n_steps += 1
            accs.append(float((logits.argmax(-1) == d[..., 0])[keep].float().mean()))
        hidden = h
    return total / max(n_steps, 1), accs


def train_draft(target, prompts, out_dir, *, draft_vocab_size=None, steps=200, lr=3e-4, ttt_steps=3,
                max_new_tokens=128, seed=0, resume=False, log_every=None, progress=None, eos_token_id=None,
                answer_progress=None, batch_size=4, gen_batch_size=16, topk=32, warmup=None, records=None,
                init=False, save_every=None, val_fraction=0.0, eval_every=None, patience=None, init_head=None,
                autocast=None, epochs=None, head_options=None, on_the_fly=False, deadline=None):
    """Train an EAGLE-3 head for ``target`` on the target's own answers to ``prompts`` ([1, S] tensors),
    or on ``records`` from :func:`collect` when given; writes ``out_dir`` (loadable with
    ``Eagle3Draft.from_pretrained(out_dir, target=target)``).  ``batch_size`` sequences per optimiser
    step; the learning rate warms up linearly over ``warmup`` steps (default steps // 20) and then decays
    on a cosine to lr / 10.  Returns the list of (step, loss, accuracies) logged.

    ``val_fraction`` > 0 holds that share of the sequences out (seeded) and measures the loss and per-step
    accuracy on them every ``eval_every`` steps (default steps // 20); the head written is then the one with
    the lowest validation loss, and with ``patience`` training stops after that many evaluations without a
    lower one.  ``training_log.json`` keeps both curves and ``training_curves.png`` draws them (matplotlib).

    ``init_head`` (a head directory) starts from that head's weights and vocabulary maps instead of a random
    head (:func:`head_from`): more training for a head already shipped.

    ``autocast`` ("bfloat16" or "float16") runs the head's forward under ``torch.autocast`` on the training
    device (the weights and the optimiser stay float32; softmax and the loss are float32): 1.5x the positions
    per second on a 2-core CPU with AVX512-BF16 (benchmarks/bench_training.py), more on a GPU.

    ``epochs`` sets ``steps`` to that many passes over the training sequences (after the validation split).

    ``head_options``: switches of a new head's :class:`~heterospec.models.draft.Eagle3Config` from
    :data:`HEAD_OPTIONS` -- EAGLE-3.1's two normalisations: ``fc_norm`` (an RMSNorm on each of the three fused
    taps, SpecForge's and vLLM's layout) and ``norm_hidden_out`` (the post-norm state fed back to the next draft
    step; our flat config key: vLLM reads this switch only from a speculators config's ``norm_output``, and
    SafeAILab's loader does not know it).  A head started from ``init_head`` or resumed keeps its own.

    ``on_the_fly``: ``records`` hold only ``ids`` and ``start`` (the answers as token ids), and every batch's
    features come from one teacher-forced forward of ``target`` (:func:`forced_features`) -- no feature files,
    however many answers (a GPU's way: the forward costs about what the head's step does).  ``deadline`` (a
    ``time.monotonic()`` value): training stops at the first step past it and checkpoints, so ``resume``
    continues; ``steps`` still sets the schedule."""
    if autocast not in (None, "bfloat16", "float16"):
        raise ValueError(f"train_draft: argument 'autocast' expected None, 'bfloat16' or 'float16', got {autocast!r}")
    head_options = dict(head_options or {})
    bad = sorted(k for k, v in head_options.items() if k not in HEAD_OPTIONS or not isinstance(v, bool))
    if bad:
        raise ValueError(f"train_draft: argument 'head_options' expected booleans for {', '.join(HEAD_OPTIONS)}, "
                         f"got {', '.join(f'{k}={head_options[k]!r}' for k in bad)}")
    torch.manual_seed(seed)
    os.makedirs(out_dir, exist_ok=True)
    V = target.config.vocab_size
    Vd = draft_vocab_size or V
    if records is None:
        records = collect(target, prompts, max_new_tokens, eos_token_id, batch_size=gen_batch_size, topk=topk,
                          progress=answer_progress)
    if on_the_fly:
        if records is None or any("taps" in r for r in records[:1]):
            raise ValueError("train_draft: argument 'records' expected answers as token ids (ids, start) with "
                             "on_the_fly=True, got " + ("None" if records is None else "records with features"))
        topk = min(topk, V)
    else:
        topk = records[0]["top_ids"].shape[-1]
    val_records = []
    if val_fraction > 0:
        if not 0 < val_fraction < 1:
            raise ValueError(f"train_draft: argument 'val_fraction' expected a value in [0, 1), got {val_fraction}")
        order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed + 7919)).tolist()
        n_val = max(1, int(round(val_fraction * len(records))))
        if n_val >= len(records):
            raise ValueError(f"train_draft: argument 'val_fraction' leaves no training sequences "
                             f"({len(records)} sequences, {n_val} held out)")
        val_records = [records[i] for i in order[:n_val]]
        records = [records[i] for i in order[n_val:]]
    if epochs is not None:   # the schedule in passes over the training sequences
        if not epochs > 0:
            raise ValueError(f"train_draft: argument 'epochs' expected a number > 0, got {epochs}")
        steps = max(1, int(math.ceil(epochs * len(records) / batch_size)))
    if log_every is None:       # a point every steps // 50 steps, at most 10 apart
        log_every = max(1, min(10, steps // 50))
    answers = np.concatenate([r["ids"][r["start"]:].numpy() for r in records])
    state_path = os.path.join(out_dir, "trainer_state.pt")
    device = next(target.parameters()).device  # the head trains where the target lives

    def amp():
        if autocast is None:
            return torch.autocast(device.type, enabled=False)
        return torch.autocast(device.type, dtype=getattr(torch, autocast))
    last_dir = os.path.join(out_dir, "last")  # with validation: the head to resume from (out_dir holds the best)
    if resume and os.path.exists(state_path):
        src = last_dir if val_records and os.path.isdir(last_dir) else out_dir
        draft = Eagle3Draft.from_pretrained(src, target=target, dtype=torch.float32, device=device)
        state = torch.load(state_path, weights_only=True, map_location=device)
        start_step = int(state["step"])
    elif init_head is not None:
        draft = head_from(init_head, target)
        differ = {k: v for k, v in head_options.items() if getattr(draft.config, k) != v}
        if differ:
            raise ValueError(f"train_draft: argument 'head_options' expected the init_head's own switches "
                             f"{ {k: getattr(draft.config, k) for k in differ} }, got {differ}")
        if draft_vocab_size is not None and draft_vocab_size != draft.config.draft_vocab_size:
            raise ValueError(f"train_draft: argument 'draft_vocab_size' expected {draft.config.draft_vocab_size} "
                             f"(the vocabulary of init_head {init_head}), got {draft_vocab_size}")
        Vd = draft.config.draft_vocab_size
        state, start_step = None, 0
    else:
        d2t, t2d = build_vocab_maps(answers, V, Vd)
        # initialised on the host (the same head for a seed whatever the device), then moved
        with torch.device("cpu"):
            draft = Eagle3Draft(draft_config_for(target, Vd, **head_options),
                                embed_tokens=target.get_input_embeddings().weight.detach().to("cpu", torch.float32))
        with torch.no_grad():
            draft.d2t.copy_(d2t)
            draft.t2d.copy_(t2d)
        if init:
            init_from_target(draft, target)
        state, start_step = None, 0
    draft = draft.to(device)
    t2d = draft.t2d.cpu()
    tmap = (t2d.long().cumsum(0) - 1).clamp(min=0)
    adapter = TargetAdapter(target, tap_layers=None) if on_the_fly else None
    forced = (target, adapter, device) if on_the_fly else None
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20) if warmup is None else max(1, warmup)
    sched = lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps)))))  # noqa: E731
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    log, val_log = [], []
    best = {"loss": math.inf, "step": None}
    stale = 0
    if state is not None and "best" in state:   # the run's curves and early-stopping state go on too
        log, val_log = [tuple(r) for r in state["log"]], [tuple(r) for r in state["val_log"]]
        best, stale = dict(state["best"]), int(state["stale"])
    draft.train()
    t0 = time.time()
    perm, epoch = None, -1

    def write_log(step):
        with open(os.path.join(out_dir, "training_log.json"), "w") as f:
            json.dump({"steps": step, "lr": lr, "ttt_steps": ttt_steps, "draft_vocab_size": Vd, "batch_size": batch_size,
                       "sequences": len(records), "validation_sequences": len(val_records),
                       "answer_tokens": int(answers.size), "topk": topk, "max_new_tokens": max_new_tokens,
                       "autocast": autocast, "head_options": {k: bool(getattr(draft.config, k)) for k in HEAD_OPTIONS},
                       "log": log,
                       "val_log": val_log, "best_val_step": best["step"], "best_val_loss":
                       None if best["step"] is None else best["loss"]}, f, indent=1)

    def save(step):
        """The head in out_dir (the final one, or with validation the best so far) and the log."""
        draft.eval()
        draft.save_pretrained(out_dir)
        write_log(step)
        draft.train()

    def checkpoint(step):
        """What --resume needs: the current head (in out_dir/last with validation, where out_dir holds the
        best one), the optimizer, the step, the curves and the early-stopping state."""
        draft.eval()
        draft.save_pretrained(last_dir if val_records else out_dir)
        torch.save({"step": step, "optimizer": opt.state_dict(), "log": log, "val_log": val_log, "best": best,
                    "stale": stale}, state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)
        write_log(step)
        draft.train()

    def validate():
        """Mean loss and per-step accuracy over the held-out sequences (weighted by batch)."""
        draft.eval()
        tot, accs, n = 0.0, None, 0
        with torch.no_grad():
            for k in range(0, len(val_records), batch_size):
                which = list(range(k, min(k + batch_size, len(val_records))))
                vb = [t.to(device) for t in _batch(val_records, which, topk, t2d, tmap, forced)]
                with amp():
                    loss_v, acc_v = ttt_loss(draft, *vb, ttt_steps)
                tot += float(loss_v) * len(which)
                accs = [a * len(which) for a in acc_v] if accs is None else [a + b * len(which) for a, b in zip(accs, acc_v)]
                n += len(which)
        draft.train()
        return tot / n, [a / n for a in accs]

    eval_every = max(1, steps // 20) if eval_every is None else max(1, eval_every)

    lengths = torch.tensor([r["ids"].numel() for r in records], dtype=torch.float64, device="cpu")
    per_epoch = max(1, len(records) // batch_size)
    done = start_step                        # the steps taken so far (the log keeps every log_every-th)
    try:
        for step in range(start_step, steps):
            e = step // per_epoch
            if e != epoch:
                # batches of similar lengths (little padding), jittered so they differ between epochs, in random order
                g = torch.Generator(device="cpu").manual_seed(seed + e)
                jitter = torch.rand(len(records), generator=g, dtype=torch.float64, device="cpu")
                order = torch.argsort(lengths + 32.0 * jitter)
                chunks = [order[k * batch_size: (k + 1) * batch_size].tolist() for k in range(per_epoch)]
                perm, epoch = [chunks[k] for k in torch.randperm(per_epoch, generator=g, device="cpu").tolist()], e
            which = perm[step % per_epoch]
            batch = [t.to(device) for t in _batch(records, which, topk, t2d, tmap, forced)]
            with amp():
                loss, accs = ttt_loss(draft, *batch, ttt_steps)
            for group in opt.param_groups:
                group["lr"] = lr * sched(step)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            done = step + 1
            if (step + 1) % log_every == 0 or step == start_step:
                log.append((step + 1, float(loss.detach()), accs))
                if progress is not None:
                    progress(step + 1, steps, float(loss.detach()), accs, time.time() - t0)
            if val_records and ((step + 1) % eval_every == 0 or step + 1 == steps):
                v_loss, v_accs = validate()
                val_log.append((step + 1, v_loss, v_accs))
                if v_loss < best["loss"]:
                    best.update(loss=v_loss, step=step + 1)
                    stale = 0
                    save(step + 1)               # the best head so far is the one on disk
                else:
                    stale += 1
                    if patience is not None and stale >= patience:
                        break                    # early stop: the head on disk is the best one
            if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                checkpoint(step + 1)
            if deadline is not None and time.monotonic() > deadline:
                break                            # out of time: checkpointed below, --resume goes on
    finally:
        if adapter is not None:
            adapter.close()
    draft.eval()
    checkpoint(done)    # the head (without validation), and what --resume to a larger --steps needs
    _plot_curves(os.path.join(out_dir, "training_curves.png"), log, val_log, ttt_steps)
    return log


def _plot_curves(path, log, val_log, ttt_steps):
    """Training and validation loss, and per-step accuracy, as a PNG beside the head (skipped without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    if log:
        a.plot([r[0] for r in log], [r[1] for r in log], label="train", color="#4477aa")
    if val_log:
        a.plot([r[0] for r in val_log], [r[1] for r in val_log], "o-", label="validation", color="#cc3311")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_title("training-time-test loss")
    a.legend()
    rows = val_log or log
    for j in range(min(ttt_steps, len(rows[0][2]) if rows else 0)):
        b.plot([r[0] for r in rows], [r[2][j] for r in rows], label=f"step {j + 1}")
    b.set_xlabel("step")
    b.set_ylabel("accuracy" + (" (validation)" if val_log else " (training)"))
    b.set_title("accuracy per drafted step")
    if rows:
        b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
