"""HeteroSpec.generate over a batch (issue 29): every row decodes losslessly on its own -- its greedy output equals
HuggingFace's greedy generate of that prompt alone and the engine's own batch-1 run, for autoregressive,
EAGLE-3 and HeteroSpec policies on Llama, Qwen2 and Qwen3 tiny targets -- with ragged per-row trees whose padding
is never accepted, rows that finish early dropped, per-row sampling keyed by seed + row (a row draws as its
prompt alone, and by chi-square follows the warped target), and one-line errors for bad batches."""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
scipy_stats = pytest.importorskip("scipy.stats")

from _doubles import BatchScriptDraft  # noqa: E402
from _models import (DEVICE, THRESHOLDS, V, _warp, eagle3_head, left_padded, prompts,  # noqa: E402
                     reference_greedy, tiny_target)

from heterospec import ops  # noqa: E402
from heterospec.engine import HeteroSpec  # noqa: E402
from heterospec.engine.tree import verification_tree  # noqa: E402
from heterospec.growth import Growth  # noqa: E402
from heterospec.policy import Policy  # noqa: E402

NEW = 24
POLICIES = {
    "ar": None,
    "eagle3": Policy.static(5, 3, 16),
    "heterospec": Policy.paper(4, 3, 12, THRESHOLDS),
}


def scripted(model, ps, new=NEW):
    """A BatchScriptDraft that knows each prompt's greedy continuation (HF's), and those references."""
    refs = [reference_greedy(model, p, new + 8) for p in ps]
    return BatchScriptDraft(model.config.vocab_size).to(DEVICE).load([r[0] for r in refs]), refs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method", list(POLICIES))
def test_each_row_equals_its_prompt_alone(arch, method):
    model = tiny_target(arch)
    ps = prompts(5)
    draft, refs = scripted(model, ps)
    hs = HeteroSpec(model, draft if POLICIES[method] else None, POLICIES[method], cuda_graphs=False)
    outs, stats = hs.generate([p[0] for p in ps], max_new_tokens=NEW)
    for b, (o, p, r) in enumerate(zip(outs, ps, refs)):
        assert o.tolist() == r[0, :p.shape[1] + NEW].tolist(), f"{method} row {b}: differs from HF's greedy"
        alone, _ = hs.generate(p, max_new_tokens=NEW)
        assert o.tolist() == alone[0].tolist()
    assert len(stats.per_row) == 5 and all(s.new_tokens == NEW for s in stats.per_row)
    assert stats.new_tokens == 5 * NEW
    if POLICIES[method] is not None:
        # the scripted draft accepts long paths, and the rows' paths differ within a cycle (ragged commits)
        assert stats.tau > 2.0, stats.tau
        assert len({tuple(sorted(s.accepted_hist.items())) for s in stats.per_row}) > 1
        assert stats.batch_calls < stats.cycles


def test_left_padded_tensor_input_and_the_padded_output():
    model = tiny_target("llama")
    ps = prompts(3)
    ids, mask = left_padded(ps)
    draft, refs = scripted(model, ps)
    hs = HeteroSpec(model, draft, POLICIES["heterospec"], cuda_graphs=False)
    out, _ = hs.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=5)
    S = ids.shape[1]
    assert out.shape == (3, S + NEW)
    assert out[:, :S].tolist() == ids.cpu().tolist()                  # the input, its padding included
    for b, (p, r) in enumerate(zip(ps, refs)):
        assert out[b, S:].tolist() == r[0, p.shape[1]:p.shape[1] + NEW].tolist()


def test_a_real_eagle3_head_in_a_batch(tmp_path):
    """The real Eagle3Draft module (random weights: short paths) through the batched drafter."""
    model = tiny_target("qwen3")
    draft = eagle3_head(model, tmp_path)
    ps = prompts(4)
    for policy in (Policy.static(5, 3, 16), Policy.paper(6, 4, 24, THRESHOLDS)):
        hs = HeteroSpec(model, draft, policy, cuda_graphs=False)
        outs, _ = hs.generate([p[0] for p in ps], max_new_tokens=NEW)
        for o, p in zip(outs, ps):
            assert o.tolist() == reference_greedy(model, p, NEW)[0].tolist()


@pytest.mark.parametrize("finished", ["drop", "mask"])
def test_rows_that_finish_stop_and_the_others_go_on(finished):
    model = tiny_target("llama")
    ps = prompts(4)
    draft, refs = scripted(model, ps, new=40)
    # an EOS id that row 1's continuation reaches early and the others do not reach before 40 tokens
    first = refs[1][0, ps[1].shape[1] + 2].item()
    hs = HeteroSpec(model, draft, POLICIES["eagle3"], cuda_graphs=False)
    outs, stats = hs.generate([p[0] for p in ps], max_new_tokens=40, eos_token_id=first, finished_rows=finished)
    for b, (o, p) in enumerate(zip(outs, ps)):
        alone, _ = hs.generate(p, max_new_tokens=40, eos_token_id=first)
        assert o.tolist() == alone[0].tolist(), b
    assert outs[1].shape[0] == ps[1].shape[1] + 3 and outs[1][-1].item() == first
    lengths = [s.new_tokens for s in stats.per_row]
    assert lengths[1] == 3 and max(lengths) > 3
    # a finished row stops costing verification: it took part in fewer batched calls than the longest
    assert stats.per_row[1].cycles < max(s.cycles for s in stats.per_row) == stats.batch_calls


def test_padding_nodes_are_never_accepted():
    """verification_tree pads ragged trees with the row's root token at depth 1 under the root; logits planted so
    that this token is the target's choice at the root make a padding node acceptable if it were read --
    the acceptance ops read the first n[b] nodes only, so row 1 accepts nothing there."""
    K, V = 2, 16
    g = Growth.root(torch.randn(2, 1, V), K)
    g = g.extend(torch.randn(2, K, V))
    root = torch.tensor([7, 9])
    # row 0 keeps 4 of the 6 candidates of one level, row 1 one of the root expansion's 2
    T = 5
    tokens, parents, depths, mask, n = verification_tree(g, torch.tensor([4, 1]), torch.tensor([6, 2]), root, T, True)
    assert tokens.shape == (2, T) and n.tolist() == [5, 2]
    assert tokens[1, 2:].tolist() == [9, 9, 9] and depths[1, 2:].tolist() == [1, 1, 1]
    assert mask[1, 2:].tolist() == [[True, False, True, False, False], [True, False, False, True, False],
                                     [True, False, False, False, True]]
    logits = torch.zeros(2, T, V)
    logits[:, :, 0] = 1.0
    logits[1, 0, 9] = 5.0                    # the target's choice at row 1's root: the padding nodes' token
    logits[1, 0, tokens[1, 1]] = -1.0        # ...and not the real child's
    for path, length, nxt in (ops.verify_greedy(tokens, parents, logits, n=n)[:3],
                              ops.verify_sample(tokens, parents, logits, n=n, temperature=0.05, seed=1,
                                                offset=0)[:3]):
        assert length[1].item() == 1 and nxt[1].item() == 9
        assert all(x < s for row, s in zip(path.tolist(), n.tolist()) for x in row if x >= 0)


def test_sampled_rows_draw_as_their_prompt_alone():
    model = tiny_target("qwen2")
    ps = prompts(3)
    draft, _ = scripted(model, ps)
    hs = HeteroSpec(model, draft, POLICIES["heterospec"], cuda_graphs=False)
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=20, top_p=0.95)
    outs, _ = hs.generate([p[0] for p in ps], seed=11, **kw)
    for b, p in enumerate(ps):
        alone, _ = hs.generate(p, seed=11 + b, **kw)
        assert outs[b].tolist() == alone[0].tolist(), b
    again, _ = hs.generate([p[0] for p in ps], seed=[11, 12, 13], **kw)
    assert [o.tolist() for o in again] == [o.tolist() for o in outs]


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.5, 0, 0.9)])
def test_sampling_per_row_matches_the_target_distribution(setting):
    """Two rows (different prompts) of 2 sampled tokens, 1,500 batched calls: each row's joint distribution
    of (t1, t2) matches p(t1) p(t2 | t1) of its own prompt by chi-square."""
    temperature, top_k, top_p = setting
    vocab = 12
    model = tiny_target("llama", vocab=vocab, layers=4, seed=5)
    ps = [torch.tensor([[3, 7, 1, 4]], device=DEVICE), torch.tensor([[5, 2, 9, 9, 0, 8]], device=DEVICE)]
    draft = BatchScriptDraft(vocab, miss_every=2, boost=2.0).to(DEVICE).load(
        [torch.cat([p[0], torch.arange(8, device=DEVICE) % vocab]) for p in ps])
    hs = HeteroSpec(model, draft, Policy.static(3, 3, 8), cuda_graphs=False)
    n = 1500
    counts = [np.zeros(vocab * vocab) for _ in ps]
    for s in range(n):
        outs, _ = hs.generate([p[0] for p in ps], max_new_tokens=2, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=2 * s)
        for b, o in enumerate(outs):
            a, c = o[-2:].tolist()
            counts[b][a * vocab + c] += 1
    cells = []
    with torch.no_grad():
        for b, p in enumerate(ps):
            p1 = _warp(model(p).logits[0, -1], temperature, top_k, top_p)
            joint = torch.stack([
                p1[a] * _warp(model(torch.cat([p, torch.tensor([[a]], device=DEVICE)], 1)).logits[0, -1],
                              temperature, top_k, top_p) for a in range(vocab)]).cpu().numpy().ravel()
            assert counts[b][joint == 0].sum() == 0
            exp = joint / joint.sum() * n
            keep = exp >= 5
            obs_cells = np.append(counts[b][keep], counts[b][~keep].sum())
            exp_cells = np.append(exp[keep], exp[~keep].sum())
            if exp_cells[-1] < 5:
                obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
                obs_cells[-1] += counts[b][~keep].sum()
                exp_cells[-1] += exp[~keep].sum()
            cells.append(len(exp_cells))
            if len(exp_cells) == 1:                    # a nucleus of one pair: every draw is that pair
                assert obs_cells[0] == n, b
            else:
                assert scipy_stats.chisquare(obs_cells, exp_cells).pvalue > 1e-4, b
    assert max(cells) >= 3, cells                      # at least one row is a real test of the distribution


@pytest.mark.parametrize("call, match", [
    (lambda hs, ids, m: hs.generate(ids, attention_mask=m[:, 1:], max_new_tokens=4),
     r"generate: argument 'attention_mask' expected the shape of input_ids \(3, \d+\), got \(3, \d+\)"),
    (lambda hs, ids, m: hs.generate(ids, attention_mask=torch.cat([m[:2], torch.zeros_like(m[2:])]),
                                    max_new_tokens=4),
     r"generate: argument 'attention_mask' expected at least one token per row, got an empty row 2"),
    (lambda hs, ids, m: hs.generate(ids, attention_mask=m.flip(1), max_new_tokens=4),
     r"generate: argument 'attention_mask' expected left padding"),
    (lambda hs, ids, m: hs.generate([[1, 2], []], max_new_tokens=4),
     r"generate: argument 'input_ids' expected a token in every prompt, got an empty prompt at index 1"),
    (lambda hs, ids, m: hs.generate([], max_new_tokens=4),
     r"generate: argument 'input_ids' expected at least one prompt, got an empty list"),
    (lambda hs, ids, m: hs.generate(ids, attention_mask=m, max_new_tokens=4, temperature=1.0, seed=[1, 2]),
     r"generate: argument 'seed' expected an int or 3 ints \(one per prompt\), got 2"),
    (lambda hs, ids, m: hs.generate(ids, attention_mask=m, max_new_tokens=4, streamer=object()),
     r"generate: argument 'streamer' expected a single prompt, got a batch of 3"),
    (lambda hs, ids, m: hs.generate(ids, attention_mask=m, max_new_tokens=4, finished_rows="keep"),
     r"generate: argument 'finished_rows' expected 'drop' or 'mask', got 'keep'"),
    (lambda hs, ids, m: hs.generate(ids, attention_mask=m.cpu().numpy(), max_new_tokens=4),
     r"generate: argument 'attention_mask' expected a torch.Tensor of the shape of input_ids \(3, \d+\), got ndarray"),
    (lambda hs, ids, m: hs.generate(ids[:, :0], max_new_tokens=4),
     r"generate: argument 'input_ids' expected at least one token, got 0"),
    (lambda hs, ids, m: hs.generate(ids, attention_mask=m, max_new_tokens=4, temperature=1.0, seed=2**63 - 2),
     r"generate: argument 'seed' expected seeds in \[0, 2\*\*63\) for every row \(row b uses seed \+ b\), "
     r"got 9223372036854775808"),
    (lambda hs, ids, m: hs.generate(ids[:1], max_new_tokens=4, temperature=1.0, seed=[1, 2]),
     r"generate: argument 'seed' expected an int or 1 ints \(one per prompt\), got 2"),
    (lambda hs, ids, m: hs.generate(ids, attention_mask=m, max_new_tokens=600),
     r"generate: prompt \(\d+\) \+ max_new_tokens \(600\) exceed the target's max_position_embeddings \(512\)"),
    # ids that are not the target's tokens: they used to fail inside the embedding (IndexError, or a float tensor's
    # RuntimeError), and a list's float ids were truncated to ints silently
    (lambda hs, ids, m: hs.generate(ids.masked_fill(m == 1, 0) + m * V, attention_mask=m, max_new_tokens=4),
     rf"generate: argument 'input_ids' expected token ids in \[0, {V}\) \(the target's vocabulary\) at every "
     rf"position, the padding included, got {V}"),
    (lambda hs, ids, m: hs.generate(ids - 1 - ids.max(), attention_mask=m, max_new_tokens=4),
     r"generate: argument 'input_ids' expected token ids in \[0, \d+\) .*got -\d+"),
    (lambda hs, ids, m: hs.generate(ids.float(), attention_mask=m, max_new_tokens=4),
     r"generate: argument 'input_ids' expected integer token ids, got torch.float32"),
    (lambda hs, ids, m: hs.generate([[1, 2], [1.5]], max_new_tokens=4),
     r"generate: argument 'input_ids' expected integer token ids in every prompt, got torch.float32 at index 1"),
    (lambda hs, ids, m: hs.generate([[1, 2], [3]], max_new_tokens=4, pad_token_id=V + 3),
     rf"generate: argument 'pad_token_id' expected an id in \[0, {V}\) to pad a list of prompts, got {V + 3}"),
])
def test_bad_batches_get_one_line_errors(call, match):
    model = tiny_target("llama")
    ids, mask = left_padded(prompts(3))
    hs = HeteroSpec(model, cuda_graphs=False)
    with pytest.raises(ValueError, match=match) as e:
        call(hs, ids, mask)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("do_sample", [False, True])
def test_custom_generate_with_a_batch_returns_what_hf_returns(do_sample):
    """model.generate(ids, attention_mask=mask, custom_generate=heterospec.custom_generate, ...) on a left-padded
    batch: the same layout as HuggingFace's own batched generate -- each row's input with its padding, its
    tokens, then pad_token_id once it finished -- and, greedily, the same tokens as HuggingFace's own batched
    greedy generate (both equal each prompt alone); sampled rows draw as their prompt alone with seed + row."""
    import heterospec

    model = tiny_target("qwen3")
    ps = prompts(4)
    ids, mask = left_padded(ps)
    draft, refs = scripted(model, ps, new=30)
    eos = refs[2][0, ps[2].shape[1] + 4].item()          # row 2 stops early
    kw = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=3)
    if do_sample:
        kw.update(do_sample=True, temperature=0.8, top_k=10, top_p=1.0)
    else:
        kw.update(do_sample=False)
    out = model.generate(ids, custom_generate=heterospec.custom_generate, draft=draft,
                         policy=Policy.paper(4, 3, 12, THRESHOLDS), seed=5, **kw)
    S = ids.shape[1]
    assert out[:, :S].tolist() == ids.tolist()
    if not do_sample:
        hf = model.generate(ids, **kw)
        assert out.tolist() == hf.tolist()
    hs = HeteroSpec(model, draft, Policy.paper(4, 3, 12, THRESHOLDS), cuda_graphs=False)
    for b, p in enumerate(ps):
        alone, _ = hs.generate(p, max_new_tokens=20, eos_token_id=eos, seed=5 + b,
                               temperature=0.8 if do_sample else 0.0, top_k=10 if do_sample else 0)
        new = alone[0, p.shape[1]:].tolist()
        assert out[b, S:S + len(new)].tolist() == new
        assert out[b, S + len(new):].tolist() == [3] * (out.shape[1] - S - len(new))
    assert (out[2, S:] == 3).any()                        # the early row was padded


def test_custom_generate_applies_processors_to_a_padded_batch_as_hf_does():
    """repetition_penalty, no_repeat_ngram_size and min_new_tokens on a left-padded batch: the processors see each
    row as HuggingFace's batched generate passes it (its padding included, the new tokens counted past the padded
    prompt), so the output equals HuggingFace's own batched greedy generate; the processors change it."""
    import heterospec

    model = tiny_target("qwen3")
    ps = prompts(4)
    ids, mask = left_padded(ps)
    draft, _ = scripted(model, ps, new=30)
    plain = dict(attention_mask=mask, max_new_tokens=20, pad_token_id=3, do_sample=False, eos_token_id=5)
    kw = dict(plain, repetition_penalty=1.8, no_repeat_ngram_size=2, min_new_tokens=8)
    hf = model.generate(ids, **kw)
    out = model.generate(ids, custom_generate=heterospec.custom_generate, draft=draft,
                         policy=Policy.paper(4, 3, 12, THRESHOLDS), **kw)
    assert out.tolist() == hf.tolist()
    assert hf.tolist() != model.generate(ids, **plain).tolist()


def test_custom_generate_hands_the_engine_options_on(monkeypatch):
    import heterospec
    from heterospec.engine import hf_generate

    model = tiny_target("llama")
    ps = prompts(2)
    ids, mask = left_padded(ps)
    seen = {}
    real = hf_generate.HeteroSpec

    def spy(*a, **k):
        seen.update(k)
        return real(*a, **k)

    monkeypatch.setattr(hf_generate, "HeteroSpec", spy)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         custom_generate=heterospec.custom_generate, cpu_decoder=False, disable_by_batch_size=1)
    assert seen["cpu_decoder"] is False and seen["disable_by_batch_size"] == 1
    assert out.tolist() == model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False).tolist()


@pytest.mark.parametrize("name", ["ar", "eagle3", "heterospec"])
def test_a_batch_reads_the_host_twice_per_cycle_at_most(name, tmp_path):
    """The whole batched generate under the host-transfer guard: inside the cycles only the declared sync
    points read the device -- "bin" (binned policies) and "accepted", once per batched cycle each, whatever
    the batch size -- with the real EAGLE-3 module (the scripted double reads its cache on the host)."""
    from heterospec.engine import sync

    model = tiny_target("llama")
    draft = eagle3_head(model, tmp_path)
    ps = prompts(4)
    record = []
    hs = HeteroSpec(model, draft if POLICIES[name] else None, POLICIES[name], cuda_graphs=False)
    with sync.forbid_host_transfers(record):
        outs, stats = hs.generate([p[0] for p in ps], max_new_tokens=12)
        _, sstats = hs.generate([p[0] for p in ps], max_new_tokens=12, temperature=1.0, seed=3)
    calls = stats.batch_calls + sstats.batch_calls
    assert record.count("accepted") == calls
    assert record.count("bin") == (calls if name == "heterospec" else 0)
    for o, p in zip(outs, ps):
        assert o.tolist() == reference_greedy(model, p, 12)[0].tolist()


def test_a_batch_too_large_for_memory_is_refused_before_decoding(monkeypatch):
    from heterospec import measure

    model = tiny_target("llama")
    ids, mask = left_padded(prompts(3))
    hs = HeteroSpec(model, cuda_graphs=False)
    monkeypatch.setattr(measure, "available_bytes", lambda device: 1000)
    where = re.escape(str(ids.device))            # a tensor's device has its index: cuda:0
    with pytest.raises(ValueError, match=r"^generate: argument 'input_ids' expected a batch whose static caches fit "
                                         r"the " + where + r" memory available \(0.00 GiB\), got 3 prompts "
                                         r"needing about [0-9.]+ GiB \(\d+ positions per row\)$"):
        hs.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)   # nothing left on the model
    monkeypatch.setattr(measure, "available_bytes", lambda device: None)     # unknown: decoding goes on
    out, _ = hs.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert out.shape[0] == 3


def test_ragged_trees_padded_to_gpu_buckets_stay_lossless():
    """With buckets (a GPU's default, given explicitly here) a cycle's trees are padded past the largest real
    tree to its bucket: the padded columns are never accepted and every row still equals HF's greedy."""
    model = tiny_target("qwen2")
    ps = prompts(5)
    draft, refs = scripted(model, ps)
    hs = HeteroSpec(model, draft, Policy.paper(4, 3, 12, THRESHOLDS), buckets=(1, 2, 4, 8, 16, 32), cuda_graphs=False)
    outs, stats = hs.generate([p[0] for p in ps], max_new_tokens=NEW)
    for o, p, r in zip(outs, ps, refs):
        assert o.tolist() == r[0, :p.shape[1] + NEW].tolist()
    assert stats.tau > 2.0


def test_masked_rows_that_finish_on_the_budget_stay_inside_the_cache():
    """A row that accepts every draft finishes past max_new_tokens (its last cycle overshoots by up to the
    depth) while another row goes on: masked, it keeps verifying a tree at its last prefix, which must still
    fit the cache (it wrote past it before the capacity counted the overshoot; found by review)."""
    model = tiny_target("llama")
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, model.config.vocab_size, (1, 10), generator=g).to(DEVICE) for _ in range(2)]
    ref0 = reference_greedy(model, ps[0], 27)
    junk = torch.cat([ps[1][0].cpu(), torch.randint(0, model.config.vocab_size, (37,), generator=g)])
    draft = BatchScriptDraft(model.config.vocab_size, miss_every=10**9).to(DEVICE).load([ref0[0], junk])
    for mode in ("drop", "mask"):
        hs = HeteroSpec(model, draft, Policy.static(5, 3, 16), cuda_graphs=False)
        outs, stats = hs.generate([p[0] for p in ps], max_new_tokens=17, finished_rows=mode)
        for o, p in zip(outs, ps):
            assert o.tolist() == reference_greedy(model, p, 17)[0].tolist(), mode
        assert stats.per_row[0].cycles < stats.per_row[1].cycles


def test_stopping_criteria_are_asked_per_row():
    """A criterion that fires on a request's own tokens (here: its last token is a given one, row 2's sixth
    new token) stops each row where that prompt alone stops, inside an accepted path, and the others go on."""
    model = tiny_target("llama")
    ps = prompts(4)
    draft, refs = scripted(model, ps, new=30)
    stop_tok = refs[2][0, ps[2].shape[1] + 5].item()       # row 2's sixth new token

    class StopAt:
        def __call__(self, ids, scores):
            return torch.tensor([ids[0, -1].item() == stop_tok])

    hs = HeteroSpec(model, draft, POLICIES["heterospec"], cuda_graphs=False)
    outs, stats = hs.generate([p[0] for p in ps], max_new_tokens=30, stopping_criteria=[StopAt()])
    for b, (o, p) in enumerate(zip(outs, ps)):
        alone, _ = hs.generate(p, max_new_tokens=30, stopping_criteria=[StopAt()])
        assert o.tolist() == alone[0].tolist(), b
    assert outs[2][-1].item() == stop_tok and stats.per_row[2].new_tokens <= 6


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_a_batch_past_disable_by_batch_size_decodes_autoregressively_with_the_same_output(graphs, tmp_path):
    """vLLM's option: calls of more requests than the limit draft nothing (τ 1, one node a row per forward); calls
    within it draft as before; every row's output is its prompt's greedy continuation either way."""
    model = tiny_target("llama")
    ps = prompts(3)
    refs = [reference_greedy(model, p, NEW) for p in ps]
    draft = eagle3_head(model, tmp_path / "head")
    hs = HeteroSpec(model, draft, POLICIES["heterospec"], cuda_graphs=graphs, disable_by_batch_size=2)
    for n in (3, 2, 1):
        outs, stats = hs.generate([p[0] for p in ps[:n]], max_new_tokens=NEW)
        for o, p, r in zip(outs, ps, refs):
            assert o.tolist() == r[0, :p.shape[1] + NEW].tolist()
        if n > 2:
            assert stats.tau == 1.0 and stats.verified_tokens == stats.cycles and not stats.bins
        else:   # drafted: every cycle binned, trees of more than the root verified
            assert sum(stats.bins.values()) == stats.cycles and stats.verified_tokens > stats.cycles
    hs.close()
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="argument 'disable_by_batch_size' expected None or an int >= 1, got"):
            HeteroSpec(model, draft, POLICIES["heterospec"], disable_by_batch_size=bad)
