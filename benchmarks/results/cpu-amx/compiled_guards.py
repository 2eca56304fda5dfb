"""Our `ar` eager, compile=True as is, and compile=True with dynamo's guard evaluation cut to the guards that tell
the compiled graphs apart (torch.compiler.set_stance(skip_guard_eval_unsafe=True) around the verify forward):
the default pair in float32, 3 demo prompts x 96 new tokens, warmed up, 3 rounds taking turns, tokens compared;
then the torch profiler over 32 tokens of each compiled engine.  python benchmarks/results/cpu-amx/compiled_guards.py"""
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from heterospec import HeteroSpec, Policy
from heterospec.models import target as tgt
from heterospec.models.default import default_target

model, tok = default_target()
prompts = json.load(open("heterospec/data/demo_prompts.json"))["prompts"][:3]
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
       for p in prompts]
ids = [i["input_ids"] if not torch.is_tensor(i) else i for i in ids]
eos = tok.eos_token_id


def rate(e):
    toks, t, outs = 0, 0.0, []
    for x in ids:
        t0 = time.perf_counter()
        s, _ = e.generate(x, max_new_tokens=96, eos_token_id=eos)
        t += time.perf_counter() - t0
        toks += s.shape[1] - x.shape[1]
        outs.append(s[0].tolist())
    return toks / t, outs


class Skipping(tgt._Regional):
    def __call__(self, **kwargs):
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return super().__call__(**kwargs)


engines = {"ar": HeteroSpec(model, None, Policy.autoregressive(), max_length=512),
           "compiled": HeteroSpec(model, None, Policy.autoregressive(), compile=True, max_length=512)}
orig = tgt._Regional
tgt._Regional = Skipping
engines["compiled, skip guards"] = HeteroSpec(model, None, Policy.autoregressive(), compile=True, max_length=512)
tgt._Regional = orig
for name, e in engines.items():
    t0 = time.perf_counter()
    rate(e)
    print(name, "warm-up s", f"{time.perf_counter() - t0:.1f}", flush=True)
for r in range(3):
    res = {n: rate(e) for n, e in engines.items()}
    outs = [o for _, o in res.values()]
    print(r, "  ".join(f"{n} {v:.2f}" for n, (v, _) in res.items()), "same tokens", all(o == outs[0] for o in outs),
          flush=True)
for name in ("compiled", "compiled, skip guards"):
    with profile(activities=[ProfilerActivity.CPU]) as pr:
        engines[name].generate(ids[0], max_new_tokens=32)
    print(name)
    print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
