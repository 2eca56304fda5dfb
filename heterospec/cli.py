"""The ``heterospec`` command line.

``heterospec demo`` for now walks one speculative-decoding cycle of the C core on synthetic logits (the
end-to-end demo on SmolLM2-135M-Instruct replaces it once the HuggingFace loop lands); ``heterospec info``
prints what the C core was compiled with.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _peaked_logits(rng, rows, vocab, sharpness):
    """Logits whose softmax puts most mass on a few tokens, like a trained LM's."""
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    hot = rng.integers(0, vocab, size=(rows, 4))
    for r in range(rows):
        x[r, hot[r]] += sharpness * np.array([3.0, 2.0, 1.0, 0.5], dtype=np.float32)
    return x


def demo(vocab=49152, k=10, depth=6, n_keep=59, seed=0, out=sys.stdout):
    """One EAGLE-3 style cycle on synthetic logits: expand the draft tree level by level, sum the top-k
    entropy along the most confident path (HeteroSpec Eq. 1), rerank, build the verification tree,
    accept greedily and by lossless sampling, and compact a KV cache.  Returns a dict of what happened."""
    from . import build_info, ops

    rng = np.random.default_rng(seed)
    timings = {}

    def timed(name, fn, *a, **kw):
        t0 = time.perf_counter()
        r = fn(*a, **kw)
        timings[name] = timings.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
        return r

    print(f"heterospec {build_info()['version']} demo: one speculative cycle on synthetic logits "
          f"(V={vocab}, top_k={k}, depth={depth}, Top-N={n_keep})", file=out)
    root_logits = _peaked_logits(rng, 1, vocab, 4.0)
    tok, sc, par, ent, beams = timed("expand", ops.expand, root_logits, np.zeros(1, np.float32),
                                     np.full(1, -1, np.int64), k)
    tokens, scores, parents, path_entropy = [tok], [sc], [par], [float(ent[0])]
    offset = k
    for _ in range(depth):
        level = _peaked_logits(rng, k, vocab, 4.0)
        all_scores = np.concatenate(scores)
        tok, sc, par, ent, new_beams = timed(
            "expand", ops.expand, level, all_scores[beams], beams, k, None, offset)
        # the most confident path continues through the best beam (row 0 of this level)
        path_entropy.append(float(ent[0]))
        tokens.append(tok), scores.append(sc), parents.append(par)
        beams, offset = new_beams, offset + k * k
    tokens, scores, parents = np.concatenate(tokens), np.concatenate(scores), np.concatenate(parents)
    h = float(np.sum(path_entropy))
    thresholds = np.array([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    b = int(timed("bucketize", ops.bucketize, np.array([h]), thresholds)[0])
    print(f"  drafted {tokens.size} candidates; cumulative top-{k} entropy along the best path "
          f"{h:.3f} nats -> bin B{b} (illustrative thresholds)", file=out)
    sel = timed("select", ops.select, scores, n_keep)
    tree = timed("build_tree", ops.build_tree, tokens, parents, sel, 1)
    print(f"  verification tree: {tree.tokens.size} nodes, {tree.retrieve.shape[0]} leaves, "
          f"max depth {int(tree.depths.max())}", file=out)
    # a target that agrees with the draft's best child at each of the first few levels
    target = _peaked_logits(rng, tree.tokens.size, vocab, 1.0)
    node = 0
    for _ in range(4):
        kids = np.nonzero(tree.parents == node)[0]
        if kids.size == 0:
            break
        target[node, tree.tokens[kids[0]]] += 40.0
        node = int(kids[0])
    path, nxt = timed("verify_greedy", ops.verify_greedy, tree.tokens, tree.parents, target)
    print(f"  greedy: accepted {len(path) - 1} draft tokens {tree.tokens[path[1:]].tolist()} + next {nxt}",
          file=out)
    spath, snxt, draws = timed("verify_sample", ops.verify_sample, tree.tokens, tree.parents, target,
                               temperature=1.0, seed=seed, offset=0)
    print(f"  sampled (T=1): accepted {len(spath) - 1} + next {snxt} using {draws} Philox draws", file=out)
    kv = [np.zeros((1, 3, 512 + tree.tokens.size, 64), np.float32) for _ in range(60)]
    timed("kv_compact", ops.kv_compact, kv, 512, path)
    print("  op times (us, first call, this machine): " +
          ", ".join(f"{name} {us:.0f}" for name, us in timings.items()), file=out)
    return {"entropy": h, "bin": b, "tree_nodes": int(tree.tokens.size), "accepted": len(path) - 1,
            "next_token": int(nxt), "sample_accepted": len(spath) - 1, "timings_us": timings}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="heterospec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="one speculative cycle of the C core on synthetic logits")
    d.add_argument("--vocab", type=int, default=49152)
    d.add_argument("--seed", type=int, default=0)
    sub.add_parser("info", help="what the C core was compiled with")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        demo(vocab=args.vocab, seed=args.seed)
    else:
        from . import build_info

        print(json.dumps(build_info(), indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
