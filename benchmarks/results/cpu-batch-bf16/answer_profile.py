# probe of 2026-11-29 (eighteenth session); the numbers are in RESULTS.md
import time, sys, numpy as np, torch
from torch.profiler import ProfilerActivity, profile
from heterospec import HeteroSpec, Policy
from heterospec.models.answers import AnswerStore, answer
from heterospec.models.default import default_target
from heterospec.tools.prompts import encode
A = "benchmarks/answers/smollm2-135m-instruct"
m = AnswerStore.read_manifest(A); listed = AnswerStore.read_prompts(A)
first = (max(int(k) for k in m["shards"]) + 1) * m["shard_size"]
N = int(sys.argv[1]); dt = getattr(torch, sys.argv[2]); T = int(sys.argv[3])
model, tok = default_target(dtype=dt)
ids = []
for t in listed["prompts"][first:]:
    p = encode(tok, t, listed.get("chat_template", True)).view(-1).numpy()
    if p.size <= 1024: ids.append(p)
    if len(ids) == N: break
print("prompt tokens", [p.size for p in ids])
eos = m["generation"]["eos_token_id"]
e = HeteroSpec(model, None, Policy.autoregressive(), batch_invariant=False, max_length=1024 + 256 + 8)
run = lambda: e.generate([torch.from_numpy(p) for p in ids], max_new_tokens=T, eos_token_id=eos)
run()
t0 = time.perf_counter(); seqs, st = run(); s = time.perf_counter() - t0
print("ours", s, st.summary() if hasattr(st, "summary") else st)
t0 = time.perf_counter(); hf = answer(model, ids, max_new_tokens=T, eos_token_id=eos, batch_size=64); print("hf", time.perf_counter() - t0)
with profile(activities=[ProfilerActivity.CPU]) as pr:
    run()
print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
