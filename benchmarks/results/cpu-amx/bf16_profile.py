"""The torch profiler over bf16 heterospec (row-invariant, shipped CPU profile), one demo prompt, 64 new tokens after a
warm-up.  python benchmarks/results/cpu-amx/bf16_profile.py"""
import json, torch
from torch.profiler import profile, ProfilerActivity
import heterospec
from heterospec.models.default import default_pair
t, tok, d = default_pair(dtype=torch.bfloat16)
pol = heterospec.default_policy("cpu")
p = json.load(open("heterospec/data/demo_prompts.json"))["prompts"][0]
x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
x = x["input_ids"] if not torch.is_tensor(x) else x
with heterospec.HeteroSpec(t, d, pol) as hs:
    hs.generate(x, max_new_tokens=32)
    with profile(activities=[ProfilerActivity.CPU]) as pr:
        s, st = hs.generate(x, max_new_tokens=64)
    print(st.cycles, st.tau, hs.cpu_gemm)
print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=55))
