"""transformers' compiled generate with inductor's CPU freezing (weights as constants, linears packed by
inductor), against its eager generate: the default pair in float32, 2 demo prompts x 96 new tokens, greedy; a
warm-up (compilation), then 2 rounds.  python hf_freezing.py '{\"freezing\": true}'"""
import json, time, torch, sys
from transformers import CompileConfig, GenerationConfig
from heterospec.models.default import default_target
model, tok = default_target()
prompts = json.load(open("heterospec/data/demo_prompts.json"))["prompts"][:2]
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt") for p in prompts]
ids = [i["input_ids"] if not torch.is_tensor(i) else i for i in ids]
model.generation_config = GenerationConfig()
eos = tok.eos_token_id
def run(**extra):
    toks, t, outs = 0, 0.0, []
    for x in ids:
        t0 = time.perf_counter()
        o = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=96, do_sample=False, eos_token_id=eos, pad_token_id=eos, **extra)
        t += time.perf_counter() - t0
        toks += o.shape[1] - x.shape[1]; outs.append(o.tolist())
    return toks / t, outs
opts = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
cc = CompileConfig(options=opts, mode=None) if opts else CompileConfig(); cc._compile_all_devices = True
t0 = time.perf_counter(); run(cache_implementation="static", compile_config=cc); print("warm", time.perf_counter() - t0, flush=True)
ref = run()[1]
for r in range(2):
    tps, outs = run(cache_implementation="static", compile_config=cc)
    print(opts, "compiled", round(tps, 2), "eager", round(run()[0], 2), "same", outs == ref, flush=True)
