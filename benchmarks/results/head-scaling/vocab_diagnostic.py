# The draft-vocabulary diagnostic of RESULTS.md (issue 27): how much first-step accuracy the 8,192-token draft
# vocabulary costs on benchmark text, and whether the target's own output rows could score the tokens outside it
# without training.  Same 10 prompts as cycle_start_diagnostic.py (first 2 of each benchmark file, greedy, float32,
# 128 new tokens); teacher-forced step 0 at every answer position (anchor t, token t+1 -> token t+2).
#   draft Vd:   argmax of the head's logits over its vocabulary (a token outside it is a miss)
#   union:      the head's logits inside its vocabulary, lm_head_target(norm(h)) outside it, one argmax
#   target rows: lm_head_target(norm(h)) over the whole vocabulary (the head's trained rows unused)
# Run from the repository root: python3 benchmarks/results/head-scaling/vocab_diagnostic.py [HEAD...]
import json, sys
import numpy as np, torch
from heterospec.models.default import DEFAULT_HEAD, default_target
from heterospec.models.draft import Eagle3Draft
from bench_outputs import benchmark_outputs

model, tok = default_target()
qs, ids, ans, recs = benchmark_outputs(model, tok, 2, 128)
W = model.get_output_embeddings().weight.detach().float()
out = {}
for head in sys.argv[1:] or [DEFAULT_HEAD]:
    draft = Eagle3Draft.from_pretrained(head, target=model, dtype=torch.float32).eval()
    t2d = draft.t2d.cpu()
    used = torch.nonzero(t2d).view(-1)
    per = {}
    for (f, _), rec in zip(qs, recs):
        s = rec["ids"].long()
        S, P = s.numel(), rec["start"]
        with torch.no_grad():
            logits, h, _ = draft(draft.fuse(rec["taps"].float().unsqueeze(0)), s[1:].view(1, -1),
                                 torch.arange(S - 1).view(1, -1))
            full = draft.norm(h[0]) @ W.T                      # [S-1, V]: the target's rows
            union = full.clone()
            union[:, used] = float("-inf")
            best_out = union.max(-1)
            best_in = logits[0].max(-1)
            pick_union = torch.where(best_in.values >= best_out.values, used[best_in.indices], best_out.indices)
        truth = s[P + 1:]                                      # token t+2 for anchors t = P-1 .. S-3
        sl = slice(P - 1, S - 2)
        r = per.setdefault(f, np.zeros(5))
        r += [truth.numel(), float((draft.map_tokens(logits[0].argmax(-1))[sl] == truth).sum()),
              float((pick_union[sl] == truth).sum()), float((full.argmax(-1)[sl] == truth).sum()),
              float((~t2d[truth]).sum())]
    tot = sum(per.values())
    res = {k: {"positions": int(v[0]), "draft_vd_acc": v[1] / v[0], "union_acc": v[2] / v[0],
               "target_rows_acc": v[3] / v[0], "out_of_draft_vocab": v[4] / v[0]}
           for k, v in list(per.items()) + [("all", tot)]}
    out[head] = res
    print(head, json.dumps(res, indent=1), flush=True)
json.dump(out, open("benchmarks/results/head-scaling/vocab_diagnostic.json", "w"), indent=1)
