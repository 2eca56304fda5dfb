"""The engine tests' tiny models (tests/engine/, and every folder that decodes): random transformers targets of
three architectures, an EAGLE-3 head for them saved and loaded through the real loader, prompts, HuggingFace's own
greedy output as the reference, and the warped distribution the chi-square tests compare against.

HETEROSPEC_TEST_DEVICE=cuda puts models and prompts on the GPU (.ci/gpu does); a test module importing this is
skipped there without a GPU and a CUDA build."""
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from heterospec import build_info  # noqa: E402

DEVICE = torch.device(os.environ.get("HETEROSPEC_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not (torch.cuda.is_available() and build_info()["cuda"]):
    pytest.skip("HETEROSPEC_TEST_DEVICE=cuda needs a GPU and a CUDA build of the core", allow_module_level=True)

V = 97
N_PROMPTS = 20
NEW = 64
THRESHOLDS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0)


def tiny_target(arch, vocab=V, layers=8, seed=0, sharpen=40.0, **moe):
    """A tiny random model, its lm_head scaled up so that sampled distributions are not nearly uniform
    (the chi-square tests need that to have power); ``moe``: a mixture of experts' config fields over :data:`MOE`'s."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  attn_implementation="sdpa")
    if arch in ("gpt_neox", "gpt_neox-serial"):   # Pythia's layout: the parallel residual, gelu; rotary over half a head
        cfg = transformers.GPTNeoXConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            max_position_embeddings=512, use_parallel_residual=arch == "gpt_neox",
            hidden_act="gelu" if arch == "gpt_neox" else "gelu_new",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
        cfg._attn_implementation = "sdpa"
        return _sharpened(transformers.GPTNeoXForCausalLM(cfg), sharpen)
    if arch in ("gpt_bigcode", "gpt_bigcode-mha"):   # StarCoder 1 / SantaCoder: multi-query (or per-head q/k/v)
        cfg = transformers.GPTBigCodeConfig(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=512,
                                            multi_query=arch == "gpt_bigcode")
        cfg._attn_implementation = "sdpa"
        return _sharpened(transformers.GPTBigCodeForCausalLM(cfg), sharpen)
    if arch == "opt":   # relu, learned positions 2 rows into their table, q scaled before the dot products
        cfg = transformers.OPTConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                     ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=512)
        cfg._attn_implementation = "sdpa"
        return _sharpened(transformers.OPTForCausalLM(cfg), sharpen)
    if arch == "phi":   # one LayerNorm feeding attention and MLP side by side; rotary over half a head; head bias
        cfg = transformers.PhiConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            max_position_embeddings=512, pad_token_id=0,   # (transformers 5.0's Phi reads it)
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
        cfg._attn_implementation = "sdpa"
        return _sharpened(transformers.PhiForCausalLM(cfg), sharpen)
    if arch in ("gptj", "codegen"):   # as Phi, with the rotation of neighbouring pairs; CodeGen's q/k/v in blocks
        kw = dict(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, rotary_dim=4, n_positions=512)
        cfg = transformers.GPTJConfig(**kw) if arch == "gptj" else transformers.CodeGenConfig(n_ctx=512, **kw)
        cfg._attn_implementation = "eager"   # (transformers gives them no sdpa)
        cls = transformers.GPTJForCausalLM if arch == "gptj" else transformers.CodeGenForCausalLM
        return _sharpened(cls(cfg), sharpen)
    if arch == "gpt2":   # learned positions, Conv1D weights, gelu's tanh form, a tied output layer
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=512)
        cfg._attn_implementation = "sdpa"
        return _sharpened(transformers.GPT2LMHeadModel(cfg), sharpen)
    if arch in ("gemma", "gemma2", "gemma3"):   # 1 + w norms, scaled embeddings, GeGLU; 2 and 3: the sandwich of
        # norms and sliding layers among full ones (a window of 6, so decoding goes past it); 2: soft-capping; 3: q/k
        # norms and a rotation of its own on the sliding layers
        kw = dict(common, head_dim=8, query_pre_attn_scalar=8, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
        if arch == "gemma":
            cfg, cls = transformers.GemmaConfig(**kw), transformers.GemmaForCausalLM
        else:
            kw.update(sliding_window=6, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                      + ["sliding_attention"] * (layers % 2))
            if arch == "gemma2":
                kw["attn_implementation"] = "eager"   # (transformers gives Gemma 2 no sdpa: its soft-capping)
                cfg, cls = transformers.Gemma2Config(**kw), transformers.Gemma2ForCausalLM
            else:
                cfg, cls = transformers.Gemma3TextConfig(**kw), transformers.Gemma3ForCausalLM
        model = cls(cfg)
        with torch.no_grad():   # (their norms start at 0, read as 1 + w: random ones tell each norm from another)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
        return _sharpened(model, sharpen)
    if arch in ("olmo2", "olmo3", "exaone4"):   # no norm before attention or MLP, norms of their outputs, q/k normed
        # over all heads; olmo3: sliding layers (a window of 6) among full ones, each kind with its own rotation;
        # exaone4: q/k normed head by head, no window (EXAONE-4.0-1.2B's layout; its window: test_sliding_window.py)
        kw = dict(common, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if arch == "olmo2":
            cfg, cls = transformers.Olmo2Config(**kw), transformers.Olmo2ForCausalLM
        elif arch == "exaone4":
            cfg = transformers.Exaone4Config(**kw, sliding_window=None, layer_types=["full_attention"] * layers)
            cls = transformers.Exaone4ForCausalLM
        else:
            kw.update(sliding_window=6, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                      + ["sliding_attention"] * (layers % 2))
            cfg, cls = transformers.Olmo3Config(**kw), transformers.Olmo3ForCausalLM
        return _sharpened(_random_norms(cls(cfg)), sharpen)
    if arch == "stablelm":   # LayerNorms, a SiLU-gated MLP, q/k/v biases, half of each head rotated (StableLM 2: a
        # quarter)
        cfg = transformers.StableLmConfig(**common, use_qkv_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5})
        return _sharpened(_random_norms(transformers.StableLmForCausalLM(cfg)), sharpen)
    if arch == "starcoder2":   # LayerNorms, gelu's tanh form of one matrix, biases everywhere (its window: in
        # tests/engine/test_sliding_window.py)
        cfg = transformers.Starcoder2Config(**common, sliding_window=None, pad_token_id=0, bos_token_id=1,
                                            eos_token_id=2)
        return _sharpened(_random_norms(transformers.Starcoder2ForCausalLM(cfg)), sharpen)
    if arch in ("cohere", "cohere2"):   # one LayerNorm without bias a layer, attention and a SiLU-gated MLP side by
        # side summed from the residual, neighbouring pairs rotated, logits x 0.5; cohere2: sliding layers (a window
        # of 6) among full ones, which rotate nothing
        kw = dict(common, logit_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if arch == "cohere":
            cfg, cls = transformers.CohereConfig(**kw), transformers.CohereForCausalLM
        else:
            kw.update(sliding_window=6, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                      + ["sliding_attention"] * (layers % 2))
            cfg, cls = transformers.Cohere2Config(**kw), transformers.Cohere2ForCausalLM
        return _sharpened(_random_norms(cls(cfg)), sharpen)
    if arch in MOE:   # mixtures of 4 experts, 2 a row (Qwen2-MoE: a dense layer and shared experts; Qwen3-MoE:
        # every second layer dense; OLMoE: q/k normed over all heads; Granite MoE: its multipliers, its routing)
        cls_name, kw = MOE[arch]
        kw = {**kw, **moe}
        cfg = getattr(transformers, cls_name + "Config")(**common, **kw, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = _random_norms(getattr(transformers, cls_name + "ForCausalLM")(cfg))
        with torch.no_grad():   # routers 20x their init: weights far from uniform, so each expert's weight matters
            for name, p in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "router.weight", "router.layer.weight")):
                    p.mul_(20.0)
        return _sharpened(model, sharpen)
    if arch in ("granitemoehybrid", "granitemoehybrid-nope"):   # Granite 4.0's dense models (350M, 1B, Micro):
        # Granite's multipliers, attention layers only, a shared MLP of input_linear [gate; up] and output_linear;
        # rotary, or none (position_embedding_type None: NoPE, as its hybrid models)
        cfg = transformers.GraniteMoeHybridConfig(
            **common, layer_types=["attention"] * layers, num_local_experts=0, shared_intermediate_size=64,
            mamba_n_heads=4,
            position_embedding_type="rope" if arch == "granitemoehybrid" else None, embedding_multiplier=12.0,
            attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
        if "attention" in cfg.layer_types:
            pytest.skip(f"transformers {transformers.__version__} names Granite 4.0's layers 'attention' (the engine "
                        f"reads full_attention, sliding_attention and linear_attention)")
        return _sharpened(_random_norms(transformers.GraniteMoeHybridForCausalLM(cfg)), sharpen)
    if arch in LLAMA_LIKE:   # Llama's layout rotating neighbouring pairs (ERNIE 4.5 with biases; GLM with q/k/v biases,
        # gate/up fused, half of each head rotated; GLM-4 with post norms); Ministral's layers all full here (its
        # window: tests/engine/test_sliding_window.py); HunYuan's q/k norms after the rotation
        name, kw = LLAMA_LIKE[arch]
        if arch == "ministral":
            kw = dict(kw, layer_types=["full_attention"] * layers)
        cfg = getattr(transformers, name + "Config")(**common, **kw, head_dim=8, pad_token_id=0, bos_token_id=1,
                                                      eos_token_id=2)
        return _sharpened(_random_norms(getattr(transformers, name + "ForCausalLM")(cfg)), sharpen)
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "granite":   # Llama's layout with multipliers: embeddings x 12, attention scale 0.2 (not 1/sqrt(8)),
        # each residual add's output x 0.5, logits / 4 (Granite 3.x checkpoints: 12, 1/64, 0.22, 8)
        cfg = transformers.GraniteConfig(**common, embedding_multiplier=12.0, attention_multiplier=0.2,
                                         residual_multiplier=0.5, logits_scaling=4.0, pad_token_id=0, bos_token_id=1,
                                         eos_token_id=2)
        return _sharpened(_random_norms(transformers.GraniteForCausalLM(cfg)), sharpen)
    elif arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "phi3":   # q/k/v and gate/up fused; half of each head rotated (Phi-4-mini: three quarters)
        cfg = transformers.Phi3Config(**common, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
        cls = transformers.Phi3ForCausalLM
    elif arch == "smollm3":   # Llama's layout, some layers rotating nothing (NoPE: every second here, every fourth
        # in SmolLM3-3B, so that a 3-layer model has one)
        cfg = transformers.SmolLM3Config(**common, no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1,
                                         eos_token_id=2)
        cls = transformers.SmolLM3ForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(head_dim=16, **common), transformers.Qwen3ForCausalLM
    return _sharpened(cls(cfg), sharpen)


LLAMA_LIKE = {"ernie4_5": ("Ernie4_5", dict(use_bias=True, tie_word_embeddings=False)), "helium": ("Helium", {}),
              "glm": ("Glm", {}), "glm4": ("Glm4", {}), "ministral": ("Ministral", {}),
              "hunyuan_v1_dense": ("HunYuanDenseV1", {})}
MOE = {"mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
       "qwen2_moe": ("Qwen2Moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, mlp_only_layers=[1], norm_topk_prob=False)),
       "qwen3_moe": ("Qwen3Moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                      decoder_sparse_step=2, norm_topk_prob=True)),
       "olmoe": ("Olmoe", dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
       "granitemoe": ("GraniteMoe", dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                                         attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0))}


def _random_norms(model):
    """The norms' weights around 1 and their biases around 0 (they start at exactly 1 and 0: random ones tell each norm
    from another and a bias from none)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    return model


def _sharpened(model, sharpen):
    model = model.eval().float()
    # no EOS: the tests compare fixed-length greedy outputs (reference_greedy decodes `new` tokens whatever comes),
    # and generate() would otherwise stop at the config's default eos id 2, as HF's generate does
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    return model.to(DEVICE)


def prompts(n=N_PROMPTS, vocab=V, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 24, (n,), generator=g)
    return [torch.randint(0, vocab, (1, int(s)), generator=g).to(DEVICE) for s in lengths]


def reference_greedy(model, prompt, new=NEW):
    # an explicit all-ones attention mask: otherwise generate() treats prompt tokens equal to the pad id
    # as padding and masks them out
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new,
                          min_new_tokens=new, pad_token_id=0, eos_token_id=None).cpu()


class ForceTokens:
    """A logits processor making HuggingFace's greedy generate take the given tokens (its raw logits are then
    what the model says for that sequence, one step at a time)."""

    def __init__(self, tokens, start):
        self.tokens, self.start = tokens, start

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, float("-inf"))
        out[:, self.tokens[input_ids.shape[1] - self.start]] = 0.0
        return out


def hf_with_logits(model, prompt, new, forced=None, mask=None, eos=None):
    """HuggingFace's greedy generate of ``new`` tokens (or of ``forced``, :class:`ForceTokens`; ``eos``: it may stop
    there) -> (the new tokens [B, new], raw logits [B, new, V] float32)."""
    kw = {} if forced is None else dict(
        logits_processor=transformers.LogitsProcessorList([ForceTokens(forced, prompt.shape[1])]))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt) if mask is None else mask, do_sample=False,
                         max_new_tokens=new, min_new_tokens=0 if eos is not None else new, pad_token_id=0,
                         eos_token_id=eos, return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits, 1).float()


def eagle3_head(model, tmp_dir, vd=60, seed=0):
    """A random EAGLE-3 head for the tiny target, saved and loaded back through from_pretrained (strict,
    checked against the target) so the real module and loader run in the loop."""
    from heterospec.models.draft import Eagle3Config, Eagle3Draft

    c = model.config
    config = Eagle3Config(hidden_size=c.hidden_size, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=c.vocab_size, draft_vocab_size=vd,
                          rms_norm_eps=1e-5, max_position_embeddings=512, rope_theta=10000.0)
    torch.manual_seed(seed)
    draft = Eagle3Draft(config, embed_tokens=model.get_input_embeddings().weight.detach().clone())
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith("embed_tokens"):
                continue
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
        used = torch.sort(torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(seed))[:vd]).values
        draft.d2t.copy_(used - torch.arange(vd))
        draft.t2d.zero_()
        draft.t2d[used] = True
    draft.save_pretrained(tmp_dir)
    return Eagle3Draft.from_pretrained(tmp_dir, target=model)


def _warp(logits, temperature, top_k, top_p, min_p=None):
    z = logits.double() / temperature
    if 0 < top_k < z.numel():
        z[z < torch.topk(z, top_k).values[-1]] = -float("inf")
    p = torch.softmax(z, -1)
    if top_p < 1.0:
        order = torch.argsort(z, descending=True, stable=True)
        before = torch.cumsum(p[order], 0) - p[order]
        p[order[before >= top_p]] = 0
        p = p / p.sum()
    if min_p:   # after top-p, as HuggingFace orders its warpers: below min_p times the likeliest left
        p[p < min_p * p.max()] = 0
        p = p / p.sum()
    return p


def left_padded(ps, pad_id=0):
    """[B, S] left-padded ids and the attention mask, as a HuggingFace tokenizer pads a batch for generation."""
    S = max(p.shape[1] for p in ps)
    ids = torch.full((len(ps), S), pad_id, dtype=torch.long, device=DEVICE)
    mask = torch.zeros((len(ps), S), dtype=torch.long, device=DEVICE)
    for b, p in enumerate(ps):
        ids[b, S - p.shape[1]:] = p[0]
        mask[b, S - p.shape[1]:] = 1
    return ids, mask
