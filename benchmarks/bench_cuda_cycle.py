"""One speculative-decoding cycle's glue on a GPU: heterospec's CUDA ops against the same cycle in torch ops.

The cycle (issue 7's shape, EAGLE-3 defaults on a Llama-3-8B-sized pair):
  root expand (1 x Vd) and 7 level expands (10 beams x Vd, k = 10, Vd = 32000, with a d2t map),
  select 59 of the 710 candidates, build_tree, verify_greedy and verify_sample over the 60 tree rows of
  V = 128256 bfloat16 target logits, kv_compact of 32 layers' keys and values [1, 8, 2048, 128] bf16.
Draft/target logits are random but fixed (the target is planted to accept up to 4 tokens along the
deepest path); only the glue is timed, never a model.  Before timing, the torch and ops variants must build
the same tree and accept the same length (cross_check; tests/scripts/test_bench_cuda_cycle.py runs it on the CPU).

Variants, all timed with CUDA events after warm-up, median (and p10/p90) of --iters runs:
  torch     the cycle as the EAGLE reference code writes it (log_softmax + topk per level, cumulative
            scores, topk over the level, searchsorted/.tolist() to build the mask and retrieve paths on the
            host, argmax + cumprod acceptance, index_select + copy_ per layer of the KV cache; sampling by
            softmax + torch.multinomial per node);
  ops       heterospec.ops called eagerly from Python (check=False, device_outputs=True: no host sync);
  ops-graph the same calls captured once in a CUDA graph and replayed.

    python -m benchmarks.bench_cuda_cycle [--iters 200] [--out benchmarks/results/cuda-cycle.json] [--per-op]

With --per-op (issue 17) it also times every op of the cycle on its own, on the cycle's own inputs:
topk_entropy (the 10 x Vd level logits), expand of the root (1 x Vd) and of a level (10 x Vd), select,
build_tree, verify_greedy, verify_sample, and kv_compact of the accepted rows with one stacked
[64, 1, 8, 2048, 128] tensor (through ops.KVTensors) and with the list of the 64 per-layer tensors.  For
each: eager median and p10/p90 us (check=False, device_outputs=True where the op has it), the median us
of the op replayed alone in a CUDA graph, the bytes it must move at minimum (per_op_bytes: an explicit
formula from the shapes and dtypes), the achieved bandwidth bytes / graph time, the floor
max(bytes / copy bandwidth, 5 us) and graph time / floor.  The copy bandwidth is measured here: a 1 GiB
device-to-device torch copy timed with CUDA events, counted as read + write (2 GiB moved).  The table goes
to the JSON under "per_op" and is printed as markdown with the device name.

Needs a CUDA GPU and a heterospec build with CUDA (heterospec.build_info()["cuda"]).
"""
import argparse
import json
import os
import platform
import statistics


KV_HEADS, HEAD_DIM = 8, 128  # the KV tensors are [1, KV_HEADS, S, HEAD_DIM] bf16
MIN_FLOOR_US = 5.0  # no op is expected to beat a few kernel launches' worth of time, whatever it moves


def make_inputs(torch, dev, Vd=32000, V=128256, k=10, depth=7, n=59, layers=32, S=2048, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    draft = [torch.randn(1 if lvl == 0 else k, Vd, generator=g).mul_(3).to(dev) for lvl in range(depth + 1)]
    target = torch.randn(n + 1, V, generator=g).mul_(3).to(dev, torch.bfloat16)
    d2t = torch.randint(0, 4, (Vd,), generator=g).cumsum(0).to(dev)
    kv = [torch.randn(1, KV_HEADS, S, HEAD_DIM, generator=g).to(dev, torch.bfloat16) for _ in range(2 * layers)]
    return dict(draft=draft, target=target, d2t=d2t, kv=kv, k=k, n=n, prefix=S * 3 // 4)


def make_state(torch, dev):
    return dict(s0=torch.zeros(1, device=dev), n0=torch.full((1,), -1, dtype=torch.long, device=dev),
                offset=torch.zeros(1, dtype=torch.long, device=dev),
                slots=torch.tensor([0, 3, 9, 27, 44], device=dev))


def cycle_ops(ops, torch, x, state):
    """The cycle on heterospec.ops (no host sync anywhere on a GPU).  Returns what cross_check compares."""
    k = x["k"]
    toks, scs, pars = [], [], []
    scores, nodes = state["s0"], state["n0"]
    offset = 0
    for logits in x["draft"]:
        t, s, p, ent, nb = ops.expand(logits, scores, nodes, k, x["d2t"], offset, check=False)
        toks.append(t), scs.append(s), pars.append(p)
        scores, nodes = s[nb - offset], nb
        offset += t.shape[0]
    tokens, all_scores, parents = torch.cat(toks), torch.cat(scs), torch.cat(pars)
    chosen = ops.select(all_scores, x["n"], check=False)
    tree, leaves, _ = ops.build_tree(tokens, parents, chosen, 1, check=False, device_outputs=True)
    path, length, nxt = ops.verify_greedy(tree.tokens, tree.parents, x["target"], check=False, device_outputs=True)
    on_gpu = state["offset"].is_cuda  # a device offset (advanced by the kernel) exists on CUDA only
    ops.verify_sample(tree.tokens, tree.parents, x["target"], temperature=1.0, top_p=0.9, seed=1,
                      offset=state["offset"] if on_gpu else 0, check=False, device_outputs=True,
                      advance_offset=on_gpu)
    ops.kv_compact(x["kv"], x["prefix"], state["slots"], check=False)
    return dict(tokens=tree.tokens, parents=tree.parents, retrieve=tree.retrieve, leaves=leaves, length=length)


def cycle_torch(torch, x):
    """The same cycle the way EAGLE's reference writes it in torch (shared/reference/eagle3.md section 7):
    log-softmax + top-k per level, cumulative scores, top-k over each level's k*k children for the next
    frontier, top-n + sort over all k + depth*k*k candidates, parents by searchsorted, the mask and the
    retrieve rows built on the host from .tolist(), greedy acceptance by argmax + cumprod, one softmax +
    multinomial for the sampled path, and index_select + copy_ per KV tensor."""
    k, n = x["k"], x["n"]
    d2t = x["d2t"]
    ss_token, scores_list, parents_list = [], [], []
    scores = frontier = None
    flat = 0  # flat index of this level's first candidate among all candidates
    for logits in x["draft"]:
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(lp, k, dim=-1)
        probs = torch.softmax(top.values, -1)
        (-(probs * probs.log()).sum(-1))  # the top-k entropy HeteroSpec reads
        ids = top.indices.view(-1)
        ss_token.append(ids + d2t[ids])
        if scores is None:  # root expansion
            scores = top.values[0]
            scores_list.append(scores)
            parents_list.append(torch.zeros(1, dtype=torch.long, device=lp.device))
            frontier = torch.arange(k, device=lp.device)
            flat += k
            continue
        parents_list.append(frontier + 1)  # flat index (+1) of each expanded frontier node
        cu = top.values + scores[:, None]
        scores_list.append(cu.view(-1))
        best = torch.topk(cu.view(-1), k)
        scores, frontier = best.values, best.indices + flat
        flat += k * k
    scores_all = torch.cat(scores_list)
    tokens_all = torch.cat(ss_token)
    idx = torch.sort(torch.topk(scores_all, n).indices).values
    draft_tokens = torch.cat((torch.ones(1, dtype=tokens_all.dtype, device=idx.device), tokens_all[idx]))
    draft_parents = torch.cat(parents_list)[idx // k]
    mask_index = torch.searchsorted(idx, draft_parents - 1, right=False)
    mask_index[draft_parents == 0] = -1
    mask_index = mask_index + 1
    mask_list = mask_index.tolist()  # EAGLE builds the mask on the host
    tree_mask = torch.eye(n + 1, n + 1, dtype=torch.bool)
    tree_mask[:, 0] = True
    for i in range(n):
        tree_mask[i + 1].add_(tree_mask[mask_list[i]])
    depth = tree_mask.sum(1) - 1
    leaves = sorted(set(range(n + 1)) - set(mask_list))
    retrieve = []
    for leaf in leaves:  # host loop over leaves, as EAGLE's retrieve_indices
        row, cur = [], leaf
        while cur != 0:
            row.append(cur)
            cur = mask_list[cur - 1]
        retrieve.append([0] + row[::-1])
    width = max(len(r) for r in retrieve)
    ret = torch.tensor([r + [-1] * (width - len(r)) for r in retrieve], device=idx.device)
    tree_mask = tree_mask.to(idx.device)
    depth = depth.to(idx.device)
    # greedy acceptance (evaluate_posterior)
    logits = x["target"]
    cand = draft_tokens[ret.clamp(min=0)]
    post = (cand[:, 1:] == torch.argmax(logits[ret.clamp(min=0)][:, :-1], dim=-1)) & (ret[:, 1:] >= 0)
    acc = torch.cumprod(post.int(), dim=1).sum(dim=1)
    best = torch.argmax(acc)
    accept = int(acc[best])
    # sampled acceptance: EAGLE's per-node softmax + rejection in Python (the root only is enough to show
    # its cost: one softmax over V and one multinomial per visited node)
    p = torch.softmax(logits[0].float(), -1)
    torch.multinomial(p, 1)
    # KV compaction: index_select + copy_ per layer tensor
    sel = ret[best, : accept + 1].clamp(min=0) + x["prefix"]
    for t in x["kv"]:
        t[:, :, x["prefix"] : x["prefix"] + sel.shape[0]].copy_(t.index_select(2, sel))
    return dict(tokens=draft_tokens, parents=torch.tensor([-1] + mask_list), retrieve=ret, leaves=len(leaves),
                accept=accept)


def plant_accepts(ops, torch, x, state, accept=4):
    """Make the target accept `accept` tokens (random logits accept nothing): along the path from the root
    to the deepest node (the lowest-numbered one), raise each node's target logit of the next node's token
    above every other.  Returns how many were planted (fewer if the tree is shallower)."""
    t = cycle_ops(ops, torch, dict(x, kv=[]), state)
    parents = torch.as_tensor(t["parents"]).cpu().tolist()
    tokens = torch.as_tensor(t["tokens"]).cpu().tolist()
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    path = [depth.index(max(depth))]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    path = path[::-1][: accept + 1]
    for node, nxt in zip(path, path[1:]):
        x["target"][node, tokens[nxt]] = 100.0
    return len(path) - 1


def cross_check(ops, torch, x, state):
    """Both variants must build the same tree and accept the same length; returns the tree's (leaves, accept).
    KV tensors are copied first (both variants compact them in place)."""
    kv = x["kv"]
    x = dict(x, kv=[t.clone() for t in kv])
    a = cycle_ops(ops, torch, x, state)
    ops.cuda_check(x["target"].device) if x["target"].is_cuda else None
    b = cycle_torch(torch, x)
    ta = torch.as_tensor(a["tokens"]).cpu()
    pa = torch.as_tensor(a["parents"]).cpu()
    L = int(torch.as_tensor(a["leaves"]))
    ra = torch.as_tensor(a["retrieve"]).cpu()[:L, : b["retrieve"].shape[1]]
    problems = []
    if not torch.equal(ta, b["tokens"].cpu()):
        problems.append("tree tokens differ")
    if not torch.equal(pa, b["parents"].cpu()):
        problems.append("tree parents differ")
    if L != b["leaves"] or not torch.equal(ra, b["retrieve"].cpu()):
        problems.append(f"retrieve rows differ (leaves {L} vs {b['leaves']})")
    accept = int(torch.as_tensor(a["length"])) - 1
    if accept != b["accept"]:
        problems.append(f"accepted length differs ({accept} vs {b['accept']})")
    if problems:
        raise AssertionError("the torch baseline and heterospec.ops disagree: " + "; ".join(problems))
    return L, b["accept"]


def timeit(torch, fn, iters, warmup=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)  # us
    times.sort()
    return dict(median_us=statistics.median(times), p10_us=times[len(times) // 10], p90_us=times[9 * len(times) // 10])


# --- --per-op (issue 17): every op of the cycle alone --------------------------------------------------------
# The pure functions (per_op_bytes, per_op_shape, floor_us, per_op_rows, per_op_markdown) take shapes and
# timings only, so tests/scripts/test_bench_cuda_cycle.py checks them on the CPU.

PER_OPS = ("topk_entropy", "expand root", "expand level", "select", "build_tree", "verify_greedy", "verify_sample",
           "verify_sample min-p", "kv_compact stacked", "kv_compact list")

PER_OP_FORMULAS = {  # what per_op_bytes counts, in words (T = n + 1 tree nodes, M = k + depth*k*k candidates)
    "topk_entropy": "logits[k, Vd] fp32 read + entropy fp32[k] written",
    "expand root": "B=1: logits[B, Vd] fp32 + beam scores fp32[B] + beam nodes int64[B] + d2t int64 at the B*k "
                   "chosen ids read; tokens, parents int64[B*k] + scores fp32[B*k] + entropy fp32[B] + "
                   "next beams int64[k] written",
    "expand level": "as expand root with B=k",
    "select": "scores fp32[M] read + int64[n] written",
    "build_tree": "selected, and the tokens and parents of the selected, int64[n] each read; tokens, parents, "
                  "depths int64[T] + mask bool[T, T] + retrieve int64[T, T] + 2 int64 counts written",
    "verify_greedy": "target logits[T, V] (2 bytes for bf16) + tree tokens, parents int64[T] read; path int64[T] "
                     "+ length, next token int64 written",
    "verify_sample": "as verify_greedy + the Philox offset int64 read and written + draws int64 written",
    "verify_sample min-p": "as verify_sample (top-p 0.9, then min-p 0.05: each row's kept mass summed again, a "
                           "second read of the logits that the floor does not count)",
    "kv_compact stacked": "rows that move (slots[i] != i) x 2*layers tensors x heads x head_dim x 2 bytes, read "
                          "and written + slots int64 read",
    "kv_compact list": "as kv_compact stacked",
}


def per_op_bytes(Vd=32000, V=128256, k=10, depth=7, n=59, layers=32, heads=KV_HEADS, head_dim=HEAD_DIM,
                 moved_rows=4, slots=5, logit_bytes=2, kv_bytes=2):
    """The bytes each op of the cycle must move at minimum (reads + writes of its inputs and outputs), from
    the shapes and dtypes of bench's cycle (PER_OP_FORMULAS says it in words).  Defaults: issue 7's shape
    and make_state's slots [0, 3, 9, 27, 44] (5 slots, 4 rows that move; the root's row stays)."""
    def expand(B):
        return (B * Vd * 4  # logits[B, Vd] fp32 read
                + B * (4 + 8)  # beam scores fp32[B], beam nodes int64[B] read
                + B * k * 8  # d2t int64 read at the B*k chosen ids
                + B * k * (8 + 4 + 8)  # tokens int64, scores fp32, parents int64 [B*k] written
                + B * 4 + k * 8)  # entropy fp32[B], next beams int64[k] written

    M = k + depth * k * k  # the candidates: k from the root, k*k from each of depth levels
    T = n + 1  # tree nodes: the root and the n selected; the target logits have T rows
    logits = T * V * logit_bytes
    kv = 2 * moved_rows * (2 * layers) * heads * head_dim * kv_bytes + slots * 8
    return {
        "topk_entropy": k * Vd * 4 + k * 4,
        "expand root": expand(1),
        "expand level": expand(k),
        "select": M * 4 + n * 8,
        "build_tree": 3 * n * 8 + 3 * T * 8 + T * T + T * T * 8 + 2 * 8,
        "verify_greedy": logits + 2 * T * 8 + T * 8 + 2 * 8,
        "verify_sample": logits + 2 * T * 8 + 8 + T * 8 + 3 * 8 + 8,
        "verify_sample min-p": logits + 2 * T * 8 + 8 + T * 8 + 3 * 8 + 8,
        "kv_compact stacked": kv,
        "kv_compact list": kv,
    }


def per_op_shape(x, slots):
    """per_op_bytes' keyword arguments for make_inputs' x and the kv_compact slots (a list of ints)."""
    kv = x["kv"][0]
    return dict(Vd=x["draft"][0].shape[1], V=x["target"].shape[1], k=x["k"], depth=len(x["draft"]) - 1, n=x["n"],
                layers=len(x["kv"]) // 2, heads=kv.shape[1], head_dim=kv.shape[-1],
                moved_rows=sum(1 for i, s in enumerate(slots) if s != i), slots=len(slots),
                logit_bytes=x["target"].element_size(), kv_bytes=kv.element_size())


def floor_us(nbytes, copy_GBs, min_us=MIN_FLOOR_US):
    """The time an op moving nbytes cannot beat: max(nbytes / copy bandwidth, min_us), in microseconds."""
    return max(nbytes / (copy_GBs * 1e3), min_us)  # bytes / (GB/s * 1e9) s = bytes / (GB/s * 1e3) us


def per_op_rows(nbytes, timings, copy_GBs, min_us=MIN_FLOOR_US):
    """One row per op of nbytes (per_op_bytes' order): timings[op] = {"eager": timeit(...), "graph":
    timeit(...)}; achieved bandwidth = bytes / graph median, ratio = graph median / floor."""
    rows = []
    for op, b in nbytes.items():
        e, g = timings[op]["eager"], timings[op]["graph"]["median_us"]
        floor = floor_us(b, copy_GBs, min_us)
        rows.append(dict(op=op, bytes=b, eager_median_us=e["median_us"], eager_p10_us=e["p10_us"],
                         eager_p90_us=e["p90_us"], graph_median_us=g, achieved_GBs=b / (g * 1e3), floor_us=floor,
                         graph_over_floor=g / floor))
    return rows


def per_op_markdown(rows, device, copy_GBs, iters, min_us=MIN_FLOOR_US):
    """The per-op table as markdown: a line naming the device and the copy bandwidth, then one row per op."""
    lines = [f"Per-op on {device}: CUDA events, {iters} runs after warm-up; copy bandwidth {copy_GBs:.0f} GB/s "
             f"(1 GiB device-to-device copy, read + write); floor = max(bytes / copy bandwidth, {min_us:g} us)",
             "",
             "| op | bytes | eager median us | eager p10 | eager p90 | graph us | achieved GB/s | floor us "
             "| graph / floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['bytes']} | {r['eager_median_us']:.1f} | {r['eager_p10_us']:.1f} | "
                     f"{r['eager_p90_us']:.1f} | {r['graph_median_us']:.1f} | {r['achieved_GBs']:.1f} | "
                     f"{r['floor_us']:.1f} | {r['graph_over_floor']:.2f} |")
    return "\n".join(lines)


def per_op_calls(ops, torch, x, state, kv_stacked):
    """Each op of cycle_ops as a zero-argument call on the cycle's own inputs (the intermediates are computed
    once here, eagerly), keyed as PER_OPS.  kv_stacked: one [2*layers, ...] tensor, compacted through a
    KVTensors; "kv_compact list" compacts the list x["kv"] as the cycle does."""
    k, n, d2t, target = x["k"], x["n"], x["d2t"], x["target"]
    toks, scs, pars, beams = [], [], [], []
    scores, nodes = state["s0"], state["n0"]
    offset = 0
    for logits in x["draft"]:
        beams.append((scores, nodes, offset))
        t, s, p, _, nb = ops.expand(logits, scores, nodes, k, d2t, offset, check=False)
        toks.append(t), scs.append(s), pars.append(p)
        scores, nodes = s[nb - offset], nb
        offset += t.shape[0]
    tokens, all_scores, parents = torch.cat(toks), torch.cat(scs), torch.cat(pars)
    chosen = ops.select(all_scores, n, check=False)
    tree, _, _ = ops.build_tree(tokens, parents, chosen, 1, check=False, device_outputs=True)
    on_gpu = state["offset"].is_cuda
    kvt = ops.KVTensors([kv_stacked])
    root, level = x["draft"][0], x["draft"][1]
    s1, n1, o1 = beams[1]
    calls = {
        "topk_entropy": lambda: ops.topk_entropy(level, k, check=False),
        "expand root": lambda: ops.expand(root, state["s0"], state["n0"], k, d2t, 0, check=False),
        "expand level": lambda: ops.expand(level, s1, n1, k, d2t, o1, check=False),
        "select": lambda: ops.select(all_scores, n, check=False),
        "build_tree": lambda: ops.build_tree(tokens, parents, chosen, 1, check=False, device_outputs=True),
        "verify_greedy": lambda: ops.verify_greedy(tree.tokens, tree.parents, target, check=False,
                                                   device_outputs=True),
        "verify_sample": lambda: ops.verify_sample(
            tree.tokens, tree.parents, target, temperature=1.0, top_p=0.9, seed=1,
            offset=state["offset"] if on_gpu else 0, check=False, device_outputs=True, advance_offset=on_gpu),
        "verify_sample min-p": lambda: ops.verify_sample(
            tree.tokens, tree.parents, target, temperature=1.0, top_p=0.9, min_p=0.05, seed=1,
            offset=state["offset"] if on_gpu else 0, check=False, device_outputs=True, advance_offset=on_gpu),
        "kv_compact stacked": lambda: ops.kv_compact(kvt, x["prefix"], state["slots"], check=False),
        "kv_compact list": lambda: ops.kv_compact(x["kv"], x["prefix"], state["slots"], check=False),
    }
    assert tuple(calls) == PER_OPS
    return calls


def capture(torch, fn):
    """fn captured alone in a CUDA graph (run once first on the capture stream: the ops grow their scratch
    outside capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph


def copy_bandwidth(torch, dev, nbytes=1 << 30, iters=20):
    """The device's copy bandwidth: a device-to-device copy of nbytes timed with CUDA events (median of
    iters), counted as 2 * nbytes moved (read + write)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timeit(torch, lambda d=dst, s=src: d.copy_(s), iters, warmup=3)
    del src, dst
    torch.cuda.empty_cache()
    return dict(copy_bytes=nbytes, moved_bytes=2 * nbytes, median_us=t["median_us"],
                GBs=2 * nbytes / (t["median_us"] * 1e3))


def run_per_op(ops, torch, x, state, dev, iters):
    """--per-op on the GPU: copy bandwidth, then every op eager and replayed alone in a CUDA graph."""
    bw = copy_bandwidth(torch, dev)
    slots = state["slots"].tolist()
    nbytes = per_op_bytes(**per_op_shape(x, slots))
    kv_stacked = torch.stack(x["kv"])
    calls = per_op_calls(ops, torch, x, state, kv_stacked)
    ops.cuda_check(dev)
    timings = {}
    for op, fn in calls.items():
        eager = timeit(torch, fn, iters)
        ops.cuda_check(dev)
        graph = capture(torch, fn)
        timings[op] = dict(eager=eager, graph=timeit(torch, graph.replay, iters))
        ops.cuda_check(dev)
        del graph
    rows = per_op_rows(nbytes, timings, bw["GBs"])
    return dict(copy_bandwidth=bw, floor_min_us=MIN_FLOOR_US, shape=dict(per_op_shape(x, slots), slots=slots),
                formulas=PER_OP_FORMULAS, rows=rows, timings=timings)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "cuda-cycle.json"))
    ap.add_argument("--vocab", type=int, default=128256,
                    help="the target's vocabulary V (128,256: Llama 3; 49,152: the default pair's SmolLM2)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the draft's vocabulary Vd (default 32,000, or 8,192 with --vocab 49152: the default head's)")
    ap.add_argument("--per-op", action="store_true",
                    help="also time every op of the cycle alone, eager and in a CUDA graph, against its bytes floor")
    args = ap.parse_args(argv)
    import torch

    import heterospec
    from heterospec import ops

    info = heterospec.build_info()
    if not torch.cuda.is_available() or not info["cuda"] or info.get("cuda_emulated"):
        raise SystemExit(f"needs a CUDA GPU and a CUDA build of heterospec (build_info: {info})")
    dev = torch.device("cuda")
    Vd = args.draft_vocab or (8192 if args.vocab == 49152 else 32000)
    if not 1 <= Vd <= args.vocab:
        raise SystemExit(f"--draft-vocab: expected 1 <= Vd <= --vocab ({args.vocab}), got {Vd}")
    x = make_inputs(torch, dev, Vd=Vd, V=args.vocab)
    state = make_state(torch, dev)
    planted = plant_accepts(ops, torch, x, state)
    leaves, accept = cross_check(ops, torch, x, state)
    if accept != planted:
        raise SystemExit(f"cross-check: expected {planted} accepted tokens, got {accept}")
    print(f"cross-check: torch and heterospec.ops build the same {x['n'] + 1}-node tree ({leaves} leaves), "
          f"accept {accept}")
    results = {}
    results["torch"] = timeit(torch, lambda: cycle_torch(torch, x), args.iters)
    results["ops"] = timeit(torch, lambda: cycle_ops(ops, torch, x, state), args.iters)
    ops.cuda_check(dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cycle_ops(ops, torch, x, state)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            cycle_ops(ops, torch, x, state)
    results["ops-graph"] = timeit(torch, graph.replay, args.iters)
    ops.cuda_check(dev)
    for name, r in results.items():
        r["speedup_vs_torch"] = results["torch"]["median_us"] / r["median_us"]
    out = dict(
        device=torch.cuda.get_device_name(dev), torch=torch.__version__, cuda=torch.version.cuda,
        heterospec=info, host=platform.node(), iters=args.iters, cross_check=dict(leaves=leaves, accept=accept),
        shape=dict(Vd=Vd, k=10, depth=7, n=59, V=args.vocab, target_dtype="bfloat16", kv="32 x 2 x [1,8,2048,128] bf16"),
        results=results,
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"{out['device']}, torch {out['torch']}, CUDA {out['cuda']}, {args.iters} iterations after warm-up")
    print("| variant | median us | p10 | p90 | vs torch |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['median_us']:.1f} | {r['p10_us']:.1f} | {r['p90_us']:.1f} | {r['speedup_vs_torch']:.1f}x |")
    if args.per_op:  # after the cycle's JSON is written, so a failure here cannot lose it
        p = out["per_op"] = run_per_op(ops, torch, x, state, dev, args.iters)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print()
        print(per_op_markdown(p["rows"], out["device"], p["copy_bandwidth"]["GBs"], args.iters))
    return out


if __name__ == "__main__":
    main()
