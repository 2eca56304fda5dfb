"""The decoding loop (batch 1): argument checks, the static caches, the prefill, the host loop around
:class:`~.cycle.Cycle` with its two declared sync points (:mod:`.sync`: "bin" for policies with bins, then
"accepted"), streaming, EOS and stopping criteria, and the stats.  The cycle's steps themselves, in order,
are in :mod:`.cycle`.  On a GPU the ops run as our CUDA kernels with ``check=False``; device-side errors are
raised at the end of the call (``ops.cuda_check``).

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

import numpy as np
import torch

from .. import ops
from ..growth import candidate_count
from ..measure import PhaseClock
from ..models import cpu_gemm as gemm
from ..models.target import TargetAdapter, _decoder_layers, attention_window
from ..policy import Policy
from . import batch, health, requests, sync
from .cycle import Cycle
from .stats import GenerationStats
from .tree import DraftState, NoDraft, bucket_for

# tree sizes (root included) a verification is padded to on a GPU: one static shape per bucket.  On the CPU
# a padded node costs its full share of a compute-bound forward, so trees keep their exact size there.
GPU_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# RoPE variants whose forward reads a position on the host to pick or rescale its frequencies (transformers'
# dynamic_rope_update): a recorded graph would keep the frequencies of the recording
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


def _check_generate_args(max_new_tokens, temperature, top_k, top_p):
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"generate: argument 'max_new_tokens' expected an int >= 1, got {max_new_tokens!r}")
    if not ops.is_decoding_temperature(temperature):
        raise ValueError(f"generate: argument 'temperature' expected 0 (greedy) or a finite value >= "
                         f"{ops.MIN_TEMPERATURE:g}, got {temperature!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"generate: argument 'top_k' expected an int >= 0, got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"generate: argument 'top_p' expected a value in (0, 1], got {top_p!r}")


def _rope_types(model):
    """The RoPE variants a model's config names, from ``rope_parameters`` (transformers 5; a dict per layer
    type in some models) or ``rope_scaling`` (4.x)."""
    cfg = getattr(model, "config", None)
    found, todo = set(), [getattr(cfg, f, None) for f in ("rope_parameters", "rope_scaling")]
    while todo:
        rp = todo.pop()
        if isinstance(rp, dict):
            kind = rp.get("rope_type") or rp.get("type")
            if isinstance(kind, str):
                found.add(kind)
            todo.extend(v for v in rp.values() if isinstance(v, dict))
    return found


def _check_graphs(cuda_graphs, device, draft, target=None):
    """-> False, True (CUDA graphs) or "emulate" (the recorded-step plumbing without graphs, any device)."""
    if cuda_graphs == "emulate":
        return "emulate"
    host_read = [(who, rope) for who, m in (("target", target), ("draft", draft)) if m is not None
                 for rope in sorted(_rope_types(m) & set(HOST_READ_ROPE))]
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
    tests on any device; default False: the eager engine).  Recording happens at the first call for each
    sampling setting and cache size; pass ``max_length`` to record once.  ``compile``: the target's forward
    through ``torch.compile`` (True = inductor, or a backend name), one specialisation per shape; with
    ``cuda_graphs`` the compiled forward is what gets captured (fewer kernels per forward).  ``cpu_gemm``: on the
    CPU, run the target's and the draft's linear layers through oneDNN with weights packed once
    (:mod:`heterospec.models.cpu_gemm`), only inside ``generate``: between calls the model is as it was.  'auto'
    (for a CPU model in float32 or bfloat16 where torch has it) measures, per layer shape and rows per call (1;
    2-16; more), whether the packed path beats torch's default on this machine and routes only there (measured
    once per machine, a few seconds for a 135M model, then cached on disk); True packs every layer for every
    row count, False = torch's default ``linear``.  ``self.cpu_gemm`` and every call's stats say which.  On the
    2-core AMD EPYC a forward over the few rows of a tree then costs about what one row does (MKL's default
    path costs 1.5-1.7x one row for 2 rows or more); the logits agree with the default path to ~1e-4.

    ``batch_invariant``: verify so that every tree node's logits are bit for bit what a one-row step of the same
    engine gives (each row attends to exactly its keys; each linear layer of the target on one path for every
    row count, one row padded to two), so that speculative output equals this engine's autoregressive output
    in bfloat16 too, where the sums of a forward over many rows otherwise round differently from one row's.
    'auto' (default): on for a bfloat16 target on the CPU when both properties hold on this machine (checked
    when the engine is made; off with a warning where they do not); True insists (ValueError where it cannot);
    False: off.  In float32 it is never needed for the greedy output to match (and is not offered)."""

    def __init__(self, target, draft=None, policy=None, *, max_length=None, buckets="auto", cuda_graphs=False,
                 compile=False, cpu_gemm="auto", batch_invariant="auto"):
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
        self.batch_invariant = _check_invariant(batch_invariant, p)
        try:
            self.target = TargetAdapter(target, tap_layers=taps, capture_taps=draft is not None, compile=compile,
                                        invariant=self.batch_invariant)
            # packed once here (outside any timed call), routed only inside generate
            self._gemm = gemm.for_models(cpu_gemm, target, draft, invariant=self.batch_invariant)
        except ValueError as e:
            if batch_invariant is True or "row-invariant" not in str(e):
                raise
            if getattr(self, "target", None) is not None:
                self.target.close()
            warnings.warn(f"HeteroSpec: batch_invariant='auto' is off here: {e}", stacklevel=2)
            self.batch_invariant = False
            self.target = TargetAdapter(target, tap_layers=taps, capture_taps=draft is not None, compile=compile)
            self._gemm = gemm.for_models(cpu_gemm, target, draft)
        self.cpu_gemm = self._gemm.describe()   # which row classes run packed: in every call's stats
        self._drafting = draft is not None and self.policy.drafts
        pol = self.policy
        self._levels = pol.levels
        most = max((pol.total_tokens, *pol.keep))
        self._max_nodes = bucket_for(min(most, candidate_count(pol.top_k, self._levels) + 1), self.buckets)
        if self._drafting:
            d2t = getattr(draft, "d2t", None)
            with sync.outside_cycle():
                d2t = d2t.detach().to(self.device, torch.long) if d2t is not None and bool(torch.any(d2t != 0)) else None
            self._drafter = DraftState(draft, pol.top_k, self._levels, d2t)
        else:
            self._drafter = NoDraft(self.device)
        self.cuda_graphs = _check_graphs(cuda_graphs, self.device, draft, target)
        self._graphs_fallback = cuda_graphs == "auto"    # 'auto': a recording that fails falls back to eager
        self._cycle = Cycle(self.target, self._drafter, pol, self.buckets, self.device,
                            emulate=self.cuda_graphs == "emulate")
        self._batch_cycles = OrderedDict()   # recorded engine: batch size -> its BatchCycle (engine/batch.py)

    @property
    def cycle(self):
        """The engine's :class:`~.cycle.Cycle`: its target adapter (``.target``), drafter (``.drafter``) and
        steps, on the static caches (what :func:`heterospec.tune.profile_costs` times)."""
        return self._cycle

    def close(self):
        """Remove the tap hooks from the target and drop the recorded steps (also done on exit of a ``with``
        block)."""
        self.target.close()
        self._cycle.drop_recordings()
        while self._batch_cycles:
            self._batch_cycles.popitem()[1].close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _capacity(self, prompt_len, max_new_tokens):
        """Static cache positions a call needs: every committed token plus the largest tree (or the draft's
        catch-up rows) written past them."""
        return prompt_len + max_new_tokens + max(self._max_nodes, self._levels + 2) + 1

    # ---- the loop -----------------------------------------------------------------------------------

    def _new_stats(self, graphs):
        """A call's GenerationStats, saying how it runs: recorded steps or not, the CPU matrix path."""
        return GenerationStats(graphs=self.cuda_graphs if isinstance(self.cuda_graphs, str) else
                               ("cuda" if graphs else "off"), cpu_gemm=self.cpu_gemm)

    @_exclusive
    @torch.no_grad()
    def generate(self, input_ids, *, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, eos_token_id=None,
                 stopping_criteria=None, streamer=None, seed=None, attention_mask=None, pad_token_id=None,
                 finished_rows="drop"):
        """Returns (sequences [1, S + new] int64 on the CPU, GenerationStats).  Greedy when temperature == 0.
        A request ends at ``max_new_tokens`` or at an ``eos_token_id`` (an id or ids; None, the default: the
        target's ``generation_config.eos_token_id``, as HuggingFace's ``generate`` takes it; [] for none).

        A batch (:mod:`.batch`): ``input_ids`` [B, S] left-padded with an ``attention_mask`` [B, S] (as a
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
        recorded steps have a fixed batch, so finished rows are always masked)."""
        _check_generate_args(max_new_tokens, temperature, top_k, top_p)
        eos_token_id = eos_ids(self.target.model, eos_token_id)
        eos = set(eos_token_id)
        if finished_rows not in ("drop", "mask"):
            raise ValueError(f"generate: argument 'finished_rows' expected 'drop' or 'mask', got {finished_rows!r}")
        pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
        as_list = isinstance(input_ids, (list, tuple))
        if as_list:
            if not input_ids:
                raise ValueError("generate: argument 'input_ids' expected at least one prompt, got an empty list")
            if attention_mask is not None:
                raise ValueError("generate: argument 'attention_mask' expected None with a list of prompts (they "
                                 "are padded here), got a mask")
            input_ids, attention_mask = requests.left_pad(input_ids, pad, self.device)
        elif not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"generate: argument 'input_ids' expected a [B, S] tensor or a list of prompts, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        B = input_ids.shape[0]
        with sync.outside_cycle():                      # the mask's check reads it on the host
            lengths = requests.check_mask(input_ids, attention_mask)
        if isinstance(seed, (list, tuple)) and len(seed) != B:
            raise ValueError(f"generate: argument 'seed' expected an int or {B} ints (one per prompt), got "
                             f"{len(seed)}")
        if B == 1:
            S = input_ids.shape[1]
            prompt = input_ids[:, S - lengths[0]:]
            with self._gemm:
                seq, stats = self._generate(prompt, max_new_tokens, temperature, top_k, top_p, eos_token_id,
                                            stopping_criteria, streamer, seed[0] if isinstance(seed, (list, tuple))
                                            else seed)
            if as_list:
                return [seq[0]], stats
            if lengths[0] == S:
                return seq, stats
            with sync.outside_cycle():
                return torch.cat([input_ids[:, :S - lengths[0]].cpu(), seq], dim=1), stats
        if streamer is not None:
            raise ValueError(f"generate: argument 'streamer' expected a single prompt, got a batch of {B}")
        if B < 1:
            raise ValueError("generate: argument 'input_ids' expected at least one prompt, got 0 rows")
        S = input_ids.shape[1]
        maxpos = self.target.max_positions
        if maxpos is not None and S + max_new_tokens > maxpos:
            raise ValueError(f"generate: prompt ({S}) + max_new_tokens ({max_new_tokens}) "
                             f"exceed the target's max_position_embeddings ({maxpos})")
        with self._gemm:
            new, _, stats = batch.generate_batch(self, input_ids, attention_mask, lengths, max_new_tokens=max_new_tokens,
                                                 temperature=temperature, top_k=top_k, top_p=top_p, eos=eos,
                                                 seed=seed, finished=finished_rows,
                                                 stop=(lambda seq: self._stop(stopping_criteria, seq))
                                                 if stopping_criteria else None)
        with sync.outside_cycle():                      # the results, on the host
            ids = input_ids.cpu()
            if as_list:
                return [torch.cat([ids[b, S - lengths[b]:], torch.tensor(new[b], dtype=torch.long)])
                        for b in range(B)], stats
            out = torch.full((B, S + max(len(x) for x in new)), pad, dtype=torch.long)
            out[:, :S] = ids
            for b, x in enumerate(new):
                out[b, S:S + len(x)] = torch.tensor(x, dtype=torch.long)
            return out, stats

    def _generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, stopping_criteria,
                  streamer, seed):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"generate: argument 'input_ids' expected a [1, S] tensor, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        S = input_ids.shape[1]
        if S < 1:
            raise ValueError("generate: argument 'input_ids' expected at least one token, got 0")
        maxpos = self.target.max_positions
        if maxpos is not None and S + max_new_tokens > maxpos:
            raise ValueError(f"generate: prompt ({S}) + max_new_tokens ({max_new_tokens}) "
                             f"exceed the target's max_position_embeddings ({maxpos})")
        need = self._capacity(S, max_new_tokens)
        if self.max_length is not None and need > self._capacity(0, self.max_length):
            raise ValueError(f"generate: prompt ({S}) + max_new_tokens ({max_new_tokens}) = {S + max_new_tokens} "
                             f"exceed the static caches' max_length ({self.max_length}) given to HeteroSpec")
        need = max(need, self._capacity(0, self.max_length or 0))
        if self.cuda_graphs and self.max_length is None:
            need = -(-need // 256) * 256      # fewer distinct capacities: each one is captured anew
        eos = set(eos_token_id)                  # generate() resolved it (eos_ids): a list
        sample = temperature > 0
        settings = (sample, float(temperature), int(top_k), float(top_p)) if sample else (False, 0.0, 0, 1.0)
        dev = self.device
        graphs = bool(self.cuda_graphs)
        stats = self._new_stats(graphs)
        clock = PhaseClock(dev, stats)
        tgt, dr, cycle, st = self.target, self._drafter, self._cycle, self._cycle.state

        with sync.outside_cycle():
            tgt.allocate(need)
            dr.allocate(need, dev)
            steps = self._record(cycle, settings, stats) if graphs else None
            graphs = steps is not None
            st.bad.zero_()
            dr.bad.zero_()
        start = time.perf_counter()
        with sync.outside_cycle():
            rng_seed = int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,), device="cpu").item())
            input_ids = input_ids.to(dev)
            last_logits, taps = tgt.prefill(input_ids)
            health.check_prefill(last_logits, tgt.model, S)
            if sample:
                _, root, draws = ops.verify_sample(np.zeros(1, np.int64), np.full(1, -1, np.int64),
                                                   last_logits.view(1, -1).cpu().numpy(), temperature=temperature,
                                                   top_k=top_k, top_p=top_p, seed=rng_seed, offset=0)
                st.seed.fill_(rng_seed)
                st.offset.fill_(draws)   # the cycles' uniforms follow the prefill's
            else:
                root = int(torch.argmax(last_logits))
            stats.prefill_s = time.perf_counter() - start
            out = input_ids[0].tolist()
        generated = [root]
        if streamer is not None:
            streamer.put(input_ids.cpu())
            streamer.put(torch.tensor([root], device="cpu"))
        done = root in eos or len(generated) >= max_new_tokens or self._stop(stopping_criteria, out + generated)
        st.root.fill_(root)
        if not done:
            clock.start()
            ids = torch.cat([input_ids[:, 1:], st.root.view(1, 1)], dim=1)
            dr.prime(taps, ids, torch.full((1,), S - 1, dtype=torch.long, device=dev), prompt=input_ids)
            clock.lap("draft_s")
        pol = self.policy
        default = (None, 0, pol.total_tokens) if self._drafting else (None, 0, 1)
        first = True
        while not done:
            t_cycle = time.perf_counter()   # the cycle's wall time, host and device, ends at the accepted sync
            # With recorded steps the device's idle time between replays (the host reading the bin or the
            # accepted tokens, streaming, stopping checks, launching) is timed as idle_s, from the previous
            # cycle's last replay on.
            if first or not graphs:
                clock.start()
            else:
                clock.lap("idle_s")
            first = False
            b, extra, keep = default
            g = None
            position = len(out) + len(generated)
            try:
                if cycle.binned:
                    g, entropy = cycle.run_base(steps, clock)
                    with sync.point("bin", stats):
                        b, extra, keep = pol.plan(entropy.item())
                    if graphs:
                        clock.lap("idle_s")
                # on the CPU the target attends over the used columns only: a host-known bound, rounded
                window = attention_window(dev, position, self._max_nodes)
                acc, size = cycle.run_finish(steps, g, extra, keep, settings, window, clock)
            except ValueError:   # on the CPU the ops refuse non-finite logits mid-cycle: say which model's
                with sync.outside_cycle():
                    flags = [int(st.bad), int(dr.bad)]
                health.raise_flagged(flags, self._models(), stats.cycles + 1, position, dev)
                raise
            # the accepted tokens, for streaming, EOS and stopping criteria (and the models' non-finite flags)
            with sync.point("accepted", stats):
                host = acc.tolist()
            health.raise_flagged(host[-2:], self._models(), stats.cycles + 1, position, dev)
            clock.flush()
            n_acc = host[0] - 1
            committed = host[3:3 + n_acc] + [host[1]]
            stats.cycles += 1
            stats.verified_tokens += size
            stats.accepted_hist[n_acc] += 1
            if b is not None:
                stats.bins[b] += 1
                stats.bin_accepted[b] += n_acc
                stats.bin_verified[b] += size
                stats.bin_s[b] += time.perf_counter() - t_cycle
            # truncate at the budget, at EOS, or where a stopping criterion fires
            for t in committed:
                generated.append(t)
                if streamer is not None:
                    streamer.put(torch.tensor([t], device="cpu"))
                if t in eos or len(generated) >= max_new_tokens or self._stop(stopping_criteria, out + generated):
                    done = True
                    break
        if dev.type == "cuda":
            ops.cuda_check(dev)   # device-side errors of the check=False launches
        if streamer is not None:
            streamer.end()
        stats.new_tokens = len(generated)
        stats.total_s = time.perf_counter() - start
        return torch.tensor([out + generated], dtype=torch.long, device="cpu"), stats

    def _record(self, cycle, settings, stats):
        """``cycle.record(settings)`` (a :class:`~.cycle.RecordedCycle`: one request's or a batch's) -> its
        StepGraphs, with the capture time in ``stats``; or None when recording failed under
        ``cuda_graphs='auto'``, which then decodes eagerly from here on (warned)."""
        try:
            steps, fresh = cycle.record(settings)
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
