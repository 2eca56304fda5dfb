"""The torch profiler over our `ar` and over transformers' eager `generate` (dynamic cache): the default pair in
float32, one chat prompt, 64 new tokens, after a warm-up.  python benchmarks/results/cpu-amx/ar_profile.py"""
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import GenerationConfig

from heterospec import HeteroSpec, Policy
from heterospec.models.default import default_target

model, tok = default_target()
model.generation_config = GenerationConfig()
p = "Explain how a rainbow forms, step by step."
x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
x = x["input_ids"] if not torch.is_tensor(x) else x
kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
with HeteroSpec(model, None, Policy.autoregressive(), max_length=512) as e:
    for name, fn in (("ours", lambda: e.generate(x, max_new_tokens=64)), ("hf", lambda: model.generate(x, **kw))):
        fn()
        t = time.perf_counter()
        fn()
        print(name, "64 tokens s", f"{time.perf_counter() - t:.3f}", flush=True)
        with profile(activities=[ProfilerActivity.CPU]) as pr:
            fn()
        print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))
