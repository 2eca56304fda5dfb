"""Targets whose layers cache keys and values of their own shapes decode as HuggingFace does: the engine probes each
layer's cache shapes with one forward (``kv_layout``) and keeps one tensor per shape.  Multi-head latent attention
(DeepSeek-V3 here; DeepSeek-V2, MiniCPM3, GLM-4.7-Flash, Mistral 4 and Youtu share its code) caches two latents of
different sizes, MiMo-V2-Flash's values are wider than its keys and its layers differ in head count, Gemma 4's
full and sliding layers differ in head size and its last layers read earlier layers' keys (KV sharing: no storage
of their own, and a tap there sees every prompt position), LongCat Flash's layers hold two attentions each.
Targets the engine cannot hold or tap are refused in one line: a cache write of another shape than probed, decoder
layers fed several residual streams (Gemma 3n's AltUp) or skipped (Mllama's cross-attention on text), whose hidden
states cannot be an EAGLE-3 draft's taps.  Gemma 3n without a draft decodes as HuggingFace does."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft, OracleDraft  # noqa: E402
from _models import DEVICE, left_padded, tiny_target  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.models.target import StaticKV, TargetAdapter  # noqa: E402

VOCAB = 64
NEW = 24


def _built(cls_name, cfg_name, attn="sdpa", **kw):
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    cfg = getattr(transformers, cfg_name)(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          max_position_embeddings=512, pad_token_id=0, **kw)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval().float()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)       # peaked distributions: long greedy runs differ at once when wrong
    return model.to(DEVICE)


def _mla():
    return _built("DeepseekV3ForCausalLM", "DeepseekV3Config", num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                  kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)


def _mimo():
    return _built("MiMoV2FlashForCausalLM", "MiMoV2FlashConfig", attn="eager", num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16)


def _gemma4():
    return _built("Gemma4ForCausalLM", "Gemma4TextConfig", num_hidden_layers=9, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=16,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 3, num_kv_shared_layers=4,
                  vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)


def _longcat():
    return _built("LongcatFlashForCausalLM", "LongcatFlashConfig", num_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                  qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, moe_topk=2, expert_ffn_hidden_size=32,
                  zero_expert_num=2, ffn_hidden_size=64)


BUILT = {"mla": _mla, "mimo": _mimo, "gemma4": _gemma4, "longcat": _longcat}
# what the probe must find: (key heads, key size), (value heads, value size) per cache index; None: nothing written.
# Multi-head latent attention: transformers 5.23 caches the latent (kv_lora_rank 16) and the rotary keys (4), one
# head each; 5.0 cached the expanded keys (4 heads of nope 8 + rope 4) and values (4 heads of 8).
LATENT, EXPANDED = ((1, 16), (1, 4)), ((4, 12), (4, 8))
LAYOUTS = {
    "mla": ([LATENT] * 3, [EXPANDED] * 3),
    "mimo": ([((2, 8), (2, 128))] + [((4, 8), (4, 128))] * 3,),   # sliding layers: other head counts; values 128
    "gemma4": ([((2, 8), (2, 8))] * 2 + [((2, 16), (2, 16))] + [((2, 8), (2, 8))] * 2,),   # 4 KV-shared layers
    "longcat": ([LATENT] * 8, [EXPANDED] * 8),                   # two attentions per decoder layer
}


def _reference(model, p, new=NEW):
    return model.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=new,
                          min_new_tokens=new, pad_token_id=0, eos_token_id=None)[0, p.shape[1]:].tolist()


@pytest.mark.parametrize("name", list(BUILT))
def test_the_probe_finds_each_layers_own_cache_shapes(name):
    model = BUILT[name]()
    tgt = TargetAdapter(model)
    assert tgt.layout in LAYOUTS[name]
    size = torch.empty((), dtype=tgt.dtype).element_size()
    assert tgt.cache_bytes(100) == 100 * size * sum(h * d for kv in tgt.layout for h, d in kv)
    tgt.allocate(100)
    assert tgt.kv is None             # no single [B, 2, layers, heads, S, size] tensor: one per shape
    assert sum(t.numel() * t.element_size() for t in tgt._storage) == tgt.cache_bytes(100)
    for kv, want in zip(tgt.cache.views(), tgt.layout):
        assert [(t.shape[1], t.shape[3], t.shape[2]) for t in kv] == [(h, d, 100) for h, d in want]


def test_a_uniform_model_keeps_one_tensor():
    tgt = TargetAdapter(tiny_target("llama", layers=3))
    assert tgt.layout == [((2, 8), (2, 8))] * 3
    tgt.allocate(20)
    assert len(tgt._storage) == 1 and tuple(tgt.kv.shape) == (1, 2, 3, 2, 20, 8)
    k, v = tgt.cache.views()[1]
    assert k.data_ptr() == tgt.kv[:, 0, 1].data_ptr() and v.data_ptr() == tgt.kv[:, 1, 1].data_ptr()


@pytest.mark.parametrize("name", list(BUILT))
def test_layers_of_their_own_shapes_decode_as_huggingface(name):
    model = BUILT[name]()
    p = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = _reference(model, p)
    # the recorded-step plumbing (one storage tensor per shape in every step) emulated on the CPU; on a GPU these
    # tiny MoE and KV-sharing models run the eager engine here (recording them is not claimed)
    steps = "emulate" if DEVICE.type == "cpu" else False
    for label, draft, policy, graphs in (("ar", None, Policy.autoregressive(), False),
                                         ("oracle", OracleDraft(model), Policy.static(5, 3, 16), False),
                                         ("noisy", NoisyDraft(32, VOCAB).to(DEVICE), Policy.static(4, 4, 12), False),
                                         ("steps", OracleDraft(model), Policy.static(4, 3, 12), steps)):
        with HeteroSpec(model, draft, policy, cuda_graphs=graphs) as hs:
            out, stats = hs.generate(p, max_new_tokens=NEW, eos_token_id=[])
        assert out[0, 30:].tolist() == ref, f"{name} {label}: differs from HF's greedy"
        if label in ("oracle", "steps"):
            assert stats.tau > 2.0, stats.tau       # long paths accepted: the commits moved real tree slots


def test_a_left_padded_batch_of_latent_attention_rows():
    """The prompts' move to column 0 and every commit go through kv_compact's per-row form over both latents."""
    model = _mla()
    g = torch.Generator().manual_seed(2)
    ps = [torch.randint(0, VOCAB, (1, n), generator=g).to(DEVICE) for n in (5, 17, 11)]
    refs = [_reference(model, p) for p in ps]
    with HeteroSpec(model, OracleDraft(model), Policy.static(5, 3, 16), cuda_graphs=False) as hs:
        outs, _ = hs.generate([p[0] for p in ps], max_new_tokens=NEW, eos_token_id=[])
        ids, mask = left_padded(ps)
        padded, _ = hs.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[])
    for b, (o, p, r) in enumerate(zip(outs, ps, refs)):
        assert o[p.shape[1]:].tolist() == r, f"row {b}"
        assert padded[b, ids.shape[1]:].tolist() == r, f"padded row {b}"


def test_keep_rows_moves_every_storage_tensor():
    model = _mla()
    tgt = TargetAdapter(model, batch=3)
    tgt.allocate(12)
    for t in tgt._storage:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.shape[-1])).to(t))
    before = [(k.clone(), v.clone()) for k, v in tgt.cache.views()]
    tgt.keep_rows([0, 2], torch.tensor([0, 2], device=DEVICE))
    assert [t.shape[0] for t in tgt._storage] == [2, 2]
    for (k, v), (k0, v0) in zip(tgt.cache.views(), before):
        assert torch.equal(k, k0[[0, 2]]) and torch.equal(v, v0[[0, 2]])


def test_a_cache_write_of_another_shape_is_refused_in_one_line():
    cache = StaticKV([(torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16, 4)), None])
    cache.slots = torch.arange(4)
    cache.update(torch.ones(1, 1, 4, 16), torch.ones(1, 1, 4, 4), 0)
    assert cache.store[0][1][0, 0, :4].eq(1).all() and cache.store[0][1][0, 0, 4:].eq(0).all()
    with pytest.raises(ValueError, match=r"^target cache: expected layer 0's keys as \[batch, 1, S, 16\] and values "
                                         r"as \[batch, 1, S, 4\] \(the shapes the model wrote when the engine probed "
                                         r"it\), got keys \(1, 1, 4, 16\) and values \(1, 1, 4, 8\): a model whose "
                                         r"cache shapes change between forwards is not supported$"):
        cache.update(torch.ones(1, 1, 4, 16), torch.ones(1, 1, 4, 8), 0)
    for layer in (1, 2):
        with pytest.raises(ValueError, match=rf"^target cache: expected no cache write from layer {layer} \(the "
                                             r"model's layout, probed when the engine was made\), got one$"):
            cache.update(torch.ones(1, 1, 4, 16), torch.ones(1, 1, 4, 4), layer)
    with pytest.raises(ValueError, match=r"^target cache: expected a model that takes position_ids and a 4D mask as "
                                         r"given, got one whose forward asks its cache for a length"):
        cache.get_seq_length()


def test_one_cache_shape_is_required_where_the_engine_needs_one():
    with pytest.raises(ValueError, match=r"^target: row-invariant verification expected every layer to cache keys "
                                         r"and values of one shape, got \[\(\((1, 16|4, 12)\), \((1, 4|4, 8)\)\)"):
        TargetAdapter(_mla().to(torch.bfloat16), invariant=True)


def _gemma3n():
    cfg = transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=16, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Gemma3nForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model.to(DEVICE)


def test_several_residual_streams_cannot_feed_a_draft():
    model = _gemma3n()
    assert TargetAdapter(model, capture_taps=False).layout == [((2, 8), (2, 8))] * 2   # its KV-shared layers: none
    p = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = _reference(model, p, 12)
    with HeteroSpec(model, None, Policy.autoregressive(), cuda_graphs=False) as hs:
        out, _ = hs.generate(p, max_new_tokens=12, eos_token_id=[])
    assert out[0, 20:].tolist() == ref
    with HeteroSpec(model, NoisyDraft(32, VOCAB).to(DEVICE), Policy.static(4, 4, 12), cuda_graphs=False) as hs:
        with pytest.raises(ValueError, match=r"^target: expected the hidden states entering decoder layer \d+ as "
                                             r"\[batch, tokens, hidden\] for every token of the forward \(the EAGLE-3 "
                                             r"draft's taps\), got "
                                             r"\(4, 1, 20, 32\) beside \(4, 1, 20, 32\) \(several residual streams"):
            hs.generate(p, max_new_tokens=12, eos_token_id=[])


def test_a_tap_layer_the_forward_skips_is_refused_in_one_line():
    """Mllama skips its cross-attention layers on text alone: a draft tapping one got a KeyError before."""
    tgt = TargetAdapter(tiny_target("llama").to(DEVICE), tap_layers=[1, 3, 5])
    tgt.allocate(16)
    layer = tgt.model.model.layers[3]
    own = layer.forward
    layer.forward = lambda hidden_states, *a, **k: hidden_states     # the layer skipped: no pre-hook, no change
    layer._forward_pre_hooks.clear()
    try:
        with pytest.raises(ValueError, match=r"^target: expected the draft's tap layers to run in every forward, got "
                                             r"layer 3 skipped"):
            tgt.prefill(torch.randint(0, 50, (1, 6), device=DEVICE))
    finally:
        layer.forward = own
