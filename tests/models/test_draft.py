"""heterospec.models.draft: the EAGLE-3 draft (config parsing, forward, RoPE, strict checkpoint I/O), and the
default tap layers it shares with the target adapter.

Tiny sizes on CPU.  The forward pass is checked against a computation assembled from transformers' own
Llama blocks (RMSNorm, rotary embedding, eager attention, MLP), so a wrong RoPE / GQA / residual / norm
detail cannot hide behind a test that only compares the module with itself.
"""
import json
import math
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from heterospec.models.draft import Eagle3Config, Eagle3Draft, default_tap_layers, rope_inv_freq  # noqa: E402



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: one intra-op thread is fastest and keeps the file fast on a loaded machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


V, VD, H = 100, 60, 32
BASE = dict(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
            draft_vocab_size=VD, rms_norm_eps=1e-5, max_position_embeddings=64, rope_theta=10000.0)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
VARIANTS = {
    "base": {},
    "head_dim16": {"head_dim": 16},                       # nh * hd = 64 != H
    "target_hidden48": {"target_hidden_size": 48},
    "fc_norm": {"fc_norm": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_before_residual": {"norm_before_residual": True},
    "rope_linear": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "rope_dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 8},
    "rope_llama3": {"rope_scaling": dict(LLAMA3), "head_dim": 16},
    "qk_norm": {"qk_norm": True},
    "no_final_norm": {"norm_output": False},
    "norm_hidden_out": {"norm_hidden_out": True},
    "full_vocab": {"draft_vocab_size": V},
}


def tf():
    return pytest.importorskip("transformers")


def make_config(variant="base", **extra):
    return Eagle3Config(**{**BASE, **VARIANTS[variant], **extra})


def make_draft(variant="base", seed=0, **extra):
    """A tiny draft with every parameter randomised (norm weights around 1) and a random d2t."""
    config = make_config(variant, **extra)
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # unit-scale activations: errors compare to values of order 1
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        c = draft.config
        if c.draft_vocab_size < c.vocab_size:
            used = sorted(random.Random(seed).sample(range(c.vocab_size), c.draft_vocab_size))
            used_t = torch.tensor(used)
            draft.d2t.copy_(used_t - torch.arange(c.draft_vocab_size))
            draft.t2d.zero_()
            draft.t2d[used_t] = True
    return draft


def inputs(draft, B=1, S=6, seed=1, start=0):
    g = torch.Generator().manual_seed(seed)
    c = draft.config
    taps = torch.randn(B, S, 3 * c.target_hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (B, S), generator=g)
    pos = (torch.arange(S) + start).expand(B, S).clone()
    return taps, ids, pos


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2))


def flat_state(draft, with_embedding=True):
    sd = {k: v.detach().clone().contiguous() for k, v in draft.state_dict().items()}
    if not with_embedding:
        sd.pop("embed_tokens.weight")
    return sd


def write_checkpoint(path, draft, sd=None, config=None):
    path.mkdir(parents=True, exist_ok=True)
    write_json(path / "config.json", config if config is not None else draft.config.to_dict())
    save_file(sd if sd is not None else flat_state(draft), str(path / "model.safetensors"))
    return path


def load_error(path, target=None):
    with pytest.raises(ValueError) as e:
        Eagle3Draft.from_pretrained(path, target)
    return str(e.value)


def tiny_target(vocab_size=V, hidden_size=H, layers=8, seed=0):
    transformers = tf()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


# ------------------------------------------------------------------------------------------------------
# config parsing
# ------------------------------------------------------------------------------------------------------

def flat_dict(**over):
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
         "hidden_act": "silu", "hidden_size": H, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
         "vocab_size": V, "draft_vocab_size": VD, "tie_word_embeddings": False, "torch_dtype": "float16",
         "some_future_key": {"nested": [1, 2]}}
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def test_flat_config_parses_with_defaults_and_honours_head_dim():
    c = Eagle3Config.from_dict(flat_dict())
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (H, 4, 2, 8)
    assert (c.vocab_size, c.draft_vocab_size, c.target_hidden_size) == (V, VD, H)
    assert c.rope_theta == 10000.0 and c.rope_scaling is None and c.aux_layer_ids is None
    assert c.norm_output is True and not (c.fc_norm or c.norm_before_fc or c.norm_before_residual
                                          or c.norm_hidden_out or c.qk_norm)
    c16 = Eagle3Config.from_dict(flat_dict(head_dim=16))
    assert c16.head_dim == 16                                # not H // nh = 8, unlike SafeAILab
    d = Eagle3Draft(c16)
    assert tuple(d.midlayer.self_attn.q_proj.weight.shape) == (4 * 16, 2 * H)
    assert tuple(d.midlayer.self_attn.o_proj.weight.shape) == (H, 4 * 16)
    # no draft_vocab_size: the full vocabulary; truncated_vocab_size (Nebius) is a synonym
    assert Eagle3Config.from_dict(flat_dict(draft_vocab_size=None)).draft_vocab_size == V
    assert Eagle3Config.from_dict(flat_dict(draft_vocab_size=None, truncated_vocab_size=40)).draft_vocab_size == 40
    with pytest.raises(ValueError, match="truncated_vocab_size"):
        Eagle3Config.from_dict(flat_dict(truncated_vocab_size=40))


def test_missing_required_keys_are_all_listed():
    d = flat_dict(hidden_size=None, vocab_size=None, rms_norm_eps=None)
    with pytest.raises(ValueError) as e:
        Eagle3Config.from_dict(d)
    msg = str(e.value)
    for key in ("hidden_size", "vocab_size", "rms_norm_eps"):
        assert f"'{key}'" in msg
    assert "intermediate_size" not in msg


def test_invalid_values_are_reported():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Eagle3Config.from_dict(flat_dict(num_key_value_heads=3))
    with pytest.raises(ValueError, match="exceeds vocab_size"):
        Eagle3Config.from_dict(flat_dict(draft_vocab_size=V + 1))
    with pytest.raises(ValueError, match="mutually exclusive"):
        Eagle3Config.from_dict(flat_dict(fc_norm=True, norm_before_fc=True))
    with pytest.raises(ValueError, match="hidden_act"):
        Eagle3Config.from_dict(flat_dict(hidden_act="gelu"))
    with pytest.raises(ValueError, match="attention_bias"):
        Eagle3Config.from_dict(flat_dict(attention_bias=True))
    with pytest.raises(ValueError, match="'hidden_size' must be an integer"):
        Eagle3Config.from_dict(flat_dict(hidden_size="32"))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        Eagle3Config.from_dict(flat_dict(eagle_aux_hidden_state_layer_ids=[1, 2]))
    with pytest.raises(ValueError, match="give head_dim"):
        Eagle3Config.from_dict(flat_dict(hidden_size=30))
    assert Eagle3Config.from_dict(flat_dict(hidden_size=30, head_dim=8)).head_dim == 8


def test_rope_scaling_parsing():
    lin_a = Eagle3Config.from_dict(flat_dict(rope_scaling={"type": "linear", "factor": 2.0}))
    lin_b = Eagle3Config.from_dict(flat_dict(rope_scaling={"rope_type": "linear", "factor": 2}))
    assert lin_a == lin_b and lin_a.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert Eagle3Config.from_dict(flat_dict(rope_scaling={"rope_type": "default"})).rope_scaling is None
    l3 = Eagle3Config.from_dict(flat_dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}))
    assert l3.rope_scaling["original_max_position_embeddings"] == 64  # falls back to max_position_embeddings
    # transformers >= 5 writes rope_parameters instead of rope_theta / rope_scaling
    v5 = Eagle3Config.from_dict(flat_dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}))
    assert v5.rope_theta == 5e5 and v5.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = Eagle3Config.from_dict(flat_dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert plain.rope_scaling is None and plain.rope_theta == 1e6
    for bad in ("yarn", "mrope", "longrope", "made-up"):
        with pytest.raises(ValueError, match=repr(bad)):
            Eagle3Config.from_dict(flat_dict(rope_scaling={"rope_type": bad, "factor": 2.0}))
    with pytest.raises(ValueError, match="rope_type='linear' but type='dynamic'"):
        Eagle3Config.from_dict(flat_dict(rope_scaling={"rope_type": "linear", "type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="factor"):
        Eagle3Config.from_dict(flat_dict(rope_scaling={"rope_type": "linear"}))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Eagle3Config.from_dict(flat_dict(max_position_embeddings=None,
                                         rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_tap_layer_conventions():
    top = Eagle3Config.from_dict(flat_dict(eagle_aux_hidden_state_layer_ids=[2, 18, 33]))
    assert top.aux_layer_ids == [2, 18, 33]                   # speculators / vLLM: input-of-layer, as is
    nested = Eagle3Config.from_dict(flat_dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 17, 32],
                                                            "use_aux_hidden_state": True}))
    assert nested.aux_layer_ids == [2, 18, 33]                # SGLang / SpecForge: output-of-layer, +1
    both = Eagle3Config.from_dict(flat_dict(eagle_aux_hidden_state_layer_ids=[3, 4, 5],
                                            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}))
    assert both.aux_layer_ids == [3, 4, 5]
    assert top.tap_layers(36) == [2, 18, 33]
    with pytest.raises(ValueError, match="33"):
        top.tap_layers(30)
    assert Eagle3Config.from_dict(flat_dict()).tap_layers(32) == [2, 16, 29] == default_tap_layers(32)
    assert default_tap_layers(7) == [2, 3, 4]
    with pytest.raises(ValueError, match="at least 7"):
        default_tap_layers(6)
    with pytest.raises(ValueError, match="use_aux_hidden_state"):
        Eagle3Config.from_dict(flat_dict(eagle_config={"use_aux_hidden_state": False}))
    # vLLM also reads norm_before_fc from eagle_config (NVIDIA heads)
    assert Eagle3Config.from_dict(flat_dict(eagle_config={"norm_before_fc": True})).norm_before_fc is True


# EAGLE-3's default taps, input-of-layer ids, written out by hand: low 2, middle L//2, high L-3
DEFAULT_TAPS = {7: [2, 3, 4], 8: [2, 4, 5], 9: [2, 4, 6], 24: [2, 12, 21], 28: [2, 14, 25], 30: [2, 15, 27],
                32: [2, 16, 29], 36: [2, 18, 33], 40: [2, 20, 37], 80: [2, 40, 77]}


@pytest.mark.parametrize("layers", sorted(DEFAULT_TAPS))
def test_default_tap_layers_are_pinned(layers):
    """Issue 28: one default_tap_layers serves the draft config and the target adapter (it was written twice);
    its values for real layer counts (Llama-3.1-8B 32, Vicuna-13B 40, Qwen3-4B 36, SmolLM2-135M 30, ...),
    and a head's explicit ids win over them."""
    from heterospec.models import target as target_mod

    assert target_mod.default_tap_layers is default_tap_layers
    taps = DEFAULT_TAPS[layers]
    assert default_tap_layers(layers) == taps
    assert default_tap_layers(layers, strict=False) == taps
    assert make_config().tap_layers(layers) == taps
    assert make_config(aux_layer_ids=[0, 1, layers - 1]).tap_layers(layers) == [0, 1, layers - 1]


def test_default_tap_layers_below_seven_layers():
    """Below 7 layers EAGLE-3's formula repeats or reverses taps: a head's config refuses it, the target
    adapter's fallback (no draft config) keeps the formula's ids as before."""
    for layers, taps in {6: [2, 3, 3], 5: [2, 2, 2], 4: [2, 2, 1], 3: [2, 1, 0]}.items():
        with pytest.raises(ValueError, match="at least 7"):
            default_tap_layers(layers)
        with pytest.raises(ValueError, match="at least 7"):
            make_config().tap_layers(layers)
        assert default_tap_layers(layers, strict=False) == taps


def test_the_target_adapter_taps_the_default_or_the_given_layers():
    from heterospec.models.target import TargetAdapter

    for layers, given, want in ((8, None, [2, 4, 5]), (4, None, [2, 2, 1]), (8, [0, 3, 7], [0, 3, 7])):
        adapter = TargetAdapter(tiny_target(layers=layers), tap_layers=given)
        try:
            assert adapter.tap_layers == want
        finally:
            adapter.close()


def speculators_dict(c: Eagle3Config, norm_output=False, model_type="llama"):
    tl = {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size,
          "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
          "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
          "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
          "rope_scaling": c.rope_scaling, "vocab_size": c.vocab_size, "num_hidden_layers": 1,
          "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "use_cache": True}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0", "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
            "fc_norm": c.fc_norm, "norm_output": norm_output,
            "target_hidden_size": None if c.target_hidden_size == c.hidden_size else c.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": c.aux_layer_ids, "embed_requires_grad": False,
            "transformer_layer_config": tl,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "x/y", "architectures": ["LlamaForCausalLM"]}}}


@pytest.mark.parametrize("variant", ["base", "head_dim16", "target_hidden48", "fc_norm", "norm_before_fc",
                                     "norm_before_residual", "rope_llama3", "full_vocab"])
def test_speculators_config_parses_to_the_same_config(variant):
    c = make_config(variant, aux_layer_ids=[2, 18, 33])
    assert Eagle3Config.from_dict(speculators_dict(c)) == c
    assert Eagle3Config.from_dict(c.to_dict()) == c


def test_norm_output_has_each_formats_meaning():
    c = make_config()
    # speculators / vLLM: the fed-back state is post-norm, the logits keep the final norm
    s = Eagle3Config.from_dict(speculators_dict(c, norm_output=True))
    assert s.norm_hidden_out is True and s.norm_output is True
    # SpecForge (flat): false = no final norm before lm_head, fed-back state pre-norm
    f = Eagle3Config.from_dict(flat_dict(norm_output=False))
    assert f.norm_output is False and f.norm_hidden_out is False
    assert Eagle3Config.from_dict(flat_dict(norm_output=True)) == Eagle3Config.from_dict(flat_dict())
    # speculators' Qwen3 draft layer has QK-norm; Qwen3 is what speculators assumes without a model_type
    assert Eagle3Config.from_dict(speculators_dict(c, model_type="qwen3")).qk_norm is True
    sd = speculators_dict(c)
    del sd["transformer_layer_config"]["model_type"]
    assert Eagle3Config.from_dict(sd).qk_norm is True
    with pytest.raises(ValueError, match="'mistral'"):
        Eagle3Config.from_dict(speculators_dict(c, model_type="mistral"))


def test_speculators_missing_keys_are_listed():
    sd = speculators_dict(make_config())
    del sd["draft_vocab_size"]
    del sd["transformer_layer_config"]["hidden_size"]
    with pytest.raises(ValueError) as e:
        Eagle3Config.from_dict(sd)
    assert "'draft_vocab_size'" in str(e.value) and "'transformer_layer_config.hidden_size'" in str(e.value)
    with pytest.raises(ValueError, match="'peagle'"):
        Eagle3Config.from_dict({**sd, "speculators_model_type": "peagle"})


def test_num_hidden_layers_is_kept_but_one_layer_is_built(tmp_path):
    c = Eagle3Config.from_dict(flat_dict(num_hidden_layers=40))   # the official Vicuna-13B head says 40
    assert c.num_hidden_layers == 40
    d = make_draft("base", num_hidden_layers=40)
    assert not any(k.startswith(("layers.", "midlayers.")) for k in d.state_dict())
    d.save_pretrained(tmp_path, save_embedding=True)
    back = Eagle3Draft.from_pretrained(tmp_path)
    assert back.config.num_hidden_layers == 40
    same_state(d, back)


# ------------------------------------------------------------------------------------------------------
# RoPE against transformers' own init functions
# ------------------------------------------------------------------------------------------------------

def hf_llama_config(c: Eagle3Config):
    transformers = tf()
    rs = None if c.rope_scaling is None else dict(c.rope_scaling)
    cfg = transformers.LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                   num_attention_heads=c.num_attention_heads,
                                   num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                   rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                                   rope_theta=c.rope_theta, rope_scaling=rs, vocab_size=c.vocab_size)
    cfg._attn_implementation = "eager"
    return cfg


@pytest.mark.parametrize("rope,seq_len", [
    (None, None), ({"rope_type": "linear", "factor": 3.0}, None),
    ({"rope_type": "dynamic", "factor": 2.0}, 20), ({"rope_type": "dynamic", "factor": 2.0}, 100),
    (dict(LLAMA3), None), ({**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 16.0}, None)])
@pytest.mark.parametrize("head_dim", [8, 16])
def test_rope_inv_freq_matches_transformers(rope, seq_len, head_dim):
    tf()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = make_config("base", head_dim=head_dim, rope_scaling=rope, max_position_embeddings=32, rope_theta=5000.0)
    hf_cfg = hf_llama_config(c)
    if rope is None:
        want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    elif seq_len is None:
        want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, None)
    else:
        want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, None, seq_len=seq_len)
    got = rope_inv_freq(c, seq_len=seq_len)
    assert got.dtype == torch.float32 and got.shape == (head_dim // 2,)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    if rope is not None and (rope["rope_type"] != "dynamic" or seq_len > 32):
        base = rope_inv_freq(make_config("base", head_dim=head_dim, rope_theta=5000.0))
        assert not torch.allclose(got, base)      # the scaling really changed something


# ------------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------------

def hf_blocks_forward(draft, taps, ids, pos):
    """The draft step computed with transformers' Llama (Qwen3 for QK-norm) blocks, causal, no cache."""
    transformers = tf()
    from transformers.models.llama import modeling_llama as ml

    c = draft.config
    lc = hf_llama_config(c)

    def norm(mod, x):
        n = ml.LlamaRMSNorm(mod.weight.shape[0], eps=c.rms_norm_eps)
        n.weight.data.copy_(mod.weight)
        return n(x)

    x = taps
    if draft.input_norm is not None:
        x = norm(draft.input_norm, x)
    if draft.fc_norm is not None:
        x = torch.cat([norm(m, part) for m, part in zip(draft.fc_norm, x.chunk(3, dim=-1))], dim=-1)
    h = x @ draft.fc.weight.T
    m = draft.midlayer
    e = draft.embed_tokens.weight[ids]
    hn = norm(m.hidden_norm, h)
    a = torch.cat([norm(m.input_layernorm, e), hn], dim=-1)
    if c.qk_norm:
        from transformers.models.qwen3 import modeling_qwen3 as mq
        qc = transformers.Qwen3Config(**{k: getattr(lc, k) for k in (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size")})
        qc._attn_implementation = "eager"
        attn = mq.Qwen3Attention(qc, layer_idx=0)
        attn.q_norm.weight.data.copy_(m.self_attn.q_norm.weight)
        attn.k_norm.weight.data.copy_(m.self_attn.k_norm.weight)
    else:
        attn = ml.LlamaAttention(lc, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(attn, name, getattr(m.self_attn, name))
    attn.eval()
    cos, sin = ml.LlamaRotaryEmbedding(lc)(a, pos)
    S = ids.shape[1]
    causal = torch.full((S, S), float("-inf")).triu(1).view(1, 1, S, S)
    o, _ = attn(a, position_embeddings=(cos, sin), attention_mask=causal)
    h1 = (hn if c.norm_before_residual else h) + o
    mlp = ml.LlamaMLP(lc)
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = m.mlp.gate_proj, m.mlp.up_proj, m.mlp.down_proj
    h2 = h1 + mlp(norm(m.post_attention_layernorm, h1))
    normed = norm(draft.norm, h2)
    logits = (normed if c.norm_output else h2) @ draft.lm_head.weight.T
    return logits, (normed if c.norm_hidden_out else h2)


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_forward_matches_transformers_llama_blocks(variant):
    draft = make_draft(variant)
    taps, ids, pos = inputs(draft, B=2, S=12, start=3)   # positions 3..14: past the dynamic variant's 8
    logits, h_out, (k, v) = draft(draft.fuse(taps), ids, pos)
    want_logits, want_h = hf_blocks_forward(draft, taps, ids, pos)
    c = draft.config
    assert logits.dtype == torch.float32 and logits.shape == (2, 12, c.draft_vocab_size)
    assert k.shape == v.shape == (2, c.num_key_value_heads, 12, c.head_dim)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_out, want_h, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_switches_change_the_output():
    """Each switch really does something: the same weights with the switch flipped give other outputs."""
    base = make_draft("base")
    taps, ids, pos = inputs(base)
    hidden = base.fuse(taps)
    base_logits, base_h, _ = base(hidden, ids, pos)
    for switch in ("norm_before_residual", "norm_hidden_out", "qk_norm"):
        other = make_draft("base", **{switch: True})
        lg, h, _ = other(hidden, ids, pos)
        assert not torch.allclose(lg, base_logits) or not torch.allclose(h, base_h), switch
    raw = make_draft("no_final_norm")
    lg, h, _ = raw(hidden, ids, pos)
    torch.testing.assert_close(h, base_h)                      # the state is unaffected ...
    torch.testing.assert_close(lg, h @ raw.lm_head.weight.T)  # ... the logits skip the norm
    assert not torch.allclose(lg, base_logits)


@pytest.mark.parametrize("variant", ["base", "head_dim16", "rope_llama3", "qk_norm", "norm_before_residual",
                                     "rope_linear"])
@torch.no_grad()
def test_incremental_decoding_equals_one_causal_call(variant):
    draft = make_draft(variant)
    taps, ids, pos = inputs(draft, B=2, S=7)
    pos[1] += 5                                             # the batch rows sit at different positions
    hidden = draft.fuse(taps)
    full_logits, full_h, (fk, fv) = draft(hidden, ids, pos)
    kv, logits, hs = None, [], []
    for lo, hi in ((0, 3), (3, 4), (4, 7)):
        lg, h, kv = draft(hidden[:, lo:hi], ids[:, lo:hi], pos[:, lo:hi], past_kv=kv)
        logits.append(lg), hs.append(h)
    torch.testing.assert_close(torch.cat(logits, 1), full_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat(hs, 1), full_h, rtol=0, atol=1e-5)
    torch.testing.assert_close(kv[0], fk, rtol=0, atol=1e-5)
    torch.testing.assert_close(kv[1], fv, rtol=0, atol=1e-5)
    # cropping by slicing: re-running the last 3 rows on the cache cropped to 4 gives the same rows
    lg, h, kv2 = draft(hidden[:, 4:], ids[:, 4:], pos[:, 4:], past_kv=(fk[:, :, :4], fv[:, :, :4]))
    torch.testing.assert_close(lg, full_logits[:, 4:], rtol=0, atol=1e-5)


@torch.no_grad()
def test_explicit_causal_mask_equals_none():
    draft = make_draft("base")
    taps, ids, pos = inputs(draft, S=7)
    hidden = draft.fuse(taps)
    _, _, past = draft(hidden[:, :4], ids[:, :4], pos[:, :4])
    for lo, hi in ((4, 7), (4, 5)):
        S, P = hi - lo, 4
        mask = torch.ones(S, P + S, dtype=torch.bool).tril(diagonal=P)
        a = draft(hidden[:, lo:hi], ids[:, lo:hi], pos[:, lo:hi], past_kv=past)
        b = draft(hidden[:, lo:hi], ids[:, lo:hi], pos[:, lo:hi], past_kv=past, attn_mask=mask)
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-6)
        assert torch.equal(a[2][0], b[2][0]) and torch.equal(a[2][1], b[2][1])
    # a batched [B, S, P+S] mask works too
    mask3 = torch.ones(1, 3, 7, dtype=torch.bool).tril(diagonal=4)
    c = draft(hidden[:, 4:], ids[:, 4:], pos[:, 4:], past_kv=past, attn_mask=mask3)
    torch.testing.assert_close(c[0], draft(hidden[:, 4:], ids[:, 4:], pos[:, 4:], past_kv=past)[0],
                               rtol=0, atol=1e-6)


@torch.no_grad()
def test_tree_mask_changes_exactly_the_masked_rows():
    draft = make_draft("base")
    taps, ids, pos = inputs(draft, S=7)
    hidden = draft.fuse(taps)
    _, _, past = draft(hidden[:, :3], ids[:, :3], pos[:, :3])
    S, P = 4, 3
    causal = torch.ones(S, P + S, dtype=torch.bool).tril(diagonal=P)
    tree = causal.clone()
    tree[2, P + 1] = False       # new row 2 does not see new row 1 (a sibling, not an ancestor)
    tree[3, 0] = False           # new row 3 does not see past key 0
    args = (hidden[:, 3:], ids[:, 3:], pos[:, 3:])
    lc, hc, kvc = draft(*args, past_kv=past, attn_mask=causal)
    lt, ht, kvt = draft(*args, past_kv=past, attn_mask=tree)
    for r in (0, 1):
        torch.testing.assert_close(lt[0, r], lc[0, r], rtol=0, atol=1e-6)
        torch.testing.assert_close(ht[0, r], hc[0, r], rtol=0, atol=1e-6)
    for r in (2, 3):
        assert (lt[0, r] - lc[0, r]).abs().max() > 1e-3
    assert torch.equal(kvt[0], kvc[0]) and torch.equal(kvt[1], kvc[1])


@torch.no_grad()
def test_tree_row_equals_a_causal_run_over_its_ancestors():
    """Siblings b, c at the same depth (same position): c's row with b masked out equals a plain causal
    run over [a, c] -- what the tree mask is for."""
    draft = make_draft("head_dim16")
    taps, ids, _ = inputs(draft, S=3)
    hidden = draft.fuse(taps)
    pos = torch.tensor([[0, 1, 1]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    lg, h, _ = draft(hidden, ids, pos, attn_mask=mask)
    keep = torch.tensor([0, 2])
    lg2, h2, _ = draft(hidden[:, keep], ids[:, keep], pos[:, keep])
    torch.testing.assert_close(lg[0, 2], lg2[0, 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(h[0, 2], h2[0, 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(lg[0, 0], lg2[0, 0], rtol=0, atol=1e-5)


@torch.no_grad()
def test_low_precision_weights_give_float32_logits():
    draft = make_draft("base").to(torch.bfloat16)
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    taps, ids, pos = inputs(draft)
    hidden = draft.fuse(taps)                               # float32 taps are cast to the draft's dtype
    assert hidden.dtype == torch.bfloat16
    logits, h, (k, v) = draft(hidden, ids, pos)
    assert logits.dtype == torch.float32 and h.dtype == k.dtype == v.dtype == torch.bfloat16
    full = make_draft("base")
    want, _, _ = full(full.fuse(taps), ids, pos)
    assert (logits - want).abs().max() < 0.5 * want.abs().max()   # same model, bf16 rounding only


def test_map_tokens_and_default_maps():
    draft = make_draft("base", seed=3)
    used = sorted(random.Random(3).sample(range(V), VD))
    assert draft.map_tokens(torch.arange(VD)).tolist() == used
    assert draft.map_tokens(torch.tensor([[0, VD - 1]])).tolist() == [[used[0], used[-1]]]
    fresh = Eagle3Draft(make_config())
    assert fresh.map_tokens(torch.arange(VD)).tolist() == list(range(VD))   # identity by default ...
    assert fresh.t2d.tolist() == [i < VD for i in range(V)]                  # ... and a consistent t2d
    assert fresh.embed_tokens.weight.requires_grad is False
    w = torch.randn(V, H)
    given = Eagle3Draft(make_config(), embed_tokens=w)
    assert given.embed_tokens.weight.data_ptr() == w.data_ptr() and not given.embed_tokens.weight.requires_grad


def test_bad_call_arguments():
    draft = make_draft("target_hidden48")
    taps, ids, pos = inputs(draft, S=3)
    with pytest.raises(ValueError, match="fuse"):
        draft(taps, ids, pos)                       # taps not fused
    with pytest.raises(ValueError, match=r"\[B, S, 144\]"):
        draft.fuse(taps[..., :96])
    hidden = draft.fuse(taps)
    with pytest.raises(ValueError, match="input_ids"):
        draft(hidden, ids[:, :2], pos)
    with pytest.raises(ValueError, match="attn_mask"):
        draft(hidden, ids, pos, attn_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        draft(hidden, ids, pos, attn_mask=torch.ones(3, 3))
    with pytest.raises(ValueError, match="past_kv"):
        draft(hidden, ids, pos, past_kv=(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 8)))
    with pytest.raises(ValueError, match=r"\[100, 32\]"):
        Eagle3Draft(make_config(), embed_tokens=torch.zeros(100, 48))


# ------------------------------------------------------------------------------------------------------
# save / load
# ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_load_round_trip_is_bit_exact(variant, tmp_path):
    draft = make_draft(variant, aux_layer_ids=[1, 3, 5], pad_token_id=0)
    draft.save_pretrained(tmp_path, save_embedding=True)
    back = Eagle3Draft.from_pretrained(tmp_path)
    assert back.config == draft.config
    same_state(draft, back)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert written["draft_vocab_size"] == draft.config.draft_vocab_size
    assert written["head_dim"] == draft.config.head_dim


def test_round_trip_in_bfloat16_keeps_the_dtype(tmp_path):
    draft = make_draft("fc_norm").to(torch.bfloat16)
    draft.save_pretrained(tmp_path, save_embedding=True)
    back = Eagle3Draft.from_pretrained(tmp_path)
    assert back.dtype == torch.bfloat16
    same_state(draft, back)
    assert Eagle3Draft.from_pretrained(tmp_path, dtype=torch.float32).dtype == torch.float32


def test_embedding_saved_only_when_needed(tmp_path):
    plain = make_draft("base")
    plain.save_pretrained(tmp_path / "plain")
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert {"d2t", "t2d"} <= set(load_file(str(tmp_path / "plain" / "model.safetensors")))
    wide = make_draft("target_hidden48")
    wide.save_pretrained(tmp_path / "wide")                  # T_H != H: the target's embedding can't stand in
    assert "embed_tokens.weight" in load_file(str(tmp_path / "wide" / "model.safetensors"))
    same_state(wide, Eagle3Draft.from_pretrained(tmp_path / "wide"))
    msg = load_error(tmp_path / "plain")
    assert "embed_tokens.weight" in msg and "target" in msg


def layer0_name(k):
    return k.replace("midlayer.", "layers.0.")


def test_every_layout_loads_the_same_module(tmp_path):
    draft = make_draft("fc_norm", aux_layer_ids=[2, 4, 6])
    sd = flat_state(draft)
    c = draft.config
    # 1. SafeAILab names, one safetensors file
    draft.save_pretrained(tmp_path / "safeailab", save_embedding=True)
    # 2. vLLM-style: "model." + layers.0.
    write_checkpoint(tmp_path / "vllm", draft, {"model." + layer0_name(k): v for k, v in sd.items()})
    # 3. speculators: its config format and layers.0. names
    write_checkpoint(tmp_path / "spec", draft, {layer0_name(k): v for k, v in sd.items()},
                     config=speculators_dict(c))
    # 4. sharded safetensors with an index
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    write_json(shard_dir / "config.json", c.to_dict())
    names = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in parts.items():
        save_file({k: sd[k] for k in keys}, str(shard_dir / fname))
    write_json(shard_dir / "model.safetensors.index.json",
               {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in parts.items() for k in ks}})
    # 5. pytorch_model.bin
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_json(bin_dir / "config.json", c.to_dict())
    torch.save(sd, bin_dir / "pytorch_model.bin")
    # 6. sharded pytorch_model.bin
    binsh = tmp_path / "bin_sharded"
    binsh.mkdir()
    write_json(binsh / "config.json", c.to_dict())
    bparts = {"pytorch_model-00001-of-00002.bin": names[:5], "pytorch_model-00002-of-00002.bin": names[5:]}
    for fname, keys in bparts.items():
        torch.save({k: sd[k] for k in keys}, binsh / fname)
    write_json(binsh / "pytorch_model.bin.index.json",
               {"weight_map": {k: f for f, ks in bparts.items() for k in ks}})

    for layout in ("safeailab", "vllm", "spec", "sharded", "bin", "bin_sharded"):
        back = Eagle3Draft.from_pretrained(tmp_path / layout)
        assert back.config == c, layout
        same_state(draft, back)


def test_identity_maps_when_the_vocabularies_are_equal(tmp_path):
    draft = make_draft("full_vocab")
    sd = flat_state(draft)
    del sd["d2t"], sd["t2d"]                         # speculators writes no maps when Vd == V
    back = Eagle3Draft.from_pretrained(write_checkpoint(tmp_path / "a", draft, sd))
    assert back.d2t.eq(0).all() and back.t2d.all()
    sd2 = flat_state(draft)
    sd2["d2t"] = torch.ones(V, dtype=torch.int64)    # garbage maps are ignored (SafeAILab's EaModel)
    with pytest.warns(UserWarning, match="ignored"):
        back2 = Eagle3Draft.from_pretrained(write_checkpoint(tmp_path / "b", draft, sd2))
    assert back2.d2t.eq(0).all()


def test_missing_t2d_is_derived_from_d2t(tmp_path):
    draft = make_draft("base", seed=5)
    sd = flat_state(draft)
    del sd["t2d"]
    back = Eagle3Draft.from_pretrained(write_checkpoint(tmp_path, draft, sd))
    same_state(draft, back)


# ------------------------------------------------------------------------------------------------------
# strictness
# ------------------------------------------------------------------------------------------------------

def test_one_missing_key(tmp_path):
    draft = make_draft("base")
    sd = flat_state(draft)
    del sd["midlayer.mlp.up_proj.weight"]
    msg = load_error(write_checkpoint(tmp_path, draft, sd))
    assert "missing key: midlayer.mlp.up_proj.weight" in msg
    assert "\n" not in msg and str(tmp_path) in msg    # one problem: one line, naming the directory


def test_one_unexpected_key(tmp_path):
    draft = make_draft("base")
    sd = flat_state(draft)
    sd["midlayer.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    msg = load_error(write_checkpoint(tmp_path, draft, sd))
    assert "unexpected key: midlayer.self_attn.rotary_emb.inv_freq" in msg
    assert "\n" not in msg


def test_one_wrong_shape(tmp_path):
    draft = make_draft("base")
    sd = flat_state(draft)
    sd["fc.weight"] = sd["fc.weight"].T.contiguous()
    msg = load_error(write_checkpoint(tmp_path, draft, sd))
    assert "wrong shape for fc.weight" in msg and "expected [32, 96], got [96, 32]" in msg


def test_several_problems_in_one_message(tmp_path):
    draft = make_draft("base")
    sd = flat_state(draft)
    del sd["norm.weight"], sd["d2t"]
    sd["lm_head.weight"] = torch.zeros(VD + 1, H)
    sd["model.fc.weight"] = sd["fc.weight"].clone()           # fc.weight twice after renaming
    sd["layers.1.mlp.up_proj.weight"] = torch.zeros(64, H)    # a second decoder layer
    sd["input_norm.weight"] = torch.ones(3 * H)               # norm_before_fc is not set
    sd["midlayer.self_attn.q_proj.bias"] = torch.zeros(32)
    msg = load_error(write_checkpoint(tmp_path, draft, sd))
    for part in ("missing key: norm.weight", "missing key: d2t", "draft_vocab_size 60 != vocab_size 100",
                 "wrong shape for lm_head.weight", "duplicate key after renaming", "'fc.weight'",
                 "unexpected key: layers.1.mlp.up_proj.weight", "only one layer",
                 "unexpected key: input_norm.weight", "norm_before_fc",
                 "unexpected key: midlayer.self_attn.q_proj.bias"):
        assert part in msg, part
    assert msg.count("\n  - ") == 7


def test_vocabulary_map_problems(tmp_path):
    draft = make_draft("base")
    sd = flat_state(draft)
    sd["d2t"] = sd["d2t"].clone()
    sd["d2t"][-1] = V                                          # maps the last draft id past the target vocab
    assert "outside the target vocabulary" in load_error(write_checkpoint(tmp_path / "a", draft, sd))
    sd = flat_state(draft)
    sd["t2d"] = sd["t2d"].clone()
    sd["t2d"][int(draft.map_tokens(torch.tensor(0)))] = False
    assert "t2d disagrees with d2t" in load_error(write_checkpoint(tmp_path / "b", draft, sd))
    sd = flat_state(draft)
    sd["d2t"] = sd["d2t"].float()
    assert "d2t must hold integers" in load_error(write_checkpoint(tmp_path / "c", draft, sd))


def test_corrupt_or_unreadable_files_are_named(tmp_path):
    draft = make_draft("base")
    good = write_checkpoint(tmp_path / "good", draft)
    blob = (good / "model.safetensors").read_bytes()

    garbage = write_checkpoint(tmp_path / "garbage", draft)
    (garbage / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    assert "model.safetensors" in load_error(garbage)

    truncated = write_checkpoint(tmp_path / "truncated", draft)
    (truncated / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    assert str(truncated / "model.safetensors") in load_error(truncated)

    empty = write_checkpoint(tmp_path / "empty", draft)
    (empty / "model.safetensors").write_bytes(b"")
    assert "model.safetensors" in load_error(empty)

    badbin = tmp_path / "badbin"
    badbin.mkdir()
    write_json(badbin / "config.json", draft.config.to_dict())
    (badbin / "pytorch_model.bin").write_bytes(b"PK\x03\x04 broken zip")
    assert "pytorch_model.bin" in load_error(badbin)

    shards = tmp_path / "shards"
    shards.mkdir()
    write_json(shards / "config.json", draft.config.to_dict())
    write_json(shards / "model.safetensors.index.json", {"weight_map": {"fc.weight": "model-00001.safetensors"}})
    assert "model-00001.safetensors" in load_error(shards)
    write_json(shards / "model.safetensors.index.json", {"weight_map": {"fc.weight": "../elsewhere.safetensors"}})
    assert "outside the checkpoint directory" in load_error(shards)

    badcfg = write_checkpoint(tmp_path / "badcfg", draft)
    (badcfg / "config.json").write_text("{ not json")
    assert "config.json" in load_error(badcfg)

    with pytest.raises(FileNotFoundError):
        Eagle3Draft.from_pretrained(tmp_path / "does-not-exist")
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    write_json(noweights / "config.json", draft.config.to_dict())
    with pytest.raises(FileNotFoundError, match="no weights"):
        Eagle3Draft.from_pretrained(noweights)


def test_sharded_index_inconsistencies_are_problems(tmp_path):
    draft = make_draft("base")
    sd = flat_state(draft)
    d = tmp_path / "ck"
    d.mkdir()
    write_json(d / "config.json", draft.config.to_dict())
    names = sorted(sd)
    save_file({k: sd[k] for k in names[:6]}, str(d / "a.safetensors"))
    save_file({k: sd[k] for k in names[5:]}, str(d / "b.safetensors"))   # names[5] in both shards
    wmap = {k: "a.safetensors" for k in names[:6]}
    wmap.update({k: "b.safetensors" for k in names[6:]})
    write_json(d / "model.safetensors.index.json", {"weight_map": wmap})
    msg = load_error(d)
    assert f"duplicate key {names[5]}" in msg


class _OpensAFileWhenUnpickled:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_only_bin_is_rejected_without_running_it(tmp_path):
    draft = make_draft("base")
    marker = tmp_path / "unpickled-code-ran"
    d = tmp_path / "ck"
    d.mkdir()
    write_json(d / "config.json", draft.config.to_dict())
    torch.save({**flat_state(draft), "payload": _OpensAFileWhenUnpickled(marker)}, d / "pytorch_model.bin")
    msg = load_error(d)
    assert "pytorch_model.bin" in msg and "weights_only=True" in msg
    assert not marker.exists()
    # a readable pickle that is not a flat {name: tensor} dict
    torch.save([torch.zeros(1)], d / "pytorch_model.bin")
    assert "flat {name: tensor} state dict" in load_error(d)


# ------------------------------------------------------------------------------------------------------
# the target
# ------------------------------------------------------------------------------------------------------

def test_embedding_is_taken_from_the_target(tmp_path):
    target = tiny_target()
    draft = make_draft("base")
    draft.save_pretrained(tmp_path)                           # no embed_tokens.weight in the file
    back = Eagle3Draft.from_pretrained(tmp_path, target)
    tw = target.get_input_embeddings().weight
    assert torch.equal(back.embed_tokens.weight, tw)
    assert back.embed_tokens.weight.data_ptr() == tw.data_ptr()   # shared, not copied
    assert back.embed_tokens.weight.requires_grad is False
    assert back.config == draft.config
    for k, v in draft.state_dict().items():
        if k != "embed_tokens.weight":
            assert torch.equal(back.state_dict()[k], v), k
    # a different dtype is copied instead
    half = Eagle3Draft.from_pretrained(tmp_path, target, dtype=torch.bfloat16)
    assert half.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(half.embed_tokens.weight, tw.to(torch.bfloat16))
    # the checkpoint's own embedding wins over the target's
    draft.save_pretrained(tmp_path / "with", save_embedding=True)
    same_state(draft, Eagle3Draft.from_pretrained(tmp_path / "with", target))


def test_target_mismatches_are_all_reported(tmp_path):
    draft = make_draft("base")
    draft.save_pretrained(tmp_path)
    msg = load_error(tmp_path, tiny_target(vocab_size=101, hidden_size=48, layers=5))
    assert "vocabulary mismatch" in msg and "101" in msg
    assert "hidden size mismatch" in msg and "48" in msg
    assert "at least 7" in msg
    assert msg.count("\n  - ") == 3


def test_target_tap_layers_are_checked(tmp_path):
    draft = make_draft("base", aux_layer_ids=[2, 4, 9])
    draft.save_pretrained(tmp_path)
    msg = load_error(tmp_path, tiny_target(layers=8))
    assert "[2, 4, 9]" in msg and "[0, 8)" in msg
    ok = make_draft("base", aux_layer_ids=[0, 1, 2])           # explicit ids work on a shallow target
    ok.save_pretrained(tmp_path / "ok")
    assert Eagle3Draft.from_pretrained(tmp_path / "ok", tiny_target(layers=3)).config.aux_layer_ids == [0, 1, 2]
    plain = make_draft("base")
    plain.save_pretrained(tmp_path / "plain")
    assert "at least 7" in load_error(tmp_path / "plain", tiny_target(layers=6))
    Eagle3Draft.from_pretrained(tmp_path / "plain", tiny_target(layers=7))   # [2, 3, 4]: fine


def test_wide_target_needs_the_checkpoint_embedding(tmp_path):
    draft = make_draft("target_hidden48")
    sd = flat_state(draft, with_embedding=False)
    ck = write_checkpoint(tmp_path, draft, sd)
    msg = load_error(ck, tiny_target(hidden_size=48))
    assert "target_hidden_size (48) != hidden_size (32)" in msg
    assert "\n" not in msg


@torch.no_grad()
def test_loaded_draft_runs_on_real_target_taps(tmp_path):
    """End to end on a tiny HF target: taps from output_hidden_states at the draft's tap layers."""
    target = tiny_target(layers=8)
    draft = make_draft("base")
    draft.save_pretrained(tmp_path)
    back = Eagle3Draft.from_pretrained(tmp_path, target)
    ids = torch.randint(0, V, (1, 5))
    hs = target(ids, output_hidden_states=True).hidden_states
    taps = torch.cat([hs[i] for i in back.config.tap_layers(8)], dim=-1)
    assert taps.shape == (1, 5, 3 * H)
    logits, h, (k, v) = back(back.fuse(taps), ids, torch.arange(5).view(1, 5))
    assert logits.shape == (1, 5, VD) and torch.isfinite(logits).all()
    assert not math.isnan(float(h.sum())) and k.shape == (1, 2, 5, 8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("per_row", [False, True])
def test_write_at_writes_each_rows_columns_and_nothing_else(dtype, per_row):
    # the static caches' one write (target and draft): dst is one layer's keys, a strided view of a larger storage
    # as the target's cache holds them; checked against a loop over NumPy arrays
    import numpy as np

    from heterospec.models.draft.module import write_at

    g = torch.Generator().manual_seed(3)
    B, L, Hk, C, D, S = 3, 2, 2, 11, 4, 3
    dt = getattr(torch, dtype)
    store = torch.randn(B, 2, L, Hk, C, D, generator=g).to(dt)
    dst = store[:, 0, 1]
    src = torch.randn(B, Hk, S, D, generator=g).to(dt)
    if per_row:
        slots = torch.stack([torch.randperm(C, generator=g)[:S] for _ in range(B)])
    else:
        slots = torch.randperm(C, generator=g)[:S]
    want = store.float().numpy().copy()
    s = slots.numpy()
    for b in range(B):
        for j in range(S):
            col = s[b, j] if per_row else s[j]
            want[b, 0, 1, :, col, :] = src[b, :, j, :].float().numpy()
    write_at(dst, slots, src)
    assert np.array_equal(store.float().numpy(), want)


def test_write_at_on_the_cpu_never_calls_scatter():
    # torch's CPU scatter_ of bfloat16/float16 costs about the destination's size (a batched bf16 step of 64 rows
    # ran 3.6x slower end to end), so the per-row write is an index_put_ there
    from torch.overrides import TorchFunctionMode

    from heterospec.models.draft.module import write_at

    called = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            called.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    dst = torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16)
    slots = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0]])
    with Record():
        write_at(dst, slots, torch.ones(4, 2, 2, 8, dtype=torch.bfloat16))
    assert "index_put_" in called and not any(n.startswith("scatter") for n in called)
    assert int((dst != 0).any(-1).sum()) == 4 * 2 * 2
