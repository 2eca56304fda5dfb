"""The torch profiler over transformers' compiled generate (static cache, CompileConfig._compile_all_devices): the
default pair in float32, one chat prompt, 64 new tokens, after a warm-up.  Run from the repository root."""
import time
import torch
from transformers import CompileConfig, GenerationConfig
from heterospec.models.default import default_target
from torch.profiler import profile, ProfilerActivity
model, tok = default_target()
model.generation_config = GenerationConfig()
p = "Explain how a rainbow forms, step by step."
x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
x = x["input_ids"] if not torch.is_tensor(x) else x
cc = CompileConfig(); cc._compile_all_devices = True
kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0, cache_implementation="static", compile_config=cc)
t = time.perf_counter(); model.generate(x, **kw); print("warm", time.perf_counter() - t, flush=True)
t = time.perf_counter(); model.generate(x, **kw); print("64 tokens s", time.perf_counter() - t, flush=True)
with profile(activities=[ProfilerActivity.CPU]) as pr:
    model.generate(x, **kw)
print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
