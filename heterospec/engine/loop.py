"""The decoding loop, one for every batch size (batch 1 is a batch of one): argument checks, the static caches,
the prefill, the host loop around :class:`~.cycle.Cycle` with its two declared sync points (:mod:`.sync`:
"bin" for policies with bins, then "accepted"; one host read each for the whole batch), streaming (one
request), EOS and stopping criteria per request, and the stats.  The cycle's steps themselves, in order, are
in :mod:`.cycle`.  On a GPU the ops run as our CUDA kernels with ``check=False``; device-side errors are raised
at the end of the call (``ops.cuda_check``).

A batch (issue 29): B prompts in the rows of the same static caches, each row with its own prefix length,
entropy bin, tree and accepted path, lossless per row.  Rows that finish (EOS, ``max_new_tokens`` or a stopping
criterion) are dropped from the caches at the end of the cycle in which they finish, so they stop costing work,
or masked (``finished_rows="mask"``; always with recorded steps, whose batch is fixed).

Counting conventions: every node count includes the root (like EAGLE's ``total_token``); ``depth`` is the
number of expansion levels after the root expansion (EAGLE's ``depth``), so the deepest drafted token is at
depth ``depth + 1``.  τ = committed tokens / verification calls (each call commits the accepted draft
tokens plus the bonus token); the prefill is counted apart.
"""
from __future__ import annotations

import functools
import threading
import time
import warnings
import weakref
from collections import OrderedDict

import torch

from .. import measure, ops
from ..growth import candidate_count
from ..measure import PhaseClock
from ..models import cpu_decoder as decoder_mod
from ..models import cpu_gemm as gemm
from ..models.target import TargetAdapter, _decoder_layers, attention_window, rope_types
from ..policy import Policy
from . import health, lookup, processors, requests, sync
from .cycle import Cycle
from .stats import GenerationStats
from .tree import DraftState, NoDraft, bucket_for, tree_size

# batch sizes > 1 whose recorded steps (and static caches) the recorded engine keeps at once
MAX_BATCH_CYCLES = 2

# tree sizes (root included) a verification is padded to on a GPU: one static shape per bucket.  On the CPU
# a padded node costs its full share of a compute-bound forward, so trees keep their exact size there.
GPU_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# RoPE variants whose forward may read a position on the host to pick or rescale its frequencies (transformers'
# dynamic_rope_update): a recorded graph would keep the frequencies of the recording.  LongRoPE only where the
# target's rotary does so under the engine's per-row choice (_host_read_rope)
HOST_READ_ROPE = ("dynamic", "longrope")


# the target models being decoded right now -> the thread decoding each (see _exclusive)
_DECODING = weakref.WeakKeyDictionary()
_DECODING_LOCK = threading.Lock()


def _exclusive(method):
    """One call at a time per target model: the static caches, the tap hooks and the routed linear layers belong
    to the model, so a second call while one decodes -- from another thread, from a streamer or a stopping
    criterion of the running call, or from another HeteroSpec on the same model -- would corrupt the first.  It
    gets a RuntimeError instead, and the running call goes on untouched."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        model = self.target.model
        me = threading.current_thread()
        with _DECODING_LOCK:
            other = _DECODING.get(model)
            if other is not None:
                who = "this thread (a streamer or stopping criterion calling back in?)" if other is me else \
                    f"thread {other.name!r}"
                raise RuntimeError(f"generate: expected one call at a time on the target model "
                                   f"{type(model).__name__}, got a second while {who} is decoding with it; wait "
                                   f"for that call to return (or load a second copy of the model for another "
                                   f"thread)")
            _DECODING[model] = me
        try:
            return method(self, *args, **kwargs)
        finally:
            with _DECODING_LOCK:
                _DECODING.pop(model, None)

    return call


def _check_generate_args(max_new_tokens, temperature, top_k, top_p, min_p=None):
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"generate: argument 'max_new_tokens' expected an int >= 1, got {max_new_tokens!r}")
    if not ops.is_decoding_temperature(temperature):
        raise ValueError(f"generate: argument 'temperature' expected 0 (greedy) or a finite value >= "
                         f"{ops.MIN_TEMPERATURE:g}, got {temperature!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"generate: argument 'top_k' expected an int >= 0, got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"generate: argument 'top_p' expected a value in (0, 1], got {top_p!r}")
    if min_p is not None and not (isinstance(min_p, (int, float)) and not isinstance(min_p, bool)
                                  and 0.0 <= min_p <= 1.0):
        raise ValueError(f"generate: argument 'min_p' expected None or a value in [0, 1], got {min_p!r}")


def _with_stop_strings(criteria, stop_strings, tokenizer):
    """``stopping_criteria`` plus HuggingFace's ``StopStringCriteria`` for ``stop_strings`` (a one-line
    ValueError for strings that are not, or no tokenizer)."""
    if stop_strings is None:
        return criteria
    strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not isinstance(strings, (list, tuple)) or not strings or not all(isinstance(x, str) and x for x in strings):
        raise ValueError(f"generate: argument 'stop_strings' expected a non-empty string or a non-empty list of "
                         f"them, got {stop_strings!r}")
    if tokenizer is None or not callable(getattr(tokenizer, "get_vocab", None)):
        raise ValueError(f"generate: argument 'tokenizer' expected the target's tokenizer (a HuggingFace "
                         f"tokenizer, to match stop_strings), got {type(tokenizer).__name__}")
    from transformers import StopStringCriteria

    return list(criteria or []) + [StopStringCriteria(tokenizer, list(strings))]


def _host_read_rope(model, rows=None):
    """The RoPE variants of ``model``'s config (:data:`HOST_READ_ROPE`) whose frequencies a forward of ours picks by
    reading a position on the host.  LongRoPE counts only where ``rows`` (the target adapter's per-row choice,
    ``TargetAdapter.rope_rows``) reads one, as measured here: one call over a row on each side of the switch under
    :func:`.sync.forbid_host_transfers` (transformers from 5.23 on picks its factors with ``torch.where``; 5.0, and
    PhiMoE's rotary choosing its scale, with a Python ``if`` on a tensor)."""
    kinds = rope_types(getattr(model, "config", None)) & set(HOST_READ_ROPE)
    if "longrope" in kinds and rows is not None:
        p = next(model.parameters())
        x = torch.zeros(1, dtype=p.dtype, device=p.device)
        at = rows.at
        pos = torch.tensor([[max(at - 2, 0), max(at - 1, 0)], [at, at + 1]], device=p.device)
        rows.rule = "min"
        try:
            with torch.no_grad():
                rows(x, pos)                      # first: tables transformers makes once, lazily
                with sync.forbid_host_transfers():
                    rows(x, pos)
        except Exception:       # noqa: BLE001 -- a host read (AssertionError) or a call it cannot take: recorded never
            pass
        else:
            kinds.discard("longrope")
    return sorted(kinds)


def _check_graphs(cuda_graphs, device, draft, target=None, rows=None):
    """-> False, True (CUDA graphs) or "emulate" (the recorded-step plumbing without graphs, any device).  ``rows``:
    the target's LongRoPE choice (:func:`_host_read_rope`)."""
    if cuda_graphs == "emulate":
        return "emulate"
    host_read = [(who, rope) for who, m, r in (("target", target, rows), ("draft", draft, None)) if m is not None
                 for rope in _host_read_rope(m, r)]
    if cuda_graphs == "auto":
        return device.type == "cuda" and not host_read
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"HeteroSpec: argument 'cuda_graphs' expected True, False, 'auto' or 'emulate', "
                         f"got {cuda_graphs!r}")
    if cuda_graphs and host_read:
        who, rope = host_read[0]
        raise ValueError(f"HeteroSpec: argument 'cuda_graphs' expected False for a {who} with {rope} RoPE "
                         f"scaling (its frequencies depend on a host read of the position), got True")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"HeteroSpec: argument 'cuda_graphs' expected False on {device} (CUDA graphs need a "
                         f"model on a CUDA device; 'emulate' runs the same steps without graphs), got True")
    return cuda_graphs


def _check_stateful(tgt, policy, cuda_graphs, compile, lookup_tokens, who="HeteroSpec"):
    """A target with linear-attention layers (``tgt.stateful``) verifies chains only: its layers' states are a
    recurrence over a sequence, which a tree's siblings would enter one after another.  So a draft's ``policy`` must
    keep one candidate a level (top_k 1), prompt lookup goes without a draft, and the eager engine runs it (the
    states advance over each row's accepted nodes after reading their count on the host).  A one-line ValueError
    naming the argument otherwise."""
    what = f"a target with linear-attention layers ({', '.join(sorted({type(m).__name__ for m in tgt.mixers}))})"
    if policy is not None and policy.top_k != 1:
        raise ValueError(f"{who}: argument 'policy' expected top_k 1 (a chain of drafts: {what} verifies no tree), "
                         f"got top_k {policy.top_k}")
    if policy is not None and lookup_tokens:
        raise ValueError(f"{who}: argument 'prompt_lookup_num_tokens' expected 0 with a draft for {what} (the "
                         f"lookup's chain would be a second branch), got {lookup_tokens}")
    if cuda_graphs is True or cuda_graphs == "emulate":
        raise ValueError(f"{who}: argument 'cuda_graphs' expected False or 'auto' for {what} (its states advance "
                         f"after a host read of the accepted counts), got {cuda_graphs!r}")
    if compile:
        raise ValueError(f"{who}: argument 'compile' expected False for {what}, got {compile!r}")


def _check_invariant(setting, param):
    """``batch_invariant`` ('auto', True or False) -> whether to try row-invariant verification for a target whose
    first parameter is ``param`` ('auto': a bfloat16 CPU target; True: ValueError for any other)."""
    from ..models.target import INVARIANT_DTYPES

    if setting not in ("auto", True, False):
        raise ValueError(f"HeteroSpec: argument 'batch_invariant' expected 'auto', True or False, got {setting!r}")
    fits = param.device.type == "cpu" and param.dtype in INVARIANT_DTYPES
    if setting is True and not fits:
        raise ValueError(f"HeteroSpec: argument 'batch_invariant' expected 'auto' or False for a "
                         f"{str(param.dtype).replace('torch.', '')} target on {param.device} (True needs a bfloat16 "
                         f"target on the CPU), got True")
    return bool(setting) and fits


def _check_buckets(buckets, device):
    if isinstance(buckets, str) and buckets == "auto":
        return GPU_BUCKETS if device.type == "cuda" else ()
    ok = buckets is None or (isinstance(buckets, (tuple, list))
                             and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in buckets)
                             and all(x < y for x, y in zip(buckets, buckets[1:])))
    if not ok:
        raise ValueError(f"HeteroSpec: argument 'buckets' expected 'auto', None or ascending ints >= 1, "
                         f"got {buckets!r}")
    return tuple(buckets or ())


def eos_ids(model, eos_token_id):
    """The ids that end a request, as a list: ``eos_token_id`` (an int or ints), or for None ``model``'s
    ``generation_config.eos_token_id`` (an int, a list or None: none), as HuggingFace's ``generate`` does."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"generate: argument 'eos_token_id' expected a token id, a list of ids or None (the "
                         f"model's), got {eos_token_id!r}")
    return ids


class HeteroSpec:
    """Speculative decoding of a HuggingFace target with an EAGLE-3 draft (or none: autoregressive).

    ``policy``: a :class:`Policy` (``Policy.static()`` = EAGLE-3, ``Policy.paper(...)`` = HeteroSpec,
    ``Policy.autoregressive()``); with ``draft=None`` decoding is autoregressive whatever the policy.
    ``max_length``: the static caches' size in positions (prompt + new tokens); by default they are sized
    by each call and kept.  ``buckets``: the tree sizes verification is padded to ('auto': a fixed set on a
    GPU, exact sizes on the CPU; None: exact sizes).  ``cuda_graphs``: record the cycle's fixed-shape steps
    once per tree shape and replay them as CUDA graphs (:mod:`.graphs`; True needs a CUDA model, 'auto' = on
    CUDA unless the target or the draft uses dynamic or longrope RoPE, falling back to the eager engine with a
    warning if recording fails, 'emulate' = the same recorded-step plumbing without graphs, for
    tests on any device; False: the eager engine).  The default is 'auto': on a GPU the eager engine is
    host-bound (the second GPU window: 49.5 against 157.1 tokens/s for ``ar`` in fp32 on an H200), and the
    recorded engine passed every GPU test phase since.  Recording happens at the first call for each
    sampling setting and cache size (0.4-1.6 s for the default pair on an H200); pass ``max_length`` to record
    once.  ``compile``: the target's forward
    through ``torch.compile`` (True = inductor, or a backend name), one specialisation per shape; with
    ``cuda_graphs`` the compiled forward is what gets captured (fewer kernels per forward).  ``cpu_gemm``: on the
    CPU, run the target's and the draft's linear layers with weights packed once -- through oneDNN, or through
    heterospec's own few-rows float32 kernel ('rows', row-invariant by construction) --
    (:mod:`heterospec.models.cpu_gemm`), only inside ``generate``: between calls the model is as it was.  'auto'
    (for a CPU model in float32 or bfloat16) measures, per layer shape and rows per call (1; 2-16; more), which
    of torch's default and the packed paths is fastest on this machine and routes there (measured once per
    machine, a few seconds for a 135M model, then cached on disk); 'onednn' or 'rows' forces that path for every
    layer and row count, True the 'rows' kernel where it runs (oneDNN otherwise), False = torch's default
    ``linear`` (and what ``compile=True`` uses: inductor lowers the linear layers itself).  ``self.cpu_gemm``
    and every call's stats say which.  A forward over the few rows of a tree then costs little more than one
    row does (MKL's default path costs 1.5-1.9x one row for 4 rows or more); the logits agree with the default
    path to ~1e-4.

    ``batch_invariant``: verify so that every tree node's logits are bit for bit what a one-row step of the same
    engine gives (each row attends to exactly its keys; each linear layer of the target on one path for every
    row count, every call in blocks of 8 rows), so that speculative output equals this engine's autoregressive
    output in bfloat16 too, where the sums of a forward over many rows otherwise round differently from one
    row's.
    'auto' (default): on for a bfloat16 target on the CPU that our decoder does not run (``cpu_decoder``: it is
    row-invariant by construction) when both properties hold on this machine (checked when the engine is made; off
    with a warning where they do not); True insists (ValueError where it cannot), on transformers' bfloat16
    arithmetic (our decoder then stays off); False: off.  In float32 it is never needed for the greedy output to
    match (and is not offered).

    ``cpu_decoder``: run the target's forwards (prefill and verify) through heterospec's own decoder on the CPU
    (:mod:`heterospec.models.cpu_decoder`: every layer in one call of C, the linear layers on the few-rows
    kernel, on this engine's cache) instead of transformers' modules, whose ~1,400 small operations per forward
    cost the default pair about as much as its matrix products.  'auto' (default): on for a CPU target of a family
    it has (:data:`heterospec.models.cpu_decoder.FAMILIES`), not compiled, where the
    kernel has AVX2 or AVX-512 tiles; True insists (ValueError naming why not); False: transformers' forward.  It
    computes in float32: a bfloat16 or float16 model's weights are read as their 16-bit values and its cache is
    float32, so its output is that of the same weights in float32 (``model.float()``), not transformers' half
    arithmetic.  The logits agree with transformers' float32 forward to ~1e-5; every tree node's logits are bit
    for bit a one-row step's of the same engine, so speculative output equals this engine's autoregressive output
    by construction.  The same setting runs an EAGLE-3 draft's step and head (its one layer, 2H wide, and its
    output layer) in one call of the same code where the draft is heterospec's ``Eagle3Draft`` on the CPU (float32,
    bfloat16 or float16; True insists on the target's decoder only; any other draft keeps its own step); the
    draft's output is not the lossless part, so its ~1e-6 differences to the torch modules only move which tokens
    are proposed.  ``self.cpu_decoder`` and every call's stats say which ran
    ("target and draft (AVX-512)", ...), and ``self.cpu_decoder_why`` why the target's forwards stay on
    transformers' (a phrase: "off", the model's family, the memory, ...; None where ours runs them); ``cpu_gemm`` then routes what is left on torch's layers (the draft's
    ``fc``, or all of it).

    ``disable_by_batch_size``: a ``generate`` call of more requests than this decodes autoregressively (vLLM's
    option of the same name): where a verify's rows cost compute, a batch's trees outweigh what they save (on a
    2-core CPU the default pair's HeteroSpec fell behind autoregressive decoding from 4 requests on).  The output
    is the same either way (speculation is lossless); the call's stats show τ 1.  None (default): every call
    drafts.

    ``prompt_lookup_num_tokens``, ``max_matching_ngram_size``, ``min_matching_ngram_size``: the engine's prompt
    lookup (:meth:`generate`'s arguments of the same names, which override them per call): off by default."""

    def __init__(self, target, draft=None, policy=None, *, max_length=None, buckets="auto", cuda_graphs="auto",
                 compile=False, cpu_gemm="auto", batch_invariant="auto", cpu_decoder="auto",
                 disable_by_batch_size=None, prompt_lookup_num_tokens=None, max_matching_ngram_size=None,
                 min_matching_ngram_size=None):
        self.draft = draft
        self.policy = policy if policy is not None else (Policy.static() if draft is not None else
                                                         Policy.autoregressive())
        if draft is None:
            self.policy = Policy.autoregressive()
        p = next(target.parameters(), None)
        if p is None:
            raise ValueError("HeteroSpec: argument 'target' expected a model with parameters")
        self.device = p.device
        if self.device.type == "cuda":
            from .. import build_info

            if not build_info().get("cuda"):
                raise ValueError(f"HeteroSpec: argument 'target' is on {self.device}, but heterospec's C core "
                                 f"was built without CUDA (build_info()['cuda'] is False); reinstall where nvcc "
                                 f"is on the PATH (HETEROSPEC_CUDA=1 pip install ...)")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"HeteroSpec: argument 'target' expected a model on the CPU or a CUDA device, got "
                             f"{self.device}")
        if draft is not None:
            dp = next(iter(draft.parameters()), None)
            dp = next(iter(draft.buffers()), None) if dp is None else dp
            ddtype = getattr(draft, "dtype", None)
            if dp is not None and dp.device != self.device:
                raise ValueError(f"HeteroSpec: argument 'draft' expected the target's device {self.device}, got "
                                 f"{dp.device} (move it with draft.to(...))")
            if isinstance(ddtype, torch.dtype) and ddtype != p.dtype:
                raise ValueError(f"HeteroSpec: argument 'draft' expected the target's dtype {p.dtype}, got "
                                 f"{ddtype} (load it with dtype=target.dtype)")
        if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)
                                       or max_length < 2):
            raise ValueError(f"HeteroSpec: argument 'max_length' expected an int >= 2 or None, got {max_length!r}")
        self.max_length = max_length
        self.buckets = _check_buckets(buckets, self.device)
        taps = None
        config = getattr(draft, "config", None)
        if config is not None and hasattr(config, "tap_layers"):
            taps = config.tap_layers(len(_decoder_layers(target)))
        if not (isinstance(compile, bool) or (isinstance(compile, str) and compile)):
            raise ValueError(f"HeteroSpec: argument 'compile' expected a bool or a torch.compile backend name, got "
                             f"{compile!r}")
        if compile is True or compile == "inductor":
            # inductor lowers the linear layers itself and cannot lower oneDNN's packed ones (an InductorError at
            # the first verify forward on the CPU): the packed path stays off under it
            if cpu_gemm is True or (isinstance(cpu_gemm, str) and cpu_gemm in ("onednn", "rows")):
                raise ValueError(f"HeteroSpec: argument 'cpu_gemm' expected False or 'auto' with compile=True "
                                 f"(inductor compiles the linear layers itself), got {cpu_gemm!r}")
            cpu_gemm = False
        # our decoder computes a half model in float32, each row on its own (so row-invariant by construction):
        # batch_invariant's transformers path is for the targets it leaves alone, or where True insists on it
        why = []
        self._decoder = decoder_mod.for_target(cpu_decoder, target, compile=bool(compile),
                                               transformers=batch_invariant is True, why=why)
        self.cpu_decoder_why = why[0]
        self.batch_invariant = _check_invariant(batch_invariant, p) and self._decoder is None
        self._fast_draft = decoder_mod.for_draft(cpu_decoder, draft)
        self.cpu_decoder = decoder_mod.describe(self._decoder, self._fast_draft)
        routed = decoder_mod.gemm_modules(draft, self._fast_draft)
        try:
            self.target = TargetAdapter(target, tap_layers=taps, capture_taps=draft is not None, compile=compile,
                                        invariant=self.batch_invariant, batched=True, decoder=self._decoder)
            # packed once here (outside any timed call), routed only inside generate
            self._gemm = gemm.for_models(cpu_gemm, target, routed, invariant=self.batch_invariant,
                                         traced=bool(compile), route_target=self._decoder is None)
        except ValueError as e:
            if batch_invariant is True or "row-invariant" not in str(e):
                raise
            if getattr(self, "target", None) is not None:
                self.target.close()
            warnings.warn(f"HeteroSpec: batch_invariant='auto' is off here: {e}", stacklevel=2)
            self.batch_invariant = False
            self.target = TargetAdapter(target, tap_layers=taps, capture_taps=draft is not None, compile=compile,
                                        batched=True, decoder=self._decoder)
            self._gemm = gemm.for_models(cpu_gemm, target, routed, traced=bool(compile),
                                         route_target=self._decoder is None)
        self.cpu_gemm = self._gemm.describe()   # which row classes run packed: in every call's stats
        if policy is None and draft is not None and self.target.stateful:
            # linear-attention layers take chains only (_check_stateful): the default's depth, one candidate a level
            self.policy = Policy.static(self.policy.depth, 1, self.policy.depth + 1)
        self._drafting = draft is not None and self.policy.drafts
        if disable_by_batch_size is not None and (not isinstance(disable_by_batch_size, int)
                                                  or isinstance(disable_by_batch_size, bool)
                                                  or disable_by_batch_size < 1):
            raise ValueError(f"HeteroSpec: argument 'disable_by_batch_size' expected None or an int >= 1, got "
                             f"{disable_by_batch_size!r}")
        self.disable_by_batch_size = disable_by_batch_size
        self.lookup = lookup.check(prompt_lookup_num_tokens, max_matching_ngram_size, min_matching_ngram_size,
                                   who="HeteroSpec")
        pol = self.policy
        self._levels = pol.levels
        most = max((pol.total_tokens, *pol.keep))
        self._most_nodes = min(most, candidate_count(pol.top_k, self._levels) + 1)   # the largest tree, root included
        self._d2t = None
        if self._drafting:
            d2t = getattr(draft, "d2t", None)
            with sync.outside_cycle():
                d2t = d2t.detach().to(self.device, torch.long) if d2t is not None and bool(torch.any(d2t != 0)) else None
            self._d2t = d2t
        if self.target.stateful:
            _check_stateful(self.target, self.policy if self._drafting else None, cuda_graphs, compile,
                            self.lookup[0])
            cuda_graphs = False if cuda_graphs == "auto" else cuda_graphs
        self.cuda_graphs = _check_graphs(cuda_graphs, self.device, draft, target, self.target.rope_rows)
        self._graphs_fallback = cuda_graphs == "auto"    # 'auto': a recording that fails falls back to eager
        self._cycle = self._new_cycle(1)      # batch 1: the engine's own adapter and caches, kept between calls
        self._cycles = OrderedDict()          # recorded engine: batch size > 1 -> its Cycle (own adapter, caches)

    def _drafts(self, batch):
        """Whether a call of ``batch`` requests drafts (``disable_by_batch_size``)."""
        limit = self.disable_by_batch_size
        return self._drafting and (limit is None or batch <= limit)

    def _new_cycle(self, batch):
        """A :class:`~.cycle.Cycle` of ``batch`` rows: batch 1 on the engine's adapter, a batch on an adapter of
        its own (its own static caches, closed with the cycle); autoregressive where the batch does not draft."""
        drafting = self._drafts(batch)
        tgt = self.target if batch == 1 else TargetAdapter(
            self.target.model, tap_layers=self.target.tap_layers, capture_taps=drafting, batch=batch,
            invariant=self.target.invariant, decoder=self._decoder)
        dr = (DraftState(self.draft, self.policy.top_k, self._levels, self._d2t, batch, fast=self._fast_draft)
              if drafting else NoDraft(self.device, batch))
        return Cycle(tgt, dr, self.policy if drafting else Policy.autoregressive(), self.buckets, self.device,
                     emulate=self.cuda_graphs == "emulate", owns_target=batch > 1)

    @property
    def cycle(self):
        """The engine's batch-1 :class:`~.cycle.Cycle`: its target adapter (``.target``), drafter (``.drafter``)
        and steps, on the static caches (what :func:`heterospec.tune.profile_costs` times)."""
        return self._cycle

    def __repr__(self):
        """What the engine runs, in one line: the target, the draft and the policy (with its bins), the device and
        dtype, and how the steps run (recorded or eager, the CPU paths, prompt lookup)."""
        cfg = getattr(self.target.model, "config", None)
        name = getattr(cfg, "_name_or_path", "") or type(self.target.model).__name__
        dtype = next(self.target.model.parameters()).dtype
        pol = self.policy
        shape = "autoregressive" if not pol.drafts else (
            f"{pol.name} (depth {pol.depth}, top-k {pol.top_k}, {pol.total_tokens} nodes"
            + (f", {len(pol.thresholds) + 1} entropy bins" if pol.binned else "") + ")")
        draft = "none" if self.draft is None else type(self.draft).__name__
        L, hi, lo = self.lookup
        look = f", prompt lookup {L} tokens from {lo}-{hi}-grams" if L else ""
        graphs = self.cuda_graphs if isinstance(self.cuda_graphs, str) else ("on" if self.cuda_graphs else "off")
        return (f"HeteroSpec(target {name}, draft {draft}, {shape}, {self.device} {str(dtype).replace('torch.', '')}"
                f", CUDA graphs {graphs}, CPU decoder: {self.cpu_decoder}{look})")

    def close(self):
        """Remove the tap hooks from the target and drop the recorded steps (also done on exit of a ``with``
        block)."""
        self.target.close()
        self._cycle.close()
        while self._cycles:
            self._cycles.popitem()[1].close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def capacity(self, prompt_len, max_new_tokens, lookup=0):
        """Static cache positions per row a request needs: every committed token plus the largest tree (or the
        draft's catch-up rows) written past them; ``lookup``: the prompt-lookup chain's length grafted onto it."""
        tree = bucket_for(self._most_nodes + lookup, self.buckets)   # its bucket, a chain's room included
        return prompt_len + max_new_tokens + max(tree, self._levels + 2, lookup + 1) + 1

    def overshoot(self, lookup=0):
        """Positions a cycle may commit past a request's budget (its deepest path and the bonus token): a masked
        finished row keeps them and still verifies a tree there every cycle."""
        return max(self._levels + 2, lookup + 1)

    # ---- the loop -----------------------------------------------------------------------------------

    def _new_stats(self, graphs):
        """A call's GenerationStats, saying how it runs: recorded steps or not, the CPU matrix path."""
        return GenerationStats(graphs=self.cuda_graphs if isinstance(self.cuda_graphs, str) else
                               ("cuda" if graphs else "off"), cpu_gemm=self.cpu_gemm, cpu_decoder=self.cpu_decoder)

    @_exclusive
    @torch.no_grad()
    def generate(self, input_ids, *, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, min_p=None, do_sample=None,
                 eos_token_id=None,
                 stopping_criteria=None, streamer=None, seed=None, attention_mask=None, pad_token_id=None,
                 finished_rows="drop", logits_processor=None, repetition_penalty=None, prompt_lookup_num_tokens=None,
                 max_matching_ngram_size=None, min_matching_ngram_size=None, output_logits=False, stop_strings=None,
                 tokenizer=None):
        """Returns (sequences [1, S + new] int64 on the CPU, GenerationStats).  Greedy when temperature == 0;
        sampled otherwise, from the target's distribution warped as HuggingFace's ``generate`` warps it: the
        temperature, ``top_k``, ``top_p``, then ``min_p`` (HuggingFace's ``MinPLogitsWarper``: tokens below ``min_p``
        times the likeliest one's probability go; None or 0: off; applied by the acceptance, ``ops.verify_sample``,
        recorded steps included).  ``do_sample``, HuggingFace's switch: None decides by the temperature,
        False is greedy whatever the temperature, True samples (at temperature 1.0 when none is given; top-k stays
        0, off, where HuggingFace's generation config defaults to 50).
        A request ends at ``max_new_tokens`` or at an ``eos_token_id`` (an id or ids; None, the default: the
        target's ``generation_config.eos_token_id``, as HuggingFace's ``generate`` takes it; [] for none).

        A batch (the same loop: batch 1 is a batch of one): ``input_ids`` [B, S] left-padded with an
        ``attention_mask`` [B, S] (as a
        HuggingFace tokenizer pads prompts for generation; None: no padding), or a list of prompts of any lengths
        (1-D token sequences).  Each row decodes losslessly on its own: its output equals that prompt decoded
        alone.  Returns the sequences -- for a tensor, [B, S + the longest generation] with each row's input
        (padding included), its new tokens, then ``pad_token_id`` (default: the first EOS id, else 0); for a list,
        a list of 1-D tensors (prompt + new tokens) -- and the batch's GenerationStats, whose ``per_row`` holds
        each request's own (its ``total_s``: the request's latency, from the prefill's start to its last token;
        the batch's ``cycles`` count request-cycles, ``batch_calls`` the batched forwards).  Sampling
        keys row b's uniforms with ``seed + b`` (or ``seed[b]`` for a list), so a row draws as its prompt alone
        with that seed.  ``stopping_criteria`` are asked per request (each with that request's own tokens, as
        [1, n] ids); a ``streamer`` takes a single prompt.  ``finished_rows``: "drop" (a
        finished request leaves the caches, so it stops costing work) or "mask" (it stays, verifying its root
        alone and committing nothing, so every cycle keeps the batch's shape; with ``cuda_graphs`` a batch's
        recorded steps have a fixed batch, so finished rows are always masked).

        ``logits_processor``: HuggingFace-style processors ``(input_ids [n, L], scores [n, V]) -> scores`` (a
        ``LogitsProcessorList``, a list or one callable, e.g. ``RepetitionPenaltyLogitsProcessor(1.2)``, or one such
        list per prompt), applied in order to the target's next-token scores at every position before the greedy or
        sampling rule (temperature, top-k and top-p come after them, as in HuggingFace's ``generate``), with
        ``input_ids`` each request's input row (padding included, as HuggingFace passes a padded batch; a list's
        prompts unpadded) and its tokens so far.  Each verification-tree node is processed with its own path, so
        decoding stays lossless for the processed distribution (the draft's distributions are processed too, which
        only helps it guess); a processor must compute each row from that row's own ids and scores.  Such a call
        runs the eager cycle (no recorded steps) and processes on the host every cycle
        (:mod:`heterospec.engine.processors`) -- except a ``RepetitionPenaltyLogitsProcessor`` alone, which runs on
        the device, recorded steps included.  ``repetition_penalty`` (HuggingFace's and vLLM's option; None or 1.0:
        off) puts that processor first in the list.

        ``prompt_lookup_num_tokens``: HuggingFace's prompt lookup inside the cycle -- each cycle, the longest suffix
        of at most ``max_matching_ngram_size`` tokens (default 2) and at least ``min_matching_ngram_size`` (default
        1) of a request's prompt and tokens so far that occurred before proposes the ``prompt_lookup_num_tokens``
        tokens that followed it (its latest occurrence; None: the engine's own settings, 0: off), as
        one more branch of the verification tree (with a draft) or as the whole tree (without one).  The output is
        unchanged (lossless either way); only how many tokens a cycle accepts changes.  The chain is grafted on
        the device, so such a call runs recorded steps too (recorded once per chain length, the trees padded for a
        whole chain: :mod:`heterospec.engine.lookup`).

        ``output_logits``: keep the target's raw logits (before any processor or warper) that each new token was
        decided from -- the prefill's last row for the first, then each accepted path node's row -- as
        ``stats.logits`` ([new_tokens, V] float32 on the model's device; a batch: each row's ``per_row`` stats),
        HuggingFace's ``output_logits`` (recorded steps too: recorded apart, with the rows' gather inside).

        ``stop_strings``: a string or a list of them, with the ``tokenizer`` that decodes the target's ids: a
        request ends once its text ends with one of them, the tokens that made it kept (HuggingFace's
        ``stop_strings`` and its ``StopStringCriteria``, asked per request after every new token like any
        stopping criterion, so the output is HuggingFace's with the same option)."""
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ValueError(f"generate: argument 'do_sample' expected None, True or False, got {do_sample!r}")
        if do_sample is False:
            temperature = 0.0
        elif do_sample and temperature == 0.0:
            temperature = 1.0
        _check_generate_args(max_new_tokens, temperature, top_k, top_p, min_p)
        stopping_criteria = _with_stop_strings(stopping_criteria, stop_strings, tokenizer)
        if not isinstance(output_logits, bool):
            raise ValueError(f"generate: argument 'output_logits' expected True or False, got {output_logits!r}")
        eos_token_id = eos_ids(self.target.model, eos_token_id)
        eos = set(eos_token_id)
        if finished_rows not in ("drop", "mask"):
            raise ValueError(f"generate: argument 'finished_rows' expected 'drop' or 'mask', got {finished_rows!r}")
        pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
        vocab = self.target.model.get_input_embeddings().num_embeddings
        as_list = isinstance(input_ids, (list, tuple))
        if as_list:
            if not input_ids:
                raise ValueError("generate: argument 'input_ids' expected at least one prompt, got an empty list")
            if attention_mask is not None:
                raise ValueError("generate: argument 'attention_mask' expected None with a list of prompts (they "
                                 "are padded here), got a mask")
            if len(input_ids) > 1 and not 0 <= pad < vocab:    # it fills the shorter prompts' padding
                raise ValueError(f"generate: argument 'pad_token_id' expected an id in [0, {vocab}) to pad a list "
                                 f"of prompts, got {pad}")
            raw_prompts = input_ids
            input_ids, attention_mask = requests.left_pad(input_ids, pad, self.device)
        elif not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"generate: argument 'input_ids' expected a [B, S] tensor or a list of prompts, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        B = input_ids.shape[0]
        with sync.outside_cycle():                      # the mask's and the ids' checks read them on the host
            lengths = requests.check_mask(input_ids, attention_mask)
            requests.check_ids(input_ids, vocab)
        if isinstance(seed, (list, tuple)) and len(seed) != B:
            raise ValueError(f"generate: argument 'seed' expected an int or {B} ints (one per prompt), got "
                             f"{len(seed)}")
        if B < 1:
            raise ValueError("generate: argument 'input_ids' expected at least one prompt, got 0 rows")
        if streamer is not None and B > 1:
            raise ValueError(f"generate: argument 'streamer' expected a single prompt, got a batch of {B}")
        S = input_ids.shape[1]
        logits_processor = processors.with_penalty(repetition_penalty, logits_processor, B,
                                                   None if as_list else [S - n for n in lengths])
        procs, contexts = processors.check(logits_processor, B), None
        penalty = processors.on_device(procs)       # a repetition penalty alone: on the device, recordable
        if penalty is not None:
            procs = []
        lookup_n = lookup.check(prompt_lookup_num_tokens, max_matching_ngram_size, min_matching_ngram_size,
                                self.lookup)
        if self.target.stateful:
            _check_stateful(self.target, self.policy if self._drafting else None, False, False, lookup_n[0],
                            who="generate")
        if procs or penalty:   # what each request's processors see before its first new token
            with sync.outside_cycle():
                contexts = ([[int(t) for t in p] for p in raw_prompts] if as_list else input_ids.tolist())
            if penalty is not None and any(n >= len(c) for n, c in zip(penalty[1], contexts)):
                penalty, procs = None, processors.check(logits_processor, B)   # a skip past the prompt: the host's
        if max(lengths) < 1:
            raise ValueError("generate: argument 'input_ids' expected at least one token, got 0")
        maxpos = self.target.max_positions
        if maxpos is not None and S + max_new_tokens > maxpos:
            raise ValueError(f"generate: prompt ({S}) + max_new_tokens ({max_new_tokens}) "
                             f"exceed the target's max_position_embeddings ({maxpos})")
        pad_front = None
        if B == 1 and lengths[0] < S:             # one request: its padding is not decoded, only given back
            with sync.outside_cycle():
                pad_front = input_ids[:, :S - lengths[0]].cpu()
            input_ids, attention_mask = input_ids[:, S - lengths[0]:], None
        with self._gemm:
            new, stats = self._decode(input_ids, attention_mask, lengths, max_new_tokens, temperature, top_k, top_p,
                                      min_p, eos, seed, finished_rows, stopping_criteria, streamer, procs, contexts,
                                      lookup_n, output_logits, penalty)
        with sync.outside_cycle():                      # the results, on the host
            ids = input_ids.cpu()
            S = ids.shape[1]
            if as_list:
                return [torch.cat([ids[b, S - lengths[b]:], torch.tensor(new[b], dtype=torch.long, device="cpu")])
                        for b in range(B)], stats
            if B == 1 and pad_front is not None:
                ids = torch.cat([pad_front, ids], dim=1)
                S = ids.shape[1]
            out = torch.full((B, S + max(len(x) for x in new)), pad, dtype=torch.long, device="cpu")
            out[:, :S] = ids
            for b, x in enumerate(new):
                out[b, S:S + len(x)] = torch.tensor(x, dtype=torch.long, device="cpu")
            return out, stats

    def _cycle_for(self, B, need, graphs):
        """The Cycle of a call of ``B`` requests with its caches allocated for ``need`` positions per row (a
        one-line error before any decoding when they cannot fit).  Batch 1 is the engine's own, kept between
        calls; the eager engine makes a batch's per call, the recorded engine keeps one per batch size (at most
        ``MAX_BATCH_CYCLES``, least recently used dropped) with its recordings."""
        if B == 1:
            self._cycle.allocate(need)
            return self._cycle
        kept = self._cycles
        if graphs and B in kept:
            cyc = kept.pop(B)
            kept[B] = cyc
            if need <= cyc.target.capacity:
                return cyc
        else:
            cyc = self._new_cycle(B)
        dev = self.device
        # the target's cache twice, as before its finished rows moved in place (TargetAdapter.keep_rows): room for
        # the draft's cache and its copies at a drop, and for the forwards' activations beside the caches
        nbytes = cyc.target.cache_bytes(need) * 2
        free = measure.available_bytes(dev)
        error = None
        if free is not None and nbytes > free:
            error = (f"generate: argument 'input_ids' expected a batch whose static caches fit the {dev} memory "
                     f"available ({free / 2**30:.2f} GiB), got {B} prompts needing about {nbytes / 2**30:.2f} GiB "
                     f"({need} positions per row)")
        else:
            try:
                cyc.allocate(need)
            except RuntimeError as e:   # an allocation the device cannot hold after all, before any decoding
                error = (f"generate: argument 'input_ids' expected a batch whose static caches fit the {dev} "
                         f"memory, got {B} prompts of {need} positions per row ({type(e).__name__})")
        if error is not None:
            kept.pop(B, None)
            cyc.close()
            raise ValueError(error)
        if graphs:
            kept[B] = cyc
            while len(kept) > MAX_BATCH_CYCLES:
                kept.pop(next(iter(kept))).close()
        return cyc

    def _seeds(self, seed, B):
        """Each row's Philox key: ``seed[b]``, or ``seed + b`` (row b draws as its prompt alone with that seed)."""
        if isinstance(seed, (list, tuple)):           # its length is checked by generate
            seeds = [int(s) for s in seed]
        else:
            with sync.outside_cycle():
                base = int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,), device="cpu").item())
            seeds = [base + b for b in range(B)]
        bad = [s for s in seeds if not 0 <= s < 2**63]
        if bad:
            raise ValueError(f"generate: argument 'seed' expected seeds in [0, 2**63) for every row (row b uses "
                             f"seed + b), got {bad[0]}")
        return seeds

    def _need(self, S, max_new_tokens, masked, graphs, lookup=0):
        """Static cache positions per row for prompts of ``S`` columns (a one-line error past ``max_length``)."""
        more = self.overshoot(lookup) if masked else 0
        need = self.capacity(S, max_new_tokens, lookup) + more
        if self.max_length is not None and need > self.capacity(0, self.max_length, lookup) + more:
            raise ValueError(f"generate: prompt ({S}) + max_new_tokens ({max_new_tokens}) = {S + max_new_tokens} "
                             f"exceed the static caches' max_length ({self.max_length}) given to HeteroSpec")
        need = max(need, self.capacity(0, self.max_length or 0, lookup) + more)
        if graphs and self.max_length is None:
            need = -(-need // 256) * 256      # fewer distinct capacities: each one is recorded anew
        return need

    def _decode(self, input_ids, attention_mask, lengths, max_new_tokens, temperature, top_k, top_p, min_p, eos, seed,
                finished, stopping_criteria, streamer, procs=(), contexts=None, lookup_n=(0, 2, 1), keep_logits=False,
                penalty=None):
        """The host loop for ``B`` requests (``lengths``: :func:`.requests.check_mask`'s) -> (per-row lists of new
        tokens, GenerationStats: the request's own for one, the batch's with ``per_row`` for more).
        ``finished``: "drop" (a finished row leaves the caches at the end of its cycle) or "mask" (it stays, with
        a root-only tree whose commit is zeroed, so the shapes stay those of the whole batch -- what a recorded
        step of fixed batch needs: with recorded steps finished rows are always masked).  Stopping criteria are
        asked after every new token of a request, with its prompt and new tokens.  ``procs``: logits processors
        (:mod:`.processors`), with each request's ``contexts`` (host lists) before its first new token.
        ``lookup_n``: (chain length, longest n-gram, shortest) of prompt lookup (:mod:`.lookup`; length 0: none).
        ``keep_logits``: each row's raw logits per new token into its stats' ``logits``.  ``penalty``:
        :func:`.processors.on_device`'s (penalty, skips) -- a repetition penalty on the device, from ``contexts``."""
        B, S = input_ids.shape
        dev = self.device
        sample = temperature > 0
        pen = penalty[0] if penalty is not None else 1.0
        settings = ((True, float(temperature), int(top_k), float(top_p), float(min_p or 0.0), pen) if sample
                    else (False, 0.0, 0, 1.0, 0.0, pen))
        L = lookup_n[0]
        # processors run on the host between forward and acceptance
        graphs = bool(self.cuda_graphs) and not procs
        if graphs:
            finished = "mask"
        seeds = self._seeds(seed, B)
        need = self._need(S, max_new_tokens, finished == "mask" and B > 1, graphs, L)
        total = self._new_stats(graphs)
        rows = [self._new_stats(graphs) for _ in range(B)] if B > 1 else [total]
        clock = PhaseClock(dev, total)
        with sync.outside_cycle():
            cyc = self._cycle_for(B, need, graphs)
        tgt, dr, st = cyc.target, cyc.drafter, cyc.state
        pol = cyc.policy   # the engine's, or autoregressive past disable_by_batch_size (_new_cycle)
        steps = None
        try:
            with sync.outside_cycle():
                if graphs:
                    steps = self._record(cyc, settings, total, L, keep_logits)
                    if steps is None:                   # 'auto' after a failed recording: eager from now on
                        graphs = False
                        self._cycles.pop(B, None)       # closed below, as an eager call's
                cyc.clear_flags()
                start = time.perf_counter()
                ids_dev = input_ids.to(dev)
                mask = attention_mask.to(dev) if attention_mask is not None else None
                last_logits, taps = tgt.prefill(ids_dev, attention_mask=mask)
                health.check_prefill(last_logits, tgt.model, S)
                vocab = last_logits.shape[-1]
                kept_logits = [[last_logits[b:b + 1].float().clone()] for b in range(B)] if keep_logits else None
                if procs:
                    lone = torch.zeros((B, 1), dtype=torch.long, device=dev)   # a tree of its root alone
                    last_logits = processors.apply(procs, contexts, lone, lone - 1, lone[:, 0] + 1,
                                                   last_logits.view(B, 1, -1)).view(B, -1)
                elif penalty is not None:                                      # the prompt's ids alone
                    processors.seen_from(contexts, penalty[1], st.seen)
                    none = torch.zeros((B, 1, 1), dtype=torch.bool, device=dev)
                    last_logits = processors.penalise(last_logits.view(B, 1, -1), none.long().view(B, 1), none,
                                                      st.seen, pen).view(B, -1)
                st.seed.copy_(torch.tensor(seeds, dtype=torch.long, device="cpu"))
                st.offset.zero_()
                if sample:
                    zeros = torch.zeros((B, 1), dtype=torch.long, device=dev)
                    _, _, root, draws = ops.verify_sample(zeros, zeros - 1, last_logits.view(B, 1, -1),
                                                          temperature=temperature, top_k=top_k, top_p=top_p,
                                                          min_p=settings[4], seed=st.seed, offset=st.offset)
                    st.offset.copy_(draws)                # the cycles' uniforms follow the prefill's, per row
                else:
                    root = torch.argmax(last_logits, dim=-1)
                st.root.copy_(root)
                roots = root.tolist()
                total.prefill_s = time.perf_counter() - start
                prompts_host = [row[S - n:] for row, n in zip(input_ids.tolist(), lengths)]
            generated = [[r] for r in roots]
            index = [lookup.NgramIndex(prompts_host[a] + [r], *lookup_n[1:]) for a, r in enumerate(roots)] if L else None
            if streamer is not None:
                streamer.put(input_ids.cpu())
                streamer.put(torch.tensor(roots, device="cpu"))
            alive = list(range(B))
            done = [r in eos or max_new_tokens <= 1 or self._stop(stopping_criteria, prompts_host[a] + [r])
                    for a, r in enumerate(roots)]
            for a in range(B):
                if done[a]:
                    rows[a].total_s = time.perf_counter() - start
            if cyc.drafting and not all(done):
                clock.start()
                front = ids_dev.gather(1, (torch.tensor([S - n for n in lengths], device=dev).view(B, 1)
                                           + torch.arange(S, device=dev)).clamp(max=S - 1))
                ids = torch.cat([front[:, 1:], front[:, :1]], dim=1)
                last = torch.tensor([n - 1 for n in lengths], dtype=torch.long, device=dev)
                ids.scatter_(1, last.view(B, 1), st.root.view(B, 1))
                dr.prime(taps, ids, last, prompt=front)
                clock.lap("draft_s")
            prefix_host = list(lengths)
            # LongRoPE (models.target.rope_switch): a tree must not reach the switch from below it; each row decides
            # its factors from its root in the target's forward
            switch = tgt.rope_switch
            reach = self.overshoot(L)

            def straddles(P):
                return P < switch[0] <= P + reach

            K = pol.top_k
            batch_calls = 0
            first = True
            while True:
                keep = [i for i, a in enumerate(alive) if not done[a]]
                if not keep:
                    break
                if finished == "drop" and len(keep) < len(alive):   # finished rows stop costing work
                    keep = requests.gap_filled(keep, len(alive))
                    cyc.keep_rows(keep, max(prefix_host[alive[i]] for i in keep))
                    st = cyc.state
                    alive = [alive[i] for i in keep]
                if switch is not None and switch[1]:   # LongRoPE's switch reached: the row's cache recomputed
                    with sync.outside_cycle():
                        for j, a in enumerate(alive):
                            if not done[a] and prefix_host[a] == switch[0]:
                                tgt.refill(j, prompts_host[a] + generated[a])
                t_cycle = time.perf_counter()   # the cycle's wall time, host and device, ends at the accepted sync
                # With recorded steps the device's idle time between replays (the host reading the bin or the
                # accepted tokens, streaming, stopping checks, launching) is timed as idle_s, from the previous
                # cycle's last replay on.
                if first or not graphs:
                    clock.start()
                else:
                    clock.lap("idle_s")
                first = False
                g = None
                process = draft_process = None
                if procs:   # each row's processors with its tokens so far, for the target's and the draft's logits
                    ctx = [contexts[a] + generated[a] for a in alive]
                    rows_procs = [procs[a] for a in alive]
                    process = functools.partial(processors.apply, rows_procs, ctx)
                    draft_process = functools.partial(processors.apply_draft, rows_procs, ctx, vocab)
                try:
                    if cyc.binned:
                        g, entropy = cyc.run_base(steps, clock, draft_process, settings)
                        with sync.point("bin", total):
                            ent = entropy.tolist()
                        plans = [pol.plan(e) if not done[a] else (None, 0, 1) for e, a in zip(ent, alive)]
                        if graphs:
                            clock.lap("idle_s")
                    elif cyc.drafting:
                        plans = [(None, 0, pol.total_tokens) if not done[a] else (None, 0, 1) for a in alive]
                    else:
                        plans = [(None, 0, 1)] * len(alive)
                    extra = max(p[1] for p in plans)
                    levels = [pol.depth + p[1] for p in plans]
                    sizes = planned = [tree_size(K, lv, p[2]) if cyc.drafting else 1 for lv, p in zip(levels, plans)]
                    if switch is not None:    # no tree straddles LongRoPE's switch: a row's root alone up to it
                        sizes = [1 if straddles(prefix_host[a]) else n for n, a in zip(sizes, alive)]
                    # prompt lookup: a recorded step always grafts (its trees padded for chains of L); the eager
                    # cycle only when some row has a chain, padded for the longest
                    chains = [index[a].propose(L) if L and not done[a] and not (switch and straddles(prefix_host[a]))
                              else [] for a in alive]
                    chain = L if graphs or any(chains) else 0
                    if chain:
                        cyc.set_chains(chains, L)
                    most = max(planned) + L if graphs else max(s + len(c) for s, c in zip(sizes, chains))
                    T = bucket_for(most, self.buckets) if most > 1 else 1
                    cyc.set_rows([s - 1 for s in sizes],
                                 [candidate_count(K, lv) if cyc.drafting else 0 for lv in levels],
                                 [int(done[a]) for a in alive])
                    # on the CPU the eager target attends over the used columns only; a recording keeps the whole
                    # cache, and so does a compiled forward (a new width would be a new compilation every 64 tokens)
                    window = None if graphs or cyc.target.compiled else \
                        attention_window(dev, max(prefix_host[a] for a in alive) + 1, T)
                    acc = cyc.run_finish(steps, g, extra, T, settings, window, clock, process, draft_process, chain,
                                         keep_logits)
                    if keep_logits:                 # a recorded step's outputs are rewritten by its next replay
                        acc, path_logits = acc
                except ValueError:   # on the CPU the ops refuse non-finite logits mid-cycle: say which model's
                    with sync.outside_cycle():
                        flags = [[int(t), int(d)] for t, d in zip(st.bad.tolist(), dr.bad.tolist())]
                    self._raise_flagged(flags, alive, done, rows, prefix_host, B)
                    raise
                with sync.point("accepted", total):
                    host = acc.tolist()
                self._raise_flagged([row[-2:] for row in host], alive, done, rows, prefix_host, B)
                sizes = [row[-3] for row in host]     # each row's real tree size, chain included
                clock.flush()
                batch_calls += 1
                for j, a in enumerate(alive):
                    if done[a]:
                        continue
                    row = host[j]
                    n_acc = row[0] - 1
                    rs = rows[a]
                    rs.cycles += 1
                    rs.verified_tokens += sizes[j]
                    rs.accepted_hist[n_acc] += 1
                    b = plans[j][0]
                    if b is not None:
                        rs.bins[b] += 1
                        rs.bin_accepted[b] += n_acc
                        rs.bin_verified[b] += sizes[j]
                        rs.bin_s[b] += time.perf_counter() - t_cycle
                    prefix_host[a] += n_acc + 1
                    # truncate at the budget, at EOS, or where a stopping criterion fires
                    before = len(generated[a])
                    for t in row[3:3 + n_acc] + [row[1]]:
                        generated[a].append(t)
                        if index is not None:
                            index[a].extend((t,))
                        if streamer is not None:
                            streamer.put(torch.tensor([t], device="cpu"))
                        if (t in eos or len(generated[a]) >= max_new_tokens
                                or self._stop(stopping_criteria, prompts_host[a] + generated[a])):
                            done[a] = True
                            rs.total_s = time.perf_counter() - start     # this request's latency
                            break
                    if kept_logits is not None:             # the path nodes' rows of the tokens kept
                        kept_logits[a].append(path_logits[j, :len(generated[a]) - before].clone())
            if dev.type == "cuda":
                ops.cuda_check(dev)   # device-side errors of the check=False launches
        finally:
            if not graphs and B > 1:
                cyc.close()
        if streamer is not None:
            streamer.end()
        for a, (rs, gen) in enumerate(zip(rows, generated)):
            rs.new_tokens = len(gen)
            if keep_logits:
                rs.logits = torch.cat(kept_logits[a])
        total.total_s = time.perf_counter() - start
        if B == 1:
            return generated, total
        # the batch's counts are the rows' pooled (cycles: request-cycles, so tau is the mean tokens per row per
        # call); its times are the batch's own
        pooled = GenerationStats.pooled(rows)
        for f in ("new_tokens", "cycles", "verified_tokens", "accepted_hist", "bins", "bin_accepted", "bin_verified",
                  "bin_s"):
            setattr(total, f, getattr(pooled, f))
        total.batch_calls = batch_calls
        total.per_row = rows
        for rs in rows:
            rs.prefill_s = total.prefill_s
            rs.graphs = total.graphs
        return generated, total

    def _raise_flagged(self, flags, alive, done, rows, prefix_host, B):
        """The first live request whose target or draft logits were not finite this cycle (:mod:`.health`)."""
        for f, a in zip(flags, alive):
            if not done[a]:
                health.raise_flagged(f, self._models(), rows[a].cycles + 1, prefix_host[a], self.device,
                                     row=a if B > 1 else None)

    def _record(self, cycle, settings, stats, chain=0, keep_logits=False):
        """``cycle.record(settings, chain, keep_logits)`` (a :class:`~.cycle.Cycle` of any batch) -> its
        StepGraphs, with the capture time in ``stats``; or None when recording failed under
        ``cuda_graphs='auto'``, which then decodes eagerly from here on (warned)."""
        try:
            steps, fresh = cycle.record(settings, chain, keep_logits)
        except Exception as e:
            if not self._graphs_fallback:
                raise
            warnings.warn(f"HeteroSpec: recording the decoding steps as CUDA graphs failed "
                          f"({type(e).__name__}: {e}); cuda_graphs='auto' falls back to the eager engine",
                          RuntimeWarning, stacklevel=4)
            self.cuda_graphs = False
            self._cycle.drop_recordings()
            stats.graphs = "off"
            return None
        stats.capture_s = steps.capture_s if fresh else 0.0
        stats.captured_steps = len(steps)
        return steps

    def _models(self):
        """(role, model) of the flags a cycle returns (:mod:`.health`)."""
        return [("target", self.target.model), ("draft", self.draft)]

    @staticmethod
    def _stop(criteria, seq):
        if not criteria:
            return False
        ids = torch.tensor([seq], dtype=torch.long, device="cpu")
        for c in criteria:
            r = c(ids, None)
            if bool(torch.as_tensor(r).any()):
                return True
        return False
