"""At the scale our users run (issue 44): the engine on a target of a real model's shape (Llama-3.1-8B, Qwen3-8B)
and an EAGLE-3 head of the official shape, with seeded random weights made on the device (no files to download).

A forward's cost does not depend on the weights' values, so random weights give the real costs, the real memory and
the real loader path; they accept almost nothing (tau ~ 1), so tokens per second at the taus real heads reach are
**projected** from the measured cycle costs (tau / cycle time), and labelled so everywhere.

What one run does, in one process (``--shape tiny`` is the same code at a size the CPU test suite runs):
1. builds the target with transformers' own model class from a config of that shape, in ``--dtype`` on
   ``--device``, and an EAGLE-3 head of the official shape (one layer, the shape's draft vocabulary with a seeded
   ``d2t``); saves the head in SafeAILab's layout and in vLLM / speculators' (``layers.0.*``) and loads both back
   through ``Eagle3Draft.from_pretrained(..., target=...)``, the path a user takes, checking every tensor;
2. times HF ``generate`` (dynamic cache) and ``hf-static`` (static cache: compiled by transformers on a GPU), our
   ``ar``, ``eagle3`` (7/10/60) and ``heterospec`` (the paper's rule on the 7/10/60 base: random weights carry no
   entropy signal to calibrate bins on), CUDA graphs on where there is a GPU, at batch 1 and a batch of
   ``--batch``;
3. fits the engine's cost model here (``heterospec.tune.profile_costs``: the verify forward over n tree tokens,
   the draft levels) and reports per cycle: target verify, draft levels, and the rest (tree ops, host, idle);
   the ``ar`` step against the memory floor (weight bytes / the copy bandwidth measured in the same run); peak
   memory and the caches' sizes (4,096 positions at batch 8 allocated for real);
4. checks that every method's greedy output equals ``ar``'s (enforced in float32, in bfloat16 on the CPU where
   verification is row-invariant, and in any dtype our CPU decoder runs; reported elsewhere, where a tree forward
   may round differently);
5. projects tokens/s at tau = 2..7 from the measured cycle times, the paper's tau marked.

    python -m benchmarks.scale_rehearsal --shape llama-3.1-8b --device cuda --out scale
    python -m benchmarks.scale_rehearsal --shape tiny --device cpu --dtype float32 --new-tokens 16 --out /tmp/s

Exit status 1 when an enforced output differs from ``ar``'s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

GEMMA3_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
SHAPES = {
    # meta-llama/Llama-3.1-8B-Instruct's config, and yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's head (32,000 draft tokens)
    "llama-3.1-8b": dict(arch="llama", draft_vocab=32000, config=dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, tie_word_embeddings=False)),
    # Qwen/Qwen3-8B's config; its EAGLE-3 heads (e.g. Tengyunw/qwen3_8b_eagle3) use a 32,000-token draft vocabulary
    "qwen3-8b": dict(arch="qwen3", draft_vocab=32000, config=dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False)),
    # EleutherAI/pythia-160m's config (GPT-NeoX: partial rotary, parallel residual) and openai-community/gpt2's
    # (learned absolute positions, tied embeddings): research staples whose layers are not at model.model.layers,
    # with a head of the same width (no official EAGLE-3 heads exist for them; 8,192 draft tokens, as ours)
    "pythia-160m": dict(arch="gpt_neox", draft_vocab=8192, config=dict(
        vocab_size=50304, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        max_position_embeddings=2048, rotary_pct=0.25, rope_theta=10000.0, use_parallel_residual=True,
        layer_norm_eps=1e-5, tie_word_embeddings=False)),
    "gpt2": dict(arch="gpt2", draft_vocab=8192, config=dict(
        vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)),
    # facebook/opt-125m's config (relu, learned positions, its norms before each block; the checkpoint is float16)
    "opt-125m": dict(arch="opt", draft_vocab=8192, config=dict(
        vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
        max_position_embeddings=2048, word_embed_proj_dim=768, do_layer_norm_before=True)),
    # microsoft/phi-1_5's config (one LayerNorm a layer, attention and MLP side by side; the checkpoint is float16)
    "phi-1.5": dict(arch="phi", draft_vocab=8192, config=dict(
        vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        max_position_embeddings=2048, layer_norm_eps=1e-5, hidden_act="gelu_new", pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # Salesforce/codegen-350M-mono's config (GPT-J's layout, q/k/v in CodeGen's blocks; the checkpoint is float16)
    "codegen-350m": dict(arch="codegen", draft_vocab=8192, config=dict(
        vocab_size=51200, n_embd=1024, n_layer=20, n_head=16, rotary_dim=32, n_positions=2048, n_ctx=2048,
        activation_function="gelu_new")),
    # the small checkpoints CPU users load today, stored in bfloat16 (transformers 5 loads them so by default):
    # Qwen/Qwen2.5-0.5B-Instruct's config (q/k/v biases, tied embeddings) and meta-llama/Llama-3.2-1B-Instruct's
    "qwen2.5-0.5b": dict(arch="qwen2", draft_vocab=32000, config=dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True)),
    "llama-3.2-1b": dict(arch="llama", draft_vocab=32000, config=dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, tie_word_embeddings=True)),
    # google/gemma-3-270m-it's and gemma-3-1b-it's configs (Gemma3ForCausalLM, bfloat16 checkpoints): five sliding
    # layers (a 512-token window, RoPE base 10,000) to each full one (base 1,000,000), one kv head of 256 dimensions,
    # a 262,144-token vocabulary; no official EAGLE-3 heads (32,000 draft tokens, as the 8B heads')
    "gemma-3-270m": dict(arch="gemma3", draft_vocab=32000, config=dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=GEMMA3_ROPE)),
    "gemma-3-1b": dict(arch="gemma3", draft_vocab=32000, config=dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=GEMMA3_ROPE)),
    # google/gemma-2-2b-it's config (Gemma2ForCausalLM, a bfloat16 checkpoint): sliding (4,096-token window) and full
    # layers alternating, attention scores soft-capped at 50 and logits at 30 (transformers gives it eager attention)
    "gemma-2-2b": dict(arch="gemma2", draft_vocab=32000, config=dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True)),
    # allenai/OLMo-2-0425-1B-Instruct's config (no norm before attention or MLP, one after each; q/k normed over all
    # heads); no official EAGLE-3 head (32,000 draft tokens)
    "olmo-2-1b": dict(arch="olmo2", draft_vocab=32000, config=dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000.0,
        tie_word_embeddings=False)),
    # ibm-granite/granite-3.3-2b-instruct's config (Llama's layout with multipliers: embeddings x 12, attention scale
    # 1/64, each residual add's output x 0.22, logits / 8; a bfloat16 checkpoint)
    "granite-3.3-2b": dict(arch="granite", draft_vocab=32000, config=dict(
        vocab_size=49159, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000000.0,
        embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0,
        tie_word_embeddings=True)),
    # stabilityai/stablelm-2-1_6b's config (LayerNorms, q/k/v biases, a quarter of each head rotated; float16)
    "stablelm-2-1.6b": dict(arch="stablelm", draft_vocab=32000, config=dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, layer_norm_eps=1e-5, use_qkv_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False)),
    # bigcode/starcoder2-3b's config (LayerNorms, gelu's tanh form, biases, a 4,096-token window on every layer)
    "starcoder2-3b": dict(arch="starcoder2", draft_vocab=32000, config=dict(
        vocab_size=49152, hidden_size=3072, intermediate_size=12288, num_hidden_layers=30, num_attention_heads=24,
        num_key_value_heads=2, max_position_embeddings=16384, norm_epsilon=1e-5, rope_theta=999999.4420358813,
        sliding_window=4096, use_bias=True, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)),
    # CohereLabs/aya-expanse-8b's config (one LayerNorm without bias a layer, attention and MLP side by side, pairs
    # rotated, logits x 0.125) and CohereLabs/c4ai-command-r7b-12-2024's (Cohere 2: three sliding layers, a 4,096-token
    # window, to each full one, which rotates nothing; logits x 0.25); bfloat16 checkpoints
    "aya-expanse-8b": dict(arch="cohere", draft_vocab=32000, config=dict(
        vocab_size=256000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, layer_norm_eps=1e-5, rope_theta=10000.0,
        logit_scale=0.125, use_qk_norm=False, tie_word_embeddings=True)),
    "command-r7b": dict(arch="cohere2", draft_vocab=32000, config=dict(
        vocab_size=256000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, layer_norm_eps=1e-5, rope_theta=50000.0,
        logit_scale=0.25, sliding_window=4096, tie_word_embeddings=True)),
    # LGAI-EXAONE/EXAONE-4.0-1.2B's config (OLMo 2's layout, q/k norms head by head, no window; a bfloat16 checkpoint)
    "exaone-4.0-1.2b": dict(arch="exaone4", draft_vocab=32000, config=dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=4096, num_hidden_layers=30, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=65536, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        sliding_window=None, layer_types=["full_attention"] * 30, tie_word_embeddings=True)),
    # ibm-granite/granite-4.0-1b's and granite-4.0-micro's configs (GraniteMoeHybrid with attention layers only:
    # Granite's multipliers, a shared MLP; bfloat16 checkpoints; their rope_theta is not in what we read: transformers'
    # default)
    "granite-4.0-1b": dict(arch="granitemoehybrid", draft_vocab=32000, config=dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=4096, shared_intermediate_size=4096,
        num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=4, num_local_experts=0, num_experts_per_tok=0,
        layer_types=["attention"] * 40, position_embedding_type="rope", max_position_embeddings=131072,
        embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=8.0,
        tie_word_embeddings=True)),
    "granite-4.0-micro": dict(arch="granitemoehybrid", draft_vocab=32000, config=dict(
        vocab_size=100352, hidden_size=2560, intermediate_size=8192, shared_intermediate_size=8192,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, num_local_experts=0, num_experts_per_tok=0,
        layer_types=["attention"] * 40, position_embedding_type="rope", max_position_embeddings=131072,
        embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=10.0,
        tie_word_embeddings=True)),
    # mixtures of experts: ibm-granite/granite-3.1-3b-a800m-instruct's config (Granite's multipliers; 40 experts of
    # 512, 8 a token, weighted by the softmax of the chosen logits; a bfloat16 checkpoint), allenai/OLMoE-1B-7B-0924-
    # Instruct's (64 experts of 1,024, 8 a token; q/k normed over all heads) and Qwen/Qwen3-30B-A3B's (128 experts of
    # 768, 8 a token, renormalised; q/k norms per head) -- 3.3B, 6.9B and 30.5B parameters, 0.8B, 1.3B and 3.3B a token
    "granite-3.1-3b-a800m": dict(arch="granitemoe", draft_vocab=32000, config=dict(
        vocab_size=49155, hidden_size=1536, intermediate_size=512, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, num_local_experts=40, num_experts_per_tok=8, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=10000000.0, embedding_multiplier=12.0, attention_multiplier=0.015625,
        residual_multiplier=0.22, logits_scaling=6.0, tie_word_embeddings=True)),
    "olmoe-1b-7b": dict(arch="olmoe", draft_vocab=32000, config=dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)),
    "qwen3-30b-a3b": dict(arch="qwen3_moe", draft_vocab=32000, config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)),
    # the same code at a size the CPU test suite runs (Llama-3.1's RoPE: its base and llama3 scaling)
    "tiny": dict(arch="llama", draft_vocab=96, config=dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256}, tie_word_embeddings=False)),
}
# a shape's arch -> transformers' (config class, causal LM class)
ARCH_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
                "gpt2": ("GPT2Config", "GPT2LMHeadModel"), "opt": ("OPTConfig", "OPTForCausalLM"),
                "phi": ("PhiConfig", "PhiForCausalLM"), "codegen": ("CodeGenConfig", "CodeGenForCausalLM"),
                "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
                "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"), "granite": ("GraniteConfig", "GraniteForCausalLM"),
                "stablelm": ("StableLmConfig", "StableLmForCausalLM"),
                "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
                "cohere": ("CohereConfig", "CohereForCausalLM"), "cohere2": ("Cohere2Config", "Cohere2ForCausalLM"),
                "exaone4": ("Exaone4Config", "Exaone4ForCausalLM"),
                "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
                "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
                "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
                "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
PAPER_TAU = {"HeteroSpec (paper, L3.1-8B)": 6.57, "EAGLE-3 (paper, L3.1-8B)": 6.31}
PROJECTED_TAUS = (2, 3, 4, 5, 6, 7)
EAGLE3 = (7, 10, 60)


def target_config(shape, layers=None):
    """The shape's config; ``layers``: that many decoder layers instead of the shape's (every width, the
    vocabulary and the RoPE as the shape has them: the code path at full width on a machine that cannot hold
    the whole model; its timings are not the shape's)."""
    import transformers

    s = SHAPES[shape]
    cls = getattr(transformers, ARCH_CLASSES[s["arch"]][0])
    kw = dict(s["config"], **({"num_hidden_layers": layers} if layers else {}))
    if layers and "layer_types" in kw:   # (a shape that lists its layers' types: the first ``layers`` of them)
        kw["layer_types"] = kw["layer_types"][:layers]
    # (transformers gives CodeGen no sdpa, nor Gemma 2: its soft-capping)
    return cls(**kw, attn_implementation="eager" if s["arch"] in ("codegen", "gemma2") else "sdpa")


def build_target(shape, device, dtype, seed=0, layers=None):
    """transformers' own model class for ``shape`` (``layers``: see target_config), its weights seeded random
    numbers made on ``device`` in ``dtype`` (no files); no EOS, so every method runs its full budget."""
    import torch
    import transformers

    cfg = target_config(shape, layers)
    cls = getattr(transformers, ARCH_CLASSES[SHAPES[shape]["arch"]][1])
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(before)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def build_head(model, shape, folder, seed=0):
    """An EAGLE-3 head of the official shape for ``model`` (seeded weights and ``d2t``), saved in SafeAILab's
    layout and in vLLM / speculators' (``layers.0.*`` keys), both loaded back through
    ``Eagle3Draft.from_pretrained(..., target=model)``.  Returns (the head loaded from SafeAILab's layout, a dict
    of what was checked)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from heterospec.models.draft import Eagle3Draft
    from heterospec.models.train import draft_config_for

    # the target's RoPE base and scaling as the loader reads them (transformers 5 keeps them in rope_parameters)
    config = draft_config_for(model, SHAPES[shape]["draft_vocab"])
    vd, c = config.draft_vocab_size, model.config
    p = next(model.parameters())
    torch.manual_seed(seed)
    with torch.device(p.device):
        head = Eagle3Draft(config, embed_tokens=model.get_input_embeddings().weight.detach())
    head = head.to(p.dtype)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        used = torch.sort(torch.randperm(c.vocab_size, generator=g)[:vd]).values.to(p.device)
        head.d2t.copy_(used - torch.arange(vd, device=p.device))
        head.t2d.zero_()
        head.t2d[used] = True
    safeailab = os.path.join(folder, "safeailab")
    vllm = os.path.join(folder, "vllm-speculators")
    head.save_pretrained(safeailab)
    os.makedirs(vllm, exist_ok=True)
    shutil.copy(os.path.join(safeailab, "config.json"), vllm)
    state = load_file(os.path.join(safeailab, "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()},
              os.path.join(vllm, "model.safetensors"))
    want = head.state_dict()
    checked = {}
    loaded = None
    for name, path in (("safeailab", safeailab), ("vllm-speculators", vllm)):
        t = time.perf_counter()
        back = Eagle3Draft.from_pretrained(path, target=model)
        got = back.state_dict()
        same = set(got) == set(want) and all(torch.equal(got[k].to(want[k].device), want[k]) for k in want)
        checked[name] = {"load_s": round(time.perf_counter() - t, 2), "equal": same,
                         "bytes": os.path.getsize(os.path.join(path, "model.safetensors")),
                         "rope_theta": back.config.rope_theta, "rope_scaling": back.config.rope_scaling}
        loaded = back if loaded is None else loaded
    return loaded, checked


def copy_bandwidth(device, nbytes):
    """Bytes moved per second (read + write) by one device-to-device copy of ``nbytes``, the fastest of 5."""
    import torch

    from heterospec.measure import device_timer

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer = device_timer(device)
    dst.copy_(src)
    best = min(timer(lambda: dst.copy_(src))[1] for _ in range(5))
    return 2 * nbytes / best   # the two buffers are freed on return


def weight_bytes(model):
    """Bytes a decode step reads: every parameter but the input embedding (one row of it is read), unless tied."""
    emb = model.get_input_embeddings().weight
    tied = emb is model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not emb)


def step_bytes(model):
    """Bytes a one-token decode step reads at least: :func:`weight_bytes`, a mixture's experts (3D parameters) at
    the share a token routes to (top_k of E)."""
    c = model.config
    E = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    K = getattr(c, "num_experts_per_tok", None)
    if not E or not K:
        return weight_bytes(model)
    experts = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 3)
    return weight_bytes(model) - experts + experts * K // E


def head_bytes(head, model):
    """The head's own parameter bytes: its token embedding is the target's (shared at load), not counted twice."""
    shared = {p.data_ptr() for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in head.parameters() if p.data_ptr() not in shared)


def random_prompts(vocab, n, length, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, length), generator=g) for _ in range(n)]


def run_methods(model, head, prompts, new_tokens, graphs, batch, thresholds, progress=None, hf_compiled=False):
    """{method: {batch: row}}: tokens/s, cycles, tau, the greedy ids; batch 1 over ``prompts`` one by one, then
    one batched call over ``batch`` prompts (0: none).  ``progress(name, rows)`` hears of each method when it is
    done (its rows hold the warm-up's seconds too: capture, and transformers' compile for hf-static).
    ``hf_compiled``: transformers' compiled static-cache generate too (bench's ``hf-compiled``: compiled on every
    device, the fastest generate a CPU user has; minutes of compilation)."""
    import torch

    import heterospec
    from heterospec.tools.bench.baselines import HFGenerate
    from heterospec.tools.bench.methods import HF_BASELINES

    dev = next(model.parameters()).device
    d, k, n = EAGLE3
    methods = {
        "hf": HF_BASELINES["hf"],
        "hf-static": HF_BASELINES["hf-static"],
        **({"hf-compiled": HF_BASELINES["hf-compiled"]} if hf_compiled else {}),
        "ar": heterospec.Policy.autoregressive(),
        "eagle3": heterospec.Policy.static(d, k, n),
        "heterospec": heterospec.Policy.paper(d, k, n, thresholds),
    }
    out = {}
    for name, m in methods.items():
        is_hf = isinstance(m, heterospec.HFMethod)
        eng = HFGenerate(model, m, pad_token_id=0) if is_hf else heterospec.HeteroSpec(
            model, head if m.drafts else None, m, cuda_graphs=graphs, max_length=prompts[0].shape[1] + new_tokens + 80)
        rows = {}
        try:
            warm = prompts[0].to(dev)
            kw = {"cache_len": warm.shape[1] + new_tokens} if is_hf else {}
            t = time.perf_counter()
            eng.generate(warm, max_new_tokens=new_tokens, eos_token_id=[], **kw)   # warm-up (and capture)
            heterospec.measure.synchronize(dev)
            warm_s = time.perf_counter() - t
            ids, toks, secs, cycles, committed, idle, graph = [], 0, 0.0, 0, 0, 0.0, 0.0
            for p in prompts:
                p = p.to(dev)
                heterospec.measure.synchronize(dev)
                t = time.perf_counter()
                seq, st = eng.generate(p, max_new_tokens=new_tokens, eos_token_id=[])
                heterospec.measure.synchronize(dev)
                secs += time.perf_counter() - t - getattr(st, "capture_s", 0.0)
                ids.append(seq[0, p.shape[1]:].tolist())
                toks += len(ids[-1])
                cycles += getattr(st, "cycles", 0) or 0
                committed += st.committed if hasattr(st, "committed") else 0
                idle += getattr(st, "idle_s", 0.0) or 0.0
                graph += getattr(st, "graph_s", 0.0) or 0.0
            rows[1] = {"tokens_per_s": toks / secs, "seconds": secs, "tokens": toks, "cycles": cycles,
                       "tau": committed / cycles if cycles else None,
                       "cycle_ms": 1e3 * secs / cycles if cycles else None,
                       "idle_ms_per_cycle": 1e3 * idle / cycles if cycles else None, "warmup_s": warm_s,
                       "ids": ids}
            if batch:
                many = [prompts[i % len(prompts)][0] for i in range(batch)]
                t = time.perf_counter()
                if is_hf:
                    S = max(x.shape[0] for x in many)
                    ids_b = torch.stack([torch.nn.functional.pad(x, (S - x.shape[0], 0)) for x in many]).to(dev)
                    mask = torch.stack([torch.nn.functional.pad(torch.ones_like(x), (S - x.shape[0], 0))
                                        for x in many]).to(dev)
                    eng.generate(ids_b, max_new_tokens=new_tokens, eos_token_id=[], attention_mask=mask,
                                 cache_len=S + new_tokens)
                    heterospec.measure.synchronize(dev)
                    warm_b = time.perf_counter() - t
                    t = time.perf_counter()
                    new, st = eng.generate(ids_b, max_new_tokens=new_tokens, eos_token_id=[], attention_mask=mask)
                    heterospec.measure.synchronize(dev)
                    secs_b, got = time.perf_counter() - t, [list(r) for r in new]
                else:
                    many = [x.to(dev) for x in many]
                    eng.generate(many, max_new_tokens=new_tokens, eos_token_id=[])
                    heterospec.measure.synchronize(dev)
                    warm_b = time.perf_counter() - t
                    t = time.perf_counter()
                    seqs, st = eng.generate(many, max_new_tokens=new_tokens, eos_token_id=[])
                    heterospec.measure.synchronize(dev)
                    secs_b = time.perf_counter() - t - getattr(st, "capture_s", 0.0)
                    got = [s[x.shape[0]:].tolist() for s, x in zip(seqs, many)]
                rows[batch] = {"tokens_per_s": sum(len(x) for x in got) / secs_b, "seconds": secs_b,
                               "tokens": sum(len(x) for x in got), "warmup_s": warm_b, "ids": got}
        finally:
            if not is_hf:
                eng.close()
        out[name] = rows
        if progress is not None:
            progress(name, {B: {k: v for k, v in r.items() if k != "ids"} for B, r in rows.items()})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=2, help="prompts timed one by one (random tokens)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="the batch timed after batch 1 (0: none)")
    ap.add_argument("--cache-check", type=int, default=4096, help="positions of the batch-8 cache allocated (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers instead of the shape's, at least 7 (full width: the code path on a "
                         "smaller machine; the timings are then not the shape's)")
    ap.add_argument("--values", choices=["float16"], default=None,
                    help="round the random weights to float16 values: a float16 checkpoint (as Pythia's are stored) "
                         "loaded in --dtype float32")
    ap.add_argument("--hf-compiled", action="store_true",
                    help="time transformers' compiled static-cache generate too (bench's hf-compiled; minutes of "
                         "compilation)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.layers is not None and args.layers < 7:
        ap.error(f"--layers: expected at least 7 decoder layers (the official head's taps [2, L//2, L-3] must be "
                 f"distinct and ascending), got {args.layers}")

    import torch

    import heterospec
    from heterospec.measure import machine_info
    from heterospec.models.target import TargetAdapter
    from heterospec.tune.costs import profile_costs

    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cuda = dev.type == "cuda"
    started = time.perf_counter()
    done = []

    def stage(name, **info):
        """One line per finished stage on stderr, and ``--out``/progress.json rewritten: what a run that is
        killed (a window's phase limit) leaves behind."""
        done.append({"stage": name, "at_s": round(time.perf_counter() - started, 1), **info})
        print(f"[scale] {done[-1]['at_s']:7.1f} s  {name}: " + json.dumps(info, default=str), file=sys.stderr,
              flush=True)
        if args.out:
            tmp = os.path.join(args.out, "progress.json.tmp")
            with open(tmp, "w") as f:
                json.dump({"shape": args.shape, "device": str(dev), "dtype": args.dtype, "stages": done}, f,
                          indent=1, default=str)
            os.replace(tmp, os.path.join(args.out, "progress.json"))

    if args.out:   # an earlier run's report must not pass for this one's if this one is cut short
        os.makedirs(args.out, exist_ok=True)
        for name in ("progress.json", "scale.json", "scale.md"):
            if os.path.exists(os.path.join(args.out, name)):
                os.remove(os.path.join(args.out, name))

    t0 = time.perf_counter()
    model = build_target(args.shape, dev, dtype, args.seed, args.layers)
    if args.values:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(getattr(torch, args.values)).to(dtype))
    build_s = time.perf_counter() - t0
    stage("build", seconds=round(build_s, 1), layers=model.config.num_hidden_layers,
          weight_bytes=weight_bytes(model))
    with tempfile.TemporaryDirectory() as tmp:
        head, loaders = build_head(model, args.shape, tmp, args.seed)
    stage("head", loaders=loaders)
    thresholds = heterospec.default_policy("cuda").thresholds or (1.0, 2.0, 3.0)
    wbytes = weight_bytes(model)
    bandwidth = copy_bandwidth(dev, min(1 << 30, max(1 << 24, wbytes // 4)))
    prompts = random_prompts(model.config.vocab_size, args.prompts, args.prompt_len, args.seed + 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    stage("bandwidth", copy_bandwidth_Bps=bandwidth)
    runs = run_methods(model, head, prompts, args.new_tokens, cuda, args.batch, thresholds,
                       hf_compiled=args.hf_compiled, progress=lambda name, rows: stage(name, rows=rows))
    peak = torch.cuda.max_memory_allocated(dev) if cuda else None
    # the cost model the calibration fits, here: verify over n tree tokens, the draft's levels
    ctx = args.prompt_len + args.new_tokens // 2
    cost = profile_costs(model, head, tree_tokens=(1, 8, 16, 32, 60), contexts=(ctx,), beams=(1, 10),
                         levels=(1, 7), reps=3, graphs=cuda, overhead_tokens=0)
    stage("cost model", verify=cost.verify)

    def verify_s(nodes):
        return cost.verify_cost(nodes, ctx)

    # the caches for --cache-check positions at batch 8, allocated for real
    caches = None
    if args.cache_check:
        adapter = TargetAdapter(model, capture_taps=False, batch=8)
        tgt_bytes = adapter.cache_bytes(args.cache_check)
        before = torch.cuda.memory_allocated(dev) if cuda else None
        adapter.allocate(args.cache_check)
        after = torch.cuda.memory_allocated(dev) if cuda else None
        dcache = head.new_cache(args.cache_check, batch=8) if hasattr(head, "new_cache") else None
        draft_bytes = sum(t.numel() * t.element_size() for t in (dcache if isinstance(dcache, (list, tuple))
                                                                 else [dcache]) if t is not None)
        total = torch.cuda.get_device_properties(dev).total_memory if cuda else None
        caches = {"positions": args.cache_check, "batch": 8, "target_bytes": tgt_bytes, "draft_bytes": draft_bytes,
                  "allocated_bytes": (after - before) if cuda else None, "weights_bytes": wbytes,
                  "head_bytes": head_bytes(head, model),
                  "device_total_bytes": total}
        del adapter, dcache

    # lossless: every method's greedy ids against ar's (enforced where the engine is bitwise: fp32, CPU bf16, and
    # any dtype our CPU decoder runs, in float32 arithmetic)
    from heterospec.models import cpu_decoder

    enforced = dtype == torch.float32 or (dev.type == "cpu" and (dtype == torch.bfloat16
                                                                 or cpu_decoder.why_off("auto", model) is None))
    same = {m: {B: r["ids"] == runs["ar"][B]["ids"] for B, r in rows.items()} for m, rows in runs.items()}
    ours_same = all(v for m, by in same.items() if not m.startswith("hf") for v in by.values())
    ar_step = runs["ar"][1]["cycle_ms"] / 1e3
    sbytes = step_bytes(model)
    floor = sbytes / bandwidth
    hf_static = runs["hf-static"][1]["tokens_per_s"]
    per_cycle = {}
    for m in ("ar", "eagle3", "heterospec"):
        r = runs[m][1]
        nodes = 1 if m == "ar" else EAGLE3[2]
        levels = 0 if m == "ar" else EAGLE3[0]
        v, dr = verify_s(nodes), (cost.draft(levels, EAGLE3[1]) if m != "ar" else 0.0)
        cyc = r["cycle_ms"] / 1e3
        per_cycle[m] = {"cycle_ms": 1e3 * cyc, "verify_ms": 1e3 * v, "draft_ms": 1e3 * dr,
                        "rest_ms": 1e3 * (cyc - v - dr), "rest_share": (cyc - v - dr) / cyc,
                        "idle_ms": r["idle_ms_per_cycle"], "tau_measured": r["tau"]}
    projection = {m: {str(t): {"tokens_per_s": t / (per_cycle[m]["cycle_ms"] / 1e3),
                               "x_hf_static": t / (per_cycle[m]["cycle_ms"] / 1e3) / hf_static}
                      for t in PROJECTED_TAUS + tuple(PAPER_TAU.values())}
                  for m in ("eagle3", "heterospec")}
    result = {
        "shape": args.shape, "layers": model.config.num_hidden_layers,
        "shape_layers": target_config(args.shape).num_hidden_layers, "config": SHAPES[args.shape]["config"],
        "draft_vocab": SHAPES[args.shape]["draft_vocab"],
        "device": str(dev), "dtype": args.dtype, "values": args.values, "machine": machine_info(args.device),
        "torch": torch.__version__,
        "build_s": build_s, "loaders": loaders, "prompts": args.prompts, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "batch": args.batch, "cuda_graphs": cuda,
        "methods": {m: {str(B): {k: v for k, v in r.items() if k != "ids"} for B, r in rows.items()}
                    for m, rows in runs.items()},
        "same_as_ar": {m: {str(B): v for B, v in by.items()} for m, by in same.items()}, "enforced": enforced,
        "cost_model": cost.to_dict(), "verify_ms": {str(n): 1e3 * verify_s(n) for n in (1, 8, 16, 32, 60)},
        "verify_60_over_1": verify_s(60) / verify_s(1),
        "weight_bytes": wbytes, "step_bytes": sbytes, "copy_bandwidth_Bps": bandwidth, "memory_floor_ms": 1e3 * floor,
        "ar_step_ms": 1e3 * ar_step, "ar_over_floor": ar_step / floor,
        "ar_over_hf_static": runs["ar"][1]["tokens_per_s"] / hf_static,
        "ar_over_hf_compiled": (runs["ar"][1]["tokens_per_s"] / runs["hf-compiled"][1]["tokens_per_s"]
                                if "hf-compiled" in runs else None),
        "peak_memory_bytes": peak, "caches": caches, "per_cycle": per_cycle,
        "projection": projection, "projection_note": "PROJECTED, not measured: tau / the measured cycle time, "
                                                     "random weights (tau ~ 1 measured)"
                                                     + ("" if args.layers is None else
                                                        f"; {args.layers} decoder layers, not the shape's: not a "
                                                        f"projection for the shape"),
        "paper_tau": PAPER_TAU,
    }
    text = markdown(result)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scale.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "scale.md"), "w") as f:
            f.write(text + "\n")
    return 1 if enforced and not ours_same else 0


def _size(n):
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.2f} MiB"


def markdown(r):
    cut = r["layers"] != r["shape_layers"]
    values = f", weights of {r['values']} values" if r.get("values") else ""
    lines = [f"# Scale rehearsal: {r['shape']} ({r['dtype']}{values}, {r['device']})", ""]
    if cut:
        lines += [f"**{r['layers']} of the shape's {r['shape_layers']} decoder layers** (every width, the vocabulary "
                  f"and the RoPE as the shape has them): this run checks the code path; its timings are not the "
                  f"shape's.", ""]
    lines += [
             f"{r['machine'].get('summary', r['device'])}; torch {r['torch']}; random weights made on the device in "
             f"{r['build_s']:.1f} s; {r['prompts']} prompts of {r['prompt_len']} random tokens, {r['new_tokens']} new "
             f"tokens, greedy, CUDA graphs {'on' if r['cuda_graphs'] else 'off'}; one run.", "",
             "Head loaders: " + "; ".join(f"{k} {'equal' if v['equal'] else 'DIFFERENT'} ({v['load_s']} s)"
                                          for k, v in r["loaders"].items()), "",
             "## Measured", "", "| method | batch | tokens/s | x hf-static | cycle ms | tau (random weights) | "
             "= ar | warm-up s (capture, compile) |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    base = r["methods"]["hf-static"]["1"]["tokens_per_s"]
    for m, rows in r["methods"].items():
        for B, x in rows.items():
            cyc = "-" if x.get("cycle_ms") is None else f"{x['cycle_ms']:.2f}"
            lines.append(f"| {m} | {B} | {x['tokens_per_s']:.1f} | {x['tokens_per_s'] / base:.2f}x | {cyc} | {'-' if x.get('tau') is None else round(x['tau'], 2)} | "
                         f"{'yes' if r['same_as_ar'][m][B] else 'no'} | {x['warmup_s']:.1f} |")
    lines += ["", f"`ar` step {r['ar_step_ms']:.2f} ms against the memory floor {r['memory_floor_ms']:.2f} ms "
                  f"({_size(r.get('step_bytes', r['weight_bytes']))} of weights"
                  + (f", the share of {_size(r['weight_bytes'])} a token routes to," if r.get("step_bytes", 0)
                     < r["weight_bytes"] else "")
                  + f" at {r['copy_bandwidth_Bps'] / 1e9:.0f} GB/s copy bandwidth): {r['ar_over_floor']:.2f}x the floor; `ar` {r['ar_over_hf_static']:.2f}x hf-static"
              + (f", {r['ar_over_hf_compiled']:.2f}x hf-compiled." if r.get("ar_over_hf_compiled") else ".")
              + (f" (The floor counts the {r['dtype']} bytes; weights of {r['values']} values are read by our CPU "
                 f"decoder as {r['values']} codes, half as many bytes: {r['memory_floor_ms'] / 2:.2f} ms.)"
                 if r.get("values") and r["dtype"] == "float32" else ""),
              f"Verify over 60 tree tokens {r['verify_ms']['60']:.2f} ms = {r['verify_60_over_1']:.2f}x one token "
              f"({r['verify_ms']['1']:.2f} ms; the cost model fitted here).", "",
              "Per cycle (batch 1): | method | cycle ms | verify ms | draft ms | rest (tree ops, host, idle) ms | "
              "rest share | idle ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for m, x in r["per_cycle"].items():
        idle = "-" if x["idle_ms"] is None else f"{x['idle_ms']:.2f}"
        lines.append(f"| {m} | {x['cycle_ms']:.2f} | {x['verify_ms']:.2f} | {x['draft_ms']:.2f} | "
                     f"{x['rest_ms']:.2f} | {100 * x['rest_share']:.0f} % | {idle} |")
    if r["caches"]:
        c = r["caches"]
        lines += ["", f"Caches for {c['positions']} positions at batch {c['batch']}: target {_size(c['target_bytes'])}"
                      f", draft {_size(c['draft_bytes'])}, beside {_size(c['weights_bytes'])} of weights and a "
                      f"{_size(c['head_bytes'])} head"
                      + (f" on a {_size(c['device_total_bytes'])} device (room left: "
                         f"{_size(c['device_total_bytes'] - c['weights_bytes'] - c['head_bytes'] - c['target_bytes'] - c['draft_bytes'])})"
                         if c["device_total_bytes"] else "")
                      + (f"; peak memory of the timed runs {_size(r['peak_memory_bytes'])}"
                         if r["peak_memory_bytes"] else "") + "."]
    lines += ["", "## PROJECTED (not measured)", "", r["projection_note"] + "; tokens/s = tau / cycle time.", "",
              "| method | " + " | ".join(f"tau {t}" for t in PROJECTED_TAUS) + " | "
              + " | ".join(f"{k}: tau {v}" for k, v in PAPER_TAU.items()) + " |",
              "|---|" + "---:|" * (len(PROJECTED_TAUS) + len(PAPER_TAU))]
    for m, by in r["projection"].items():
        vals = [by[str(t)] for t in PROJECTED_TAUS + tuple(PAPER_TAU.values())]
        lines.append(f"| {m} (projected) | " + " | ".join(f"{v['tokens_per_s']:.0f} tok/s ({v['x_hf_static']:.2f}x)"
                                                         for v in vals) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
