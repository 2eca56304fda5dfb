"""The decoding loop on real transformers models (tiny, random, float32, CPU): lossless greedy output for
every method and policy on Llama, Qwen2 and Qwen3; distributional equality under sampling; stopping,
streaming and bad input.  Drafts here are test doubles (tests/_doubles.py); the EAGLE-3 head has its own
tests.

HETEROSPEC_TEST_DEVICE=cuda runs the same tests with models and prompts on the GPU (.ci/gpu does)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
scipy_stats = pytest.importorskip("scipy.stats")

from _doubles import NoisyDraft, OracleDraft  # noqa: E402
from _models import (  # noqa: E402
    DEVICE,
    NEW,
    THRESHOLDS,
    V,
    _warp,
    eagle3_head,
    prompts,
    reference_greedy,
    tiny_target,
)

from heterospec import GenerationStats, HeteroSpec, Policy  # noqa: E402

METHODS = {
    "autoregressive": lambda m: (None, None),
    "eagle3-oracle": lambda m: (OracleDraft(m), Policy.static(7, 4, 24)),
    "heterospec-oracle": lambda m: (OracleDraft(m), Policy.paper(5, 3, 16, THRESHOLDS)),
    "deep-9-levels": lambda m: (OracleDraft(m), Policy.static(9, 2, 12)),
    "pruned-to-4": lambda m: (OracleDraft(m), Policy.static(6, 3, 4)),
    "eagle3-noisy": lambda m: (NoisyDraft(32, V).to(DEVICE), Policy.static(5, 3, 16)),
    "heterospec-noisy": lambda m: (NoisyDraft(32, V, seed=3).to(DEVICE), Policy.paper(4, 4, 20, THRESHOLDS)),
    "eagle3-head": "head",
}


# 10 prompts on the CPU (each method's 27 cases called them one at a time: 20 made this file a third of CI's
# README stage), all 20 on a GPU, where they go as one batch
GREEDY_PROMPTS = 10 if DEVICE.type == "cpu" else 20


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def target_and_refs(request):
    model = tiny_target(request.param)
    ps = prompts(GREEDY_PROMPTS)
    return model, ps, [reference_greedy(model, p) for p in ps]


# On a GPU the 20 prompts go as one batch (a row decodes as its prompt alone: test_batch_decoding), and the first
# two alone too: a call of these tiny targets costs about the same there whatever its rows, and 20 x 24 single
# calls were three quarters of the engine phase's 9 minutes in the fourth window (H100).  The CPU calls one prompt
# at a time, as a user does, and runs the GPU's batched form too for three methods, so a window never meets it first.
GREEDY_CASES = ([(m, "single") for m in METHODS] + [(m, "batched") for m in ("eagle3-oracle", "heterospec-noisy",
                                                                             "eagle3-head")]
                if DEVICE.type == "cpu" else [(m, "batched") for m in METHODS])


@pytest.mark.parametrize("method,form", GREEDY_CASES, ids=[f"{m}-{f}" for m, f in GREEDY_CASES])
def test_greedy_output_equals_target_generate(target_and_refs, method, form, tmp_path):
    model, ps, refs = target_and_refs
    if METHODS[method] == "head":
        draft, policy = eagle3_head(model, tmp_path), Policy.paper(6, 4, 24, THRESHOLDS)
    else:
        draft, policy = METHODS[method](model)
    hs = HeteroSpec(model, draft, policy, cuda_graphs=False)
    if form == "single":
        runs = [(ref, *hs.generate(p, max_new_tokens=NEW)) for p, ref in zip(ps, refs)]
    else:
        outs, st = hs.generate([p[0] for p in ps], max_new_tokens=NEW)
        runs = [(ref, o.view(1, -1), s) for ref, o, s in zip(refs, outs, st.per_row)]
        runs += [(ref, *hs.generate(p, max_new_tokens=NEW)) for p, ref in zip(ps[:2], refs)]
    taus = []
    for ref, seq, stats in runs:
        assert seq.tolist() == ref.tolist(), f"{method}: output differs from target.generate"
        assert stats.new_tokens == NEW
        taus.append(stats.tau)
    if method == "eagle3-oracle":
        # the oracle proposes the target's own tokens: every cycle accepts the whole depth-8 chain
        assert np.mean(taus) > 7.5, taus
    if method == "pruned-to-4":
        assert max(taus) <= 4.0 + 1e-9  # 3 drafted nodes + the bonus token per call, at most


def test_oracle_run_statistics():
    """The test-double run the closing note reports: τ, calls and tree tokens at depth 7, top-k 10."""
    model = tiny_target("llama")
    hs = HeteroSpec(model, OracleDraft(model), Policy.static(7, 10, 60), cuda_graphs=False)
    stats = GenerationStats()
    for p in prompts(5):
        _, s = hs.generate(p, max_new_tokens=NEW)
        stats.cycles += s.cycles
        stats.verified_tokens += s.verified_tokens
        stats.accepted_hist.update(s.accepted_hist)
    assert stats.tau > 8.0  # max 9: 8 drafted + bonus, short only where max_new_tokens cuts the last cycle
    assert stats.verified_tokens == 60 * stats.cycles


def test_heterospec_policy_bins_and_shapes():
    model = tiny_target("llama")
    pol = Policy.paper(7, 10, 60, THRESHOLDS)
    assert pol.extra == (4, 3, 2) and pol.keep == (22, 39, 62)  # paper §4.3 with N = 60, α = 4
    # a CPU's tree of 3 nodes at depth 0 (α = 0): round(0.1 * 3) = 0 nodes would be no tree; a bin keeps the root
    small = Policy.paper(0, 10, 3, (1.0, 2.0, 3.0), gammas=(0.1, 0.6, 1.0))
    assert small.extra == (0, 0, 0) and small.keep == (1, 2, 3)
    hs = HeteroSpec(model, OracleDraft(model), pol, cuda_graphs=False)
    _, stats = hs.generate(prompts(1)[0], max_new_tokens=32)
    assert sum(stats.bins.values()) == stats.cycles
    # every binned cycle's wall time is charged to its bin, and the cycles fit inside the call (issue 19.4)
    assert set(stats.bin_s) == set(stats.bins) and all(v > 0 for v in stats.bin_s.values())
    assert sum(stats.bin_s.values()) <= stats.total_s - stats.prefill_s
    assert pol.plan(0.1) == (0, 4, 22) and pol.plan(100.0) == (7, 0, 60)


# ---- sampling ----------------------------------------------------------------------------------------


SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.2, 0, 0.8)]
# The 2,000 draws of a setting: on the CPU one call per seed (the batch-1 path, as a user calls it); on a GPU 40
# calls of 50 rows, row b of call c keyed with seed 50c + b.  A row draws exactly as its prompt alone with that
# seed (checked below on the first call's rows, and by test_batch_decoding), and a call of this tiny target on a
# GPU costs about the same whatever its rows: launch- and sync-bound, about 0.2 s, so 2,000 single calls took 7
# of a 15-minute window's minutes on an H100.  The CPU runs the batched form for every setting and both drafts, and
# the batch-1 path for the first setting with the noisy draft (2,000 calls of about 18 ms; its rejections exercise
# the residual draws that an oracle's accepted paths rarely reach; the oracle's 2,000 single calls took 97 s of CI
# for what its batched case and the row-alone check below already show).
CHI2_CASES = [(d, s, 50, 0, 0) for d in ("oracle", "noisy") for s in SETTINGS]
# a repetition penalty of 3 on the prompt's tokens and on t1 (the second token's own context): the processed target
CHI2_CASES.append(("noisy", SETTINGS[1], 50, 3.0, 0))
# prompt lookup: t2 proposed by a chain of 3 from the prompt wherever t1 occurred in it (a prompt holding 9 of the
# 12 ids), grafted onto the noisy draft's tree, and as the whole tree without a draft
CHI2_CASES += [("noisy", SETTINGS[2], 50, 0, 3), ("none", SETTINGS[0], 50, 0, 3)]
# min-p after top-p (HuggingFace's order), applied to the target's logits on the device before the acceptance
MIN_P = (1.2, 0, 0.9, 0.3)
CHI2_CASES.append(("noisy", MIN_P, 50, 0, 0))
if DEVICE.type == "cpu":
    CHI2_CASES.append(("noisy", SETTINGS[0], 1, 0, 0))


@pytest.mark.parametrize("draft_kind, setting, rows, penalty, lookup", [
    pytest.param(d, s, r, pen, lk, id=f"{d}-" + (f"setting{SETTINGS.index(s)}" if s in SETTINGS else "minp")
                 + f"-rows{r}" + (f"-penalty{pen:g}" if pen else "") + (f"-lookup{lk}" if lk else ""))
    for d, s, r, pen, lk in CHI2_CASES])
def test_sampling_matches_the_target_distribution(setting, rows, draft_kind, penalty, lookup):
    """Two sampled tokens, 2,000 seeds: the joint distribution of (t1, t2) matches the exact target
    distribution p(t1) p(t2 | t1) by chi-square (cells with expected count < 5 merged); with a ``penalty``,
    HuggingFace's RepetitionPenaltyLogitsProcessor applied to each position's logits with that position's own
    tokens before the warpers, as its ``generate`` applies it; with ``lookup``, prompt-lookup chains of that length
    in the trees; a fourth number in ``setting`` is min-p."""
    temperature, top_k, top_p, *more = setting
    min_p = more[0] if more else None
    vocab = 12
    model = tiny_target("llama", vocab=vocab, layers=4, seed=5)
    prompt = torch.tensor([[3, 7, 1, 5, 3, 9, 2, 0, 4, 7, 8, 1] if lookup else [3, 7, 1]], device=DEVICE)
    draft = {"oracle": lambda: OracleDraft(model), "noisy": lambda: NoisyDraft(32, vocab).to(DEVICE),
             "none": lambda: None}[draft_kind]()
    hs = HeteroSpec(model, draft, Policy.static(3, 3, 8), cuda_graphs=False)
    procs = [transformers.RepetitionPenaltyLogitsProcessor(penalty)] if penalty else []

    def target(ids):   # the processed and warped next-token distribution after ids [1, L]
        z = model(ids).logits[0, -1].float()
        for proc in procs:
            z = proc(ids, z.view(1, -1))[0]
        return _warp(z, temperature, top_k, top_p, min_p)

    with torch.no_grad():
        p1 = target(prompt)
        joint = torch.stack([p1[a] * target(torch.cat([prompt, torch.tensor([[a]], device=DEVICE)], 1))
                             for a in range(vocab)]).cpu().numpy().ravel()
    counts = np.zeros(vocab * vocab)
    n = 2000
    kw = dict(max_new_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
              logits_processor=procs or None,
              prompt_lookup_num_tokens=lookup or None, max_matching_ngram_size=1)
    for call in range(n // rows):
        if rows == 1:
            seq, _ = hs.generate(prompt, seed=call, **kw)
            pairs = [seq[0, -2:].tolist()]
        else:
            outs, _ = hs.generate([prompt[0]] * rows, seed=[call * rows + r for r in range(rows)], **kw)
            pairs = [o[-2:].tolist() for o in outs]
            if call == 0:   # a row draws as the prompt alone with its seed
                for r in range(3):
                    alone, _ = hs.generate(prompt, seed=r, **kw)
                    assert alone[0, -2:].tolist() == pairs[r], r
        for a, b in pairs:
            counts[a * vocab + b] += 1
    assert counts[joint == 0].sum() == 0, "emitted a pair the warped target never emits"
    exp = joint / joint.sum() * counts.sum()   # sums to the observed total exactly, as chisquare checks
    keep = exp >= 5
    obs_cells = np.append(counts[keep], counts[~keep].sum())
    exp_cells = np.append(exp[keep], exp[~keep].sum())
    if exp_cells[-1] < 5:  # fold the small remainder into the smallest kept cell
        i = int(np.argmin(exp_cells[:-1]))
        obs_cells[i] += obs_cells[-1]
        exp_cells[i] += exp_cells[-1]
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    assert len(exp_cells) >= 3
    assert scipy_stats.chisquare(obs_cells, exp_cells).pvalue > 1e-4


def test_do_sample_switches_as_in_huggingfaces_generate():
    """do_sample=False is greedy whatever the temperature; True samples at temperature 1.0 when none is given (the
    draws of temperature=1.0 with the same seed); None decides by the temperature."""
    model = tiny_target("llama")
    p = prompts(1)[0]
    hs = HeteroSpec(model, NoisyDraft(32, V).to(DEVICE), Policy.static(3, 3, 10), cuda_graphs=False)
    greedy = reference_greedy(model, p, 16).tolist()
    kw = dict(max_new_tokens=16, eos_token_id=[], seed=4)
    assert hs.generate(p, temperature=1.5, do_sample=False, **kw)[0].tolist() == greedy
    assert hs.generate(p, do_sample=None, **kw)[0].tolist() == greedy
    sampled = hs.generate(p, do_sample=True, **kw)[0].tolist()
    assert sampled == hs.generate(p, temperature=1.0, **kw)[0].tolist() != greedy
    assert hs.generate(p, do_sample=True, temperature=0.7, **kw)[0].tolist() == \
        hs.generate(p, temperature=0.7, **kw)[0].tolist()


def test_sampling_is_reproducible_with_a_seed():
    model = tiny_target("llama")
    hs = HeteroSpec(model, OracleDraft(model), Policy.static(4, 3, 10), cuda_graphs=False)
    p = prompts(1)[0]
    a, _ = hs.generate(p, max_new_tokens=20, temperature=0.9, seed=7)
    b, _ = hs.generate(p, max_new_tokens=20, temperature=0.9, seed=7)
    c, _ = hs.generate(p, max_new_tokens=20, temperature=0.9, seed=8)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


# ---- stopping and streaming -----------------------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.view(-1).tolist())

    def end(self):
        self.ended = True


def test_eos_inside_an_accepted_path_truncates_there():
    model = tiny_target("llama")
    p = prompts(1)[0]
    ref = reference_greedy(model, p, 40)[0, p.shape[1]:].tolist()
    eos = ref[13]  # the oracle accepts ~8 tokens a cycle, so this lands inside an accepted path
    first = ref.index(eos)
    rec = Recorder()
    seq, stats = HeteroSpec(model, OracleDraft(model), Policy.static(7, 3, 20), cuda_graphs=False).generate(
        p, max_new_tokens=40, eos_token_id=eos, streamer=rec)
    assert seq[0, p.shape[1]:].tolist() == ref[: first + 1]
    assert rec.chunks[0] == p[0].tolist() and sum(rec.chunks[1:], []) == ref[: first + 1] and rec.ended


@pytest.mark.parametrize("budget", [1, 2, 9, 17])
def test_max_new_tokens_is_never_overshot(budget):
    model = tiny_target("llama")
    p = prompts(1)[0]
    seq, stats = HeteroSpec(model, OracleDraft(model), Policy.static(7, 3, 20), cuda_graphs=False).generate(
        p, max_new_tokens=budget)
    assert seq.shape[1] - p.shape[1] == budget == stats.new_tokens
    assert seq.tolist() == reference_greedy(model, p, budget).tolist()


def test_stopping_criteria_inside_a_path():
    model = tiny_target("llama")
    p = prompts(1)[0]
    ref = reference_greedy(model, p, 30)[0].tolist()
    stop_len = p.shape[1] + 11

    def crit(ids, scores):
        return torch.tensor([ids.shape[1] >= stop_len])

    seq, _ = HeteroSpec(model, OracleDraft(model), Policy.static(7, 3, 20), cuda_graphs=False).generate(
        p, max_new_tokens=30, stopping_criteria=[crit])
    assert seq[0].tolist() == ref[:stop_len]


def test_stop_strings_end_each_request_where_hf_generate_ends_it():
    """``stop_strings`` with the ``tokenizer``, HuggingFace's option: the output equals HF's generate with the same
    strings (the tokens that made one kept), each ending inside a verified path of the oracle draft, alone and in
    a batch where every row stops at its own place."""
    from _pairs import word_tokenizer

    tok = word_tokenizer(last="abcdef")
    model = tiny_target("llama")
    ps = prompts(3)
    stops = []
    for p, at in zip(ps, (6, 9, 13)):    # the text of two new tokens, e.g. " w12 w40"
        new = reference_greedy(model, p, 30)[0, p.shape[1]:].tolist()
        stops.append(" " + tok.decode(new[at - 1:at + 1]))
    refs = [model.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=30, pad_token_id=0,
                           eos_token_id=None, stop_strings=stops, tokenizer=tok)[0].cpu() for p in ps]
    assert all(r.shape[0] < p.shape[1] + 30 for r, p in zip(refs, ps))      # every one stopped early
    assert len({r.shape[0] - p.shape[1] for r, p in zip(refs, ps)}) > 1     # at different places
    hs = HeteroSpec(model, OracleDraft(model), Policy.static(7, 3, 20), cuda_graphs=False)
    for p, ref in zip(ps, refs):
        seq, stats = hs.generate(p, max_new_tokens=30, eos_token_id=[], stop_strings=stops, tokenizer=tok)
        assert seq[0].tolist() == ref.tolist()
        assert stats.cycles < stats.new_tokens        # paths of several tokens: the stop fell inside one
    out, _ = hs.generate([p[0] for p in ps], max_new_tokens=30, eos_token_id=[], stop_strings=stops, tokenizer=tok)
    assert [o.tolist() for o in out] == [r.tolist() for r in refs]


# ---- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=5, temperature=-0.1), "temperature"),
    (dict(max_new_tokens=5, temperature=0.5, top_p=0.0), "top_p"),
    (dict(max_new_tokens=5, temperature=0.5, top_p=1.5), "top_p"),
    (dict(max_new_tokens=5, top_k=-1), "top_k"),
    (dict(max_new_tokens=600), "max_position_embeddings"),
    (dict(max_new_tokens=5, logits_processor=[None]), "argument 'logits_processor' expected callables"),
    (dict(max_new_tokens=5, stop_strings=["</s>"]), "argument 'tokenizer' expected the target's tokenizer"),
    (dict(max_new_tokens=5, repetition_penalty=0.0), "argument 'repetition_penalty' expected None or a finite"),
    (dict(max_new_tokens=5, do_sample=1), "argument 'do_sample' expected None, True or False"),
    (dict(max_new_tokens=5, repetition_penalty=float("inf")), "argument 'repetition_penalty' expected"),
    (dict(max_new_tokens=5, repetition_penalty="1.2"), "argument 'repetition_penalty' expected"),
    (dict(max_new_tokens=5, stop_strings=[""]), "argument 'stop_strings' expected a non-empty string"),
    (dict(max_new_tokens=5, stop_strings=3), "argument 'stop_strings' expected a non-empty string"),
])
def test_bad_generate_arguments(kwargs, match):
    model = tiny_target("llama")
    with pytest.raises(ValueError, match=match):
        HeteroSpec(model, cuda_graphs=False).generate(prompts(1)[0], **kwargs)


def test_attention_implementation_without_tree_masks_is_refused():
    model = tiny_target("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa"):
        HeteroSpec(model, cuda_graphs=False)


def test_bad_policies():
    with pytest.raises(ValueError, match="thresholds"):
        Policy.paper(7, 10, 60, thresholds=(1.0, 0.5))
    with pytest.raises(ValueError, match="top_k"):
        Policy.static(7, 0, 60)


def test_generate_stops_at_the_models_eos_by_default_as_hf_generate_does():
    """Issue 41.3: eos_token_id=None means the model's generation_config.eos_token_id (HF's generate does the
    same), an explicit id or list is used as given, and [] means none.  A user calling hs.generate(ids,
    max_new_tokens=64) ran 64 tokens past <|im_end|> where HF's generate stopped."""
    import heterospec

    model = tiny_target("llama")
    p = prompts(1)[0]
    free = reference_greedy(model, p, 24)[0, p.shape[1]:].tolist()
    eos = free[9]                                   # a token the greedy output reaches at step 10 (maybe earlier)
    stop = free.index(eos) + 1
    model.generation_config.eos_token_id = eos
    hf = model.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=24, pad_token_id=0)
    assert hf.shape[1] - p.shape[1] == stop         # HF stops at the model's EOS
    for policy, draft in ((heterospec.Policy.static(4, 3, 10), OracleDraft(model)),
                          (heterospec.Policy.autoregressive(), None)):
        with heterospec.HeteroSpec(model, draft, policy, cuda_graphs=False) as hs:
            seq, _ = hs.generate(p, max_new_tokens=24)
            assert seq.tolist() == hf.cpu().tolist()
            assert hs.generate(p, max_new_tokens=24, eos_token_id=[])[0].shape[1] == p.shape[1] + 24
            other = free[3] if free[3] != eos else free[4]
            assert hs.generate(p, max_new_tokens=24, eos_token_id=other)[0][0, -1].item() == other
            model.generation_config.eos_token_id = [12345, eos]          # a list, as Llama 3 ships it
            assert hs.generate(p, max_new_tokens=24)[0].tolist() == hf.cpu().tolist()
            model.generation_config.eos_token_id = eos
            with pytest.raises(ValueError, match="argument 'eos_token_id' expected a token id"):
                hs.generate(p, max_new_tokens=4, eos_token_id="</s>")
    model.generation_config.eos_token_id = None


# ---- HuggingFace generate integration ------------------------------------------------------------------------


def test_custom_generate_in_hf_generate_is_lossless():
    import heterospec

    model = tiny_target("qwen2")
    for p in prompts(4):
        ref = reference_greedy(model, p, 24)
        out = model.generate(p, attention_mask=torch.ones_like(p), custom_generate=heterospec.custom_generate,
                             draft=OracleDraft(model), policy=heterospec.Policy.static(5, 3, 12),
                             max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out.tolist() == ref.tolist()
    # hooks are removed after each call: none left on the model
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)


def test_custom_generate_from_a_text_generation_pipeline():
    """HuggingFace's text-generation pipeline hands its generate keyword arguments to custom_generate: the text
    is the pipeline's own without it, greedy, for a string and for a list of prompts."""
    import heterospec
    from _pairs import word_tokenizer

    model = tiny_target("llama")
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=word_tokenizer(), device=DEVICE)
    texts = ["w5 w17 w3 w40 w22", "w9 w9 w1"]
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = pipe(texts, **kw)
    out = pipe(texts, custom_generate=heterospec.custom_generate, draft=OracleDraft(model),
               policy=Policy.static(5, 3, 12), **kw)
    assert out == ref and len(ref[0][0]["generated_text"].split()) > 5 + 8     # the prompt and 16 words
    assert pipe(texts[0], custom_generate=heterospec.custom_generate, **kw) == ref[0]


def test_custom_generate_stops_at_stop_strings_through_stopping_criteria():
    """HuggingFace's generate keeps the tokenizer from a custom_generate callable, so its stop_strings cannot
    reach the engine: StopStringCriteria given as stopping_criteria gives HF's own stop_strings output, and
    stop_strings given anyway is one line naming the way that works (not HF's "pass the tokenizer", which the
    user did)."""
    import heterospec
    from _pairs import word_tokenizer

    tok = word_tokenizer(last="abcdef")
    model = tiny_target("llama")
    p = prompts(1)[0]
    new = reference_greedy(model, p, 30)[0, p.shape[1]:].tolist()
    stop = " " + tok.decode(new[10:12])
    kw = dict(attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=30, pad_token_id=0, eos_token_id=None)
    ref = model.generate(p, stop_strings=[stop], tokenizer=tok, **kw)
    assert ref.shape[1] < p.shape[1] + 30
    criteria = transformers.StoppingCriteriaList([transformers.StopStringCriteria(tok, [stop])])
    out = model.generate(p, custom_generate=heterospec.custom_generate, draft=OracleDraft(model),
                         policy=Policy.static(5, 3, 12), stopping_criteria=criteria, **kw)
    assert out.tolist() == ref.tolist()
    with pytest.raises(ValueError, match=r"argument 'stop_strings' expected the tokenizer.*StopStringCriteria"):
        model.generate(p, custom_generate=heterospec.custom_generate, stop_strings=[stop], tokenizer=tok, **kw)


def test_custom_generate_refuses_processors_it_cannot_apply():
    """A processor that is not a function of each row's own tokens (prefix_allowed_tokens_fn gets a batch index),
    or a warper the acceptance does not apply (typical_p), is refused in one line naming it, never ignored."""
    import heterospec

    model = tiny_target("llama")
    p = prompts(1)[0]
    kw = dict(attention_mask=torch.ones_like(p), custom_generate=heterospec.custom_generate, draft=OracleDraft(model),
              max_new_tokens=5, pad_token_id=0)
    with pytest.raises(ValueError, match=r"argument 'logits_processor' .*\['PrefixConstrainedLogitsProcessor'\]"):
        model.generate(p, prefix_allowed_tokens_fn=lambda b, ids: [1, 2, 3], **kw)
    with pytest.raises(ValueError, match=r"\['TypicalLogitsWarper'\]"):
        model.generate(p, do_sample=True, typical_p=0.5, **kw)


# ---- logits processors -----------------------------------------------------------------------------------------

PROCESSED = dict(repetition_penalty=1.8, no_repeat_ngram_size=2)


def _processors():
    return transformers.LogitsProcessorList([transformers.RepetitionPenaltyLogitsProcessor(1.8),
                                             transformers.NoRepeatNGramLogitsProcessor(2)])


@pytest.mark.parametrize("method", ["autoregressive", "eagle3-oracle", "heterospec-noisy"])
def test_logits_processors_keep_greedy_output_equal_to_hf_generate(method):
    """A repetition penalty and no repeated 2-grams, applied to every tree node with its own path: each method's
    greedy output equals HuggingFace's generate with the same processors, from ``generate(logits_processor=)``
    and from ``custom_generate`` with the generation config's options; and the processors do change the output."""
    import heterospec

    model = tiny_target("qwen2")
    draft, policy = METHODS[method](model)
    changed = 0
    with HeteroSpec(model, draft, policy) as hs:
        for p in prompts(4):
            kw = dict(attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=30, pad_token_id=0,
                      eos_token_id=None, **PROCESSED)
            ref = model.generate(p, min_new_tokens=30, **kw).cpu()
            out, stats = hs.generate(p, max_new_tokens=30, logits_processor=_processors())
            assert out.tolist() == ref.tolist()
            via_hf = model.generate(p, custom_generate=heterospec.custom_generate, draft=draft, policy=policy, **kw)
            assert via_hf.tolist() == ref.tolist()
            changed += ref.tolist() != reference_greedy(model, p, 30).tolist()
    assert changed >= 3
    if method == "eagle3-oracle":
        assert stats.tau > 1.2   # trees were verified and accepted past the root


def test_the_drafts_distributions_are_processed_with_each_beams_path():
    """processors.apply_draft: the root expansion's distribution with the row's context, each beam's with the
    context and the beam's path (its candidates' parents walked up), in the target's vocabulary (draft id j is
    target id j + d2t[j]; every other id at -inf, never handed back)."""
    from heterospec.engine import processors
    from heterospec.growth import Growth

    seen = {}

    def record(ids, scores):
        for row, sc in zip(ids.tolist(), scores):
            seen[tuple(row)] = sc.clone()
        return scores + torch.arange(scores.shape[-1], dtype=scores.dtype)   # + the target id

    d2t = torch.tensor([1, 1, 2, 4])            # draft ids 0..3 -> target ids 1, 2, 4, 7 of 9
    root = torch.tensor([[[0.0, 3.0, 2.0, 1.0]]])
    out = processors.apply_draft([(record,)], [[5, 6]], 9, None, root, d2t)
    assert list(seen) == [(5, 6)]
    assert torch.equal(seen[(5, 6)][[1, 2, 4, 7]], root[0, 0]) and seen[(5, 6)][[0, 3, 5, 6, 8]].eq(-float("inf")).all()
    assert torch.equal(out, root + torch.tensor([1.0, 2.0, 4.0, 7.0]))
    g = Growth.root(root, 2, d2t)               # the root's 2 children: target ids 2 (score 3) and 4 (score 2)
    seen.clear()
    level = torch.zeros(1, 2, 4)
    processors.apply_draft([(record,)], [[5, 6]], 9, g, level, d2t)
    assert sorted(seen) == [(5, 6, 2), (5, 6, 4)]
    g2 = g.extend(level, d2t)                   # beams one level down: paths of two tokens
    seen.clear()
    processors.apply_draft([(record,)], [[5, 6]], 9, g2, level, d2t)
    assert all(len(k) == 4 and k[:3] in ((5, 6, 2), (5, 6, 4)) for k in seen)


def test_processors_see_each_nodes_own_path():
    """processors.apply hands node i of each row the row's context and then the tree tokens from the root's child
    down to i (written out here for a fixed tree) through that row's own processors, and leaves padding nodes
    alone; check takes one list for every request or one list per request."""
    from heterospec.engine import processors

    seen = []

    def record(ids, scores):
        for row in ids.tolist():
            seen.append(row)
        return scores + 1.0

    tokens = torch.tensor([[9, 4, 5, 6, 7, 9], [8, 2, 9, 9, 9, 9]])
    parents = torch.tensor([[-1, 0, 0, 1, 3, 0], [-1, 0, 0, 0, 0, 0]])
    logits = torch.zeros(2, 6, 3)
    twice = (record, lambda ids, scores: scores * 2)
    out = processors.apply([(record,), twice], [[1, 9], [3, 8]], tokens, parents, torch.tensor([5, 2]), logits)
    assert sorted(seen) == sorted([[1, 9], [1, 9, 4], [1, 9, 5], [1, 9, 4, 6], [1, 9, 4, 6, 7], [3, 8], [3, 8, 2]])
    assert out[0, :5].eq(1).all() and out[0, 5].eq(0).all()
    assert out[1, :2].eq(2).all() and out[1, 2:].eq(0).all()
    assert processors.check(record, 2) == [(record,), (record,)] and processors.check([], 3) == []
    assert processors.check([[record], list(twice)], 2) == [(record,), twice]
    with pytest.raises(ValueError, match="argument 'logits_processor' expected callables"):
        processors.check([record, 3], 1)
    with pytest.raises(ValueError, match="expected each processor to return scores of shape"):
        processors.apply([(lambda ids, s: s[:, :2],)] * 2, [[1], [3]], tokens, parents, torch.tensor([1, 1]), logits)


def test_custom_generate_eos_from_the_generation_config():
    import heterospec

    model = tiny_target("llama")
    p = prompts(1)[0]
    ref = reference_greedy(model, p, 30)[0, p.shape[1]:].tolist()
    eos = ref[9]
    out = model.generate(p, attention_mask=torch.ones_like(p), custom_generate=heterospec.custom_generate,
                         draft=OracleDraft(model), policy=heterospec.Policy.static(6, 3, 16), max_new_tokens=30,
                         eos_token_id=eos, pad_token_id=0)
    assert out[0, p.shape[1]:].tolist() == ref[: ref.index(eos) + 1]
