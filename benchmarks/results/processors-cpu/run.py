"""Logits processors on the default pair (2026-12-01, thirty-second session): HF's greedy generate with
repetition_penalty=1.3 and no_repeat_ngram_size=3 on the first 3 demo prompts x 64 tokens, against our ar and
HeteroSpec (the device's default profile) with the same processors passed as logits_processor (equal output?),
and each engine's tokens/s with and without them in the same process.  Run from the repository root:
    python benchmarks/results/processors-cpu/run.py"""
import json, time, torch, heterospec
from heterospec import HeteroSpec, default_pair, default_policy
from heterospec.tools.prompts import encode
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor
target, tok, draft = default_pair()
prompts = json.load(open("heterospec/data/demo_prompts.json"))["prompts"][:3]
pol = default_policy(target.device)
for text in prompts:
    x = encode(tok, text)
    t = time.perf_counter()
    ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=64, repetition_penalty=1.3, no_repeat_ngram_size=3)
    t_hf = time.perf_counter() - t
    plain = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=64)
    for name, d, p in (("ar", None, None), ("heterospec", draft, pol)):
        with HeteroSpec(target, d, p) as hs:
            hs.generate(x, max_new_tokens=8)
            procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), NoRepeatNGramLogitsProcessor(3)])
            t = time.perf_counter(); out, st = hs.generate(x, max_new_tokens=64, logits_processor=procs); dt = time.perf_counter() - t
            t = time.perf_counter(); out0, st0 = hs.generate(x, max_new_tokens=64); dt0 = time.perf_counter() - t
        print(f"{name}: equal HF {out.tolist() == ref.tolist()}, processors changed output {ref.tolist() != plain.tolist()}, "
              f"{st.new_tokens/dt:.1f} tok/s with processors (tau {st.tau:.2f}), {st0.new_tokens/dt0:.1f} without (tau {st0.tau:.2f}), HF {ref.shape[1]-x.shape[1]} toks {(ref.shape[1]-x.shape[1])/t_hf:.1f} tok/s", flush=True)
