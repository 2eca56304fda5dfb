"""The target's forward on the CPU in one call of ours (``cpu_decoder``): every decoder layer of a Llama-family,
Gemma, OLMo 2/3, EXAONE 4, Granite, StableLM, StarCoder2, Cohere 1/2, GPT-NeoX (Pythia), GPT-2, GPTBigCode, OPT, Phi,
GPT-J or CodeGen model in float32 arithmetic
(csrc/gemm/decoder.h), on the engine's own key/value cache, instead of transformers' modules.

A bfloat16 or float16 model (what transformers 5 loads from such a checkpoint by default, ``dtype="auto"``) runs
too: its weights are read as the 16-bit values they are (2 bytes each), its norms, biases, embeddings and rotary
tables are taken at their float32 values, and every sum is float32, the cache too.  So its output is, bit for bit,
that of the same weights loaded in float32 (``model.float()``), which equals transformers' float32 ``generate`` to
float32 rounding -- not transformers' bfloat16 arithmetic, whose rounding changes with the call's row count and
the machine's kernels anyway (``cpu_decoder=False`` keeps it).

Why: on a 2-core Xeon a one-token forward of SmolLM2-135M through transformers took 52 ms, of which the linear
layers were 24.5 ms (the few-rows kernel of ``cpu_gemm='rows'``); the rest was about 1,400 small torch
operations and their Python calls per forward.  The decoder runs the same arithmetic as a few loops per layer
around the same few-rows kernel.

What stays transformers': the weights (read in place, packed once into the kernel's panels: q, k and v as one
matrix, gate and up as one; as their codes where they are exactly a GGUF checkpoint's decodings (Q4_1, Q8_0, the
K-quants, ...) or float16 / bfloat16 values, :func:`heterospec.models.cpu_gemm.pack_rows`, same bits), the token embedding (and the
learned positions' table) and the rotary tables (the model's own ``rotary_emb``, so every RoPE variant it has is
the one used).  What differs: the order of each sum.  The logits agree with transformers'
forward to ~1e-5 (the tests hold them to it), as the packed matrix paths do; each row's result is computed the
same way whatever the other rows are (decoder.h), so a tree node's logits equal, bit for bit, those of a one-row
step of the same engine over the same keys.

Supported: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (q/k norms), ``phi3`` (q/k/v and gate/up fused; part of
each head rotated in Phi-4-mini; LongRoPE through its own rotary module), ``smollm3`` (its NoPE layers) and ``granite``
(Granite 3: its embeddings', residual adds' and logits' multipliers) models on the CPU in float32, bfloat16
or float16 with SiLU MLPs and RMSNorm, any bias layout, any head grouping, a sliding window where every layer slides
(Mistral, Phi-3: the engine restricts each row's columns to it) or sliding layers among full ones (Qwen2/3 with
``use_sliding_window``: those layers read the rows the engine restricts, decoder.h's local layers); ``gemma``,
``gemma2`` and ``gemma3_text`` (Gemma 1, 2 and 3, and Gemma 3's vision-language class on text: norms of 1 + w, scaled
embeddings, GeGLU with gelu's tanh form, the sandwich of norms around attention and MLP, sliding layers with their own
rotation, Gemma 2's soft-capped scores and logits); ``olmo2`` and ``olmo3`` (no norm before attention or MLP, one
after each, q and k normed over all their heads; OLMo 3's sliding layers) and ``exaone4`` (EXAONE 4: the same with q/k
norms head by head, its full layers without rotation where it has a window); ``gpt_neox`` (Pythia: LayerNorm, gelu,
rotary over part of each head, the parallel residual or not; its fused q/k/v reordered head by head when packed),
``gpt2`` (LayerNorm, gelu's tanh form, learned positions added to the embeddings, Conv1D weights read transposed),
``gpt_bigcode`` (StarCoder 1, SantaCoder: as GPT-2 on linear layers, multi-query or q/k/v fused head by head),
``opt`` (relu, learned positions two rows into their table; not OPT-350m's norms after each block and
projections), ``phi`` (one LayerNorm a layer feeding attention and MLP side by side), ``gptj`` and ``codegen`` (the
same, with the rotation of neighbouring pairs from their own sinusoid tables; CodeGen's q/k/v blocks reordered),
``stablelm`` (LayerNorms, SiLU-gated MLP, a quarter of each head rotated; not its parallel residual or q/k norms) and
``starcoder2`` (LayerNorms, gelu's tanh form, biases, its sliding window), ``cohere`` and ``cohere2`` (one LayerNorm
without bias a layer feeding attention and a SiLU-gated MLP side by side, summed from the residual; neighbouring pairs
rotated; the logits scaled; Cohere 2's sliding layers among full ones that rotate nothing; not its q/k norms);
:func:`unsupported` says why not otherwise.  A model with forward hooks of the user's on any of its
modules runs transformers' forward while they are set (the hooks then run, as they would in the user's own calls).

The EAGLE-3 draft's step and head run on the same C code (:class:`CpuDraft`, decoder.h's draft layout: its one
layer with the 2H-wide attention input, on the draft's own cache, then the output layer over the rows wanted),
where :func:`draft_unsupported` allows; the drafter takes it in ``DraftState._step_head``.
"""
from __future__ import annotations

import math
import types
import warnings
import weakref

import torch

from .. import measure
from . import cpu_gemm
from .target import sliding_layout

# (granitemoehybrid: Granite 4.0's dense models, attention layers only; the last five: mixtures of experts,
# MOE_FAMILIES)
LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "granite", "granitemoehybrid", "ministral",
                  "ernie4_5", "helium", "glm", "glm4", "hunyuan_v1_dense", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                  "granitemoe")
# Llama's layout with GPT-J's rotation of neighbouring pairs (ERNIE 4.5, Helium, GLM: their rotate_half interleaves;
# GLM-4's layers besides norm the attention's and the MLP's outputs, as Gemma 2's sandwich)
PAIR_FAMILIES = ("ernie4_5", "helium", "glm", "glm4")
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")
OLMO_FAMILIES = ("olmo2", "olmo3", "exaone4")   # (EXAONE 4: OLMo 2's layout with q/k norms per head)
FAMILIES = LLAMA_FAMILIES + GEMMA_FAMILIES + OLMO_FAMILIES + ("gpt_neox", "gpt2", "gpt_bigcode", "opt", "phi", "gptj",
                                                              "codegen", "stablelm", "starcoder2", "cohere", "cohere2")
SETTINGS = ("auto", True, False)
# the models' dtypes the decoder runs: every weight read as it is stored (16-bit values as such), every sum in float32
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISA_NAMES = ("portable", "AVX2", "AVX-512")
HSD_RESIDUAL_NORMED, HSD_HEAD_RAW, HSD_OUT_NORMED = 1, 2, 4   # decoder.h's flags
HSD_LAYERNORM, HSD_PARALLEL, HSD_SHARED_NORM, HSD_ROT_PAIRS, HSD_POST_ONLY, HSD_QK_NORM_ALL, HSD_H_FIRST = \
    1, 2, 4, 8, 16, 32, 64   # (decoder.h's arch bits)
HSD_QK_NORM_AFTER = 128   # (decoder.h's: q/k norms after the rotation, HunYuan's)
QK_NORMS = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"))   # (HunYuan's names: after the rotation)
HSD_SILU_GLU, HSD_GELU, HSD_GELU_TANH, HSD_RELU, HSD_GELU_TANH_GLU = 0, 1, 2, 3, 4   # decoder.h's act
HSD_MOE_NORM, HSD_MOE_TOPK_SOFTMAX = 1, 2   # decoder.h's moe bits
HSD_FIELD_ROUTER, HSD_FIELD_EXPERTS, HSD_FIELD_SHARED_GATE = 18, 19, 20   # decoder.h's table columns of a mixture
# transformers' activation modules (activations.py) by the form the kernel computes: gelu's erf one or its tanh one,
# relu
ACT_MODULES = {"GELUActivation": HSD_GELU, "NewGELUActivation": HSD_GELU_TANH, "GELUTanh": HSD_GELU_TANH,
               "PytorchGELUTanh": HSD_GELU_TANH, "FastGELUActivation": HSD_GELU_TANH, "ReLU": HSD_RELU}


def _text(model):
    c = model.config
    return c.get_text_config() if hasattr(c, "get_text_config") else c


def _is_rmsnorm(m):
    return m is not None and type(m).__name__.endswith("RMSNorm") and getattr(m, "weight", None) is not None \
        and hasattr(m, "variance_epsilon")


def _act_kind(act):
    """decoder.h's act for an activation module of transformers' (or torch's nn.GELU, nn.ReLU), or None."""
    if isinstance(act, torch.nn.GELU):
        return HSD_GELU_TANH if act.approximate == "tanh" else HSD_GELU
    if isinstance(act, torch.nn.ReLU):
        return HSD_RELU
    return ACT_MODULES.get(type(act).__name__)


def _silu_kind(act):
    """HSD_SILU_GLU for a SiLU module (the gate's activation of a gated MLP), else None."""
    return HSD_SILU_GLU if type(act).__name__ in ("SiLU", "SiLUActivation") else None


def _silu_only(act):
    """Why a gated MLP's activation module is refused, or None for SiLU (decoder.h's gate)."""
    return None if _silu_kind(act) is not None else f"an MLP activation {type(act).__name__} (the decoder has SiLU)"


def _acts_only(act):
    return f"an MLP activation {type(act).__name__} (the decoder has gelu, its tanh form and relu)"


def _is_layernorm(m):
    return isinstance(m, torch.nn.LayerNorm) and m.weight is not None and len(m.normalized_shape) == 1


def _plain_conv1d(m):
    """transformers' Conv1D (GPT-2's linear layers, weight [in, out]) with its own forward."""
    if type(m).__name__ != "Conv1D":
        return False
    from transformers.pytorch_utils import Conv1D

    return isinstance(m, Conv1D) and type(m).forward is Conv1D.forward


def _pair(m, transposed=False):
    """A linear layer's (weight [out, in], bias or None)."""
    return (m.weight.t() if transposed else m.weight), m.bias


class _Layout:
    """What the decoder reads of a supported model, found once: its embeddings (``pos``: learned positions, or
    None; ``pos_offset``: the table's first row), the rotation's tables (``rotary(h, positions) -> (cos, sin)``: the
    model's rotary module, or GPT-J's table lookup; None: no rotation), the final norm, the output layer, the
    layers, decoder.h's arch, act and rot, and ``parts(layer)``: a layer's weights as decoder.h packs them.  Gemma's
    besides: the embeddings' factor, the sliding layers' own rotation, the final norm's weight as read (1 + w) and
    the soft-caps; ``local`` (set by :func:`layout`): which layers slide where others do not, or None."""

    pos_offset = 0   # OPT's learned positions start at row 2 of their table
    embed_scale = local_rotary = final_weight = local = None
    attn_cap = final_cap = 0.0
    res_mult = logit_div = logit_mult = 1.0   # Granite's residual_multiplier and logits_scaling; Cohere's logit_scale
    experts = top_k = moe_inter = moe = 0     # a mixture of experts' sizes and decoder.h's moe bits (0 experts: none)

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _rms_base(model, family, norm=None, rotary=True):
    """(the base model, its layers, the output layer) of a model laid out as Llama is (model.embed_tokens, .layers,
    .norm, .rotary_emb; lm_head; ``norm(final norm)``: whether it is the family's norm, RMSNorm by default;
    ``rotary`` False: a model that may rotate nothing, rotary_emb None), or why not (naming ``family``)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    head = getattr(model, "lm_head", None)
    if layers is None or not isinstance(getattr(base, "embed_tokens", None), torch.nn.Embedding) \
            or not (norm or _is_rmsnorm)(getattr(base, "norm", None)) \
            or (rotary and getattr(base, "rotary_emb", None) is None) or not cpu_gemm.plain_linear(head):
        return f"{family} without its layout (model.embed_tokens, .layers, .norm, .rotary_emb; lm_head)"
    return base, layers, head


def _plain_blocks(att, mlp):
    """Whether a layer's attention has q/k/v/o and its MLP gate/up/down, each a plain linear layer."""
    return att is not None and mlp is not None \
        and all(cpu_gemm.plain_linear(getattr(att, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) \
        and all(cpu_gemm.plain_linear(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj"))


def _llama_layout(model, cfg):
    hybrid = cfg.model_type == "granitemoehybrid"   # (Granite 4.0: NoPE where position_embedding_type is not rope)
    got = _rms_base(model, "a model of the Llama family", rotary=not hybrid)
    if isinstance(got, str):
        return got
    base, layers, head = got
    if hybrid and any(getattr(layer, "self_attn", None) is None for layer in layers):
        return "Mamba 2 layers among its attention layers (Granite 4.0's hybrid models: transformers' forward runs " \
               "them)"
    if hybrid and getattr(cfg, "num_local_experts", 0):
        return "experts beside its shared MLP (Granite 4.0's mixtures add the shared MLP without a gate)"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {cfg.hidden_act!r} (the decoder has SiLU)"
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
        return "logit soft-capping"
    moe = _moe_layout(cfg, layers) if cfg.model_type in MOE_FAMILIES else None
    if isinstance(moe, str):
        return moe
    for layer in layers:
        att, mlp = getattr(layer, "self_attn", None), _dense_mlp(layer)
        if att is None or not all(cpu_gemm.plain_linear(getattr(att, n, None))
                                  for n in _llama_names(att, QKV_NAMES) + ("o_proj",)) \
                or (mlp is None and _moe_block(layer) is None) \
                or (mlp is not None and not all(cpu_gemm.plain_linear(getattr(mlp, n, None))
                                                for n in sum(_mlp_names(mlp), ()))):
            return "a layer without q/k/v (or qkv_proj), o and gate/up (or gate_up_proj), down linear layers"
        if not (_is_rmsnorm(getattr(layer, "input_layernorm", None))
                and _is_rmsnorm(getattr(layer, "post_attention_layernorm", None))) \
                or not all(_is_rmsnorm(getattr(layer, n)) for n in ("post_self_attn_layernorm", "post_mlp_layernorm")
                           if getattr(layer, n, None) is not None):   # (GLM-4's)
            return "a layer whose norms are not RMSNorm"
        for n in sum(QK_NORMS, ()):
            if getattr(att, n, None) is not None and not _is_rmsnorm(getattr(att, n)):
                return f"a {n} that is not RMSNorm"
        why = mlp is not None and _silu_only(getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
                                             or getattr(mlp, "activation", None))
        if why:   # (activation_fn: Phi-3's name; activation: Granite 4.0's)
            return why
    att0 = layers[0].self_attn
    dense = [m for m in map(_dense_mlp, layers) if m is not None]
    widths = {m.gate_proj.out_features if hasattr(m, "gate_proj") else getattr(m, _mlp_names(m)[0][0]).out_features // 2
              for m in dense}
    if len(widths) > 1:   # (Qwen2-MoE with dense layers besides its shared experts, of another width)
        return f"dense MLPs of different widths {sorted(widths)} (the decoder has one)"
    inter = widths.pop() if widths else moe.moe_inter
    # the rotated dimensions: the width of the model's own tables (Phi-3 / Phi-4-mini rotate part of each head)
    rotary, _, rot = _rotaries(base.rotary_emb, cfg) if base.rotary_emb is not None else (None, None, 0)
    pairs = cfg.model_type in PAIR_FAMILIES
    if pairs:   # the first half of the module's tables, each value repeated for its pair, as their rotation reads them
        rotary = _interleaved(rotary)
    got = _Layout(embed=base.embed_tokens, pos=None, rotary=rotary, final=base.norm, head=head,
                  layers=list(layers), arch=HSD_ROT_PAIRS if pairs else 0, act=HSD_SILU_GLU, rot=rot,
                  eps=float(layers[0].input_layernorm.variance_epsilon), scale=float(att0.scaling),
                  heads=cfg.num_attention_heads, kv_heads=getattr(cfg, "num_key_value_heads", None)
                  or cfg.num_attention_heads, head_dim=att0.head_dim, inter=inter, parts=_llama_parts)
    if moe is not None:
        got.__dict__.update(moe.__dict__)
    if cfg.model_type == "olmoe":   # q and k normed over all heads at once (OLMo 2's q_norm and k_norm)
        got.arch = HSD_QK_NORM_ALL
    if getattr(att0, QK_NORMS[1][0], None) is not None:   # (HunYuan: q and k normed after the rotation)
        got.arch |= HSD_QK_NORM_AFTER
    if cfg.model_type in ("granite", "granitemoe", "granitemoehybrid"):   # multipliers: the embeddings', each
        # residual add's, the logits'
        mults = {float(getattr(layer, "residual_multiplier", "nan")) for layer in layers}
        div = float(getattr(cfg, "logits_scaling", 1.0))
        if len(mults) != 1 or not all(map(math.isfinite, mults | {div})) or div == 0.0:
            return f"Granite with residual multipliers {sorted(mults)} and logits_scaling {div} (expected one " \
                   f"finite multiplier for every layer and a finite nonzero scaling)"
        got.embed_scale = torch.tensor(float(cfg.embedding_multiplier), dtype=torch.float32)
        got.res_mult, got.logit_div = mults.pop(), div
    return got


# a Llama-family layer's linear layers, apart or fused (Phi-3: qkv_proj, [q; k; v]; gate_up_proj, [gate; up]: the
# rows decoder.h packs, in its order)
QKV_NAMES, GU_NAMES = (("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")


def _llama_names(module, names):
    apart, fused = names
    return (fused,) if hasattr(module, fused) and not hasattr(module, apart[0]) else apart


def _mlp_names(mlp):
    """A Llama-family MLP's (gate/up linear layers, (down,)): gate_proj and up_proj or Phi-3's gate_up_proj, and
    down_proj; Granite 4.0's shared MLP: input_linear ([gate; up]) and output_linear."""
    if hasattr(mlp, "input_linear") and not hasattr(mlp, "gate_proj"):
        return ("input_linear",), ("output_linear",)
    return _llama_names(mlp, GU_NAMES), ("down_proj",)


def _llama_parts(layer):
    a, m, blk = layer.self_attn, _dense_mlp(layer), _moe_block(layer)
    parts = {"ln1": (layer.input_layernorm.weight, None), "ln2": (layer.post_attention_layernorm.weight, None),
             "qkv": [_pair(getattr(a, n)) for n in _llama_names(a, QKV_NAMES)], "o": [_pair(a.o_proj)],
             "gu": [] if m is None else [_pair(getattr(m, n)) for n in _mlp_names(m)[0]],
             "down": [] if m is None else [_pair(getattr(m, _mlp_names(m)[1][0]))],
             "no_rot": not getattr(a, "use_rope", True),   # (SmolLM3: every few layers rotate nothing, NoPE)
             # (HunYuan's after the rotation, HSD_QK_NORM_AFTER)
             "q_norm": getattr(getattr(a, "q_norm", None) or getattr(a, "query_layernorm", None), "weight", None),
             "k_norm": getattr(getattr(a, "k_norm", None) or getattr(a, "key_layernorm", None), "weight", None),
             # (GLM-4's norms of the attention's and the MLP's outputs)
             "post_attn": getattr(getattr(layer, "post_self_attn_layernorm", None), "weight", None),
             "post_mlp": getattr(getattr(layer, "post_mlp_layernorm", None), "weight", None)}
    if blk is not None:
        router, gu, down = _moe_weights(blk)
        gate = getattr(blk, "shared_expert_gate", None)
        parts.update(router=router, experts=[(gu[e], down[e]) for e in range(gu.shape[0])],
                     shared_gate=None if gate is None else gate.weight)
    return parts


# mixture-of-experts families: the Llama family's attention, the MLP a router and SiLU-gated experts (decoder.h's)
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe")


def _moe_block(layer):
    """A layer's mixture-of-experts block (Mixtral, Qwen2/3-MoE, OLMoE: its mlp; Granite MoE: block_sparse_moe), or
    None for a dense layer."""
    blk = getattr(layer, "block_sparse_moe", None)
    blk = getattr(layer, "mlp", None) if blk is None else blk
    return blk if hasattr(blk, "experts") or hasattr(blk, "input_linear") else None


def _dense_mlp(layer):
    """A layer's dense MLP: its mlp (Granite 4.0's shared_mlp), its mixture's shared expert (Qwen2-MoE), or None (a
    mixture without one)."""
    blk = _moe_block(layer)
    if blk is not None:
        return getattr(blk, "shared_expert", None)
    mlp = getattr(layer, "mlp", None)
    return getattr(layer, "shared_mlp", None) if mlp is None else mlp


def _moe_weights(blk):
    """(router [E, H], each expert's [gate; up] [E, 2 MI, H], down [E, H, MI]) of a mixture-of-experts block:
    transformers 5's experts as 3D parameters; Granite MoE's on transformers 5.0 (router.layer, input_linear,
    output_linear; 5.23 has the 3D parameters)."""
    router = getattr(blk, "gate", None) if hasattr(blk, "gate") else getattr(blk, "router", None)
    w = getattr(router, "weight", None)
    w = getattr(getattr(router, "layer", None), "weight", None) if w is None else w
    ex = getattr(blk, "experts", None)
    if ex is not None:
        return w, getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    return w, getattr(getattr(blk, "input_linear", None), "weight", None), \
        getattr(getattr(blk, "output_linear", None), "weight", None)


def _moe_layout(cfg, layers):
    """The mixture-of-experts fields of a MoE family's layout (experts, top_k, moe_inter, decoder.h's moe bits), or
    why the decoder cannot run its mixtures."""
    kind = cfg.model_type
    E = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    K = getattr(cfg, "num_experts_per_tok", None)
    if getattr(cfg, "clip_qkv", None) is not None:   # (OLMoE's option: q, k and v clamped)
        return f"clip_qkv {cfg.clip_qkv} (q, k and v clamped: the decoder does not clamp)"
    MI, H = None, cfg.hidden_size
    for layer in layers:
        blk = _moe_block(layer)
        if blk is None:
            continue
        router, gu, down = _moe_weights(blk)
        ex = getattr(blk, "experts", None)
        if any(getattr(ex, n, None) is not None for n in ("gate_up_proj_bias", "down_proj_bias")) \
                or getattr(ex, "has_bias", False):
            return "experts with biases"
        if router is None or gu is None or down is None or router.dim() != 2 or gu.dim() != 3 or down.dim() != 3:
            return "a mixture of experts without its router and experts' weights (gate_up_proj, down_proj)"
        MI = gu.shape[1] // 2
        if tuple(router.shape) != (E, H) or tuple(gu.shape) != (E, 2 * MI, H) or tuple(down.shape) != (E, H, MI) \
                or not isinstance(K, int) or not 1 <= K <= E:
            return f"a mixture of experts of router {tuple(router.shape)}, experts {tuple(gu.shape)} and " \
                   f"{tuple(down.shape)}, top {K} (expected {E} experts of hidden {H}, 1 <= top <= experts)"
        act = getattr(ex, "act_fn", None) or getattr(blk, "activation", None)
        why = _silu_only(act)
        if why:
            return why
        gate = getattr(blk, "shared_expert_gate", None)
        if (getattr(blk, "shared_expert", None) is None) != (gate is None) \
                or (gate is not None and (not cpu_gemm.plain_linear(gate) or gate.out_features != 1)):
            return "a shared expert without its one-output gate (or a gate without a shared expert)"
    if MI is None:
        return f"a {kind} model without a mixture of experts"
    if kind == "granitemoe":
        bits = HSD_MOE_TOPK_SOFTMAX
    else:
        bits = HSD_MOE_NORM if kind == "mixtral" or getattr(cfg, "norm_topk_prob", False) else 0
    return _Layout(experts=E, top_k=K, moe_inter=MI, moe=bits)


def _gemma_norm(m):
    """Gemma's RMSNorm (GemmaRMSNorm, Gemma2RMSNorm, Gemma3RMSNorm): x * rsqrt(mean(x^2) + eps) * (1 + weight)."""
    return type(m).__name__ in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm") \
        and getattr(m, "weight", None) is not None and isinstance(getattr(m, "eps", None), float)


def _one_plus(norm):
    """A Gemma norm's weight as decoder.h's RMSNorm reads it: 1 + weight, in float32 (as its forward computes it)."""
    return None if norm is None else 1.0 + norm.weight.detach().to(torch.float32)


def _gemma_layout(model, cfg):
    """Gemma (1), Gemma 2 and Gemma 3's text model (Gemma3ForCausalLM): RMSNorms of 1 + weight, embeddings scaled by
    their own factor, gelu's tanh form of the gate times up; Gemma 2 and 3 norm the attention's and the MLP's outputs
    too (the sandwich), slide their windows on some layers (decoder.h's local layers), and Gemma 2 soft-caps the
    attention scores and the logits; Gemma 3 norms q and k and rotates its sliding layers by their own tables.  Gemma
    3's vision-language class (Gemma3ForConditionalGeneration, what ``AutoModelForCausalLM`` gives for its larger
    checkpoints) decodes text through its language model's layers, read the same way."""
    language = getattr(getattr(model, "model", None), "language_model", None)
    outer = model if language is None else types.SimpleNamespace(model=language,
                                                                  lm_head=getattr(model, "lm_head", None))
    got = _rms_base(outer, "a Gemma model", _gemma_norm)
    if isinstance(got, str):
        return got
    base, layers, head = got
    embed = base.embed_tokens
    # the embeddings' factor: the module's own buffer (transformers >= 5.x's scaled embedding), or the forward's
    # sqrt(hidden) (Gemma 1 and 2 before it: in the model's dtype, so float32 in its float32 copy)
    scale = getattr(embed, "embed_scale", None)
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32)
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention: an embedding model)"
    sandwich = hasattr(layers[0], "pre_feedforward_layernorm")
    norms = [base.norm]
    for layer in layers:
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not _plain_blocks(att, mlp):
            return "a Gemma layer without q/k/v, o, gate, up and down linear layers"
        names = ["input_layernorm", "post_attention_layernorm"] \
            + (["pre_feedforward_layernorm", "post_feedforward_layernorm"] if sandwich else [])
        mine = [getattr(layer, n, None) for n in names] + [m for m in (getattr(att, "q_norm", None),
                                                                      getattr(att, "k_norm", None)) if m is not None]
        if not all(_gemma_norm(m) for m in mine):
            return "a Gemma layer whose norms are not Gemma's RMSNorm"
        norms += mine
        act = getattr(mlp, "act_fn", None)
        if _act_kind(act) != HSD_GELU_TANH:
            return f"a Gemma MLP activation {type(act).__name__} (the decoder has gelu's tanh form there)"
    eps = _one_eps(norms)
    if eps is None:
        return "norms of different epsilons"
    att0 = layers[0].self_attn
    rotary, local_rotary, rot = _rotaries(base.rotary_emb, cfg)
    return _Layout(embed=embed, embed_scale=scale, pos=None, rotary=rotary, local_rotary=local_rotary,
                   final=base.norm, final_weight=_one_plus(base.norm), head=head, layers=list(layers), arch=0,
                   act=HSD_GELU_TANH_GLU, rot=rot, eps=eps, scale=float(att0.scaling),
                   heads=cfg.num_attention_heads, kv_heads=getattr(cfg, "num_key_value_heads", None)
                   or cfg.num_attention_heads, head_dim=att0.head_dim, inter=layers[0].mlp.gate_proj.out_features,
                   attn_cap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
                   final_cap=float(getattr(cfg, "final_logit_softcapping", None) or 0.0),
                   parts=lambda layer: _gemma_parts(layer, sandwich))


def _parameters(fn):
    import inspect

    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _typed_rotary(rotary, kind):
    """A rotary module with a table per layer type (Gemma 3, OLMo 3), for one type, as decoder.h's tables:
    (h, positions) -> (cos, sin)."""
    def tables(h, positions):
        return rotary(h, positions, kind)

    return tables


def _rotaries(module, cfg):
    """(the full layers' rotation, the sliding layers' own or None, the rotated width) of a model's rotary module:
    one table for every layer, or one per layer type (Gemma 3, OLMo 3: a ``layer_type`` argument)."""
    rotary, local = module, None
    if "layer_type" in _parameters(module.forward):
        kinds = sorted(set(getattr(cfg, "layer_types", None) or ()))
        rotary = _typed_rotary(module, "full_attention" if "full_attention" in kinds or not kinds else kinds[0])
        if "sliding_attention" in kinds:
            local = _typed_rotary(module, "sliding_attention")
    with torch.no_grad():
        rot = rotary(torch.zeros(1, 1, cfg.hidden_size, device="cpu"),   # (never the default device)
                     torch.zeros(1, 1, dtype=torch.long, device="cpu"))[0].shape[-1]
    return rotary, local, rot


def _olmo_layout(model, cfg):
    """OLMo 2 and 3: no norm before attention or MLP, a norm of each one's output before its residual add (decoder.h's
    HSD_POST_ONLY with the post norms), q_norm and k_norm over all heads of q and of k at once (HSD_QK_NORM_ALL);
    OLMo 3's sliding layers among full ones with their own rotation.  EXAONE 4: the same layout with q_norm and k_norm
    head by head; where it has a window, its sliding layers among full ones that rotate nothing (NoPE)."""
    exaone = cfg.model_type == "exaone4"
    family = "an EXAONE 4" if exaone else "an OLMo"
    got = _rms_base(model, f"{family} model")
    if isinstance(got, str):
        return got
    base, layers, head = got
    norms = [base.norm]
    for layer in layers:
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not _plain_blocks(att, mlp):
            return f"{family} layer without q/k/v, o, gate, up and down linear layers"
        mine = [getattr(layer, "post_attention_layernorm", None), getattr(layer, "post_feedforward_layernorm", None),
                getattr(att, "q_norm", None), getattr(att, "k_norm", None)]
        if getattr(layer, "input_layernorm", None) is not None or not all(_is_rmsnorm(m) for m in mine):
            return f"{family} layer whose norms are not OLMo 2's (RMSNorms after attention and MLP, on q and k)"
        norms += mine
        why = _silu_only(getattr(mlp, "act_fn", None))
        if why:
            return why
    eps = _one_eps(norms, "variance_epsilon")
    if eps is None:
        return "norms of different epsilons"
    att0 = layers[0].self_attn
    rotary, local_rotary, rot = _rotaries(base.rotary_emb, cfg)

    def parts(layer):
        a, m = layer.self_attn, layer.mlp
        return {"qkv": [_pair(a.q_proj), _pair(a.k_proj), _pair(a.v_proj)], "o": [_pair(a.o_proj)],
                "gu": [_pair(m.gate_proj), _pair(m.up_proj)], "down": [_pair(m.down_proj)],
                "ln1": (None, None), "ln2": (None, None), "q_norm": a.q_norm.weight, "k_norm": a.k_norm.weight,
                "post_attn": layer.post_attention_layernorm.weight, "post_mlp": layer.post_feedforward_layernorm.weight,
                # (EXAONE 4 with a window: its full layers rotate nothing, as its attention rotates only where it
                # slides or where the model has no window)
                "no_rot": exaone and a.sliding_window is not None and not a.is_sliding}

    return _Layout(embed=base.embed_tokens, pos=None, rotary=rotary, local_rotary=local_rotary, final=base.norm,
                   head=head, layers=list(layers), arch=HSD_POST_ONLY | (0 if exaone else HSD_QK_NORM_ALL),
                   act=HSD_SILU_GLU, rot=rot,
                   eps=eps, scale=float(att0.scaling), heads=cfg.num_attention_heads,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                   head_dim=att0.head_dim, inter=layers[0].mlp.gate_proj.out_features, parts=parts)


def _gemma_parts(layer, sandwich):
    a, m = layer.self_attn, layer.mlp
    parts = {"qkv": [_pair(a.q_proj), _pair(a.k_proj), _pair(a.v_proj)], "o": [_pair(a.o_proj)],
             "gu": [_pair(m.gate_proj), _pair(m.up_proj)], "down": [_pair(m.down_proj)],
             "ln1": (_one_plus(layer.input_layernorm), None),
             "q_norm": _one_plus(getattr(a, "q_norm", None)), "k_norm": _one_plus(getattr(a, "k_norm", None))}
    if sandwich:   # (Gemma 2 and 3: post_attention_layernorm norms the attention's output)
        parts.update(ln2=(_one_plus(layer.pre_feedforward_layernorm), None),
                     post_attn=_one_plus(layer.post_attention_layernorm),
                     post_mlp=_one_plus(layer.post_feedforward_layernorm))
    else:
        parts["ln2"] = (_one_plus(layer.post_attention_layernorm), None)
    return parts


def _one_eps(norms, attr="eps"):
    """The one epsilon (``attr``: its attribute's name) of these norms, or None where they differ (decoder.h takes
    one per model)."""
    eps = {float(getattr(n, attr)) for n in norms}
    return eps.pop() if len(eps) == 1 else None


def _missing(family, where, layers, head, embeds=(), norms=(), present=()):
    """Why a family's model lacks what the decoder reads beside its layers' insides (``where`` names it), or None:
    a layer list, ``head`` a plain linear layer, ``embeds`` embeddings, ``norms`` LayerNorms, ``present`` not None."""
    if layers is None or not cpu_gemm.plain_linear(head) or not all(isinstance(e, torch.nn.Embedding) for e in embeds) \
            or not all(_is_layernorm(n) for n in norms) or any(m is None for m in present):
        return f"{family} without its layout ({where})"
    return None


def _checked(family, layers, final, get, gated=False):
    """The checks every LayerNorm family shares: ``get(layer)`` -> (ln1, ln2, its linear layers, the MLP's activation
    module, the linear layers' check); each linear layer plain, each norm a LayerNorm, one known activation (``gated``:
    SiLU, the gate's; else gelu, its tanh form or relu) and one epsilon for all.  Returns (eps, act) or why not."""
    kind_of, why = (_silu_kind, _silu_only) if gated else (_act_kind, _acts_only)
    norms, acts = [final], set()
    for layer in layers:
        try:
            ln1, ln2, lins, act, plain = get(layer)
        except AttributeError as e:
            return f"a {family} layer without its usual modules ({e})"
        if not all(plain(lin) for lin in lins):
            return f"a {family} layer whose linear layers are not transformers' own"
        if not (_is_layernorm(ln1) and _is_layernorm(ln2)):
            return f"a {family} layer whose norms are not LayerNorm"
        norms += [ln1, ln2]
        got = kind_of(act)
        if got is None:
            return why(act)
        acts.add(got)
    if len(acts) != 1:
        return "layers of different MLP activations"
    eps = _one_eps(norms)
    return "LayerNorms of different epsilons" if eps is None else (eps, acts.pop())


def _heads_qkv(w, b, heads, D):
    """A fused q/k/v that transformers views as [heads, 3 * D] (q, k and v of each head side by side: GPT-NeoX,
    GPTBigCode without multi-query) as decoder.h's [q of every head; k of every head; v of every head]: the same
    rows in another order."""
    H = w.shape[1]
    w = w.view(heads, 3, D, H).transpose(0, 1).reshape(3 * heads * D, H)
    return w, (None if b is None else b.view(heads, 3, D).transpose(0, 1).reshape(-1))


def _neox_layout(model, cfg):
    base = getattr(model, "gpt_neox", None)
    layers = getattr(base, "layers", None)
    head = model.get_output_embeddings()
    why = _missing("GPT-NeoX", "gpt_neox.embed_in, .layers, .final_layer_norm, .rotary_emb; the output layer",
                   layers, head, [getattr(base, "embed_in", None)], [getattr(base, "final_layer_norm", None)],
                   [getattr(base, "rotary_emb", None)])
    if why:
        return why
    got = _checked("GPT-NeoX", layers, base.final_layer_norm, lambda L: (
        L.input_layernorm, L.post_attention_layernorm, [L.attention.query_key_value, L.attention.dense,
                                                       L.mlp.dense_h_to_4h, L.mlp.dense_4h_to_h], L.mlp.act,
        cpu_gemm.plain_linear))
    if isinstance(got, str):
        return got
    if any(layer.use_parallel_residual != layers[0].use_parallel_residual for layer in layers):
        return "layers that differ in their residual (parallel or not)"
    att0 = layers[0].attention
    D = att0.head_size
    if att0.rotary_ndims % 2 or not 0 < att0.rotary_ndims <= D:
        return f"a rotary width of {att0.rotary_ndims} of {D} head dimensions (expected even, > 0)"
    heads = cfg.num_attention_heads

    def parts(layer):
        a, m = layer.attention, layer.mlp
        return {"ln1": _pair(layer.input_layernorm), "ln2": _pair(layer.post_attention_layernorm),
                "qkv": [_heads_qkv(a.query_key_value.weight, a.query_key_value.bias, heads, D)],
                "o": [_pair(a.dense)], "gu": [_pair(m.dense_h_to_4h)], "down": [_pair(m.dense_4h_to_h)],
                "q_norm": None, "k_norm": None}

    return _Layout(embed=base.embed_in, pos=None, rotary=base.rotary_emb, final=base.final_layer_norm, head=head,
                   layers=list(layers), arch=HSD_LAYERNORM | (HSD_PARALLEL if layers[0].use_parallel_residual else 0),
                   act=got[1], rot=att0.rotary_ndims, eps=got[0], scale=float(att0.scaling), heads=heads,
                   kv_heads=heads, head_dim=D, inter=layers[0].mlp.dense_h_to_4h.out_features, parts=parts)


def _learned_layout(model, cfg, family, conv):
    """GPT-2 (``conv``: Conv1D weights, [in, out]) and GPTBigCode (linear layers; multi-query or q/k/v side by side
    per head): transformer.wte + .wpe, .h, .ln_f, sequential LayerNorm layers."""
    base = getattr(model, "transformer", None)
    layers = getattr(base, "h", None)
    head = model.get_output_embeddings()
    why = _missing(family, "transformer.wte, .wpe, .h, .ln_f; lm_head", layers, head,
                   [getattr(base, "wte", None), getattr(base, "wpe", None)], [getattr(base, "ln_f", None)])
    if why:
        return why
    if getattr(cfg, "add_cross_attention", False) or getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        return f"{family} with cross-attention or a scale per layer (scale_attn_by_inverse_layer_idx)"
    got = _checked(family, layers, base.ln_f, lambda L: (
        L.ln_1, L.ln_2, [L.attn.c_attn, L.attn.c_proj, L.mlp.c_fc, L.mlp.c_proj], L.mlp.act,
        _plain_conv1d if conv else cpu_gemm.plain_linear))
    if isinstance(got, str):
        return got
    att0 = layers[0].attn
    heads = att0.num_heads
    D = att0.head_dim
    kv = 1 if getattr(att0, "multi_query", False) else heads
    scale = getattr(att0, "scaling", None)   # (GPT-2 on transformers < 5.23 has none: 1 / sqrt(head_dim) where scaled)
    if scale is None:
        if not getattr(cfg, "scale_attn_weights", True):
            return f"{family} with unscaled attention on a transformers release without the attention's scaling"
        scale = D ** -0.5

    def parts(layer):
        a, m = layer.attn, layer.mlp
        if conv or kv == 1:   # GPT-2's [q; k; v] (read transposed); multi-query's [q; the one k; the one v]
            qkv = _pair(a.c_attn, conv)
        else:
            qkv = _heads_qkv(a.c_attn.weight, a.c_attn.bias, heads, D)
        return {"ln1": _pair(layer.ln_1), "ln2": _pair(layer.ln_2), "qkv": [qkv], "o": [_pair(a.c_proj, conv)],
                "gu": [_pair(m.c_fc, conv)], "down": [_pair(m.c_proj, conv)], "q_norm": None, "k_norm": None}

    inter = layers[0].mlp.c_fc.nf if conv else layers[0].mlp.c_fc.out_features
    return _Layout(embed=base.wte, pos=base.wpe, rotary=None, final=base.ln_f, head=head, layers=list(layers),
                   arch=HSD_LAYERNORM, act=got[1], rot=0, eps=got[0], scale=float(scale), heads=heads, kv_heads=kv,
                   head_dim=D, inter=inter, parts=parts)


def _opt_layout(model, cfg):
    """OPT with its norms before each block and no projections in or out (every size but 350m)."""
    base = getattr(getattr(model, "model", None), "decoder", None)
    layers = getattr(base, "layers", None)
    head = model.get_output_embeddings()
    why = _missing("OPT", "model.decoder.embed_tokens, .embed_positions, .layers; lm_head", layers, head,
                   [getattr(base, "embed_tokens", None), getattr(base, "embed_positions", None)])
    if why:
        return why
    if getattr(base, "project_in", None) is not None or getattr(base, "project_out", None) is not None \
            or not _is_layernorm(getattr(base, "final_layer_norm", None)) \
            or not all(getattr(layer, "do_layer_norm_before", False) for layer in layers):
        return "OPT with its norms after each block or a projection in and out (OPT-350m's layout)"
    got = _checked("OPT", layers, base.final_layer_norm, lambda L: (
        L.self_attn_layer_norm, L.final_layer_norm, [L.self_attn.q_proj, L.self_attn.k_proj, L.self_attn.v_proj,
                                                     L.self_attn.out_proj, L.fc1, L.fc2], L.activation_fn,
        cpu_gemm.plain_linear))
    if isinstance(got, str):
        return got
    att0 = layers[0].self_attn

    def parts(layer):
        a = layer.self_attn
        return {"ln1": _pair(layer.self_attn_layer_norm), "ln2": _pair(layer.final_layer_norm),
                "qkv": [_pair(a.q_proj), _pair(a.k_proj), _pair(a.v_proj)], "o": [_pair(a.out_proj)],
                "gu": [_pair(layer.fc1)], "down": [_pair(layer.fc2)], "q_norm": None, "k_norm": None}

    return _Layout(embed=base.embed_tokens, pos=base.embed_positions,
                   pos_offset=int(getattr(base.embed_positions, "offset", 0)), rotary=None, final=base.final_layer_norm,
                   head=head, layers=list(layers), arch=HSD_LAYERNORM, act=got[1], rot=0, eps=got[0],
                   scale=float(att0.scaling), heads=cfg.num_attention_heads, kv_heads=cfg.num_attention_heads,
                   head_dim=att0.head_dim, inter=layers[0].fc1.out_features, parts=parts)


def _phi_layout(model, cfg):
    """Phi (1, 1.5, 2): one LayerNorm a layer feeding attention and MLP side by side, rotary over part of a head."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    head = model.get_output_embeddings()
    why = _missing("Phi", "model.embed_tokens, .layers, .final_layernorm, .rotary_emb; lm_head", layers, head,
                   [getattr(base, "embed_tokens", None)], [getattr(base, "final_layernorm", None)],
                   [getattr(base, "rotary_emb", None)])
    if why:
        return why
    if getattr(cfg, "qk_layernorm", False):
        return "Phi with LayerNorms on its queries and keys (qk_layernorm)"
    got = _checked("Phi", layers, base.final_layernorm, lambda L: (
        L.input_layernorm, L.input_layernorm, [L.self_attn.q_proj, L.self_attn.k_proj, L.self_attn.v_proj,
                                               L.self_attn.dense, L.mlp.fc1, L.mlp.fc2], L.mlp.activation_fn,
        cpu_gemm.plain_linear))
    if isinstance(got, str):
        return got
    att0 = layers[0].self_attn
    D, rot = att0.head_dim, att0.rotary_ndims
    if rot % 2 or not 0 < rot <= D:
        return f"a rotary width of {rot} of {D} head dimensions (expected even, > 0)"

    def parts(layer):
        a = layer.self_attn
        return {"ln1": _pair(layer.input_layernorm), "ln2": (None, None),
                "qkv": [_pair(a.q_proj), _pair(a.k_proj), _pair(a.v_proj)], "o": [_pair(a.dense)],
                "gu": [_pair(layer.mlp.fc1)], "down": [_pair(layer.mlp.fc2)], "q_norm": None, "k_norm": None}

    return _Layout(embed=base.embed_tokens, pos=None, rotary=base.rotary_emb, final=base.final_layernorm, head=head,
                   layers=list(layers), arch=HSD_LAYERNORM | HSD_PARALLEL | HSD_SHARED_NORM, act=got[1], rot=rot,
                   eps=got[0], scale=float(att0.scaling), heads=cfg.num_attention_heads,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim=D,
                   inter=layers[0].mlp.fc1.out_features, parts=parts)


def _interleaved(rotary):
    """A rotary module's tables (cos, sin [B, n, 2f]: the f frequencies twice) as ERNIE 4.5, Helium and GLM rotate
    neighbouring pairs with them: the first f values, each repeated for its pair."""
    def tables(h, positions):
        cos, sin = rotary(h, positions)
        f = cos.shape[-1] // 2
        return cos[..., :f].repeat_interleave(2, -1), sin[..., :f].repeat_interleave(2, -1)

    return tables


def _pair_tables(owner):
    """GPT-J's and CodeGen's rotation tables from the model's own sinusoid buffer (``embed_positions``: sin then cos
    for each position; the attention's before transformers 5.25, the base model's ``rotary_emb`` since): (cos, sin)
    [B, n, rotary_dim], each value repeated for its pair of dimensions, as their apply_rotary_pos_emb repeats them."""
    def tables(h, positions):
        sincos = owner.embed_positions[positions].to(h.dtype)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)

    return tables


def _gptj_layout(model, cfg, family):
    """GPT-J and CodeGen: transformer.wte, .h, .ln_f; one LayerNorm a layer (ln_1) feeding attention and MLP side by
    side, the rotation of neighbouring pairs over rotary_dim dimensions; CodeGen's q/k/v one matrix of its own
    order (four blocks of q, v, k)."""
    base = getattr(model, "transformer", None)
    layers = getattr(base, "h", None)
    head = model.get_output_embeddings()
    why = _missing(family, "transformer.wte, .h, .ln_f; lm_head", layers, head, [getattr(base, "wte", None)],
                   [getattr(base, "ln_f", None)])
    if why:
        return why
    codegen = family == "CodeGen"
    got = _checked(family, layers, base.ln_f, lambda L: (
        L.ln_1, L.ln_1, ([L.attn.qkv_proj] if codegen else [L.attn.q_proj, L.attn.k_proj, L.attn.v_proj])
        + [L.attn.out_proj, L.mlp.fc_in, L.mlp.fc_out], L.mlp.act, cpu_gemm.plain_linear))
    if isinstance(got, str):
        return got
    att0 = layers[0].attn
    heads = cfg.num_attention_heads
    D = cfg.hidden_size // heads
    rot = getattr(att0, "rotary_dim", None)
    if rot is None or rot % 2 or not 0 < rot <= D:
        return f"a rotary_dim of {rot} with {D} head dimensions (expected even, > 0)"
    if codegen and (heads % 4 or att0.qkv_proj.bias is not None):
        return f"CodeGen with {heads} heads or a bias on its q/k/v (expected 4 blocks of heads, no bias)"

    def parts(layer):
        a = layer.attn
        if codegen:   # rows [4 blocks][q, v, k][heads / 4][D] -> [q; k; v], heads in the same order
            w = a.qkv_proj.weight.view(4, 3, heads // 4, D, -1)[:, [0, 2, 1]].transpose(0, 1)
            qkv = [(w.reshape(3 * heads * D, -1), None)]
        else:
            qkv = [_pair(a.q_proj), _pair(a.k_proj), _pair(a.v_proj)]
        return {"ln1": _pair(layer.ln_1), "ln2": (None, None), "qkv": qkv, "o": [_pair(a.out_proj)],
                "gu": [_pair(layer.mlp.fc_in)], "down": [_pair(layer.mlp.fc_out)], "q_norm": None, "k_norm": None}

    owner = getattr(base, "rotary_emb", None)
    owner = owner if isinstance(getattr(owner, "embed_positions", None), torch.Tensor) else att0
    if not isinstance(getattr(owner, "embed_positions", None), torch.Tensor):
        return f"a {family} model without its sinusoid table (embed_positions)"
    return _Layout(embed=base.wte, pos=None, rotary=_pair_tables(owner), final=base.ln_f, head=head,
                   layers=list(layers), arch=HSD_LAYERNORM | HSD_PARALLEL | HSD_SHARED_NORM | HSD_ROT_PAIRS,
                   act=got[1], rot=rot, eps=got[0], scale=float(D ** -0.5), heads=heads, kv_heads=heads, head_dim=D,
                   inter=layers[0].mlp.fc_in.out_features, parts=parts)


def _ln_names_layout(model, cfg, family, gated):
    """StableLM (``gated``: SiLU of the gate times up; q/k/v biases where the config has them) and StarCoder2 (one
    matrix c_fc before gelu's tanh form, c_proj; biases): Llama's names (model.embed_tokens, .layers, .norm,
    .rotary_emb; lm_head) with LayerNorms, sequential residuals, the rotation over the first dimensions its tables
    cover (StableLM: a quarter of each head)."""
    got = _rms_base(model, family, _is_layernorm)
    if isinstance(got, str):
        return got
    base, layers, head = got
    if getattr(cfg, "qk_layernorm", False):
        return f"{family} with LayerNorms on its queries and keys (qk_layernorm)"
    if getattr(cfg, "use_parallel_residual", False):   # (its sum, (h + attention) + mlp, is not decoder.h's order)
        return f"{family} with the parallel residual (use_parallel_residual)"
    mlp_names = ("gate_proj", "up_proj", "down_proj") if gated else ("c_fc", "c_proj")
    got = _checked(family, layers, base.norm, lambda L: (
        L.input_layernorm, L.post_attention_layernorm, [L.self_attn.q_proj, L.self_attn.k_proj, L.self_attn.v_proj,
                                                        L.self_attn.o_proj] + [getattr(L.mlp, n) for n in mlp_names],
        L.mlp.act_fn if gated else L.mlp.act, cpu_gemm.plain_linear), gated)
    if isinstance(got, str):
        return got
    att0 = layers[0].self_attn
    rotary, _, rot = _rotaries(base.rotary_emb, cfg)

    def parts(layer):
        a, m = layer.self_attn, layer.mlp
        return {"ln1": _pair(layer.input_layernorm), "ln2": _pair(layer.post_attention_layernorm),
                "qkv": [_pair(a.q_proj), _pair(a.k_proj), _pair(a.v_proj)], "o": [_pair(a.o_proj)],
                "gu": [_pair(m.gate_proj), _pair(m.up_proj)] if gated else [_pair(m.c_fc)],
                "down": [_pair(m.down_proj if gated else m.c_proj)], "q_norm": None, "k_norm": None}

    return _Layout(embed=base.embed_tokens, pos=None, rotary=rotary, final=base.norm, head=head, layers=list(layers),
                   arch=HSD_LAYERNORM, act=got[1], rot=rot, eps=got[0], scale=float(att0.scaling),
                   heads=cfg.num_attention_heads, kv_heads=getattr(cfg, "num_key_value_heads", None)
                   or cfg.num_attention_heads, head_dim=att0.head_dim,
                   inter=(layers[0].mlp.gate_proj if gated else layers[0].mlp.c_fc).out_features, parts=parts)


def _cohere_norm(m):
    """Cohere's LayerNorm (CohereLayerNorm, Cohere2LayerNorm): x - mean over the row, times rsqrt(variance + eps),
    times its weight; no bias."""
    return type(m).__name__ in ("CohereLayerNorm", "Cohere2LayerNorm") and getattr(m, "weight", None) is not None \
        and m.weight.dim() == 1 and isinstance(getattr(m, "variance_epsilon", None), float)


def _cohere_layout(model, cfg):
    """Cohere (Command R, Aya) and Cohere 2 (Command R7B, Aya Expanse's successors): one LayerNorm without bias a
    layer feeding attention and a SiLU-gated MLP side by side, summed from the residual, (h + attention) + mlp
    (HSD_H_FIRST); the rotation of neighbouring pairs (its tables repeat each value for its pair); the logits times
    logit_scale.  Cohere 2: sliding layers among full ones, the full ones without rotation (NoPE)."""
    got = _rms_base(model, "a Cohere model", _cohere_norm)
    if isinstance(got, str):
        return got
    base, layers, head = got
    if getattr(cfg, "use_qk_norm", False):
        return "Cohere with norms on its queries and keys (use_qk_norm)"
    norms = [base.norm]
    for layer in layers:
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not _plain_blocks(att, mlp):
            return "a Cohere layer without q/k/v, o, gate, up and down linear layers"
        if not _cohere_norm(getattr(layer, "input_layernorm", None)):
            return "a Cohere layer whose norm is not Cohere's LayerNorm"
        norms.append(layer.input_layernorm)
        why = _silu_only(getattr(mlp, "act_fn", None))
        if why:
            return why
    eps = _one_eps(norms, "variance_epsilon")
    if eps is None:
        return "norms of different epsilons"
    scale = float(getattr(cfg, "logit_scale", 1.0))
    if not math.isfinite(scale):
        return f"Cohere with logit_scale {scale} (expected finite)"
    att0 = layers[0].self_attn
    rotary, _, rot = _rotaries(base.rotary_emb, cfg)
    types = getattr(cfg, "layer_types", None)

    def parts(layer):
        a, m = layer.self_attn, layer.mlp
        # (Cohere 2's full layers rotate nothing: its attention rotates where it slides)
        nope = types is not None and getattr(a, "sliding_window", 0) is None
        return {"ln1": (layer.input_layernorm.weight, None), "ln2": (None, None),
                "qkv": [_pair(a.q_proj), _pair(a.k_proj), _pair(a.v_proj)], "o": [_pair(a.o_proj)],
                "gu": [_pair(m.gate_proj), _pair(m.up_proj)], "down": [_pair(m.down_proj)],
                "q_norm": None, "k_norm": None, "no_rot": nope}

    return _Layout(embed=base.embed_tokens, pos=None, rotary=rotary, final=base.norm, head=head, layers=list(layers),
                   arch=HSD_LAYERNORM | HSD_PARALLEL | HSD_SHARED_NORM | HSD_ROT_PAIRS | HSD_H_FIRST,
                   act=HSD_SILU_GLU, rot=rot, eps=eps, scale=float(att0.scaling), heads=cfg.num_attention_heads,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                   head_dim=att0.head_dim, inter=layers[0].mlp.gate_proj.out_features, logit_mult=scale, parts=parts)


LAYOUTS = {**{k: _llama_layout for k in LLAMA_FAMILIES}, **{k: _gemma_layout for k in GEMMA_FAMILIES},
           **{k: _olmo_layout for k in OLMO_FAMILIES},
           "gpt_neox": _neox_layout,
           "gpt2": lambda model, cfg: _learned_layout(model, cfg, "GPT-2", conv=True),
           "gpt_bigcode": lambda model, cfg: _learned_layout(model, cfg, "GPTBigCode", conv=False), "opt": _opt_layout,
           "phi": _phi_layout, "gptj": lambda model, cfg: _gptj_layout(model, cfg, "GPT-J"),
           "codegen": lambda model, cfg: _gptj_layout(model, cfg, "CodeGen"),
           "stablelm": lambda model, cfg: _ln_names_layout(model, cfg, "StableLM", gated=True),
           "starcoder2": lambda model, cfg: _ln_names_layout(model, cfg, "StarCoder2", gated=False),
           "cohere": _cohere_layout, "cohere2": _cohere_layout}


def layout(model):
    """The :class:`_Layout` the decoder reads of ``model``, or why it cannot (a short phrase)."""
    if not cpu_gemm.rows_available():
        return "heterospec's kernel extension (heterospec._gemm) is not built in this install"
    cfg = _text(model)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"a {kind!r} model (supported: {', '.join(FAMILIES)})"
    try:
        sliding = sliding_layout(model.config)
    except ValueError as e:
        return str(e).removeprefix("target: ")
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype not in DTYPES:
        return f"a {getattr(p, 'device', None)} {str(getattr(p, 'dtype', None)).replace('torch.', '')} model " \
               f"(the decoder runs float32, bfloat16 or float16 models on the CPU)"
    if any(q.dtype not in DTYPES or q.device.type != "cpu" for q in model.parameters()):
        return "parameters on other devices or of other dtypes than float32, bfloat16 and float16"
    got = LAYOUTS[kind](model, cfg)
    if isinstance(got, str):
        return got
    if len(got.layers) != cfg.num_hidden_layers:
        return "a layer count other than the config's"
    if sliding is not None and sliding[1]:   # sliding and full layers: decoder.h's local layers are the sliding ones
        got.local = [t == "sliding_attention" for t in cfg.layer_types[:len(got.layers)]]
    return got


def unsupported(model):
    """Why the decoder cannot run ``model``'s forward (a short phrase), or None when it can."""
    got = layout(model)
    return got if isinstance(got, str) else None


class _Packed:
    """What the target's decoder and the draft's layer share: a module held weakly, its weights packed once into
    the kernel's panels (repacked when a weight was written since), the user's-hooks rule and the one call of
    decoder.h.  A subclass says what it packs (:meth:`_layer_parts`, :meth:`_head`), its layout (``arch``, ``act``,
    ``rot``: decoder.h's) and why a module is not supported (:meth:`_why`)."""

    arch, act = 0, HSD_SILU_GLU
    attn_cap = final_cap = 0.0
    res_mult = logit_div = logit_mult = 1.0   # Granite's residual_multiplier and logits_scaling, Cohere's logit_scale
    experts = top_k = moe_inter = moe = 0     # a mixture of experts' sizes and decoder.h's moe bits (0 experts: none)
    local = None   # [layers] bool: decoder.h's HSD_LOCAL layers (the target's sliding ones among full ones), or None
    _final_weight = None   # the final norm's weight as decoder.h reads it where not its own (Gemma: 1 + w)

    def __init__(self, module):
        why = self._why(module)
        if why is not None:
            raise ValueError(f"HeteroSpec: argument 'cpu_decoder' expected a supported CPU model, got {why}")
        self._model = weakref.ref(module)
        self._g = cpu_gemm._rows_module()
        self.isa = self._g.isa_best()
        self._params = list(module.parameters())
        # the submodules' hook tables (the module's own only through the weak reference): fixed objects that
        # register_forward_hook and a handle's remove() change in place
        self._hook_dicts = [d for m in list(module.modules())[1:] for d in (m._forward_hooks, m._forward_pre_hooks)]
        self._versions = None

    def hooked(self):
        """Whether forward hooks other than the engine's own taps are set on the module (or globally): the user's
        hooks run only on torch's forward, so the caller takes that forward while there are any."""
        from torch.nn.modules import module as tm

        if tm._global_forward_hooks or tm._global_forward_pre_hooks:
            return True
        model = self.model
        dicts = (model._forward_hooks, model._forward_pre_hooks, *self._hook_dicts)
        return any(not all(getattr(h, "heterospec_tap", False) for h in hooks.values())
                   for hooks in filter(None, dicts))

    def usable(self):
        """Whether our forward runs the module now: no user's hook is set (:meth:`hooked`), and the packed copies
        are current (repacked when a weight was written since; ValueError when the module is now unsupported).
        The engine asks once per call, when the call's prompts are prefilled, and then passes ``current=True``
        to each forward: walking every parameter and module before each of a cycle's forwards cost 5-7 % of a
        one-token step on a 2-core CPU.  A hook set or a weight written while a call runs (from a streamer's
        callback) takes effect from the next call."""
        if self.hooked():
            return False
        self._fresh()
        return True

    def runs(self, asked):
        """Whether our forward runs the module for a forward of a call: ``asked`` (:meth:`usable`'s answer at the
        call's start), or, before any call asked (None), whether no user's hook is set now; such a forward then
        checks the weights itself (``current=False``)."""
        return asked if asked is not None else not self.hooked()

    @property
    def model(self):
        """The module (None once the user dropped it)."""
        return self._model()

    def _state(self):
        return [(p.data_ptr(), p._version) for p in self._params]

    @torch.no_grad()
    def _pack(self):
        """The packed copies and the address table (decoder.h's fields per layer)."""
        keep = []   # every tensor an address in the table points into
        codecs = {}   # packed copies per codec (rows.h: F32, or a GGUF checkpoint's Q8 / Q4 codes)

        def addr(t):
            if t is None:
                return 0
            t = t.detach()
            if t.dtype in cpu_gemm.HALF_CODECS:   # a half model's norms and biases: their float32 values
                t = t.to(torch.float32)
            t = t.contiguous()
            keep.append(t)
            return t.data_ptr()

        def fused(pairs):
            """(weight [out, in], bias or None) pairs as one packed matrix and its bias (zeros where one has none);
            (0, 0) for none."""
            if not pairs:
                return 0, 0
            w = cpu_gemm.pack_rows(torch.cat([w.detach() for w, _ in pairs]))
            codec = cpu_gemm.packed_codec(w)
            codecs[codec] = codecs.get(codec, 0) + 1
            b = None
            if any(b is not None for _, b in pairs):
                b = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in pairs])
            return addr(w), addr(b)

        def experts(pairs):
            """A mixture's experts ([gate; up], down) as decoder.h's table: int64 [E, 2] of their packed copies."""
            return torch.tensor([[fused([(gu, None)])[0], fused([(down, None)])[0]] for gu, down in pairs],
                                dtype=torch.int64)

        rows = []
        for P in self._layer_parts():
            qkv, qkv_b = fused(P["qkv"])
            o, o_b = fused(P["o"])
            gu, gu_b = fused(P["gu"])
            down, down_b = fused(P["down"])
            rows.append([addr(P["ln1"][0]), addr(P["ln2"][0]), qkv, qkv_b, addr(P["q_norm"]), addr(P["k_norm"]),
                         o, o_b, gu, gu_b, down, down_b, addr(P["ln1"][1]), addr(P["ln2"][1]),
                         int(bool(P.get("no_rot"))),   # (HSD_NO_ROT, a flag)
                         addr(P.get("post_attn")), addr(P.get("post_mlp")),
                         int(bool(self.local and self.local[len(rows)])),   # (HSD_LOCAL, a flag)
                         fused([(P["router"], None)])[0] if P.get("router") is not None else 0,
                         addr(experts(P["experts"])) if P.get("experts") else 0,
                         fused([(P["shared_gate"], None)])[0] if P.get("shared_gate") is not None else 0])
        self._table = torch.tensor(rows, dtype=torch.int64, device="cpu")
        final, head, hidden_norm, flags = self._head()
        final_w = self._final_weight
        head, head_b = fused([_pair(head)])
        fc, in_norm, fc_norms = self._fusion()
        fc_w, fc_b = fused([_pair(fc)]) if fc is not None else (0, 0)
        self._desc = (len(rows), self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self.vocab,
                      self._table.data_ptr(), addr(final.weight if final_w is None else final_w), head, head_b,
                      addr(None if hidden_norm is None else hidden_norm.weight), flags,
                      fc_w, fc_b, 0 if fc is None else fc.in_features, addr(in_norm),
                      addr(None if fc_norms is None else torch.cat(fc_norms)), addr(getattr(final, "bias", None)),
                      self.arch, self.act, self.rot, self.attn_cap, self.final_cap, self.res_mult, self.logit_div,
                      self.logit_mult, self.experts, self.top_k, self.moe_inter, self.moe)
        self._keep = keep
        self.codecs = codecs
        self._versions = self._state()

    def _fresh(self):
        """Repack when a weight was written since (in place, or replaced); a module now unsupported is an error."""
        if self._state() != self._versions:
            why = self._why(self.model)
            if why is not None:
                raise ValueError(f"cpu_decoder: the model changed since the engine was made and is now {why}; make a "
                                 f"new HeteroSpec for it")
            self._pack()

    def _fusion(self):
        """The draft's fusion of the target's taps: (fc, the norm over the whole row or None, the three norm weights
        of its thirds or None); (None, None, None) for a model without one."""
        return None, None, None

    def _run(self, h, emb, cos, sin, B, n, slots, allowed, cache, out_rows, k, taps=None, hout=False, bad=None,
             nreal=None, fuse=None, local=None):
        """decoder.h's forward over B requests x n rows: ``h`` [B*n, H] in (the residual stream out; written from
        ``fuse`` [B*n, 3T], the target's taps, by the draft's fusion when given), ``emb`` the draft's embeddings or
        None, ``cos``/``sin`` [B, n, d], ``slots`` [n] or [B, n], ``allowed`` [n, W] or
        [B, n, W], ``cache``: (tensor, batch, capacity, strides of a request, of keys/values, of a layer, of a kv
        head); logits for the rows ``out_rows`` (None: all), ``k`` of them; ``bad`` (int64 [B]) |= a kept row of
        that request has non-finite logits (:func:`~.finite.mark_nonfinite`'s rule), counting only each request's
        first ``nreal[b]`` rows when given (int64 [B]); ``local``: (allowed, cos, sin) of decoder.h's local layers,
        shaped as those (cos, sin None: the call's own).  Returns (logits [k, V], the taps' inputs or None, the kept
        rows' states [k, H] or None)."""
        for name, t in (("bad", bad), ("nreal", nreal)):
            if t is not None and (t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous()
                                  or t.numel() != B):
                raise ValueError(f"cpu_decoder: argument '{name}' expected a contiguous int64 CPU tensor of {B} "
                                 f"(one per request), got {tuple(t.shape)} {t.dtype} on {t.device}")
        rows, H = B * n, self.hidden
        cos = cos.expand(B, n, -1).contiguous()
        sin = sin.expand(B, n, -1).contiguous()
        req = torch.arange(B, device="cpu").repeat_interleave(n)
        slot = slots.expand(B, n).reshape(-1).contiguous()
        W = allowed.shape[-1]
        given, allowed = allowed, allowed.expand(B, n, W).reshape(rows, W).contiguous()
        keep_local = []
        if local is not None:   # (the same rows as allowed's where given them: no second copy)
            near = allowed if local[0] is given else local[0].expand(B, n, W).reshape(rows, W).contiguous()
            keep_local = [near] + [None if t is None else t.expand(B, n, -1).contiguous() for t in local[1:]]
        local_at = tuple(0 if t is None else t.data_ptr() for t in keep_local) or (0, 0, 0)
        logits = torch.empty(k, self.vocab, device="cpu")   # (never the default device)
        bufs = [torch.empty(rows, H, device="cpu") for _ in taps] if taps else []
        tap_at = list(taps or []) + [-1] * (3 - len(bufs))
        addrs = [b.data_ptr() for b in bufs] + [0] * (3 - len(bufs))
        states = torch.empty(k, H, device="cpu") if hout else None
        self._g.decoder_forward(self._desc, self.eps, self.scale, cache, h.data_ptr(),
                                0 if emb is None else emb.data_ptr(), 0 if fuse is None else fuse.data_ptr(), rows,
                                cos.data_ptr(), sin.data_ptr(), req.data_ptr(), slot.data_ptr(), allowed.data_ptr(), W,
                                local_at, tuple(tap_at), tuple(addrs),
                                0 if out_rows is None else out_rows.data_ptr(), k, logits.data_ptr(),
                                0 if states is None else states.data_ptr(), 0 if bad is None else bad.data_ptr(),
                                0 if nreal is None else nreal.data_ptr(), n, self.isa, 0)
        return logits, (bufs if taps else None), states


class CpuDecoder(_Packed):
    """The decoder of one CPU model (float32, bfloat16 or float16): its weights packed once (repacked when a weight
    was written since), and :meth:`forward` over any rows of the engine's cache.  Get it with :func:`for_target` (one per model,
    shared by every engine on it).  It holds the model weakly: the model's lifetime stays the user's."""

    def __init__(self, model):
        super().__init__(model)
        lay = self._lay = layout(model)
        self.hidden = _text(model).hidden_size
        self.heads, self.kv_heads, self.head_dim, self.inter = lay.heads, lay.kv_heads, lay.head_dim, lay.inter
        self.arch, self.act, self.rot = lay.arch, lay.act, lay.rot
        self.vocab = lay.head.out_features
        self.eps, self.scale = lay.eps, lay.scale
        self.embed, self.pos_embed, self.rotary, self.pos_offset = lay.embed, lay.pos, lay.rotary, lay.pos_offset
        self.embed_scale, self.local_rotary, self._final_weight = lay.embed_scale, lay.local_rotary, lay.final_weight
        self.attn_cap, self.final_cap, self.local = lay.attn_cap, lay.final_cap, lay.local
        self.res_mult, self.logit_div, self.logit_mult = lay.res_mult, lay.logit_div, lay.logit_mult
        self.experts, self.top_k, self.moe_inter, self.moe = lay.experts, lay.top_k, lay.moe_inter, lay.moe
        self._no_rotation = torch.zeros(1, 1, 1, device="cpu")   # (cos and sin without rotary: never read)
        self._pack()

    _why = staticmethod(unsupported)

    def _layer_parts(self):
        return [self._lay.parts(layer) for layer in self._lay.layers]

    def _head(self):
        return self._lay.final, self._lay.head, None, 0

    @torch.no_grad()
    def forward(self, ids, positions, slots, allowed, kv, keep=None, taps=None, current=False, bad=None,
                nreal=None, local=None):
        """One forward of ``ids`` [B, n] at ``positions`` [B, n], written to cache columns ``slots`` ([n] for
        every row, or [B, n]) of ``kv`` (the engine's cache [B', 2, layers, kv_heads, capacity, head_dim],
        request b in its row b), each row attending to the columns ``allowed`` [n, W] / [B, n, W] marks, or in the
        sliding layers of a model with sliding and full ones (:attr:`local`), those ``local`` marks (the same
        shape: ``allowed`` within the window; None: ``allowed`` itself, right while no row reaches past it).
        ``keep``: logits for every row (None) or for each request's last ``keep`` rows; ``taps``: the layers whose
        input to return; ``current``: :meth:`usable` was asked in this call (else the weights are checked here);
        ``bad``, ``nreal``: :func:`~.finite.mark_nonfinite` (bad, the kept logits, nreal) inside the call.
        Returns (logits [B, rows kept, V] float32, [the taps' inputs [B, n, H]] or None)."""
        if not current:
            self._fresh()
        B, n = ids.shape
        H = self.hidden
        if kv.dim() != 6 or kv.dtype != torch.float32 or kv.stride(5) != 1 or kv.stride(4) != self.head_dim \
                or B > kv.shape[0]:
            raise ValueError(f"cpu_decoder: argument 'kv' expected a float32 cache [>= {B}, 2, layers, kv_heads, "
                             f"capacity, {self.head_dim}] with contiguous columns, got {tuple(kv.shape)} {kv.dtype}")
        h = torch.nn.functional.embedding(ids.reshape(-1), self.embed.weight).to(torch.float32)
        if self.embed_scale is not None:   # (Gemma: its embeddings times their factor, as its module multiplies)
            h = h * self.embed_scale.to(torch.float32)
        if self.pos_embed is not None:   # (GPT-2, OPT: the tokens' embeddings + the positions', as transformers adds)
            h = h + torch.nn.functional.embedding(positions.reshape(-1) + self.pos_offset,
                                                  self.pos_embed.weight).to(torch.float32)
        h = h.contiguous()
        if self.rotary is None:
            cos = sin = self._no_rotation
        else:
            cos, sin = self.rotary(h.view(B, n, H), positions)
            if cos.shape[-1] != self.rot:
                raise ValueError(f"cpu_decoder: the model's rotary tables cover {cos.shape[-1]} head dimensions, "
                                 f"expected {self.rot} (its attention's)")
        if keep is None:
            out_rows, k = None, B * n
        else:
            k = min(int(keep), n)
            out_rows = (torch.arange(B, device="cpu").view(B, 1) * n
                        + torch.arange(n - k, n, device="cpu").view(1, k)).reshape(-1)
            k = B * k
        rows = None
        if self.local is not None and any(self.local):   # the sliding layers' columns, and their own rotation
            lc, ls = self.local_rotary(h.view(B, n, H), positions) if self.local_rotary is not None else (None, None)
            rows = (allowed if local is None else local, lc, ls)
        s = kv.stride()
        logits, bufs, _ = self._run(h, None, cos, sin, B, n, slots, allowed,
                                    (kv.data_ptr(), kv.shape[0], kv.shape[4], s[0], s[1], s[2], s[3]), out_rows, k,
                                    taps=taps, bad=bad, nreal=nreal, local=rows)
        return logits.view(B, -1, self.vocab), ([b.view(B, n, H) for b in bufs] if taps else None)


def draft_unsupported(draft):
    """Why the C layer cannot run ``draft``'s step and head (a short phrase), or None when it can."""
    from .draft import Eagle3Draft

    if not cpu_gemm.rows_available():
        return "heterospec's kernel extension (heterospec._gemm) is not built in this install"
    if not isinstance(draft, Eagle3Draft):
        return f"a draft of type {type(draft).__name__} (the C layer runs heterospec's Eagle3Draft)"
    if any(p.dtype not in DTYPES or p.device.type != "cpu" for p in draft.parameters()):
        return "a draft not in float32, bfloat16 or float16 on the CPU"
    if any(getattr(type(draft), f) is not getattr(Eagle3Draft, f) for f in ("fuse", "step", "head")):
        return "a draft whose fuse, step or head is its own"
    return None


class CpuDraft(_Packed):
    """The EAGLE-3 draft's step and head on the CPU in one call of ours (decoder.h's draft layout): the fusion of
    the target's taps where the step starts from them, the layer over the step's rows on the draft's own static
    cache, then the final norm and the output layer over the rows wanted.  The embedding stays torch's.  Get it
    with :func:`for_draft`."""

    def __init__(self, draft):
        super().__init__(draft)
        c = draft.config
        m = draft.midlayer
        self.hidden, self.heads, self.kv_heads, self.head_dim = (c.hidden_size, c.num_attention_heads,
                                                                 c.num_key_value_heads, c.head_dim)
        self.inter = m.mlp.gate_proj.out_features
        self.vocab = draft.lm_head.out_features
        self.eps = float(c.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(c.head_dim)   # (scaled_dot_product_attention's default, as the module's)
        self.rot = c.head_dim
        self._pack()

    _why = staticmethod(draft_unsupported)

    def hooked(self):
        """A user's forward hook on the draft, or its ``fuse``, ``step`` or ``head`` replaced on the instance (a
        patch of the user's, which must run): the drafter then calls the module's own."""
        d = self.model
        return any(f in vars(d) for f in ("fuse", "step", "head")) or super().hooked()

    def _layer_parts(self):
        m = self.model.midlayer
        return [_llama_parts(m)]

    def _head(self):
        d = self.model
        c = d.config
        flags = (HSD_RESIDUAL_NORMED if c.norm_before_residual else 0) | (0 if c.norm_output else HSD_HEAD_RAW) \
            | (HSD_OUT_NORMED if c.norm_hidden_out else 0)
        return d.norm, d.lm_head, d.midlayer.hidden_norm, flags

    def _fusion(self):
        d = self.model
        return (d.fc, None if d.input_norm is None else d.input_norm.weight,
                None if d.fc_norm is None else [norm.weight for norm in d.fc_norm])

    @torch.no_grad()
    def step_head(self, hidden, input_ids, position_ids, cache, slots, attn_mask, last=None, current=False, bad=None,
                  taps=None):
        """``Eagle3Draft.step`` then ``Eagle3Draft.head`` over its rows (``last`` None) or over each request's row
        ``last`` [B] -- the same arguments (``cache`` from ``new_cache``) -- in one call (``current``, ``bad``: as
        :meth:`CpuDecoder.forward`'s, every kept row counting).  ``taps`` [B, rows, 3T] (the target's, ``hidden``
        None): the step starts from ``Eagle3Draft.fuse(taps)``, fused in the same call.  Returns (logits [B, rows,
        Vd] float32, the states to feed back [B, rows, H])."""
        if not current:
            self._fresh()
        d = self.model
        if (hidden is None) == (taps is None):
            raise ValueError("cpu_decoder: step_head expected one of 'hidden' and 'taps', got "
                             f"{'both' if taps is not None else 'neither'}")
        H = self.hidden
        fuse = None
        if taps is not None:
            B, n, F = taps.shape
            if F != d.fc.in_features:
                raise ValueError(f"cpu_decoder: argument 'taps' expected [B, rows, {d.fc.in_features}] (3 x the "
                                 f"target's hidden size), got {tuple(taps.shape)}")
            fuse = taps.reshape(B * n, F).to(torch.float32).contiguous()
            h = torch.empty(B * n, H, device="cpu")
        else:
            B, n, H = hidden.shape
            h = hidden.reshape(B * n, H).to(torch.float32, copy=True).contiguous()
        if cache.dim() != 5 or cache.dtype != torch.float32 or not cache.is_contiguous() or cache.shape[1] < B:
            raise ValueError(f"cpu_decoder: argument 'cache' expected the draft's float32 cache [2, >= {B}, kv_heads, "
                             f"capacity, {self.head_dim}], got {tuple(cache.shape)} {cache.dtype}")
        emb = torch.nn.functional.embedding(input_ids.reshape(-1), d.embed_tokens.weight).to(torch.float32).contiguous()
        cos, sin = d.rope_tables(position_ids.reshape(-1, n).expand(B, n), torch.device("cpu"), torch.float32)
        if last is None:
            out_rows, k = None, B * n
        else:
            out_rows = (torch.arange(B, device="cpu") * n + last.view(B)).contiguous()
            k = B
        s = cache.stride()
        logits, _, states = self._run(h, emb, cos, sin, B, n, slots, attn_mask.view(torch.uint8),
                                      (cache.data_ptr(), cache.shape[1], cache.shape[3], s[1], s[0], 0, s[2]),
                                      out_rows, k, hout=True, bad=bad, fuse=fuse)
        return logits.view(B, -1, self.vocab), states.view(B, -1, H)


def why_off(setting, model, *, compile=False, draft=False, transformers=False):
    """Why a ``cpu_decoder`` setting leaves ``model`` (``draft``: a draft) on torch's forward (a phrase; 'off' for
    False), or None when ours runs it (:func:`for_target`'s and :func:`for_draft`'s rule, packing nothing).
    ``transformers``: the engine insists on transformers' own arithmetic for a half-precision target
    (``batch_invariant=True``)."""
    if not cpu_gemm.one_of(setting, SETTINGS):
        raise ValueError(f"HeteroSpec: argument 'cpu_decoder' expected 'auto', True or False, got {setting!r}")
    if setting is False:
        return "off"
    if draft:
        why = draft_unsupported(model)
    elif compile:
        why = "a compiled target (compile=...)"
    else:
        why = unsupported(model)
        p = next(model.parameters(), None)
        if why is None and transformers and p is not None and p.dtype != torch.float32:
            why = f"batch_invariant=True (transformers' {str(p.dtype).replace('torch.', '')} arithmetic)"
    if why is None and setting == "auto" and cpu_gemm._rows_module().isa_best() == 0:
        why = "only the kernel's portable loop on this CPU"
    if why is None and setting == "auto" and model not in _SHARED:   # (packed already: no new memory)
        need, free = packed_bytes(model), measure.available_bytes(torch.device("cpu"))
        if free is not None and need > free:
            why = f"a packed copy of its weights (up to {need / 2**30:.1f} GiB) that the memory available " \
                  f"({free / 2**30:.1f} GiB) would not hold"
            warnings.warn(f"heterospec: cpu_decoder='auto' leaves the model on transformers' forward: {why} "
                          f"(cpu_decoder=True packs it anyway)", stacklevel=3)
    return why


def packed_bytes(module):
    """An upper bound on the bytes the packed copies of ``module`` take: its matrices (and a mixture's experts) at
    their own width, the input embedding apart (read by torch; counted where the output layer shares it).  Codes
    take less where a float32 checkpoint is a GGUF's decodings (a quarter for Q4_1)."""
    emb = getattr(module, "get_input_embeddings", lambda: None)()
    head = getattr(module, "get_output_embeddings", lambda: None)()
    skip = emb.weight if emb is not None and (head is None or head.weight is not emb.weight) else None
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.dim() >= 2 and p is not skip)


_SHARED = weakref.WeakKeyDictionary()   # module -> its CpuDecoder / CpuDraft: one packed copy for every engine


def _shared(module, kind):
    got = _SHARED.get(module)
    if got is None:
        got = _SHARED[module] = kind(module)
    return got


def for_target(setting, model, *, compile=False, transformers=False, why=None):
    """The decoder a ``cpu_decoder`` setting gives ``model`` (None: transformers' forward).  'auto': on where the
    model is supported (:func:`unsupported`), not compiled, and the kernel has AVX2 or AVX-512 tiles here (its
    portable loop is ~8x slower than AVX2); True insists (ValueError naming why not); False: off.
    ``transformers``: :func:`why_off`'s.  ``why``: a list that gets :func:`why_off`'s phrase (None where ours
    runs), for a caller that says why."""
    reason = why_off(setting, model, compile=compile, transformers=transformers)
    if why is not None:
        why.append(reason)
    if setting is False:
        return None
    if reason is not None:
        if setting is True:
            raise ValueError(f"HeteroSpec: argument 'cpu_decoder' expected False or 'auto' here (True needs a "
                             f"supported CPU model, no compile, and heterospec._gemm), got True for {reason}")
        return None
    return _shared(model, CpuDecoder)


def for_draft(setting, draft):
    """The C layer a ``cpu_decoder`` setting gives ``draft`` (None: its torch modules): on for 'auto' and True
    wherever :func:`draft_unsupported` allows and the kernel has AVX2 or AVX-512 tiles here (True insists on the
    target's decoder only: a draft of another kind keeps its own step); one per draft, shared by every engine."""
    if draft is None or why_off("auto" if setting is True else setting, draft, draft=True) is not None:
        return None
    return _shared(draft, CpuDraft)


def gemm_modules(draft, fast):
    """The draft modules whose linear layers ``cpu_gemm`` routes: the fusion layer ``fc`` alone where the C layer
    runs the draft (``fast``: ``fc`` runs on torch's modules only while a user's hook sends the draft there), else
    the whole draft (None without one)."""
    if draft is None:
        return None
    return draft.fc if fast is not None else draft


def describe(decoder, fast):
    """What an engine's ``cpu_decoder`` says: 'off', or which forwards run ours, on which instruction set and, where
    some weights are read as block codes, how many of each ('target and draft (AVX-512)', 'target (AVX2)',
    'target and draft (AVX-512; weights as codes: Q4 120, Q8 1, F16 4)')."""
    parts = [name for name, on in (("target", decoder), ("draft", fast)) if on is not None]
    if not parts:
        return "off"
    codecs = {}
    for d in (decoder, fast):
        for c, k in (getattr(d, "codecs", None) or {}).items():
            codecs[c] = codecs.get(c, 0) + k
    coded = "" if set(codecs) <= {"F32"} else "; weights as codes: " + ", ".join(
        f"{c} {codecs[c]}" for c in ("Q4", "Q5", "Q8", "Q8H", "Q8X", "F16", "BF16", "F32") if c in codecs)
    return f"{' and '.join(parts)} ({ISA_NAMES[(decoder or fast).isa]}{coded})"
