# The cycle-start diagnostic of RESULTS.md (issue 27): is the in-engine acceptance of the first draft token lower
# than teacher-forced accuracy because of where cycles start (selection), because of the draft vocabulary, or
# because the engine feeds the head something other than what it was trained on (a mismatch)?
#
# For the first 2 questions of each benchmark file (greedy, float32, 128 new tokens; bench_outputs.py):
# 1. the target's greedy output; one teacher-forced forward gives the head's step-0 prediction at every position
#    (anchor t, token t+1 -> token t+2), compared with the output itself; positions whose token is outside the
#    draft vocabulary count as misses (the engine cannot draft them);
# 2. the engine, simulated from those predictions: a depth-1 chain accepts at the cycle's position iff the
#    teacher-forced prediction there is right, and the next cycle starts 2 tokens later on an accept, 1 on a miss;
# 3. the engine itself (HeteroSpec, static depth 1, top-1, 2 nodes) on the same prompts: its acceptance rate.
# If 3 equals 2, the engine feeds the head exactly what training did and the gap to 1 is selection.
# Run from the repository root: python3 benchmarks/results/head-scaling/cycle_start_diagnostic.py [HEAD...]
import json, sys
import numpy as np, torch
from heterospec import HeteroSpec, Policy
from heterospec.models.default import DEFAULT_HEAD, default_target
from heterospec.models.draft import Eagle3Draft
from bench_outputs import benchmark_outputs

N_NEW = 128
model, tok = default_target()
qs, ids, ans, recs = benchmark_outputs(model, tok, 2, N_NEW)

out = {}
for head in sys.argv[1:] or [DEFAULT_HEAD]:
    draft = Eagle3Draft.from_pretrained(head, target=model, dtype=torch.float32).eval()
    t2d = draft.t2d.cpu()
    tf_hit = tf_n = oov = sim_acc = sim_cyc = 0
    per_file = {}
    for (f, _), rec in zip(qs, recs):
        s = rec["ids"].long()
        S, P = s.numel(), rec["start"]
        with torch.no_grad():
            hid = draft.fuse(rec["taps"].float().unsqueeze(0))
            logits, _, _ = draft(hid, s[1:].view(1, -1), torch.arange(S - 1).view(1, -1))
        pred = draft.map_tokens(logits[0].argmax(-1)).cpu()   # pred[t]: the head's token t+2 from anchor t
        hit = np.zeros(S, dtype=bool)                          # hit[n]: token n+1 drafted right at a cycle on n
        for n in range(P, S - 1):
            hit[n] = bool(pred[n - 1] == s[n + 1])
        tf_hit += int(hit[P:S - 1].sum()); tf_n += S - 1 - P
        oov += int((~t2d[s[P + 1:]]).sum())
        n, a, c = P, 0, 0
        while n < S - 1:
            c += 1
            a += int(hit[n])
            n += 2 if hit[n] else 1
        sim_acc += a; sim_cyc += c
        pf = per_file.setdefault(f, [0, 0]); pf[0] += a; pf[1] += c
    acc_e = cyc_e = 0
    same = True
    with HeteroSpec(model, draft, Policy.static(1, 1, 2)) as hs:
        for p, a in zip(ids, ans):
            toks, st = hs.generate(torch.from_numpy(p).view(1, -1), max_new_tokens=N_NEW, eos_token_id=tok.eos_token_id)
            same &= np.array_equal(np.asarray(toks).reshape(-1)[-len(a):], a)
            acc_e += st.accepted_hist.get(1, 0); cyc_e += st.cycles
    r = {"teacher_forced_acc_all_positions": tf_hit / tf_n, "out_of_draft_vocab": oov / tf_n,
         "simulated_engine_acceptance": sim_acc / sim_cyc, "simulated_cycles": sim_cyc,
         "engine_acceptance": acc_e / cyc_e, "engine_cycles": cyc_e, "engine_output_equals_target": bool(same),
         "simulated_per_file": {f: a / c for f, (a, c) in per_file.items()}}
    out[head] = r
    print(head, json.dumps(r, indent=1), flush=True)
json.dump(out, open("benchmarks/results/head-scaling/cycle_start_diagnostic.json", "w"), indent=1)
