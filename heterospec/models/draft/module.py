"""The EAGLE-3 draft module: RoPE and the one-layer draft (:class:`Eagle3Draft`: fuse, forward, step, head,
cache).

The draft is one Llama-style decoder layer whose attention input is 2H wide (the token embedding
concatenated with a hidden state), a fusion layer ``fc`` in front of it, and a reduced-vocabulary LM head
(SafeAILab's EAGLE-3 ``cnets.Model``).  Parameter names are SafeAILab's (``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, ``embed_tokens``).

Calling convention (what the decoding loop uses)::

    draft = Eagle3Draft.from_pretrained(path, target)       # strict: every problem in one ValueError
    hidden = draft.fuse(taps)                                # [B, S, 3*T_H] -> [B, S, H]
    logits, h_out, (k, v) = draft(hidden, input_ids, position_ids, past_kv=None, attn_mask=None)
    #  logits [B, S, Vd] float32 over the DRAFT vocabulary; h_out [B, S, H]: feed it back as `hidden`;
    #  (k, v) [B, nkv, P+S, hd]: past + new keys (RoPE applied) / values -- crop by slicing dim 2.
    target_ids = draft.map_tokens(draft_ids)                 # ids + d2t[ids]
    taps = draft.config.tap_layers(num_target_layers)        # input-of-layer ids of the 3 taps

The config switches (``fc_norm``, ``norm_before_fc``, ``norm_before_residual``, ``norm_output``,
``norm_hidden_out``, ``qk_norm``) and the tap-layer conventions are described in ``config.py``; the
checkpoint layouts and key names :meth:`Eagle3Draft.from_pretrained` reads in ``checkpoint.py``.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import read_config, read_state, write_checkpoint
from .config import NUM_TAPS, Eagle3Config

# ------------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------------

def rope_inv_freq(config: Eagle3Config, seq_len: int | None = None, device=None) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], float32, for ``config``'s rope_theta / rope_scaling.

    * default: ``1 / theta ** (2i / hd)``;
    * ``linear``: divided by ``factor`` (the same as dividing the positions by it);
    * ``dynamic`` (NTK): when ``seq_len`` > max_position_embeddings the base becomes
      ``theta * (factor * seq_len / max_pos - (factor - 1)) ** (hd / (hd - 2))``, else unchanged;
    * ``llama3``: wavelengths above ``original_max / low_freq_factor`` are divided by ``factor``, those
      below ``original_max / high_freq_factor`` are kept, and the band between is interpolated.
    """
    dim = config.head_dim
    base = config.rope_theta
    rs = config.rope_scaling or {}
    rtype = rs.get("rope_type", "default")
    mpe = config.max_position_embeddings
    if rtype == "dynamic" and seq_len is not None and seq_len > mpe:
        f = rs["factor"]
        base = base * ((f * seq_len / mpe) - (f - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    inv = 1.0 / (base ** exponents)
    if rtype == "linear":
        inv = inv / rs["factor"]
    elif rtype == "llama3":
        f, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        long_wave = wavelen > old / lo          # low frequencies: fully scaled
        short_wave = wavelen < old / hi         # high frequencies: untouched
        scaled = torch.where(long_wave, inv / f, inv)
        if hi != lo:
            s = (old / wavelen - lo) / (hi - lo)
            blend = (1 - s) * scaled / f + s * scaled
            scaled = torch.where(~long_wave & ~short_wave, blend, scaled)
        inv = scaled
    return inv


def write_at(dst, slots, src):
    """A static cache's write: ``src`` [B, heads, S, D] into ``dst`` [B, heads, C, D] at columns ``slots`` -- [S],
    the same columns in every row (one ``index_copy_``), or [B, S], each row its own (a ``scatter_`` on a GPU, an
    ``index_put_`` on the CPU).  torch's CPU ``scatter_`` of bfloat16 and float16 costs about the destination's
    size, not the write's: on a 2-core Xeon, 64 rows of one layer's keys (1,288 columns) took 23.6 ms a call
    against 25 us as an ``index_put_`` (float32: 26 against 14 us), and a batched bf16 step calls it twice a
    layer."""
    src = src.to(dst.dtype)
    if slots.dim() == 2 and slots.shape[0] == 1:
        slots = slots[0]         # one row's own columns are the same columns in every row: the faster copy
    if slots.dim() == 1:
        dst.index_copy_(2, slots, src)
    elif dst.device.type == "cpu":
        B, H, S = src.shape[:3]
        rows = torch.arange(B, device=dst.device).view(B, 1, 1)
        heads = torch.arange(H, device=dst.device).view(1, H, 1)
        dst.index_put_((rows, heads, slots.view(B, 1, S)), src)
    else:
        dst.scatter_(2, slots[:, None, :, None].expand(-1, src.shape[1], -1, src.shape[3]), src)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


# ------------------------------------------------------------------------------------------------------
# modules
# ------------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in float32, cast back to the input dtype, then scaled."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c.rms_norm_eps)
            self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        eps = c.rms_norm_eps
        self.hidden_norm = RMSNorm(c.hidden_size, eps)
        self.input_layernorm = RMSNorm(c.hidden_size, eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps)
        self.mlp = _MLP(c)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft: ``fc`` (+ optional ``fc_norm`` / ``input_norm``), one ``midlayer``, ``norm``,
    ``lm_head`` over the draft vocabulary, the frozen target embedding ``embed_tokens``, and the vocabulary
    maps ``d2t`` (draft id -> target id offset, int64 [Vd]) and ``t2d`` (target id in the draft
    vocabulary, bool [V]).

    ``embed_tokens`` (a [V, H] tensor, optional) initialises the embedding; its storage is shared, not
    copied.  Without it the embedding is randomly initialised (tests, training from scratch).  The
    default ``d2t`` is zeros (identity) with ``t2d`` true on ids < Vd, which are consistent.
    """

    def __init__(self, config: Eagle3Config, embed_tokens: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(config, Eagle3Config):
            raise TypeError(f"Eagle3Draft: config must be an Eagle3Config, got {type(config).__name__}")
        c = self.config = config
        H, T, V, Vd = c.hidden_size, c.target_hidden_size, c.vocab_size, c.draft_vocab_size
        self.fc = nn.Linear(NUM_TAPS * T, H, bias=False)
        self.fc_norm = nn.ModuleList([RMSNorm(T, c.rms_norm_eps) for _ in range(NUM_TAPS)]) if c.fc_norm else None
        self.input_norm = RMSNorm(NUM_TAPS * T, c.rms_norm_eps) if c.norm_before_fc else None
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        if embed_tokens is not None:
            self.embed_tokens = nn.Embedding(V, H, _weight=self._check_embedding(embed_tokens), _freeze=True)
        else:
            self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(V) < Vd)
        self._inv_freq_cache = {}

    # ---- helpers -------------------------------------------------------------------------------------

    def _check_embedding(self, w):
        c = self.config
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"Eagle3Draft: embed_tokens must be a [{c.vocab_size}, {c.hidden_size}] tensor "
                             f"(vocab_size, hidden_size), got {getattr(w, 'shape', type(w).__name__)}")
        return w.detach()

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def _inv_freq(self, device, seq_len):
        rs = self.config.rope_scaling or {}
        if rs.get("rope_type") == "dynamic" and seq_len > self.config.max_position_embeddings:
            return rope_inv_freq(self.config, seq_len=seq_len, device=device)
        key = str(device)
        inv = self._inv_freq_cache.get(key)
        if inv is None:
            inv = self._inv_freq_cache[key] = rope_inv_freq(self.config, device=device)
        return inv

    # ---- the public calls ----------------------------------------------------------------------------

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """[B, S, 3*T_H] target taps (low, mid, high) -> [B, S, H]: ``fc_norm`` / ``input_norm`` if
        configured, then ``fc``.  The taps are cast to the draft's dtype."""
        c = self.config
        if not isinstance(taps, torch.Tensor) or taps.dim() != 3 or taps.shape[-1] != NUM_TAPS * c.target_hidden_size:
            raise ValueError(f"Eagle3Draft.fuse: taps must be [B, S, {NUM_TAPS * c.target_hidden_size}] "
                             f"(3 x target_hidden_size), got {getattr(taps, 'shape', type(taps).__name__)}")
        x = taps.to(self.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(NUM_TAPS, dim=-1))], dim=-1)
        return self.fc(x)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                past_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                attn_mask: torch.Tensor | None = None):
        """One draft step over S new rows.

        hidden [B, S, H]: fused taps (:meth:`fuse`) or the draft's own earlier ``h_out`` rows.
        input_ids [B, S]: TARGET-vocabulary ids (map draft ids with :meth:`map_tokens` first).
        position_ids [B, S] int64 (a [1, S] or [S] tensor is broadcast over the batch).
        past_kv: None or (k, v), each [B, nkv, P, hd], as returned by an earlier call (crop by slicing).
        attn_mask: None = causal over past + new (row s sees all P past keys and new keys <= s), or a bool
        tensor [S, P+S] (or [B, S, P+S]), True = may attend, used as is.  A row that may attend to
        nothing gives NaN.

        Returns ``(logits [B, S, Vd] float32, h_out [B, S, H], (k, v) [B, nkv, P+S, hd])``: the logits
        are ``lm_head(norm(h2))`` (``lm_head(h2)`` when ``config.norm_output`` is false), ``h_out`` is
        the state to feed back (``h2``, or ``norm(h2)`` when ``config.norm_hidden_out``), and k carries
        RoPE at its positions.  With dynamic RoPE beyond max_position_embeddings the frequencies depend on
        the largest position of the call (as in HF), so cached keys keep the frequencies they were made
        with.
        """
        c = self.config
        H, nkv, hd = c.hidden_size, c.num_key_value_heads, c.head_dim
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[-1] != H:
            hint = (" (target taps must go through fuse() first)"
                    if isinstance(hidden, torch.Tensor) and hidden.shape[-1] == NUM_TAPS * c.target_hidden_size
                    else "")
            raise ValueError(f"Eagle3Draft.forward: hidden must be [B, S, {H}], got "
                             f"{getattr(hidden, 'shape', type(hidden).__name__)}{hint}")
        B, S = hidden.shape[0], hidden.shape[1]
        if not isinstance(input_ids, torch.Tensor) or tuple(input_ids.shape) != (B, S):
            raise ValueError(f"Eagle3Draft.forward: input_ids must be [{B}, {S}], got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        if not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != S or position_ids.dim() > 2 \
                or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, B)):
            raise ValueError(f"Eagle3Draft.forward: position_ids must be [{B}, {S}], got "
                             f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
        if S == 0:
            raise ValueError("Eagle3Draft.forward: no rows (S = 0)")
        position_ids = position_ids.reshape(-1, S).expand(B, S)
        P = 0
        if past_kv is not None:
            if not isinstance(past_kv, (tuple, list)) or len(past_kv) != 2:
                raise ValueError("Eagle3Draft.forward: past_kv must be None or a (k, v) pair")
            pk, pv = past_kv
            if pk.dim() != 4 or tuple(pk.shape[:2]) != (B, nkv) or pk.shape[3] != hd or pk.shape != pv.shape:
                raise ValueError(f"Eagle3Draft.forward: past_kv tensors must both be [{B}, {nkv}, P, {hd}], got "
                                 f"{tuple(pk.shape)} and {tuple(pv.shape)}")
            P = pk.shape[2]
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool \
                    or attn_mask.shape[-2:] != (S, P + S) \
                    or attn_mask.dim() not in (2, 3) or (attn_mask.dim() == 3 and attn_mask.shape[0] != B):
                raise ValueError(f"Eagle3Draft.forward: attn_mask must be a bool tensor [{S}, {P + S}] "
                                 f"(or [{B}, {S}, {P + S}]), got {attn_mask.dtype} {tuple(attn_mask.shape)}")
            mask = attn_mask if attn_mask.dim() == 2 else attn_mask.unsqueeze(1)
            mask = mask.to(hidden.device)
        elif S > 1:
            mask = torch.ones(S, P + S, dtype=torch.bool, device=hidden.device).tril(diagonal=P)
        else:
            mask = None  # one new row sees everything

        q, k, v, h, hn = self._project(hidden, input_ids, position_ids)
        if P:
            k = torch.cat((past_kv[0].to(k.dtype), k), dim=2)
            v = torch.cat((past_kv[1].to(v.dtype), v), dim=2)
        logits, h_out = self.head(self._attend(q, k, v, mask, h, hn))
        return logits, h_out, (k, v)

    def _project(self, hidden, input_ids, position_ids):
        """The new rows' queries, keys (RoPE at their positions) and values [B, heads, S, hd], with the
        residual input h and its norm hn."""
        c = self.config
        B, S = hidden.shape[0], hidden.shape[1]
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        position_ids = position_ids.reshape(-1, S).expand(B, S)
        m = self.midlayer
        dtype = self.dtype
        h = hidden.to(dtype)
        e = self.embed_tokens(input_ids.to(self.embed_tokens.weight.device)).to(dtype)
        hn = m.hidden_norm(h)
        a = torch.cat((m.input_layernorm(e), hn), dim=-1)        # embedding first, hidden second

        att = m.self_attn
        q = att.q_proj(a).view(B, S, nh, hd)
        k = att.k_proj(a).view(B, S, nkv, hd)
        v = att.v_proj(a).view(B, S, nkv, hd).transpose(1, 2)
        if att.q_norm is not None:
            q, k = att.q_norm(q), att.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)

        cos, sin = self.rope_tables(position_ids, q.device, q.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v, h, hn

    def rope_tables(self, position_ids, device, dtype):
        """RoPE's cos and sin [B, S, head_dim] in ``dtype`` at ``position_ids`` [B, S] (what queries and keys are
        rotated with: ``x * cos + rotate_half(x) * sin``)."""
        # dynamic RoPE depends on the largest position: a host read (only for rope_type "dynamic")
        rs = self.config.rope_scaling or {}
        seq_len = int(position_ids.max()) + 1 if rs.get("rope_type") == "dynamic" else 0
        inv = self._inv_freq(device, seq_len)
        freqs = position_ids.to(device, torch.float32).unsqueeze(-1) * inv      # [B, S, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _attend(self, q, k, v, mask, h, hn):
        """Attention of q over all keys k / values v [B, nkv, P+S, hd] under ``mask``, then the MLP: the
        layer output h2 [B, S, H]."""
        c = self.config
        B, S = q.shape[0], q.shape[2]
        m = self.midlayer
        rep = c.num_attention_heads // c.num_key_value_heads
        kr = k if rep == 1 else k.repeat_interleave(rep, dim=1)
        vr = v if rep == 1 else v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        o = m.self_attn.o_proj(o.transpose(1, 2).reshape(B, S, c.num_attention_heads * c.head_dim))
        h1 = (hn if c.norm_before_residual else h) + o
        return h1 + m.mlp(m.post_attention_layernorm(h1))

    def head(self, h2):
        """Layer output h2 [..., H] -> (logits [..., Vd] float32, h_out [..., H]): ``lm_head(norm(h2))``
        (``lm_head(h2)`` when ``config.norm_output`` is false) and the state to feed back (``h2``, or
        ``norm(h2)`` when ``config.norm_hidden_out``)."""
        c = self.config
        normed = self.norm(h2)
        logits = self.lm_head(normed if c.norm_output else h2).float()
        return logits, (normed if c.norm_hidden_out else h2)

    def new_cache(self, capacity, batch=1, dtype=None):
        """A static key/value cache for :meth:`step`: one [2, batch, nkv, capacity, hd] tensor in ``dtype`` (default:
        the draft's) on its device."""
        c = self.config
        return torch.zeros((2, batch, c.num_key_value_heads, capacity, c.head_dim),
                           dtype=self.dtype if dtype is None else dtype, device=self.device)

    def step(self, hidden, input_ids, position_ids, cache, slots, attn_mask):
        """One draft step on a static cache (the engine's path; no shape depends on the sequence length).

        hidden [B, S, H], input_ids [B, S] (target ids), position_ids [B, S] as in :meth:`forward`;
        ``cache`` from :meth:`new_cache`; this step's keys and values are written at cache columns
        ``slots`` [S] (int64, on the device; the same columns in every row) or [B, S] (each row its own);
        ``attn_mask`` bool [S, C] or [B, S, C] over all C cache columns (True = may attend; the rows' own
        columns included).  Returns the layer output h2 [B, S, H]: pass the rows you need through :meth:`head`."""
        q, k, v, h, hn = self._project(hidden, input_ids, position_ids)
        write_at(cache[0], slots, k)
        write_at(cache[1], slots, v)
        mask = attn_mask if attn_mask.dim() == 2 else attn_mask.unsqueeze(1)
        # (a half draft on the float32 cache of cpu_decoder's C layer, while a hook of the user's sends it here)
        keys, values = (cache[0], cache[1]) if cache.dtype == q.dtype else (cache[0].to(q.dtype), cache[1].to(q.dtype))
        return self._attend(q, keys, values, mask, h, hn)

    def map_tokens(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids: ``ids + d2t[ids]`` (int64, on ``d2t``'s device)."""
        ids = torch.as_tensor(draft_ids, device=self.d2t.device).long()
        return ids + self.d2t[ids]

    # ---- loading -------------------------------------------------------------------------------------

    @classmethod
    def _empty(cls, config, dtype, device):
        """The module with uninitialised storage (no random init of V x H tables)."""
        with torch.device("meta"):
            model = cls(config)
            # a placeholder, so that to_empty does not allocate a V x H table that is replaced anyway
            model.embed_tokens.weight = nn.Parameter(torch.empty(0, config.hidden_size), requires_grad=False)
        model = model.to(dtype)
        model.to_empty(device=device)
        model._inv_freq_cache = {}
        return model

    @classmethod
    def from_pretrained(cls, path, target=None, *, dtype: torch.dtype | None = None, device=None) -> "Eagle3Draft":
        """Load a draft checkpoint directory strictly.

        Reads ``config.json`` and the weights (layouts and name normalisation: see ``checkpoint.py``).
        Every problem -- missing / unexpected / wrongly shaped / duplicate (after renaming) keys, a
        missing ``d2t`` while Vd != V, a ``d2t`` mapping outside the target vocabulary, a ``t2d`` that
        disagrees with ``d2t``, and with ``target`` (a HF causal LM) vocabulary / hidden-size / tap-layer
        mismatches -- is collected and raised as ONE ValueError.  Unreadable or corrupt files raise a
        ValueError naming the file; a missing directory, config or weight file raises FileNotFoundError.

        The embedding: the checkpoint's ``embed_tokens.weight`` if present, else
        ``target.get_input_embeddings().weight`` (shared, not copied, when dtype and device already match;
        impossible when target_hidden_size != hidden_size).  With no embedding anywhere this is an error.

        When Vd == V the vocabulary maps are the identity whatever the checkpoint holds (as SafeAILab's
        ``EaModel`` does: it deletes them); a non-identity ``d2t`` there is ignored with a warning.  When
        ``t2d`` is absent it is derived from ``d2t``.

        dtype: None = the target embedding's dtype when a target is given, else the checkpoint's (that of
        ``fc.weight``).  device: None = the target
        embedding's device when a target is given, else CPU.
        """
        path = Path(path)
        config = read_config(path)
        # expected names and shapes, from the module itself
        try:
            expected = {k: tuple(t.shape) for k, t in cls._meta_state(config).items()}
        except RuntimeError as e:   # sizes whose product torch cannot even describe (on the meta device)
            raise ValueError(f"{path / 'config.json'}: invalid EAGLE-3 config: its sizes make a weight larger than "
                             f"torch can describe ({str(e).splitlines()[0]})") from None
        values, embedding, target_embedding = read_state(path, config, expected, target)

        if dtype is None:  # the draft runs next to its target: take the target's dtype, as its device below
            dtype = target_embedding.dtype if target_embedding is not None else values["fc.weight"].dtype
        if device is None:
            device = target_embedding.device if target_embedding is not None else torch.device("cpu")
        device = torch.device(device)
        model = cls._empty(config, dtype, device)
        with torch.no_grad():
            own = dict(model.named_parameters())
            own.update(dict(model.named_buffers()))
            own.pop("embed_tokens.weight")
            assert set(own) == set(values), (set(own) ^ set(values))
            for k, t in values.items():
                own[k].copy_(t)
            w = embedding.detach()
            if w.dtype != dtype or w.device != device:
                w = w.to(device=device, dtype=dtype)
            model.embed_tokens.weight = nn.Parameter(w, requires_grad=False)
        return model

    @staticmethod
    def _meta_state(config):
        with torch.device("meta"):
            return Eagle3Draft(config).state_dict()

    def save_pretrained(self, path, *, save_embedding: bool = False) -> None:
        """Write ``config.json`` (:meth:`Eagle3Config.to_dict` plus ``torch_dtype``) and
        ``model.safetensors`` in SafeAILab names, ``d2t`` / ``t2d`` included.  ``embed_tokens.weight`` is
        written only when target_hidden_size != hidden_size (the target's embedding cannot stand in for
        it) or ``save_embedding`` is true.  Loading the result gives equal tensors and an equal config."""
        write_checkpoint(path, self.config, self.state_dict(), self.dtype, save_embedding=save_embedding)
