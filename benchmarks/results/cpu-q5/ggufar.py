"""Our autoregressive decoding of a GGUF file (in /tmp/kq) with the codecs tried in the order given (cpu_gemm's
_CODECS_TRIED: 2 Q4, 6 Q5, 1 Q8, 7 Q8H, 5 Q8X): the best of 3 passes over 4 demo prompts x 64 new tokens, greedy,
float32, in tokens/s of the decoding (prefill included, short prompts).  Usage: ggufar.py FILE.gguf 2,6,1,7,5"""
import sys, time, torch, transformers
from heterospec import HeteroSpec, Policy
from heterospec.models import cpu_gemm
from heterospec.tools.demo import demo_prompts
from heterospec.tools.prompts import encode
f, order = sys.argv[1], tuple(int(c) for c in sys.argv[2].split(","))
cpu_gemm._CODECS_TRIED = order
m = transformers.AutoModelForCausalLM.from_pretrained("/tmp/kq", gguf_file=f, dtype=torch.float32)
tok = transformers.AutoTokenizer.from_pretrained("/tmp/kq", gguf_file=f)
xs = [encode(tok, p) for p in demo_prompts()[:4]]
e = HeteroSpec(m, None, Policy.autoregressive(), max_length=512)
e.generate(xs[0], max_new_tokens=8)
best = 0
for r in range(3):
    t = time.perf_counter(); n = 0
    for x in xs:
        out, st = e.generate(x, max_new_tokens=64); n += out.shape[1] - x.shape[1]
    best = max(best, n / (time.perf_counter() - t))
print(f, order, "ar tok/s %.1f" % best, e.cpu_decoder.split("weights as codes: ")[-1] if isinstance(e.cpu_decoder, str) else "")
