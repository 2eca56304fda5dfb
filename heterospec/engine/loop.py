"""One lossless decoding loop for autoregressive, EAGLE-3 and HeteroSpec decoding (batch 1).

A cycle (see DESIGN.md §3):
  1. draft catch-up: the draft consumes the target's taps of the positions committed last cycle (paired
     with the token after each) and expands the root: ``ops.expand`` gives the first level's candidates;
  2. per tree level, one draft forward over the K beams (tree attention: each beam sees the committed
     prefix and its own ancestors) and one ``ops.expand``; after the base depth the path entropy along
     the most confident path decides, through the policy, how many extra levels to draft and how many
     nodes to keep;
  3. ``ops.select`` + ``ops.build_tree``; one target forward over the tree (4D tree mask);
  4. ``ops.verify_greedy`` / ``ops.verify_sample`` accept losslessly; ``ops.kv_compact`` commits.
Autoregressive decoding is the same loop with a root-only tree (no draft). The Python work per cycle is a
fixed number of calls per tree level; nothing loops over tree nodes.

Counting conventions: every node count includes the root (like EAGLE's ``total_token``); ``depth`` is the
number of expansion levels after the root expansion (EAGLE's ``depth``), so the deepest drafted token is at
depth ``depth + 1``.  τ = committed tokens / verification calls (each call commits the accepted draft
tokens plus the bonus token); the prefill is counted apart.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter

import numpy as np
import torch

from .. import ops
from ..models.target import TargetAdapter
from ..policy import Policy

@dataclasses.dataclass
class GenerationStats:
    new_tokens: int = 0
    cycles: int = 0            # verification calls after the prefill
    verified_tokens: int = 0   # tree tokens sent through the target, root included
    accepted_hist: Counter = dataclasses.field(default_factory=Counter)  # accepted draft tokens per cycle
    bins: Counter = dataclasses.field(default_factory=Counter)          # cycles per entropy bin
    bin_accepted: Counter = dataclasses.field(default_factory=Counter)  # accepted draft tokens per entropy bin
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    ops_s: float = 0.0
    total_s: float = 0.0

    @property
    def committed(self):
        """Tokens committed by verification calls (accepted draft tokens + the bonus token of each)."""
        return sum((a + 1) * c for a, c in self.accepted_hist.items())

    @property
    def tau(self):
        """Committed tokens per verification call (the bonus token counts)."""
        return self.committed / self.cycles if self.cycles else 0.0

    def as_dict(self):
        d = dataclasses.asdict(self)
        d["accepted_hist"] = dict(sorted(self.accepted_hist.items()))
        d["bins"] = dict(sorted(self.bins.items()))
        d["bin_accepted"] = dict(sorted(self.bin_accepted.items()))
        d["tau"] = self.tau
        d["tokens_per_s"] = self.new_tokens / self.total_s if self.total_s else 0.0
        return d


def _check_generate_args(max_new_tokens, temperature, top_k, top_p):
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"generate: argument 'max_new_tokens' expected an int >= 1, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"generate: argument 'temperature' expected a finite value >= 0, got {temperature!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"generate: argument 'top_k' expected an int >= 0, got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"generate: argument 'top_p' expected a value in (0, 1], got {top_p!r}")


@dataclasses.dataclass
class CandidateTree:
    """All candidates of one cycle's draft tree, numbered level by level (the root expansion's K first,
    then K*K per level), so the tree grown to fewer levels is a prefix of these arrays."""

    tokens: np.ndarray        # int64 [M] target-vocabulary ids
    scores: np.ndarray        # float32 [M] cumulative log-probabilities
    parents: np.ndarray       # int64 [M] candidate index of the parent, -1 under the root
    row_entropy: np.ndarray   # float32 [1 + fed rows]: top-K entropy of each draft row (row 0: the root)
    row_of: np.ndarray        # int64 [M] fed row of a candidate that became a beam, else -1
    level_best: np.ndarray    # int64 [levels + 1]: the best-scoring candidate of each level
    top_k: int

    def size(self, levels):
        """Number of candidates in the tree grown to ``levels`` levels after the root expansion."""
        return self.top_k + self.top_k * self.top_k * levels

    def path_entropy(self, levels):
        """Cumulative top-K entropy (paper Eq. 1) along P* at ``levels``: P* is the path to the
        best-scoring candidate of that level; the sum runs over the distributions that produced its tokens
        (the root row and the row of every ancestor).  A walk over depth, not over nodes."""
        h = float(self.row_entropy[0])
        c = int(self.parents[self.level_best[levels]])
        while c >= 0:
            h += float(self.row_entropy[1 + self.row_of[c]])
            c = int(self.parents[c])
        return h


def grow_tree(draft, kv, root_logits, h_root, P, K, base_depth, d2t, decide=None, stats=None):
    """Grow one cycle's draft tree (EAGLE-2/3 dynamic tree, one draft forward + one ``ops.expand`` per
    level).  ``kv`` is the draft cache of the committed prefix (P positions); ``root_logits`` [1, Vd] and
    ``h_root`` [1, H] are the draft's output at the last committed position.  After ``base_depth`` levels
    ``decide(path_entropy)`` (if given) returns how many extra levels to grow."""
    t1 = time.perf_counter()
    tok, sc, par, ent, beams = ops.expand(root_logits.float().cpu().numpy(), np.zeros(1, np.float32),
                                          np.full(1, -1, np.int64), K, d2t, 0)
    ops_s = time.perf_counter() - t1
    draft_s = 0.0
    tokens, scores, parents, src = [tok], [sc], [par], [np.full(K, -1, np.int64)]
    row_entropy = [ent]                  # per fed row: entropy of its distribution (row 0: the root)
    row_of = np.full(K, -1, np.int64)    # candidate -> fed tree row (-1: not fed)
    level_best = [int(beams[0])]
    h_rows = h_root                      # hidden inputs by source row: index 0 = the root's output
    tree_mask = torch.zeros((0, 0), dtype=torch.bool)
    n_rows, offset, level, depth = 0, K, 0, base_depth
    candidate = None
    while level < depth:
        level += 1
        all_scores = np.concatenate(scores)
        all_tokens = np.concatenate(tokens)
        all_parents = np.concatenate(parents)
        all_src = np.concatenate(src)
        # the beams' inputs: their own token, the draft output of the row that produced them
        t0 = time.perf_counter()
        parent_rows = np.where(all_parents[beams] >= 0, row_of[np.maximum(all_parents[beams], 0)], -1)
        prow = torch.from_numpy(parent_rows)
        new_mask = torch.zeros((K, n_rows + K), dtype=torch.bool)
        if n_rows:
            has = prow >= 0
            new_mask[has, :n_rows] = tree_mask[prow[has]]
        new_mask[:, n_rows:] = torch.eye(K, dtype=torch.bool)
        full_mask = torch.cat([torch.ones((K, P), dtype=torch.bool), new_mask], dim=1)
        hid = h_rows[torch.from_numpy(all_src[beams] + 1)].unsqueeze(0)
        ids = torch.from_numpy(all_tokens[beams]).view(1, K)
        pos = torch.full((1, K), P + level - 1, dtype=torch.long)
        lg, hl, kv = draft(hid, ids, pos, past_kv=kv, attn_mask=full_mask)
        draft_s += time.perf_counter() - t0
        # bookkeeping of the fed rows
        grown = torch.zeros((n_rows + K, n_rows + K), dtype=torch.bool)
        grown[:n_rows, :n_rows] = tree_mask
        grown[n_rows:] = new_mask
        tree_mask = grown
        row_of = np.concatenate([row_of, np.full(K * K, -1, np.int64)])
        row_of[beams] = n_rows + np.arange(K)
        h_rows = torch.cat([h_rows, hl[0]], dim=0)
        t1 = time.perf_counter()
        tok, sc, par, ent, nbeams = ops.expand(lg[0].float().cpu().numpy(), all_scores[beams], beams, K, d2t,
                                               offset)
        ops_s += time.perf_counter() - t1
        tokens.append(tok), scores.append(sc), parents.append(par), row_entropy.append(ent)
        src.append(n_rows + np.repeat(np.arange(K), K))  # each child's hidden: its parent beam's row
        n_rows += K
        offset += K * K
        beams = nbeams
        level_best.append(int(nbeams[0]))
        if level == base_depth and decide is not None:
            candidate = CandidateTree(np.concatenate(tokens), None, np.concatenate(parents),
                                      np.concatenate(row_entropy), row_of, np.array(level_best), K)
            depth = base_depth + decide(candidate.path_entropy(base_depth))
    if stats is not None:
        stats.draft_s += draft_s
        stats.ops_s += ops_s
    return CandidateTree(np.concatenate(tokens), np.concatenate(scores), np.concatenate(parents),
                         np.concatenate(row_entropy), row_of, np.array(level_best, dtype=np.int64), K)


class HeteroSpec:
    """Speculative decoding of a HuggingFace target with an EAGLE-3 draft (or none: autoregressive).

    ``policy``: a :class:`Policy` (``Policy.static()`` = EAGLE-3, ``Policy.paper(...)`` = HeteroSpec,
    ``Policy.autoregressive()``); with ``draft=None`` decoding is autoregressive whatever the policy."""

    def __init__(self, target, draft=None, policy=None):
        self.draft = draft
        self.policy = policy if policy is not None else (Policy.static() if draft is not None else
                                                         Policy.autoregressive())
        if draft is None:
            self.policy = Policy.autoregressive()
        taps = None
        config = getattr(draft, "config", None)
        if config is not None and hasattr(config, "tap_layers"):
            from ..models.target import _decoder_layers

            taps = config.tap_layers(len(_decoder_layers(target)))
        self.target = TargetAdapter(target, tap_layers=taps, capture_taps=draft is not None)
        self._d2t = None
        if draft is not None:
            d2t = getattr(draft, "d2t", None)
            if d2t is not None and bool(torch.any(d2t != 0)):
                self._d2t = d2t.detach().cpu().numpy().astype(np.int64)

    def close(self):
        """Remove the tap hooks from the target (also done on exit of a ``with`` block)."""
        self.target.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- draft side ----------------------------------------------------------------------------------

    def _draft_tree(self, new_taps, new_ids, root_token, stats):
        """Catch the draft up on the committed positions, then grow this cycle's candidate tree.  Returns
        (tokens, scores, parents) over all candidates (numpy), the number of nodes to keep and the entropy bin
        (None for a policy without bins)."""
        d, pol = self.draft, self.policy
        t0 = time.perf_counter()
        P = self.target.length
        Pd = P - new_ids.shape[1]
        hidden = d.fuse(new_taps)
        positions = torch.arange(Pd, P, device=new_ids.device).view(1, -1)
        logits, h, kv = d(hidden, new_ids, positions, past_kv=self._draft_kv, attn_mask=None)
        self._draft_kv = kv  # the committed prefix: tree rows are appended to copies of it
        stats.draft_s += time.perf_counter() - t0
        plan = {"keep": pol.total_tokens, "bin": None}

        def decide(entropy):
            b, extra, keep = pol.plan(entropy)
            stats.bins[b] += 1
            plan["keep"], plan["bin"] = keep, b
            return extra

        tree = grow_tree(d, kv, logits[0, -1:], h[0, -1:], P, pol.top_k, pol.depth, self._d2t,
                         decide if pol.thresholds else None, stats)
        return tree.tokens, tree.scores, tree.parents, plan["keep"], plan["bin"]

    # ---- the loop -----------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids, *, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, eos_token_id=None,
                 stopping_criteria=None, streamer=None, seed=None):
        """Returns (sequences [1, S + new] int64, GenerationStats).  Greedy when temperature == 0."""
        _check_generate_args(max_new_tokens, temperature, top_k, top_p)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"generate: argument 'input_ids' expected a [1, S] tensor, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        if input_ids.shape[1] < 1:
            raise ValueError("generate: argument 'input_ids' expected at least one token, got 0")
        maxpos = self.target.max_positions
        if maxpos is not None and input_ids.shape[1] + max_new_tokens > maxpos:
            raise ValueError(f"generate: prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) "
                             f"exceed the target's max_position_embeddings ({maxpos})")
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        sample = temperature > 0
        rng_seed = int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        rng_offset = 0
        stats = GenerationStats()
        start = time.perf_counter()
        input_ids = input_ids.to(self.target.device)

        last_logits, taps = self.target.prefill(input_ids)
        stats.prefill_s = time.perf_counter() - start
        root_only = (np.zeros(1, np.int64), np.full(1, -1, np.int64))

        def accept_root(logits_row):
            nonlocal rng_offset
            if not sample:
                return int(torch.argmax(logits_row))
            _, nxt, draws = ops.verify_sample(root_only[0], root_only[1], logits_row.view(1, -1).cpu().numpy(),
                                              temperature=temperature, top_k=top_k, top_p=top_p,
                                              seed=rng_seed, offset=rng_offset)
            rng_offset += draws
            return nxt

        out = input_ids[0].tolist()
        root = accept_root(last_logits)
        generated = [root]
        if streamer is not None:
            streamer.put(input_ids.cpu())
            streamer.put(torch.tensor([root]))
        done = root in eos or len(generated) >= max_new_tokens or self._stop(stopping_criteria, out + generated)
        self._draft_kv = None
        if self.draft is not None and hasattr(self.draft, "begin_sequence"):
            self.draft.begin_sequence(input_ids)
        new_taps = taps
        new_ids = torch.cat([input_ids[:, 1:], torch.tensor([[root]], device=input_ids.device)], dim=1)
        while not done:
            if self.draft is not None and self.policy.drafts:
                tokens, scores, parents, keep, cycle_bin = self._draft_tree(new_taps, new_ids, root, stats)
                t1 = time.perf_counter()
                sel = ops.select(scores, min(keep - 1, scores.shape[0]))
                tree = ops.build_tree(tokens, parents, sel, root)
                stats.ops_s += time.perf_counter() - t1
            else:
                cycle_bin = None
                tree = ops.build_tree(root_only[0][:0], root_only[1][:0], root_only[0][:0], root)
            t0 = time.perf_counter()
            tt, td, tm = (torch.from_numpy(a) for a in (tree.tokens, tree.depths, tree.mask))
            logits, vtaps = self.target.verify(tt, td, tm)
            stats.verify_s += time.perf_counter() - t0
            t1 = time.perf_counter()
            lg = logits.cpu().numpy()
            if sample:
                path, nxt, draws = ops.verify_sample(tree.tokens, tree.parents, lg, temperature=temperature,
                                                     top_k=top_k, top_p=top_p, seed=rng_seed, offset=rng_offset)
                rng_offset += draws
            else:
                path, nxt = ops.verify_greedy(tree.tokens, tree.parents, lg)
            self.target.commit(path)
            stats.ops_s += time.perf_counter() - t1
            stats.cycles += 1
            stats.verified_tokens += int(tree.tokens.shape[0])
            stats.accepted_hist[len(path) - 1] += 1
            if cycle_bin is not None:
                stats.bin_accepted[cycle_bin] += len(path) - 1
            committed = tree.tokens[path[1:]].tolist() + [int(nxt)]
            # truncate at the budget, at EOS, or where a stopping criterion fires
            for i, t in enumerate(committed):
                generated.append(t)
                if streamer is not None:
                    streamer.put(torch.tensor([t]))
                if t in eos or len(generated) >= max_new_tokens or self._stop(stopping_criteria, out + generated):
                    done = True
                    break
            root = int(nxt)
            if self.draft is not None:
                new_taps = vtaps[:, torch.from_numpy(path)]
                new_ids = torch.tensor([committed], device=input_ids.device)
        if streamer is not None:
            streamer.end()
        stats.new_tokens = len(generated)
        stats.total_s = time.perf_counter() - start
        return torch.tensor([out + generated], dtype=torch.long), stats

    @staticmethod
    def _stop(criteria, seq):
        if not criteria:
            return False
        ids = torch.tensor([seq], dtype=torch.long)
        for c in criteria:
            r = c(ids, None)
            if bool(torch.as_tensor(r).any()):
                return True
        return False


# ---- HuggingFace generate() integration ---------------------------------------------------------------

# processors that only warp the distribution the way verify_sample already does (we apply those ourselves);
# anything else changes the distribution per position (penalties, bans, forced tokens, min length...) and
# is refused rather than silently ignored
_WARPERS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
_OWN_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria", "MaxTimeCriteria"}


def custom_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                    draft=None, policy=None, seed=None, streamer=None, **model_kwargs):
    """``model.generate(input_ids, custom_generate=heterospec.custom_generate, draft=..., policy=...)``.

    Needs a transformers release whose ``generate`` accepts a callable ``custom_generate`` (5.x; tested
    with 5.23).  Honours max_new_tokens / max_length, do_sample, temperature, top_k, top_p and the eos ids
    of the generation config; refuses logits processors that would change the distribution per position
    (repetition penalty, bad words, min length, ...) with a ValueError.  Batch 1, no padding.
    Returns the sequences [1, S + new]."""
    gc = generation_config
    extra = [type(p).__name__ for p in (logits_processor or []) if type(p).__name__ not in _WARPERS]
    if extra:
        raise ValueError(
            f"custom_generate: logits processors {extra} would change the target's distribution per position, "
            f"which speculative acceptance cannot reproduce losslessly; remove them from the generation config"
        )
    if input_ids.shape[0] != 1:
        raise ValueError(f"custom_generate: argument 'input_ids' expected batch size 1, got {input_ids.shape[0]}")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("custom_generate: argument 'attention_mask' expected no padding (all ones)")
    if gc.max_new_tokens is not None:
        max_new = gc.max_new_tokens
    else:
        max_new = gc.max_length - input_ids.shape[1]
    sample = bool(gc.do_sample)
    eos = gc.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in torch.as_tensor(eos).view(-1)])
    criteria = [c for c in (stopping_criteria or []) if type(c).__name__ not in _OWN_CRITERIA]
    with HeteroSpec(model, draft, policy) as hs:
        seq, _ = hs.generate(
            input_ids, max_new_tokens=max_new,
            temperature=float(gc.temperature if gc.temperature is not None else 1.0) if sample else 0.0,
            top_k=int(gc.top_k or 0) if sample else 0, top_p=float(gc.top_p if gc.top_p is not None else 1.0) if sample else 1.0,
            eos_token_id=eos, stopping_criteria=criteria, streamer=streamer, seed=seed)
    return seq.to(input_ids.device)
