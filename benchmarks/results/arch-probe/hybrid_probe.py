"""The hybrid (linear-attention) families of transformers against HF's greedy generate, with the chain methods a
hybrid target takes (ar, an oracle's chains, a noisy draft's chains, prompt lookup): run from this folder,
NAMES="Qwen3Next Qwen3_5 ..." python hybrid_probe.py (probe.py's tiny configs).  ALL=1 lets every module with a
cache argument count as a state-keeping mixer (how the list in heterospec.models.target.STATE_MIXERS was tried)."""
import os
import sys
import time
import warnings

import torch
import transformers

warnings.filterwarnings("ignore"); transformers.logging.set_verbosity_error()
sys.argv = ["x"]; sys.path.insert(0, "."); sys.path.insert(0, "../../../tests")
import probe as P
from _doubles import OracleDraft, NoisyDraft
from heterospec import HeteroSpec, Policy
import heterospec.models.target as T
names = os.environ["NAMES"].split()
if os.environ.get("ALL"):
    import inspect
    extra = set()
    for n in names:
        mod = inspect.getmodule(getattr(transformers, n + "ForCausalLM"))
        for k, v in vars(mod).items():
            if isinstance(v, type) and issubclass(v, torch.nn.Module) and "cache_params" in T._params(v):
                extra.add(k)
    T.STATE_MIXERS = tuple(T.STATE_MIXERS) + tuple(sorted(extra))
for base in names:
    t0 = time.time()
    try:
        m, ref, how, errs = P.build(base)
    except Exception as e:
        print(base, "NOT-BUILT", str(e)[:150]); continue
    res = []
    for label, mk, pol, kw in (("ar", lambda: None, Policy.autoregressive(), {}), ("oracle-chain", lambda: OracleDraft(m), Policy.static(5, 1, 6), {}),
                               ("noisy-chain", lambda: NoisyDraft(32, P.V), Policy.static(4, 1, 5), {}), ("lookup", lambda: None, Policy.autoregressive(), dict(prompt_lookup_num_tokens=4))):
        try:
            with HeteroSpec(m, mk(), pol, cuda_graphs=False) as hs:
                o, st = hs.generate(P.PROMPT, max_new_tokens=40, eos_token_id=[], **kw)
            got = o[0, 30:].tolist()
            i = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            res.append(f"{label}:" + ("OK" if i is None else f"DIFF@{i}"))
        except Exception as e:
            res.append(f"{label}:EXC {type(e).__name__}: {str(e)[:120]}")
    print(f"{base:18s} {' '.join(res)}   [{how}] ({time.time() - t0:.1f}s)", flush=True)
