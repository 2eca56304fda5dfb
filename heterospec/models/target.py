"""The HuggingFace target adapter: taps, tree verification on the model's own DynamicCache, KV commit.

One forward verifies a whole draft tree: the N+1 tree tokens go in with explicit ``position_ids`` (prefix
length + depth), ``cache_position`` and a 4D additive mask whose tree block is the ancestor-or-self mask,
so each node sees the committed prefix and exactly its ancestors.  After acceptance every layer's keys and
values are compacted in place with :func:`heterospec.ops.kv_compact` (accepted slots moved behind the
prefix) and the cache is cropped.  The three EAGLE-3 taps (the residual stream entering layers 2, L//2 and
L-3 by default) are captured with forward pre-hooks, so the model never has to return all hidden states.

Tested with transformers 5.x (Llama, Qwen2, Qwen3).
"""
from __future__ import annotations

import inspect

import torch

from .. import ops

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


def default_tap_layers(num_layers):
    """EAGLE-3's default taps in the input-of-layer convention: [2, L//2, L-3]."""
    return [2, num_layers // 2, num_layers - 3]


def _core_has_cuda():
    from .. import build_info

    return bool(build_info().get("cuda"))


_CORE_HAS_CUDA = _core_has_cuda()


def kv_compact_torch(tensors, prefix, path):
    """:func:`heterospec.ops.kv_compact` in torch ops, for caches on a device the C core was not built
    for: slots ``prefix + path[i]`` move to ``prefix + i`` along dim 2 of every [B, H, S, D] tensor."""
    if not tensors:
        return
    idx = torch.as_tensor(path, dtype=torch.long).to(tensors[0].device) + prefix
    n = idx.numel()
    for t in tensors:
        t[:, :, prefix:prefix + n] = t.index_select(2, idx)  # index_select copies first: overlap is safe


def _crop(cache, new_length):
    """Crop a DynamicCache to new_length positions, across the transformers crop conventions."""
    current = cache.get_seq_length()
    if new_length == current:
        return
    param = next(iter(inspect.signature(cache.crop).parameters))
    cache.crop(new_length - current if param == "tokens_to_remove" else new_length)


class TargetAdapter:
    """Drives a HuggingFace causal LM as the speculative-decoding target (batch 1).

    ``length`` is the number of committed positions whose keys/values are in the cache.
    """

    def __init__(self, model, tap_layers=None, capture_taps=True):
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
        self.tap_layers = list(default_tap_layers(n) if tap_layers is None else tap_layers)
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
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.cache = None
        self.length = 0

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

    def reset(self):
        from transformers import DynamicCache

        try:
            self.cache = DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            self.cache = DynamicCache()
        self.length = 0

    @torch.no_grad()
    def prefill(self, input_ids):
        """Run the prompt [1, S]; returns (logits of the last position [V] float32, taps [1, S, 3H] or None)."""
        self.reset()
        S = input_ids.shape[1]
        out = self.model(
            input_ids=input_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.length = S
        return out.logits[0, -1].float(), self._taps()

    @torch.no_grad()
    def verify(self, tree_tokens, tree_depths, tree_mask):
        """One forward over a verification tree. tree_tokens/tree_depths [n] int64, tree_mask [n, n] bool.

        Returns (logits [n, V] float32, taps [1, n, 3H] or None).  The tree's keys/values are appended to the
        cache at slots length .. length+n-1 until :meth:`commit`."""
        n = tree_tokens.shape[0]
        P = self.length
        if self.max_positions is not None and P + n > self.max_positions:
            raise ValueError(
                f"target: the sequence would need {P + n} positions, more than max_position_embeddings "
                f"= {self.max_positions}"
            )
        ids = tree_tokens.view(1, n).to(self.device)
        position_ids = (tree_depths + P).view(1, n).to(self.device)
        cache_position = torch.arange(P, P + n, device=self.device)
        mask = torch.zeros((1, 1, n, P + n), dtype=self.dtype, device=self.device)
        mask[0, 0, :, P:].masked_fill_(~tree_mask.to(self.device), torch.finfo(self.dtype).min)
        out = self.model(
            input_ids=ids,
            position_ids=position_ids,
            cache_position=cache_position,
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.logits[0].float(), self._taps()

    def kv_tensors(self):
        layers = getattr(self.cache, "layers", None)
        if layers is not None:
            return [t for layer in layers for t in (layer.keys, layer.values)]
        return list(self.cache.key_cache) + list(self.cache.value_cache)  # transformers 4.x

    def commit(self, path):
        """Keep the tree slots of ``path`` (tree node indices, ascending, starting with the root): move them
        behind the committed prefix in every layer and crop the rest."""
        kv = self.kv_tensors()
        if kv and kv[0].device.type != "cpu" and not _CORE_HAS_CUDA:
            kv_compact_torch(kv, self.length, path)  # until the CUDA kernels land: torch ops on the device
        else:
            ops.kv_compact(kv, self.length, path)
        self.length += int(path.shape[0])
        _crop(self.cache, self.length)
