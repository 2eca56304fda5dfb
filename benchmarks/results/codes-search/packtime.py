import sys, time, torch, transformers, heterospec
from heterospec.models import cpu_decoder as cd
from heterospec.models import default as dm
spec = sys.argv[1]
if spec == "default":
    m = dm.default_target()[0]
elif spec.endswith(".gguf"):
    m = transformers.AutoModelForCausalLM.from_pretrained("/tmp/kq", gguf_file=spec, dtype=torch.float32)
else:
    m = transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)
ts = []
for r in range(3):
    t = time.perf_counter(); d = cd.CpuDecoder(m); ts.append(time.perf_counter() - t)
print(spec, "before" if heterospec.__file__.startswith("/tmp/before") else "after", "pack s", " ".join(f"{x:.2f}" for x in ts), "codecs", d.codecs)
