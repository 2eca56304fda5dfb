"""Independent brute-force oracles used by the tests.

Nothing here imports heterospec: these are deliberately naive re-derivations of docs/ops.md (plain Python
loops and floats, scipy where it helps), so that the tests never compare an implementation with itself.
"""
import math

import numpy as np

M32 = 0xFFFFFFFF

# Random123 kat_vectors for philox4x32_10: (counter, key, expected output)
PHILOX_KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def _mulhilo(a, b):
    p = a * b
    return p >> 32, p & M32


def philox(counter, key):
    """Textbook Philox4x32-10: round, then bump the key, ten times."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0 = (k0 + 0x9E3779B9) & M32
            k1 = (k1 + 0xBB67AE85) & M32
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return (c0, c1, c2, c3)


def uniform(seed, offset, j):
    """u_j of docs/ops.md."""
    c = (offset + j) % (1 << 64)
    x0 = philox((c & M32, c >> 32, 0, 0), (seed & M32, seed >> 32))[0]
    return x0 / 4294967296.0


def argmax_loop(row):
    """argmax with ties to the lower id, by an explicit loop."""
    best = 0
    for v in range(1, len(row)):
        if row[v] > row[best]:
            best = v
    return best


def hf_keep(row, temperature, top_k, top_p, min_p=0.0):
    """HuggingFace TopK/TopP/MinP logits-warper semantics on one row, in its order -> (z float64, keep bool mask)."""
    z = np.asarray(row, dtype=np.float32).astype(np.float64) / temperature
    v = z.shape[0]
    keep = np.ones(v, dtype=bool)
    if 0 < top_k < v:
        kth = np.sort(z)[::-1][top_k - 1]  # torch.topk(scores, top_k)[0][..., -1]
        keep &= ~(z < kth)
    if top_p < 1.0:
        masked = np.where(keep, z, -np.inf)
        # torch.sort(ascending) with the docs' tie rule: (z ascending, id descending)
        order = sorted(range(v), key=lambda i: (masked[i], -i))
        zs = masked[order]
        e = np.exp(zs - zs.max())
        probs = e / e.sum()
        cum = 0.0
        remove = []
        for p in probs:
            cum += p
            remove.append(cum <= 1.0 - top_p)
        remove[-1] = False  # min_tokens_to_keep = 1
        for pos, i in enumerate(order):
            if remove[pos]:
                keep[i] = False
    if min_p > 0.0:
        # MinPLogitsWarper: probs = softmax of the kept z; remove probs < min_p * max probs.  The sum cancels in
        # the ratio, and the largest kept z is the largest z (top-k and top-p always keep the top token).
        zmax = max(float(a) for a in z)
        for i in range(v):
            if keep[i] and math.exp(float(z[i]) - zmax) < min_p:
                keep[i] = False
    return z, keep


def warped_probs(row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The exact (normalised) warped target distribution of one row."""
    z, keep = hf_keep(row, temperature, top_k, top_p, min_p)
    zz = np.where(keep, z, -np.inf)
    e = np.exp(zz - zz.max())
    return e / e.sum()


def children_of(parents):
    ch = [[] for _ in range(len(parents))]
    for i in range(1, len(parents)):
        ch[int(parents[i])].append(i)
    return ch


def sample_walk(tree_tokens, tree_parents, logits, temperature, top_k, top_p, seed, offset, min_p=0.0):
    """docs/ops.md 'Walk' written out with Python floats -> (path list, next_token, draws)."""
    tokens = [int(t) for t in tree_tokens]
    ch = children_of(tree_parents)
    node, path, j = 0, [0], 0
    while True:
        z, keep = hf_keep(logits[node], temperature, top_k, top_p, min_p)
        zmax = max(float(x) for x in z)
        w = [math.exp(float(z[v]) - zmax) if keep[v] else 0.0 for v in range(len(z))]
        total = 0.0
        for x in w:
            total += x
        rejected = []
        moved = False
        for c in ch[node]:
            t = tokens[c]
            if t in rejected:
                continue
            u = uniform(seed, offset, j)
            j += 1
            if w[t] > 0.0 and u * total < w[t]:
                path.append(c)
                node = c
                moved = True
                break
            rejected.append(t)
            total -= w[t]
            w[t] = 0.0
        if moved:
            continue
        u = uniform(seed, offset, j)
        j += 1
        s = 0.0
        for x in w:
            s += x
        if s == 0.0:
            return path, rejected[-1], j
        run = 0.0
        for v, x in enumerate(w):
            run += x
            if run > u * s:
                return path, v, j


def greedy_brute(tree_tokens, tree_parents, logits):
    """Deepest node whose root path follows the step-by-step argmax (lowest-index child on duplicates)."""
    n = len(tree_tokens)
    ch = children_of(tree_parents)
    best_path = [0]
    for node in range(n):
        chain = [node]
        while chain[-1] != 0:
            chain.append(int(tree_parents[chain[-1]]))
        chain.reverse()
        ok = True
        for a, b in zip(chain, chain[1:]):
            want = argmax_loop(logits[a])
            first = [c for c in ch[a] if int(tree_tokens[c]) == want]
            if not first or first[0] != b:
                ok = False
                break
        if ok and len(chain) > len(best_path):
            best_path = chain
    return best_path, argmax_loop(logits[best_path[-1]])


def tree_oracle(tokens, parents, selected, root_token):
    """build_tree by walking parent pointers -> dict of expected arrays."""
    sel = [int(s) for s in selected]
    where = {cand: i + 1 for i, cand in enumerate(sel)}
    n = len(sel)
    t_tok = [int(root_token)] + [int(tokens[s]) for s in sel]
    t_par = [-1] + [0 if int(parents[s]) == -1 else where[int(parents[s])] for s in sel]

    def ancestors(i):
        out = [i]
        while out[-1] != 0:
            out.append(t_par[out[-1]])
        return out

    depths = [len(ancestors(i)) - 1 for i in range(n + 1)]
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    for i in range(n + 1):
        for j in ancestors(i):
            mask[i, j] = True
    leaves = [i for i in range(n + 1) if i not in t_par[1:]]
    width = max(depths) + 1
    retrieve = np.full((len(leaves), width), -1, dtype=np.int64)
    for r, leaf in enumerate(leaves):
        chain = ancestors(leaf)[::-1]
        retrieve[r, : len(chain)] = chain
    return dict(
        tokens=np.array(t_tok, np.int64),
        parents=np.array(t_par, np.int64),
        depths=np.array(depths, np.int64),
        mask=mask,
        retrieve=retrieve,
    )


def random_forest(rng, m, p_root=0.3):
    """Candidate parents with parents[i] in [-1, i)."""
    par = np.empty(m, dtype=np.int64)
    for i in range(m):
        par[i] = -1 if i == 0 or rng.random() < p_root else rng.integers(0, i)
    return par


def parent_closure(parents, picks):
    """Smallest parent-closed superset of picks, ascending."""
    out = set()
    for p in picks:
        p = int(p)
        while p != -1 and p not in out:
            out.add(p)
            p = int(parents[p])
    return np.array(sorted(out), dtype=np.int64)


def random_tree(rng, n, v, p_greedy=0.6, logits=None):
    """A random verification tree (tree_parents[i] < i) whose tokens often follow the target argmax."""
    if logits is None:
        logits = rng.normal(size=(n, v)).astype(np.float32)
    parents = np.empty(n, dtype=np.int64)
    parents[0] = -1
    tokens = np.empty(n, dtype=np.int64)
    tokens[0] = rng.integers(0, v)
    for i in range(1, n):
        parents[i] = rng.integers(0, i)
        if rng.random() < p_greedy:
            tokens[i] = argmax_loop(logits[parents[i]])
        else:
            tokens[i] = rng.integers(0, v)
    return tokens, parents, logits
