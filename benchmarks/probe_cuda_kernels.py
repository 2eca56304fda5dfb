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

    python -m benchmarks.probe_cuda_kernels [--iters 100] [--out probe.json]
"""
import argparse
import collections
import json

from benchmarks.bench_cuda_cycle import capture, make_inputs, make_state, per_op_calls, timeit


def kernel_table(torch, fn, reps=5):
    """CUDA kernels run by reps calls of fn: name -> (calls per call of fn, us per call of fn)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if dt is not None and "CUDA" not in str(dt):
            continue
        us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) or 0.0
        a = agg[e.name[:90]]
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", default="probe-cuda-kernels.json")
    args = ap.parse_args(argv)
    import torch

    from heterospec import ops
    dev = torch.device("cuda")
    x = make_inputs(torch, dev)
    state = make_state(torch, dev)
    calls = per_op_calls(ops, torch, x, state, torch.stack(x["kv"]))
    out = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, kernels={}, verify_sample=[])
    for op, fn in calls.items():
        out["kernels"][op] = tab = kernel_table(torch, fn)
        print(f"## {op}")
        for name, (n, us) in list(tab.items())[:8]:
            print(f"  {us:9.1f} us  x{n:4.1f}  {name}")
    ops.cuda_check(dev)

    # verify_sample: warps x logits, replayed in a graph
    k, n = x["k"], x["n"]
    scores, nodes, offset, tk, sc, pa = state["s0"], state["n0"], 0, [], [], []
    for logits in x["draft"]:
        t, s, p, _, nb = ops.expand(logits, scores, nodes, k, x["d2t"], offset, check=False)
        tk.append(t), sc.append(s), pa.append(p)
        scores, nodes = s[nb - offset], nb
        offset += t.shape[0]
    tree, _, _ = ops.build_tree(torch.cat(tk), torch.cat(pa), ops.select(torch.cat(sc), n, check=False), 1,
                                check=False, device_outputs=True)
    tree_tokens, tree_parents = tree.tokens, tree.parents
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
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
