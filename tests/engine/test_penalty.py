"""A repetition penalty alone on the device (HuggingFace's ``RepetitionPenaltyLogitsProcessor``, the processor a
generation config's ``repetition_penalty`` makes): each node penalised at its own context's ids from the tree's
ancestor mask, against HuggingFace's processor called per node (:func:`processors.apply`, the host path); greedy
output equal to HF's ``generate`` for every method, batched with padding, with prompt lookup and in recorded steps;
the host path never taken.  The sampled distribution with a penalty: test_decoding's chi-square ``penalty3``."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft, OracleDraft  # noqa: E402
from _models import DEVICE, V, eagle3_head, prompts, reference_greedy, tiny_target  # noqa: E402

import heterospec  # noqa: E402
from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.engine import processors  # noqa: E402

MODE = True if DEVICE.type == "cuda" else "emulate"
Penalty = transformers.RepetitionPenaltyLogitsProcessor


def _ancestors(parents):
    """[B, T] parents (-1 at the root) -> [B, T, T] bool ancestor-or-self, by walking each node up."""
    B, T = parents.shape
    out = np.zeros((B, T, T), dtype=bool)
    for b in range(B):
        for i in range(T):
            j = i
            while j >= 0:
                out[b, i, j] = True
                j = int(parents[b, j])
    return torch.from_numpy(out)


@pytest.mark.parametrize("skip", [0, 2])
def test_penalise_is_hfs_processor_at_every_node_with_its_own_path(skip):
    """Random trees of 3 rows (9 nodes, tokens drawn from 12 ids so paths repeat the context), random logits of
    both signs: penalise with seen_from equals HuggingFace's processor called per node with the row's context and
    the node's path (processors.apply), bit for bit; with ``skip``, the first ids of each context do not count, as
    prompt_ignore_length does."""
    g = torch.Generator().manual_seed(3 + skip)
    B, T, W = 3, 9, 40
    parents = torch.full((B, T), -1, dtype=torch.long)
    for i in range(1, T):
        parents[:, i] = torch.randint(0, i, (B,), generator=g)
    tokens = torch.randint(0, 12, (B, T), generator=g)
    contexts = [torch.randint(0, 12, (n,), generator=g).tolist() + [int(tokens[b, 0])] for b, n in enumerate((5, 2, 8))]
    logits = torch.randn(B, T, W, generator=g) * 4
    ref = processors.apply([(Penalty(1.7, prompt_ignore_length=skip),)] * B, contexts, tokens, parents,
                           torch.full((B,), T), logits)
    seen = torch.zeros(B, W + 1, dtype=torch.bool)
    processors.seen_from(contexts, [skip] * B, seen)
    out = processors.penalise(logits, tokens, _ancestors(parents), seen, 1.7)
    assert torch.equal(out, ref)
    assert not torch.equal(out, logits)
    # the accepted path joins the context: a row's next tree sees it
    processors.see(seen, torch.tensor([[4, 30, 31], [5, 32, 33], [6, 34, 35]]), torch.tensor([3, 1, 0]))
    assert seen[0, [4, 30, 31]].all() and seen[1, 5] and not seen[1, 32] and not seen[2, [34, 35]].any()


def test_penalise_draft_is_hfs_processor_on_each_beams_path():
    """The draft's distributions (8 draft ids mapped by d2t into 20 target ids) at the root expansion and two
    levels down, penalised on the device with the row's context, its root and each beam's path: equal to
    HuggingFace's processor called per beam in the target's vocabulary (processors.apply_draft, the host path)."""
    from heterospec.growth import Growth

    g0 = torch.Generator().manual_seed(11)
    B, K, Vd, W = 2, 3, 8, 20
    d2t = torch.tensor([0, 1, 1, 3, 5, 6, 9, 12])            # draft id j -> target id j + d2t[j]
    tid = torch.arange(Vd) + d2t
    root = tid[torch.tensor([2, 5])]                         # each row's root token, a draft-reachable id
    contexts = [[int(t) for t in tid[torch.randint(0, Vd, (n,), generator=g0)]] + [int(r)]
                for n, r in zip((4, 6), root)]
    seen = torch.zeros(B, W + 1, dtype=torch.bool)
    processors.seen_from([c[:-1] for c in contexts], [0, 0], seen)     # the root comes from the cycle's state
    rows = [(Penalty(1.9),)] * B
    g = None
    for level in range(3):
        logits = torch.randn(B, 1 if g is None else K, Vd, generator=g0) * 3
        out = processors.penalise_draft(seen, root, 1.9, g, logits, d2t)
        ref = processors.apply_draft(rows, contexts, W, g, logits, d2t)
        assert torch.equal(out, ref), level
        assert not torch.equal(out, logits)
        g = Growth.root(logits, K, d2t) if g is None else g.extend(logits, d2t)


def test_on_device_takes_a_penalty_alone_and_leaves_anything_else_to_the_host():
    rows = processors.check(Penalty(1.3), 2)
    assert processors.on_device(rows) == (1.3, [0, 0])
    per_row = [(Penalty(1.3, prompt_ignore_length=2),), (Penalty(1.3, prompt_ignore_length=0),)]
    assert processors.on_device(per_row) == (1.3, [2, 0])
    assert processors.on_device(processors.check(Penalty(1.3, torch.tensor([1, 4])), 2)) == (1.3, [1, 4])
    assert processors.on_device([(Penalty(1.3),), (Penalty(1.5),)]) is None
    assert processors.on_device(processors.check([Penalty(1.3), transformers.NoRepeatNGramLogitsProcessor(2)], 1)) \
        is None
    assert processors.on_device(processors.check(lambda ids, s: s, 1)) is None
    assert processors.on_device([]) is None


def test_the_repetition_penalty_argument_goes_first_in_each_rows_list():
    def a(ids, scores):
        return scores

    def b(ids, scores):
        return scores

    assert processors.with_penalty(None, [a], 1) == [a] and processors.with_penalty(1.0, None, 1) is None
    (pen,) = processors.with_penalty(1.3, None, 1)
    assert type(pen) is Penalty and pen.penalty == 1.3
    got = processors.with_penalty(1.3, a, 1)
    assert [type(x) for x in got] == [Penalty, type(a)] and got[1] is a
    rows = processors.with_penalty(1.3, [[a], [b]], 2)
    assert [r[1:] for r in rows] == [[a], [b]] and all(type(r[0]) is Penalty for r in rows)


def _methods(model, tmp_path):
    return {"ar": (None, None), "eagle3-oracle": (OracleDraft(model), Policy.static(5, 3, 16)),
            "heterospec-noisy": (NoisyDraft(32, V, seed=3).to(DEVICE), Policy.paper(4, 4, 20, (0.5, 1.0, 1.5))),
            "eagle3-head": (eagle3_head(model, tmp_path), Policy.static(4, 3, 12))}


@pytest.fixture
def host_path_forbidden(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the host processors ran for a penalty alone")
    monkeypatch.setattr(processors, "apply", refuse)
    monkeypatch.setattr(processors, "apply_draft", refuse)


@pytest.mark.parametrize("graphs", [False, MODE], ids=["eager", "recorded"])
@pytest.mark.parametrize("method", ["ar", "eagle3-oracle", "heterospec-noisy", "eagle3-head"])
def test_a_penalty_alone_keeps_greedy_output_equal_to_hf_generate(method, graphs, tmp_path, host_path_forbidden):
    """Greedy with repetition_penalty 1.8: HeteroSpec.generate and custom_generate (the generation config's option)
    equal HuggingFace's generate, for every method, eager and in recorded steps; the penalty changes the output."""
    model = tiny_target("qwen2")
    draft, policy = _methods(model, tmp_path)[method]
    changed = 0
    with HeteroSpec(model, draft, policy, cuda_graphs=graphs) as hs:
        for p in prompts(4):
            kw = dict(attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=30, pad_token_id=0,
                      eos_token_id=None, repetition_penalty=1.8)
            ref = model.generate(p, min_new_tokens=30, **kw).cpu()
            out, stats = hs.generate(p, max_new_tokens=30, eos_token_id=[], logits_processor=[Penalty(1.8)])
            assert out.tolist() == ref.tolist()
            assert (stats.captured_steps > 0) == bool(graphs)
            assert hs.generate(p, max_new_tokens=30, eos_token_id=[], repetition_penalty=1.8)[0].tolist() == \
                ref.tolist()
            changed += ref.tolist() != reference_greedy(model, p, 30).tolist()
            via_hf = model.generate(p, custom_generate=heterospec.custom_generate, draft=draft, policy=policy, **kw)
            assert via_hf.tolist() == ref.tolist()
    assert changed >= 3
    if method == "eagle3-oracle":
        assert stats.tau > 1.2


@pytest.mark.parametrize("graphs", [False, MODE], ids=["eager", "recorded"])
def test_a_penalty_over_a_padded_batch_with_prompt_lookup_is_hfs(graphs, host_path_forbidden):
    """A left-padded batch of 3 through custom_generate (HF gives the penalty each row's padding length to skip)
    with prompt-lookup chains grafted onto the noisy draft's trees: HuggingFace's own padded-batch output."""
    model = tiny_target("llama")
    ps = prompts(3)
    S = max(p.shape[1] for p in ps)
    ids = torch.stack([torch.cat([torch.zeros(S - p.shape[1], dtype=torch.long, device=DEVICE), p[0]]) for p in ps])
    mask = torch.stack([torch.arange(S, device=DEVICE) >= S - p.shape[1] for p in ps]).long()
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0,
              eos_token_id=None, repetition_penalty=1.6)
    ref = model.generate(ids, **kw).cpu()
    draft = NoisyDraft(32, V, seed=5).to(DEVICE)
    out = model.generate(ids, custom_generate=heterospec.custom_generate, draft=draft, policy=Policy.static(3, 3, 10),
                         cuda_graphs=graphs, prompt_lookup_num_tokens=4, max_matching_ngram_size=2, **kw)
    assert out.cpu().tolist() == ref.tolist()
    # generate(repetition_penalty=...) on the same padded tensor skips each row's padding too, as HF's option does
    with HeteroSpec(model, draft, Policy.static(3, 3, 10), cuda_graphs=graphs) as hs:
        ours, _ = hs.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0, eos_token_id=[],
                              repetition_penalty=1.6, prompt_lookup_num_tokens=4, max_matching_ngram_size=2)
    assert ours.tolist() == ref.tolist()
