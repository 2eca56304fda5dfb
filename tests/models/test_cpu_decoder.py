"""cpu_decoder: heterospec's own float32 decoder forward (csrc/gemm/decoder.c, heterospec.models.cpu_decoder).

Its pieces against their NumPy twins (heterospec.reference.decoder) bit for bit on every instruction set this CPU
has, and the twins against float64 math; the whole forward against the twin's forward bit for bit and against
transformers' own forward to float32 rounding; a tree row against a one-row step bit for bit; batches; errors;
and the engine that runs on it against transformers' generate."""
import copy
import functools
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from heterospec import HeteroSpec, Policy, measure  # noqa: E402
from heterospec.models import cpu_decoder, cpu_gemm  # noqa: E402
from heterospec.reference import decoder as ref  # noqa: E402
from tests._gguf import k_quantize_like_gguf, quantize_like_gguf  # noqa: E402
from tests._models import eagle3_head, prompts, reference_greedy, tiny_target  # noqa: E402

G = cpu_gemm._rows_module()
pytestmark = pytest.mark.skipif(G is None, reason="heterospec._gemm was not built here")
ISAS = range(G.isa_best() + 1) if G is not None else ()
# qwen2: q/k/v biases; qwen3: q/k norms, head_dim 16 (the others 8); phi3: q/k/v and gate/up fused, half of each
# head rotated (as Phi-4-mini rotates three quarters); smollm3: every second layer without rotation (NoPE)
# gemma: 1 + w norms, scaled embeddings, GeGLU; gemma2: + the sandwich of norms, sliding layers among full ones (a
# window of 6), soft-capped scores and logits; gemma3: + q/k norms and the sliding layers' own rotation
# olmo2: no norms before the blocks, norms after them, q/k normed over all heads; olmo3: + sliding layers among full
# ones with their own rotation
# granite: Llama's layout with its multipliers (embeddings, attention scale, each residual add, the logits' divisor);
# exaone4: OLMo 2's layout with q/k norms head by head
# granitemoehybrid: Granite 4.0's dense models (Granite's multipliers, a shared MLP of input_linear and output_linear),
# with rotary, or without (-nope); ministral: Llama's layout (its window: test_sliding_window.py); ernie4_5, helium,
# glm: neighbouring pairs rotated (ERNIE with biases; GLM with q/k/v biases, gate/up fused, half of each head rotated);
# glm4: GLM's with norms of the attention's and the MLP's outputs; hunyuan_v1_dense: q/k norms after the rotation
# mixtures of experts (4 experts, 2 a row): mixtral (renormalised weights), qwen2_moe (shared experts, a dense layer,
# weights not renormalised), qwen3_moe (every second layer dense), olmoe (q/k normed over all heads), granitemoe (the
# softmax of the chosen logits, Granite's multipliers)
ARCHS = ["llama", "qwen2", "qwen3", "phi3", "smollm3", "gemma", "gemma2", "gemma3", "olmo2", "olmo3", "granite",
         "exaone4", "granitemoehybrid", "granitemoehybrid-nope", "ministral", "ernie4_5", "helium", "glm", "glm4",
         "hunyuan_v1_dense", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
         "granitemoe"]
# LayerNorm layouts: GPT-NeoX (Pythia: the parallel residual and gelu; serial with gelu's tanh form; rotary over
# half of each head, q/k/v fused head by head), GPT-2 (learned positions, Conv1D weights, gelu's tanh form),
# GPTBigCode (multi-query, or q/k/v fused head by head), OPT (relu, positions 2 rows into their table), Phi (one norm
# a layer, attention and MLP side by side), GPT-J and CodeGen (as Phi, rotating neighbouring pairs), StableLM (a
# SiLU-gated MLP, q/k/v biases, half of each head rotated), StarCoder2 (gelu's tanh form, biases), Cohere (one norm
# without bias a layer, attention and a gated MLP side by side summed from the residual, pairs rotated, logits scaled)
# and Cohere 2 (+ sliding layers among full ones that rotate nothing)
LN_ARCHS = ["gpt_neox", "gpt_neox-serial", "gpt2", "gpt_bigcode", "gpt_bigcode-mha", "opt", "phi", "gptj", "codegen",
            "stablelm", "starcoder2", "cohere", "cohere2"]
ALL_ARCHS = ARCHS + LN_ARCHS


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a, np.float32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [1, 7, 8, 16, 17, 64, 100])
def test_dot_is_its_twins_bit_for_bit(isa, d):
    g = np.random.default_rng(d)
    for scale in (1.0, 1e-3, 1e4):
        a, b = t(g.standard_normal(d) * scale), t(g.standard_normal(d))
        got = np.float32(G.dot(a.data_ptr(), b.data_ptr(), d, isa))
        assert got.tobytes() == ref.dot16(a.numpy(), b.numpy()).tobytes()
        assert got == pytest.approx(float(np.dot(a.numpy().astype(np.float64), b.numpy())), rel=1e-5, abs=1e-5 * scale)


@pytest.mark.parametrize("isa", ISAS)
def test_exp_is_its_twins_bit_for_bit_and_within_2_ulp(isa):
    x = np.concatenate([np.linspace(-100, 100, 20011), [0.0, -0.0, -87.0, 88.0, np.inf, -np.inf, np.nan, 1e-30]])
    x = t(x)
    y = x.clone()
    G.exp(y.data_ptr(), y.numel(), isa)
    twin = ref.exp(x.numpy())
    assert y.numpy().tobytes() == twin.tobytes()
    ok = (x > -87) & (x < 88)
    exact = np.exp(x.numpy()[ok.numpy()].astype(np.float64)).astype(np.float32)
    ulps = np.abs(twin[ok.numpy()].view(np.int32).astype(np.int64) - exact.view(np.int32).astype(np.int64))
    assert ulps.max() <= 2
    assert twin[x.numpy() < -87].tolist() == [0.0] * int((x < -87).sum()) and np.isnan(twin[-2])


@pytest.mark.parametrize("isa", ISAS)
def test_softcapping_and_softcapped_attention_are_their_twins_bit_for_bit_and_tanh_to_rounding(isa):
    """Gemma 2's soft-capping, cap * tanh(x / cap), as decoder.h computes it (2 / (1 + exp(-2 y)) - 1): its twin's
    bits on every instruction set, math.tanh to a few float32 ulps of the cap, +-cap far out, NaN kept; and the
    soft-capped attention of one row, its twin's bits and float64's softmax of the capped scores."""
    g = np.random.default_rng(5)
    x = np.concatenate([g.standard_normal(997) * 40, [0.0, -0.0, 1e-6, -1e-6, 1e4, -1e4, np.inf, -np.inf, np.nan]])
    for cap in (50.0, 30.0, 1.5):
        y = t(x.copy())
        G.softcap(y.data_ptr(), y.numel(), cap, isa)
        twin = ref.softcap(x.astype(np.float32), cap)
        assert y.numpy().tobytes() == twin.tobytes()
        want = cap * np.tanh(x.astype(np.float64) / cap)
        ok = np.isfinite(want)
        assert np.allclose(twin[ok], want[ok], rtol=0, atol=4e-7 * cap)
        assert twin[-3] == cap and twin[-2] == -cap and np.isnan(twin[-1])
    with pytest.raises(ValueError, match="softcap: argument 'cap' expected a finite value > 0, got 0"):
        G.softcap(y.data_ptr(), 1, 0.0, isa)
    for d, W in ((8, 37), (64, 130), (100, 29)):
        q = t(g.standard_normal(d) * 4)
        k, v = t(g.standard_normal((W, d)) * 4), t(g.standard_normal((W, d)))
        allowed = torch.from_numpy(g.random(W) < 0.7)
        allowed[0] = True
        out = torch.empty(d)
        G.attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), d, allowed.data_ptr(), W, 1.0, out.data_ptr(), d, isa, 5.0)
        twin = ref.attend(q.numpy(), k.numpy(), v.numpy(), allowed.numpy(), 1.0, 5.0)
        assert out.numpy().tobytes() == twin.tobytes(), (d, W)
        s = 5.0 * np.tanh((k.numpy().astype(np.float64) @ q.numpy()) / 5.0)
        s[~allowed.numpy()] = -np.inf
        p = np.exp(s - s.max())
        assert np.allclose(twin, (p / p.sum()) @ v.numpy(), rtol=1e-5, atol=1e-5)
        plain = ref.attend(q.numpy(), k.numpy(), v.numpy(), allowed.numpy(), 1.0)
        assert not np.allclose(plain, twin, atol=1e-3)   # (the cap is felt: scores of up to ~100 against 5)


@pytest.mark.parametrize("isa", ISAS)
def test_rmsnorm_and_attention_are_their_twins_bit_for_bit(isa):
    g = np.random.default_rng(0)
    for d in (8, 16, 24, 64):
        x, w = t(g.standard_normal(d) * 3), t(g.standard_normal(d))
        y = torch.empty(d)
        G.rmsnorm(x.data_ptr(), w.data_ptr(), y.data_ptr(), d, 1e-6, isa)
        assert y.numpy().tobytes() == ref.rmsnorm(x.numpy(), w.numpy(), 1e-6).tobytes()
        x64 = x.numpy().astype(np.float64)
        assert np.allclose(y.numpy(), w.numpy() * x64 / np.sqrt((x64 ** 2).mean() + 1e-6), rtol=1e-5, atol=1e-6)
    # attention: the AVX2 path takes the keys four at a time (so 1-3 left over), keeps 64 outputs in registers at
    # a time (so d = 80, 100, 128 run two blocks, with and without a ragged tail) and reads keys at a stride
    for d, W, stride in ((8, 37, 8), (16, 37, 16), (24, 37, 24), (64, 37, 64), (64, 130, 64), (7, 23, 9),
                         (17, 41, 17), (80, 58, 80), (100, 29, 104), (128, 75, 128), (64, 5, 64), (64, 1, 64)):
        q = t(g.standard_normal(d))
        k, v = t(g.standard_normal((W, stride)) * 2), t(g.standard_normal((W, stride)))
        for allowed in (torch.from_numpy(g.random(W) < 0.6), torch.ones(W, dtype=torch.bool)):
            allowed[W // 2] = True
            out = torch.empty(d)
            G.attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), stride, allowed.data_ptr(), W, d ** -0.5, out.data_ptr(),
                     d, isa)
            twin = ref.attend(q.numpy(), k.numpy()[:, :d], v.numpy()[:, :d], allowed.numpy(), d ** -0.5)
            assert out.numpy().tobytes() == twin.tobytes(), (d, W, stride)
            # against softmax in float64 over the allowed keys only
            s = (k.numpy()[:, :d].astype(np.float64) @ q.numpy()) * d ** -0.5
            s[~allowed.numpy()] = -np.inf
            p = np.exp(s - s.max())
            assert np.allclose(twin, (p / p.sum()) @ v.numpy()[:, :d], rtol=1e-5, atol=1e-6)
    out = torch.full((16,), 7.0)   # no key allowed: zeros
    none = torch.zeros(8, dtype=torch.bool)
    q, kv = t(g.standard_normal(16)), t(g.standard_normal((8, 16)))
    G.attend(q.data_ptr(), kv.data_ptr(), kv.data_ptr(), 16, none.data_ptr(), 8, 0.25, out.data_ptr(), 16, isa)
    assert out.tolist() == [0.0] * 16


@pytest.mark.parametrize("isa", ISAS)
def test_layernorm_and_the_activations_are_their_twins_bit_for_bit_and_the_math_to_rounding(isa):
    from math import erfc

    g = np.random.default_rng(1)
    for d in (1, 8, 17, 32, 100):
        x, w, b = t(g.standard_normal(d) * 3 + 5), t(g.standard_normal(d)), t(g.standard_normal(d))
        for bias in (b, None):
            y = torch.empty(d)
            G.layernorm(x.data_ptr(), w.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), d, 1e-5, isa)
            twin = ref.layernorm(x.numpy(), w.numpy(), None if bias is None else bias.numpy(), 1e-5)
            assert y.numpy().tobytes() == twin.tobytes(), d
            x64 = x.numpy().astype(np.float64)
            c = x64 - x64.mean()
            want = w.numpy() * c / np.sqrt((c ** 2).mean() + 1e-5) + (0 if bias is None else b.numpy())
            assert np.allclose(twin, want, rtol=1e-5, atol=1e-5)
    x = t(np.concatenate([np.linspace(-12, 12, 4801), g.standard_normal(999) * 3, [0.0, -0.0, 1e-30, -1e-30, 60.0,
                                                                                    -60.0, 200.0, -200.0]]))
    x64 = x.numpy().astype(np.float64)
    with np.errstate(over="ignore"):
        exact = {ref.gelu: x64 * 0.5 * np.array([erfc(-v / np.sqrt(2)) for v in x64]),   # (1 + erf: no cancelling)
                 ref.gelu_tanh: x64 / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3))),
                 ref.relu: np.maximum(x64, 0)}
    for kind, fn in ((cpu_decoder.HSD_GELU, ref.gelu), (cpu_decoder.HSD_GELU_TANH, ref.gelu_tanh),
                     (cpu_decoder.HSD_RELU, ref.relu)):
        y = torch.empty_like(x)
        G.act(kind, x.data_ptr(), y.data_ptr(), x.numel(), isa)
        assert y.numpy().tobytes() == fn(x.numpy()).tobytes()
        # close to the exact function relative to its value (erfcc: fractional error < 1.2e-7, then float32 steps;
        # the tail past |x| 9 is below 1e-18), and to torch's own (what transformers computes; its erf form loses
        # the tail's digits: 1 + erf(-2.8) cancels, so it is held to within 1e-6 only)
        near = np.abs(x64) < 9
        assert np.allclose(y.numpy()[near], exact[fn][near], rtol=1e-5, atol=0), fn.__name__
        assert np.allclose(y.numpy()[~near], exact[fn][~near], rtol=1e-5, atol=1e-18)
        torch_act = torch.relu(x) if fn is ref.relu else \
            torch.nn.functional.gelu(x, approximate="none" if fn is ref.gelu else "tanh")
        assert torch.allclose(y, torch_act, rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"act: argument 'kind' expected 1 \(gelu\), 2 .* or 3 \(relu\), got 0"):
        G.act(0, x.data_ptr(), y.data_ptr(), 1, isa)
    with pytest.raises(ValueError, match="act: argument 'y' expected a buffer other than 'g'"):
        G.act(1, x.data_ptr(), x.data_ptr(), 1, isa)


def cpu_model(arch, layers=3, seed=0):
    return tiny_target(arch, layers=layers, seed=seed).cpu()


def new_cache(model, batch=1, capacity=64):
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 1 if getattr(c, "multi_query", False) else getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return torch.zeros(batch, 2, c.num_hidden_layers, kv, capacity, hd)


def causal(n, W):
    cols = torch.arange(W)
    return cols.view(1, -1) <= torch.arange(n).view(-1, 1)


def window(model, allowed):
    """The sliding layers' columns of a model with sliding and full layers (Gemma 2 and 3 here), for rows at
    positions 0.. in columns 0..: ``allowed`` [n, W] within config.sliding_window; None for other models."""
    c = model.config
    if "sliding_attention" not in (getattr(c, "layer_types", None) or ()):
        return None
    n, W = allowed.shape
    return allowed & (torch.arange(W).view(1, -1) > torch.arange(n).view(-1, 1) - c.sliding_window)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_the_forward_is_its_twins_and_transformers_to_rounding(arch):
    model = cpu_model(arch)
    dec = cpu_decoder.CpuDecoder(model)
    n = 9
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n).view(1, n)
    kv = new_cache(model)
    logits, taps = dec.forward(ids, pos, torch.arange(n), causal(n, 16), kv, taps=[0, 1, 2],
                               local=window(model, causal(n, 16)))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert torch.allclose(logits[0], out.logits[0], rtol=1e-4, atol=1e-4 * out.logits.abs().max().item())
    assert torch.equal(logits[0].argmax(-1), out.logits[0].argmax(-1))
    for i in range(3):   # the input of layer i is transformers' hidden_states[i]
        assert torch.allclose(taps[i][0], out.hidden_states[i][0], rtol=1e-5, atol=1e-5)
    # the NumPy twin of the whole forward, from the same weights: the same bits
    twin, cache = twin_forward(model, dec, ids, pos, n)
    assert logits[0].numpy().tobytes() == twin.tobytes()
    assert np.array_equal(kv[0, :, :, :, :16].permute(1, 0, 2, 3, 4).numpy(), cache)


def _np(d):
    return {k: None if v is None else v.detach().numpy() for k, v in d.items()}


def _twin_layers(model):
    """The twin's per-layer weights ([out, in]), read from the modules here (not through cpu_decoder), with
    decoder_layers' keyword arguments: (layers, final norm, head, embeddings [V, H], positions' table or None, the
    rotary module or None, kwargs)."""
    kind = model.config.model_type
    if kind == "gpt_neox":
        base, heads = model.gpt_neox, model.config.num_attention_heads
        layers = []
        for layer in base.layers:
            a, m = layer.attention, layer.mlp
            D = a.head_size
            w = a.query_key_value.weight.view(heads, 3, D, -1)   # transformers: [heads, (q, k, v), D] rows
            bq = a.query_key_value.bias.view(heads, 3, D)
            L = {"ln1": layer.input_layernorm.weight, "ln1_b": layer.input_layernorm.bias,
                 "ln2": layer.post_attention_layernorm.weight, "ln2_b": layer.post_attention_layernorm.bias,
                 "o": a.dense.weight, "o_b": a.dense.bias, "up": m.dense_h_to_4h.weight, "up_b": m.dense_h_to_4h.bias,
                 "down": m.dense_4h_to_h.weight, "down_b": m.dense_4h_to_h.bias}
            for i, name in enumerate("qkv"):
                L[name], L[name + "_b"] = w[:, i].reshape(heads * D, -1), bq[:, i].reshape(-1)
            layers.append(_np(L))
        act = "gelu" if model.config.hidden_act == "gelu" else "gelu_tanh"
        fin = base.final_layer_norm
        return (layers, (fin.weight.detach().numpy(), fin.bias.detach().numpy()), model.embed_out.weight
                if hasattr(model, "embed_out") else model.lm_head.weight, base.embed_in.weight, None,
                base.rotary_emb, dict(act=act, parallel=model.config.use_parallel_residual))
    if kind in ("gpt2", "gpt_bigcode"):
        base, heads = model.transformer, model.config.num_attention_heads
        layers = []
        for layer in base.h:
            a, m = layer.attn, layer.mlp
            conv = kind == "gpt2"   # Conv1D: weight [in, out]
            H = a.c_attn.weight.shape[0 if conv else 1]
            D = H // heads

            def w(lin):
                return lin.weight.t() if conv else lin.weight

            qkv, qkv_b = w(a.c_attn), a.c_attn.bias
            L = {"ln1": layer.ln_1.weight, "ln1_b": layer.ln_1.bias, "ln2": layer.ln_2.weight, "ln2_b": layer.ln_2.bias,
                 "o": w(a.c_proj), "o_b": a.c_proj.bias, "up": w(m.c_fc), "up_b": m.c_fc.bias,
                 "down": w(m.c_proj), "down_b": m.c_proj.bias}
            if conv or model.config.multi_query:   # rows [q of every head; k; v] (multi-query: one k and one v head)
                for name, lo, hi in (("q", 0, H), ("k", H, H + qkv.shape[0] // 3 if conv else H + D),
                                     ("v", H + qkv.shape[0] // 3 if conv else H + D, qkv.shape[0])):
                    L[name], L[name + "_b"] = qkv[lo:hi], qkv_b[lo:hi]
            else:                                  # transformers: [heads, (q, k, v), D] rows
                for i, name in enumerate("qkv"):
                    L[name] = qkv.view(heads, 3, D, -1)[:, i].reshape(heads * D, -1)
                    L[name + "_b"] = qkv_b.view(heads, 3, D)[:, i].reshape(-1)
            layers.append(_np(L))
        return (layers, (base.ln_f.weight.detach().numpy(), base.ln_f.bias.detach().numpy()), model.lm_head.weight,
                base.wte.weight, base.wpe.weight, None, dict(act="gelu_tanh"))
    if kind == "opt":
        base = model.model.decoder
        layers = []
        for layer in base.layers:
            a = layer.self_attn
            L = {"ln1": layer.self_attn_layer_norm.weight, "ln1_b": layer.self_attn_layer_norm.bias,
                 "ln2": layer.final_layer_norm.weight, "ln2_b": layer.final_layer_norm.bias}
            for name, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.out_proj), ("up", layer.fc1),
                              ("down", layer.fc2)):
                L[name], L[name + "_b"] = lin.weight, lin.bias
            layers.append(_np(L))
        fin = base.final_layer_norm
        return (layers, (fin.weight.detach().numpy(), fin.bias.detach().numpy()), model.lm_head.weight,
                base.embed_tokens.weight, base.embed_positions.weight[2:], None, dict(act="relu"))
    if kind == "phi":
        base = model.model
        layers = []
        for layer in base.layers:
            a, ln = layer.self_attn, layer.input_layernorm
            L = {"ln1": ln.weight, "ln1_b": ln.bias}   # no ln2: the MLP reads ln1's rows
            for name, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.dense), ("up", layer.mlp.fc1),
                              ("down", layer.mlp.fc2)):
                L[name], L[name + "_b"] = lin.weight, lin.bias
            layers.append(_np(L))
        fin = base.final_layernorm
        return (layers, (fin.weight.detach().numpy(), fin.bias.detach().numpy()), model.lm_head,
                base.embed_tokens.weight, None, base.rotary_emb, dict(act="gelu_tanh", parallel=True))
    if kind in ("gptj", "codegen"):
        base, heads = model.transformer, model.config.num_attention_heads
        layers = []
        for layer in base.h:
            a, ln = layer.attn, layer.ln_1
            L = {"ln1": ln.weight, "ln1_b": ln.bias, "o": a.out_proj.weight, "up": layer.mlp.fc_in.weight,
                 "up_b": layer.mlp.fc_in.bias, "down": layer.mlp.fc_out.weight, "down_b": layer.mlp.fc_out.bias}
            if kind == "gptj":
                L.update(q=a.q_proj.weight, k=a.k_proj.weight, v=a.v_proj.weight)
            else:   # CodeGen: 4 blocks of rows, each [q, v, k] of a quarter of the heads
                blocks = a.qkv_proj.weight.view(4, 3, -1, model.config.hidden_size)
                L.update(q=blocks[:, 0].reshape(-1, model.config.hidden_size),
                         v=blocks[:, 1].reshape(-1, model.config.hidden_size),
                         k=blocks[:, 2].reshape(-1, model.config.hidden_size))
            layers.append(_np(L))
        fin = base.ln_f

        def pair_tables(_, pos):   # the model's own sinusoids (sin then cos), each repeated for its pair
            owner = getattr(base, "rotary_emb", None) or base.h[0].attn   # (the attention's before transformers 5.25)
            sin, cos = owner.embed_positions[pos].chunk(2, -1)
            return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)

        return (layers, (fin.weight.detach().numpy(), fin.bias.detach().numpy()), model.lm_head,
                base.wte.weight, None, pair_tables, dict(act="gelu_tanh", parallel=True, pairs=True))
    if kind in ("gemma", "gemma2", "gemma3_text"):
        return _gemma_twin_layers(model)
    if kind in ("olmo2", "olmo3", "exaone4"):
        return _olmo_twin_layers(model)
    if kind in ("stablelm", "starcoder2"):
        return _ln_names_twin_layers(model)
    if kind in ("cohere", "cohere2"):
        return _cohere_twin_layers(model)
    base = model.model
    layers = []
    for layer in base.layers:
        a, blk = layer.self_attn, getattr(layer, "block_sparse_moe", None)   # (Granite MoE's mixture)
        blk = layer.mlp if blk is None and hasattr(getattr(layer, "mlp", None), "experts") else blk
        m = getattr(layer, "mlp", None) or getattr(layer, "shared_mlp", None) if blk is None \
            else getattr(blk, "shared_expert", None)   # (Granite 4.0's shared MLP; Qwen2-MoE's shared expert)
        L = {"ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight}
        if hasattr(m, "input_linear"):   # Granite 4.0: [gate; up] in one matrix, output_linear the down
            g = m.input_linear.weight
            L.update(gate=g[:g.shape[0] // 2], up=g[g.shape[0] // 2:])
            lins = (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj), ("down", m.output_linear))
        elif hasattr(m, "gate_up_proj") and not hasattr(a, "qkv_proj"):   # GLM: gate/up fused, q/k/v apart
            g = m.gate_up_proj.weight
            L.update(gate=g[:g.shape[0] // 2], up=g[g.shape[0] // 2:])
            lins = (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj), ("down", m.down_proj))
        elif hasattr(a, "qkv_proj"):   # Phi-3: q/k/v and gate/up fused (rows [q; k; v] and [gate; up]), no biases
            nq, nk = model.config.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
            w, g = a.qkv_proj.weight, m.gate_up_proj.weight
            L.update(q=w[:nq], k=w[nq:nq + nk], v=w[nq + nk:], gate=g[:g.shape[0] // 2], up=g[g.shape[0] // 2:])
            lins = (("o", a.o_proj), ("down", m.down_proj))
        else:
            lins = (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj))
            if m is not None:
                lins += (("gate", m.gate_proj), ("up", m.up_proj), ("down", m.down_proj))
        for name, lin in lins:
            L[name] = lin.weight
            if lin.bias is not None:
                L[name + "_b"] = lin.bias
        for name in ("q_norm", "k_norm"):
            if getattr(a, name, None) is not None:
                L[name] = getattr(a, name).weight
        if hasattr(a, "query_layernorm"):   # HunYuan: q/k norms per head, after the rotation
            L.update(q_norm=a.query_layernorm.weight, k_norm=a.key_layernorm.weight)
        if hasattr(layer, "post_self_attn_layernorm"):   # GLM-4: the attention's and the MLP's outputs normed
            L.update(post_attn=layer.post_self_attn_layernorm.weight, post_mlp=layer.post_mlp_layernorm.weight)
        layers.append(dict(_np(L), no_rot=not getattr(a, "use_rope", True),   # (SmolLM3's NoPE layers)
                           qk_all=kind == "olmoe", qk_after=hasattr(a, "query_layernorm"),
                           **(_moe_twin(blk, model.config) if blk is not None else {})))
    c = model.config
    if kind in ("granite", "granitemoe", "granitemoehybrid"):   # multipliers, from the config (the embeddings' as
        # the module multiplies: float32)
        embed = base.embed_tokens.weight * torch.tensor(c.embedding_multiplier, dtype=torch.float32)
        return layers, base.norm.weight.detach().numpy(), model.lm_head.weight, embed, None, base.rotary_emb, \
            dict(res_mult=c.residual_multiplier, logit_div=c.logits_scaling)
    if kind in ("ernie4_5", "helium", "glm", "glm4"):   # neighbouring pairs: the tables' first half, per pair

        def pair_tables(h, pos):
            cos, sin = base.rotary_emb(h, pos)
            return (t[..., :t.shape[-1] // 2].repeat_interleave(2, -1) for t in (cos, sin))

        return layers, base.norm.weight.detach().numpy(), model.lm_head.weight, base.embed_tokens.weight, None, \
            pair_tables, dict(pairs=True)
    return layers, base.norm.weight.detach().numpy(), model.lm_head.weight, base.embed_tokens.weight, None, \
        base.rotary_emb, {}


def _moe_twin(blk, c):
    """A mixture of experts' entries of a twin layer, read from the block here: the router, each expert's gate, up
    and down (transformers 5's 3D parameters; Granite MoE on 5.0: input_linear / output_linear), top_k, the routing
    bits (Mixtral's renormalised, Qwen's and OLMoE's by norm_topk_prob, Granite's the softmax of the chosen), and
    Qwen2-MoE's shared expert gate."""
    router = blk.router if c.model_type == "granitemoe" else blk.gate
    router = router.layer.weight if hasattr(router, "layer") else router.weight
    if hasattr(blk, "experts"):
        gu, down = blk.experts.gate_up_proj, blk.experts.down_proj
    else:
        gu, down = blk.input_linear.weight, blk.output_linear.weight
    MI = gu.shape[1] // 2
    bits = ref.MOE_TOPK_SOFTMAX if c.model_type == "granitemoe" else \
        ref.MOE_NORM if c.model_type == "mixtral" or c.norm_topk_prob else 0
    out = dict(router=router.detach().numpy(), top_k=c.num_experts_per_tok, moe=bits,
               experts=[tuple(t.detach().numpy() for t in (gu[e, :MI], gu[e, MI:], down[e])) for e in range(len(gu))])
    if getattr(blk, "shared_expert_gate", None) is not None:
        out["shared_gate"] = blk.shared_expert_gate.weight.detach().numpy()
    return out


def _cohere_twin_layers(model):
    """Cohere's layers for the twin: one LayerNorm without bias a layer (the MLP reads its rows), summed from the
    residual (``h_first``), pairs rotated, the logits times logit_scale; Cohere 2's sliding layers marked local and
    its full layers rotating nothing."""
    base, c = model.model, model.config
    types = getattr(c, "layer_types", None)
    layers = []
    for i, layer in enumerate(base.layers):
        a, m = layer.self_attn, layer.mlp
        L = {"ln1": layer.input_layernorm.weight, "ln1_b": None}
        for name, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj), ("gate", m.gate_proj),
                          ("up", m.up_proj), ("down", m.down_proj)):
            L[name] = lin.weight
        slides = types is not None and types[i] == "sliding_attention"
        layers.append(dict(_np(L), local=slides, no_rot=types is not None and not slides))
    return (layers, (base.norm.weight.detach().numpy(), None), model.lm_head.weight, base.embed_tokens.weight, None,
            base.rotary_emb, dict(parallel=True, pairs=True, h_first=True, logit_mult=c.logit_scale))


def _ln_names_twin_layers(model):
    """StableLM's and StarCoder2's layers for the twin: LayerNorms with their biases, q/k/v/o with theirs; StableLM's
    gate and up, StarCoder2's one matrix c_fc before gelu's tanh form."""
    base = model.model
    layers = []
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        L = {"ln1": layer.input_layernorm.weight, "ln1_b": layer.input_layernorm.bias,
             "ln2": layer.post_attention_layernorm.weight, "ln2_b": layer.post_attention_layernorm.bias}
        mlp = (("gate", m.gate_proj), ("up", m.up_proj), ("down", m.down_proj)) if hasattr(m, "gate_proj") \
            else (("up", m.c_fc), ("down", m.c_proj))
        for name, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj)) + mlp:
            L[name], L[name + "_b"] = lin.weight, lin.bias
        layers.append(_np(L))
    fin = base.norm
    return (layers, (fin.weight.detach().numpy(), fin.bias.detach().numpy()), model.lm_head.weight,
            base.embed_tokens.weight, None, base.rotary_emb,
            dict(act="silu" if hasattr(base.layers[0].mlp, "gate_proj") else "gelu_tanh"))


def _gemma_twin_layers(model):
    """Gemma's layers for the twin: every norm's weight read as 1 + w (Gemma's RMSNorm), the embeddings times their
    factor, the sandwich's norms (Gemma 2, 3), the sliding layers marked local with their own rotation (Gemma 3)
    and the soft-caps (Gemma 2)."""
    base, c = model.model, model.config
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers

    def one(norm):
        return 1.0 + norm.weight.detach().float()

    layers = []
    for layer, kind in zip(base.layers, types):
        a, m = layer.self_attn, layer.mlp
        L = {"ln1": one(layer.input_layernorm)}
        if hasattr(layer, "pre_feedforward_layernorm"):   # post_attention_layernorm norms the attention's output
            L.update(ln2=one(layer.pre_feedforward_layernorm), post_attn=one(layer.post_attention_layernorm),
                     post_mlp=one(layer.post_feedforward_layernorm))
        else:
            L["ln2"] = one(layer.post_attention_layernorm)
        for name, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj), ("gate", m.gate_proj),
                          ("up", m.up_proj), ("down", m.down_proj)):
            L[name] = lin.weight
        if getattr(a, "q_norm", None) is not None:
            L.update(q_norm=one(a.q_norm), k_norm=one(a.k_norm))
        layers.append(dict(_np(L), local=kind == "sliding_attention"))
    rotary, local_rotary = base.rotary_emb, None
    if "layer_type" in inspect.signature(rotary.forward).parameters:   # Gemma 3: a table per layer type
        local_rotary = functools.partial(base.rotary_emb, layer_type="sliding_attention")
        rotary = functools.partial(base.rotary_emb, layer_type="full_attention")
    kw = dict(act="gelu_tanh_glu", attn_cap=getattr(c, "attn_logit_softcapping", None) or 0.0,
              final_cap=getattr(c, "final_logit_softcapping", None) or 0.0, local_rotary=local_rotary)
    scale = getattr(base.embed_tokens, "embed_scale", None)   # (Gemma 1, 2 before transformers 5.x: the forward's)
    scale = torch.tensor(c.hidden_size ** 0.5) if scale is None else scale
    return layers, one(base.norm).numpy(), model.lm_head.weight, base.embed_tokens.weight * scale, None, rotary, kw


def _olmo_twin_layers(model):
    """OLMo 2 and 3's layers for the twin: no ln1 and ln2 (the blocks read h), the post norms, q/k norms over all
    heads (``qk_all``); OLMo 3's sliding layers marked local, with their own rotation.  EXAONE 4's: q/k norms head by
    head; with a window, its full layers rotate nothing."""
    base, c = model.model, model.config
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    layers = []
    for layer, kind in zip(base.layers, types):
        a, m = layer.self_attn, layer.mlp
        L = {"post_attn": layer.post_attention_layernorm.weight, "post_mlp": layer.post_feedforward_layernorm.weight,
             "q_norm": a.q_norm.weight, "k_norm": a.k_norm.weight}
        for name, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj), ("gate", m.gate_proj),
                          ("up", m.up_proj), ("down", m.down_proj)):
            L[name] = lin.weight
        exaone = c.model_type == "exaone4"
        nope = exaone and c.sliding_window is not None and kind != "sliding_attention"
        layers.append(dict(_np(L), qk_all=not exaone, local=kind == "sliding_attention", no_rot=nope))
    rotary, local_rotary = base.rotary_emb, None
    if "layer_type" in inspect.signature(rotary.forward).parameters:   # OLMo 3: a table per layer type
        local_rotary = functools.partial(base.rotary_emb, layer_type="sliding_attention")
        rotary = functools.partial(base.rotary_emb, layer_type="full_attention")
    return layers, base.norm.weight.detach().numpy(), model.lm_head.weight, base.embed_tokens.weight, None, rotary, \
        dict(local_rotary=local_rotary)


def twin_forward(model, dec, ids, pos, n):
    """heterospec.reference.decoder's forward of ``ids`` [1, n] from position 0 over a fresh 16-column cache:
    (logits [n, V], the cache [layers, 2, kv_heads, 16, head_dim])."""
    layers, final, head, embed, wpe, rotary, kw = _twin_layers(model)
    cos = sin = None
    if rotary is not None:
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, n, 1), pos)
        cos, sin = cos[0].numpy(), sin[0].numpy()
    local_rotary = kw.pop("local_rotary", None)
    near = window(model, causal(n, 16))
    if near is not None:   # the sliding layers: their columns, and their own rotation where they have one
        lcos = lsin = None
        if local_rotary is not None:
            with torch.no_grad():
                lcos, lsin = (t[0].numpy() for t in local_rotary(torch.zeros(1, n, 1), pos))
        kw["local"] = (near.numpy(), lcos, lsin)
    hd = dec.head_dim
    cache = np.zeros((len(layers), 2, dec.kv_heads, 16, hd), np.float32)
    embedded = embed[ids[0]]
    if wpe is not None:
        embedded = embedded + wpe[pos[0]]
    head = (head.weight, head.bias) if isinstance(head, torch.nn.Module) else (head, None)   # (Phi, GPT-J: a bias)
    head = tuple(None if t is None else t.detach().numpy() for t in head)
    twin = ref.decoder_layers(layers, final, head, dec.eps, dec.scale, dec.heads,
                              dec.kv_heads, embedded.detach().numpy(), cos, sin, cache, list(range(n)),
                              causal(n, 16).numpy(), **kw)
    return twin, cache


def the_twins_bits_on_every_isa(model, dec, seed):
    """The decoder's logits and cache for 9 random tokens equal the twin's from the float weights, bit for bit, on
    every instruction set here."""
    n = 9
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(n).view(1, n)
    twin, cache = twin_forward(model, dec, ids, pos, n)
    for isa in ISAS:
        dec.isa = isa
        kv = new_cache(model)
        logits, _ = dec.forward(ids, pos, torch.arange(n), causal(n, 16), kv, local=window(model, causal(n, 16)))
        assert logits[0].numpy().tobytes() == twin.tobytes(), f"isa {isa}"
        assert np.array_equal(kv[0, :, :, :, :16].permute(1, 0, 2, 3, 4).numpy(), cache)
    dec.isa = G.isa_best()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_quantized_model_is_read_as_its_codes_with_the_same_bits(arch, monkeypatch):
    """A model whose weights are a Q4_1 / Q8_0 checkpoint's decodings (as transformers loads a GGUF file): the
    decoder reads its codes (rows.h) and its logits are still the twin's from the float weights, bit for bit, on
    every instruction set."""
    monkeypatch.setattr(cpu_gemm, "pack_rows", functools.partial(cpu_gemm.pack_rows, coded=True))
    model = quantize_like_gguf(cpu_model(arch))
    dec = cpu_decoder.CpuDecoder(model)
    q4 = Q4_MATRICES.get(arch, 4 * 3)
    assert dec.codecs == {"Q4": q4, "Q8": 1}   # q/k/v, o, gate/up, down per layer; the output layer
    the_twins_bits_on_every_isa(model, dec, seed=1)
    assert cpu_decoder.describe(dec, None).endswith(f"; weights as codes: Q4 {q4}, Q8 1)")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "mixtral"])
def test_a_k_quant_checkpoint_is_read_as_its_codes_with_the_same_bits(arch, monkeypatch):
    """A Q4_K_M checkpoint's mix (Q4_K; Q6_K for the value and down projections, the embedding and the output
    layer): Q4_K's matrices are read as Q4 codes, Q6_K's (a scale per 16 weights, -0 under a negative one) as Q8H
    and the fused q/k/v (Q4_K and Q6_K rows) as Q8X, with the twin's bits from the float weights on every
    instruction set; a greedy run on the decoder (one-row steps and trees) is transformers' generate."""
    monkeypatch.setattr(cpu_gemm, "pack_rows", functools.partial(cpu_gemm.pack_rows, coded=True))
    model = k_quantize_like_gguf(cpu_model(arch))
    dec = cpu_decoder.CpuDecoder(model)
    if G.isa_best() >= 1:
        # per layer q/k/v (Q8X), o and gate/up (Q4), down (Q8H); the output layer (Q8H); a mixture's experts'
        # [gate; up] Q4 and down Q8H, its router Q4
        want = {"llama": {"Q4": 6, "Q8H": 4, "Q8X": 3}, "qwen3": {"Q4": 6, "Q8H": 4, "Q8X": 3},
                "gemma2": {"Q4": 6, "Q8H": 4, "Q8X": 3}, "mixtral": {"Q4": 3 * 6, "Q8H": 3 * 4 + 1, "Q8X": 3}}[arch]
        assert dec.codecs == want
    the_twins_bits_on_every_isa(model, dec, seed=2)
    if arch != "llama":
        return
    ps = [p.cpu() for p in prompts(2)]
    refs = [reference_greedy(model, p) for p in ps]
    with HeteroSpec(model, None, Policy.autoregressive(), cpu_decoder=True) as hs:
        assert "Q8X" in hs.cpu_decoder
        for p, want in zip(ps, refs):
            assert hs.generate(p, max_new_tokens=want.shape[1] - p.shape[1])[0].tolist() == want.tolist()


# the 3 layers' matrices of the mixtures (4 experts: their [gate; up] and down, 8 a mixture): q/k/v, o, router and
# experts per mixture; Qwen2-MoE's 2 mixtures also a shared expert's gate/up, down and gate, its dense layer 4;
# Qwen3-MoE's mixture is its middle layer, the other 2 dense (4 each)
Q4_MATRICES = {"mixtral": 3 * 11, "olmoe": 3 * 11, "granitemoe": 3 * 11, "qwen2_moe": 2 * 14 + 4,
               "qwen3_moe": 11 + 2 * 4}


def test_a_float16_checkpoint_of_pythia_is_read_as_its_values_and_what_the_decoder_lacks_is_refused():
    """Pythia's checkpoints hold float16 values: loaded in float32 every matrix is read as 2 bytes a weight, with the
    twin's bits from the float weights on every instruction set.  And the layouts' variants the kernel does not
    compute leave the model on transformers' forward, each with its reason."""
    model = cpu_model("gpt_neox")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    dec = cpu_decoder.CpuDecoder(model)
    if G.isa_best() >= 1:
        assert dec.codecs == {"F16": 4 * 3 + 1}   # q/k/v, dense, the MLP's two per layer; the output layer
    the_twins_bits_on_every_isa(model, dec, seed=4)
    gpt2 = cpu_model("gpt2")
    gpt2.config.scale_attn_by_inverse_layer_idx = True
    assert "scale per layer" in cpu_decoder.unsupported(gpt2)
    mixed = cpu_model("gpt_neox")
    mixed.gpt_neox.layers[1].mlp.act = torch.nn.ReLU()
    assert cpu_decoder.unsupported(mixed) == "layers of different MLP activations"
    for layer in mixed.gpt_neox.layers:
        layer.mlp.act = torch.nn.SiLU()
    assert cpu_decoder.unsupported(mixed) == "an MLP activation SiLU (the decoder has gelu, its tanh form and relu)"
    eps = cpu_model("gpt_neox-serial")
    eps.gpt_neox.layers[2].post_attention_layernorm.eps = 1e-6
    assert cpu_decoder.unsupported(eps) == "LayerNorms of different epsilons"
    opt350 = transformers.OPTForCausalLM(transformers.OPTConfig(   # OPT-350m: norms after each block, projections
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=16,
        do_layer_norm_before=False, max_position_embeddings=64))
    assert cpu_decoder.unsupported(opt350) == "OPT with its norms after each block or a projection in and out " \
                                             "(OPT-350m's layout)"
    phi = cpu_model("phi")
    phi.config.qk_layernorm = True
    assert cpu_decoder.unsupported(phi) == "Phi with LayerNorms on its queries and keys (qk_layernorm)"
    gptj = cpu_model("gptj")
    gptj.transformer.h[0].attn.rotary_dim = None   # (rotary over the whole width: transformers' own shapes fail)
    assert cpu_decoder.unsupported(gptj) == "a rotary_dim of None with 8 head dimensions (expected even, > 0)"
    with HeteroSpec(eps) as hs:   # auto: transformers' forward
        assert hs.cpu_decoder == "off" and hs.target.decoder is None
    with pytest.raises(ValueError, match="argument 'cpu_decoder' expected False or 'auto' here .* epsilons"):
        HeteroSpec(eps, cpu_decoder=True)


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_a_tree_row_is_a_one_row_step_bit_for_bit_on_every_isa(arch):
    """A tree node's logits (other rows beside it, its ancestors at other columns) equal a one-row step's over the
    same keys once the ancestors are committed: the row-invariance decoder.h promises; and every instruction
    set gives the same bits."""
    model = cpu_model(arch)
    dec = cpu_decoder.CpuDecoder(model)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    S = 11
    prompt = torch.randint(0, V, (1, S), generator=g)
    tok = torch.randint(0, V, (1, 4), generator=g)   # a tree: root r (column S), children a (S+1), b (S+2),
    results = []                                     # a's child c (S+3)
    for isa in ISAS:
        dec.isa = isa
        kv = new_cache(model)
        dec.forward(prompt, torch.arange(S).view(1, S), torch.arange(S), causal(S, S), kv)
        allowed = torch.zeros(4, S + 4, dtype=torch.bool)
        allowed[:, :S + 1] = True
        allowed[1, S + 1] = allowed[2, S + 2] = allowed[3, S + 1] = allowed[3, S + 3] = True
        tree, _ = dec.forward(tok, torch.tensor([[S, S + 1, S + 1, S + 2]]), torch.arange(S, S + 4), allowed,
                              kv.clone())
        # the path r, a, c one row at a time, each at the next column
        steps = []
        one = kv.clone()
        for j, (node, col) in enumerate(((0, S), (1, S + 1), (3, S + 2))):
            lg, _ = dec.forward(tok[:, node:node + 1], torch.tensor([[S + j]]), torch.tensor([col]),
                                torch.arange(col + 1).view(1, -1) <= col, one)
            steps.append(lg[0, 0])
        for node, step in zip((0, 1, 3), steps):
            assert torch.equal(tree[0, node], step)
        results.append(tree)
    dec.isa = G.isa_best()
    assert all(torch.equal(r, results[0]) for r in results)


def test_a_batch_row_is_its_request_alone_and_prefill_keeps_the_last_rows():
    model = cpu_model("qwen3")
    dec = cpu_decoder.CpuDecoder(model)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 5), generator=g)
    kv = new_cache(model, batch=2)
    logits, taps = dec.forward(ids, torch.arange(5).expand(2, 5), torch.arange(5), causal(5, 8), kv, keep=1, taps=[1])
    assert logits.shape == (2, 1, V) and taps[0].shape == (2, 5, model.config.hidden_size)
    for b in range(2):
        alone = new_cache(model)
        lb, tb = dec.forward(ids[b:b + 1], torch.arange(5).view(1, 5), torch.arange(5), causal(5, 8), alone, taps=[1])
        assert torch.equal(logits[b, 0], lb[0, -1]) and torch.equal(taps[0][b], tb[0][0])
        assert torch.equal(kv[b:b + 1], alone)


def test_nonfinite_is_the_engines_rule_on_every_kind_of_row():
    """hsd_nonfinite (the decoder's flags) against its NumPy twin and mark_nonfinite (the engine's rule, torch) on
    rows of each kind."""
    from heterospec.models.finite import mark_nonfinite

    inf, nan = float("inf"), float("nan")
    rows = {"finite": [1.0, -2.0, 3e38], "masked": [-inf, 0.5, -inf], "all -inf": [-inf] * 3, "nan": [0.0, nan, 1.0],
            "+inf": [-inf, inf, 0.0], "-nan": [0.0, -nan, 0.0], "one -inf": [-inf], "one value": [-3e38]}
    for name, r in rows.items():
        for V in (len(r), 37, 1000):   # the row's values at its end, a vectorised body and a tail before them
            x = torch.full((V,), -inf if name == "all -inf" else 0.25)
            x[V - len(r):] = torch.tensor(r)
            want = torch.zeros(1, dtype=torch.long)
            mark_nonfinite(want, x.view(1, V))
            assert G.nonfinite(x.data_ptr(), V) == bool(want.item()) == bool(ref.nonfinite(x.numpy())), (name, V)
    assert G.nonfinite(torch.zeros(3).data_ptr(), 3) is False


def test_the_forward_flags_non_finite_logits_of_each_requests_real_rows():
    """bad |= a request's real row has non-finite logits, inside the call: a NaN in a cache column that only
    request 0's row 2 attends to makes that row NaN, and only the rows counted by nreal flag."""
    from heterospec.models.finite import mark_nonfinite

    model = cpu_model("llama")
    dec = cpu_decoder.CpuDecoder(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(4))
    allowed = causal(3, 8).expand(2, 3, 8).clone()
    allowed[0, 2, 5] = True          # request 0's row 2 sees column 5 too
    for nreal, want in ((None, [1, 0]), ([3, 3], [1, 0]), ([2, 3], [0, 0]), ([3, 1], [1, 0])):
        kv = new_cache(model, batch=2)
        kv[0, :, 0, :, 5] = float("nan")
        real = None if nreal is None else torch.tensor(nreal)
        bad = torch.zeros(2, dtype=torch.long)
        logits, _ = dec.forward(ids, torch.arange(3).expand(2, 3), torch.arange(3), allowed, kv, bad=bad, nreal=real)
        rule = torch.zeros(2, dtype=torch.long)
        mark_nonfinite(rule, logits, real)
        assert bad.tolist() == want == rule.tolist(), nreal
        assert torch.isnan(logits[0, 2]).all() and torch.isfinite(logits[0, :2]).all() and torch.isfinite(logits[1]).all()
    with pytest.raises(ValueError, match="argument 'bad' expected a contiguous int64 CPU tensor of 2"):
        dec.forward(ids, torch.arange(3).expand(2, 3), torch.arange(3), allowed, kv, bad=torch.zeros(2))


def test_a_weight_written_in_place_is_packed_again():
    model = cpu_model("llama")
    dec = cpu_decoder.CpuDecoder(model)
    ids = torch.tensor([[1, 2, 3]])
    before, _ = dec.forward(ids, torch.arange(3).view(1, 3), torch.arange(3), causal(3, 3), new_cache(model))
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
        want = model(ids).logits
    after, _ = dec.forward(ids, torch.arange(3).view(1, 3), torch.arange(3), causal(3, 3), new_cache(model))
    assert not torch.equal(before, after)
    assert torch.allclose(after, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    model.to(torch.bfloat16)   # converted under the decoder: packed again, as its 16-bit values
    half, _ = dec.forward(ids, torch.arange(3).view(1, 3), torch.arange(3), causal(3, 3), new_cache(model))
    full = copy.deepcopy(model).float()
    want, _ = cpu_decoder.CpuDecoder(full).forward(ids, torch.arange(3).view(1, 3), torch.arange(3), causal(3, 3),
                                                   new_cache(full))
    assert torch.equal(half, want) and not torch.equal(half, after)
    model.to(torch.float64)   # to a dtype it does not run: refused, never read as float32
    with pytest.raises(ValueError, match="cpu_decoder: the model changed .* float64"):
        dec.forward(ids, torch.arange(3).view(1, 3), torch.arange(3), causal(3, 3), new_cache(model))


def test_bad_input_gets_a_clear_error():
    model = cpu_model("llama")
    dec = cpu_decoder.CpuDecoder(model)
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="argument 'kv' expected a float32 cache"):
        dec.forward(ids, torch.arange(2).view(1, 2), torch.arange(2), causal(2, 4), torch.zeros(1, 2, 3, 4))
    kv = new_cache(model, capacity=4)
    with pytest.raises(ValueError, match="decoder_forward: arguments 'req', 'slot'.*out of range"):
        dec.forward(ids, torch.arange(2).view(1, 2), torch.tensor([3, 4]), causal(2, 4), kv)
    assert not kv.any()   # nothing written
    with pytest.raises(ValueError, match="argument 'isa' expected 0 to"):
        G.dot(ids.data_ptr(), ids.data_ptr(), 1, 7)
    with pytest.raises(ValueError, match="argument 'cpu_decoder' expected 'auto', True or False, got 'yes'"):
        HeteroSpec(model, cpu_decoder="yes")
    wide = cpu_model("llama").to(torch.float64)
    with pytest.raises(ValueError, match="argument 'cpu_decoder' expected False or 'auto' here .* float64"):
        HeteroSpec(wide, cpu_decoder=True)
    with pytest.raises(ValueError, match="argument 'cpu_decoder' .* compiled"):
        HeteroSpec(model, cpu_decoder=True, compile="eager")
    assert cpu_decoder.unsupported(wide) is not None and cpu_decoder.unsupported(model) is None
    assert cpu_decoder.unsupported(model.to(torch.bfloat16)) is None


def test_what_the_decoder_lacks_of_gemma_is_refused_and_a_local_layer_needs_its_rows():
    """Gemma's (and an OLMo's) variants the kernel does not compute leave the model on transformers' forward, each with its reason;
    and a forward whose sliding layers get no rows of their own is a clear error from C, nothing written."""
    erf = cpu_model("gemma")
    for layer in erf.model.layers:
        layer.mlp.act_fn = transformers.activations.GELUActivation()
    assert cpu_decoder.unsupported(erf) == "a Gemma MLP activation GELUActivation (the decoder has gelu's tanh " \
                                           "form there)"
    eps = cpu_model("gemma3")
    eps.model.layers[1].self_attn.k_norm.eps = 1e-5
    assert cpu_decoder.unsupported(eps) == "norms of different epsilons"
    olmo = cpu_model("olmo2")
    olmo.model.layers[2].self_attn.q_norm.variance_epsilon = 1e-3
    assert cpu_decoder.unsupported(olmo) == "norms of different epsilons"
    both = cpu_model("gemma3")
    both.config.use_bidirectional_attention = True
    assert cpu_decoder.unsupported(both) == "bidirectional attention (use_bidirectional_attention: an embedding model)"
    model = cpu_model("gemma2")
    dec = cpu_decoder.CpuDecoder(model)
    assert dec.local == [True, False, True] and dec.attn_cap == 50.0 and dec.final_cap == 30.0
    dec.local = None   # (the table still marks layers 0 and 2 local: the call then gives them nothing)
    kv = new_cache(model)
    with pytest.raises(ValueError, match="decoder_forward: argument 'local' expected the local rows' columns "
                                         r"\(allowed\) for layer 0, a local layer, got 0"):
        dec.forward(torch.tensor([[1, 2]]), torch.arange(2).view(1, 2), torch.arange(2), causal(2, 4), kv)
    assert not kv.any()


def test_what_the_decoder_lacks_of_granite_stablelm_and_starcoder2_is_refused_and_c_checks_the_multipliers():
    """Granite's multipliers are read (and refused where a layer's differs), StableLM's parallel residual and q/k
    LayerNorms and StarCoder2's silu are refused, each with its reason; and decoder.h refuses a residual multiplier
    on a parallel layout, a zero or non-finite logit divisor, a non-finite logit multiplier and Cohere's residual
    order without the parallel residual in one line, nothing written."""
    granite = cpu_model("granite")
    dec = cpu_decoder.CpuDecoder(granite)
    assert (dec.res_mult, dec.logit_div, float(dec.embed_scale)) == (0.5, 4.0, 12.0) and dec.scale == 0.2
    granite.model.layers[1].residual_multiplier = 0.25
    assert cpu_decoder.unsupported(granite) == "Granite with residual multipliers [0.25, 0.5] and logits_scaling 4.0 " \
                                               "(expected one finite multiplier for every layer and a finite nonzero " \
                                               "scaling)"
    stable = cpu_model("stablelm")
    stable.config.use_parallel_residual = True
    assert cpu_decoder.unsupported(stable) == "StableLM with the parallel residual (use_parallel_residual)"
    stable.config.use_parallel_residual, stable.config.qk_layernorm = False, True
    assert cpu_decoder.unsupported(stable) == "StableLM with LayerNorms on its queries and keys (qk_layernorm)"
    coder = cpu_model("starcoder2")
    for layer in coder.model.layers:
        layer.mlp.act = torch.nn.SiLU()
    assert cpu_decoder.unsupported(coder) == "an MLP activation SiLU (the decoder has gelu, its tanh form and relu)"
    stable = cpu_model("stablelm")
    for layer in stable.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    assert cpu_decoder.unsupported(stable) == "an MLP activation GELU (the decoder has SiLU)"
    pythia = cpu_model("gpt_neox")   # (the parallel residual)
    neox = cpu_decoder.CpuDecoder(pythia)
    kv = new_cache(pythia)
    for res_mult, logit_div, logit_mult in ((0.5, 1.0, 1.0), (1.0, 0.0, 1.0), (1.0, float("inf"), 1.0),
                                            (float("nan"), 1.0, 1.0), (1.0, 1.0, float("nan"))):
        neox.res_mult, neox.logit_div, neox.logit_mult = res_mult, logit_div, logit_mult
        neox._pack()
        with pytest.raises(ValueError, match=r"decoder_forward: argument 'model' expected .* a finite res_mult \(1 "
                                             r"with 2\), a finite nonzero logit_div and a finite logit_mult, got .* "
                                             r"res_mult "):
            neox.forward(torch.tensor([[1, 2]]), torch.arange(2).view(1, 2), torch.arange(2), causal(2, 4), kv)
    neox.res_mult = neox.logit_div = neox.logit_mult = 1.0
    neox.arch = cpu_decoder.HSD_LAYERNORM | cpu_decoder.HSD_H_FIRST   # (Cohere's order without the parallel residual)
    neox._pack()
    with pytest.raises(ValueError, match=r"arch bits 1\|2\|4\|8\|16\|32\|64\|128 \(4 and 64 with 2, 16 without 2\)"
                                         r".*arch 65"):
        neox.forward(torch.tensor([[1, 2]]), torch.arange(2).view(1, 2), torch.arange(2), causal(2, 4), kv)
    assert not kv.any()


def test_what_the_decoder_lacks_of_the_mixtures_of_experts_is_refused_and_c_checks_their_layout():
    """OLMoE's clamped q/k/v, a mixture of another activation, a Qwen2-MoE whose dense layers and shared experts
    differ in width, a shared expert without its gate: each refused with its reason.  And decoder_forward refuses
    sizes of experts it cannot take, a router without experts (or experts without a router) and a shared expert
    without its gate in one line, nothing written."""
    olmoe = cpu_model("olmoe")
    olmoe.config.clip_qkv = 8.0
    assert cpu_decoder.unsupported(olmoe) == "clip_qkv 8.0 (q, k and v clamped: the decoder does not clamp)"
    mixtral = cpu_model("mixtral")
    mixtral.model.layers[2].mlp.experts.act_fn = torch.nn.GELU()
    assert cpu_decoder.unsupported(mixtral) == "an MLP activation GELU (the decoder has SiLU)"
    qwen = tiny_target("qwen2_moe", layers=3, shared_expert_intermediate_size=32).cpu()
    assert cpu_decoder.unsupported(qwen) == "dense MLPs of different widths [32, 64] (the decoder has one)"
    qwen = cpu_model("qwen2_moe")
    qwen.model.layers[0].mlp.shared_expert_gate = None
    assert cpu_decoder.unsupported(qwen) == "a shared expert without its one-output gate (or a gate without a " \
                                           "shared expert)"
    model = cpu_model("qwen3_moe")   # (a dense layer, a mixture, a dense layer)
    dec = cpu_decoder.CpuDecoder(model)
    assert (dec.experts, dec.top_k, dec.moe_inter, dec.moe) == (4, 2, 32, cpu_decoder.HSD_MOE_NORM)
    kv = new_cache(model)

    def forward():
        dec.forward(torch.tensor([[1, 2]]), torch.arange(2).view(1, 2), torch.arange(2), causal(2, 4), kv)

    for experts, top_k, moe_inter, moe, act in ((-1, 2, 32, 1, 0), (4, 5, 32, 1, 0), (4, 0, 32, 1, 0),
                                                 (4, 2, 0, 1, 0), (4, 2, 32, 4, 0), (4, 2, 32, 1, 1)):
        dec.experts, dec.top_k, dec.moe_inter, dec.moe, dec.act = experts, top_k, moe_inter, moe, act
        dec._pack()
        with pytest.raises(ValueError, match=r"^decoder_forward: argument 'model' expected experts >= 0 and, with "
                                             r"experts, top_k in \[1, experts\], moe_inter > 0, moe bits 1\|2 and "
                                             rf"act 0 \(SiLU-gated\), got experts {experts}, top_k {top_k}, "
                                             rf"moe_inter {moe_inter}, moe {moe}, act {act}$"):
            forward()
    dec.experts, dec.top_k, dec.moe_inter, dec.moe, dec.act = 0, 0, 0, 0, cpu_decoder.HSD_SILU_GLU
    dec._pack()
    with pytest.raises(ValueError, match=r"expected layer 1, a mixture of experts, to have its router and experts "
                                         r"\(and the model experts > 0\).* got router given, experts given "
                                         r"\(model 0\)"):
        forward()
    dec.experts, dec.top_k, dec.moe_inter, dec.moe = 4, 2, 32, cpu_decoder.HSD_MOE_NORM
    dec._pack()
    table = dec._table.clone()
    for field, value in ((cpu_decoder.HSD_FIELD_EXPERTS, 0), (cpu_decoder.HSD_FIELD_SHARED_GATE, 64)):
        dec._table.copy_(table)
        dec._table[1, field] = value   # (a gate without a shared expert: its address never read)
        with pytest.raises(ValueError, match=r"expected layer 1, a mixture of experts, .* a shared expert's gate/up, "
                                             r"down and gate all or none"):
            forward()
    dec._table.copy_(table)
    dec._table[0, cpu_decoder.HSD_FIELD_ROUTER] = 0   # (a dense layer's fields are there: its MLP runs)
    dec._table[0, cpu_decoder.HSD_FIELD_EXPERTS] = table[1, cpu_decoder.HSD_FIELD_EXPERTS]
    with pytest.raises(ValueError, match=r"expected layer 0, a mixture of experts, to have its router"):
        forward()
    assert not kv.any()
    dec._table.copy_(table)
    forward()
    assert kv.any()


def test_auto_is_on_for_a_supported_float32_model_and_off_otherwise():
    model = cpu_model("llama")
    with HeteroSpec(model) as hs:
        assert hs.cpu_decoder.startswith("target (") and hs.target.decoder is not None and hs.cpu_decoder_why is None
        assert hs.generate(prompts(1)[0].cpu(), max_new_tokens=2)[1].cpu_decoder == hs.cpu_decoder
    with HeteroSpec(model) as a, HeteroSpec(model, cpu_decoder=True) as b:   # one packed copy per model
        assert a.target.decoder is b.target.decoder
    with HeteroSpec(model, cpu_decoder=False) as hs:
        assert hs.cpu_decoder == "off" and hs.target.decoder is None and hs.cpu_decoder_why == "off"
    with HeteroSpec(cpu_model("llama").to(torch.bfloat16)) as hs:   # a half model: ours, row-invariant by itself
        assert hs.cpu_decoder.startswith("target (") and "BF16" in hs.cpu_decoder and not hs.batch_invariant
    with HeteroSpec(cpu_model("llama").to(torch.bfloat16), batch_invariant=True) as hs:   # transformers' bf16
        assert hs.cpu_decoder == "off" and hs.batch_invariant
    with pytest.raises(ValueError, match="cpu_decoder.*batch_invariant=True"):
        HeteroSpec(cpu_model("llama").to(torch.bfloat16), cpu_decoder=True, batch_invariant=True)
    with HeteroSpec(cpu_model("llama").to(torch.float64)) as hs:
        assert hs.cpu_decoder == "off" and "float64" in hs.cpu_decoder_why
    assert "float64" in cpu_decoder.unsupported(cpu_model("llama").to(torch.float64))


def test_granite_4_with_experts_or_mamba_layers_is_refused():
    granite4 = cpu_model("granitemoehybrid")
    granite4.config.num_local_experts = 4
    assert cpu_decoder.unsupported(granite4) == "experts beside its shared MLP (Granite 4.0's mixtures add the " \
                                               "shared MLP without a gate)"
    granite4 = cpu_model("granitemoehybrid-nope")
    granite4.model.layers[1].self_attn = None   # (a Mamba 2 layer's place: Granite 4.0-H)
    assert cpu_decoder.unsupported(granite4) == "Mamba 2 layers among its attention layers (Granite 4.0's hybrid " \
                                               "models: transformers' forward runs them)"


def test_auto_leaves_a_model_whose_packed_copy_the_memory_would_not_hold_on_transformers(monkeypatch):
    """'auto' counts the packed copy it would make (every matrix and expert at its own width, the input embedding
    apart) against the memory available and stays off, saying so, where it would not fit; a model packed already
    costs nothing new; True still insists."""
    model = cpu_model("mixtral")
    c = model.config
    H, I, E, V = c.hidden_size, c.intermediate_size, c.num_local_experts, c.vocab_size
    per_layer = 2 * H * H + 2 * H * (H // 2) + E * H + E * 3 * H * I   # q, o; k, v (2 of 4 heads); router; experts
    assert cpu_decoder.packed_bytes(model) == 4 * (3 * per_layer + V * H)   # and the output layer, float32
    assert cpu_decoder.why_off("auto", model) is None
    monkeypatch.setattr(measure, "available_bytes", lambda device: 4 * 3 * per_layer)   # (the head's bytes short)
    with pytest.warns(UserWarning, match="cpu_decoder='auto' leaves the model on transformers' forward: a packed"):
        why = cpu_decoder.why_off("auto", model)
    assert why == f"a packed copy of its weights (up to {4 * (3 * per_layer + V * H) / 2**30:.1f} GiB) that the " \
                  f"memory available (0.0 GiB) would not hold"
    with pytest.warns(UserWarning, match="cpu_decoder='auto'"), HeteroSpec(model) as hs:
        assert hs.cpu_decoder == "off" and hs.target.decoder is None and hs.cpu_decoder_why == why
    with HeteroSpec(model, cpu_decoder=True) as hs:   # (insisting packs it; then 'auto' finds it packed)
        assert hs.target.decoder is not None
        assert cpu_decoder.why_off("auto", model) is None


@pytest.mark.parametrize("arch,gguf", [(a, False) for a in ALL_ARCHS] + [("llama", True)])
def test_greedy_decoding_on_the_decoder_equals_transformers_generate(arch, gguf, tmp_path, monkeypatch):
    """The engine's every forward on the decoder (prefill, one-row steps, trees; a batch): the tokens of
    transformers' own greedy generate; ``gguf``: on a model of a GGUF checkpoint's weights, read as their codes."""
    if arch in ("gptj", "codegen", "stablelm") and tuple(int(x) for x in transformers.__version__.split(".")[:2]) \
            < (5, 23):   # (5.0's StableLM too: its own causal mask from the cache's length)
        pytest.skip(f"transformers {transformers.__version__}: {arch}'s forward builds its masks from the cache's "
                    f"length, which the engine refuses (tests/models/test_classic_layouts.py)")
    model = tiny_target(arch).cpu()
    if gguf:
        monkeypatch.setattr(cpu_gemm, "pack_rows", functools.partial(cpu_gemm.pack_rows, coded=True))
        quantize_like_gguf(model)
    draft = eagle3_head(model, tmp_path / "draft")
    ps = [p.cpu() for p in prompts(4)]
    refs = [reference_greedy(model, p) for p in ps]
    for pol, d in ((Policy.autoregressive(), None), (Policy.static(3, 3, 10), draft)):
        with HeteroSpec(model, d, pol, cpu_decoder=True) as hs:
            assert ("weights as codes: Q4" in hs.cpu_decoder) == gguf
            for p, want in zip(ps, refs):
                out, _ = hs.generate(p, max_new_tokens=want.shape[1] - p.shape[1])
                assert out.tolist() == want.tolist()
            outs, _ = hs.generate([p[0] for p in ps], max_new_tokens=refs[0].shape[1] - ps[0].shape[1])
            for p, want, got in zip(ps, refs, outs):
                assert got[:want.shape[1]].tolist() == want[0].tolist()


HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_a_half_precision_model_is_its_float32_copy_bit_for_bit_its_weights_read_as_stored(arch, dtype):
    """A bfloat16 / float16 model (what transformers 5 loads by default from such a checkpoint): every weight read
    as its 16-bit values, every sum in float32, so the logits are bit for bit those of the same weights loaded in
    float32 -- and so, to float32 rounding, transformers' float32 forward of them."""
    half = cpu_model(arch).to(dtype)
    full = copy.deepcopy(half).float()
    dh, df = cpu_decoder.CpuDecoder(half), cpu_decoder.CpuDecoder(full)
    name = {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    if G.isa_best() >= 1:
        assert set(dh.codecs) == {name}, dh.codecs    # 2 bytes a weight (float32 panels on the portable loop)
    ids = prompts(1)[0].cpu()[:, :12]
    n = ids.shape[1]
    pos = torch.arange(n).view(1, n)
    outs = []
    for dec, model in ((dh, half), (df, full)):
        kv = new_cache(model)
        logits, taps = dec.forward(ids, pos, torch.arange(n), causal(n, 16), kv, taps=[0, 1, 2],
                                   local=window(model, causal(n, 16)))
        outs.append((logits, taps, kv))
    (lh, th, kh), (lf, tf, kf) = outs
    assert lh.dtype == torch.float32 and torch.equal(lh, lf) and torch.equal(kh, kf)
    assert all(torch.equal(a, b) for a, b in zip(th, tf))
    with torch.no_grad():
        want = full(ids).logits
    assert torch.allclose(lh, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox", "gpt2", "phi"])
def test_greedy_decoding_of_a_half_model_and_its_half_draft_equals_transformers_generate_of_its_float32_copy(
        arch, dtype, tmp_path):
    """The engine on a half model (its draft in the same dtype, on the C layer too): autoregressive and tree
    decoding, alone and batched, give the tokens of transformers' greedy generate on the same weights in float32;
    the cache is float32 and no row-invariant machinery runs (a row of ours never depends on the others)."""
    half = tiny_target(arch).cpu().to(dtype)
    full = copy.deepcopy(half).float()
    draft = eagle3_head(full, tmp_path / "draft").to(dtype)
    ps = [p.cpu() for p in prompts(3)]
    refs = [reference_greedy(full, p) for p in ps]
    for pol, d in ((Policy.autoregressive(), None), (Policy.static(3, 3, 10), draft)):
        with HeteroSpec(half, d, pol) as hs:
            assert hs.cpu_decoder.startswith("target and draft (" if d is not None else "target (")
            assert hs.target.decoder is not None and not hs.batch_invariant
            for p, want in zip(ps, refs):
                out, _ = hs.generate(p, max_new_tokens=want.shape[1] - p.shape[1])
                assert out.tolist() == want.tolist()
            assert hs.target.kv.dtype == torch.float32
            outs, _ = hs.generate([p[0] for p in ps], max_new_tokens=refs[0].shape[1] - ps[0].shape[1])
            for want, got in zip(refs, outs):
                assert got[:want.shape[1]].tolist() == want[0].tolist()


def test_a_users_hook_on_a_half_model_and_its_draft_runs_their_modules_on_the_float32_caches(tmp_path):
    """While a hook of the user's is set, transformers' bfloat16 forward (and the draft's modules) run, reading the
    float32 caches our C code keeps for them converted to bfloat16; the hooks run and the call completes."""
    full = tiny_target("llama").cpu()
    draft = eagle3_head(full, tmp_path / "draft").to(torch.bfloat16)
    half = full.to(torch.bfloat16)
    p = prompts(1)[0].cpu()
    calls = []
    with HeteroSpec(half, draft, Policy.static(3, 3, 10)) as hs:
        assert hs.cycle.drafter.fast is not None
        handles = [m.register_forward_hook(lambda m, a, out: calls.append(out.dtype)) for m in (half.lm_head,
                                                                                                draft.lm_head)]
        try:
            out, st = hs.generate(p, max_new_tokens=6)
        finally:
            for h in handles:
                h.remove()
        assert out.shape[1] == p.shape[1] + 6 and calls and set(calls) == {torch.bfloat16}
        assert hs.target.kv.dtype == torch.float32 and hs.cycle.drafter.cache.dtype == torch.float32


def test_a_users_forward_hook_sends_the_forwards_to_transformers_and_runs():
    model = cpu_model("llama", layers=8)
    p = prompts(1)[0].cpu()
    calls = []
    with HeteroSpec(model) as hs:
        assert hs.target.decoder is not None and not hs.target.decoder.hooked()   # the engine's own taps: ours
        plain, _ = hs.generate(p, max_new_tokens=3)
        handle = model.lm_head.register_forward_hook(lambda m, a, out: calls.append(out.shape))
        try:
            assert hs.target.decoder.hooked()
            hooked, _ = hs.generate(p, max_new_tokens=3)
        finally:
            handle.remove()
        assert calls and hooked.tolist() == plain.tolist()   # the hook ran on every forward; the same tokens
        assert not hs.target.decoder.hooked()


def test_the_shared_decoder_does_not_keep_the_model_alive():
    import gc
    import weakref

    model = cpu_model("llama")
    with HeteroSpec(model) as hs:
        dec = hs.target.decoder
    del hs
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and dec.model is None


# ---- the EAGLE-3 draft's step and head (decoder.h's draft layout) -----------------------------------------------

DRAFT_VARIANTS = [{}, {"qk_norm": True}, {"norm_before_residual": True}, {"norm_output": False},
                  {"norm_hidden_out": True}, {"fc_norm": True}, {"norm_before_fc": True}]


def random_draft(seed=0, **flags):
    from heterospec.models.draft import Eagle3Config, Eagle3Draft

    config = Eagle3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=90, draft_vocab_size=40, rms_norm_eps=1e-5, max_position_embeddings=512,
                          rope_theta=10000.0, target_hidden_size=32, **flags)
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return draft


def draft_twin(draft, hidden, ids, pos, slots, allowed, cache):
    """ref.draft_layer for one request from the module's own weights, on a copy of ``cache`` [2, kv, C, d]:
    (logits, states, the cache written)."""
    m, c = draft.midlayer, draft.config
    a, mlp = m.self_attn, m.mlp
    L = {"ln1": m.input_layernorm.weight, "ln2": m.post_attention_layernorm.weight, "q": a.q_proj.weight,
         "k": a.k_proj.weight, "v": a.v_proj.weight, "o": a.o_proj.weight, "gate": mlp.gate_proj.weight,
         "up": mlp.up_proj.weight, "down": mlp.down_proj.weight}
    if a.q_norm is not None:
        L.update(q_norm=a.q_norm.weight, k_norm=a.k_norm.weight)
    L = {k: v.detach().numpy() for k, v in L.items()}
    cos, sin = draft.rope_tables(pos.view(1, -1), torch.device("cpu"), torch.float32)
    cache = np.array(cache, np.float32)
    logits, states = ref.draft_layer(
        L, m.hidden_norm.weight.detach().numpy(), draft.norm.weight.detach().numpy(),
        (draft.lm_head.weight.detach().numpy(), None), c.rms_norm_eps, c.head_dim ** -0.5, c.num_attention_heads,
        c.num_key_value_heads, draft.embed_tokens.weight[ids].detach().numpy(), hidden.numpy(), cos[0].numpy(),
        sin[0].numpy(), cache, slots.tolist(), allowed.numpy(), residual_normed=c.norm_before_residual,
        head_normed=c.norm_output, out_normed=c.norm_hidden_out)
    return logits, states, cache


@pytest.mark.parametrize("flags", DRAFT_VARIANTS, ids=lambda f: ",".join(f) or "standard")
def test_the_draft_step_is_its_twins_and_the_modules_to_rounding(flags):
    draft = random_draft(**flags)
    fast = cpu_decoder.CpuDraft(draft)
    g = torch.Generator().manual_seed(4)
    n, C = 6, 16
    hidden = torch.randn(1, n, 32, generator=g)
    ids = torch.randint(0, 90, (1, n), generator=g)
    pos = torch.arange(3, 3 + n).view(1, n)
    slots = torch.arange(2, 2 + n)
    allowed = torch.zeros(n, C, dtype=torch.bool)
    allowed[:, :2] = True
    allowed[:, 2:2 + n] = causal(n, n)
    cache = draft.new_cache(C)
    cache[:, :, :, :2] = torch.randn(2, 1, 2, 2, 8, generator=g)   # two committed columns before the rows
    mine = cache.clone()
    logits, states = fast.step_head(hidden, ids, pos, mine, slots, allowed)
    with torch.no_grad():
        want_logits, want_states = draft.head(draft.step(hidden, ids, pos, cache, slots, allowed))
    scale = want_logits.abs().max().item()
    assert torch.allclose(logits, want_logits, rtol=1e-4, atol=1e-5 * scale)
    assert torch.allclose(states, want_states, rtol=1e-4, atol=1e-5)
    assert torch.allclose(mine, cache, rtol=1e-5, atol=1e-6)
    before = draft.new_cache(C)
    before[:, :, :, :2] = cache[:, :, :, :2]
    twin_logits, twin_states, twin_cache = draft_twin(draft, hidden[0], ids[0], pos[0], slots, allowed,
                                                      before[:, 0].numpy())
    assert logits[0].numpy().tobytes() == twin_logits.tobytes()
    assert states[0].numpy().tobytes() == twin_states.tobytes()
    assert mine[:, 0].numpy().tobytes() == twin_cache.tobytes()
    # from the target's taps: the draft's fusion in the same call, its norms included where the config has them
    taps = 2.0 * torch.randn(1, n, 96, generator=g)
    mine = before.clone()
    logits, states = fast.step_head(None, ids, pos, mine, slots, allowed, taps=taps)
    cache = before.clone()
    with torch.no_grad():
        want_logits, want_states = draft.head(draft.step(draft.fuse(taps), ids, pos, cache, slots, allowed))
    scale = want_logits.abs().max().item()
    assert torch.allclose(logits, want_logits, rtol=1e-4, atol=1e-5 * scale)
    assert torch.allclose(states, want_states, rtol=1e-4, atol=1e-5)
    norms = None if draft.fc_norm is None else [m.weight.detach().numpy() for m in draft.fc_norm]
    fused = ref.fuse(taps[0].numpy(), draft.fc.weight.detach().numpy(), None, draft.config.rms_norm_eps,
                     None if draft.input_norm is None else draft.input_norm.weight.detach().numpy(), norms)
    twin_logits, twin_states, twin_cache = draft_twin(draft, torch.from_numpy(fused), ids[0], pos[0], slots, allowed,
                                                      before[:, 0].numpy())
    assert logits[0].numpy().tobytes() == twin_logits.tobytes()
    assert states[0].numpy().tobytes() == twin_states.tobytes()
    assert mine[:, 0].numpy().tobytes() == twin_cache.tobytes()


def test_the_draft_step_keeps_each_requests_row_and_a_row_is_its_request_alone_on_every_isa():
    draft = random_draft(seed=1)
    fast = cpu_decoder.CpuDraft(draft)
    g = torch.Generator().manual_seed(5)
    B, n, C = 3, 4, 12
    hidden = torch.randn(B, n, 32, generator=g)
    ids = torch.randint(0, 90, (B, n), generator=g)
    rows = torch.tensor([[0], [2], [5]]) + torch.arange(n)               # each request its own columns
    allowed = torch.arange(C).view(1, 1, C) <= rows.view(B, n, 1)
    last = torch.tensor([3, 0, 2])
    results = []
    for isa in ISAS:
        fast.isa = isa
        cache = draft.new_cache(C, B)
        logits, states = fast.step_head(hidden, ids, rows, cache, rows, allowed, last)
        assert logits.shape == (B, 1, 40) and states.shape == (B, 1, 32)
        for b in range(B):
            alone = draft.new_cache(C)
            lb, sb = fast.step_head(hidden[b:b + 1], ids[b:b + 1], rows[b:b + 1], alone, rows[b:b + 1],
                                    allowed[b:b + 1])
            assert torch.equal(logits[b, 0], lb[0, last[b]]) and torch.equal(states[b, 0], sb[0, last[b]])
            assert torch.equal(cache[:, b], alone[:, 0])
        results.append((logits, states))
    fast.isa = G.isa_best()
    assert all(torch.equal(r[0], results[0][0]) and torch.equal(r[1], results[0][1]) for r in results)


def test_the_draft_step_refuses_a_wrong_cache_and_is_off_for_other_drafts():
    draft = random_draft()
    fast = cpu_decoder.CpuDraft(draft)
    x = torch.zeros(1, 2, 32)
    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="argument 'cache' expected the draft's float32 cache"):
        fast.step_head(x, ids, torch.arange(2).view(1, 2), torch.zeros(2, 1, 2, 8), torch.arange(2),
                       causal(2, 8))
    pos, cache = torch.arange(2).view(1, 2), draft.new_cache(8)
    with pytest.raises(ValueError, match="step_head expected one of 'hidden' and 'taps', got both"):
        fast.step_head(x, ids, pos, cache, torch.arange(2), causal(2, 8), taps=torch.zeros(1, 2, 96))
    with pytest.raises(ValueError, match=r"argument 'taps' expected \[B, rows, 96\].*got \(1, 2, 32\)"):
        fast.step_head(None, ids, pos, cache, torch.arange(2), causal(2, 8), taps=x)
    assert cpu_decoder.draft_unsupported(draft) is None
    assert cpu_decoder.draft_unsupported(random_draft().to(torch.bfloat16)) is None   # read as stored, float32 sums
    assert "a draft not in float32, bfloat16 or float16" in cpu_decoder.draft_unsupported(
        random_draft().to(torch.float64))
    assert "a draft of type Linear" in cpu_decoder.draft_unsupported(torch.nn.Linear(2, 2))
    assert cpu_decoder.for_draft(False, draft) is None and cpu_decoder.for_draft("auto", draft) is not None


def test_the_engine_runs_its_draft_on_the_c_layer_and_a_users_hook_on_the_draft_runs(tmp_path):
    model = tiny_target("llama").cpu()
    draft = eagle3_head(model, tmp_path / "draft")
    p = prompts(1)[0].cpu()
    want = reference_greedy(model, p)
    pol = Policy.static(3, 3, 10)
    with HeteroSpec(model, draft, pol) as hs, HeteroSpec(model, draft, pol, cpu_decoder=False) as off:
        assert hs.cpu_decoder.startswith("target and draft (") and hs.cycle.drafter.fast is not None
        assert off.cpu_decoder == "off" and off.cycle.drafter.fast is None
        out, st = hs.generate(p, max_new_tokens=want.shape[1] - p.shape[1])
        assert out.tolist() == want.tolist() and st.cpu_decoder == hs.cpu_decoder
        calls = []
        handle = draft.lm_head.register_forward_hook(lambda m, a, o: calls.append(o.shape))
        try:
            assert hs.cycle.drafter.fast.hooked()
            hooked, _ = hs.generate(p, max_new_tokens=want.shape[1] - p.shape[1])
        finally:
            handle.remove()
        assert calls and hooked.tolist() == want.tolist()


def test_the_draft_fuses_the_targets_taps_in_its_own_call_on_the_c_layer(tmp_path, monkeypatch):
    from heterospec.models.draft import Eagle3Draft

    model = tiny_target("llama").cpu()
    draft = eagle3_head(model, tmp_path / "draft")
    p = prompts(1)[0].cpu()
    want = reference_greedy(model, p)
    fused = []
    own = Eagle3Draft.fuse
    monkeypatch.setattr(Eagle3Draft, "fuse", lambda self, taps: fused.append(taps.shape) or own(self, taps))
    pol = Policy.static(2, 3, 6)
    with HeteroSpec(model, draft, pol) as hs, HeteroSpec(model, draft, pol, cpu_decoder=False) as off:
        assert hs.cycle.drafter.fast is not None
        out, st = hs.generate(p, max_new_tokens=want.shape[1] - p.shape[1])
        assert out.tolist() == want.tolist() and st.cycles >= 3
        assert fused == []                          # the catch-ups' fusion ran inside the draft's C call
        out, st = off.generate(p, max_new_tokens=want.shape[1] - p.shape[1])
        assert out.tolist() == want.tolist() and len(fused) == st.cycles + 1   # the prime, then one per cycle


def test_the_engine_checks_the_weights_once_a_call_and_a_weight_written_between_calls_is_read(tmp_path, monkeypatch):
    """The weights and hooks are asked once a call (at the prefill and the draft's prime), not before each of a
    cycle's forwards; a weight written between two calls is packed again before the second."""
    model = tiny_target("llama").cpu()
    draft = eagle3_head(model, tmp_path / "draft")
    p = prompts(1)[0].cpu()
    walks = []
    state = cpu_decoder._Packed._state
    monkeypatch.setattr(cpu_decoder._Packed, "_state", lambda self: walks.append(type(self).__name__) or state(self))
    with HeteroSpec(model, draft, Policy.static(3, 3, 10)) as hs:
        walks.clear()
        out, st = hs.generate(p, max_new_tokens=12)
        assert st.cycles >= 3 and sorted(walks) == ["CpuDecoder", "CpuDraft"]   # one walk each, whatever the cycles
        assert out.tolist() == reference_greedy(model, p, 12).tolist()
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(-2.0)
        again, _ = hs.generate(p, max_new_tokens=12)
        assert again.tolist() == reference_greedy(model, p, 12).tolist() and again.tolist() != out.tolist()


def test_non_finite_logits_on_the_c_layers_are_the_engines_clear_errors(tmp_path):
    """No hook in the way, so the target's and the draft's forwards run on the C layers and their flags come
    from inside the calls: a target whose rotary tables turn NaN past a position fails in that cycle, naming the
    target; a draft with a NaN output row fails naming the draft; both as the engine's one-line error."""
    from heterospec import NonFiniteLogitsError

    model = tiny_target("llama").cpu()
    draft = eagle3_head(model, tmp_path / "draft")
    p = prompts(1)[0].cpu()
    rotary = model.model.rotary_emb
    plain = rotary.forward

    def poisoned(x, positions):
        cos, sin = plain(x, positions)
        late = (positions >= p.shape[1] + 3).unsqueeze(-1)
        return cos.masked_fill(late, float("nan")), sin
    with HeteroSpec(model, draft, Policy.static(2, 2, 4)) as hs:
        rotary.forward = poisoned
        try:
            with pytest.raises(NonFiniteLogitsError, match="the target model LlamaForCausalLM .* in cycle [1-4],"):
                hs.generate(p, max_new_tokens=12)
        finally:
            del rotary.forward
        assert hs.cycle.drafter.fast_on and hs.target._decoder_on   # both on the C layers
        with torch.no_grad():
            draft.lm_head.weight[3] = float("nan")
        with pytest.raises(NonFiniteLogitsError, match="the draft model Eagle3Draft .* in cycle 1,"):
            hs.generate(p, max_new_tokens=12)
        assert hs.cycle.drafter.fast_on
