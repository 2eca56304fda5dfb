"""Statistical losslessness of verify_sample (and greedy correctness), for both implementations.

What is tested.  One verify_sample call emits the tokens of the accepted path (without the root) followed by
next_token.  The logits of a sequence that leaves the tree are not available, so the target distribution is
only known for emitted tokens whose prefix stays inside the tree:

* the FIRST emitted token has the warped distribution of row 0;
* if the first emitted token is the token of a root child c (the lowest-index child carrying that token:
  a duplicate sibling is never reached), the walk is at c, and the SECOND emitted token has the warped
  distribution of row c; more generally, given that the path reaches node c, the token emitted after c
  (the next path token or next_token) has the warped distribution of row c.

So we test, for every setting: the first-token marginal; the joint distribution of the 2-token prefix with
cells (t1, t2) when t1 leads into the tree and (t1, *) when it does not; and the conditional next-token
distribution at every reachable node.  Each with scipy.stats.chisquare (cells with expected count < 5
merged) and p > 1e-4; a token with zero target probability must never be emitted.  The expected
distributions come from an independent HuggingFace-order warp written in tests/_oracles.py.

A negative control proves the machinery has power: two deliberately wrong samplers must be rejected with
p < 1e-6 by exactly the same checks.
"""
import numpy as np
import pytest
import scipy.stats

from _oracles import children_of, greedy_brute, random_tree, warped_probs
from conftest import to_numpy

N_CALLS = 100_000
# The NumPy twin draws 25,000 times (about 300 us a call in Python: 100,000 took 25-38 s per setting, 2.5 minutes
# of CI): it gives the C core's draws bit for bit (test_agree_verify_sample), and the negative controls below are
# rejected at this size too, so the smaller sample still has power against those errors.
N_CALLS_BY_IMPL = {"heterospec.ops": N_CALLS, "heterospec.reference": 25_000}
P_MIN = 1e-4

V = 8
#                 0   1  2  3  4  5  6  7  8  9  10  11
TREE_PARENTS = [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 5, 4]
TREE_TOKENS = [0, 2, 5, 2, 1, 3, 0, 4, 6, 6, 1, 7]
# root children 1 (token 2), 2 (5), 3 (2: duplicate of node 1, never reached), 4 (1);
# node 1 has three children (5, 6, 7); node 2 has two children with the same token; depth 3 through node 10.
UNREACHABLE = {3, 9}

SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.8), (0.8, 4, 0.9)]


def tree_logits():
    rng = np.random.default_rng(2024)
    x = rng.normal(size=(len(TREE_TOKENS), V)) * 0.5 - 0.5
    # make the in-tree continuations likely enough that every internal node is visited often
    x[0, [2, 5, 7, 1]] = [2.0, 1.6, 1.2, 0.9]  # top_k=3 keeps {2, 5, 7}: child 4 (token 1) is warped away
    x[1, [3, 4]] = [1.8, 1.1]
    x[1, 0] = -np.inf  # child 6 (token 0) of node 1 is masked in the target: never accepted
    x[2, 6] = 1.5
    x[4, 7] = 1.4
    x[5, 1] = 1.6
    return x.astype(np.float32)

# ---------------------------------------------------------------------------------------------- machinery


def chisq(observed, probs):
    """Chi-square goodness of fit with cells of expected count < 5 merged.  Returns the p-value (1.0 when
    fewer than two cells remain); an outcome in a cell of probability 0 is impossible under the target: 0.0."""
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    total = observed.sum()
    assert total > 0
    zero = probs <= 0
    if observed[zero].sum() > 0:
        return 0.0  # emitted something the target distribution never emits
    obs, exp = observed[~zero], probs[~zero] / probs[~zero].sum() * total
    order = np.argsort(exp)
    obs, exp = obs[order], exp[order]
    # merge the smallest cells together until the merged cell has expected count >= 5
    i = 0
    while i < len(exp) - 1 and exp[: i + 1].sum() < 5:
        i += 1
    if i > 0:
        obs = np.concatenate([[obs[: i + 1].sum()], obs[i + 1 :]])
        exp = np.concatenate([[exp[: i + 1].sum()], exp[i + 1 :]])
    if len(exp) < 2:
        return 1.0
    return float(scipy.stats.chisquare(obs, exp).pvalue)


def emitted(path, next_token, tokens):
    return [tokens[c] for c in path[1:]] + [next_token]


def lossless_pvalues(samples, tokens, parents, logits, temperature, top_k, top_p):
    """samples: list of (path list, next_token). Returns {test name: p-value}."""
    n = len(tokens)
    ch = children_of(parents)
    probs = [warped_probs(logits[i], temperature, top_k, top_p) for i in range(n)]
    # the node reached by emitting token t at node i (lowest-index child carrying t), if any
    step = [{} for _ in range(n)]
    for i in range(n):
        for c in ch[i]:
            step[i].setdefault(tokens[c], c)

    after = [np.zeros(V) for _ in range(n)]  # token emitted after reaching node i
    joint = np.zeros((V, V + 1))  # (first, second) with column V = "second undefined"
    for path, nxt in samples:
        seq = emitted(path, nxt, tokens)
        assert len(seq) == len(path)
        for depth, node in enumerate(path):
            after[node][seq[depth]] += 1
        joint[seq[0], seq[1] if len(seq) > 1 else V] += 1

    out = {"first": chisq(after[0], probs[0])}
    jp = np.zeros((V, V + 1))
    for t1 in range(V):
        if t1 in step[0]:
            jp[t1, :V] = probs[0][t1] * probs[step[0][t1]]
        else:
            jp[t1, V] = probs[0][t1]
    out["joint2"] = chisq(joint.ravel(), jp.ravel())
    for node in range(1, n):
        if after[node].sum() >= 50:
            out[f"after{node}"] = chisq(after[node], probs[node])
    return out, after


# ---------------------------------------------------------------------------------------------- the real thing


@pytest.mark.statistical
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "T%s-k%s-p%s" % s)
def test_verify_sample_lossless(impl, setting):
    temperature, top_k, top_p = setting
    tokens, parents, x = np.array(TREE_TOKENS), np.array(TREE_PARENTS), tree_logits()
    use_offset = top_k > 0  # alternate the two seeding schemes: seed = i, or fixed seed + offset = i * 64
    samples = []
    total_draws = 0
    for i in range(N_CALLS_BY_IMPL[impl.__name__]):
        if use_offset:
            path, nxt, draws = impl.verify_sample(
                tokens, parents, x, temperature=temperature, top_k=top_k, top_p=top_p, seed=987654321, offset=i * 64
            )
        else:
            path, nxt, draws = impl.verify_sample(
                tokens, parents, x, temperature=temperature, top_k=top_k, top_p=top_p, seed=i, offset=0
            )
        path = to_numpy(path).tolist()
        samples.append((path, nxt))
        total_draws += draws
        assert draws >= len(path)
    visited = set(c for p, _ in samples for c in p)
    assert not (visited & UNREACHABLE), "a duplicate sibling token was accepted twice"
    pvals, after = lossless_pvalues(samples, TREE_TOKENS, TREE_PARENTS, x, temperature, top_k, top_p)
    assert len(pvals) >= 5, pvals  # the tree is exercised: several conditional tests could run
    assert max(len(p) for p, _ in samples) >= 4  # depth-3 paths occur
    bad = {k: v for k, v in pvals.items() if v <= P_MIN}
    assert not bad, f"not lossless: {bad} (all: {pvals})"


# ---------------------------------------------------------------------------------------------- negative control


def wrong_sampler(kind, tokens, parents, x, temperature, top_k, top_p, n_calls, rng):
    """Deliberately wrong tree samplers (numpy uniforms, same walk otherwise):
    'no_renorm'   -- accept child t with probability p(t) of the ORIGINAL row distribution, never renormalised
                     after a rejection;
    'full_bonus'  -- correct acceptance, but the bonus token drawn from the un-residualised distribution."""
    ch = children_of(parents)
    probs = [warped_probs(x[i], temperature, top_k, top_p) for i in range(len(tokens))]
    uni = rng.random(size=(n_calls, 16))
    out = []
    for s in range(n_calls):
        u = iter(uni[s])
        node, path = 0, [0]
        while True:
            p = probs[node]
            resid = p.copy()
            rejected = set()
            nxt_node = None
            for c in ch[node]:
                t = tokens[c]
                if t in rejected:
                    continue
                mass = resid.sum()
                accept_p = p[t] if kind == "no_renorm" else resid[t] / mass
                if next(u) < accept_p:
                    nxt_node = c
                    break
                rejected.add(t)
                resid[t] = 0.0
            if nxt_node is None:
                dist = p if kind == "full_bonus" else resid / resid.sum()
                out.append((path, int(np.searchsorted(np.cumsum(dist), next(u) * dist.sum(), "right"))))
                break
            path.append(nxt_node)
            node = nxt_node
    return out


@pytest.mark.statistical
@pytest.mark.parametrize("n_calls", sorted(set(N_CALLS_BY_IMPL.values())))
@pytest.mark.parametrize("kind", ["no_renorm", "full_bonus"])
def test_negative_control_wrong_sampler_is_rejected(kind, n_calls):
    temperature, top_k, top_p = 1.0, 0, 1.0
    rng = np.random.default_rng(77)
    x = tree_logits()
    samples = wrong_sampler(kind, TREE_TOKENS, TREE_PARENTS, x, temperature, top_k, top_p, n_calls, rng)
    pvals, _ = lossless_pvalues(samples, TREE_TOKENS, TREE_PARENTS, x, temperature, top_k, top_p)
    assert min(pvals.values()) < 1e-6, pvals


@pytest.mark.statistical
def test_negative_control_correct_python_sampler_passes():
    """The same harness with a correct (residual) sampler written in the test is accepted: the machinery
    rejects wrong samplers because they are wrong, not because it rejects everything."""
    temperature, top_k, top_p = 0.8, 4, 0.9
    rng = np.random.default_rng(78)
    x = tree_logits()
    samples = wrong_sampler("correct", TREE_TOKENS, TREE_PARENTS, x, temperature, top_k, top_p, N_CALLS, rng)
    pvals, _ = lossless_pvalues(samples, TREE_TOKENS, TREE_PARENTS, x, temperature, top_k, top_p)
    assert min(pvals.values()) > P_MIN, pvals


# ---------------------------------------------------------------------------------------------- greedy


def test_verify_greedy_many_random_trees(impl):
    rng = np.random.default_rng(91)
    depths = []
    for trial in range(1500):
        v = int(rng.choice([2, 5, 8, 50]))
        n = int(rng.integers(1, 40))
        x = rng.integers(-3, 4, size=(n, v)).astype(np.float32)  # ties in the argmax
        tokens, parents, _ = random_tree(rng, n, v, p_greedy=0.7, logits=x)
        path, nxt = impl.verify_greedy(tokens, parents, x)
        want_path, want_next = greedy_brute(tokens, parents, x)
        assert to_numpy(path).tolist() == want_path
        assert nxt == want_next
        depths.append(len(want_path))
    assert max(depths) >= 5  # long accepted paths were exercised
