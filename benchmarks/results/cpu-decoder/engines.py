"""ar and heterospec with cpu_decoder off (transformers' forward, cpu_gemm auto) and on: 3 demo prompts x 96 tokens, 2 rounds
after a warm-up, outputs compared.  PYTHONPATH=. python benchmarks/results/cpu-decoder/engines.py"""
import time, torch
from heterospec import HeteroSpec, Policy, default_pair, default_policy
from heterospec.tools.demo import demo_prompts
target, tok, draft = default_pair()
pol = default_policy()
prompts = demo_prompts()[:3]
xs = []
for p in prompts:
    x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
    xs.append(x["input_ids"] if not torch.is_tensor(x) else x)
N = 96
res = {}
engines = {
  "ar-hf": HeteroSpec(target, None, Policy.autoregressive(), max_length=512, cpu_decoder=False),
  "ar-dec": HeteroSpec(target, None, Policy.autoregressive(), max_length=512),
  "hs-hf": HeteroSpec(target, draft, pol, max_length=512, cpu_decoder=False),
  "hs-dec": HeteroSpec(target, draft, pol, max_length=512),
}
for n, e in engines.items(): print(n, e.cpu_decoder, e.cpu_gemm)
for n, e in engines.items(): e.generate(xs[0], max_new_tokens=8)
for rnd in range(2):
    for n, e in engines.items():
        t = time.perf_counter(); toks = 0; outs = []
        for x in xs:
            out, st = e.generate(x, max_new_tokens=N)
            toks += out.shape[1] - x.shape[1]; outs.append(out[0, x.shape[1]:].tolist())
        el = time.perf_counter() - t
        res.setdefault(n, []).append(outs)
        print(rnd, n, f"{toks/el:.1f} tok/s", flush=True)
print("same as ar-hf:", {n: res[n][0] == res["ar-hf"][0] for n in res})
