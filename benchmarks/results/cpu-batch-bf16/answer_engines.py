"""Answering training prompts in bf16 on this CPU: HF generate (answers.answer, static cache, batch 64) against our
engine's batched ar (a list of prompts, finished rows dropped, batch_invariant off as HF's answers are not row-
invariant either). The same 64 prompts of the committed list (past the answered shards), 256 new tokens."""
import time, sys, numpy as np, torch
from heterospec import HeteroSpec, Policy
from heterospec.models.answers import AnswerStore, answer
from heterospec.models.default import default_target
from heterospec.tools.prompts import encode
A = "benchmarks/answers/smollm2-135m-instruct"
m = AnswerStore.read_manifest(A); listed = AnswerStore.read_prompts(A)
first = (max(int(k) for k in m["shards"]) + 1) * m["shard_size"]
N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
model, tok = default_target(dtype=torch.bfloat16)
ids = []
for t in listed["prompts"][first:]:
    p = encode(tok, t, listed.get("chat_template", True)).view(-1).numpy()
    if p.size <= 1024: ids.append(p)
    if len(ids) == N: break
eos = m["generation"]["eos_token_id"]
print("prompts", len(ids), "prompt tokens", sum(p.size for p in ids), flush=True)
t0 = time.perf_counter()
with HeteroSpec(model, None, Policy.autoregressive(), batch_invariant=False, max_length=1024 + 256 + 8) as e:
    order = sorted(range(len(ids)), key=lambda i: ids[i].size)
    ours = [None] * len(ids)
    for b0 in range(0, len(order), 64):
        idx = order[b0:b0 + 64]
        seqs, st = e.generate([torch.from_numpy(ids[i]) for i in idx], max_new_tokens=256, eos_token_id=eos)
        for i, s in zip(idx, seqs):
            ours[i] = s[ids[i].size:].numpy()
s_ours = time.perf_counter() - t0
n_ours = sum(a.size for a in ours)
print(f"ours ar batched: {n_ours} tokens in {s_ours:.0f} s = {n_ours / s_ours:.1f} tokens/s", flush=True)
t0 = time.perf_counter()
hf = answer(model, ids, max_new_tokens=256, eos_token_id=eos, batch_size=64)
s_hf = time.perf_counter() - t0
n_hf = sum(a.size for a in hf)
print(f"HF generate: {n_hf} tokens in {s_hf:.0f} s = {n_hf / s_hf:.1f} tokens/s", flush=True)
print("identical answers", sum(np.array_equal(a, b) for a, b in zip(ours, hf)), "of", len(ids))
