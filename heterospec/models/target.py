"""The HuggingFace target: its EAGLE-3 taps, and tree verification on a static key/value cache we own.

One forward verifies a whole draft tree: the tree tokens go in with explicit ``position_ids`` (prefix
length + depth) and a 4D additive mask over the whole cache, in which each node sees the committed prefix
and exactly its ancestors.  Keys and values live in preallocated tensors, one per shape the layers cache
(:func:`kv_layout`, probed once: a Llama's is one tensor ``[batch, 2, layers, kv_heads, capacity, head_dim]``;
multi-head latent attention caches two latents, Gemma 4 two head sizes); a forward writes its rows at the slots
the engine chose (prefix length + row), and commit moves the accepted slots behind the prefix with
:func:`heterospec.ops.kv_compact` -- one call, one launch on a GPU, with the prefix length a device tensor, so
nothing in a cycle needs the host.

A batch of B requests is B rows of the same cache, each with its own prefix length: a left-padded prompt
batch is prefilled in one forward and each row's prompt is then moved to column 0 (``kv_compact``), so a
row's cache never holds padding; every tree, commit and position is per row.

Why our own cache: transformers' ``StaticCache`` (5.x) writes at a counter it advances on every call and
ignores ``cache_position``, so it cannot overwrite rejected tree slots, and its layer API changed between
5.0 and 5.23.  A 4D mask makes every supported version skip its own mask construction, so the model only
ever calls ``update(keys, values, layer_idx, ...)`` on the cache.

The three EAGLE-3 taps (the residual stream entering layers 2, L//2 and L-3 by default) are captured with
forward pre-hooks, so the model never has to return all hidden states.

Sliding attention windows (:func:`sliding_layout`): a layer that slides sees a key at position k from a query at
position q only when k > q - window, as transformers' own masks say; the mask is restricted so for every layer
(the Mistral family) or passed per layer type in a dict (``config.layer_types``: Gemma 2/3, Qwen2/3 with
``use_sliding_window``, gpt-oss), so the output past the window is still the model's own.

Linear-attention layers (:func:`linear_layers`: Qwen3-Next, Qwen3.5, OLMo hybrid, Granite 4 hybrid, Bamba, Kimi
Linear, Bailing hybrid) keep a conv and a recurrent state instead of keys and values, in static tensors too
(:class:`StaticKV` answers transformers' linear-attention cache API).  Their recurrence cannot take a tree, so such
a target verifies chains only: a chain's forward reads the states and keeps nothing (``staged``), and
:meth:`TargetAdapter.commit` advances each row's states over its accepted nodes alone by running each layer's mixer
again on the inputs it had at those nodes (causal, so the same as a forward over the accepted tokens alone).

Tested with transformers 5.x (Llama, Qwen2, Qwen3; sdpa and eager attention; sliding windows on Mistral, Phi-3,
Qwen2, Gemma 3 and gpt-oss).
"""
from __future__ import annotations

import torch

from .. import ops
from .draft.config import default_tap_layers
from .draft.module import write_at
from .finite import mark_nonfinite

TREE_MASK_ATTN = ("sdpa", "eager")


# where a base model keeps its decoder layers: the Llama family and most others (.layers), GPT-2's descendants (.h),
# MPT and DBRX (.blocks), OPT (.decoder.layers)
_LAYER_LISTS = ("layers", "h", "blocks", "decoder.layers")


def _layer_list(base):
    for path in _LAYER_LISTS:
        found = base
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, torch.nn.ModuleList):
            return found
    return None


def layers_owner(model):
    """The base model whose forward runs the decoder layers (and holds the rotary embedding beside them): the causal
    LM's ``base_model`` (``model.model`` in the Llama family, ``model.transformer`` in GPT-2's, ``model.gpt_neox``
    in GPT-NeoX), or its text model, ``model.model.language_model`` (a vision-language model that
    ``AutoModelForCausalLM`` gives for its text generation: Gemma 3; Qwen2.5-VL and others passed directly; its
    forward on text alone is the text model's)."""
    found = None
    # the base model by its prefix, else model.model (Mllama's prefix names no attribute of its causal LM)
    for base in (getattr(model, "base_model", None), getattr(model, "model", None)):
        if base is None or base is model:
            continue
        for cand in (base, getattr(base, "language_model", None)):
            if found is None and cand is not None and _layer_list(cand) is not None:
                found = cand
    base = found
    if base is None:
        raise TypeError(
            f"target: expected a HuggingFace decoder-only LM whose base model holds its decoder layers "
            f"(model.model.layers as the Llama family, model.transformer.h as GPT-2, model.gpt_neox.layers, "
            f"model.model.decoder.layers as OPT) or a vision-language model's text model "
            f"(model.model.language_model.layers), got {type(model).__name__}"
        )
    return base


def _decoder_layers(model):
    """The decoder layers the taps hook (:func:`layers_owner`'s list of them)."""
    return _layer_list(layers_owner(model))


def cache_kwarg(model):
    """The keyword a HuggingFace model's forward takes its KV cache by: ``cache`` from transformers 5.24 on (which
    deprecates ``past_key_values``, to be removed in 5.40), ``past_key_values`` before.  A model whose forward and
    base model's forward name neither (OpenAI GPT: no cache) is refused (ValueError)."""
    import inspect

    for owner in (lambda: model, lambda: layers_owner(model)):    # the base model's only where the model names none
        try:
            params = inspect.signature(owner().forward).parameters
        except (TypeError, ValueError):
            return "past_key_values"
        for name in ("cache", "past_key_values"):
            if name in params:
                return name
    raise ValueError(f"target: expected a model whose forward takes a KV cache (past_key_values or cache), got "
                     f"{type(model).__name__}, which takes none: the model is not supported")


def _cache_base():
    from transformers import Cache

    return Cache


def _conv_window(conv_states, K):
    """A prefill's conv input as transformers' cache returns it: left-padded with zeros to the kernel size ``K``."""
    n = conv_states.shape[-1]
    return conv_states if n >= K else torch.nn.functional.pad(conv_states, (K - n, 0))


class StaticKV(_cache_base()):
    """A transformers ``Cache`` over our own storage: ``update`` writes the new keys/values of layer
    ``layer_idx`` at cache columns ``self.slots`` (set by the caller before each forward) and returns the
    whole layer, which the caller's 4D mask restricts.  ``store``: each layer's (keys [B, heads, S, size],
    values [B, heads, S, size]) views, or None for a layer that writes no cache (Gemma 3n's KV-shared layers);
    the sizes are each layer's own (:func:`kv_layout`).  ``Cache.__init__`` is deliberately not called: no
    layer objects, no counters."""

    is_compileable = False

    def __init__(self, store, states=None, length=None):
        self.store = store
        self.states = states or {}   # linear-attention layers: (layer, state index) -> (conv [B, C, K], recurrent)
        self.length = length         # get_seq_length's answer (LENGTH_UNUSED's families), else None: refused
        self.slots = None
        self.layers = []
        self.layer = None    # a compiled layer's own (keys, values) views, set outside its region (_Regional)

    window = None   # columns attended to (None: all); set per forward, see TargetAdapter.verify
    fresh = False   # this forward starts the states from nothing (a prefill)
    staged = False  # this forward's linear-attention states are not kept (a chain verification: TargetAdapter.commit)

    def views(self):
        """Each layer's (keys, values): views of the storage, made once, outside any compiled region."""
        return self.store

    def row(self, b):
        """The same cache restricted to request ``b`` (a batch of one: views, no copy)."""
        return StaticKV([None if kv is None else (kv[0][b:b + 1], kv[1][b:b + 1]) for kv in self.store],
                        {k: tuple(None if t is None else t[b:b + 1] for t in st) for k, st in self.states.items()},
                        self.length)

    # transformers' linear-attention cache API (5.23: Qwen3-Next, Qwen3.5): the conv and recurrent states of each
    # linear layer, kept in place as the model's own cache keeps them, except in a staged (chain) forward, which
    # reads them and leaves them as they were
    def _state(self, layer_idx, state_idx):
        st = self.states.get((layer_idx, state_idx))
        if st is None:
            raise ValueError(f"target cache: expected no linear-attention state from layer {layer_idx} (the model's "
                             f"layout, probed when the engine was made), got one")
        return st

    def get_conv_state(self, layer_idx, state_idx=0):
        return None if self.fresh else self._state(layer_idx, state_idx)[0]

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return None if self.fresh else self._state(layer_idx, state_idx)[1]

    def is_recording_past(self, layer_idx):
        return self.staged

    def get_recurrent_states_to_keep(self, layer_idx=None):   # 5.25: no per-token states (commit re-runs)
        return 0

    def increase_count(self, layer_idx, state_idx=0):          # 5.25: its token count (none kept here)
        pass

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, **kwargs):
        live = self._state(layer_idx, state_idx)[0]
        K = live.shape[-1]
        if self.fresh:
            full = _conv_window(conv_states, K)
        else:
            full = torch.cat([live, conv_states], dim=-1)
        if not self.staged:
            live.copy_(full[..., -K:])
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        live = self._state(layer_idx, state_idx)[1]
        if self.staged:
            return recurrent_states
        live.copy_(recurrent_states)
        return live

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # A compiled layer gets its own views as inputs (``self.layer``), so inductor writes the new slots in
        # place.  Made inside the region from the whole storage (a narrow at the layer index), the write was a
        # mutation of a view of a graph input, and inductor wrote the whole input back: every layer's keys and
        # values copied at every layer's call (the default pair on a 2-core CPU: 3.5 tokens/s compiled against
        # 9 eager).
        kv = self.layer if self.layer is not None else \
            (self.store[layer_idx] if 0 <= layer_idx < len(self.store) else None)
        if kv is None:
            raise ValueError(f"target cache: expected no cache write from layer {layer_idx} (the model's layout, "
                             f"probed when the engine was made), got one")
        k, v = kv
        if any(t.shape[1] != c.shape[1] or t.shape[3] != c.shape[3] for t, c in ((key_states, k), (value_states, v))):
            raise ValueError(f"target cache: expected layer {layer_idx}'s keys as [batch, {k.shape[1]}, S, "
                             f"{k.shape[3]}] and values as [batch, {v.shape[1]}, S, {v.shape[3]}] (the shapes the "
                             f"model wrote when the engine probed it), got keys {tuple(key_states.shape)} and values "
                             f"{tuple(value_states.shape)}: a model whose cache shapes change between forwards is "
                             f"not supported")
        write_at(k, self.slots, key_states)
        write_at(v, self.slots, value_states)
        if self.window is not None:
            k, v = k[:, :, :self.window], v[:, :, :self.window]
        if k.dtype != key_states.dtype:   # a half model's forward on the float32 cache kept for cpu_decoder
            k, v = k.to(key_states.dtype), v.to(value_states.dtype)
        return k, v

    def get_seq_length(self, layer_idx=0):
        if self.length is not None:
            return self.length
        raise ValueError("target cache: expected a model that takes position_ids and a 4D mask as given, got one "
                         "whose forward asks its cache for a length, which a tree verification has not (a model, or "
                         "a transformers release of it, not known to use the length harmlessly: LENGTH_UNUSED): the "
                         "model is not supported")


def attention_window(device, used, nodes):
    """The columns a verification forward attends to (``TargetAdapter.verify``'s ``window``): on the CPU the
    ``used`` positions (committed tokens and the root) plus room for ``nodes`` tree rows, rounded up to 64 so
    that a run sees few distinct widths (attention over unused columns is real work there); None on a GPU,
    where every cycle keeps the whole cache so that a tree shape has one recorded shape."""
    if getattr(device, "type", device) == "cuda":
        return None
    return -(-(used + nodes) // 64) * 64


INVARIANT_ATTN = "heterospec_exact_keys"   # the attention the target runs under while it verifies row-invariantly
INVARIANT_DTYPES = (torch.bfloat16,)


def key_groups(allowed):
    """The exact keys of every query row, for :func:`exact_keys_attention`: ``allowed`` [B, n, W] bool (what row
    i of request b sees) -> one (row into the flattened B*n rows, or None when there is one row; its request;
    its key columns) per row, the columns in cache order (the committed prefix, then the ancestors root first):
    an int c when they are 0 .. c-1 (a one-row step, a tree's root: a view of the cache, no copy), else a [c]
    tensor.  Host ints: computed once per forward, read by every layer."""
    B, n, W = allowed.shape
    flat = allowed.reshape(B * n, W)
    counts = flat.sum(1)
    where = flat.nonzero()[:, 1]
    ends = counts.cumsum(0)
    # c columns ascending whose last is c-1 are 0 .. c-1 (one host read for every row)
    contiguous = (where[ends - 1] == counts - 1).tolist()
    groups, start = [], 0
    for r, (c, view) in enumerate(zip(counts.tolist(), contiguous)):
        groups.append((None if B * n == 1 else r, r // n, c if view else where[start:start + c]))
        start += c
    return groups


def _row_keys(states, request, cols):
    """states [B, kv_heads, W, D] -> [1, kv_heads, c, D]: one row's own keys (a view for an int c)."""
    if isinstance(cols, int):
        return states[request:request + 1, :, :cols]
    return states[request].index_select(1, cols).unsqueeze(0)


def exact_keys_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function (registered as :data:`INVARIANT_ATTN`) in which every query row attends
    to exactly the keys it sees, in cache order, with no mask, in a call of its own: the same call, on the same
    values, that a one-row step over those keys makes.  A row's output then does not depend on how many rows the
    forward verifies or which other rows are in it, so a bfloat16 verify over a tree gives each node what a
    one-row step gives, bit for bit.  (Rows of equal length batched into one call are not enough: on the 2-core
    AMD EPYC, torch's CPU attention gave the rows that its first thread computed other low bits than the same
    row alone; with one thread it did not.)  ``heterospec_keys`` (the :func:`key_groups` of the forward) comes
    through the model's keyword arguments; without it (any other forward of the model) this is transformers'
    sdpa."""
    groups = kwargs.pop("heterospec_keys", None)
    if groups is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    B, H, n, D = query.shape
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(B * n, kv_heads, H // kv_heads, D)   # query head h reads kv head h // rep
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if len(groups) == 1:
        _, request, cols = groups[0]
        out = sdpa(q, _row_keys(key, request, cols), _row_keys(value, request, cols), scale=scaling)
        return out.view(B, n, H, D), None
    out = query.new_empty(B * n, kv_heads, H // kv_heads, D)
    for row, request, cols in groups:
        out[row] = sdpa(q[row:row + 1], _row_keys(key, request, cols), _row_keys(value, request, cols),
                        scale=scaling)[0]
    return out.view(B, n, H, D), None


GQA_ATTN = "heterospec_sdpa_gqa"   # transformers' sdpa for our masked CPU forwards, key/value heads read in place


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention (registered as :data:`GQA_ATTN`) for the target's own eager forwards on the
    CPU (verify, prefill): with a 4D mask and several query rows, transformers repeats every layer's keys and
    values to the query heads (``repeat_kv``, a copy of the attended cache per layer) before torch's attention;
    here torch reads the key/value heads in place (``enable_gqa``).  The output is the same, bit for bit
    (tests/models/test_target_attention.py holds it to transformers' own function); on a 2-core Xeon a layer's attention
    over 6 rows and 192 keys took 51 against 105 µs, over 12 rows and 448 keys 126 against 278.  Anything else
    (one query row, no mask, no key/value groups, a position bias, a paged cache) is transformers' function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups <= 1 or query.shape[2] == 1 or attention_mask is None or key.shape[1] * groups != query.shape[1]
             or any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap", "is_causal"))
             or kwargs.get("output_attentions"))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=False,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


_REGISTERED = []


def _register_attention():
    """Our two attention functions, under their names (once per process)."""
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    for name, fn in ((INVARIANT_ATTN, exact_keys_attention), (GQA_ATTN, gqa_sdpa_attention)):
        AttentionInterface.register(name, fn)
        try:   # the model's own 2D-mask forwards while our name is set (none of ours: they pass 4D masks)
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionMaskInterface.register(name, sdpa_mask)
        except ImportError:
            pass
    _REGISTERED.append(True)


_ATTN_CHECKED = {}


def check_invariant_attention(dtype, heads, kv_heads, head_dim):
    """Whether :func:`exact_keys_attention` gives a row the same output whether its keys are a view of the cache
    (a one-row step) or a gathered copy (a tree node), on this machine in ``dtype`` (measured once per process
    and shape: random keys, 3 key counts, a tree row beside others)."""
    key = (dtype, heads, kv_heads, head_dim)
    if key not in _ATTN_CHECKED:
        gen = torch.Generator().manual_seed(0)
        ok = True
        for c in (37, 200, 600):
            q = torch.randn(1, heads, 3, head_dim, generator=gen).to(dtype)
            kv = torch.randn(2, 1, kv_heads, c + 2, head_dim, generator=gen).to(dtype)
            # a tree: row 0 sees 0..c-1 (a view), rows 1 and 2 see 0..c-2 and c, c+1 (gathered copies)
            allowed = torch.zeros(1, 3, c + 2, dtype=torch.bool)
            allowed[0, 0, :c] = True
            allowed[0, 1:, :c - 1] = True
            allowed[0, 1, c] = allowed[0, 2, c + 1] = True
            tree = exact_keys_attention(None, q, kv[0], kv[1], None, scaling=head_dim ** -0.5,
                                        heterospec_keys=key_groups(allowed))[0]
            for r, col in ((0, None), (1, c), (2, c + 1)):
                # the same keys laid out as a one-row step sees them: contiguous columns 0 .. c-1
                k = kv[0] if col is None else torch.cat([kv[0][:, :, :c - 1], kv[0][:, :, col:col + 1]], 2)
                v = kv[1] if col is None else torch.cat([kv[1][:, :, :c - 1], kv[1][:, :, col:col + 1]], 2)
                one = exact_keys_attention(None, q[:, :, r:r + 1], k, v, None, scaling=head_dim ** -0.5,
                                           heterospec_keys=key_groups(torch.ones(1, 1, c, dtype=torch.bool)))[0]
                ok = ok and torch.equal(tree[0, r], one[0, 0])
        _ATTN_CHECKED[key] = ok
    return _ATTN_CHECKED[key]


def sliding_layout(config):
    """How a model's attention layers slide, as transformers (5.x) builds their masks -> None (no layer slides), or
    (window, typed): ``typed`` when the config names each layer's type (``layer_types`` holding
    "sliding_attention": Gemma 2/3, Qwen2/3 with ``use_sliding_window``, ...), whose forward takes a mask per type
    in a dict; else every layer slides (``sliding_window`` set without layer types: the Mistral family, Phi-3,
    Mixtral, Starcoder2).  Linear-attention layers take no mask (:func:`linear_layers`); other layer types (chunked,
    indexed, ...) are refused (a ValueError): their masks are not what the engine builds."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    typed = types is not None
    if typed:
        other = sorted(set(types) - {"full_attention", "sliding_attention", *STATE_LAYER_TYPES, *BOTH_LAYER_TYPES})
        if other:
            raise ValueError(f"target: expected layers of full, sliding or linear attention (config.layer_types), "
                             f"got {other}, whose masks the engine does not build")
        if "sliding_attention" not in types:
            return None
    elif window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        wanted = "an int >= 1 for its sliding_attention layers" if typed else "None or an int >= 1"
        raise ValueError(f"target: expected config.sliding_window {wanted}, got {window!r}")
    return window, typed


# model types whose forward asks its cache for the cached length (get_seq_length) only to infer positions or a 2D mask
# where none is given (the adapter always passes position_ids and a 4D mask: OPT, BioGPT, CTRL, Falcon without ALiBi),
# or to size its table of sinusoidal positions (XGLM: the cache's columns, an upper bound, size it), each from the
# earliest transformers release where its modeling code was read and tested so (CTRL's and XGLM's before 5.23 build
# their masks from the length); any other model that asks is refused (StaticKV.get_seq_length)
LENGTH_UNUSED = {"opt": (5, 0), "biogpt": (5, 0), "falcon": (5, 0), "ctrl": (5, 23), "xglm": (5, 23)}


def _length_unused(config):
    """Whether ``config``'s model asks for a cache length it does not use here (:data:`LENGTH_UNUSED`)."""
    import transformers

    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    since = LENGTH_UNUSED.get(getattr(c, "model_type", None))
    return since is not None and tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= since


def check_positions(config):
    """Refuse in one line (ValueError) a model whose attention places its keys in a way a tree verification on a
    static cache breaks: ALiBi (BLOOM, MPT, Falcon with ``alibi``), whose biases transformers builds from a 2D mask
    of key positions (a tree's nodes share positions, and the engine passes a 4D mask); GPT-Neo's local layers,
    whose window the attention places by the number of keys it is given (a static cache has more columns than
    tokens)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(c, "model_type", None)
    if kind in ("bloom", "mpt") or (kind == "falcon" and getattr(c, "alibi", False)):
        raise ValueError(f"target: expected rotary or learned positions, got ALiBi ({kind}), whose biases "
                         f"transformers builds from a 2D mask of key positions, which a tree verification replaces "
                         f"by a 4D mask: the model is not supported")
    if kind == "gpt_neo" and "local" in (getattr(c, "attention_layers", None) or ()):
        raise ValueError("target: expected attention windows given by the mask, got GPT-Neo's local layers, whose "
                         "window the attention places by its number of keys (a static cache has more columns than "
                         "tokens): the model is not supported")


# layer types whose state is a recurrence rather than keys and values: linear attention (Qwen3-Next, Qwen3.5, ...),
# LFM2's short convolutions ("conv": a conv state alone); they take no attention mask
STATE_LAYER_TYPES = ("linear_attention", "conv")
# layer types holding full attention and a state-keeping mixer side by side (Falcon-H1's "hybrid": its attention
# takes the full mask, its Mamba 2 mixer none); a model whose "hybrid" mixer is not in STATE_MIXERS is refused
BOTH_LAYER_TYPES = ("hybrid",)


def linear_layers(config):
    """The indices of a model's layers with a state-keeping mixer (``config.layer_types`` in
    :data:`STATE_LAYER_TYPES` or :data:`BOTH_LAYER_TYPES`), whose state is a recurrence: [] for none."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [i for i, t in enumerate(getattr(c, "layer_types", None) or ()) if t in STATE_LAYER_TYPES + BOTH_LAYER_TYPES]


# the linear-attention mixers whose state the engine keeps and rolls back (tests/models/test_hybrid_targets.py holds
# each to HuggingFace's generate); another mixer is refused in one line
STATE_MIXERS = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet",
                "GraniteMoeHybridMambaLayer", "BambaMixer", "KimiLinearDeltaAttention", "BailingHybridDeltaAttention",
                "Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv", "FalconH1Mixer")
# not JambaMambaMixer: transformers 5.23 runs a forward of several tokens as a new prompt whatever its cache holds
# the keyword a mixer takes the cache by (transformers 5.25 renames cache_params and past_key_values to cache)
MIXER_CACHE_KW = ("cache_params", "cache", "past_key_values")
# the entries of a per-layer-type mask dict for the layers that take none (STATE_LAYER_TYPES)
NO_MASKS = dict.fromkeys(STATE_LAYER_TYPES)


def rope_parameters(config):
    """Every RoPE parameter dict a model's config holds, outermost first: ``rope_parameters`` (transformers 5; in
    some models one per layer type, nested) or ``rope_scaling`` (4.x)."""
    found, todo = [], [getattr(config, f, None) for f in ("rope_parameters", "rope_scaling")]
    while todo:
        rp = todo.pop(0)
        if isinstance(rp, dict):
            found.append(rp)
            todo.extend(v for v in rp.values() if isinstance(v, dict))
    return found


def _rope_kind(rp):
    """A RoPE parameter dict's variant: ``rope_type`` (``type`` in 4.x configs)."""
    return rp.get("rope_type") or rp.get("type")


def rope_types(config):
    """The RoPE variants a model's config names (:func:`rope_parameters`' ``rope_type``)."""
    return {k for k in map(_rope_kind, rope_parameters(config)) if isinstance(k, str)}


def rope_switch(model):
    """Where a target's rotary frequencies switch with its sequence -> None, or (at, recompute).

    transformers' LongRoPE (``rope_type`` "longrope": Phi-3 and Phi-3.5 with 128K context, Phi-4-mini, PhiMoE)
    rotates with its short factors while every position of a forward stays below ``at``
    (``original_max_position_embeddings``) and with its long ones once any position reaches it: one decision per
    forward, from the largest position in it.  ``recompute``: the model's ``generate`` then recomputes the whole cache
    with the long factors, once, at the step whose query sits at position ``at`` (Phi-3's
    ``prepare_inputs_for_generation`` drops its cache there); without it the keys written before keep the short
    factors.  Decoding one token at a time, a position is thus rotated as its own step decided; the engine's tree
    forwards reproduce that by deciding per row (:class:`_RopeRows`), never verifying a tree that straddles
    ``at``, and recomputing a row's cache at ``at`` where the model's ``generate`` does (:meth:`TargetAdapter.refill`).
    A model with LongRoPE per layer type must switch them all at one position (else a ValueError)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ats = {rp.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
           for rp in rope_parameters(config) if _rope_kind(rp) == "longrope"}
    if not ats:
        return None
    at = ats.pop() if len(ats) == 1 else sorted(ats, key=repr)
    if not isinstance(at, int) or isinstance(at, bool) or at < 1:
        raise ValueError(f"target: expected LongRoPE's original_max_position_embeddings one int >= 1, got {at!r}")
    import inspect

    try:
        prepare = inspect.getsource(type(model).prepare_inputs_for_generation)
    except (AttributeError, TypeError, OSError):
        prepare = ""
    recompute = "original_max_position_embeddings" in prepare
    if recompute and getattr(config, "original_max_position_embeddings", at) != at:
        raise ValueError(f"target: expected config.original_max_position_embeddings "
                         f"({config.original_max_position_embeddings}), where generate recomputes the cache, to equal "
                         f"LongRoPE's switch ({at})")
    return at, recompute


def _state_mixers(layers):
    """{layer: its mixer} of the decoder ``layers`` whose mixers are in :data:`STATE_MIXERS`."""
    return {m.layer_idx: m for layer in layers for m in layer.modules()
            if type(m).__name__ in STATE_MIXERS and isinstance(getattr(m, "layer_idx", None), int)}


def _require_mixers(layers, found, wanted):
    """A ValueError where a layer of ``wanted`` (indices) has no mixer in ``found`` (:func:`_state_mixers`)."""
    missing = sorted(set(wanted) - set(found))
    if missing:
        kinds = sorted({type(m).__name__ for m in layers[missing[0]].modules()
                        if set(MIXER_CACHE_KW) & _params(m) and m is not layers[missing[0]]
                        or "recurrent" in type(m).__name__.lower()})
        raise ValueError(f"target: expected linear-attention layers the engine keeps the state of "
                         f"({', '.join(STATE_MIXERS)}), got {kinds or 'none'} in layer {missing[0]}")


class _RopeRows:
    """The target's rotary embedding (``rotary_emb``) deciding LongRoPE's short or long factors per row, while the
    adapter's own forwards run (:meth:`TargetAdapter._forward` installs it on the module and takes it off after:
    the model is the user's).  transformers decides once per forward, from the largest position of the whole
    batch; a row here is long when its own positions say so: with ``rule`` "max" (a prompt, a recomputed cache) when
    its largest position reaches ``at``, with "min" (a verification tree, whose root is its smallest position) when
    its root does.  transformers' own forward computes both tables -- the short one over positions clamped below
    ``at``, the long one with a column at ``at`` appended and dropped -- so every value is its own; device ops only."""

    def __init__(self, rotary, at):
        self.rotary, self.at = rotary, at
        self.rule = "max"

    def __call__(self, x, position_ids, *args, **kwargs):
        own = type(self.rotary).forward
        B, n = position_ids.shape
        edge = (position_ids.amax(1) if self.rule == "max" else position_ids.amin(1)) >= self.at
        short = own(self.rotary, x, position_ids.clamp(max=self.at - 1), *args, **kwargs)
        wide = torch.cat([position_ids, position_ids.new_full((B, 1), self.at)], dim=1)
        long = own(self.rotary, x, wide, *args, **kwargs)
        pick = edge.view(B, 1, 1)
        return tuple(torch.where(pick, lt[:, :n], st) for st, lt in zip(short, long))


def _params(module):
    """The parameter names of a module's forward (none where they cannot be read)."""
    import inspect

    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


class _LayoutProbe(StaticKV):
    """The cache of :func:`kv_layout`'s forward: records each layer's key and value shapes and each linear-attention
    layer's state shapes, and attends to the new token alone."""

    fresh = True

    def __init__(self):
        super().__init__([])
        self.shapes = {}
        self.state_shapes = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.shapes[layer_idx] = ((key_states.shape[1], key_states.shape[3]),
                                  (value_states.shape[1], value_states.shape[3]))
        return key_states, value_states

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        K = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
        self.state_shapes.setdefault((layer_idx, state_idx), [None, None])[0] = \
            ((*conv_states.shape[1:-1], K), conv_states.dtype)
        return _conv_window(conv_states, K)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.state_shapes.setdefault((layer_idx, state_idx), [None, None])[1] = \
            (tuple(recurrent_states.shape[1:]), recurrent_states.dtype)
        return recurrent_states


def kv_layout(model, cache_kw, sliding):
    """What each layer index of ``model``'s cache is written with, as one forward of one token shows -> (a list with
    one entry per index, ((key heads, key size), (value heads, value size)), or None for an index nothing writes (a
    layer reading an earlier layer's: Gemma 3n's KV-shared layers, a linear-attention layer); each linear-attention
    layer's states, {(layer, state index): ((conv shape, dtype), (recurrent shape, dtype))}, shapes without the
    batch).  An index is usually a decoder layer's (LongCat
    Flash's layers hold two attentions, two indices each).  Probed rather than read from the config because
    the shapes are the modeling code's: multi-head latent attention caches its two latents (transformers 5.23:
    DeepSeek-V2/V3, MiniCPM3, GLM-4.7-Flash: keys [B, 1, S, kv_lora_rank], "values" the rotary part), Gemma 4's
    full and sliding layers differ in head size, MiMo-V2-Flash's in head count.  ``cache_kw``, ``sliding``: the
    model's :func:`cache_kwarg` and :func:`sliding_layout`."""
    p = next(model.parameters())
    if linear_layers(model.config):
        import transformers.cache_utils as cache_utils

        if not hasattr(cache_utils, "LinearAttentionCacheLayerMixin"):
            import transformers

            raise ValueError(f"target: expected a transformers whose caches hold linear-attention states (5.23 or "
                             f"newer) for a model with linear-attention layers, got {transformers.__version__}")
    probe = _LayoutProbe()
    probe.length = 1 if _length_unused(model.config) else None
    zero = torch.zeros((1, 1, 1, 1), dtype=p.dtype, device=p.device)
    typed = (sliding is not None and sliding[1]) or linear_layers(model.config)
    mask = {"full_attention": zero, "sliding_attention": zero, **NO_MASKS} if typed else zero
    at = torch.zeros((1, 1), dtype=torch.long, device=p.device)
    with torch.no_grad():     # the decoder alone: no logits
        layers_owner(model)(input_ids=at, position_ids=at, cache_position=at[0], attention_mask=mask, use_cache=True,
                            **{cache_kw: probe})
    if not probe.shapes or min(probe.shapes) < 0:
        raise ValueError(f"target: expected cache writes at layer indices >= 0 from a forward, got "
                         f"{sorted(probe.shapes) or 'none'}")
    bad = sorted(k for k, (conv, rec) in probe.state_shapes.items() if conv is None)
    if bad:   # a conv state alone is a short convolution's (LFM2); a recurrent state comes with one
        raise ValueError(f"target: expected a conv state (and a recurrent state, or none for a short convolution) "
                         f"from each linear-attention layer, got only a recurrent state from (layer, state) {bad}")
    return [probe.shapes.get(i) for i in range(max(probe.shapes) + 1)], \
        {k: tuple(v) for k, v in sorted(probe.state_shapes.items())}


class _Regional:
    """``compile``: the target's decoder layers compiled one region at a time (``torch.compile`` of each layer's
    ``_call_impl``), switched on for our own verify forwards only, so the user's model is as it was between
    calls.  The layers share one code object, so dynamo compiles a layer once and reuses it for every other
    (the layer index becomes a symbolic int: ``allow_unspec_int_on_nn_module``), with shapes left to dynamo
    (static first, dynamic after a change): a few compilations in all, instead of one whole-model compilation
    per tree shape.  Each layer's call is bound, outside its region, to that layer's own cache views
    (``StaticKV.layer``), which the region takes as inputs and writes in place: one region per layer, no graph
    break.  On the 2-core AMD EPYC the default pair's first call took 20.5 s this way against 115 s for the
    whole model (and 5.5 s eager)."""

    def __init__(self, model, backend, cache_kw):
        import torch._dynamo

        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 256))
        if hasattr(cfg, "allow_unspec_int_on_nn_module"):
            cfg.allow_unspec_int_on_nn_module = True
        self.model, self.cache_kw = model, cache_kw
        self.layers = list(_decoder_layers(model))
        backend = "inductor" if backend is True else backend
        fns = [torch.compile(layer._call_impl, dynamic=None, backend=backend) for layer in self.layers]
        self.cache = None   # the StaticKV of the forward running now (set by __call__)
        self.calls = [self._bound(fn, i) for i, fn in enumerate(fns)]   # made once, not per forward

    def _bound(self, fn, i):
        def call(*args, **kwargs):
            cache = self.cache
            cache.layer = cache.views()[i]
            try:
                return fn(*args, **kwargs)
            finally:
                cache.layer = None
        return call

    def __call__(self, **kwargs):
        self.cache = kwargs[self.cache_kw]
        before = [layer._compiled_call_impl for layer in self.layers]
        for layer, call in zip(self.layers, self.calls):
            layer._compiled_call_impl = call
        try:
            return self.model(**kwargs)
        finally:
            self.cache = None
            for layer, fn in zip(self.layers, before):
                layer._compiled_call_impl = fn


class _Logits:
    """What a forward of :class:`~heterospec.models.cpu_decoder.CpuDecoder` returns in place of transformers'
    output: the logits."""

    def __init__(self, logits):
        self.logits = logits


class TargetAdapter:
    """Drives a HuggingFace causal LM as the speculative-decoding target on a static cache of ``batch`` rows.

    ``prefix`` is an int64 tensor ``[batch]`` on the model's device: each row's number of committed positions.
    With ``batch=1`` the calls take and return unbatched trees (``[n]`` tokens, ``[n, V]`` logits) unless
    ``batched`` (the decoding engine's form: batch 1 is a batch of one); with a batch every tree input and
    output has a leading ``[batch]`` dimension.
    :meth:`allocate` sizes the cache (prompt + new tokens + the largest tree); the engine calls it before
    decoding, outside the cycle.  ``compile``: run the verify forward through ``torch.compile`` (True or a
    backend name; one specialisation per tree size), fewer kernels per forward before CUDA-graph capture.
    The prefill stays eager: its length changes with every prompt.

    ``invariant``: verify so that each row's logits are bit for bit what a one-row step over the same keys gives,
    however many rows the forward has (a bfloat16 model on the CPU: :data:`INVARIANT_DTYPES`).  Every verify then
    runs :func:`exact_keys_attention` (each row its exact keys, no mask), a batch's prompts are prefilled one
    by one, and the linear layers must be row-invariant too (the engine routes them so:
    :mod:`heterospec.models.cpu_gemm`).  Checked on this machine when the adapter is made (ValueError where
    the attention kernel is not).

    ``decoder``: a :class:`~heterospec.models.cpu_decoder.CpuDecoder` of ``model`` that runs every forward of the
    adapter (prefill and verify) in place of transformers' modules, on the same cache (the engine's
    ``cpu_decoder``)."""

    def __init__(self, model, tap_layers=None, capture_taps=True, compile=None, batch=1, invariant=False,
                 batched=False, decoder=None):
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in TREE_MASK_ATTN:
            raise ValueError(
                f"target: attn_implementation {impl!r} cannot take a tree attention mask; expected one of "
                f"{TREE_MASK_ATTN} (load the model with attn_implementation='sdpa', or call "
                f"model.set_attn_implementation('sdpa'))"
            )
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"target: argument 'batch' expected an int >= 1, got {batch!r}")
        self.model = model
        self.batch = batch
        self.batched = bool(batched) or batch > 1
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
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.invariant = bool(invariant)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        check_positions(model.config)
        self._asks_length = _length_unused(model.config)
        # sliding attention windows: each forward's mask restricted to them as transformers restricts its own
        self._sliding = sliding_layout(model.config)
        self._cache_kw = cache_kwarg(model)
        # linear-attention layers (Qwen3-Next, Qwen3.5, ...): their mixers, re-run over each row's accepted positions
        # at a chain's commit (the states are a recurrence: what a rejected node did cannot be taken out); checked
        # before the layout probe too, whose forward a model with unknown mixers may fail in (Zaya)
        linear = linear_layers(model.config)
        found = _state_mixers(layers)
        _require_mixers(layers, found, linear)
        # what each layer caches (kv_layout); one storage tensor per distinct shape, allocate()
        self.layout, self.state_layout = kv_layout(model, self._cache_kw, self._sliding)
        # a linear layer keeping its state elsewhere than in the cache (RecurrentGemma's own) is missing too
        _require_mixers(layers, found, {i for i, _ in self.state_layout})
        self._mixers = {i: found[i] for i in sorted({i for i, _ in self.state_layout})}
        shapes = {s for kv in self.layout if kv is not None for s in kv}
        self._uniform = shapes.pop() if len(shapes) == 1 and None not in self.layout else None
        try:
            heads = text.num_attention_heads
        except (AttributeError, RuntimeError):     # transformers' AmbiguousGlobalPerLayerAttributeError
            heads = None
        if self.invariant:
            if self.device.type != "cpu" or self.dtype not in INVARIANT_DTYPES:
                raise ValueError(f"target: row-invariant verification expected a CPU model in one of "
                                 f"{[str(d).replace('torch.', '') for d in INVARIANT_DTYPES]}, got {self.device} "
                                 f"{str(self.dtype).replace('torch.', '')}")
            if self.state_layout:
                raise ValueError("target: row-invariant verification expected attention layers only, got "
                                 "linear-attention layers; use float32 or batch_invariant=False")
            if self._uniform is None or heads is None:
                raise ValueError(f"target: row-invariant verification expected every layer to cache keys and values "
                                 f"of one shape, got {self.layout} ((heads, size) of keys and values per layer); "
                                 f"use float32 or batch_invariant=False")
            if not check_invariant_attention(self.dtype, heads, *self._uniform):
                raise ValueError("target: row-invariant verification: this machine's attention kernel gives a "
                                 "row of a batched call another result than the row alone; use float32 or "
                                 "batch_invariant=False")
        if self._sliding is not None and self._sliding[1] and self.invariant:
            raise ValueError("target: row-invariant verification (bfloat16 on the CPU) expected one kind of attention "
                             "layer, got sliding and full layers (config.layer_types); use float32")
        # LongRoPE: the short or long factors per row (rope_switch); the rotary module the model calls once a forward
        self.rope_switch = rope_switch(model)
        self.rope_rows = None
        if self.rope_switch is not None:
            rotary = getattr(layers_owner(model), "rotary_emb", None)
            if not isinstance(rotary, torch.nn.Module):
                raise ValueError(f"target: expected the rotary embedding of a LongRoPE model at rotary_emb beside its "
                                 f"decoder layers, got {type(rotary).__name__}")
            self.rope_rows = _RopeRows(rotary, self.rope_switch[0])
        self._captured = {}
        self._hooks = []
        # the first KV-shared layer (Gemma 4: from there on a prefill given an int logits_to_keep runs those positions)
        self._shared_from = getattr(layers_owner(model), "first_kv_shared_layer_idx", None)
        if capture_taps:
            for i in self.tap_layers:
                self._hooks.append(layers[i].register_forward_pre_hook(self._make_hook(i), with_kwargs=True))
        # the last staged (chain) forward's inputs of each linear-attention mixer, layer -> (args, kwargs), until the
        # commit re-runs them (empty: nothing to re-run)
        self._mixer_in = {}
        self._state_hooks = [m.register_forward_pre_hook(self._mixer_hook(i), with_kwargs=True)
                             for i, m in self._mixers.items()]
        self.max_positions = getattr(text, "max_position_embeddings", None)   # a VLM: its text model's
        self.capacity = 0
        self.kv = None          # the whole cache as one tensor, where every layer caches one shape (allocate)
        self._states = {}       # linear-attention layers' states: (layer, state index) -> (conv, recurrent) [B, ...]
        self.cache = None
        self.prefix = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._call = model if not compile else _Regional(model, compile, self._cache_kw)
        # our eager CPU forwards attend through gqa_sdpa_attention where the model runs transformers' sdpa with
        # key/value groups (a compiled forward keeps what it was traced with; a GPU keeps its recorded kernels)
        self._gqa = (self.device.type == "cpu" and getattr(model.config, "_attn_implementation", None) == "sdpa"
                     and (heads is None or any(kv is not None and kv[0][0] < heads for kv in self.layout)))
        if self.invariant or self._gqa:
            _register_attention()
        self.compiled = bool(compile)   # a compiled verify forward: the whole cache attended, so no new widths
        if decoder is not None and (compile or self.invariant or decoder.model is not model):
            raise ValueError("target: argument 'decoder' expected the model's own CpuDecoder, without compile or "
                             "row-invariant verification")
        if decoder is not None and self._uniform is None:
            raise ValueError(f"target: argument 'decoder' expected a model whose layers cache keys and values of one "
                             f"shape, got {self.layout}")
        self.decoder = decoder
        # the cache's dtype: the model's, or float32 where our decoder runs it (it computes in float32 whatever the
        # weights' dtype; transformers' forward of a half model, while a hook of the user's is set, reads it converted)
        self.cache_dtype = self.dtype if decoder is None else torch.float32
        self._decoder_on = None   # the decoder runs this call's forwards (asked at each prefill; None: not yet)

    def _make_hook(self, i):
        def hook(module, args, kwargs):
            self._captured[i] = args[0] if args else kwargs["hidden_states"]

        hook.heterospec_tap = True   # ours (CpuDecoder.hooked: a user's hook sends forwards to transformers')
        return hook

    @property
    def stateful(self):
        """Whether the target has linear-attention layers (their states advance at a chain's commit)."""
        return bool(self._mixers)

    @property
    def mixers(self):
        """The linear-attention mixer modules whose states the adapter keeps."""
        return list(self._mixers.values())

    def _mixer_hook(self, i):
        def hook(module, args, kwargs):
            cache = next((kwargs[n] for n in MIXER_CACHE_KW if kwargs.get(n) is not None), None)
            if getattr(cache, "staged", False):
                self._mixer_in[i] = (args, kwargs)

        return hook

    def close(self):
        for h in self._hooks + self._state_hooks:
            h.remove()
        self._hooks, self._state_hooks = [], []

    def _taps(self):
        if not self._hooks:
            return None
        skipped = [i for i in self.tap_layers if i not in self._captured]
        if skipped:
            raise ValueError(f"target: expected the draft's tap layers to run in every forward, got layer "
                             f"{skipped[0]} skipped (a cross-attention layer on text alone, as Mllama skips them); "
                             f"a draft tapping other layers is needed")
        taps = [self._captured[i] for i in self.tap_layers]
        for i, t in zip(self.tap_layers, taps):
            if t.dim() != 3 or t.shape[:2] != taps[0].shape[:2]:
                raise ValueError(f"target: expected the hidden states entering decoder layer {i} as [batch, tokens, "
                                 f"hidden] for every token of the forward (the EAGLE-3 draft's taps), got "
                                 f"{tuple(t.shape)} beside {tuple(taps[0].shape)} (several residual streams, as Gemma "
                                 f"3n's AltUp keeps, or layers that see fewer tokens, "
                                 f"cannot feed a draft; autoregressive decoding needs none)")
        return torch.cat(taps, dim=-1)

    def _groups(self):
        """The storage's entries (layer, 0 = keys / 1 = values, (heads, size)) grouped by shape, keys before values
        and layers ascending in each: one tensor per group (a model whose every layer caches one shape has one,
        [B, 2 * layers, heads, S, size], which is also :attr:`kv` [B, 2, layers, heads, S, size])."""
        entries = [(i, j, kv[j]) for j in (0, 1) for i, kv in enumerate(self.layout) if kv is not None]
        groups = {}
        for e in entries:
            groups.setdefault(e[2], []).append(e)
        return list(groups.values())

    def cache_bytes(self, capacity):
        """Bytes of the static key/value cache :meth:`allocate` makes for ``capacity`` positions."""
        size = torch.empty((), dtype=self.cache_dtype).element_size()
        return self.batch * capacity * size * sum(h * d for kv in self.layout if kv is not None for h, d in kv)

    def _store(self, tensors):
        """Make ``tensors`` (one [B, entries, heads, S, size] per :meth:`_groups` group) the cache: the per-layer
        views of :class:`StaticKV`, :attr:`kv` (one group only) and the tensors of ``kv_compact``."""
        self._storage = tensors
        store = [[None, None] if kv is not None else None for kv in self.layout]
        for group, t in zip(self._groups(), tensors):
            for k, (i, j, _) in enumerate(group):
                store[i][j] = t[:, k]
        B, S = tensors[0].shape[0], tensors[0].shape[3]
        self.cache = StaticKV([None if kv is None else tuple(kv) for kv in store], self._states,
                              S if self._asks_length else None)
        self.kv = tensors[0].view(B, 2, -1, *tensors[0].shape[2:]) if self._uniform is not None else None
        # kv_compact's tensors, imported once: [entries * heads, S, size] per group (batch 1), or
        # [batch, entries * heads, S, size] for the per-row (batched) form
        self._kv_rows = ops.KVTensors([t.view(B, -1, S, t.shape[-1]) if self.batched else t.view(-1, S, t.shape[-1])
                                       for t in tensors])

    def allocate(self, capacity):
        """Make room for ``capacity`` positions (kept when already large enough; never inside a cycle)."""
        if capacity <= self.capacity:
            return
        B = self.batch
        if not self._states and self.state_layout:
            self._states = {k: tuple(None if s is None else torch.zeros((B, *s[0]), dtype=s[1], device=self.device)
                                     for s in st) for k, st in self.state_layout.items()}
        self._store([torch.zeros((B, len(g), *g[0][2][:1], capacity, g[0][2][1]), dtype=self.cache_dtype,
                                 device=self.device) for g in self._groups()])
        self._cols = torch.arange(capacity, device=self.device)
        self.capacity = capacity
        self._neg = torch.finfo(self.dtype).min

    def keep_rows(self, order, idx, used=None):
        """Keep the requests ``order`` (a host list of row numbers: row ``order[i]`` becomes row i; ``idx``: the
        same as an int64 tensor on the model's device) and drop the others' cache rows: the finished requests of
        a batch stop costing work.  The adapter stays in the batched form (trees ``[b', n]``) even when one row is
        left.  A row that moves must come from past the new batch (:func:`~heterospec.engine.requests.gap_filled`
        orders them so): the rows move in place, each in one copy, and the cache becomes the storage's first b'
        rows.  ``used`` (a host int; default: the whole cache): the columns any kept row has committed, the only
        ones moved.  A drop used to copy every kept row's whole cache into a new one: 0.52-0.54 s for 63 of 64
        bf16 rows of 1,288 columns on a 2-core Xeon.  A moved row's
        columns from ``used`` on then hold the finished row's keys and values, finite as everything the target
        writes (non-finite logits stop the engine); the row's mask hides them until its own tree overwrites them,
        as it hid the zeros before."""
        n = len(order)
        moves = [(i, r) for i, r in enumerate(order) if r != i]
        if len(set(order)) != n or any(not n <= r < self.batch for _, r in moves):
            raise ValueError(f"target: keep_rows expected distinct rows of [0, {self.batch}), each moved one from "
                             f"past the {n} kept, got {order}")
        cols = self.capacity if used is None else max(1, min(int(used), self.capacity))
        for t in self._storage:
            for i, r in moves:
                t[i, :, :, :cols].copy_(t[r, :, :, :cols])
        for st in self._states.values():
            for t in st:
                for i, r in moves:
                    if t is not None:
                        t[i].copy_(t[r])
        self._states = {k: tuple(None if t is None else t[:n] for t in st) for k, st in self._states.items()}
        self.batch = n
        self.batched = True
        self._store([t[:n] for t in self._storage])
        self.prefix = self.prefix.index_select(0, idx)

    def _forward(self, ids, positions, slots, allowed, call=None, cache=None, exact=False, bad=None, n=None,
                 rope="max", **kw):
        """ids/positions [B, n], slots [n] (the same cache columns in every row) or [B, n] (per row), allowed
        bool [n, W] or [B, n, W] over the first W = window or capacity columns; ``call``: the model or its
        compiled forward (default: the model); ``cache``: the StaticKV written (default: the whole cache);
        ``exact``: attend with :func:`exact_keys_attention` (row-invariant verification); ``bad``, ``n``:
        :func:`~.finite.mark_nonfinite` (bad, the logits, n), inside the decoder's call where it runs; ``rope``:
        how a LongRoPE row decides its factors (:class:`_RopeRows`' rule: "max" for a sequence, "min" for a tree)."""
        if self.rope_rows is None:
            return self._run(ids, positions, slots, allowed, call, cache, exact, bad, n, **kw)
        self.rope_rows.rule = rope
        rotary = self.rope_rows.rotary
        own = rotary.__dict__.get("forward")
        rotary.forward = self.rope_rows          # this forward only: the model is the user's
        try:
            return self._run(ids, positions, slots, allowed, call, cache, exact, bad, n, **kw)
        finally:
            if own is None:
                del rotary.forward
            else:
                rotary.forward = own

    def _run(self, ids, positions, slots, allowed, call, cache, exact, bad, n, **kw):
        """:meth:`_forward` with the rotary embedding in place."""
        self._captured.clear()          # this forward's taps only (a layer it skips leaves none)
        cache = self.cache if cache is None else cache
        if self.decoder is not None and call in (None, self.model) and cache is self.cache and not exact \
                and set(kw) <= {"logits_to_keep"} and self.decoder.runs(self._decoder_on):
            local = None
            if self._sliding is not None:   # the window: every layer's, or the sliding layers' among full ones
                near = self._within_window(allowed, positions, slots)
                local, allowed = (near, allowed) if self._sliding[1] else (None, near)
            logits, taps = self.decoder.forward(ids, positions, slots, allowed, self.kv, keep=kw.get("logits_to_keep"),
                                                taps=self.tap_layers if self._hooks else None,
                                                current=self._decoder_on is not None,
                                                bad=bad, nreal=n, local=local)
            for i, t in zip(self.tap_layers, taps or ()):
                self._captured[i] = t
            return _Logits(logits)
        out = self._modules_forward(ids, positions, slots, allowed, call, cache, exact, **kw)
        if bad is not None:
            mark_nonfinite(bad, out.logits, n)
        return out

    def _modules_forward(self, ids, positions, slots, allowed, call, cache, exact, **kw):
        """:meth:`_forward` through transformers' modules."""
        cache.slots = slots
        W = allowed.shape[-1]
        cache.window = W if W < self.capacity else None
        if self._sliding is None:
            mask = self._additive(allowed)
            if self._mixers:          # linear-attention layers take no mask (the model's own is None there too)
                mask = {"full_attention": mask, **NO_MASKS}
        elif self._sliding[1]:        # a mask per layer type, as the model's forward takes them
            near = self._within_window(allowed, positions, slots)
            mask = {"full_attention": self._additive(allowed), "sliding_attention": self._additive(near),
                    **NO_MASKS}
        else:                         # every layer slides
            allowed = self._within_window(allowed, positions, slots)
            mask = self._additive(allowed)
        call = self.model if call is None else call
        # cache_position is informational here (our cache writes at `slots`; the 4D mask skips mask building)
        args = dict(input_ids=ids, position_ids=positions, cache_position=slots if slots.dim() == 1 else slots[0],
                    attention_mask=mask, use_cache=True, **{self._cache_kw: cache}, **kw)
        gqa = not exact and self._gqa and call is self.model
        if not exact and not gqa:
            return call(**args)
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = INVARIANT_ATTN if exact else GQA_ATTN   # this forward only: the model is the user's
        try:
            if gqa:
                return call(**args)
            return call(**args, heterospec_keys=key_groups(allowed.view(-1, *allowed.shape[-2:])))
        finally:
            config._attn_implementation = before

    def _additive(self, allowed):
        """bool [n, W] or [B, n, W] -> the additive 4D mask [1 or B, 1, n, W] of the model's dtype."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, self._neg)
        return mask.view(1, 1, *allowed.shape) if allowed.dim() == 2 else mask.unsqueeze(1)

    def _within_window(self, allowed, positions, slots):
        """``allowed`` restricted to the sliding window: a query at position q sees a key at position k only when
        k > q - window (transformers' ``sliding_window_overlay``).  A column's position is its index (committed
        positions sit at their own columns: prefill and commit put them there), except this forward's ``slots``,
        which hold ``positions`` (a tree node's depth past the prefix, a left-padded prompt's own count)."""
        B, n = positions.shape
        W = allowed.shape[-1]
        kpos = self._cols[:W].expand(B, W).clone()
        kpos.scatter_(1, (slots if slots.dim() == 2 else slots.view(1, n)).expand(B, n), positions)
        near = kpos.view(B, 1, W) > positions.view(B, n, 1) - self._sliding[0]
        return allowed & (near[0] if allowed.dim() == 2 else near)

    def _last(self, n):
        """A prefill's ``logits_to_keep`` over ``n`` tokens: the last one's logits.  1, except where a tap layer is
        one of the KV-shared layers (Gemma 4) that the model runs over the kept positions alone when given an int:
        then the index as a tensor, so every position reaches the taps."""
        if self._hooks and self._shared_from is not None and max(self.tap_layers) >= self._shared_from:
            return torch.tensor([n - 1], device=self.device)
        return 1

    @torch.no_grad()
    def prefill(self, input_ids, attention_mask=None):
        """Run the prompts ``input_ids`` [batch, S] (the cache must hold S positions), left-padded where
        ``attention_mask`` [batch, S] (1 = token, 0 = padding, zeros only before ones; None: no padding) says so.
        Returns (logits of each row's last position, float32: [V] unbatched, else [batch, V]; the taps
        [batch, S, 3H] or None, each row's prompt moved to the front as in the cache).  Sets ``prefix`` to each
        row's prompt length."""
        B, S = input_ids.shape
        if B != self.batch:
            raise ValueError(f"target: prefill expected {self.batch} prompts (the adapter's batch), got {B}")
        # a call's forwards: ours or transformers', decided once here (CpuDecoder.usable)
        self._decoder_on = self.decoder is not None and self.decoder.usable()
        if S > self.capacity:
            self.allocate(S)
        rows = self._cols[:S]
        causal = self._cols[:S].view(1, -1) <= rows.view(-1, 1)    # causal over the prompt (S columns)
        if (self.invariant and B > 1) or (self._mixers and attention_mask is not None):
            # one prompt at a time: row-invariant verification; a linear-attention state, which padding would enter
            return self._prefill_each(input_ids, attention_mask, causal)
        self.cache.fresh = True
        try:
            return self._prefill_all(input_ids, attention_mask, rows, causal)
        finally:
            self.cache.fresh = False

    def _prefill_all(self, input_ids, attention_mask, rows, causal):
        """:meth:`prefill` in one forward."""
        B, S = input_ids.shape
        if attention_mask is None:
            out = self._forward(input_ids, rows.expand(B, S), rows, causal, logits_to_keep=self._last(S))
            self.prefix.fill_(S)
            taps = self._taps()
        else:
            real = attention_mask.to(device=self.device, dtype=torch.bool)
            lengths = real.sum(1)
            positions = (real.long().cumsum(1) - 1).clamp(min=0)
            # a padding row sees itself only (no empty softmax); a token sees the earlier tokens of its row
            allowed = (causal.unsqueeze(0) & real.unsqueeze(1)) | torch.eye(S, dtype=torch.bool, device=self.device)
            out = self._forward(input_ids, positions, rows, allowed, logits_to_keep=self._last(S))
            # each row's tokens to the front: row pad + i moves to i (kv_compact's per-row form, prefix 0)
            pad = (S - lengths).view(B, 1)
            src = pad + rows.view(1, S)
            slots = torch.where(rows.view(1, S) < lengths.view(B, 1), src, torch.full_like(src, -1))
            ops.kv_compact(self._kv_rows, torch.zeros(B, dtype=torch.long, device=self.device),
                           slots if self.batched else slots[0], check=self.device.type != "cuda")
            self.prefix.copy_(lengths)
            taps = self._taps()
            if taps is not None:
                taps = taps.gather(1, src.clamp(max=S - 1).unsqueeze(-1).expand(-1, -1, taps.shape[-1]))
        logits = out.logits[:, -1].float()
        return (logits if self.batched else logits[0]), taps

    def _prefill_each(self, input_ids, attention_mask, causal):
        """:meth:`prefill` one prompt at a time, each into its own cache row (row-invariant verification: a
        request's prompt is then computed exactly as when it is decoded alone)."""
        B, S = input_ids.shape
        lengths = [S] * B if attention_mask is None else attention_mask.to(torch.long).sum(1).tolist()
        logits, taps = [], None
        for b, n in enumerate(lengths):
            rows = self._cols[:n]
            cache = self.cache.row(b)
            cache.fresh = True
            out = self._forward(input_ids[b:b + 1, S - n:], rows.view(1, n), rows, causal[:n, :n],
                                cache=cache, logits_to_keep=self._last(n))
            logits.append(out.logits[0, -1].float())
            t = self._taps()
            if t is not None:
                taps = t.new_zeros(B, S, t.shape[-1]) if taps is None else taps
                taps[b, :n] = t[0]
            self.prefix[b] = n
        return torch.stack(logits), taps

    @torch.no_grad()
    def verify(self, tree_tokens, tree_depths, tree_mask, window=None, bad=None, real=None):
        """One forward over a verification tree per row: tree_tokens/tree_depths [n] int64 and tree_mask [n, n]
        bool (ancestor-or-self) with batch 1, [batch, n] / [batch, n, n] with a batch, all on the model's
        device.  Row b's nodes are written at cache columns prefix[b] .. prefix[b]+n-1 (until :meth:`commit`).
        ``window`` (a host int >= every row's prefix + n, or None = the whole cache): attend to the first
        ``window`` columns only -- on the CPU, where attention over unused columns is real work; a GPU keeps
        the whole cache so every cycle has the same shape.  ``bad``, ``real``: the engine's non-finite flags
        [batch] and each row's real nodes (1-element tensors unbatched), ORed with :func:`~.finite.mark_nonfinite`
        (bad, logits, real).  Returns (logits
        [n, V] / [batch, n, V] float32, taps [batch, n, 3H] or None)."""
        W = self.capacity if window is None else min(window, self.capacity)
        self.cache.staged = bool(self._mixers) and tree_tokens.shape[-1] > 1
        self._mixer_in.clear()
        try:
            return self._verify(tree_tokens, tree_depths, tree_mask, W, bad, real)
        finally:
            self.cache.staged = False

    def _verify(self, tree_tokens, tree_depths, tree_mask, W, bad, real):
        """:meth:`verify` over the first ``W`` columns."""
        if tree_tokens.dim() == 1:
            n = tree_tokens.shape[0]
            P = self.prefix
            slots = P + self._cols[:n]
            allowed = (self._cols[:W] < P).expand(n, W).clone()
            allowed.scatter_(1, slots.expand(n, n), tree_mask)           # the tree block: ancestors and self
            out = self._forward(tree_tokens.view(1, n), (tree_depths + P).view(1, n), slots, allowed,
                                call=self._call, exact=self.invariant, bad=bad, n=real, rope="min")
            return out.logits[0].float(), self._taps()
        B, n = tree_tokens.shape
        P = self.prefix.view(B, 1)
        slots = P + self._cols[:n]                                       # [B, n]
        allowed = (self._cols[:W].view(1, 1, W) < P.view(B, 1, 1)).expand(B, n, W).clone()
        allowed.scatter_(2, slots.view(B, 1, n).expand(B, n, n), tree_mask)
        out = self._forward(tree_tokens, tree_depths + P, slots, allowed, call=self._call, exact=self.invariant,
                            bad=bad, n=real, rope="min")
        return out.logits.float(), self._taps()

    @torch.no_grad()
    def refill(self, row, tokens):
        """Recompute row ``row``'s cache from its tokens (a host list: its committed tokens and its root, prefix + 1
        ids) in one forward at positions 0 .. prefix, with LongRoPE's long factors: what the model's ``generate``
        does when a sequence reaches the switch (:func:`rope_switch` with ``recompute``).  The root's column is
        written too; the next verify writes it again."""
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"target: refill expected at most {self.capacity} tokens (the cache), got {n}")
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        cols = self._cols[:n]
        causal = cols.view(1, n) <= cols.view(n, 1)
        self._forward(ids, cols.view(1, n), cols, causal, cache=self.cache.row(row), logits_to_keep=1)

    def commit(self, path, length, *, check=True):
        """Keep the tree slots of ``path`` (tree node indices, ascending from the root, padded with -1 as the
        verify ops' device outputs are; [m] with batch 1, [batch, m] per row): move them behind the committed
        prefix in every layer and advance ``prefix`` by ``length`` (a 1-element / [batch] device tensor)."""
        ops.kv_compact(self._kv_rows, self.prefix, path, check=check)
        if self._mixer_in:
            self._advance_states(path, length)
        self.prefix += length

    def _advance_states(self, path, length):
        """After a staged (chain) verification: each linear-attention layer's states advanced over each row's
        accepted nodes alone, by running its mixer again from the states before the cycle on the inputs it had in
        the verification at those nodes (causal: the same as a forward over the accepted tokens alone).  Reads the
        accepted lengths on the host (the engine's "states" sync point)."""
        paths = path.view(-1, path.shape[-1])
        for b, a in enumerate(length.view(-1).tolist()):
            if a <= 0:
                continue
            cache = self.cache.row(b)
            nodes = paths[b, :a]
            for i, mixer in self._mixers.items():
                args, kwargs = self._mixer_in[i]
                kw = dict(kwargs, attention_mask=None)
                kw[next((n for n in MIXER_CACHE_KW if n in kw), "cache_params")] = cache
                hidden = kw.pop("hidden_states", None)
                rest = args
                if hidden is None:
                    hidden, rest = args[0], args[1:]
                mixer(hidden[b:b + 1].index_select(1, nodes), *rest, **kw)
        self._mixer_in.clear()
