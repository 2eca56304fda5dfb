"""Targets with linear-attention layers (Qwen3-Next, Qwen3.5: Gated DeltaNet beside full attention) decode as
HuggingFace does.  Such a layer keeps a conv and a recurrent state instead of keys and values; the engine holds them
in static tensors (found by the layout probe), verifies chains only (a tree's siblings would enter one recurrence one
after another), reads them in a chain's forward without keeping what the forward made, and at the commit advances
each row's states over its accepted nodes alone by running the layer's mixer again on the inputs it had there.
Checked: tokens and raw logits against HuggingFace's generate (greedy, and sampled with rejections, its logits taken
token by token), batches of prompts of different lengths with a row finishing early, no undeclared host read, and
one-line refusals of what cannot be exact (trees, prompt lookup beside a draft, recorded steps, compile,
row-invariant bfloat16)."""
import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft, OracleDraft  # noqa: E402
from _models import DEVICE, THRESHOLDS, hf_with_logits  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.engine import sync  # noqa: E402
from heterospec.models.target import TargetAdapter  # noqa: E402

VOCAB, NEW = 64, 24
TOL = 1e-4     # float32: a chain's chunked recurrence against transformers' one-token steps
# linear layers: 2 key heads and 2 value heads of 8; the conv runs over q, k and v (2 * 16 + 16 channels), kernel 4
SHAPES = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
CONV, RECURRENT = (2 * 2 * 8 + 2 * 8, 4), (2, 8, 8)
LAYERS = ["linear_attention", "linear_attention", "full_attention"] * 2


def _built(cls_name, cfg_name, **kw):
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    v = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if v < (5, 23):
        pytest.skip(f"transformers {transformers.__version__}: its linear-attention cache API is not the one the "
                    f"engine keeps (5.23's)")
    kw = {"layer_types": LAYERS, **SHAPES, **kw}
    cfg = getattr(transformers, cfg_name)(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          max_position_embeddings=512, pad_token_id=0, **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval().float()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model.to(DEVICE)


BUILT = {
    "qwen3-next": lambda: _built("Qwen3NextForCausalLM", "Qwen3NextConfig", num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "qwen3.5": lambda: _built("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
    # LFM2's short convolutions: a conv state alone (kernel 3 over the 32 hidden channels), no recurrent state
    # (untied: the sharpened output layer would scale the embeddings too, and every draft would be accepted)
    "lfm2": lambda: _built("Lfm2ForCausalLM", "Lfm2Config", tie_word_embeddings=False,
                           layer_types=[t.replace("linear_attention", "conv") for t in LAYERS]),
}
STATES = {"qwen3-next": (CONV, RECURRENT), "qwen3.5": (CONV, RECURRENT), "lfm2": ((32, 3), None)}
def _other(cls_name, cfg_name, weigh_mamba=False, **kw):
    """A tiny model of another family whose mixers keep their state in the cache (the arch probe's configs).
    ``weigh_mamba``: its Mamba 2 mixers' input and output layers scaled up (x10, x20), so that their recurrent state
    shows in the logits: at random initialisation a chain that kept its rejected tokens' states was off by 5e-6 on
    Bamba, Granite 4 hybrid and Falcon-H1, below the tolerance; weighed up, by 2e-3 to 7e-3."""
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 23):
        pytest.skip(f"transformers {transformers.__version__}: not the linear-attention cache API of 5.23")
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=512)
    cfg = getattr(transformers, cfg_name)(**{**base, **kw})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval().float()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
        for name, p in model.named_parameters():
            if weigh_mamba and name.endswith(("mamba.in_proj.weight", "mamba.out_proj.weight")):
                p.mul_(10.0 if "in_proj" in name else 20.0)
    return model.to(DEVICE)


LINEAR4 = ["linear_attention"] * 3 + ["full_attention"]
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, head_dim=4,
           qk_head_dim=12, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, pad_token_id=0,
           layer_types=LINEAR4, linear_head_dim=8, linear_num_heads=4)
# mixer: Gated DeltaNet (OLMo hybrid), Mamba 2 (Granite 4, Bamba, Falcon-H1), Kimi Delta Attention, Bailing's, LFM2's
# short convolutions in LFM2-MoE and LFM3 (LFM3 with sliding layers beside them)
OTHERS = {
    # Falcon-H1: each layer runs attention and a Mamba 2 mixer side by side ("hybrid" layers)
    "falcon-h1": lambda: _other("FalconH1ForCausalLM", "FalconH1Config", True, num_key_value_heads=2, pad_token_id=0,
                                mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_chunk_size=16,
                                mamba_n_groups=1, mamba_d_state=8, tie_word_embeddings=False),
    "lfm2-moe": lambda: _other("Lfm2MoeForCausalLM", "Lfm2MoeConfig", num_key_value_heads=2, pad_token_id=0,
                               layer_types=["conv", "full_attention"] * 2, num_dense_layers=1, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False),
    "lfm3": lambda: _other("Lfm3ForCausalLM", "Lfm3Config", num_key_value_heads=2, pad_token_id=0, sliding_window=16,
                           layer_types=["conv", "full_attention", "conv", "sliding_attention"],
                           tie_word_embeddings=False),
    "olmo-hybrid": lambda: _other("OlmoHybridForCausalLM", "OlmoHybridConfig", num_key_value_heads=2, pad_token_id=0,
                                  layer_types=LINEAR4, **SHAPES),
    "granite-moe-hybrid": lambda: _other("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", True,
                                         num_key_value_heads=2, pad_token_id=0, num_local_experts=4,
                                         layer_types=["linear_attention", "full_attention"] * 2, mamba_n_heads=4,
                                         mamba_d_state=8, mamba_d_head=16, mamba_chunk_size=16),
    "bamba": lambda: _other("BambaForCausalLM", "BambaConfig", True, num_key_value_heads=2, attn_layer_indices=[1, 3],
                            mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16),
    "kimi-linear": lambda: _other("KimiLinearForCausalLM", "KimiLinearConfig", q_lora_rank=16,
                                  mlp_layer_types=["dense", "sparse", "sparse", "sparse"], **MLA),
    "bailing-hybrid": lambda: _other("BailingHybridForCausalLM", "BailingHybridConfig", num_expert_group=1,
                                     topk_group=1, first_k_dense_replace=1, layer_group_size=2,
                                     mlp_layer_types=["dense", "dense", "sparse", "sparse"], **MLA),
}
METHODS = {
    "ar": lambda m: (None, Policy.autoregressive(), {}),
    "eagle3-oracle-chain": lambda m: (OracleDraft(m), Policy.static(5, 1, 6), {}),
    "eagle3-noisy-chain": lambda m: (NoisyDraft(32, VOCAB, seed=3).to(DEVICE), Policy.static(4, 1, 5), {}),
    "heterospec-chain": lambda m: (NoisyDraft(32, VOCAB, seed=4).to(DEVICE), Policy.paper(4, 1, 5, THRESHOLDS), {}),
    "lookup": lambda m: (None, Policy.autoregressive(), dict(prompt_lookup_num_tokens=4)),
}


def _prompt(n, seed=None):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n if seed is None else seed)
                         ).to(DEVICE)


def _hf(model, p, forced=None, new=NEW, eos=None):
    """HuggingFace's greedy generate (or ``forced`` tokens) -> (tokens, raw logits [new, V])."""
    tokens, logits = hf_with_logits(model, p, new, forced=forced, eos=eos)
    return tokens[0].tolist(), logits[0]


@pytest.fixture(scope="module", params=list(BUILT))
def model(request):
    m = BUILT[request.param]()
    m.heterospec_test_name = request.param
    return m


def test_the_probe_finds_the_linear_layers_states(model):
    tgt = TargetAdapter(model)
    assert tgt.stateful and len(tgt.mixers) == 4
    lin = [i for i, t in enumerate(LAYERS) if t == "linear_attention"]
    assert sorted(tgt.state_layout) == [(i, 0) for i in lin]
    want_conv, want_rec = STATES[model.heterospec_test_name]
    for (conv, _), rec in tgt.state_layout.values():
        assert conv == want_conv and (rec if rec is None else rec[0]) == want_rec
    assert [i for i, kv in enumerate(tgt.layout) if kv is not None] == [2, 5]    # keys and values: attention only


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_tokens_and_logits_equal_huggingface(model, method):
    draft, policy, kw = METHODS[method](model)
    with HeteroSpec(model, draft, policy) as hs:
        for n in (9, 30):
            tokens, logits = _hf(model, _prompt(n))
            # the "states" point is the engine's only new host read (transformers' MoE experts read the host
            # themselves: Qwen3-Next's grouped experts count their tokens, so the guard checks the dense model;
            # the oracle double runs the target on the host)
            guard = contextlib.nullcontext() if getattr(model.config, "num_experts", None) or "oracle" in method \
                else sync.forbid_host_transfers()
            with guard:
                out, st = hs.generate(_prompt(n), max_new_tokens=NEW, eos_token_id=[], output_logits=True, **kw)
            assert out[0, n:].tolist() == tokens, f"{method} prompt {n}"
            err = float((st.logits - logits).abs().max())
            assert err < TOL, f"{method} prompt {n}: logits off by {err:.1e}"
            if method == "eagle3-oracle-chain":
                assert st.tau > 4.0, st.tau           # long chains accepted: the states advanced over several nodes


def test_sampled_logits_are_the_models_own(model):
    """Sampling with the greedy oracle's chains (rejections mid-chain): every new token's logits are HuggingFace's
    for the same sequence, taken token by token."""
    with HeteroSpec(model, OracleDraft(model), Policy.static(4, 1, 5)) as hs:
        for n in (12, 20):
            out, st = hs.generate(_prompt(n), max_new_tokens=NEW, eos_token_id=[], output_logits=True,
                                  temperature=1.0, seed=7)
            tokens = out[0, n:].tolist()
            forced, logits = _hf(model, _prompt(n), forced=tokens)
            assert forced == tokens
            assert float((st.logits - logits).abs().max()) < TOL, f"prompt {n}"
            assert 1.5 < st.tau < 5.0, st.tau          # drafts accepted, and some rejected mid-chain


def test_a_batch_with_a_row_finishing_early(model):
    """Prompts of different lengths (each prefilled alone: padding would enter a recurrence), rows accepting
    different counts, and a row that stops at an EOS and leaves the caches (its states move with the rows)."""
    ps = [_prompt(n, seed=50 + n) for n in (5, 17, 11)]
    refs = [_hf(model, p)[0] for p in ps]
    eos = refs[1][3]                      # the second row ends at its fourth token (or before, where it recurs)
    want = []
    for r in refs:
        cut = r.index(eos) + 1 if eos in r else len(r)
        want.append(r[:cut])
    with HeteroSpec(model, OracleDraft(model), Policy.static(4, 1, 5)) as hs:
        outs, st = hs.generate([p[0] for p in ps], max_new_tokens=NEW, eos_token_id=eos)
    for b, (o, p, w) in enumerate(zip(outs, ps, want)):
        assert o[p.shape[1]:].tolist() == w, f"row {b}"
    assert len(want[1]) <= 4 and max(len(w) for w in want) > 8     # one row left early, another went on


def test_what_cannot_be_exact_is_refused_in_one_line(model, request):
    kind = type(TargetAdapter(model).mixers[0]).__name__
    what = rf"a target with linear-attention layers \({kind}\)"
    noisy = NoisyDraft(32, VOCAB).to(DEVICE)
    default = Policy.static()
    with HeteroSpec(model, noisy) as hs:      # no policy given: the default's depth as a chain
        assert (hs.policy.depth, hs.policy.top_k, hs.policy.total_tokens) == (default.depth, 1, default.depth + 1)
    with pytest.raises(ValueError, match=rf"^HeteroSpec: argument 'policy' expected top_k 1 \(a chain of drafts: "
                                         rf"{what} verifies no tree\), got top_k 4$"):
        HeteroSpec(model, noisy, Policy.static(4, 4, 12))
    with pytest.raises(ValueError, match=rf"^HeteroSpec: argument 'prompt_lookup_num_tokens' expected 0 with a "
                                         rf"draft for {what} \(the lookup's chain would be a second branch\), got 3$"):
        HeteroSpec(model, noisy, Policy.static(4, 1, 5), prompt_lookup_num_tokens=3)
    with HeteroSpec(model, noisy, Policy.static(4, 1, 5)) as hs:
        assert hs.cuda_graphs is False
        with pytest.raises(ValueError, match=rf"^generate: argument 'prompt_lookup_num_tokens' expected 0 with a "
                                             rf"draft for {what}"):
            hs.generate(_prompt(8), max_new_tokens=4, prompt_lookup_num_tokens=2)
    for graphs in (True, "emulate"):
        with pytest.raises(ValueError, match=rf"^HeteroSpec: argument 'cuda_graphs' expected False or 'auto' for "
                                             rf"{what} \(its states advance after a host read of the accepted "
                                             rf"counts\), got {graphs!r}$"):
            HeteroSpec(model, noisy, Policy.static(4, 1, 5), cuda_graphs=graphs)
    with pytest.raises(ValueError, match=rf"^HeteroSpec: argument 'compile' expected False for {what}, got True$"):
        HeteroSpec(model, noisy, Policy.static(4, 1, 5), compile=True)
    half = BUILT[request.node.callspec.params["model"]]().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^target: row-invariant verification expected attention layers only, got "
                                         r"linear-attention layers; use float32 or batch_invariant=False$"):
        TargetAdapter(half, invariant=True)


@pytest.mark.parametrize("family", list(OTHERS))
def test_other_state_keeping_mixers_decode_as_huggingface(family):
    """The same engine for every mixer that keeps its state in transformers' cache: greedy tokens and raw logits
    equal to HuggingFace's with autoregressive decoding, an oracle's chains, a noisy draft's chains (rejections) and
    prompt lookup."""
    model = OTHERS[family]()
    p = _prompt(30)
    tokens, logits = _hf(model, p)
    for method in ("ar", "eagle3-oracle-chain", "eagle3-noisy-chain", "lookup"):
        draft, policy, kw = METHODS[method](model)
        with HeteroSpec(model, draft, policy) as hs:
            assert hs.target.stateful
            out, st = hs.generate(p, max_new_tokens=NEW, eos_token_id=[], output_logits=True, **kw)
        assert out[0, 30:].tolist() == tokens, f"{family} {method}"
        err = float((st.logits - logits).abs().max())
        assert err < TOL, f"{family} {method}: logits off by {err:.1e}"


def test_a_mixer_that_restarts_its_state_on_several_tokens_is_refused():
    """Jamba's Mamba mixer in transformers 5.23 runs a forward of several tokens as a new prompt, whatever its cache
    holds (a chain's logits were off by 1e-3 while the tokens agreed): refused in one line, with or without a draft."""
    model = _other("JambaForCausalLM", "JambaConfig", num_key_value_heads=2, num_experts=4, attn_layer_period=2,
                   attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8, mamba_dt_rank=8)
    with pytest.raises(ValueError, match=r"^target: expected linear-attention layers the engine keeps the state of "
                                         r"\(Qwen3NextGatedDeltaNet, .*\), got \['JambaMambaMixer'\] in layer 0$"):
        HeteroSpec(model)


def test_an_older_transformers_is_refused_in_one_line():
    """transformers before 5.23 kept these states in per-model caches of their own (Qwen3-Next's in 5.0): the engine
    says which release it needs instead of failing inside the model."""
    v = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if v >= (5, 23) or not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} holds the states (or has no Qwen3-Next)")
    cfg = transformers.Qwen3NextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, layer_types=LAYERS,
                                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32, **SHAPES)
    cfg._attn_implementation = "sdpa"
    model = transformers.Qwen3NextForCausalLM(cfg).eval().to(DEVICE)
    with pytest.raises(ValueError, match=rf"^target: expected a transformers whose caches hold linear-attention "
                                         rf"states \(5.23 or newer\) for a model with linear-attention layers, got "
                                         rf"{transformers.__version__}$"):
        HeteroSpec(model)
