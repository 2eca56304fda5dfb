"""The row-invariant batched bf16 ar of invariant_batch.py: its prefill and verify seconds, then the torch profiler
grouped by input shape.  python benchmarks/results/cpu-batch-bf16/invariant_shapes.py"""
import time, torch, json
from torch.profiler import ProfilerActivity, profile
from heterospec import HeteroSpec, Policy
from heterospec.models.default import default_target
model, tok = default_target(dtype=torch.bfloat16)
qs = [json.loads(l) for l in open("benchmarks/data/heldout/gsm8k_heldout.jsonl")][:16]
ids = []
for q in qs:
    x = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True, return_tensors="pt")
    ids.append((x["input_ids"] if not torch.is_tensor(x) else x)[0])
e = HeteroSpec(model, None, Policy.autoregressive(), batch_invariant=True, max_length=512)
run = lambda: e.generate(ids, max_new_tokens=32)
run()
t0 = time.perf_counter(); _, st = run(); print("inv s", round(time.perf_counter() - t0, 2), "prefill_s", round(st.prefill_s, 2), "verify_s", round(st.verify_s, 2), flush=True)
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as pr:
    run()
print(pr.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=40, max_shapes_column_width=70))
