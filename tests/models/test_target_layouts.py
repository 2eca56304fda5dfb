"""Targets whose layers the engine cannot hold or tap are refused in one line, before or at the first forward,
instead of failing inside torch: attention that varies per layer (transformers' per-layer configs, Gemma 4: one
static cache shape for every layer is what the engine keeps), layers caching other shapes (multi-head latent
attention, MiMo's narrower values), decoder layers fed several residual streams (Gemma 3n's AltUp) or skipped
(Mllama's cross-attention on text), whose hidden states cannot be an EAGLE-3 draft's taps.  Gemma 3n without a draft
decodes as HuggingFace does."""
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft  # noqa: E402
from _models import DEVICE, tiny_target  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.models.target import StaticKV, TargetAdapter, _kv_shape  # noqa: E402

VOCAB = 64


class _PerLayer(RuntimeError):
    """What transformers raises for a global read of a per-layer attribute (AmbiguousGlobalPerLayerAttributeError)."""


class _HeterogeneousConfig:
    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 4, 4, 2, 32

    @property
    def head_dim(self):
        raise _PerLayer("'head_dim' is a per-layer attribute and may vary across layers")


def test_attention_that_varies_per_layer_is_refused_in_one_line():
    assert _kv_shape(SimpleNamespace(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                     hidden_size=32, head_dim=None)) == (4, 2, 8)
    with pytest.raises(ValueError, match=r"^target: expected one key/value head count and head size for every layer "
                                         r"\(the engine's static cache\), got a config whose attention varies per "
                                         r"layer \(_PerLayer\)$"):
        _kv_shape(_HeterogeneousConfig())


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
    p = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = model.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                         pad_token_id=0, eos_token_id=None)[0, 20:].tolist()
    with HeteroSpec(model, None, Policy.autoregressive(), cuda_graphs=False) as hs:
        out, _ = hs.generate(p, max_new_tokens=12, eos_token_id=[])
    assert out[0, 20:].tolist() == ref
    with HeteroSpec(model, NoisyDraft(32, VOCAB).to(DEVICE), Policy.static(4, 4, 12), cuda_graphs=False) as hs:
        with pytest.raises(ValueError, match=r"^target: expected the hidden states entering decoder layer \d+ as "
                                             r"\[batch, tokens, hidden\] for every token of the forward \(the EAGLE-3 "
                                             r"draft's taps\), got "
                                             r"\(4, 1, 20, 32\) beside \(4, 1, 20, 32\) \(several residual streams"):
            hs.generate(p, max_new_tokens=12, eos_token_id=[])


def test_a_layer_caching_another_shape_is_refused_in_one_line():
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) caches latents of its own shapes; MiMo-V2-Flash's values
    are narrower than its keys: the values were not checked before, and torch failed inside the write."""
    cache = StaticKV(torch.zeros(1, 2, 3, 2, 16, 8))
    cache.slots = torch.arange(4)
    cache.update(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8), 0)
    for k, v in (((1, 1, 4, 16), (1, 1, 4, 4)), ((1, 2, 4, 8), (1, 2, 4, 4))):
        with pytest.raises(ValueError, match=r"^target cache: expected every layer's keys and values as \[batch, 2, "
                                             r"S, 8\] .*got keys \(1, \d, 4, \d+\) and values \(1, \d, 4, 4\) from "
                                             r"layer 1: a model whose layers cache other shapes .* is not supported$"):
            cache.update(torch.ones(k), torch.ones(v), 1)
    with pytest.raises(ValueError, match=r"^target cache: expected a model that takes position_ids and a 4D mask as "
                                         r"given, got one whose forward asks its cache for a length"):
        cache.get_seq_length()


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
