"""HuggingFace's ``return_dict_in_generate`` outputs through our engine: ``HeteroSpec.generate(output_logits=True)``
keeps the target's raw logits that decided each new token, and ``custom_generate`` returns them, and the processed
``scores``, as HuggingFace's own ``generate`` does.  References: HuggingFace's generate itself (greedy, where its
sequence equals ours), or the target's own forward over our output (sampling, where the draws differ)."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft  # noqa: E402
from _models import DEVICE, THRESHOLDS, V, prompts, tiny_target  # noqa: E402

import heterospec  # noqa: E402
from heterospec import HeteroSpec, Policy  # noqa: E402

NEW = 16
ATOL = 1e-4


def _teacher_forced(model, seq, S, mask=None):
    """The target's logits for positions S .. end of ``seq``, from one forward over the whole sequence."""
    with torch.no_grad():
        out = model(seq.to(DEVICE), attention_mask=None if mask is None else mask.to(DEVICE)).logits
    return out[:, S - 1:-1].float().cpu()


@pytest.mark.parametrize("method", ["autoregressive", "heterospec-noisy"])
def test_generate_keeps_the_logits_each_new_token_came_from(method):
    model = tiny_target("llama")
    draft, policy = (None, None) if method == "autoregressive" else \
        (NoisyDraft(32, V, seed=3).to(DEVICE), Policy.paper(4, 4, 20, THRESHOLDS))
    ps = prompts(3)
    with HeteroSpec(model, draft, policy, cuda_graphs=False) as hs:
        for p in ps:
            seq, st = hs.generate(p, max_new_tokens=NEW, output_logits=True)
            S = p.shape[1]
            assert st.logits.shape == (NEW, V) and st.logits.dtype == torch.float32
            ref = _teacher_forced(model, seq, S)[0]
            assert torch.allclose(st.logits.cpu(), ref, atol=ATOL), (st.logits.cpu() - ref).abs().max()
            assert st.logits.argmax(-1).cpu().tolist() == seq[0, S:].tolist()     # greedy: each token its argmax
        _, plain = hs.generate(ps[0], max_new_tokens=NEW)
        assert plain.logits is None and "logits" not in plain.as_dict()
        # a batch: each row's own, cut where the row stopped (an EOS id that the greedy rows reach early)
        eos = int(seq[0, S + 3])
        outs, st = hs.generate([p[0] for p in ps], max_new_tokens=NEW, output_logits=True, eos_token_id=eos)
        for out, p, row in zip(outs, ps, st.per_row):
            S = p.shape[1]
            assert row.logits.shape == (out.shape[0] - S, V) and row.new_tokens == out.shape[0] - S
            ref = _teacher_forced(model, out.view(1, -1), S)[0]
            assert torch.allclose(row.logits.cpu(), ref, atol=ATOL)
        assert min(r.new_tokens for r in st.per_row) < NEW                      # some row did stop at the EOS
    with pytest.raises(ValueError, match="argument 'output_logits' expected True or False, got 1"):
        HeteroSpec(model, cuda_graphs=False).generate(ps[0], max_new_tokens=2, output_logits=1)


def _hf(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True,
                          output_scores=True, pad_token_id=0, **kw)


def test_custom_generate_returns_hf_outputs_greedy_with_a_penalty_in_a_batch():
    """Greedy with a repetition penalty over a left-padded batch: our sequences, logits and scores equal
    HuggingFace's own generate's at every step of every row that has not finished; a finished row's steps hold
    a distribution certain of the padding token."""
    model = tiny_target("llama")
    a, b = prompts(2)
    ids = torch.cat([torch.cat([torch.zeros((1, b.shape[1] - a.shape[1]), dtype=torch.long), a], 1), b]) \
        if b.shape[1] >= a.shape[1] else torch.cat([a, torch.cat([torch.zeros((1, a.shape[1] - b.shape[1]),
                                                                             dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    if b.shape[1] >= a.shape[1]:
        mask[0, :b.shape[1] - a.shape[1]] = 0
    else:
        mask[1, :a.shape[1] - b.shape[1]] = 0
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    kw = dict(do_sample=False, max_new_tokens=NEW, repetition_penalty=1.3, eos_token_id=None)
    ref = _hf(model, ids, mask, **kw)
    ours = _hf(model, ids, mask, custom_generate=heterospec.custom_generate,
               draft=NoisyDraft(32, V, seed=5).to(DEVICE), policy=Policy.static(3, 3, 8), **kw)
    assert isinstance(ours, transformers.generation.utils.GenerateDecoderOnlyOutput)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert len(ours.logits) == len(ours.scores) == len(ref.scores) == NEW
    for t in range(NEW):
        assert ours.logits[t].shape == ref.logits[t].shape == (2, V)
        assert torch.allclose(ours.logits[t].float(), ref.logits[t].float(), atol=ATOL)
        assert torch.allclose(ours.scores[t].float(), ref.scores[t].float(), atol=ATOL)
    # the penalty changed the scores: they are not the raw logits
    assert not torch.allclose(ours.scores[NEW - 1], ours.logits[NEW - 1])
    assert ours.attentions is None and ours.hidden_states is None


def test_a_finished_rows_steps_are_certain_of_the_padding_token():
    """Two prompts of one length and an EOS id that one row reaches before the other: the output is HuggingFace's
    layout (one step per new column), the early row's later steps certain of the padding token."""
    model = tiny_target("llama")
    ps = [p[:, :8] for p in prompts(8)]                  # one length: no padding in the batch
    with HeteroSpec(model, cuda_graphs=False) as hs:
        outs = [hs.generate(p, max_new_tokens=NEW)[0][0, p.shape[1]:].tolist() for p in ps]
    # an EOS id: a token one row makes early that another row makes later (or never)
    pick = None
    for i in range(len(outs)):
        for j in range(len(outs)):
            for k, tok in enumerate(outs[i][:NEW // 2]):
                if outs[i].index(tok) == k and (tok not in outs[j] or outs[j].index(tok) > k + 1) and i != j:
                    pick = pick or (i, j, tok, k)
    assert pick is not None
    i, j, eos, k = pick
    ids = torch.cat([ps[i], ps[j]]).to(DEVICE)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=heterospec.custom_generate,
                         do_sample=False, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=7,
                         return_dict_in_generate=True, output_scores=True, output_logits=True)
    S = ids.shape[1]
    n = out.sequences.shape[1] - S
    assert len(out.logits) == len(out.scores) == n > k + 1
    assert out.sequences[0, S + k].item() == eos and (out.sequences[0, S + k + 1:] == 7).all()
    certain = torch.full((V,), float("-inf"))
    certain[7] = 0.0
    for t in range(n):
        for steps in (out.logits, out.scores):
            assert steps[t].shape == (2, V)
            assert torch.equal(steps[t][0].cpu(), certain) == (t > k)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=heterospec.custom_generate,
                         do_sample=False, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=7,
                         return_dict_in_generate=True, output_scores=True)
    assert out.logits is None and len(out.scores) == n                # output_scores alone: no logits


def test_custom_generate_sampled_outputs_are_the_targets_logits_and_the_warped_scores():
    """Sampling: our draws differ from HuggingFace's, so the reference is the target's forward over our own
    sequence; the scores are those logits through temperature, top-k and top-p (HuggingFace's warpers), and every
    sampled token has a finite score."""
    model = tiny_target("llama")
    p = prompts(3)[2].to(DEVICE)
    kw = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=NEW, eos_token_id=None)
    out = _hf(model, p, torch.ones_like(p), custom_generate=heterospec.custom_generate, seed=3,
              draft=NoisyDraft(32, V, seed=2).to(DEVICE), policy=Policy.static(3, 3, 8), **kw)
    S = p.shape[1]
    ref = _teacher_forced(model, out.sequences, S)[0]
    logits = torch.stack(out.logits, 1)[0].float().cpu()
    assert torch.allclose(logits, ref, atol=ATOL)
    scores = torch.stack(out.scores, 1)[0].float().cpu()
    # temperature 0.8: every kept entry is the logit / 0.8; at most 20 kept per step; the sampled token kept
    kept = torch.isfinite(scores)
    assert torch.allclose(scores[kept], (logits / 0.8)[kept], atol=ATOL)
    assert (kept.sum(-1) <= 20).all() and (kept.sum(-1) >= 1).all()
    tokens = out.sequences[0, S:].cpu()
    assert kept.gather(1, tokens.view(-1, 1)).all()


@pytest.mark.parametrize("name", ["output_attentions", "output_hidden_states"])
def test_custom_generate_refuses_attentions_and_hidden_states_in_one_line(name):
    model = tiny_target("llama")
    p = prompts(1)[0].to(DEVICE)
    with pytest.raises(ValueError, match=f"custom_generate: argument '{name}' expected False"):
        model.generate(p, attention_mask=torch.ones_like(p), custom_generate=heterospec.custom_generate,
                       do_sample=False, max_new_tokens=4, pad_token_id=0, return_dict_in_generate=True,
                       **{name: True})


def test_without_return_dict_custom_generate_returns_the_sequences():
    model = tiny_target("llama")
    p = prompts(1)[0].to(DEVICE)
    out = model.generate(p, attention_mask=torch.ones_like(p), custom_generate=heterospec.custom_generate,
                         do_sample=False, max_new_tokens=4, pad_token_id=0, output_scores=True)
    assert isinstance(out, torch.Tensor) and out.shape == (1, p.shape[1] + 4)


def test_custom_generate_refuses_beam_search_in_one_line():
    """HF expands the prompt to num_beams rows before calling us: without the check, two greedy copies came back
    as if they were beam search's output."""
    model = tiny_target("llama")
    p = prompts(1)[0].to(DEVICE)
    with pytest.raises(ValueError, match="custom_generate: argument 'num_beams' expected 1 .*got 2"):
        model.generate(p, attention_mask=torch.ones_like(p), custom_generate=heterospec.custom_generate,
                       do_sample=False, num_beams=2, max_new_tokens=4, pad_token_id=0)


def test_custom_generate_honours_max_time_as_hf_does():
    """max_time was dropped with the criteria the engine applies itself: it is asked after every new token now,
    so a time already spent stops after the first token, as in HF's own generate."""
    model = tiny_target("llama")
    p = prompts(1)[0].to(DEVICE)
    kw = dict(attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=8, pad_token_id=0, max_time=1e-9)
    ours = model.generate(p, custom_generate=heterospec.custom_generate, **kw)
    assert ours.shape[1] == p.shape[1] + 1 == model.generate(p, **kw).shape[1]
    full = model.generate(p, custom_generate=heterospec.custom_generate, **dict(kw, max_time=60.0))
    assert full.shape[1] == p.shape[1] + 8


def test_custom_generate_num_return_sequences_samples_each_row_apart():
    model = tiny_target("llama")
    p = prompts(2)[1].to(DEVICE)
    out = model.generate(p, attention_mask=torch.ones_like(p), custom_generate=heterospec.custom_generate,
                         do_sample=True, num_return_sequences=3, max_new_tokens=NEW, pad_token_id=0, seed=4,
                         eos_token_id=None)
    assert out.shape == (3, p.shape[1] + NEW) and len({tuple(r) for r in out[:, p.shape[1]:].tolist()}) == 3


def test_stats_show_themselves_in_one_line_and_as_a_jupyter_table():
    """GenerationStats.summary (what `heterospec generate` prints) and its Markdown for Jupyter: the call's
    counts, and a batch's rows one line each, written from the stats' own fields."""
    from heterospec import GenerationStats

    st = GenerationStats(new_tokens=12, cycles=5, verified_tokens=20, total_s=0.5, graphs="cuda")
    st.accepted_hist.update({1: 3, 2: 1, 0: 1})
    st.bins.update({0: 2, 3: 3})
    assert st.summary().startswith("12 tokens in 0.50 s (24.0 tok/s); verification calls 5, tree tokens verified "
                                   "20, tau 2.00; accepted-length histogram {0: 1, 1: 3, 2: 1}; bins {0: 2, 3: 3}")
    md = st._repr_markdown_().splitlines()
    assert md[2] == "| call | 12 | 24.0 | 2.00 | 5 | 4.0 | cuda |" and md[-1] == "Entropy bins (cycles): 0: 2, 3: 3"
    batch = GenerationStats(new_tokens=3, cycles=2, per_row=[GenerationStats(new_tokens=1, cycles=1),
                                                             GenerationStats(new_tokens=2, cycles=1)])
    assert [r.split("|")[1].strip() for r in batch._repr_markdown_().splitlines()[2:]] == ["call", "row 0", "row 1"]


def test_the_engine_says_what_it_runs_in_one_line():
    model = tiny_target("llama")
    plain = repr(HeteroSpec(model, cuda_graphs=False))
    assert plain.startswith("HeteroSpec(target LlamaForCausalLM, draft none, autoregressive, cpu float32, "
                            "CUDA graphs off, CPU decoder: ") and "\n" not in plain and "lookup" not in plain
    hs = HeteroSpec(model, NoisyDraft(32, V).to(DEVICE), Policy.paper(4, 4, 20, THRESHOLDS), cuda_graphs=False,
                    prompt_lookup_num_tokens=4, max_matching_ngram_size=3, min_matching_ngram_size=2)
    assert (", draft NoisyDraft, heterospec (depth 4, top-k 4, 20 nodes, 8 entropy bins), " in repr(hs)
            and repr(hs).endswith(", prompt lookup 4 tokens from 2-3-grams)"))
