#!/usr/bin/env python3
"""CPU microbenchmark of ONE speculative-decoding cycle of tree ops (no models).

One cycle = the EAGLE-2/3 dynamic draft tree with depth 7 and top_k 10 (root expand + 7 level expands),
Top-N rerank to 59 drafted nodes (60 verified tokens with the root), verification-tree construction
(tokens, parents, depths, ancestor mask, retrieve rows), greedy verification, sampled verification
(T=1 plain, and T=1 with top_k=50/top_p=0.9) and KV compaction of 30 layers' keys and values.
All logits are fixed random inputs generated once up front (seeded, peaked like real LM outputs), so the
same work is done by every implementation:

  hs/numpy   heterospec.ops (C core) fed NumPy arrays
  hs/torch   heterospec.ops (C core) fed torch CPU tensors (the DLPack path an engine would use)
  numpy      the cycle as vectorised NumPy operations
  torch/1t   the cycle as torch operations written the way the EAGLE reference does it
             (log_softmax + topk per level, Python loops for mask/retrieve, retrieve-indexed logits gather
             for evaluation, Python `random` for sampling, index_select + copy_ per layer), 1 thread
  torch/Nt   the same with torch's default thread count

Semantics: docs/ops.md (heterospec.ops) and docs/design.md ("The cycle"). The torch variant is written
from EAGLE-3's published algorithm (its tree growth, reranking and tree attention), not copied from its repository.

Usage: python benchmarks/bench_cycle.py [--reps N] [--warmup W] [--json out.json] [--quick]
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import random
import sys
import time

import numpy as np
import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.append(_REPO)  # after site-packages: an installed heterospec wins, the source tree is a fallback

# ---------------------------------------------------------------------------------------------------
# Cycle settings (EAGLE-3 defaults with depth 7, see eagle3.md section 7.1)
# ---------------------------------------------------------------------------------------------------
K = 10               # top_k: branching and beam width
DEPTH = 7            # expansion rounds after the root expansion
N_SELECT = 59        # drafted nodes kept (total_token 60 including the root)
T = N_SELECT + 1     # verified tokens (rows of the target logits)
PREFIX = 512         # committed KV length before the cycle
LAYERS = 30          # SmolLM2-1.7B-like depth for the KV compaction
KV_HEADS = 3
HEAD_DIM = 64
S_KV = PREFIX + T    # sequence length of each KV buffer
ROOT_TOKEN = 1234
PLANT_ACCEPT = 5     # drafted tokens the target logits are built to accept greedily
SAMPLE_SEED = 20250522
SAMPLE_VARIANTS = (("T1", dict(temperature=1.0, top_k=0, top_p=1.0)),
                   ("T1_k50_p0.9", dict(temperature=1.0, top_k=50, top_p=0.9)))

CONFIGS = (
    dict(name="V=49152 (SmolLM2, Vd=V, no d2t)", V=49152, Vd=49152, d2t=False),
    dict(name="V=128256 (Llama-3, Vd=32000 + d2t)", V=128256, Vd=32000, d2t=True),
)

STAGES = ("expand_root", "expand_levels", "select", "build_tree", "verify_greedy",
          "verify_sample_T1", "verify_sample_T1_k50_p0.9", "kv_compact")
# sub-stages some implementations also report (already included in their stage above)
SUBSTAGES = ("verify_greedy.gather",)
CYCLE_TOTALS = {
    "cycle_greedy": ("expand_root", "expand_levels", "select", "build_tree", "verify_greedy", "kv_compact"),
    "cycle_sample_T1": ("expand_root", "expand_levels", "select", "build_tree", "verify_sample_T1",
                        "kv_compact"),
    "cycle_sample_T1_k50_p0.9": ("expand_root", "expand_levels", "select", "build_tree",
                                 "verify_sample_T1_k50_p0.9", "kv_compact"),
}

now = time.perf_counter_ns


# ---------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------
def peaked_logits(rng: np.random.Generator, rows: int, V: int) -> np.ndarray:
    """Random float32 logits shaped like an LM's: N(0,1) background plus 16 'hot' tokens per row. The top
    token's margin over the background mass and its gap to the runner-up are random, so the top-1
    probability spreads widely (10th/50th/90th percentile about 0.39/0.66/0.95)."""
    x = rng.standard_normal((rows, V), dtype=np.float32)
    bg = np.log(V * np.exp(0.5))  # log of the background mass (E[exp(N(0,1))] = e^0.5)
    for r in range(rows):
        hot = rng.choice(V, 16, replace=False)
        top = bg + rng.uniform(0.0, 6.0)
        gaps = rng.exponential(0.7, 16)
        gaps[0] = 0.0
        gaps[1] += rng.exponential(2.0)  # gap between the top token and the runner-up
        vals = top - np.cumsum(gaps)
        x[r, hot] = (vals + 0.05 * rng.standard_normal(16)).astype(np.float32)
    return x


def make_inputs(cfg: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    V, Vd = cfg["V"], cfg["Vd"]
    draft = [peaked_logits(rng, 1, Vd)] + [peaked_logits(rng, K, Vd) for _ in range(DEPTH)]
    d2t = None
    if cfg["d2t"]:
        used = np.sort(rng.choice(V, Vd, replace=False))  # eagle3.md 4.1: ascending used ids
        d2t = (used - np.arange(Vd)).astype(np.int64)       # draft id i -> target id i + d2t[i]
    target = peaked_logits(rng, T, V)
    kv = rng.standard_normal((2 * LAYERS, 1, KV_HEADS, S_KV, HEAD_DIM), dtype=np.float32)
    inp = dict(draft=draft, d2t=d2t, target=target, kv=kv, V=V, Vd=Vd)
    # Plant a realistic acceptance: build the tree once (NumPy implementation), then make the target's
    # argmax at the first PLANT_ACCEPT nodes of the top-1 chain equal the drafted child token.
    res = NumpyCycle(inp).run_once_untimed()
    ttok, tpar = res["tree_tokens"], res["tree_parents"]
    node, planted = 0, [0]
    for _ in range(PLANT_ACCEPT):
        ch = np.flatnonzero(tpar == node)
        if ch.size == 0:
            break
        c = int(ch[0])  # lowest node index = the top-1 draft child
        row = target[node]
        row[ttok[c]] = row.max() + 2.0  # strongly preferred (p ~ 0.8-0.95 when sampling)
        node = c
        planted.append(c)
    # make sure the walk stops at `node` (no child token is the argmax there)
    ch_tokens = set(int(t) for t in ttok[np.flatnonzero(tpar == node)])
    while int(np.argmax(target[node])) in ch_tokens:
        target[node, int(np.argmax(target[node]))] -= 5.0
    inp["planted_path"] = planted
    return inp


# ---------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------
def check_sample_path(path, tree_parents, next_token, V):
    path = [int(p) for p in path]
    assert path[0] == 0, path
    for a, b in zip(path, path[1:]):
        assert int(tree_parents[b]) == a, (path, "not a root-to-node chain")
    assert 0 <= int(next_token) < V


def record_phases(rec, t0, t1, t2, t3, t4, t5, t6, t7):
    """The per-op timings of one cycle (t5..t6 is the sampled verification, timed per variant)."""
    rec.update(expand_root=t1 - t0, expand_levels=t2 - t1, select=t3 - t2, build_tree=t4 - t3,
               verify_greedy=t5 - t4, kv_compact=t7 - t6)


class Impl:
    name = "?"
    threads = None  # torch threads to set before running (None: leave as is)

    def run(self, rec: dict) -> dict:
        raise NotImplementedError

    def run_once_untimed(self) -> dict:
        return self.run({})

    @staticmethod
    def timed_samples(sample_fn, rec):
        """Run sample_fn(**kw) for every sampling variant, timing each into rec; returns {variant: result}."""
        samples = {}
        tprev = now()
        for vname, kw in SAMPLE_VARIANTS:
            samples[vname] = sample_fn(**kw)
            tnow = now()
            rec["verify_sample_" + vname] = tnow - tprev
            tprev = tnow
        return samples


# ---------------------------------------------------------------------------------------------------
# (a) heterospec.ops, the C core (also works with heterospec.reference: same API)
# ---------------------------------------------------------------------------------------------------
class HsCycle(Impl):
    def __init__(self, ops, inp, lib="numpy", name=None):
        self.ops = ops
        self.lib = lib
        self.name = name or f"hs/{lib}"
        if lib == "numpy":
            self.draft = inp["draft"]
            self.d2t = inp["d2t"]
            self.target = inp["target"]
            self.kv = list(inp["kv"].copy())  # 60 views of one fresh buffer, each [1, 3, S, 64] contiguous
            self.bs0 = np.zeros(1, np.float32)
            self.bn0 = np.full(1, -1, np.int64)
            self.cat = np.concatenate
        else:
            self.draft = [torch.from_numpy(x) for x in inp["draft"]]
            self.d2t = None if inp["d2t"] is None else torch.from_numpy(inp["d2t"])
            self.target = torch.from_numpy(inp["target"])
            self.kv = list(torch.from_numpy(inp["kv"].copy()).unbind(0))
            self.bs0 = torch.zeros(1, dtype=torch.float32)
            self.bn0 = torch.full((1,), -1, dtype=torch.int64)
            # outputs follow the first array argument (docs/ops.md); heterospec.reference returns NumPy
            self.cat = lambda xs: torch.cat(xs) if isinstance(xs[0], torch.Tensor) else np.concatenate(xs)
        self.offset = 0  # Philox counter offset, advanced by `draws` like an engine would

    def run(self, rec):
        ops, d2t, cat = self.ops, self.d2t, self.cat
        t0 = now()
        tok, sc, par, _ent, nb = ops.expand(self.draft[0], self.bs0, self.bn0, K, d2t=d2t, node_offset=0)
        toks, scs, pars = [tok], [sc], [par]
        prev_sc, prev_off, off = sc, 0, K
        t1 = now()
        for lvl in range(1, DEPTH + 1):
            beam_scores = prev_sc[nb - prev_off]
            tok, sc, par, _ent, nb = ops.expand(self.draft[lvl], beam_scores, nb, K, d2t=d2t,
                                                node_offset=off)
            toks.append(tok)
            scs.append(sc)
            pars.append(par)
            prev_sc, prev_off, off = sc, off, off + K * K
        t2 = now()
        tokens_all, scores_all, parents_all = cat(toks), cat(scs), cat(pars)
        sel = ops.select(scores_all, N_SELECT)
        t3 = now()
        tree = ops.build_tree(tokens_all, parents_all, sel, ROOT_TOKEN)
        t4 = now()
        path, nxt = ops.verify_greedy(tree.tokens, tree.parents, self.target)
        t5 = now()
        def sample(**kw):
            spath, snext, draws = ops.verify_sample(tree.tokens, tree.parents, self.target, seed=SAMPLE_SEED,
                                                    offset=self.offset, **kw)
            self.offset += draws
            return spath, snext

        samples = self.timed_samples(sample, rec)
        t6 = now()
        ops.kv_compact(self.kv, PREFIX, path)
        t7 = now()
        record_phases(rec, t0, t1, t2, t3, t4, t5, t6, t7)
        return dict(tree_tokens=np.asarray(tree.tokens), tree_parents=np.asarray(tree.parents),
                    mask=np.asarray(tree.mask), retrieve=np.asarray(tree.retrieve),
                    depths=np.asarray(tree.depths), path=np.asarray(path), next_token=int(nxt),
                    samples=samples, selected=np.asarray(sel))


# ---------------------------------------------------------------------------------------------------
# (b) vectorised NumPy
# ---------------------------------------------------------------------------------------------------
def np_topk_rows(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, listed by value descending (ties to the lower id)."""
    part = np.argpartition(x, x.shape[-1] - k, axis=-1)[..., -k:]
    vals = np.take_along_axis(x, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    return np.take_along_axis(part, order, axis=-1)


def np_topk_flat(x: np.ndarray, k: int) -> np.ndarray:
    part = np.argpartition(x, x.size - k)[-k:]
    return part[np.lexsort((part, -x[part]))]


class NumpyCycle(Impl):
    name = "numpy"

    def __init__(self, inp):
        self.draft = inp["draft"]
        self.d2t = inp["d2t"]
        self.target = inp["target"]
        self.V = inp["V"]
        self.kv = list(inp["kv"].copy())
        self.rng = np.random.default_rng(SAMPLE_SEED)

    def expand(self, logits, beam_scores, beam_nodes, node_offset):
        m = logits.max(axis=1, keepdims=True)
        s = logits - m
        lse = np.log(np.exp(s).sum(axis=1, keepdims=True))
        lp = s - lse                                            # log_softmax over each row
        ids = np_topk_rows(lp, K)                               # [B, K]
        lp_top = np.take_along_axis(lp, ids, axis=1)
        z = lp_top - lp_top[:, :1]                              # top-k entropy (HeteroSpec's extra output)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        _entropy = -(p * np.log(np.maximum(p, 1e-45))).sum(axis=1)
        scores = (beam_scores[:, None] + lp_top).reshape(-1).astype(np.float32)
        tokens = ids.reshape(-1)
        if self.d2t is not None:
            tokens = tokens + self.d2t[tokens]
        parents = np.repeat(beam_nodes, K)
        next_beams = node_offset + np_topk_flat(scores, K)
        return tokens, scores, parents, next_beams

    def build(self, tokens, parents, sel):
        n = sel.size
        Tn = n + 1
        pos = np.full(tokens.size, -1, np.int64)
        pos[sel] = np.arange(1, Tn)
        psel = parents[sel]
        tpar = np.empty(Tn, np.int64)
        tpar[0] = -1
        tpar[1:] = np.where(psel < 0, 0, pos[np.maximum(psel, 0)])
        ttok = np.empty(Tn, np.int64)
        ttok[0] = ROOT_TOKEN
        ttok[1:] = tokens[sel]
        # depths by pointer jumping (<= D+1 vectorised steps)
        depth = np.zeros(Tn, np.int64)
        anc = tpar.copy()
        while True:
            live = anc >= 0
            if not live.any():
                break
            depth += live
            anc = np.where(live, tpar[np.maximum(anc, 0)], -1)
        D = int(depth.max())
        # ancestor-or-self mask: OR each parent's row into its children's rows, one depth level at a time
        mask = np.eye(Tn, dtype=bool)
        for d in range(1, D + 1):
            rows = np.flatnonzero(depth == d)
            mask[rows] |= mask[tpar[rows]]
        # retrieve: one row per leaf (ascending node index), root -> leaf, padded with -1
        is_par = np.zeros(Tn, bool)
        is_par[tpar[1:]] = True
        leaves = np.flatnonzero(~is_par)
        L = leaves.size
        retrieve = np.full((L, D + 1), -1, np.int64)
        rows = np.arange(L)
        cur = leaves.copy()
        dd = depth[leaves].copy()
        retrieve[rows, dd] = cur
        for _ in range(D):
            live = dd > 0
            cur = np.where(live, tpar[cur], cur)
            dd = np.where(live, dd - 1, dd)
            retrieve[rows[live], dd[live]] = cur[live]
        return ttok, tpar, depth, mask, retrieve

    def warp(self, row, temperature, top_k, top_p):
        z = row.astype(np.float64)
        if temperature != 1.0:
            z /= temperature
        V = z.size
        if (0 < top_k < V) or top_p < 1.0:
            if 0 < top_k < V:
                kth = np.partition(z, V - top_k)[V - top_k]
                idx = np.flatnonzero(z >= kth)
            else:
                idx = np.arange(V)
            zs = z[idx]
            if top_p < 1.0:
                order = np.lexsort((-idx, zs))                  # ascending (z asc, id desc)
                e = np.exp(zs[order] - zs.max())
                c = np.cumsum(e / e.sum())
                keep = c > 1.0 - top_p
                keep[-1] = True
                idx = idx[order[keep]]
                zs = z[idx]
            w = np.zeros(V)
            w[idx] = np.exp(zs - zs.max())
            return w / w.sum()
        w = np.exp(z - z.max())
        return w / w.sum()

    def sample(self, ttok, tpar, temperature, top_k, top_p):
        rng = self.rng
        node, path = 0, [0]
        while True:
            p = self.warp(self.target[node], temperature, top_k, top_p)
            accepted = -1
            for c in np.flatnonzero(tpar == node):              # children, ascending node index
                t = ttok[c]
                if rng.random() <= p[t]:                        # q(x) = 1 proposals
                    accepted = int(c)
                    break
                p[t] = 0.0
                p /= p.sum()
            if accepted < 0:
                break
            node = accepted
            path.append(node)
        # p is the residual after the rejections at the stopping node, or (no rejection there) its fresh
        # warped distribution
        cdf = np.cumsum(p)
        nxt = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        return np.asarray(path, np.int64), min(nxt, p.size - 1)

    def run(self, rec):
        t0 = now()
        tok, sc, par, nb = self.expand(self.draft[0], np.zeros(1, np.float32), np.full(1, -1, np.int64), 0)
        toks, scs, pars = [tok], [sc], [par]
        prev_sc, prev_off, off = sc, 0, K
        t1 = now()
        for lvl in range(1, DEPTH + 1):
            tok, sc, par, nb = self.expand(self.draft[lvl], prev_sc[nb - prev_off], nb, off)
            toks.append(tok)
            scs.append(sc)
            pars.append(par)
            prev_sc, prev_off, off = sc, off, off + K * K
        t2 = now()
        tokens_all, scores_all, parents_all = np.concatenate(toks), np.concatenate(scs), np.concatenate(pars)
        sel = np.sort(np.argpartition(-scores_all, N_SELECT - 1)[:N_SELECT])
        t3 = now()
        ttok, tpar, depth, mask, retrieve = self.build(tokens_all, parents_all, sel)
        t4 = now()
        # greedy (eagle3.md 8.2): candidates vs target argmax along every retrieve path
        am = self.target.argmax(axis=1)
        tok_ext = np.append(ttok, -1)
        am_ext = np.append(am, -2)
        match = tok_ext[retrieve[:, 1:]] == am_ext[retrieve[:, :-1]]
        acc = np.cumprod(match, axis=1).sum(axis=1)
        best = int(np.argmax(acc))
        a = int(acc[best])
        path = retrieve[best, :a + 1]
        nxt = int(am[path[-1]])
        t5 = now()
        samples = self.timed_samples(lambda **kw: self.sample(ttok, tpar, **kw), rec)
        t6 = now()
        src = PREFIX + path
        m = path.size
        for t in self.kv:
            t[..., PREFIX:PREFIX + m, :] = t[..., src, :]
        t7 = now()
        record_phases(rec, t0, t1, t2, t3, t4, t5, t6, t7)
        return dict(tree_tokens=ttok, tree_parents=tpar, mask=mask, retrieve=retrieve, depths=depth,
                    path=path, next_token=nxt, samples=samples, selected=sel)


# ---------------------------------------------------------------------------------------------------
# (c) torch, the way the EAGLE reference does it (written from eagle3.md 7-9)
# ---------------------------------------------------------------------------------------------------
class TorchEagleCycle(Impl):
    def __init__(self, inp, threads, name):
        self.name = name
        self.threads = threads
        self.draft = [torch.from_numpy(x) for x in inp["draft"]]
        self.d2t = None if inp["d2t"] is None else torch.from_numpy(inp["d2t"])
        self.target = torch.from_numpy(inp["target"])
        self.V = inp["V"]
        self.kv = list(torch.from_numpy(inp["kv"].copy()).unbind(0))
        self.root = torch.tensor([ROOT_TOKEN], dtype=torch.long)
        self.pad = torch.tensor([-1], dtype=torch.long)
        self.random = random.Random(SAMPLE_SEED)
        self.gen = torch.Generator().manual_seed(SAMPLE_SEED)

    @staticmethod
    def topk_entropy(top_lp):
        p = torch.softmax(top_lp, dim=-1)
        return -(p * torch.log(p.clamp_min(1e-45))).sum(-1)

    @staticmethod
    def logits_processor(x, temperature, top_k, top_p):
        """HF warpers in the order EAGLE's prepare_logits_processor builds them: temperature (skipped at
        1.0), top-p, top-k. x: [1, V]."""
        if temperature != 1.0:
            x = x / temperature
        if top_p < 1.0:
            sorted_x, sorted_idx = torch.sort(x, descending=False)
            cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
            remove_sorted = cum <= (1 - top_p)
            remove_sorted[..., -1:] = False
            remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
            x = x.masked_fill(remove, -float("inf"))
        if top_k > 0:
            kk = min(top_k, x.size(-1))
            thresh = torch.topk(x, kk)[0][..., -1, None]
            x = x.masked_fill(x < thresh, -float("inf"))
        return x

    def draft_tree(self, rec):
        d2t = self.d2t
        t0 = now()
        # A. root expansion
        lp = torch.log_softmax(self.draft[0], dim=-1)                      # [1, Vd]
        top = torch.topk(lp, K, dim=-1)
        _ent = self.topk_entropy(top.values)
        ids = top.indices[0]
        tok = ids + d2t[ids] if d2t is not None else ids
        scores_list, tokens_list = [top.values[0]], [tok]
        parents_list = [torch.full((K,), -1, dtype=torch.long)]            # record index of the parent
        frontier_scores = top.values[0]
        frontier_rec = torch.arange(K)
        base = K
        t1 = now()
        # B. expansion rounds
        for _ in range(DEPTH):
            lp = torch.log_softmax(self.draft[len(scores_list)], dim=-1)   # [K, Vd]
            top = torch.topk(lp, K, dim=-1)
            _ent = self.topk_entropy(top.values)
            cu = (top.values + frontier_scores[:, None]).view(-1)           # k*k cumulative path scores
            best = torch.topk(cu, K, dim=-1)
            ids = top.indices.view(-1)
            tok = ids + d2t[ids] if d2t is not None else ids
            parents_list.append(frontier_rec.repeat_interleave(K))
            scores_list.append(cu)
            tokens_list.append(tok)
            frontier_scores = best.values
            frontier_rec = best.indices + base
            base += K * K
        t2 = now()
        # C. rerank
        all_scores = torch.cat(scores_list)
        all_tokens = torch.cat(tokens_list)
        all_parents = torch.cat(parents_list)
        chosen = torch.topk(all_scores, N_SELECT, dim=-1).indices
        chosen = torch.sort(chosen).values
        t3 = now()
        # tree: tokens, parent positions (searchsorted), mask (Python loop), retrieve (Python loops)
        draft_tokens = torch.cat([self.root, all_tokens[chosen]])
        par_rec = all_parents[chosen]
        mask_index = torch.searchsorted(chosen, par_rec.clamp_min(0))
        mask_index = torch.where(par_rec < 0, torch.zeros_like(mask_index), mask_index + 1)
        mask_index_list = mask_index.tolist()
        tree_mask = torch.eye(T, dtype=torch.bool)
        tree_mask[:, 0] = True
        for i in range(N_SELECT):
            tree_mask[i + 1] |= tree_mask[mask_index_list[i]]
        position_ids = tree_mask.sum(dim=1) - 1
        max_depth = int(position_ids.max().item()) + 1
        noleaf = set(torch.unique(mask_index).tolist())
        pos_list = position_ids.tolist()
        parent_list = [-1] + mask_index_list
        retrieve_rows = []
        for leaf in range(T):
            if leaf in noleaf:
                continue
            row = [-1] * max_depth
            cur = leaf
            while True:
                row[pos_list[cur]] = cur
                if cur == 0:
                    break
                cur = parent_list[cur]
            retrieve_rows.append(row)
        retrieve = torch.tensor(retrieve_rows, dtype=torch.long)
        tree_parents = torch.tensor(parent_list, dtype=torch.long)
        t4 = now()
        rec["expand_root"] = t1 - t0
        rec["expand_levels"] = t2 - t1
        rec["select"] = t3 - t2
        rec["build_tree"] = t4 - t3
        return draft_tokens, tree_parents, tree_mask, retrieve, position_ids, chosen

    def evaluate_greedy(self, draft_tokens, retrieve, rec):
        g0 = now()
        logits = self.target[retrieve]                                     # [L, D+1, V]; -1 pads -> last row
        rec["verify_greedy.gather"] = now() - g0
        cand = torch.cat([draft_tokens, self.pad])[retrieve]
        match = (cand[:, 1:] == torch.argmax(logits[:, :-1], dim=-1)).int()
        acc = torch.cumprod(match, dim=1).sum(dim=1)
        a = int(acc.max().item())
        best = int(torch.argmax(acc).item()) if a > 0 else 0
        nxt = int(torch.argmax(logits[best, a]).item())
        return retrieve[best, :a + 1], nxt

    def evaluate_sample(self, draft_tokens, retrieve, temperature, top_k, top_p):
        # rows sorted lexicographically with -1 as +inf (what EAGLE does when a logits processor is present)
        big = 1 << 40
        rows = sorted(retrieve.tolist(), key=lambda r: [big if v < 0 else v for v in r])
        retrieve = torch.tensor(rows, dtype=torch.long)
        logits = self.target[retrieve]                                     # [L, D+1, V]
        cand = torch.cat([draft_tokens, self.pad])[retrieve]
        accept_cand = cand[0][:1]
        best = 0
        adjusted = False
        gtp = None
        accepted = True
        for i in range(1, cand.shape[1]):
            if not accepted:
                break
            accepted = False
            adjusted = False
            is_eq = (cand[:, :accept_cand.shape[0]] == accept_cand).all(dim=1)
            fi = int(torch.nonzero(is_eq, as_tuple=True)[0][0])
            gt_logits = self.logits_processor(logits[fi, i - 1][None], temperature, top_k, top_p)[0]
            gtp = torch.softmax(gt_logits, dim=0)
            tried = []
            for j in range(cand.shape[0]):
                if not is_eq[j]:
                    continue
                x = cand[j, i]
                xi = int(x.item())
                if xi < 0 or xi in tried:
                    continue
                tried.append(xi)
                r = self.random.random()
                if r <= gtp[xi].item():
                    accept_cand = torch.cat((accept_cand, x[None]), dim=0)
                    best = j
                    accepted = True
                    break
                gtp[xi] = 0
                gtp = gtp / gtp.sum()
                adjusted = True
        a = accept_cand.shape[0] - 1
        if adjusted and not accepted:
            p = gtp                                                       # residual after the rejections
        else:
            last = logits[best, a][None]
            p = torch.softmax(self.logits_processor(last, temperature, top_k, top_p)[0], dim=0)
        nxt = int(torch.multinomial(p, 1, generator=self.gen).item())
        return retrieve[best, :a + 1], nxt

    def run(self, rec):
        draft_tokens, tree_parents, tree_mask, retrieve, position_ids, chosen = self.draft_tree(rec)
        t4 = now()
        path, nxt = self.evaluate_greedy(draft_tokens, retrieve, rec)
        t5 = now()
        samples = self.timed_samples(lambda **kw: self.evaluate_sample(draft_tokens, retrieve, **kw), rec)
        t6 = now()
        idx = path + PREFIX
        m = idx.shape[0]
        for t in self.kv:                                                  # KVCache.copy per layer
            tgt = t.index_select(2, idx)
            t.narrow(2, PREFIX, m).copy_(tgt)
        t7 = now()
        rec["verify_greedy"] = t5 - t4
        rec["kv_compact"] = t7 - t6
        return dict(tree_tokens=draft_tokens.numpy(), tree_parents=tree_parents.numpy(),
                    mask=tree_mask.numpy(), retrieve=retrieve.numpy(), depths=position_ids.numpy(),
                    path=path.numpy(), next_token=nxt, samples=samples, selected=chosen.numpy())

# ---------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------
def expected_kv(kv: np.ndarray, path: np.ndarray) -> np.ndarray:
    out = kv.copy()
    m = path.size
    out[..., PREFIX:PREFIX + m, :] = kv[..., PREFIX + path, :]
    return out


def check_agreement(impls, inp, log) -> dict:
    """Run every implementation once on fresh state; assert they agree on the greedy result and the KV
    compaction, and compare the trees. Returns a summary."""
    results = {}
    for impl in impls:
        if impl.threads is not None:
            torch.set_num_threads(impl.threads)
        results[impl.name] = impl.run_once_untimed()
    ref_name = impls[0].name
    ref = results[ref_name]
    V = inp["V"]
    summary = dict(tree_identical=True, accept_length=int(ref["path"].size - 1),
                   greedy_path=[int(x) for x in ref["path"]], next_token=ref["next_token"],
                   planted_path=inp["planted_path"], leaves=int(ref["retrieve"].shape[0]),
                   max_depth=int(ref["retrieve"].shape[1] - 1))
    for name, r in results.items():
        # greedy: same accepted tokens and same bonus token
        path_tokens = r["tree_tokens"][r["path"]]
        ref_tokens = ref["tree_tokens"][ref["path"]]
        assert np.array_equal(path_tokens, ref_tokens), (name, path_tokens, ref_tokens)
        assert r["next_token"] == ref["next_token"], (name, r["next_token"], ref["next_token"])
        for key in ("tree_tokens", "tree_parents", "mask", "retrieve", "depths", "selected"):
            if not np.array_equal(np.asarray(r[key]), np.asarray(ref[key])):
                summary["tree_identical"] = False
                log(f"  NOTE: {name} differs from {ref_name} in {key} (greedy result still agrees)")
        if np.array_equal(r["tree_tokens"], ref["tree_tokens"]):
            assert np.array_equal(r["path"], ref["path"]), (name, r["path"], ref["path"])
        for vname, (spath, snext) in r["samples"].items():
            check_sample_path(np.asarray(spath), r["tree_parents"], snext, V)
    # KV: each implementation compacted a fresh copy with its greedy path
    exp = expected_kv(inp["kv"], ref["path"])
    for impl in impls:
        got = np.stack([np.asarray(t) for t in impl.kv]) if not isinstance(impl.kv[0], torch.Tensor) \
            else torch.stack(impl.kv).numpy()
        assert np.array_equal(got, exp), (impl.name, "kv_compact result differs")
    summary["sample_paths"] = {name: {v: [int(x) for x in np.asarray(p)] for v, (p, _) in r["samples"].items()}
                               for name, r in results.items()}
    return summary


def check_against_reference(ops, refmod, inp, log):
    """Exact cross-check of the C core against heterospec.reference on this cycle (same seed/offset)."""
    a = HsCycle(ops, inp, "numpy", name="ops").run_once_untimed()
    b = HsCycle(refmod, inp, "numpy", name="reference").run_once_untimed()
    for key in ("tree_tokens", "tree_parents", "mask", "retrieve", "depths", "path", "selected"):
        assert np.array_equal(a[key], b[key]), ("ops vs reference", key)
    assert a["next_token"] == b["next_token"]
    for v in a["samples"]:
        pa, na = a["samples"][v]
        pb, nb_ = b["samples"][v]
        assert np.array_equal(np.asarray(pa), np.asarray(pb)) and na == nb_, ("ops vs reference sample", v)
    log("  heterospec.ops == heterospec.reference on this cycle (tree, greedy, both sample variants)")


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------
def pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) / 1e3  # ns -> us


def summarise(records):
    out = {}
    keys = list(STAGES) + [k for k in SUBSTAGES if k in records[0]] + list(CYCLE_TOTALS)
    for key in keys:
        if key in CYCLE_TOTALS:
            xs = [sum(r[s] for s in CYCLE_TOTALS[key]) for r in records]
        else:
            xs = [r[key] for r in records]
        out[key] = dict(median_us=pct(xs, 50), p10_us=pct(xs, 10), p90_us=pct(xs, 90))
    return out


def time_impls(impls, reps, warmup, default_threads):
    for _ in range(warmup):
        for impl in impls:
            torch.set_num_threads(impl.threads if impl.threads is not None else default_threads)
            impl.run({})
    records = {impl.name: [] for impl in impls}
    gc.collect()
    gc.disable()
    try:
        n = len(impls)
        for r in range(reps):
            order = impls[r % n:] + impls[:r % n]  # rotate so no implementation always runs first
            for impl in order:
                torch.set_num_threads(impl.threads if impl.threads is not None else default_threads)
                rec = {}
                impl.run(rec)
                records[impl.name].append(rec)
    finally:
        gc.enable()
        torch.set_num_threads(default_threads)
    return {name: summarise(recs) for name, recs in records.items()}


def cpu_ticks():
    """(busy seconds of the whole machine, CPU seconds of this process) or None where /proc is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    t = os.times()
    return (sum(fields[:8]) - idle) / hz, t.user + t.system


def background_load(before, after, wall_s):
    """Average number of cores other processes kept busy between two cpu_ticks() samples."""
    if before is None or after is None or wall_s <= 0:
        return None
    return round(max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s, 2)


# ---------------------------------------------------------------------------------------------------
# Machine info and output
# ---------------------------------------------------------------------------------------------------
def machine_info(ops_mod) -> dict:
    """heterospec's own machine description (heterospec.measure.machine_info), plus the CPUs this process may
    use and which ops module was timed."""
    from heterospec.measure import machine_info as heterospec_machine

    info = heterospec_machine()
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["cpus_usable"] = None
    info["ops_module"] = getattr(ops_mod, "__name__", None)
    return info


IMPL_LABELS = {
    "hs/numpy": "heterospec.ops (C), NumPy in",
    "hs/torch": "heterospec.ops (C), torch in",
    "numpy": "NumPy vectorised",
    "torch/1t": "torch EAGLE-style, 1 thread",
}


def fmt(x):
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def markdown(results, info, settings) -> str:
    lines = []
    lines.append("## Machine")
    lines.append("")
    for k, v in info.items():
        lines.append(f"- {k}: {v}")
    lines.append("")
    lines.append("## Settings")
    lines.append("")
    for k, v in settings.items():
        lines.append(f"- {k}: {v}")
    for cfg_name, res in results.items():
        timing = res["timing"]
        names = list(timing)
        lines.append("")
        lines.append(f"## {cfg_name}")
        lines.append("")
        chk = res["check"]
        lines.append(f"Tree: {T} nodes, {chk['leaves']} leaves, max depth {chk['max_depth']}; greedy accept "
                     f"length {chk['accept_length']} (path {chk['greedy_path']}), next token "
                     f"{chk['next_token']}; trees identical across implementations: {chk['tree_identical']}. "
                     f"Background load while timing (cores busy with other processes): "
                     f"{res.get('background_cores')}.")
        lines.append("")
        lines.append("Whole cycle, microseconds per cycle: median [p10, p90]")
        lines.append("")
        base_name = "hs/numpy" if "hs/numpy" in timing else names[0]
        lines.append("| implementation | greedy cycle | sample cycle T=1 | sample cycle T=1 top-k 50 top-p 0.9 |"
                     f" greedy vs {base_name} |")
        lines.append("|---|---:|---:|---:|---:|")
        base = timing[base_name]["cycle_greedy"]["median_us"]
        for n in names:
            t = timing[n]
            cells = []
            for key in CYCLE_TOTALS:
                s = t[key]
                cells.append(f"{fmt(s['median_us'])} [{fmt(s['p10_us'])}, {fmt(s['p90_us'])}]")
            ratio = t["cycle_greedy"]["median_us"] / base
            lines.append(f"| {res['labels'][n]} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
        lines.append("")
        lines.append("Per-op breakdown, median microseconds")
        lines.append("")
        lines.append("| op | " + " | ".join(names) + " |")
        lines.append("|---|" + "---:|" * len(names))
        for st in STAGES + SUBSTAGES:
            cells = [fmt(timing[n][st]["median_us"]) if st in timing[n] else "-" for n in names]
            if st in SUBSTAGES and all(c == "-" for c in cells):
                continue
            label = st if st in STAGES else f"(of which {st.split('.', 1)[1]})"
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per implementation "
                    "(default 100, --quick: 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed warm-up cycles (default 3, --quick: 1)")
    ap.add_argument("--json", default=None, help="write all numbers to this JSON file")
    ap.add_argument("--quick", action="store_true", help="smoke run: few repetitions")
    ap.add_argument("--ops-module", default="heterospec.ops",
                    help="module providing the ops API for implementation (a) (default heterospec.ops; "
                         "heterospec.reference also works)")
    ap.add_argument("--vocab", choices=("all", "49152", "128256"), default="all")
    ap.add_argument("--no-torch-default-threads", action="store_true",
                    help="skip the torch row with the default thread count")
    args = ap.parse_args(argv)
    reps = args.reps if args.reps is not None else (3 if args.quick else 100)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    try:
        ops = importlib.import_module(args.ops_module)
    except Exception as e:
        log(f"cannot import {args.ops_module}: {e!r}; implementation (a) is skipped")
        ops = None
    try:
        refmod = importlib.import_module("heterospec.reference")
    except Exception:
        refmod = None
    default_threads = torch.get_num_threads()
    info = machine_info(ops)
    settings = dict(top_k=K, depth=DEPTH, total_token=T, drafted=N_SELECT, candidates=K + DEPTH * K * K,
                    kv=f"{2 * LAYERS} tensors [1, {KV_HEADS}, {S_KV}, {HEAD_DIM}] float32, prefix {PREFIX}",
                    logits="float32", reps=reps, warmup=warmup,
                    sample_variants=", ".join(f"{n}={kw}" for n, kw in SAMPLE_VARIANTS),
                    timer="time.perf_counter_ns around each op, implementations interleaved per rep, gc off")
    results = {}
    t_start = time.time()
    for cfg in CONFIGS:
        if args.vocab != "all" and str(cfg["V"]) != args.vocab:
            continue
        log(f"[{cfg['name']}] generating inputs ...")
        inp = make_inputs(cfg)

        def build_impls(inp=inp):  # bind this iteration's inputs
            impls = []
            if ops is not None:
                impls.append(HsCycle(ops, inp, "numpy"))
                impls.append(HsCycle(ops, inp, "torch"))
            impls.append(NumpyCycle(inp))
            impls.append(TorchEagleCycle(inp, 1, "torch/1t"))
            if not args.no_torch_default_threads and default_threads != 1:
                impls.append(TorchEagleCycle(inp, default_threads, f"torch/{default_threads}t"))
            return impls

        log(f"[{cfg['name']}] checking that the implementations agree ...")
        check = check_agreement(build_impls(), inp, log)
        log(f"  agree: greedy accept length {check['accept_length']}, next token {check['next_token']}, "
            f"trees identical: {check['tree_identical']}")
        if ops is not None and refmod is not None and ops is not refmod:
            check_against_reference(ops, refmod, inp, log)
        impls = build_impls()  # fresh state for timing
        labels = {impl.name: IMPL_LABELS.get(impl.name, impl.name if not impl.name.startswith("torch/")
                                             else f"torch EAGLE-style, {impl.threads} threads (default)")
                  for impl in impls}
        log(f"[{cfg['name']}] timing {len(impls)} implementations x {reps} reps (+{warmup} warm-up) ...")
        c0, w0 = cpu_ticks(), time.time()
        timing = time_impls(impls, reps, warmup, default_threads)
        bg = background_load(c0, cpu_ticks(), time.time() - w0)
        if bg is not None and bg > 0.1:
            log(f"  WARNING: other processes kept {bg} cores busy on average while timing; numbers are noisy")
        results[cfg["name"]] = dict(check=check, timing=timing, labels=labels, background_cores=bg,
                                    config={k: v for k, v in cfg.items()})
        del impls, inp
        gc.collect()
    settings["wall_seconds"] = round(time.time() - t_start, 1)
    md = markdown(results, info, settings)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, settings=settings, results=results), f, indent=1, default=str)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
