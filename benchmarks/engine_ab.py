"""Tokens per second of the engine at batch 1 and a batch, for a paired A/B of two source trees (issue 45).

    PYTHONPATH=TREE python benchmarks/engine_ab.py [--batch 4] [--prompts 4] [--new 64] --out FILE.json

Imports ``heterospec`` from wherever ``PYTHONPATH`` points (a checkout, or a worktree of another commit with the
C extension copied in), runs the default pair in float32 on the CPU -- ``ar``, ``eagle3`` (EAGLE-3's static
tree) and ``heterospec`` (the shipped profile) -- on the first ``--prompts`` demo prompts: each alone (batch 1),
then all at once (a batch), greedy, ``--new`` new tokens, and writes tokens/s and the output tokens (so two trees
can be checked equal as well as timed).  One warm-up call per method first.  Alternate two trees' runs and take
medians: this machine's speed drifts.
"""
import argparse
import json
import os
import sys
import time


def main(argv=None):
    import torch

    import heterospec
    from heterospec import HeteroSpec, Policy
    from heterospec.models.default import DEFAULT_HEAD, default_target
    from heterospec.models.draft import Eagle3Draft
    from heterospec.policy.profile import load_profile, shipped_profile
    from heterospec.tools.prompts import encode

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    model, tok = default_target()
    draft = Eagle3Draft.from_pretrained(DEFAULT_HEAD, target=model)
    here = os.path.dirname(heterospec.__file__)
    with open(os.path.join(here, "data", "demo_prompts.json")) as f:
        texts = json.load(f)["prompts"][: a.prompts]
    ids = [encode(tok, t).view(-1) for t in texts]
    methods = {"ar": (None, None), "eagle3": (draft, Policy.static()),
               "heterospec": (draft, load_profile(shipped_profile()[0])[0])}
    out = {"tree": here, "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": {}}
    for name, (d, pol) in methods.items():
        with HeteroSpec(model, d, pol) as hs:
            hs.generate(ids[0].view(1, -1), max_new_tokens=8, eos_token_id=[])        # warm-up
            t0 = time.perf_counter()
            one = [hs.generate(p.view(1, -1), max_new_tokens=a.new, eos_token_id=[])[0][0, p.numel():].tolist()
                   for p in ids]
            t1 = time.perf_counter()
            seqs, _ = hs.generate(ids[: a.batch], max_new_tokens=a.new, eos_token_id=[])
            t2 = time.perf_counter()
        many = [s[p.numel():].tolist() for s, p in zip(seqs, ids)]
        out["rows"][name] = {"batch1_tokens_per_s": sum(map(len, one)) / (t1 - t0),
                             f"batch{a.batch}_tokens_per_s": sum(map(len, many)) / (t2 - t1),
                             "batch1_tokens": one, f"batch{a.batch}_tokens": many}
        print(f"{name}: batch 1 {out['rows'][name]['batch1_tokens_per_s']:.1f} tokens/s, batch {a.batch} "
              f"{out['rows'][name][f'batch{a.batch}_tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    with open(a.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
