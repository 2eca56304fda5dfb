"""Where the CUDA cycle's time goes: every kernel of each op, and verify_sample under several warps and logits.

The first GPU run (RESULTS.md, "The first GPU run") put bench_cuda_cycle's cycle in a graph at 2.8 ms against a
50 us goal, 2.3 ms of it in verify_sample (top_p = 0.9 over 128,256 random bf16 logits).  This probe answers
two questions on a GPU in a few seconds:

1. which kernels each op of the cycle launches and how long each runs (torch.profiler's CUDA activity over
   a few eager calls of bench_cuda_cycle.per_op_calls);
2. how verify_sample's time depends on the warp and the logits: top_p 0.9 / 1.0, top_k 50, on the bench's
   flat rows (randn * 3: a nucleus of thousands of tokens, wider than the split path's candidates) and on
   peaked rows (the same plus 30 on one token per row, which then holds > 99.9 % of the mass, as a
   confident language model's rows do).

The fourth window (H100, RESULTS.md) left two questions, answered by three more tables:

3. the cycle's kernels inside its CUDA graph (the replay profiled): where the 0.7 ms (V = 49,152) and 1.5 ms
   (V = 128,256) of bench_cuda_cycle's graph go, kernel by kernel, rather than op by op;
4. the split rows' merges (hs_k_entropy_merge, hs_k_expand_merge: 34-41 us each in the eager profile, 8 per
   cycle) against the number of chunks a row is cut into: 10 rows of Vd = 1,024 ... 32,000 give 1 ... 32
   chunks, so a merge whose time grows with them is paying for hs_merge_rank's per-candidate binary searches
   over every other chunk, and one that does not is paying for something else;
5. verify_sample's wide rows (hs_k_wide_level: 944 us of a 978 us call at top-p 0.9 on 60 x 128,256 flat
   rows, four launches: one per 8-bit level of the key) against how the keys fall into the first level's
   bins.  Each level adds every kept token's weight into 256 shared histogram bins with float64 atomicAdd,
   and randn * 3 puts a row into about a dozen of them.  The same rows shifted by a constant (float32:
   randn * 3 + 30, + 1000) have the same softmax (to float32's rounding), so the same nucleus and the same
   work, but fall into 2 or 1 bins: if level 0's launch slows as the bins narrow while levels 1-3 do not, the time is those atomics'
   contention.

6. the minimum chunk length (`_C.cuda_set_chunk_min`): the eighth window's probe shows the draft's split rows
   paying a fixed latency per kernel and per chunk (10 rows of Vd = 1,024 in one chunk each: chunk kernel 9.8 us,
   merge 12.6; 10 rows of 32,000 in 32 chunks of 1,000: 15.5 and 17.9), so fewer, longer chunks may be cheaper
   for the draft's few rows while the target's 60 rows of 128,256 (8 chunks of 16,032) are untouched; each op of
   the cycle and the whole cycle replayed in a graph at each minimum (CHUNK_MINS) chooses the default.

The sixth window (H200) left the wide launches at 94-110 us each whatever their work: level 2 of the flat rows,
where almost no entry passes the prefix test, took 43 us, and the "+1000" rows, where every entry passes every
level, about 100.  Neither float64 arithmetic (about 10 us of it for 7.7M entries) nor contention explains that;
hardware counters will.  `--ncu-target` runs each op of the cycle once, eagerly, after one warm-up call each, so
that Nsight Compute can profile exactly those launches (.ci/gpu's `kernels-bench` phase runs it under `ncu` with
`-k regex:hs_k_`: occupancy, warp stall reasons, memory throughput per kernel):

    python -m benchmarks.probe_cuda_kernels [--iters 100] [--out probe.json]
    ncu --clock-control none --profile-from-start off ... python -m benchmarks.probe_cuda_kernels --ncu-target
"""
import argparse
import collections
import json

from benchmarks.bench_cuda_cycle import capture, cycle_ops, make_inputs, make_state, per_op_calls, timeit

MERGE_VOCABS = (1024, 4096, 16384, 32000)     # 10 rows each: 1, 4, 16 and 32 chunks a row on a GPU
CHUNK_MINS = (0, 2048, 4096, 8192, 32768)      # 0: the build's default (1,024 on a GPU)
# (dtype, shift) for randn * 3 + shift: the same softmax (so the same nucleus), keys in fewer level-0 bins
WIDE_CASES = (("bfloat16", 0.0), ("float32", 0.0), ("float32", 30.0), ("float32", 1000.0))


def device_events(torch, fn, reps):
    """The CUDA kernel events of reps calls of fn (after one unprofiled call), in launch order: (name, us)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if "CUDA" in str(getattr(e, "device_type", None) or "CUDA")]
    evs.sort(key=lambda e: e.time_range.start if getattr(e, "time_range", None) else 0)
    return [(e.name, float(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) or 0.0)) for e in evs]


def kernel_table(torch, fn, reps=5):
    """CUDA kernels run by reps calls of fn: name -> (calls per call of fn, us per call of fn)."""
    agg = collections.defaultdict(lambda: [0, 0.0])
    for name, us in device_events(torch, fn, reps):
        a = agg[name[:90]]
        a[0] += 1
        a[1] += us
    return {k: (v[0] / reps, v[1] / reps) for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])}


def peaked_rows(torch, logits, bump=30.0, seed=0):
    """logits with ``bump`` added to one random token per row (the same tokens for a given seed)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    cols = torch.randint(0, logits.shape[1], (logits.shape[0],), generator=g).to(logits.device)
    out = logits.clone()
    out[torch.arange(logits.shape[0], device=logits.device), cols] += bump
    return out


def draft_tree(ops, torch, x, state):
    """The cycle's draft tree (every level expanded, the n best selected, built): its tokens and parents."""
    k, n = x["k"], x["n"]
    scores, nodes, offset, tk, sc, pa = state["s0"], state["n0"], 0, [], [], []
    for logits in x["draft"]:
        t, s, p, _, nb = ops.expand(logits, scores, nodes, k, x["d2t"], offset, check=False)
        tk.append(t), sc.append(s), pa.append(p)
        scores, nodes = s[nb - offset], nb
        offset += t.shape[0]
    tree, _, _ = ops.build_tree(torch.cat(tk), torch.cat(pa), ops.select(torch.cat(sc), n, check=False), 1,
                                check=False, device_outputs=True)
    return tree.tokens, tree.parents


def key_bins(torch, logits):
    """How a row's keys fall into the first level of verify_sample's wide descent: the top 8 bits of the
    order-preserving 32-bit key of each value as float32 (hs_key32 in csrc/cuda/common.cuh: -0 as +0, the
    sign bit flipped for non-negative values, every bit for negative ones).  Returns (the mean over rows of
    the number of distinct bins, the mean over rows of the largest bin's share of the row)."""
    x = logits.float()
    x = torch.where(x == 0, torch.zeros_like(x), x)
    u = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(u >= 0x80000000, (~u) & 0xFFFFFFFF, u | 0x80000000)
    top = (key >> 24).long()
    counts = torch.zeros(top.shape[0], 256, dtype=torch.long, device=top.device)
    counts.scatter_add_(1, top, torch.ones_like(top))
    distinct = (counts > 0).sum(1).float().mean().item()
    largest = (counts.max(1).values.float() / top.shape[1]).mean().item()
    return distinct, largest


def chunks_per_row(rows, V):
    """The chunks the split-row kernels cut each of `rows` rows of V into (the CUDA build's own rule)."""
    from heterospec._native import _C
    return int(_C.cuda_chunks(rows, V))


def launches(torch, fn, match):
    """The device microseconds of each launch of the kernels whose name contains `match`, in launch order,
    over one call of fn."""
    return [us for name, us in device_events(torch, fn, 1) if match in name]


def merge_sweep(ops, torch, dev, iters):
    """topk_entropy and expand (k = 10) on 10 rows of each Vd in MERGE_VOCABS: chunks per row, the op replayed
    alone in a graph, and its kernels (eager, profiled)."""
    rows = []
    k = 10
    for Vd in MERGE_VOCABS:
        g = torch.Generator(device="cpu").manual_seed(Vd)
        logits = (torch.randn(k, Vd, generator=g) * 3).to(dev)
        scores = torch.zeros(k, device=dev)
        nodes = torch.arange(k, device=dev)
        for op, fn in (("topk_entropy", lambda lg=logits: ops.topk_entropy(lg, k, check=False)),
                       ("expand", lambda lg=logits, sc=scores, nd=nodes: ops.expand(lg, sc, nd, k, None, k, check=False))):
            graph = capture(torch, fn)
            t = timeit(torch, graph.replay, iters)
            ops.cuda_check(dev)
            ker = kernel_table(torch, fn)
            rows.append(dict(op=op, rows=k, Vd=Vd, chunks=chunks_per_row(k, Vd), graph_median_us=t["median_us"],
                             kernels={name: v for name, v in list(ker.items())[:4]}))
            del graph
    return rows


def wide_sweep(ops, torch, dev, tree_tokens, tree_parents, V, iters):
    """verify_sample at top-p 0.9 on the tree's rows of randn * 3 + shift (WIDE_CASES): the level-0 bins the
    rows' keys fall into, the call replayed in a graph, each hs_k_wide_level launch (levels 0-3) and the
    crossing key's tie (hs_k_wide_tie)."""
    rows = []
    T = tree_tokens.shape[0]
    for dtype, shift in WIDE_CASES:
        g = torch.Generator(device="cpu").manual_seed(7)
        lg = (torch.randn(T, V, generator=g) * 3 + shift).to(dev, getattr(torch, dtype))
        distinct, largest = key_bins(torch, lg)
        off = torch.zeros(1, dtype=torch.long, device=dev)
        fn = lambda lg=lg, off=off: ops.verify_sample(  # noqa: E731
            tree_tokens, tree_parents, lg, temperature=1.0, top_p=0.9, seed=1, offset=off, check=False,
            device_outputs=True, advance_offset=True)
        graph = capture(torch, fn)
        t = timeit(torch, graph.replay, iters)
        ops.cuda_check(dev)
        rows.append(dict(dtype=dtype, shift=shift, bins=distinct, largest_bin=largest, graph_median_us=t["median_us"],
                         wide_level_us=launches(torch, fn, "wide_level"),
                         wide_tie_us=launches(torch, fn, "wide_tie")))
        del graph, lg
    return rows


def chunk_sweep(ops, torch, x, state, calls, iters):
    """Each op of the cycle (calls: per_op_calls) and the whole cycle, each replayed in a graph captured after
    setting the minimum chunk length to each of CHUNK_MINS; the chunks a row of each shape gets.  The build's
    default is restored afterwards, whatever happens."""
    from heterospec._native import _C
    rows = []
    shapes = {"draft": (x["k"], x["draft"][-1].shape[1]), "draft root": (1, x["draft"][0].shape[1]),
              "target": tuple(x["target"].shape)}
    try:
        for lo in CHUNK_MINS:
            _C.cuda_set_chunk_min(lo)
            row = dict(chunk_min=lo or None, chunks={k: chunks_per_row(*v) for k, v in shapes.items()}, ops={})
            for op, fn in calls.items():
                g = capture(torch, fn)
                row["ops"][op] = timeit(torch, g.replay, iters)["median_us"]
                del g
            cyc = capture(torch, lambda: cycle_ops(ops, torch, x, state))
            row["cycle_us"] = timeit(torch, cyc.replay, iters)["median_us"]
            del cyc
            ops.cuda_check(torch.device("cuda"))
            rows.append(row)
    finally:
        _C.cuda_set_chunk_min(0)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", default="probe-cuda-kernels.json")
    ap.add_argument("--ncu-target", action="store_true",
                    help="run each op of the cycle once to warm up, then once between cudaProfilerStart and Stop, and exit")
    args = ap.parse_args(argv)
    import torch

    from heterospec import ops
    dev = torch.device("cuda")
    x = make_inputs(torch, dev)
    state = make_state(torch, dev)
    calls = per_op_calls(ops, torch, x, state, torch.stack(x["kv"]))
    if args.ncu_target:
        for fn in calls.values():
            fn()                                  # warm-up: the workspace, lazy state
        torch.cuda.synchronize()
        torch.cuda.profiler.start()               # ncu --profile-from-start off: only what follows
        for op, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            print(f"ncu-target: {op}", flush=True)
        torch.cuda.profiler.stop()
        ops.cuda_check(dev)
        return None
    out = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, kernels={}, verify_sample=[])
    for op, fn in calls.items():
        out["kernels"][op] = tab = kernel_table(torch, fn)
        print(f"## {op}")
        for name, (n, us) in list(tab.items())[:8]:
            print(f"  {us:9.1f} us  x{n:4.1f}  {name}")
    ops.cuda_check(dev)

    # verify_sample: warps x logits, replayed in a graph
    tree_tokens, tree_parents = draft_tree(ops, torch, x, state)
    flat = x["target"]
    peaked = peaked_rows(torch, flat)
    for lname, lg in (("flat randn*3", flat), ("peaked +30", peaked)):
        for warp in (dict(top_p=0.9), dict(top_p=1.0), dict(top_k=50), dict(top_p=0.9, top_k=50)):
            off = torch.zeros(1, dtype=torch.long, device=dev)
            fn = lambda lg=lg, w=warp, off=off: ops.verify_sample(  # noqa: E731
                tree_tokens, tree_parents, lg, temperature=1.0, seed=1, offset=off, check=False,
                device_outputs=True, advance_offset=True, **w)
            g = capture(torch, fn)
            t = timeit(torch, g.replay, args.iters)
            ops.cuda_check(dev)
            ker = kernel_table(torch, fn, reps=3)
            row = dict(logits=lname, warp=warp, graph_median_us=t["median_us"],
                       kernels={k2: v for k2, v in list(ker.items())[:6]})
            out["verify_sample"].append(row)
            print(f"verify_sample {lname:13s} {str(warp):28s} graph {t['median_us']:8.1f} us   top kernels: "
                  + "; ".join(f"{k2[:40]} {v[1]:.0f}us" for k2, v in list(ker.items())[:3]))
            del g
    with open(args.out, "w") as f:   # what is measured so far is kept if a table below fails
        json.dump(out, f, indent=1)

    # 3. the whole cycle in its graph, kernel by kernel
    cyc = capture(torch, lambda: cycle_ops(ops, torch, x, state))
    out["cycle_graph"] = dict(median_us=timeit(torch, cyc.replay, args.iters)["median_us"],
                              kernels=kernel_table(torch, cyc.replay))
    ops.cuda_check(dev)
    del cyc
    print(f"## the cycle in its graph: {out['cycle_graph']['median_us']:.1f} us a replay")
    if not out["cycle_graph"]["kernels"]:
        print("  (the profiler saw no kernels inside the graph's replays)")
    for name, (n, us) in list(out["cycle_graph"]["kernels"].items())[:16]:
        print(f"  {us:9.1f} us  x{n:4.1f}  {name}")

    # 4. the merges against the chunks per row
    out["merge_sweep"] = merge_sweep(ops, torch, dev, args.iters)
    print("\n| op | rows x Vd | chunks a row | graph us | kernels (eager profile) |\n|---|---|---:|---:|---|")
    for r in out["merge_sweep"]:
        print(f"| {r['op']} | {r['rows']} x {r['Vd']} | {r['chunks']} | {r['graph_median_us']:.1f} | "
              + "; ".join(f"{n[:28]} {v[1]:.1f}" for n, v in r["kernels"].items()) + " |")

    # 5. the wide rows against the level-0 bins
    out["wide_sweep"] = wide_sweep(ops, torch, dev, tree_tokens, tree_parents, flat.shape[1], args.iters)
    print("\n| logits | bins at level 0 | largest bin | graph us | hs_k_wide_level us, levels 0-3 "
          "| hs_k_wide_tie us |\n|---|---:|---:|---:|---|---:|")
    for r in out["wide_sweep"]:
        print(f"| {r['dtype']} randn x 3 + {r['shift']:g} | {r['bins']:.1f} | {r['largest_bin']:.2f} | "
              f"{r['graph_median_us']:.1f} | {' / '.join(f'{u:.1f}' for u in r['wide_level_us'])} | "
              f"{sum(r['wide_tie_us']):.1f} |")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)

    # 6. the minimum chunk length
    out["chunk_sweep"] = chunk_sweep(ops, torch, x, state, calls, args.iters)
    names = list(calls)
    print("\n| chunk min | chunks a row (draft / root / target) | " + " | ".join(names) + " | cycle us |\n|---|---|"
          + "---:|" * (len(names) + 1))
    for r in out["chunk_sweep"]:
        c = r["chunks"]
        print(f"| {r['chunk_min'] or 'default'} | {c['draft']} / {c['draft root']} / {c['target']} | "
              + " | ".join(f"{r['ops'][n]:.1f}" for n in names) + f" | {r['cycle_us']:.1f} |")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
