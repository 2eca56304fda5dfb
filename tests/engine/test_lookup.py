"""Prompt lookup inside the cycle (heterospec/engine/lookup.py): the n-gram index's proposals; the graft of a
chain onto a verification tree, written out by hand and on random trees, for the device graft and a NumPy host loop
alike; greedy output equal to HuggingFace's generate with a chain grafted onto no tree, a noisy draft's and a
binned policy's, alone and batched; no host read beyond the cycle's own; bad arguments.  The sampled distribution
with chains is in test_decoding's chi-square cases, recorded steps with chains in test_graphs / test_batch_graphs."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft, OracleDraft  # noqa: E402
from _models import DEVICE, NEW, THRESHOLDS, V, prompts, reference_greedy, tiny_target  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.engine import lookup, sync  # noqa: E402


def test_the_index_proposes_what_followed_the_latest_longest_suffix():
    idx = lookup.NgramIndex([5, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2], max_ngram=2)
    assert idx.propose(3) == [4, 8, 1]            # (1, 2) last occurred at 5: what followed it there
    idx.extend([4])
    assert idx.propose(5) == [8, 1, 2, 4]         # (2, 4) at 6, cut at the context's end
    idx.extend([7])
    assert idx.propose(2) == []                   # (4, 7) and (7,) never occurred before
    idx = lookup.NgramIndex([5, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2], max_ngram=2, min_ngram=2)
    idx.extend([6, 2])
    assert idx.propose(2) == []                   # (6, 2) is new; the one-token match (2,) is below min_ngram
    idx = lookup.NgramIndex([3, 3], max_ngram=3)
    assert idx.propose(4) == [3]                  # the suffix never matches itself: (3,) at 0, followed by 3
    idx = lookup.NgramIndex([7], max_ngram=3)
    assert idx.propose(4) == []
    idx = lookup.NgramIndex([1, 2, 3, 1, 2, 9, 2, 3, 5, 1, 2, 3], max_ngram=3)
    assert idx.propose(2) == [1, 2]               # the longest suffix first: (1, 2, 3) at 0, not (2, 3) at 6


def _graft_numpy(tokens, parents, depths, mask, n_real, chains, T):
    """The graft written as a host loop in NumPy, independently of lookup.graft (which runs on the device with
    fixed shapes): the reference both implementations of the tests below are held to.  Inputs padded to any width
    <= T; returns the five outputs padded to T."""
    tk, pa, de, mk, nr = (np.asarray(x) for x in (tokens, parents, depths, mask, n_real))
    B = tk.shape[0]
    out_tk = np.repeat(tk[:, :1], T, axis=1)          # the padding rule: root token, depth 1, sees root and itself
    out_pa = np.zeros((B, T), dtype=np.int64)
    out_de = np.ones((B, T), dtype=np.int64)
    out_mk = np.zeros((B, T, T), dtype=bool)
    out_mk[:, :, 0] = True
    out_mk[:, np.arange(T), np.arange(T)] = True
    sizes = []
    for b in range(B):
        n = int(nr[b])
        out_tk[b, :n], out_pa[b, :n], out_de[b, :n] = tk[b, :n], pa[b, :n], de[b, :n]
        out_mk[b, :n] = False
        out_mk[b, :n, :n] = mk[b, :n, :n]
        cur, i = 0, 0
        while i < len(chains[b]):                      # down the tree while a child holds the chain's next token
            kids = [j for j in range(1, n) if pa[b, j] == cur and tk[b, j] == chains[b][i]]
            if not kids:
                break
            cur, i = kids[0], i + 1
        for t in chains[b][i:]:                        # the rest: a new node under the last one
            out_tk[b, n], out_pa[b, n], out_de[b, n] = t, cur, out_de[b, cur] + 1
            out_mk[b, n] = False
            out_mk[b, n, :n] = out_mk[b, cur, :n]
            out_mk[b, n, n] = True
            cur, n = n, n + 1
        sizes.append(n)
    return out_tk, out_pa, out_de, out_mk, np.array(sizes)


def _pad(tokens, parents, depths, mask, T):
    """A tree padded by the one padding rule to T nodes (the room verification_tree leaves for the chains)."""
    B, T0 = tokens.shape
    tk = torch.cat([tokens, tokens[:, :1].expand(B, T - T0)], 1)
    pa = torch.cat([parents, torch.zeros((B, T - T0), dtype=torch.long)], 1)
    de = torch.cat([depths, torch.ones((B, T - T0), dtype=torch.long)], 1)
    mk = torch.nn.functional.pad(mask, (0, T - T0, 0, T - T0))
    mk[:, T0:, 0] = True
    mk[:, range(T0, T), range(T0, T)] = True
    return tk, pa, de, mk


def _graft_device(tokens, parents, depths, mask, n_real, chains, T):
    """lookup.graft on the test device, the chains packed as the cycle packs them (lookup.pack)."""
    L = max(4, max(map(len, chains)))
    packed = torch.tensor(lookup.pack(chains, L)).to(DEVICE)
    tree = [x.to(DEVICE) for x in _pad(tokens, parents, depths, mask, T)]
    out = lookup.graft(*tree, n_real.to(DEVICE), packed[:, 1:], packed[:, 0])
    return [x.cpu().numpy() for x in out]


GRAFTS = {"device": _graft_device, "numpy": _graft_numpy}


def _tree():
    """Two rows padded to 4 nodes: row 0 = root 10 with children 11 (node 1) and 12 (node 2), node 3 = 13 under
    node 1; row 1 = root 20 alone, then padding (root token, depth 1, parent 0, sees the root and itself)."""
    tokens = torch.tensor([[10, 11, 12, 13], [20, 20, 20, 20]])
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 0, 0]])
    depths = torch.tensor([[0, 1, 1, 2], [0, 1, 1, 1]])
    mask = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                         [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]], dtype=torch.bool)
    return tokens, parents, depths, mask, torch.tensor([4, 1])


@pytest.mark.parametrize("impl", list(GRAFTS))
def test_graft_follows_the_tree_then_hangs_the_rest_below(impl):
    # row 0's chain 11, 13 is already the path to node 3, then 14 and 15 hang below it; row 1's chain is new
    t, p, d, m, n2 = GRAFTS[impl](*_tree(), [[11, 13, 14, 15], [21, 22]], 7)
    assert n2.tolist() == [6, 3]
    assert t.tolist() == [[10, 11, 12, 13, 14, 15, 10], [20, 21, 22, 20, 20, 20, 20]]
    assert p.tolist() == [[-1, 0, 0, 1, 3, 4, 0], [-1, 0, 1, 0, 0, 0, 0]]
    assert d.tolist() == [[0, 1, 1, 2, 3, 4, 1], [0, 1, 2, 1, 1, 1, 1]]
    want = [[[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0],
             [1, 1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 1]],
            [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 0, 0, 0],
             [1, 0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0, 1]]]
    assert m.astype(int).tolist() == want


@pytest.mark.parametrize("impl", list(GRAFTS))
def test_graft_never_adds_a_sibling_with_a_token_already_there(impl):
    # a chain inside the tree adds nothing; one that leaves it at the root's child 12 hangs below node 2
    t, p, d, m, n2 = GRAFTS[impl](*_tree(), [[11, 13], [20]], 4)
    assert n2.tolist() == [4, 2] and t.tolist() == [[10, 11, 12, 13], [20, 20, 20, 20]]
    assert p.tolist()[1] == [-1, 0, 0, 0] and d.tolist()[1] == [0, 1, 1, 1]
    t, p, d, m, n2 = GRAFTS[impl](*_tree(), [[12, 16], []], 5)
    assert n2.tolist() == [5, 1] and t.tolist()[0] == [10, 11, 12, 13, 16] and p.tolist()[0] == [-1, 0, 0, 1, 2]
    assert m[0, 4].astype(int).tolist() == [1, 0, 1, 0, 1] and d.tolist()[0][4] == 2
    # a chain that leaves the tree below its deepest matching node, not at a deeper node of another branch
    t, p, d, m, n2 = GRAFTS[impl](*_tree(), [[12, 13], [13]], 6)
    assert n2.tolist() == [5, 2] and t.tolist()[0][4] == 13 and p.tolist()[0][4] == 2 and d.tolist()[0][4] == 2


def _random_tree(rng, n, K, V):
    """A tree of n real nodes grown level by level like a draft's: each node's children hold distinct tokens."""
    tokens, parents, depths = [int(rng.integers(V))], [-1], [0]
    while len(tokens) < n:
        par = int(rng.integers(len(tokens)))
        used = {tokens[j] for j in range(1, len(tokens)) if parents[j] == par}
        free = [t for t in range(V) if t not in used]
        if len([j for j in parents if j == par]) >= K or not free:
            continue
        tokens.append(int(rng.choice(free)))
        parents.append(par)
        depths.append(depths[par] + 1)
    mask = np.zeros((n, n), dtype=bool)
    for j in range(n):
        a = j
        while a >= 0:
            mask[j, a] = True
            a = parents[a]
    return tokens, parents, depths, mask


def test_the_device_graft_equals_the_host_loop_on_random_trees():
    """Random trees (small vocabularies, so chains often follow a branch for a while) and chains that start along
    a random path: the device graft equals the NumPy host loop in every output, including the padding."""
    rng = np.random.default_rng(7)
    for trial in range(60):
        B, V, L = 3, int(rng.integers(2, 6)), int(rng.integers(1, 7))
        trees = [_random_tree(rng, int(rng.integers(1, 12)), 3, V) for _ in range(B)]
        T0 = max(len(t[0]) for t in trees)
        T = T0 + L + int(rng.integers(0, 3))
        tk = torch.zeros((B, T0), dtype=torch.long)
        pa, de = torch.zeros_like(tk), torch.ones_like(tk)
        mk = torch.zeros((B, T0, T0), dtype=torch.bool)
        chains = []
        for b, (t, p, d, m) in enumerate(trees):
            n = len(t)
            tk[b] = t[0]
            tk[b, :n], pa[b, :n], de[b, :n] = torch.tensor(t), torch.tensor(p), torch.tensor(d)
            mk[b, :, 0] = True
            mk[b, range(T0), range(T0)] = True
            mk[b, :n] = False
            mk[b, :n, :n] = torch.from_numpy(m)
            # a chain along a random path from the root for a while, then random tokens
            path, cur = [], 0
            while True:
                kids = [j for j in range(1, n) if p[j] == cur]
                if not kids or rng.random() < 0.25:
                    break
                cur = int(rng.choice(kids))
                path.append(t[cur])
            chain = (path + [int(x) for x in rng.integers(0, V, L)])[:int(rng.integers(0, L + 1))]
            chains.append(chain)
        n_real = torch.tensor([len(t[0]) for t in trees])
        want = _graft_numpy(tk, pa, de, mk, n_real, chains, T)
        got = _graft_device(tk, pa, de, mk, n_real, chains, T)
        for name, w, g in zip(("tokens", "parents", "depths", "mask", "n_real"), want, got):
            assert np.array_equal(w, g), (trial, name, chains)


CASES = {
    "autoregressive": lambda m: (None, None),
    "eagle3-noisy": lambda m: (NoisyDraft(32, V).to(DEVICE), Policy.static(5, 3, 16)),
    "heterospec-noisy": lambda m: (NoisyDraft(32, V, seed=3).to(DEVICE), Policy.paper(4, 4, 20, THRESHOLDS)),
    "eagle3-oracle": lambda m: (OracleDraft(m), Policy.static(3, 2, 6)),
}


@pytest.mark.parametrize("method", list(CASES))
def test_prompt_lookup_keeps_greedy_output_equal_to_hf_generate(method):
    """Chains of 6 grafted onto each method's trees: every output equals HuggingFace's greedy generate, alone and in
    a batch; chains were verified and, for the autoregressive engine, accepted (tau > 1 from lookup alone)."""
    model = tiny_target("llama")
    draft, policy = CASES[method](model)
    ps = prompts(6)
    refs = [reference_greedy(model, p) for p in ps]
    kw = dict(max_new_tokens=NEW, prompt_lookup_num_tokens=6, max_matching_ngram_size=3)
    with HeteroSpec(model, draft, policy, cuda_graphs=False) as hs:
        plain = [hs.generate(p, max_new_tokens=NEW)[1] for p in ps]
        runs = []
        for p, ref in zip(ps, refs):
            out, st = hs.generate(p, **kw)
            assert out.tolist() == ref.tolist()
            runs.append(st)
        outs, st = hs.generate([p[0] for p in ps], **kw)
        assert [o.tolist() for o in outs] == [r[0].tolist() for r in refs]

    def per_cycle(stats, field):
        return sum(getattr(s, field) for s in stats) / sum(s.cycles for s in stats)

    # the chains were verified with the trees (more nodes a cycle), and they were accepted (more tokens a cycle)
    assert per_cycle(runs, "verified_tokens") > per_cycle(plain, "verified_tokens")
    if method != "eagle3-oracle":                # the oracle's tree holds the target's own path already
        assert per_cycle(runs, "committed") > per_cycle(plain, "committed") + 0.1
    if method == "autoregressive":
        assert st.tau > 1.2, st.tau              # a chain alone, in the batch too


def test_custom_generate_takes_prompt_lookup_from_the_generation_config():
    """HF's own prompt_lookup_num_tokens through custom_generate: the same output as HF's greedy generate, and the
    chains were used (HF's prompt-lookup decoding is refused for batches; ours takes one)."""
    import heterospec

    model = tiny_target("llama")
    ps = prompts(3)
    kw = dict(do_sample=False, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None, prompt_lookup_num_tokens=5,
              max_matching_ngram_size=3)
    for p in ps:
        out = model.generate(p, attention_mask=torch.ones_like(p), custom_generate=heterospec.custom_generate, **kw)
        assert out.tolist() == reference_greedy(model, p).tolist()
    seen = []
    real = heterospec.HeteroSpec.generate

    def spy(self, *a, **k):
        seen.append((k["prompt_lookup_num_tokens"], k["max_matching_ngram_size"]))
        return real(self, *a, **k)

    heterospec.HeteroSpec.generate = spy
    try:
        model.generate(ps[0], attention_mask=torch.ones_like(ps[0]), custom_generate=heterospec.custom_generate, **kw)
    finally:
        heterospec.HeteroSpec.generate = real
    assert seen == [(5, 3)]


def test_prompt_lookup_adds_no_host_read():
    """The chains are grafted on the device: a call with prompt lookup reads the host at the cycle's own two
    points only (the bin and the accepted tokens), once each a cycle, and its chains were grafted."""
    model = tiny_target("llama")
    p = prompts(2)[1]
    record = []
    with HeteroSpec(model, NoisyDraft(32, V, seed=3).to(DEVICE), Policy.paper(4, 4, 20, THRESHOLDS),
                    cuda_graphs=False) as hs, sync.forbid_host_transfers(record):
        _, plain = hs.generate(p, max_new_tokens=NEW)
        del record[:]
        _, stats = hs.generate(p, max_new_tokens=NEW, prompt_lookup_num_tokens=4)
    assert record.count("accepted") == stats.cycles and record.count("bin") == stats.cycles
    assert set(record) == {"bin", "accepted"}
    assert stats.verified_tokens / stats.cycles > plain.verified_tokens / plain.cycles


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_lookup_num_tokens=-1), "argument 'prompt_lookup_num_tokens' expected None or an int in"),
    (dict(prompt_lookup_num_tokens=2.5), "argument 'prompt_lookup_num_tokens'"),
    (dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=0), "argument 'max_matching_ngram_size'"),
    (dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=2, min_matching_ngram_size=3),
     "argument 'min_matching_ngram_size' expected at most max_matching_ngram_size"),
])
def test_bad_prompt_lookup_arguments(kwargs, match):
    model = tiny_target("llama")
    with pytest.raises(ValueError, match=match):
        HeteroSpec(model, cuda_graphs=False).generate(prompts(1)[0], max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="HeteroSpec: " + match):
        HeteroSpec(model, cuda_graphs=False, **kwargs)


def test_the_engines_settings_are_each_calls_default():
    """HeteroSpec(prompt_lookup_num_tokens=...) turns lookup on for every call; a call's 0 turns it off."""
    model = tiny_target("llama")
    p = prompts(3)[2]
    with HeteroSpec(model, cuda_graphs=False, prompt_lookup_num_tokens=6, max_matching_ngram_size=3) as hs:
        on = hs.generate(p, max_new_tokens=NEW)[1]
        off = hs.generate(p, max_new_tokens=NEW, prompt_lookup_num_tokens=0)[1]
        assert hs.lookup == (6, 3, 1)
    assert off.tau == 1.0 and on.tau > 1.0 and on.verified_tokens > on.cycles
