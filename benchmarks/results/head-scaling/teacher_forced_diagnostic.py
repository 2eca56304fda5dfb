# The teacher-forced diagnostic of RESULTS.md (issue 27): the heads' per-step accuracy (train-draft's TTT loss) on the
# target's own greedy outputs (128 new tokens) for the chain diagnostic's 6 benchmark prompts.  Run from the repository root.
import json, torch
from heterospec.models.default import DEFAULT_HEAD, default_target
from heterospec.models.draft import Eagle3Draft
from heterospec.models.train import teacher_forced, _batch, ttt_loss
from heterospec.models.answers import answer
from heterospec.tools.prompts import encode
model, tok = default_target()
qs = []
for f in ("alpaca", "gsm8k", "mt_bench"):
    qs += [json.loads(l)["turns"][0] for l in open(f"../shared/data/benchmarks/{f}.jsonl") if l.strip()][:2]
ids = [encode(tok, q).view(-1).numpy() for q in qs]
ans = answer(model, ids, max_new_tokens=128, eos_token_id=tok.eos_token_id, batch_size=1)
import numpy as np
seqs = [(torch.from_numpy(np.concatenate([p, a])), int(p.size)) for p, a in zip(ids, ans)]
recs, agree, total = teacher_forced(model, seqs, topk=32)
print("target fp32 self-agreement", agree / total)
for name, d in (("shipped", DEFAULT_HEAD), ("h27a", "head-recipe/h27a")):
    draft = Eagle3Draft.from_pretrained(d, target=model, dtype=torch.float32).eval()
    t2d = draft.t2d.cpu(); tmap = (t2d.long().cumsum(0) - 1).clamp(min=0)
    with torch.no_grad():
        b = _batch(recs, list(range(len(recs))), 32, t2d, tmap)
        loss, accs = ttt_loss(draft, *b, 7)
    print(name, "teacher-forced on benchmark outputs: loss", round(float(loss), 3), "acc/step", " ".join(f"{a:.2f}" for a in accs), flush=True)
