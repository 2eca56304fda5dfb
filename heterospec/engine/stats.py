"""What a generate call reports, and how the engine times its phases without adding host syncs.

On a GPU, phase boundaries are CUDA events recorded on the stream (no sync); their times are read after
the cycle's accepted-tokens sync, when they are complete.  On the CPU they are ``perf_counter`` stamps.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

import torch


@dataclasses.dataclass
class GenerationStats:
    new_tokens: int = 0
    cycles: int = 0            # verification calls after the prefill
    verified_tokens: int = 0   # tree tokens sent through the target, root included
    accepted_hist: Counter = dataclasses.field(default_factory=Counter)  # accepted draft tokens per cycle
    bins: Counter = dataclasses.field(default_factory=Counter)          # cycles per entropy bin
    bin_accepted: Counter = dataclasses.field(default_factory=Counter)  # accepted draft tokens per entropy bin
    bin_s: Counter = dataclasses.field(default_factory=Counter)  # wall seconds of the cycles per entropy bin
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    ops_s: float = 0.0
    sync_s: float = 0.0        # host time blocked at the declared sync points (on a GPU: waiting for the device)
    graph_s: float = 0.0       # time in replayed steps (recorded engine: replaces the draft/verify/ops split)
    idle_s: float = 0.0        # recorded engine: device idle between replays (host work between graphs)
    total_s: float = 0.0
    graphs: str = "off"        # "off" (eager engine), "cuda" (CUDA graphs) or "emulate"
    capture_s: float = 0.0     # warm-up and capture of the recorded steps in this call (not in total_s)
    captured_steps: int = 0    # recorded steps available (one per step key)

    @property
    def committed(self):
        """Tokens committed by verification calls (accepted draft tokens + the bonus token of each)."""
        return sum((a + 1) * c for a, c in self.accepted_hist.items())

    @property
    def tau(self):
        """Committed tokens per verification call (the bonus token counts)."""
        return self.committed / self.cycles if self.cycles else 0.0

    def as_dict(self):
        d = dataclasses.asdict(self)
        d["accepted_hist"] = dict(sorted(self.accepted_hist.items()))
        d["bins"] = dict(sorted(self.bins.items()))
        d["bin_accepted"] = dict(sorted(self.bin_accepted.items()))
        d["bin_s"] = dict(sorted(self.bin_s.items()))
        d["tau"] = self.tau
        d["tokens_per_s"] = self.new_tokens / self.total_s if self.total_s else 0.0
        d["host_s_per_cycle"] = self.host_s_per_cycle
        return d

    @property
    def host_s_per_cycle(self):
        """Wall time per cycle the host spent outside the sync points (on a GPU: Python, launches and the
        ops' argument checks -- what CUDA graphs remove)."""
        return (self.total_s - self.prefill_s - self.sync_s) / self.cycles if self.cycles else 0.0


class PhaseClock:
    """Accumulates the time between consecutive :meth:`lap` calls into GenerationStats fields."""

    def __init__(self, device, stats):
        self.cuda = device.type == "cuda"
        self.stats = stats
        self.pending = []
        self.last = None

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self):
        self.last = self._now()

    def lap(self, field):
        now = self._now()
        self.pending.append((field, self.last, now))
        self.last = now

    def flush(self):
        """Add the finished laps to the stats (call after a sync: on a GPU the events are then complete)."""
        for field, a, b in self.pending:
            dt = a.elapsed_time(b) / 1000.0 if self.cuda else b - a
            setattr(self.stats, field, getattr(self.stats, field) + dt)
        self.pending.clear()
