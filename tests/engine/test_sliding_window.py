"""Targets whose attention slides (Mistral, Phi-3, StarCoder2, Mixtral: every layer; Gemma 2/3, Qwen2/3 and
Qwen2-MoE with ``use_sliding_window``, Ministral, Cohere 2, EXAONE 4, gpt-oss: some layers, by ``config.layer_types``): the engine restricts each
forward's mask to the window as transformers does, so greedy output equals HuggingFace's own generate -- for prompts
and generations longer than the window, where the window changes HuggingFace's output (checked first: a test that
could not fail otherwise), with autoregressive decoding, EAGLE-3 trees and HeteroSpec's bins, one prompt or a
left-padded batch.  Before the engine knew the window, every such model drifted from HuggingFace's output past the
window.  Also the vision-language class ``AutoModelForCausalLM`` gives for Gemma 3 (its decoder under
``model.language_model``): its text generation equals HuggingFace's, and ``custom_generate`` refuses an image in one
line."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft, OracleDraft  # noqa: E402
from _models import DEVICE, THRESHOLDS  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.engine.requests import left_pad  # noqa: E402
from heterospec.models import cpu_decoder, cpu_gemm  # noqa: E402
from heterospec.models.target import sliding_layout  # noqa: E402

VOCAB, WINDOW, PROMPT, NEW = 64, 12, 30, 32
OUR_DECODER = cpu_gemm.rows_available() and cpu_gemm._rows_module().isa_best() >= 1   # cpu_decoder='auto' runs
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, attn_implementation="sdpa")
# arch -> (config class, model class, extra config, lm_head scale: Gemma's logits stay unsharpened, as its soft
# capping / embedding scale otherwise leave greedy ties that hide the window)
ARCHS = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW), 40.0),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW, pad_token_id=0), 40.0),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=WINDOW, initializer_range=0.2),
                   4.0),   # (its default init, 0.018, leaves the attention too flat for the window to show)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2), 40.0),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=8, sliding_window=WINDOW), 1.0),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(sliding_window=WINDOW, initializer_range=0.2), 4.0),
    # (three sliding layers to a full one; a wider init, as StarCoder2)
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(sliding_window=WINDOW, pad_token_id=0), 40.0),   # (its
    # pattern: three sliding layers to a full one, which rotates nothing)
    "ministral": ("MinistralConfig", "MinistralForCausalLM",   # (Ministral-8B's sliding and full layers)
                  dict(sliding_window=WINDOW, head_dim=8, layer_types=["sliding_attention", "full_attention"] * 3),
                  40.0),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=WINDOW, num_local_experts=4,
                                                             num_experts_per_tok=2), 40.0),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",   # (its sliding and full layers, shared experts)
                  dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64), 40.0),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=8, num_local_experts=4, sliding_window=WINDOW, attn_implementation="eager"), 40.0),
}


def _model(arch, window=WINDOW):
    cfg_name, cls_name, extra, scale = ARCHS[arch]
    kw = dict(COMMON, **extra)
    kw["sliding_window"] = window
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**kw)).eval().float()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model.to(DEVICE)


def _hf(model, p, new=NEW):
    out = model.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, pad_token_id=0, eos_token_id=None)
    return out[0, p.shape[1]:].tolist()


def _prompt(seed, n=PROMPT):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_model_refs(request):
    model = _model(request.param)
    ps = [_prompt(s) for s in (1, 2)]
    refs = [_hf(model, p) for p in ps]
    wide = _model(request.param, window=4096)            # the same weights, a window the sequence never reaches
    assert any(_hf(wide, p) != r for p, r in zip(ps, refs)), "the window must change HuggingFace's output here"
    return request.param, model, ps, refs


@pytest.mark.parametrize("method", ["ar", "eagle3-oracle", "eagle3-noisy", "heterospec-noisy"])
def test_greedy_equals_huggingface_past_the_window(arch_model_refs, method):
    arch, model, ps, refs = arch_model_refs
    draft, policy = {
        "ar": lambda: (None, Policy.autoregressive()),
        "eagle3-oracle": lambda: (OracleDraft(model), Policy.static(5, 3, 16)),
        "eagle3-noisy": lambda: (NoisyDraft(32, VOCAB).to(DEVICE), Policy.static(4, 4, 12)),
        "heterospec-noisy": lambda: (NoisyDraft(32, VOCAB, seed=3).to(DEVICE), Policy.paper(4, 4, 20, THRESHOLDS)),
    }[method]()
    with HeteroSpec(model, draft, policy, cuda_graphs=False) as hs:
        if DEVICE.type == "cpu" and OUR_DECODER:   # our CPU decoder, the window in its rows (every layer's, or the
            # sliding layers' among full ones); gpt-oss (experts with biases) on transformers'
            assert (hs.target.decoder is not None) == (arch != "gpt_oss"), hs.cpu_decoder
        for p, ref in zip(ps, refs):
            out, _ = hs.generate(p, max_new_tokens=NEW, eos_token_id=[])
            assert out[0, p.shape[1]:].tolist() == ref, f"{arch} {method}"


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_left_padded_batch_decodes_each_row_as_alone(arch):
    """Rows of different lengths (left padding in the prefill, each prompt then moved to column 0): each row's
    output is HuggingFace's for its prompt alone."""
    model = _model(arch)
    ps = [_prompt(10 + i, n) for i, n in enumerate((9, 30, 21))]
    refs = [_hf(model, p) for p in ps]
    ids, mask = left_pad(ps, 0, DEVICE)
    S = ids.shape[1]
    with HeteroSpec(model, OracleDraft(model), Policy.static(5, 3, 16), cuda_graphs=False) as hs:
        out, _ = hs.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[])
    assert [row[S:S + NEW].tolist() for row in out] == refs


def test_sliding_layout_reads_the_config_as_transformers_does():
    def cfg(**kw):
        return transformers.PretrainedConfig(**kw)

    assert sliding_layout(cfg()) is None
    assert sliding_layout(cfg(sliding_window=None)) is None
    assert sliding_layout(cfg(sliding_window=4096)) == (4096, False)                    # Mistral: every layer
    assert sliding_layout(cfg(sliding_window=512, layer_types=["sliding_attention", "full_attention"])) == (512, True)
    assert sliding_layout(cfg(sliding_window=4096, layer_types=["full_attention"] * 2)) is None   # Qwen2's default
    assert sliding_layout(_model("qwen2").config) == (WINDOW, True)
    assert sliding_layout(transformers.Qwen2Config(sliding_window=4096)) is None        # use_sliding_window False
    with pytest.raises(ValueError, match=r"^target: expected layers of full, sliding or linear attention "
                                         r"\(config\.layer_types\), got \['chunked_attention'\]"):
        sliding_layout(cfg(layer_types=["chunked_attention", "full_attention"]))
    with pytest.raises(ValueError, match=r"^target: expected config\.sliding_window None or an int >= 1, got 0"):
        sliding_layout(cfg(sliding_window=0))
    with pytest.raises(ValueError, match=r"^target: expected config\.sliding_window an int >= 1 for its "):
        sliding_layout(cfg(sliding_window=None, layer_types=["sliding_attention"]))
    if cpu_gemm.rows_available():   # our CPU decoder takes one window for every layer, or for the sliding ones
        assert cpu_decoder.unsupported(_model("qwen2").cpu()) is None
        assert cpu_decoder.unsupported(_model("mistral").cpu()) is None
        assert cpu_decoder.unsupported(_model("gpt_oss").cpu()).startswith("a 'gpt_oss' model")


def _gemma3_vlm():
    """A tiny Gemma 3 vision-language model: the class ``AutoModelForCausalLM`` gives for a Gemma 3 checkpoint, its
    decoder layers under ``model.language_model`` (sliding ones among them)."""
    text = {k: v for k, v in COMMON.items() if k != "attn_implementation"}
    cfg = transformers.Gemma3Config(
        text_config=dict(text, head_dim=8, sliding_window=WINDOW),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval().float()
    model.generation_config.eos_token_id = None
    return model.to(DEVICE)


def test_a_vision_language_models_text_generation_is_its_own():
    """``AutoModelForCausalLM`` gives Gemma 3 checkpoints as ``Gemma3ForConditionalGeneration``: on text, the
    engine decodes it as HuggingFace does (it was refused before: its layers are not at ``model.model.layers``)."""
    model = _gemma3_vlm()
    assert transformers.AutoModelForCausalLM._model_mapping[type(model.config)] is type(model)
    p = torch.randint(0, VOCAB - 3, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = _hf(model, p)
    for draft, policy in ((None, Policy.autoregressive()), (NoisyDraft(32, VOCAB).to(DEVICE), Policy.static(4, 4, 12))):
        with HeteroSpec(model, draft, policy, cuda_graphs=False) as hs:
            out, _ = hs.generate(p, max_new_tokens=NEW, eos_token_id=[])
            assert hs.target.max_positions == COMMON["max_position_embeddings"]     # the text model's limit
            if DEVICE.type == "cpu" and OUR_DECODER:   # its language model's layers on our CPU decoder
                assert hs.target.decoder is not None, hs.cpu_decoder
        assert out[0, PROMPT:].tolist() == ref


def test_custom_generate_refuses_images_and_takes_text_only_token_types():
    """An input the engine would ignore (an image's pixels) is refused in one line naming it; Gemma 3's
    ``token_type_ids`` of a text-only prompt (all 0) is taken, with the same output as without it."""
    from heterospec import custom_generate

    model = _gemma3_vlm()
    p = torch.randint(0, VOCAB - 3, (1, PROMPT), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    kw = dict(attention_mask=torch.ones_like(p), custom_generate=custom_generate, draft=None,
              policy=Policy.autoregressive(), max_new_tokens=8, do_sample=False, pad_token_id=0)
    # transformers 5.23 encodes the image first and hands over its mm_encoder_outputs; 5.0 the pixels themselves
    with pytest.raises(ValueError, match=r"^custom_generate: argument '(pixel_values|mm_encoder_outputs)' expected "
                                         r"None \(the speculative engine decodes input_ids alone"):
        model.generate(p, pixel_values=torch.zeros(1, 3, 28, 28, device=DEVICE), **kw)
    plain = model.generate(p, **kw)
    typed = model.generate(p, token_type_ids=torch.zeros_like(p), **kw)
    assert typed.tolist() == plain.tolist() == [p[0].tolist() + _hf(model, p, 8)]


def test_a_saved_model_without_sdpa_loads_with_eager_attention(tmp_path):
    """The CLI's loader (``models.default.load_target``, what ``--target PATH`` runs) takes sdpa where transformers
    has it and eager where it has not (Gemma 2 in transformers 5.23: sdpa refused; 5.0 takes it), so such a model
    needs no flag; the loaded model decodes as HF's generate does."""
    from heterospec.models.default import load_target

    cfg = transformers.Gemma2Config(**dict(COMMON, head_dim=8, sliding_window=WINDOW, attn_implementation="eager"))
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(cfg).save_pretrained(tmp_path / "gemma2")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).save_pretrained(tmp_path / "llama")
    gemma2, llama = load_target(tmp_path / "gemma2"), load_target(tmp_path / "llama")
    try:                                   # does this transformers give Gemma 2 sdpa?
        transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**dict(COMMON, head_dim=8)))
        expected = "sdpa"
    except ValueError as e:
        assert "scaled_dot_product_attention" in str(e)
        expected = "eager"
    assert gemma2.config._attn_implementation == expected and llama.config._attn_implementation == "sdpa"
    gemma2 = gemma2.eval().to(DEVICE)
    gemma2.generation_config.eos_token_id = None
    p = _prompt(4)
    with HeteroSpec(gemma2, None, Policy.autoregressive(), cuda_graphs=False) as hs:
        out, _ = hs.generate(p, max_new_tokens=NEW, eos_token_id=[])
    assert out[0, PROMPT:].tolist() == _hf(gemma2, p)
    with pytest.raises(OSError):
        load_target(tmp_path / "missing")
