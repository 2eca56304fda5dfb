"""Training an EAGLE-3 head for a target (``heterospec train-draft``).

Pipeline:
1. the target answers the training prompts itself (greedy), so the head learns the target's distribution;
2. the draft vocabulary = the ``draft_vocab_size`` most frequent tokens of those answers (ties to the lower
   id), sorted ascending; ``d2t[i] = used[i] - i`` and ``t2d[v] = v in used`` (EAGLE-3's construction);
3. per sequence, one target forward gives the three taps and the target's logits; the loss is the cross
   entropy between the target distribution restricted to the draft vocabulary (renormalised) and the
   head's, at every position whose target argmax lies in the draft vocabulary;
4. training-time test: ``ttt_steps`` unrolled steps; step j feeds the head its own previous output
   features (shifted one position) with the next tokens, so it learns to draft several levels from its
   own features.  Simplification: each step attends causally to its own step's keys only (EAGLE-3's
   training also lets step j see step-0 keys of earlier positions).
Checkpoints are ``save_pretrained`` directories plus ``trainer_state.pt`` (optimizer, step) for resume.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

from .draft import Eagle3Config, Eagle3Draft
from .hf import TargetAdapter, _decoder_layers


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


def draft_config_for(target, draft_vocab_size, **overrides):
    """An EAGLE-3 config shaped after the target (one decoder layer of the target's width)."""
    c = target.config
    d = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
             num_attention_heads=c.num_attention_heads,
             num_key_value_heads=getattr(c, "num_key_value_heads", c.num_attention_heads),
             head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
             rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), rope_theta=float(getattr(c, "rope_theta", 10000.0) or 10000.0),
             max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
             draft_vocab_size=draft_vocab_size)
    d.update(overrides)
    return Eagle3Config(**d)


@torch.no_grad()
def target_answers(target, prompts, max_new_tokens=128, eos_token_id=None, progress=None):
    """The target's own greedy answers: a list of [1, S + new] sequences and the answer start of each."""
    from .decoding import HeteroSpec

    seqs, starts = [], []
    with HeteroSpec(target) as hs:
        for i, p in enumerate(prompts):
            seq, _ = hs.generate(p, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
            seqs.append(seq)
            starts.append(p.shape[1])
            if progress is not None:
                progress(i + 1, len(prompts))
    return seqs, starts


def _ttt_loss(draft, taps, ids, target_logits, t2d, start, ttt_steps):
    """Sum over unrolled steps of the masked soft cross entropy; returns (loss, accuracy per step)."""
    S = ids.shape[1]
    td = t2d.to(target_logits.device)
    hidden = draft.fuse(taps[:, : S - 1])
    cur_ids = ids[:, 1:S]
    positions = torch.arange(0, S - 1).view(1, -1)
    total, accs, n_steps = 0.0, [], 0
    for j in range(ttt_steps):
        L = hidden.shape[1]
        if L < 1:
            break
        logits, h, _ = draft(hidden, cur_ids[:, :L], positions[:, :L])
        # step j at position t predicts token t + 2 + j: the target's distribution at position t + 1 + j
        tgt = target_logits[:, 1 + j: 1 + j + L]
        L = min(L, tgt.shape[1])
        logits, tgt, h = logits[:, :L], tgt[:, :L], h[:, :L]
        p = torch.softmax(tgt.float()[..., td], dim=-1)
        keep = td[tgt.argmax(-1)]                        # target argmax inside the draft vocabulary
        keep[:, : max(0, start - 2 - j)] = False           # train on predictions of answer tokens only
        if keep.any():
            logq = torch.log_softmax(logits.float(), dim=-1)
            ce = -(p * logq).sum(-1)
            total = total + ce[keep].mean()
            n_steps += 1
            accs.append(float((logits.argmax(-1) == p.argmax(-1))[keep].float().mean()))
        # next step: own features, shifted one position, with the next tokens
        hidden = h[:, :-1]
        cur_ids = ids[:, 2 + j: 2 + j + hidden.shape[1]]
        positions = positions[:, 1: 1 + hidden.shape[1]]
    return (total / max(n_steps, 1)), accs


def train_draft(target, prompts, out_dir, *, draft_vocab_size=None, steps=200, lr=3e-4, ttt_steps=3,
                max_new_tokens=128, seed=0, resume=False, log_every=10, progress=None, eos_token_id=None,
                answer_progress=None):
    """Train an EAGLE-3 head for ``target`` on the target's own answers to ``prompts`` ([1, S] tensors);
    writes ``out_dir`` (loadable with ``Eagle3Draft.from_pretrained(out_dir, target=target)``).  Returns
    the list of (step, loss, accuracies) logged."""
    torch.manual_seed(seed)
    os.makedirs(out_dir, exist_ok=True)
    V = target.config.vocab_size
    Vd = draft_vocab_size or V
    seqs, starts = target_answers(target, prompts, max_new_tokens, eos_token_id, answer_progress)
    answers = np.concatenate([s[0, st:].numpy() for s, st in zip(seqs, starts)])
    d2t, t2d = build_vocab_maps(answers, V, Vd)
    state_path = os.path.join(out_dir, "trainer_state.pt")
    if resume and os.path.exists(state_path):
        draft = Eagle3Draft.from_pretrained(out_dir, target=target, dtype=torch.float32)
        state = torch.load(state_path, weights_only=True)
        start_step = int(state["step"])
    else:
        draft = Eagle3Draft(draft_config_for(target, Vd),
                            embed_tokens=target.get_input_embeddings().weight.detach().float())
        with torch.no_grad():
            draft.d2t.copy_(d2t)
            draft.t2d.copy_(t2d)
        state, start_step = None, 0
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    adapter = TargetAdapter(target, tap_layers=draft.config.tap_layers(len(_decoder_layers(target))))
    # the target's taps and logits per training sequence, computed once
    cache = []
    with torch.no_grad():
        for s in seqs:
            out = target(s, output_hidden_states=False)
            cache.append((adapter._taps().detach().float(), out.logits.detach().float()))
    adapter.close()
    log = []
    draft.train()
    t0 = time.time()
    for step in range(start_step, steps):
        i = step % len(seqs)
        taps, logits = cache[i]
        loss, accs = _ttt_loss(draft, taps, seqs[i], logits, draft.t2d, starts[i], ttt_steps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        if (step + 1) % log_every == 0 or step == start_step:
            log.append((step + 1, float(loss.detach()), accs))
            if progress is not None:
                progress(step + 1, steps, float(loss.detach()), accs, time.time() - t0)
    draft.eval()
    draft.save_pretrained(out_dir)
    torch.save({"step": steps, "optimizer": opt.state_dict()}, state_path)
    with open(os.path.join(out_dir, "training_log.json"), "w") as f:
        json.dump({"steps": steps, "lr": lr, "ttt_steps": ttt_steps, "draft_vocab_size": Vd,
                   "sequences": len(seqs), "max_new_tokens": max_new_tokens, "log": log}, f, indent=1)
    return log
