"""Where a speculative cycle's time goes on this machine (issue 28), with torch's default linear and with
``cpu_gemm`` (oneDNN, weights packed once), in one run:

1. one target forward over n tree rows (``TargetAdapter.verify`` on the static cache, a 64-token prompt's
   context), n = 1, 2, 4, 8, 12: median ms;
2. the target's output layer alone on n rows (after a one-row forward has streamed the other weights through
   the caches): median ms;
3. the engine on 4 short chat prompts (128 new tokens, greedy, float32): ``ar`` and a top-1 chain
   ``Policy.static(2, 1, 4)`` (3 drafted tokens, what vLLM's EAGLE-3 drafts per step by default), tokens/s,
   τ and the per-cycle split (tokens/s with the prefill included, as for HuggingFace's ``generate``; the split
   without it) (draft = catch-up + draft steps, verify = the target's forward, ops = selection,
   acceptance, commit; host = the rest), and whether every output equals HuggingFace's greedy ``generate``.

    python benchmarks/profile_cycle.py [--out results.json]
"""
import argparse
import json
import platform
import time

import torch

from heterospec import HeteroSpec, Policy
from heterospec.models import cpu_gemm
from heterospec.models.default import DEFAULT_HEAD, default_target
from heterospec.models.draft import Eagle3Draft
from heterospec.models.target import TargetAdapter
from heterospec.tools.prompts import encode

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
           "List three uses of copper."]
ROWS = (1, 2, 4, 8, 12)


def median_ms(fn, reps=12, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[len(ts) // 2]


@torch.no_grad()
def forward_costs(model, tok, gemm):
    """ms per verify forward and per output layer, per row count."""
    packed = cpu_gemm.PackedLinears([model] if gemm else [])
    packed.prepare()
    tgt = TargetAdapter(model, capture_taps=True)
    tgt.allocate(256)
    lm = model.get_output_embeddings()
    out = {}
    try:
        with packed:
            ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
            tgt.prefill(ids)
            window = 192
            for n in ROWS:
                toks, depths = torch.arange(100, 100 + n), torch.arange(n)
                mask = torch.ones(n, n, dtype=torch.bool).tril()
                verify = median_ms(lambda: tgt.verify(toks, depths, mask, window))
                h = torch.randn(1, n, model.config.hidden_size)

                def head():
                    tgt.verify(toks[:1], depths[:1], mask[:1, :1], window)   # the other weights through the caches
                    t = time.perf_counter()
                    lm(h).float()
                    return time.perf_counter() - t
                head_ms = 1e3 * sorted(head() for _ in range(12))[6]
                out[n] = {"verify_ms": verify, "output_layer_ms": head_ms}
    finally:
        tgt.close()
    return out


@torch.no_grad()
def engine(model, tok, draft, gemm, refs):
    rows = {}
    ids = [encode(tok, p) for p in PROMPTS]
    for name, pol, d in (("ar", Policy.autoregressive(), None), ("chain 2/1/4", Policy.static(2, 1, 4), draft)):
        with HeteroSpec(model, d, pol, cpu_gemm=gemm) as hs:
            hs.generate(ids[0], max_new_tokens=16)
            t = {"new": 0, "s": 0.0, "total": 0.0, "cycles": 0, "committed": 0, "draft": 0.0, "verify": 0.0, "ops": 0.0}
            same = True
            for x, ref in zip(ids, refs):
                seq, st = hs.generate(x, max_new_tokens=128, eos_token_id=tok.eos_token_id)
                same &= seq.tolist() == ref
                t["new"] += st.new_tokens
                t["s"] += st.total_s - st.prefill_s
                t["total"] += st.total_s
                t["cycles"] += st.cycles
                t["committed"] += st.committed
                for k in ("draft", "verify", "ops"):
                    t[k] += getattr(st, k + "_s")
        c = t["cycles"]
        rows[name] = {"tokens_per_s": t["new"] / t["total"], "tau": t["committed"] / c,
                      "ms_per_cycle": 1e3 * t["s"] / c, "draft_ms": 1e3 * t["draft"] / c,
                      "verify_ms": 1e3 * t["verify"] / c, "ops_ms": 1e3 * t["ops"] / c,
                      "host_ms": 1e3 * (t["s"] - t["draft"] - t["verify"] - t["ops"]) / c,
                      "equals_hf_generate": bool(same)}
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model, tok = default_target()
    draft = Eagle3Draft.from_pretrained(DEFAULT_HEAD, target=model, dtype=torch.float32)
    refs = []
    hf_s = hf_new = 0
    for p in PROMPTS:
        x = encode(tok, p)
        t = time.perf_counter()
        seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=128,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        hf_s += time.perf_counter() - t
        hf_new += seq.shape[1] - x.shape[1]
        refs.append(seq.tolist())
    res = {"machine": {"platform": platform.platform(), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "cpu_gemm_available": cpu_gemm.available()},
           "hf_generate_tokens_per_s": hf_new / hf_s}
    print(f"HuggingFace generate (greedy, dynamic cache): {res['hf_generate_tokens_per_s']:.1f} tokens/s")
    for gemm in (False, True):
        key = "cpu_gemm" if gemm else "torch linear"
        f = forward_costs(model, tok, gemm)
        e = engine(model, tok, draft, gemm, refs)
        res[key] = {"forward": f, "engine": e}
        print(f"\n{key}: ms per forward over n rows / output layer alone")
        for n, r in f.items():
            print(f"  n={n:2d}: {r['verify_ms']:6.1f} / {r['output_layer_ms']:5.1f}")
        for name, r in e.items():
            print(f"  {name}: {r['tokens_per_s']:.1f} tokens/s, tau {r['tau']:.2f}, {r['ms_per_cycle']:.1f} ms/cycle "
                  f"(draft {r['draft_ms']:.1f}, verify {r['verify_ms']:.1f}, ops {r['ops_ms']:.1f}, host "
                  f"{r['host_ms']:.1f}); equal to HF generate: {r['equals_hf_generate']}", flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
