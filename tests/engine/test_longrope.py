"""Targets with LongRoPE (Phi-3 and Phi-3.5 with 128K context, Phi-4-mini, PhiMoE; any config whose
``rope_parameters`` say "longrope"): transformers rotates with the short factors while a forward's positions stay
below ``original_max_position_embeddings`` and with the long ones from there on, one decision per forward; Phi-3's
generate also recomputes its whole cache with the long factors at the step that reaches the switch.  The engine
decides per row, never verifies a tree that straddles the switch and recomputes a row's cache where Phi-3 does, so
its logits are HuggingFace's own on both sides of the switch (Phi-3, PhiMoE, a Llama with LongRoPE): prompts below,
at and past it, autoregressive decoding, EAGLE-3 trees, HeteroSpec's bins, prompt lookup, a left-padded batch,
sampling.  Before, every method
drifted from HuggingFace's logits once a sequence crossed the switch (by 0.01-0.05 here; the test first checks
that the switch moves HuggingFace's logits by more than 100 times its tolerance)."""
import contextlib
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft, OracleDraft  # noqa: E402
from _models import DEVICE, THRESHOLDS, hf_with_logits  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.engine import sync  # noqa: E402
from heterospec.engine.requests import left_pad  # noqa: E402
from heterospec.models import cpu_gemm  # noqa: E402
from heterospec.models.target import rope_switch  # noqa: E402

VOCAB, AT, NEW = 64, 24, 24
TOL = 1e-4          # float32: the engine's tree forwards against transformers' one-token steps
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa", pad_token_id=0)


SHORT = [1.0, 1.1, 1.2, 1.3]


def _rope(switch):
    """LongRoPE's parameters; without ``switch`` the long ones equal the short ones."""
    return dict(rope_type="longrope", long_factor=[1.0, 3.0, 9.0, 27.0] if switch else SHORT, short_factor=SHORT,
                original_max_position_embeddings=AT)


def _model(arch, switch=True):
    """A tiny random Phi-3 or PhiMoE (their generate recomputes the cache at the switch; PhiMoE's routers are linear
    layers with a forward of their own; its rotary, in transformers 5.23, switches only its scale, ``long_mscale``) or
    Llama (it does not), LongRoPE switching at ``AT`` (``switch`` False: the same weights, nothing to switch to)."""
    torch.manual_seed(0)
    if arch == "phi3":
        cfg = transformers.Phi3Config(**COMMON, original_max_position_embeddings=AT, rope_parameters=_rope(switch))
        model = transformers.Phi3ForCausalLM(cfg)
    elif arch == "phimoe":
        cfg = transformers.PhimoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                        rope_parameters=dict(_rope(switch), short_mscale=1.0,
                                                             long_mscale=1.2 if switch else 1.0))
        model = transformers.PhimoeForCausalLM(cfg)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, rope_parameters=_rope(switch)))
    model = model.eval().float()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    return model.to(DEVICE)


def _prompt(n, seed=None):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n if seed is None else seed)
                         ).to(DEVICE)


def _hf(model, p, forced=None):
    """HuggingFace's greedy generate of ``NEW`` tokens (or of ``forced``) -> (tokens, raw logits [NEW, V])."""
    tokens, logits = hf_with_logits(model, p, NEW, forced=forced)
    return tokens[0].tolist(), logits[0]


_FORGETS = {}


def _check_hf(arch):
    """Skip a Phi-3 or PhiMoE case on a transformers whose generate drops its cache at the switch without recomputing
    it (5.0: the step at the switch then attends to itself alone, and every later one from there on), or whose own
    LongRoPE forward fails (5.0's PhiMoE): its output is not the model's, and the engine follows the releases that
    recompute (5.23: the whole sequence in one forward, as each step's no-cache forward over the whole sequence
    gives it)."""
    if arch == "llama":
        return
    if arch not in _FORGETS:
        model, p = _model(arch), _prompt(20)
        try:
            tokens, logits = _hf(model, p)
        except AttributeError as e:        # 5.0's PhiMoE rotary reads attributes it never set
            _FORGETS[arch] = f"{arch}'s own LongRoPE forward fails ({e})"
        else:
            seq = torch.cat([p, torch.tensor([tokens], device=DEVICE)], 1)
            with torch.no_grad():
                full = torch.stack([model(seq[:, :p.shape[1] + t]).logits[0, -1].float() for t in range(NEW)])
            forgets = float((full - logits).abs().max()) > TOL
            _FORGETS[arch] = forgets and f"{arch}'s generate drops its cache at the switch without recomputing it"
    if _FORGETS[arch]:
        pytest.skip(f"transformers {transformers.__version__}: {_FORGETS[arch]}")


METHODS = {
    "ar": lambda m: (None, Policy.autoregressive(), {}),
    "eagle3-oracle": lambda m: (OracleDraft(m), Policy.static(5, 3, 16), {}),
    "eagle3-noisy": lambda m: (NoisyDraft(32, VOCAB).to(DEVICE), Policy.static(4, 4, 12), {}),
    "heterospec-noisy": lambda m: (NoisyDraft(32, VOCAB, seed=3).to(DEVICE), Policy.paper(4, 4, 20, THRESHOLDS), {}),
    "lookup": lambda m: (None, Policy.autoregressive(), dict(prompt_lookup_num_tokens=4)),
}
PROMPTS = (10, 20, 23, 24, 25, 30)      # below the switch by more and less than a tree's depth, at it, past it


@pytest.fixture(scope="module", params=["phi3", "phimoe", "llama"])
def arch_model_refs(request):
    _check_hf(request.param)
    model = _model(request.param)
    refs = {n: _hf(model, _prompt(n)) for n in PROMPTS}
    flat = _model(request.param, switch=False)            # the same weights, no switch to speak of
    moved = max(float((refs[n][1] - _hf(flat, _prompt(n), forced=refs[n][0])[1]).abs().max()) for n in PROMPTS)
    assert moved > 100 * TOL, f"the switch must move HuggingFace's logits here, moved {moved:.1e}"
    return request.param, model, refs


def test_rope_switch_reads_the_config_and_the_generate_that_recomputes():
    assert rope_switch(_model("phi3")) == (AT, True)       # Phi-3's prepare_inputs_for_generation drops its cache
    assert rope_switch(_model("phimoe")) == (AT, True)
    assert rope_switch(_model("llama")) == (AT, False)
    torch.manual_seed(0)
    plain = transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON))
    assert rope_switch(plain) is None                        # no LongRoPE: nothing switches

    def bare(rope_parameters):
        return SimpleNamespace(config=SimpleNamespace(rope_parameters=rope_parameters))

    per_type = {t: _rope(True) for t in ("full_attention", "sliding_attention")}
    assert rope_switch(bare(per_type)) == (AT, False)
    per_type["sliding_attention"]["original_max_position_embeddings"] = 2 * AT
    with pytest.raises(ValueError, match=r"^target: expected LongRoPE's original_max_position_embeddings one int >= "
                                         r"1, got \[24, 48\]$"):
        rope_switch(bare(per_type))
    with pytest.raises(ValueError, match=r"^target: expected LongRoPE's original_max_position_embeddings one int >= "
                                         r"1, got None$"):
        rope_switch(bare({"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}))


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_logits_equal_huggingface_across_the_switch(arch_model_refs, method):
    arch, model, refs = arch_model_refs
    draft, policy, kw = METHODS[method](model)
    with HeteroSpec(model, draft, policy, cuda_graphs=False) as hs:
        if DEVICE.type == "cpu" and cpu_gemm.rows_available() and cpu_gemm._rows_module().isa_best() >= 1:
            # Phi-3 and Llama on our CPU decoder (the rotary module it calls switches per row); PhiMoE on theirs
            assert (hs.target.decoder is not None) == (arch != "phimoe"), hs.cpu_decoder
        for n, (tokens, logits) in refs.items():
            out, st = hs.generate(_prompt(n), max_new_tokens=NEW, eos_token_id=[], output_logits=True, **kw)
            assert out[0, n:].tolist() == tokens, f"{arch} {method} prompt {n}"
            err = float((st.logits - logits).abs().max())
            assert err < TOL, f"{arch} {method} prompt {n}: logits off by {err:.1e}"


@pytest.mark.parametrize("arch", ["phi3", "phimoe", "llama"])
def test_a_left_padded_batch_decodes_each_row_as_alone(arch):
    """Rows on both sides of the switch in one forward (transformers would decide for the whole batch from its
    longest row): each row's logits are HuggingFace's for its prompt alone."""
    _check_hf(arch)
    model = _model(arch)
    ns = (9, 30, 21, 24)
    ps = [_prompt(n, seed=40 + n) for n in ns]
    refs = [_hf(model, p) for p in ps]
    ids, mask = left_pad(ps, 0, DEVICE)
    S = ids.shape[1]
    with HeteroSpec(model, OracleDraft(model), Policy.static(5, 3, 16), cuda_graphs=False) as hs:
        out, st = hs.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[], output_logits=True)
    for b, (tokens, logits) in enumerate(refs):
        assert out[b, S:S + NEW].tolist() == tokens, f"row {b}"
        assert float((st.per_row[b].logits - logits).abs().max()) < TOL, f"row {b}"


@pytest.mark.parametrize("arch", ["phi3", "llama"])
def test_sampled_logits_are_the_models_own_across_the_switch(arch):
    """Sampling: each new token is drawn from the logits HuggingFace's generate computes for the same sequence
    (taken token by token with a forcing processor)."""
    _check_hf(arch)
    model = _model(arch)
    with HeteroSpec(model, NoisyDraft(32, VOCAB, seed=5).to(DEVICE), Policy.static(4, 4, 12),
                    cuda_graphs=False) as hs:
        for n in (16, 24):
            p = _prompt(n)
            out, st = hs.generate(p, max_new_tokens=NEW, eos_token_id=[], output_logits=True, temperature=1.0,
                                  seed=7)
            tokens = out[0, n:].tolist()
            forced, logits = _hf(model, p, forced=tokens)
            assert forced == tokens
            assert float((st.logits - logits).abs().max()) < TOL, f"prompt {n}"


def _device_side():
    """Whether this transformers picks LongRoPE's factors without a host read: from 5.23 on (``torch.where``); 5.0
    reads the largest position with a Python ``if``.  Releases between are not known here (skipped)."""
    v = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if v == (5, 0) or v >= (5, 23):
        return v >= (5, 23)
    pytest.skip(f"transformers {transformers.__version__}: where its LongRoPE reads the host is not known here")


@pytest.mark.parametrize("arch", ["phi3", "phimoe", "llama"])
def test_recorded_steps_where_the_rotary_picks_on_the_device(arch):
    """A recorded step keeps what its recording computed, so a target whose rotary reads a position on the host to
    pick its factors is never recorded.  Through the engine's per-row choice, transformers 5.23's Phi-3 and Llama
    pick them on the device (recorded steps allowed); PhiMoE's rotary picks its scale with a Python ``if`` (refused),
    as every LongRoPE model in 5.0 does."""
    _check_hf(arch)
    model = _model(arch)
    on_device = arch != "phimoe" and _device_side()
    draft = OracleDraft(model)
    if not on_device:
        with pytest.raises(ValueError, match=r"^HeteroSpec: argument 'cuda_graphs' expected False for a target with "
                                             r"longrope RoPE scaling \(its frequencies depend on a host read of the "
                                             r"position\), got True$"):
            HeteroSpec(model, draft, Policy.static(5, 3, 16), cuda_graphs=True)
        assert HeteroSpec(model, draft, Policy.static(5, 3, 16), cuda_graphs="auto").cuda_graphs is False
    elif DEVICE.type == "cuda":
        assert HeteroSpec(model, draft, Policy.static(5, 3, 16), cuda_graphs="auto").cuda_graphs is True
    else:
        with pytest.raises(ValueError, match=r"^HeteroSpec: argument 'cuda_graphs' expected False on cpu"):
            HeteroSpec(model, draft, Policy.static(5, 3, 16), cuda_graphs=True)


@pytest.mark.parametrize("arch", ["phi3", "llama"])
def test_recorded_steps_equal_huggingface_across_the_switch(arch):
    """Recorded steps (CUDA graphs on a GPU; on the CPU emulated, under the host-read guard a capture needs, the
    whole call) on both sides of the switch: HuggingFace's logits, prompts below, at and past it, with HeteroSpec's
    bins and with prompt lookup."""
    _check_hf(arch)
    if not _device_side():
        pytest.skip(f"transformers {transformers.__version__}: its LongRoPE reads the host (never recorded)")
    model = _model(arch)
    mode = True if DEVICE.type == "cuda" else "emulate"
    cases = (("heterospec", NoisyDraft(32, VOCAB, seed=3).to(DEVICE), Policy.paper(4, 4, 20, THRESHOLDS), {}),
             ("lookup", None, Policy.autoregressive(), dict(prompt_lookup_num_tokens=4)))
    for name, draft, policy, kw in cases:
        with HeteroSpec(model, draft, policy, cuda_graphs=mode) as hs:
            assert hs.cuda_graphs == mode
            for n in (10, 23, 24, 30):
                tokens, logits = _hf(model, _prompt(n))
                guard = sync.forbid_host_transfers() if mode == "emulate" else contextlib.nullcontext()
                with guard:
                    out, st = hs.generate(_prompt(n), max_new_tokens=NEW, eos_token_id=[], output_logits=True, **kw)
                assert out[0, n:].tolist() == tokens, f"{arch} {name} prompt {n}"
                err = float((st.logits - logits).abs().max())
                assert err < TOL, f"{arch} {name} prompt {n}: logits off by {err:.1e}"
                assert st.captured_steps > 0
