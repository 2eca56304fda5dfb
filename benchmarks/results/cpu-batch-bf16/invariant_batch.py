"""Our batched bf16 ar on the CPU with and without batch_invariant: 16 held-out gsm8k questions x 32 new tokens,
after a warm-up, then the torch profiler.  python benchmarks/results/cpu-batch-bf16/invariant_batch.py {inv,plain}"""
import time, sys, torch
from torch.profiler import ProfilerActivity, profile
from heterospec import HeteroSpec, Policy
from heterospec.models.default import default_target
import json
model, tok = default_target(dtype=torch.bfloat16)
qs = [json.loads(l) for l in open("benchmarks/data/heldout/gsm8k_heldout.jsonl")][:16]
ids = []
for q in qs:
    t = q.get("turns", [q.get("question", q.get("prompt", ""))])[0] if isinstance(q.get("turns"), list) else (q.get("question") or q.get("prompt") or q.get("instruction"))
    x = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_tensors="pt")
    ids.append((x["input_ids"] if not torch.is_tensor(x) else x)[0])
inv = sys.argv[1] == "inv"
e = HeteroSpec(model, None, Policy.autoregressive(), batch_invariant=inv, max_length=512)
run = lambda: e.generate(ids, max_new_tokens=32)
run()
t0 = time.perf_counter(); run(); print("inv" if inv else "plain", "16 x 32 tokens s", round(time.perf_counter() - t0, 2), flush=True)
with profile(activities=[ProfilerActivity.CPU]) as pr:
    run()
print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
