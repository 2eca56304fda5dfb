"""The HuggingFace target: its EAGLE-3 taps, and tree verification on a static key/value cache we own.

One forward verifies a whole draft tree: the tree tokens go in with explicit ``position_ids`` (prefix
length + depth) and a 4D additive mask over the whole cache, in which each node sees the committed prefix
and exactly its ancestors.  Keys and values live in one preallocated tensor ``[2, layers, 1, kv_heads,
capacity, head_dim]``; a forward writes its rows at the slots the engine chose (prefix length + row), and
commit moves the accepted slots behind the prefix with :func:`heterospec.ops.kv_compact` -- one call, one
launch on a GPU, with the prefix length a device tensor, so nothing in a cycle needs the host.

Why our own cache: transformers' ``StaticCache`` (5.x) writes at a counter it advances on every call and
ignores ``cache_position``, so it cannot overwrite rejected tree slots, and its layer API changed between
5.0 and 5.23.  A 4D mask makes every supported version skip its own mask construction, so the model only
ever calls ``update(keys, values, layer_idx, ...)`` on the cache.

The three EAGLE-3 taps (the residual stream entering layers 2, L//2 and L-3 by default) are captured with
forward pre-hooks, so the model never has to return all hidden states.

Tested with transformers 5.x (Llama, Qwen2, Qwen3; sdpa and eager attention).
"""
from __future__ import annotations

import torch

from .. import ops
from .draft.config import default_tap_layers

TREE_MASK_ATTN = ("sdpa", "eager")


def _decoder_layers(model):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None) if base is not None else None
    if layers is None:
        raise TypeError(
            f"target: expected a HuggingFace decoder-only LM with model.model.layers (Llama family), "
            f"got {type(model).__name__}"
        )
    return layers


def _cache_base():
    from transformers import Cache

    return Cache


class StaticKV(_cache_base()):
    """A transformers ``Cache`` over our own storage: ``update`` writes the new keys/values of layer
    ``layer_idx`` at cache columns ``self.slots`` (set by the caller before each forward) and returns the
    whole layer, which the caller's 4D mask restricts.  ``Cache.__init__`` is deliberately not called: no
    layer objects, no counters."""

    is_compileable = False

    def __init__(self, kv):
        self.kv = kv
        self.slots = None
        self.layers = []

    window = None   # columns attended to (None: all); set per forward, see TargetAdapter.verify

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.kv[0, layer_idx], self.kv[1, layer_idx]
        if key_states.shape[1] != k.shape[1] or key_states.shape[3] != k.shape[3]:
            raise ValueError(f"target cache: layer {layer_idx} produced keys {tuple(key_states.shape)}, the cache "
                             f"holds [1, {k.shape[1]}, S, {k.shape[3]}] (num_key_value_heads / head_dim of the config)")
        k.index_copy_(2, self.slots, key_states.to(k.dtype))
        v.index_copy_(2, self.slots, value_states.to(v.dtype))
        if self.window is not None:
            return k[:, :, :self.window], v[:, :, :self.window]
        return k, v

    def get_seq_length(self, layer_idx=0):
        raise RuntimeError("target cache: the engine passes position_ids and a 4D mask, so the model should "
                           "never ask the cache for its length")


def attention_window(device, used, nodes):
    """The columns a verification forward attends to (``TargetAdapter.verify``'s ``window``): on the CPU the
    ``used`` positions (committed tokens and the root) plus room for ``nodes`` tree rows, rounded up to 64 so
    that a run sees few distinct widths (attention over unused columns is real work there); None on a GPU,
    where every cycle keeps the whole cache so that a tree shape has one recorded shape."""
    if getattr(device, "type", device) == "cuda":
        return None
    return -(-(used + nodes) // 64) * 64


def _kv_shape(config):
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, kv_heads, head_dim


def _compiled(model, backend):
    """``torch.compile(model, dynamic=False)`` with ``backend`` (True: inductor): one specialisation per
    forward shape (prompt lengths, tree buckets), so the recompile limit is raised to 256 shapes."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    return torch.compile(model, dynamic=False, backend="inductor" if backend is True else backend)


class TargetAdapter:
    """Drives a HuggingFace causal LM as the speculative-decoding target (batch 1) on a static cache.

    ``prefix`` is a one-element int64 tensor on the model's device: the number of committed positions.
    :meth:`allocate` sizes the cache (prompt + new tokens + the largest tree); the engine calls it before
    decoding, outside the cycle.  ``compile``: run the verify forward through ``torch.compile`` (True or a
    backend name; one specialisation per tree size), fewer kernels per forward before CUDA-graph capture.
    The prefill stays eager: its length changes with every prompt."""

    def __init__(self, model, tap_layers=None, capture_taps=True, compile=None):
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in TREE_MASK_ATTN:
            raise ValueError(
                f"target: attn_implementation {impl!r} cannot take a tree attention mask; expected one of "
                f"{TREE_MASK_ATTN} (load the model with attn_implementation='sdpa', or call "
                f"model.set_attn_implementation('sdpa'))"
            )
        self.model = model
        layers = _decoder_layers(model)
        n = len(layers)
        # the engine and the trace recorder pass a loaded head's own, checked taps; the default here (no draft,
        # a draft without an EAGLE-3 config, training's collection) stays unchecked below 7 layers, as before
        self.tap_layers = list(default_tap_layers(n, strict=False) if tap_layers is None else tap_layers)
        bad = [i for i in self.tap_layers if not 0 <= i < n]
        if len(self.tap_layers) != 3 or bad:
            raise ValueError(
                f"target: expected 3 tap layers in [0, {n}) (input-of-layer ids), got {self.tap_layers}"
            )
        self._captured = {}
        self._hooks = []
        if capture_taps:
            for i in self.tap_layers:
                self._hooks.append(layers[i].register_forward_pre_hook(self._make_hook(i), with_kwargs=True))
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.capacity = 0
        self.kv = None
        self.cache = None
        self.prefix = torch.zeros(1, dtype=torch.long, device=self.device)
        self._call = model if not compile else _compiled(model, compile)

    def _make_hook(self, i):
        def hook(module, args, kwargs):
            self._captured[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _taps(self):
        if not self._hooks:
            return None
        return torch.cat([self._captured[i] for i in self.tap_layers], dim=-1)

    def allocate(self, capacity):
        """Make room for ``capacity`` positions (kept when already large enough; never inside a cycle)."""
        if capacity <= self.capacity:
            return
        layers, kv_heads, head_dim = _kv_shape(self.model.config)
        self.kv = torch.zeros((2, layers, 1, kv_heads, capacity, head_dim), dtype=self.dtype, device=self.device)
        self.cache = StaticKV(self.kv)
        # one tensor for kv_compact, imported once: [2 * layers * kv_heads, capacity, head_dim]
        self._kv_rows = ops.KVTensors([self.kv.view(-1, capacity, head_dim)])
        self._cols = torch.arange(capacity, device=self.device)
        self.capacity = capacity
        self._neg = torch.finfo(self.dtype).min

    def _forward(self, ids, positions, slots, allowed, call=None, **kw):
        """ids/positions [1, n], slots [n] cache columns to write, allowed bool [n, window or capacity];
        ``call``: the model or its compiled forward (default: the model)."""
        self.cache.slots = slots
        self.cache.window = allowed.shape[1] if allowed.shape[1] < self.capacity else None
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, self._neg)
        return (self.model if call is None else call)(input_ids=ids, position_ids=positions, cache_position=slots,
                          attention_mask=mask.view(1, 1, *allowed.shape), past_key_values=self.cache,
                          use_cache=True, **kw)

    @torch.no_grad()
    def prefill(self, input_ids):
        """Run the prompt [1, S] (the cache must hold S positions); returns (logits of the last position [V]
        float32, taps [1, S, 3H] or None).  Sets ``prefix`` to S."""
        S = input_ids.shape[1]
        if S > self.capacity:
            self.allocate(S)
        rows = self._cols[:S]
        allowed = self._cols[:S].view(1, -1) <= rows.view(-1, 1)    # causal over the prompt (S columns)
        out = self._forward(input_ids, rows.view(1, S), rows, allowed, logits_to_keep=1)
        self.prefix.fill_(S)
        return out.logits[0, -1].float(), self._taps()

    @torch.no_grad()
    def verify(self, tree_tokens, tree_depths, tree_mask, window=None):
        """One forward over a verification tree: tree_tokens/tree_depths [n] int64, tree_mask [n, n] bool
        (ancestor-or-self), all on the model's device.  Rows are written at cache columns prefix .. prefix+n-1
        (until :meth:`commit`).  ``window`` (a host int >= prefix + n, or None = the whole cache): attend to
        the first ``window`` columns only -- on the CPU, where attention over unused columns is real work;
        a GPU keeps the whole cache so every cycle has the same shape.  Returns (logits [n, V] float32,
        taps [1, n, 3H] or None)."""
        n = tree_tokens.shape[0]
        P = self.prefix
        W = self.capacity if window is None else min(window, self.capacity)
        slots = P + self._cols[:n]
        allowed = (self._cols[:W] < P).expand(n, W).clone()
        allowed.scatter_(1, slots.expand(n, n), tree_mask)           # the tree block: ancestors and self
        out = self._forward(tree_tokens.view(1, n), (tree_depths + P).view(1, n), slots, allowed, call=self._call)
        return out.logits[0].float(), self._taps()

    def commit(self, path, length, *, check=True):
        """Keep the tree slots of ``path`` (tree node indices, ascending from the root, padded with -1 as the
        verify ops' device outputs are): move them behind the committed prefix in every layer and advance
        ``prefix`` by ``length`` (a 0-d / 1-element device tensor)."""
        ops.kv_compact(self._kv_rows, self.prefix, path, check=check)
        self.prefix += length
