# The chain diagnostic of RESULTS.md (issue 27): in-engine P(accepted >= k) for a top-1 chain and the static tree,
# shipped head vs h27a, first 2 questions of alpaca, gsm8k and mt_bench, 128 new tokens, greedy, float32.
# Run from the repository root after OUT=head-recipe/h27a EPOCHS=1 bash benchmarks/head_recipe.sh train.
import json, sys, torch
from heterospec import HeteroSpec, Policy
from heterospec.models.default import DEFAULT_HEAD, default_target
from heterospec.models.draft import Eagle3Draft
from heterospec.tools.prompts import encode
model, tok = default_target()
qs = []
for f in ("alpaca", "gsm8k", "mt_bench"):
    qs += [json.loads(l)["turns"][0] for l in open(f"../shared/data/benchmarks/{f}.jsonl") if l.strip()][:2]
for name, d in (("shipped", DEFAULT_HEAD), ("h27a", "head-recipe/h27a")):
    draft = Eagle3Draft.from_pretrained(d, target=model, dtype=torch.float32)
    for shape in ((6, 1, 7), (7, 10, 60)):
        pol = Policy.static(*shape)
        hist, cyc = {}, 0
        with HeteroSpec(model, draft, pol) as hs:
            for q in qs:
                _, st = hs.generate(encode(tok, q), max_new_tokens=128, eos_token_id=tok.eos_token_id)
                for a, c in st.accepted_hist.items():
                    hist[a] = hist.get(a, 0) + c
                cyc += st.cycles
        ge = [sum(c for a, c in hist.items() if a >= k) / cyc for k in range(1, 5)]
        tau = sum((a + 1) * c for a, c in hist.items()) / cyc
        print(name, shape, f"tau {tau:.2f}", "P(acc>=k) k=1..4:", " ".join(f"{x:.2f}" for x in ge), flush=True)
