"""The families whose decoder layers are not at ``model.model.layers`` decode as HuggingFace does: GPT-2, GPT-NeoX
(Pythia), OPT, GPT-J, CodeGen, GPTBigCode (StarCoder 1, SantaCoder), Falcon, BioGPT, XGLM, CTRL and DBRX.  The
engine finds the decoder through the causal LM's ``base_model`` and its layer list (``.layers``, ``.h``, ``.blocks``
or ``.decoder.layers``).  Several of them ask their cache for its length in every forward (OPT, BioGPT, CTRL, Falcon,
XGLM), only where no position_ids or 2D mask is given (the engine gives both) or to size a table of positions
(XGLM): the cache answers them alone.  Checked: tokens and raw logits (1e-4) against HuggingFace's generate for
autoregressive decoding and trees (an oracle draft's and a noisy one's), sampled trees with rejections, and
left-padded batches of learned absolute positions.  What cannot be exact is refused in one line: ALiBi (BLOOM, MPT,
Falcon with ``alibi``), GPT-Neo's local layers (their window placed by the number of keys: a test below shows the
logits a static cache would give), a model without a key/value cache (OpenAI GPT).  GPT-2, GPT-NeoX, GPTBigCode,
OPT, GPT-J and CodeGen run on heterospec's own CPU decoder by default in float32 on the CPU: their tests here run
both that and transformers' modules."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft, OracleDraft  # noqa: E402
from _models import DEVICE, hf_with_logits, left_padded  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.models import target as target_mod  # noqa: E402
from heterospec.models.target import TargetAdapter, _decoder_layers, layers_owner  # noqa: E402

VOCAB, NEW, LAYERS = 64, 24, 4
RELEASE = tuple(int(x) for x in transformers.__version__.split(".")[:2])
TOL = 1e-4
SMALL = dict(vocab_size=VOCAB, pad_token_id=0)


def _built(cls_name, cfg_name, attn="sdpa", since=(5, 0), **kw):
    """A tiny model of the family; skipped before ``since``, where this test's config does not build it."""
    if RELEASE < since:
        pytest.skip(f"transformers {transformers.__version__}: {cfg_name} takes other arguments before {since}")
    cfg = (cfg_name if isinstance(cfg_name, type) else getattr(transformers, cfg_name))(**SMALL, **kw)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval().float()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)   # peaked: a wrong forward changes the tokens at once
    return model.to(DEVICE)


def _gpt2(n):
    return dict(n_embd=32, n_layer=n, n_head=4, n_positions=512)



# (the model, where its layers are: the base model's attribute and the layer list's)
BUILT = {
    "gpt2": (lambda n=LAYERS: _built("GPT2LMHeadModel", "GPT2Config", **_gpt2(n)), "transformer", "h"),
    "gpt-neox": (lambda n=LAYERS: _built("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_size=32, num_hidden_layers=n,
                                         num_attention_heads=4, intermediate_size=64, max_position_embeddings=512),
                 "gpt_neox", "layers"),
    "opt": (lambda n=LAYERS: _built("OPTForCausalLM", "OPTConfig", hidden_size=32, num_hidden_layers=n,
                                    num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32,
                                    max_position_embeddings=512), "model", "decoder.layers"),
    "gpt-j": (lambda n=LAYERS: _built("GPTJForCausalLM", "GPTJConfig", "eager", rotary_dim=4, **_gpt2(n)),
              "transformer", "h"),
    "codegen": (lambda n=LAYERS: _built("CodeGenForCausalLM", "CodeGenConfig", "eager", rotary_dim=4, n_ctx=512,
                                        **_gpt2(n)), "transformer", "h"),
    "gpt-bigcode": (lambda n=LAYERS: _built("GPTBigCodeForCausalLM", "GPTBigCodeConfig", multi_query=True,
                                            **_gpt2(n)), "transformer", "h"),
    "falcon": (lambda n=LAYERS: _built("FalconForCausalLM", "FalconConfig", hidden_size=32, num_hidden_layers=n,
                                       num_attention_heads=4, max_position_embeddings=512), "transformer", "h"),
    "biogpt": (lambda n=LAYERS: _built("BioGptForCausalLM", "BioGptConfig", hidden_size=32, num_hidden_layers=n,
                                       num_attention_heads=4, intermediate_size=64, max_position_embeddings=512),
               "biogpt", "layers"),
    "xglm": (lambda n=LAYERS: _built("XGLMForCausalLM", "XGLMConfig", "eager", d_model=32, num_layers=n,
                                     attention_heads=4, ffn_dim=64, max_position_embeddings=512), "model", "layers"),
    "ctrl": (lambda n=LAYERS: _built("CTRLLMHeadModel", "CTRLConfig", "eager", n_embd=32, n_layer=n, n_head=4,
                                     dff=64, n_positions=512), "transformer", "h"),
    "dbrx": (lambda n=LAYERS: _built("DbrxForCausalLM", "DbrxConfig", since=(5, 23), d_model=32, n_heads=4,
                                     n_layers=n, max_seq_len=512,
                                     attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                     ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
             "transformer", "blocks"),
}
# families whose forward on older transformers releases builds its own mask from the cache's length: refused there
# (the length refusal), decoded from 5.23 on (the releases between are not tested, so refused too where they ask)
LENGTH_BUILT_MASK = {"gpt-j", "codegen", "xglm", "ctrl"}
ASKS_LENGTH = (r"^target cache: expected a model that takes position_ids and a 4D mask as given, got one whose "
               r"forward asks its cache for a length")
METHODS = {
    "ar": lambda m: (None, Policy.autoregressive()),
    "oracle-tree": lambda m: (OracleDraft(m), Policy.static(5, 3, 16)),
    "noisy-tree": lambda m: (NoisyDraft(32, VOCAB).to(DEVICE), Policy.static(4, 4, 12)),
}


def _prompt(n, seed=None):
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(n if seed is None else seed)
                         ).to(DEVICE)


def _hf(model, p, forced=None, mask=None):
    """HuggingFace's greedy generate (or ``forced`` tokens) -> (tokens [B, NEW], raw logits [B, NEW, V])."""
    return hf_with_logits(model, p, NEW, forced=forced, mask=mask)


@pytest.fixture(scope="module", params=list(BUILT))
def family(request):
    return request.param, BUILT[request.param][0]()


def _old(name):
    return name in LENGTH_BUILT_MASK and RELEASE < (5, 23)


# families whose float32 CPU forward heterospec's own decoder runs (cpu_decoder "auto"): each test below runs them
# both ways, ours and transformers' modules (cpu_decoder=False)
OWN_DECODER = {"gpt2", "gpt-neox", "gpt-bigcode", "opt", "gpt-j", "codegen"}


def _decoders(name):
    return ("auto", False) if name in OWN_DECODER else ("auto",)


def _engine(model, name, draft, policy, setting):
    hs = HeteroSpec(model, draft, policy, cuda_graphs=False, cpu_decoder=setting)
    ours = setting == "auto" and name in OWN_DECODER and DEVICE.type == "cpu"
    assert (hs.cpu_decoder != "off") == ours, (name, setting, hs.cpu_decoder)
    return hs


def test_the_decoder_is_found_under_each_layout(family):
    name, model = family
    _, base, layers = BUILT[name]
    assert layers_owner(model) is getattr(model, base)
    want = getattr(model, base)
    for part in layers.split("."):
        want = getattr(want, part)
    assert _decoder_layers(model) is want and len(want) == LAYERS
    if _old(name):
        with pytest.raises(ValueError, match=ASKS_LENGTH):
            TargetAdapter(model)
        return
    tgt = TargetAdapter(model)
    assert len(tgt.layout) == LAYERS and None not in tgt.layout


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_tokens_and_logits_equal_huggingface(family, method):
    name, model = family
    draft, policy = METHODS[method](model)
    if _old(name):
        return _refused(model, ASKS_LENGTH)
    for setting in _decoders(name):
        with _engine(model, name, draft, policy, setting) as hs:
            for n in (7, 30):
                tokens, logits = _hf(model, _prompt(n))
                out, st = hs.generate(_prompt(n), max_new_tokens=NEW, eos_token_id=[], output_logits=True)
                assert out[0, n:].tolist() == tokens[0].tolist(), f"{name} {method} {setting} prompt {n}"
                err = float((st.logits - logits[0]).abs().max())
                assert err < TOL, f"{name} {method} {setting} prompt {n}: logits off by {err:.1e}"
                if method == "oracle-tree":
                    assert st.tau > 3.0, st.tau       # deep paths accepted: the commits moved real tree slots


@pytest.mark.parametrize("name", ["gpt2", "gpt-neox", "opt"])
def test_sampled_tree_logits_are_the_models_own(name):
    """Sampling through the oracle's trees (rejections at every depth): each new token's logits are HuggingFace's
    for the same sequence, taken token by token."""
    model = BUILT[name][0]()
    for setting in _decoders(name):
        with _engine(model, name, OracleDraft(model), Policy.static(4, 3, 12), setting) as hs:
            for n in (12, 20):
                out, st = hs.generate(_prompt(n), max_new_tokens=NEW, eos_token_id=[], output_logits=True,
                                      temperature=1.0, seed=7)
                tokens = out[0, n:].tolist()
                forced, logits = _hf(model, _prompt(n), forced=tokens)
                assert forced[0].tolist() == tokens
                assert float((st.logits - logits[0]).abs().max()) < TOL, f"{name} {setting} prompt {n}"
                assert 1.3 < st.tau, st.tau


@pytest.mark.parametrize("name", ["gpt2", "opt", "gpt-neox"])
def test_a_left_padded_batch_takes_each_rows_own_positions(name):
    """Learned absolute positions (GPT-2, OPT) and rotary ones: each row of a left-padded batch counts its positions
    from its own first token, as HuggingFace's generate does from the attention mask."""
    model = BUILT[name][0]()
    ps = [_prompt(n, seed=40 + n) for n in (5, 17, 11)]
    ids, mask = left_padded(ps)
    tokens, _ = _hf(model, ids, mask=mask)
    for setting in _decoders(name):
        with _engine(model, name, OracleDraft(model), Policy.static(5, 3, 16), setting) as hs:
            out, _ = hs.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[])
        for b, p in enumerate(ps):
            alone, _ = _hf(model, p)
            assert out[b, ids.shape[1]:].tolist() == alone[0].tolist() == tokens[b].tolist(), f"{name} {setting} {b}"


def _refused(model, match):
    for draft in (None, NoisyDraft(32, VOCAB).to(DEVICE)):
        with pytest.raises(ValueError, match=match):
            HeteroSpec(model, draft, Policy.autoregressive() if draft is None else Policy.static(4, 4, 12),
                       cuda_graphs=False)


ALIBI = r"^target: expected rotary or learned positions, got ALiBi \({}\), whose biases transformers builds from a " \
        r"2D mask of key positions, which a tree verification replaces by a 4D mask: the model is not supported$"


def test_alibi_is_refused_in_one_line():
    small = dict(hidden_size=32, n_layer=LAYERS, n_head=4)
    _refused(_built("BloomForCausalLM", "BloomConfig", "eager", **small), ALIBI.format("bloom"))
    _refused(_built("MptForCausalLM", "MptConfig", "eager", d_model=32, n_layers=LAYERS, n_heads=4, expansion_ratio=2,
                    max_seq_len=512), ALIBI.format("mpt"))
    _refused(_built("FalconForCausalLM", "FalconConfig", hidden_size=32, num_hidden_layers=LAYERS,
                    num_attention_heads=4, alibi=True), ALIBI.format("falcon"))


def _gpt_neo(kinds, window=16):
    return _built("GPTNeoForCausalLM", "GPTNeoConfig", "eager", hidden_size=32, num_layers=LAYERS, num_heads=4,
                  attention_types=[[kinds, LAYERS // len(kinds)]], window_size=window, max_position_embeddings=512)


def test_gpt_neos_local_layers_are_refused_and_its_global_ones_decode():
    _refused(_gpt_neo(["global", "local"]), r"^target: expected attention windows given by the mask, got GPT-Neo's "
                                            r"local layers, whose window the attention places by its number of keys "
                                            r"\(a static cache has more columns than tokens\): the model is not "
                                            r"supported$")
    model = _gpt_neo(["global"])
    if RELEASE < (5, 23):
        return _refused(model, ASKS_LENGTH)     # its forward before 5.23 builds its mask from the length
    tokens, logits = _hf(model, _prompt(30))
    with HeteroSpec(model, OracleDraft(model), Policy.static(5, 3, 16), cuda_graphs=False) as hs:
        out, st = hs.generate(_prompt(30), max_new_tokens=NEW, eos_token_id=[], output_logits=True)
    assert out[0, 30:].tolist() == tokens[0].tolist()
    assert float((st.logits - logits[0]).abs().max()) < TOL


def test_what_the_local_layers_refusal_prevents(monkeypatch):
    """The refusal guards a real difference: past the window, a chain verified on the static cache gets other logits
    than one forward of the whole sequence (0.1 here), though greedy tokens on a random model may agree."""
    if RELEASE < (5, 23):
        pytest.skip("GPT-Neo's forward before 5.23 asks its cache for a length: refused for that first")
    model = _gpt_neo(["global", "local"])
    with torch.no_grad():      # sharper attention, so that the keys the local layers drop matter
        for n, prm in model.named_parameters():
            if "q_proj" in n or "k_proj" in n:
                prm.mul_(6.0)
    monkeypatch.setattr(target_mod, "check_positions", lambda config: None)
    p = _prompt(40)
    with torch.no_grad():
        full = model(p).logits[0].float()
    tgt = TargetAdapter(model, capture_taps=False)
    tgt.allocate(100)
    first, _ = tgt.prefill(p[:, :30])
    assert float((first - full[29]).abs().max()) < TOL        # the prefill's keys are its own: exact
    chain = tgt.verify(p[0, 30:], torch.arange(10, device=DEVICE), torch.ones(10, 10, dtype=torch.bool,
                                                                             device=DEVICE).tril())[0]
    assert float((chain - full[30:]).abs().max()) > 1e-2


def test_a_model_without_a_key_value_cache_is_refused_in_one_line():
    gpt = _built("OpenAIGPTLMHeadModel", "OpenAIGPTConfig", "eager", n_embd=32, n_layer=LAYERS, n_head=4)
    _refused(gpt, r"^target: expected a model whose forward takes a KV cache \(past_key_values or cache\), got "
                  r"OpenAIGPTLMHeadModel, which takes none: the model is not supported$")


def test_a_model_with_no_decoder_layers_found_is_refused_in_one_line():
    class Bare(torch.nn.Module):
        base_model = None

    with pytest.raises(TypeError, match=r"^target: expected a HuggingFace decoder-only LM whose base model holds its "
                                        r"decoder layers \(.*\), got Bare$"):
        layers_owner(Bare())


@pytest.mark.parametrize("name", ["gpt2", "gpt-neox", "opt", "falcon"])
def test_a_real_eagle3_head_saved_and_loaded_against_the_target(name, tmp_path):
    """The path a user takes: an EAGLE-3 checkpoint loaded through ``Eagle3Draft.from_pretrained`` (checked against
    the target's config: GPT-2's ``n_embd`` read as its hidden size), its taps on the layers found, greedy output
    HuggingFace's under the default policy (HeteroSpec's bins) and a static tree."""
    from _models import eagle3_head

    model = BUILT[name][0](8)          # the default taps [2, 4, 5] need 7 layers or more
    head = eagle3_head(model, tmp_path).to(DEVICE)
    tokens, _ = _hf(model, _prompt(30))
    for policy in (None, Policy.static(5, 3, 16)):
        with HeteroSpec(model, head, policy, cuda_graphs=False) as hs:
            out, st = hs.generate(_prompt(30), max_new_tokens=NEW, eos_token_id=[])
        assert out[0, 30:].tolist() == tokens[0].tolist(), f"{name} {policy}"
        assert st.cycles < NEW or st.tau >= 1.0


# the MLP width each family's config names (GPT-2's family: n_inner None, so 4 x 32), and the RoPE base (GPT-NeoX
# and Falcon name theirs; GPT-J and CodeGen rotate with a fixed 10000; the rest have absolute positions)
HEAD_SHAPES = {"gpt2": 128, "gpt-neox": 64, "opt": 64, "gpt-j": 128, "codegen": 128, "gpt-bigcode": 128,
               "falcon": 128, "biogpt": 64, "xglm": 64, "ctrl": 64, "dbrx": 64}


def test_a_heads_config_is_made_for_every_family(family):
    from heterospec.models.train import draft_config_for

    name, model = family
    head = draft_config_for(model, 40)
    assert (head.hidden_size, head.intermediate_size, head.num_attention_heads) == (32, HEAD_SHAPES[name], 4)
    assert head.rope_theta == 10000.0 and head.head_dim == 8 and head.max_position_embeddings == 512


def test_a_config_of_an_unknown_family_without_a_rope_base_is_still_refused():
    import types

    from heterospec.models.train import draft_config_for

    cfg = types.SimpleNamespace(model_type="mystery", hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                                max_position_embeddings=512, to_dict=lambda: {"hidden_size": 32})
    with pytest.raises(ValueError, match=r"^draft_config_for: the target's config has no RoPE base"):
        draft_config_for(types.SimpleNamespace(config=cfg), 40)


@pytest.mark.parametrize("name", ["gpt2", "gpt-neox"])
def test_a_head_trained_for_the_family_is_lossless_and_accepts(name, tmp_path):
    """The recipe a user runs for a Pythia or a GPT-2 (train_draft: the target's answers, then the head): the loss
    falls, and the head, loaded back against the target, decodes as HuggingFace does and accepts its drafts."""
    import numpy as np

    from heterospec.models.draft import Eagle3Draft
    from heterospec.models.train import train_draft

    model = BUILT[name][0](8)
    ps = [_prompt(n, seed=90 + n) for n in (6, 9, 12, 15)]
    log = train_draft(model, ps, tmp_path, draft_vocab_size=40, steps=100, lr=3e-3, ttt_steps=3, max_new_tokens=32,
                      log_every=10)
    assert np.mean([loss for _, loss, _ in log[-3:]]) < 0.7 * log[0][1], log
    head = Eagle3Draft.from_pretrained(tmp_path, target=model)
    taus = []
    for p in ps[:2]:
        tokens, _ = _hf(model, p)
        with HeteroSpec(model, head, Policy.static(4, 4, 16), cuda_graphs=False) as hs:
            out, st = hs.generate(p, max_new_tokens=NEW, eos_token_id=[])
        assert out[0, p.shape[1]:].tolist() == tokens[0].tolist()
        taus.append(st.tau)
    assert np.mean(taus) > 1.5, taus


def test_through_huggingfaces_generate_and_the_clis_loader(tmp_path):
    """The two other ways in: ``model.generate(custom_generate=heterospec.custom_generate, ...)`` on GPT-2 with a
    tree policy, and ``--target PATH``'s loader (``load_target``) on a saved GPT-J, which transformers 5.23 gives no
    sdpa (the loader takes eager by itself); both decode as HuggingFace's own generate."""
    from heterospec import custom_generate
    from heterospec.models.default import load_target

    gpt2 = BUILT["gpt2"][0]()
    p = _prompt(20)
    tokens, _ = _hf(gpt2, p)
    out = gpt2.generate(p, attention_mask=torch.ones_like(p), custom_generate=custom_generate,
                        draft=NoisyDraft(32, VOCAB).to(DEVICE), policy=Policy.static(4, 4, 12), max_new_tokens=NEW,
                        do_sample=False, pad_token_id=0)
    assert out[0, 20:].tolist() == tokens[0].tolist()
    if _old("gpt-j"):
        return
    BUILT["gpt-j"][0]().save_pretrained(tmp_path / "gptj")
    gptj = load_target(tmp_path / "gptj").eval().to(DEVICE)
    gptj.generation_config.eos_token_id = None
    tokens, _ = _hf(gptj, p)
    with HeteroSpec(gptj, OracleDraft(gptj), Policy.static(5, 3, 16), cuda_graphs=False) as hs:
        out, _ = hs.generate(p, max_new_tokens=NEW, eos_token_id=[])
    assert out[0, 20:].tolist() == tokens[0].tolist()


def test_a_causal_lm_whose_prefix_names_none_of_its_attributes():
    """MllamaForCausalLM's ``base_model_prefix`` ("language_model") is no attribute of it, so ``base_model`` is the
    model itself: its decoder is found at ``model.model`` as before, and text decodes as HuggingFace's does."""
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig   # (not exported by 5.0)

    model = _built("MllamaForCausalLM", MllamaTextConfig, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1, 3],
                   max_position_embeddings=512)
    assert model.base_model is model and layers_owner(model) is model.model
    if RELEASE < (5, 23):
        return _refused(model, ASKS_LENGTH)      # its forward before 5.23 builds its own mask from the length
    p = _prompt(20)
    tokens, logits = _hf(model, p)
    with HeteroSpec(model, None, Policy.autoregressive(), cuda_graphs=False) as hs:
        out, st = hs.generate(p, max_new_tokens=NEW, eos_token_id=[], output_logits=True)
    assert out[0, 20:].tolist() == tokens[0].tolist() and float((st.logits - logits[0]).abs().max()) < TOL
