"""HuggingFace's generate with a static cache compiled the way transformers compiles it on a GPU (its own
auto-compile of the decoding step, forced on the CPU with CompileConfig._compile_all_devices), against HF's eager
generate and our `ar`: the default pair in float32, the 3 built-in demo prompts x 96 new tokens (EOS stops),
greedy; one warm-up of the compiled path, then 3 rounds taking turns.  Run from the repository root:
python benchmarks/results/cpu-avx2-compile/hf_compiled.py"""
import json
import time

import torch
from transformers import CompileConfig, GenerationConfig

from heterospec import HeteroSpec, Policy
from heterospec.models.default import default_target

model, tok = default_target()
prompts = json.load(open("heterospec/data/demo_prompts.json"))["prompts"][:3]
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
       for p in prompts]
ids = [i["input_ids"] if not torch.is_tensor(i) else i for i in ids]
eos = tok.eos_token_id
model.generation_config = GenerationConfig()
cc = CompileConfig()
cc._compile_all_devices = True


def hf(**extra):
    toks, t = 0, 0.0
    for x in ids:
        t0 = time.perf_counter()
        o = model.generate(x, max_new_tokens=96, do_sample=False, eos_token_id=eos, pad_token_id=eos, **extra)
        t += time.perf_counter() - t0
        toks += o.shape[1] - x.shape[1]
    return toks / t


compiled = dict(cache_implementation="static", compile_config=cc)
t0 = time.perf_counter()
hf(**compiled)
print("warm-up (3 prompts) s", f"{time.perf_counter() - t0:.1f}", flush=True)
with HeteroSpec(model, None, Policy.autoregressive()) as e:
    e.generate(ids[0], max_new_tokens=8, eos_token_id=eos)
    for r in range(3):
        toks, t = 0, 0.0
        for x in ids:
            t0 = time.perf_counter()
            s, _ = e.generate(x, max_new_tokens=96, eos_token_id=eos)
            t += time.perf_counter() - t0
            toks += s.shape[1] - x.shape[1]
        print(r, "hf-static compiled", f"{hf(**compiled):.2f}", "hf eager", f"{hf():.2f}", "ar", f"{toks / t:.2f}",
              flush=True)
