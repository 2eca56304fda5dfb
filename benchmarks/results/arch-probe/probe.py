"""Probe heterospec against HF generate on tiny random models of every decoder-only *ForCausalLM in transformers.
python probe.py [ClassPrefix ...]      env: SHARPEN (default 40), HFTWICE=1 (HF generate twice), LAYERS (default 4)
"""
import os
import signal
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
import torch, transformers
warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
from _doubles import OracleDraft, NoisyDraft
from heterospec import HeteroSpec, Policy

V = 64
SHARPEN = float(os.environ.get("SHARPEN", "40"))
NL = int(os.environ.get("LAYERS", "4"))

SKIP = set("Bart Bert BigBird BigBirdPegasus Blenderbot BlenderbotSmall Camembert Clvp CpmAnt CsmDepthDecoder "
           "Data2VecText Electra Ernie Git Marian MBart MegatronBert Moshi Musicgen MusicgenMelody Mvp Pegasus PLBart "
           "ProphetNet RemBert RoCBert RoFormer Roberta RobertaPreLayerNorm TrOCR Whisper XLMRoberta XLMRobertaXL Xmod "
           "AutoModel BlipText FlaubertWith XLMWith XLNet".split())
OLD = set("Mistral Qwen2 Gemma Gemma2 Gemma3 Phi3 Mixtral Starcoder2 Qwen3 Exaone4 Olmo2 Granite StableLm Cohere Glm "
          "Qwen3Moe SmolLM3 Phi GPTNeoX Olmo Llama4 SeedOss Ernie4_5 HunYuanDenseV1 GptOss".split())

# generic overrides: every alias that the default config has is set
ALIASES = [
    (("vocab_size",), V),
    (("pad_token_id",), 0),
    (("hidden_size", "n_embd", "n_embed", "d_model", "embed_dim", "model_dim"), 32),
    (("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim", "intermediate_size_mlp"), 64),
    (("num_hidden_layers", "n_layer", "n_layers", "num_layers"), NL),
    (("num_attention_heads", "n_head", "n_heads", "num_heads"), 4),
    (("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
    (("head_dim", "attention_head_dim"), 8),
    (("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"), 512),
    # MoE
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    (("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts"), 2),
    (("moe_intermediate_size", "expert_intermediate_size"), 32),
    (("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"), 32),
    (("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    (("n_group", "topk_group"), 1),
    (("first_k_dense_replace",), 1),
    # MLA
    (("q_lora_rank",), 16), (("kv_lora_rank",), 16), (("qk_rope_head_dim",), 4), (("qk_nope_head_dim",), 8),
    (("v_head_dim",), 8),
    # recurrent / mamba sizes
    (("mamba_d_state", "state_size", "d_state", "ssm_state_size"), 8),
    (("mamba_n_heads", "mamba_num_heads"), 4),
    (("mamba_d_head", "mamba_head_dim"), 16),
    (("linear_num_key_heads", "linear_num_value_heads"), 2),
    (("linear_key_head_dim", "linear_value_head_dim"), 8),
    (("index_n_heads",), 2), (("index_head_dim",), 8), (("index_topk",), 16),
]

# per-architecture extra overrides (found by trial)
EXTRA = {
    "Blt": dict(patcher_config=dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=4, intermediate_size=64, head_dim=8),
                encoder_config=dict(vocab_size=V, hidden_size=32, hidden_size_global=64, num_attention_heads=4,
                                    num_key_value_heads=4, num_hidden_layers=1, intermediate_size=64),
                decoder_config=dict(vocab_size=V, hidden_size=32, hidden_size_global=64, num_attention_heads=4,
                                    num_key_value_heads=4, num_hidden_layers=2, intermediate_size=64, head_dim=8),
                global_config=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                                   intermediate_size=64, head_dim=16),
                encoder_hash_byte_group_vocab=64),
    "Zaya": dict(num_experts_per_tok=1, router_hidden_size=16),
    "Phi4Multimodal": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, image_size=28, crop_size=28),
                           audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=4,
                                             ext_pw_out_channel=32, depthwise_separable_out_channel=32,
                                             nemo_conv_channels=32)),
    "GraniteMoeHybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                             mamba_n_heads=4, mamba_d_head=16, mamba_chunk_size=16),
    "LongcatFlash": dict(head_dim=4, num_key_value_heads=4, expert_ffn_hidden_size=32, zero_expert_num=2),
    "CodeGen": dict(rotary_dim=4), "GPTJ": dict(rotary_dim=4),
    "GPTNeo": dict(window_size=16),      # local layers past their window within the probe's 70 positions
    "BailingHybrid": dict(linear_head_dim=8, linear_num_heads=4, num_experts_per_token=2, num_expert_group=1,
                          head_dim=4, qk_head_dim=12, layer_group_size=2),
    "KimiLinear": dict(linear_head_dim=8, linear_num_heads=4, num_experts_per_token=2, num_expert_group=1,
                       head_dim=4, qk_head_dim=12),
    "Bamba": dict(attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=16, mamba_chunk_size=16),
    "CohereCompass": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "Dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
    "FalconH1": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_chunk_size=16, mamba_n_groups=1),
    "Gemma4Assistant": dict(hidden_size_per_layer_input=0),
    "Jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False, mamba_dt_rank=8),
    "Lfm2Moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1),
    "Mamba2": dict(num_heads=4, head_dim=16, n_groups=1, chunk_size=16, time_step_rank=8),
    "Mllama": dict(cross_attention_layers=[1, 3]),
    "NemotronH": dict(n_groups=1, mamba_num_heads=4, mamba_head_dim=16, chunk_size=16, moe_latent_size=None),
    "Zamba": dict(attn_layer_period=1, attn_layer_offset=0, layers_block_type=None, attention_hidden_size=64,
                  attention_head_dim=16, n_mamba_heads=2, mamba_dt_rank=8, use_mamba_kernels=False),
    "xLSTM": dict(embedding_dim=32, num_blocks=4, num_heads=4, chunk_size=16, mode="inference",
                  autocast_kernel_dtype="float32"),
    "Qwen4Exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16,
                     indexer_compress_ratio=4, ngram_vocab_size_base=64, split_ngram_parts=1, hc_lowrank=8,
                     ple_embed_dim=32, heads_per_ngram=2),
    "Gemma3n": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    num_kv_shared_layers=2, vocab_size_per_layer_input=V, hidden_size_per_layer_input=8),
}

_t = time.time()
PROMPT = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(1))


class Timeout(Exception):
    pass


def _alarm(*a):
    raise Timeout("architecture took too long")


def ensure_variety(lst, n):
    new = list(lst[:n])
    missing = [t for t in dict.fromkeys(lst) if t not in new]
    for i, t in enumerate(missing[: n - 1]):
        new[n - 1 - i] = t
    return new


def overrides(default, drop=()):
    d = default.to_dict() if hasattr(default, "to_dict") else dict(vars(default))
    kw = {}
    for names, val in ALIASES:
        for n in names:
            if n in d and n not in drop:
                kw[n] = val
    old_layers = None
    for n in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
        if isinstance(d.get(n), int):
            old_layers = d[n]
            break
    if old_layers:
        for k, v in d.items():
            if isinstance(v, list) and len(v) == old_layers and k not in kw and old_layers != NL:
                kw[k] = ensure_variety(v, NL)
    sw = d.get("sliding_window")
    if isinstance(sw, int) and not isinstance(sw, bool) and "sliding_window" not in drop:
        kw["sliding_window"] = 16
    return kw


def build(base):
    Cls = getattr(transformers, base + "ForCausalLM", None) or getattr(transformers, base + "LMHeadModel")
    Cfg = Cls.config_class
    default = Cfg()
    sub = getattr(default, "text_config", None)
    variants = []
    if sub is not None and not isinstance(sub, dict) and Cfg.__name__ != type(sub).__name__:
        # a composite config: shrink its text part (and the top level where it has the same keys)
        kw = overrides(default)
        kw["text_config"] = dict(overrides(sub))
        variants.append(("composite", kw))
    variants.append(("full", overrides(default)))
    variants.append(("no-head_dim", overrides(default, drop=("head_dim",))))
    kw = overrides(default)
    for k in ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"):
        if k in kw:
            kw[k] = 4
    variants.append(("kv=heads", kw))
    kw = overrides(default, drop=("head_dim",))
    for k in ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"):
        if k in kw:
            kw[k] = 4
    variants.append(("kv=heads,no-head_dim", kw))
    variants.append(("keep-window", overrides(default, drop=("sliding_window",))))
    errs = []
    for vname, kw in variants:
        kw.update(EXTRA.get(base, {}))
        for attn in ("sdpa", "eager"):
            try:
                torch.manual_seed(0)
                cfg = Cfg(**kw, attn_implementation=attn)
                m = Cls(cfg).eval().float()
                if os.environ.get("ATTN_SCALE"):
                    with torch.no_grad():
                        for pn, prm in m.named_parameters():
                            if any(t in pn for t in ("q_proj.weight", "k_proj.weight", "Wqkv.weight", "qkv_proj.weight")):
                                prm.mul_(float(os.environ["ATTN_SCALE"]))
                            if any(t in pn for t in ("o_proj.weight", "v_proj.weight", "Wo.weight")):
                                prm.mul_(float(os.environ.get("OV_SCALE", "1")))
                m.generation_config.eos_token_id = None
                with torch.no_grad():
                    out = m.get_output_embeddings()
                    if out is not None and os.environ.get("UNTIE") and out.weight is m.get_input_embeddings().weight:
                        out.weight = torch.nn.Parameter(out.weight.detach().clone())
                        m.config.tie_word_embeddings = False
                        if hasattr(m.config, "get_text_config"):
                            m.config.get_text_config().tie_word_embeddings = False
                    if out is not None:
                        for q in out.parameters():
                            q.mul_(SHARPEN)
                try:
                    ref = hf_ref(m, PROMPT)
                except Timeout:
                    raise
                except Exception as e:
                    errs.append(f"{vname}/{attn}: HF-ERROR {short(e)}")
                    continue
                return m, ref, f"{vname}/{attn}" + ("" if out is not None else " (unsharpened: no output emb)"), errs
            except Timeout:
                raise
            except Exception as e:
                errs.append(f"{vname}/{attn}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    if os.environ.get("DEBUG"):
        print("\n".join(errs))
    raise RuntimeError("construction/HF failed: " + " | ".join(errs[:1] + errs[-1:]))


def describe(m):
    c = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
    bits = []
    lt = getattr(c, "layer_types", None)
    if lt:
        bits.append("types=" + ",".join(sorted(set(map(str, lt)))))
    sw = getattr(c, "sliding_window", None)
    if sw:
        bits.append(f"sw={sw}")
    bits.append(f"nparams={sum(p.numel() for p in m.parameters())}")
    return " ".join(bits)


def hf_ref(m, p):
    return m.generate(p, attention_mask=torch.ones_like(p), do_sample=False, max_new_tokens=40, min_new_tokens=40,
                      pad_token_id=0, eos_token_id=None)[0, p.shape[1]:].tolist()


def short(e):
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:200] if s else ''}"


def probe(base):
    m, ref, how, errs = build(base)
    p = PROMPT
    info = f"[{how}] {describe(m)}"
    if os.environ.get("DEBUG"):
        print("\n".join(errs))
    res = ["hf:ok" + ("(after %d failed variants)" % len(errs) if errs else "")]
    if os.environ.get("HFTWICE", "1") == "1":
        res.append("hf-det" if hf_ref(m, p) == ref else "hf-NONDET")
    for label, mk, pol in (("ar", lambda: None, Policy.autoregressive()),
                           ("oracle", lambda: OracleDraft(m), Policy.static(5, 3, 16)),
                           ("noisy", lambda: NoisyDraft(32, V), Policy.static(4, 4, 12))):
        try:
            d = mk()
            with HeteroSpec(m, d, pol, cuda_graphs=False) as hs:
                o, st = hs.generate(p, max_new_tokens=40, eos_token_id=[])
            got = o[0, 30:].tolist()
            if got == ref:
                res.append(f"{label}:OK")
            else:
                i = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                res.append(f"{label}:DIFF@{i}")
        except Exception as e:
            res.append(f"{label}:EXC {short(e)}")
            if os.environ.get("TB"):
                traceback.print_exc()
    return info, res


def main():
    names = sys.argv[1:]
    if not names:
        names = [n[: -len("ForCausalLM")] for n in dir(transformers) if n.endswith("ForCausalLM")]
        names += [n[: -len("LMHeadModel")] for n in dir(transformers) if n.endswith("LMHeadModel")
                  and not n.endswith("DoubleHeadsModel") and n[: -len("LMHeadModel")] not in names]
        names = [n for n in names if n not in SKIP and n not in OLD]
    for base in names:
        t0 = time.time()
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(int(os.environ.get("ARCH_TIMEOUT", "180")))
        try:
            info, res = probe(base)
            line = f"{base:26s} {' '.join(res)}   {info}"
        except Exception as e:
            line = f"{base:26s} NOT-BUILT {short(e)}"
        finally:
            signal.alarm(0)
        print(f"{line}   ({time.time() - t0:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
