"""bf16 default pair: does HeteroSpec's greedy output equal our one-row ar's (same engine, bf16)?
patch=1: every linear layer's 1-row call padded to 2 rows (row-count-invariant on this CPU for M >= 2)."""
import json, sys, time, torch, heterospec
from heterospec.tools.prompts import encode_turn
patch, n_q, new = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
target, tok, draft = heterospec.default_pair(dtype=torch.bfloat16)
F = torch.nn.functional
if patch:
    def fwd(lin):
        w = lin.weight.detach(); b = None if lin.bias is None else lin.bias.detach()
        def f(x):
            s = x.shape; x2 = x.reshape(-1, s[-1])
            if x2.shape[0] == 1:
                y = F.linear(torch.cat([x2, x2]), w, b)[:1]
            else:
                y = F.linear(x2, w, b)
            return y.view(*s[:-1], y.shape[-1])
        return f
    for m in list(target.modules()) + list(draft.modules()):
        if isinstance(m, torch.nn.Linear):
            m.forward = fwd(m)
qs = []
for f in ("benchmarks/data/heldout/gsm8k_heldout.jsonl", "benchmarks/data/heldout/alpaca_seed_heldout.jsonl"):
    qs += [json.loads(l)["turns"][0] for l in open(f) if l.strip()][:n_q]
ids = [encode_turn(tok, [q], []) for q in qs]
pol = heterospec.default_policy("cpu")
out = {}
for name, p in (("ar", heterospec.Policy.autoregressive()), ("eagle3", heterospec.Policy.static(7, 10, 60)), ("heterospec", pol)):
    with heterospec.HeteroSpec(target, draft if p.drafts else None, p, cpu_gemm=False) as hs:
        hs.generate(ids[0], max_new_tokens=8)
        t = time.perf_counter(); seqs = []; n = 0
        for x in ids:
            s, st = hs.generate(x, max_new_tokens=new); seqs.append(s[0, x.shape[1]:].tolist()); n += st.new_tokens
        out[name] = (seqs, n / (time.perf_counter() - t))
for name in ("eagle3", "heterospec"):
    bad = [(i, next((k for k, (a, b) in enumerate(zip(out["ar"][0][i], out[name][0][i])) if a != b), None)) for i in range(len(ids)) if out["ar"][0][i] != out[name][0][i]]
    print(f"patch={patch} {name}: {len(bad)} of {len(ids)} differ from bf16 ar {bad}; tok/s {out[name][1]:.1f} (ar {out['ar'][1]:.1f})")
