"""The target's forward on the CPU in one call of ours (``cpu_decoder``): every decoder layer of a Llama-family
model in float32 (csrc/gemm/decoder.h), on the engine's own key/value cache, instead of transformers' modules.

Why: on a 2-core Xeon a one-token forward of SmolLM2-135M through transformers took 52 ms, of which the linear
layers were 24.5 ms (the few-rows kernel of ``cpu_gemm='rows'``); the rest was about 1,400 small torch
operations and their Python calls per forward.  The decoder runs the same arithmetic as a few loops per layer
around the same few-rows kernel.

What stays transformers': the weights (read in place, packed once into the kernel's panels: q, k and v as one
matrix, gate and up as one), the token embedding and the rotary tables (the model's own ``rotary_emb``, so every
RoPE variant it has is the one used).  What differs: the order of each sum.  The logits agree with transformers'
forward to ~1e-5 (the tests hold them to it), as the packed matrix paths do; each row's result is computed the
same way whatever the other rows are (decoder.h), so a tree node's logits equal, bit for bit, those of a one-row
step of the same engine over the same keys.

Supported: ``llama``, ``mistral`` (without a sliding window), ``qwen2`` and ``qwen3`` (q/k norms) models on the
CPU in float32 with SiLU MLPs and RMSNorm, any bias layout, any head grouping; :func:`unsupported` says why not
otherwise.  A model with forward hooks of the user's on any of its modules runs transformers' forward while they
are set (the hooks then run, as they would in the user's own calls).
"""
from __future__ import annotations

import weakref

import torch

from . import cpu_gemm

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SETTINGS = ("auto", True, False)
ISA_NAMES = ("portable", "AVX2", "AVX-512")


def _text(model):
    c = model.config
    return c.get_text_config() if hasattr(c, "get_text_config") else c


def _is_rmsnorm(m):
    return m is not None and type(m).__name__.endswith("RMSNorm") and getattr(m, "weight", None) is not None \
        and hasattr(m, "variance_epsilon")


def unsupported(model):
    """Why the decoder cannot run ``model``'s forward (a short phrase), or None when it can."""
    if not cpu_gemm.rows_available():
        return "heterospec's kernel extension (heterospec._gemm) is not built in this install"
    cfg = _text(model)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"a {kind!r} model (supported: {', '.join(FAMILIES)})"
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype != torch.float32:
        return f"a {getattr(p, 'device', None)} {str(getattr(p, 'dtype', None)).replace('torch.', '')} model " \
               f"(the decoder runs float32 on the CPU)"
    if any(q.dtype != torch.float32 or q.device.type != "cpu" for q in model.parameters()):
        return "parameters of mixed dtypes or devices"
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    head = getattr(model, "lm_head", None)
    if layers is None or not isinstance(getattr(base, "embed_tokens", None), torch.nn.Embedding) \
            or not _is_rmsnorm(getattr(base, "norm", None)) or getattr(base, "rotary_emb", None) is None \
            or not isinstance(head, torch.nn.Linear):
        return "a model without the Llama layout (model.embed_tokens, .layers, .norm, .rotary_emb; lm_head)"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {cfg.hidden_act!r} (the decoder has SiLU)"
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
        return "logit soft-capping"
    if len(layers) != cfg.num_hidden_layers:
        return "a layer count other than the config's"
    for layer in layers:
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if att is None or mlp is None or not all(isinstance(getattr(att, n, None), torch.nn.Linear)
                                                 for n in ("q_proj", "k_proj", "v_proj", "o_proj")) \
                or not all(isinstance(getattr(mlp, n, None), torch.nn.Linear)
                           for n in ("gate_proj", "up_proj", "down_proj")):
            return "a layer without q/k/v/o and gate/up/down linear layers"
        if not (_is_rmsnorm(getattr(layer, "input_layernorm", None))
                and _is_rmsnorm(getattr(layer, "post_attention_layernorm", None))):
            return "a layer whose norms are not RMSNorm"
        for n in ("q_norm", "k_norm"):
            if getattr(att, n, None) is not None and not _is_rmsnorm(getattr(att, n)):
                return f"a {n} that is not RMSNorm"
        if getattr(att, "sliding_window", None):
            return "a sliding attention window"
        if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
            return f"an MLP activation {type(getattr(mlp, 'act_fn', None)).__name__} (the decoder has SiLU)"
    if getattr(cfg, "sliding_window", None) and kind == "mistral":
        return "a sliding attention window"
    return None


class CpuDecoder:
    """The decoder of one float32 CPU model: its weights packed once (repacked when a weight was written since),
    and :meth:`forward` over any rows of the engine's cache.  Get it with :func:`for_target` (one per model,
    shared by every engine on it).  It holds the model weakly: the model's lifetime stays the user's."""

    def __init__(self, model):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"HeteroSpec: argument 'cpu_decoder' expected a supported float32 CPU model, got {why}")
        self._model = weakref.ref(model)
        self._g = cpu_gemm._rows_module()
        self.isa = self._g.isa_best()
        cfg = _text(model)
        base = model.model
        self.layers = list(base.layers)
        att0 = self.layers[0].self_attn
        self.hidden = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = att0.head_dim
        self.inter = self.layers[0].mlp.gate_proj.out_features
        self.vocab = model.lm_head.out_features
        self.eps = float(self.layers[0].input_layernorm.variance_epsilon)
        self.scale = float(att0.scaling)
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self._params = list(model.parameters())
        self._children = list(model.modules())[1:]   # (the model itself only through the weak reference)
        self._versions = None
        self._pack()

    def hooked(self):
        """Whether forward hooks other than the engine's own taps are set on the model (or globally): the user's
        hooks run only on transformers' forward, so the adapter takes that forward while there are any."""
        from torch.nn.modules import module as tm

        if tm._global_forward_hooks or tm._global_forward_pre_hooks:
            return True
        for m in (self.model, *self._children):
            for hooks in (m._forward_hooks, m._forward_pre_hooks):
                if hooks and not all(getattr(h, "heterospec_tap", False) for h in hooks.values()):
                    return True
        return False

    @property
    def model(self):
        """The model (None once the user dropped it)."""
        return self._model()

    def _state(self):
        return [(p.data_ptr(), p._version) for p in self._params]

    @torch.no_grad()
    def _pack(self):
        """The packed copies and the address table (decoder.h's fields per layer)."""
        keep = []   # every tensor an address in the table points into

        def addr(t):
            if t is None:
                return 0
            t = t.detach().contiguous()
            keep.append(t)
            return t.data_ptr()

        def fused(lins):
            w = cpu_gemm.pack_rows(torch.cat([lin.weight.detach() for lin in lins]))
            b = None
            if any(lin.bias is not None for lin in lins):
                b = torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                               for lin in lins])
            return addr(w), addr(b)

        rows = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            qkv, qkv_b = fused([a.q_proj, a.k_proj, a.v_proj])
            o, o_b = fused([a.o_proj])
            gu, gu_b = fused([m.gate_proj, m.up_proj])
            down, down_b = fused([m.down_proj])
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            rows.append([addr(layer.input_layernorm.weight), addr(layer.post_attention_layernorm.weight), qkv, qkv_b,
                         addr(None if qn is None else qn.weight), addr(None if kn is None else kn.weight), o, o_b, gu,
                         gu_b, down, down_b])
        self._table = torch.tensor(rows, dtype=torch.int64, device="cpu")
        head, head_b = fused([self.model.lm_head])
        self._desc = (len(self.layers), self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self.vocab,
                      self._table.data_ptr(), addr(self.model.model.norm.weight), head, head_b)
        self._keep = keep
        self._versions = self._state()

    def describe(self):
        return f"on ({ISA_NAMES[self.isa]})"

    @torch.no_grad()
    def forward(self, ids, positions, slots, allowed, kv, keep=None, taps=None):
        """One forward of ``ids`` [B, n] at ``positions`` [B, n], written to cache columns ``slots`` ([n] for
        every row, or [B, n]) of ``kv`` (the engine's cache [B', 2, layers, kv_heads, capacity, head_dim],
        request b in its row b), each row attending to the columns ``allowed`` [n, W] / [B, n, W] marks.
        ``keep``: logits for every row (None) or for each request's last ``keep`` rows; ``taps``: the layers whose
        input to return.  Returns (logits [B, rows kept, V] float32, [the taps' inputs [B, n, H]] or None)."""
        if self._state() != self._versions:   # a weight written since (in place, or replaced)
            why = unsupported(self.model)
            if why is not None:
                raise ValueError(f"cpu_decoder: the model changed since the engine was made and is now {why}; make a "
                                 f"new HeteroSpec for it")
            self._pack()
        B, n = ids.shape
        rows = B * n
        H = self.hidden
        if kv.dim() != 6 or kv.dtype != torch.float32 or kv.stride(5) != 1 or kv.stride(4) != self.head_dim \
                or B > kv.shape[0]:
            raise ValueError(f"cpu_decoder: argument 'kv' expected a float32 cache [>= {B}, 2, layers, kv_heads, "
                             f"capacity, {self.head_dim}] with contiguous columns, got {tuple(kv.shape)} {kv.dtype}")
        h = torch.nn.functional.embedding(ids.reshape(-1), self.embed.weight).contiguous()
        cos, sin = self.rotary(h.view(B, n, H), positions)
        if cos.shape[-1] != self.head_dim:
            raise ValueError(f"cpu_decoder: the model's rotary tables cover {cos.shape[-1]} of {self.head_dim} "
                             f"head dimensions (partial rotary is not supported)")
        cos = cos.expand(B, n, -1).contiguous()
        sin = sin.expand(B, n, -1).contiguous()
        req = torch.arange(B, device="cpu").repeat_interleave(n)
        slot = slots.expand(B, n).reshape(-1).contiguous()
        W = allowed.shape[-1]
        allowed = allowed.expand(B, n, W).reshape(rows, W).contiguous()
        if keep is None:
            out_rows, k = None, rows
        else:
            k = min(int(keep), n)
            out_rows = (torch.arange(B, device="cpu").view(B, 1) * n
                        + torch.arange(n - k, n, device="cpu").view(1, k)).reshape(-1)
            k = B * k
        logits = torch.empty(k, self.vocab, device="cpu")   # (never the default device)
        bufs = [torch.empty(rows, H, device="cpu") for _ in taps] if taps else []
        tap_at = list(taps or []) + [-1] * (3 - len(bufs))
        addrs = [b.data_ptr() for b in bufs] + [0] * (3 - len(bufs))
        s = kv.stride()
        self._g.decoder_forward(self._desc, self.eps, self.scale,
                                (kv.data_ptr(), kv.shape[0], kv.shape[4], s[0], s[1], s[2], s[3]),
                                h.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), req.data_ptr(), slot.data_ptr(),
                                allowed.data_ptr(), W, tuple(tap_at), tuple(addrs),
                                0 if out_rows is None else out_rows.data_ptr(), k, logits.data_ptr(), self.isa, 0)
        return logits.view(B, -1, self.vocab), ([b.view(B, n, H) for b in bufs] if taps else None)


def why_off(setting, model, *, compile=False):
    """Why a ``cpu_decoder`` setting leaves ``model`` on transformers' forward (a phrase; 'off' for False), or None
    when the decoder runs it (:func:`for_target`'s rule, without packing anything)."""
    if not cpu_gemm.one_of(setting, SETTINGS):
        raise ValueError(f"HeteroSpec: argument 'cpu_decoder' expected 'auto', True or False, got {setting!r}")
    if setting is False:
        return "off"
    why = "a compiled target (compile=...)" if compile else unsupported(model)
    if why is None and setting == "auto" and cpu_gemm._rows_module().isa_best() == 0:
        why = "only the kernel's portable loop on this CPU"
    return why


_SHARED = weakref.WeakKeyDictionary()   # model -> its CpuDecoder: one packed copy however many engines use it


def for_target(setting, model, *, compile=False):
    """The decoder a ``cpu_decoder`` setting gives ``model`` (None: transformers' forward).  'auto': on where the
    model is supported (:func:`unsupported`), not compiled, and the kernel has AVX2 or AVX-512 tiles here (its
    portable loop is ~8x slower than AVX2); True insists (ValueError naming why not); False: off."""
    why = why_off(setting, model, compile=compile)
    if setting is False:
        return None
    if why is not None:
        if setting is True:
            raise ValueError(f"HeteroSpec: argument 'cpu_decoder' expected False or 'auto' here (True needs a "
                             f"supported float32 CPU model, no compile, and heterospec._gemm), got True for {why}")
        return None
    dec = _SHARED.get(model)
    if dec is None:
        dec = _SHARED[model] = CpuDecoder(model)
    return dec
