"""What a decoding run reports: :class:`GenerationStats`, the one stats type of a ``generate`` call, of
a trace's replay (:meth:`heterospec.tune.Trace.replay`, with the times a cost model predicts) and of a
benchmark's pooled runs (:meth:`GenerationStats.pooled`).  The engine times its phases with
:class:`heterospec.measure.PhaseClock`."""
from __future__ import annotations

import dataclasses
from collections import Counter


@dataclasses.dataclass
class GenerationStats:
    new_tokens: int = 0
    cycles: int = 0            # verification calls after the prefill
    verified_tokens: int = 0   # tree tokens sent through the target, root included
    accepted_hist: Counter = dataclasses.field(default_factory=Counter)  # accepted draft tokens per cycle
    bins: Counter = dataclasses.field(default_factory=Counter)          # cycles per entropy bin
    bin_accepted: Counter = dataclasses.field(default_factory=Counter)  # accepted draft tokens per entropy bin
    bin_verified: Counter = dataclasses.field(default_factory=Counter)  # verified tree tokens per entropy bin
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
    cpu_gemm: str = "off"      # the CPU matrix path of the linear layers (HeteroSpec.cpu_gemm: measured per machine)
    cpu_decoder: str = "off"   # the target's forward through heterospec's CPU decoder (HeteroSpec.cpu_decoder)
    capture_s: float = 0.0     # warm-up and capture of the recorded steps in this call (not in total_s)
    captured_steps: int = 0    # recorded steps available (one per step key)
    predicted: bool = False    # the times are a cost model's prediction (a trace's replay), not measured
    batch_calls: int = 0       # a batch's verification forwards (each over every unfinished row; cycles counts rows)
    per_row: list = dataclasses.field(default_factory=list)   # a batch: each request's own GenerationStats
    # generate(output_logits=True): the target's raw logits that each new token was decided from, [new_tokens, V]
    # float32 on the model's device (a batch: on each row's own stats); None otherwise
    logits: object = dataclasses.field(default=None, repr=False)

    @property
    def committed(self):
        """Tokens committed by verification calls (accepted draft tokens + the bonus token of each)."""
        return sum((a + 1) * c for a, c in self.accepted_hist.items())

    @property
    def tau(self):
        """Committed tokens per verification call (the bonus token counts)."""
        return self.committed / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self):
        """New tokens per second of ``total_s`` (predicted seconds for a replay); None without a time."""
        return self.new_tokens / self.total_s if self.total_s > 0 else None

    def per_bin(self):
        """{bin: {"cycles", "share", "mean_accepted", "mean_nodes", "seconds", "tau", "tokens_per_s"}}: tau and
        tokens/s count the committed tokens (accepted + the bonus) of the bin's cycles over those cycles' time
        (each cycle up to its accepted-tokens sync; predicted seconds for a replay)."""
        total = sum(self.bins.values())
        out = {}
        for b, c in sorted(self.bins.items()):
            acc, sec = self.bin_accepted[b], self.bin_s[b]
            out[b] = {"cycles": c, "share": c / total, "mean_accepted": acc / c,
                      "mean_nodes": self.bin_verified[b] / c, "seconds": sec, "tau": 1 + acc / c,
                      "tokens_per_s": (acc + c) / sec if sec > 0 else None}
        return out

    @classmethod
    def pooled(cls, runs):
        """One GenerationStats of several runs: counts, histograms and times summed."""
        out = cls()
        for r in runs:
            for f in dataclasses.fields(cls):
                v = getattr(r, f.name)
                if isinstance(v, Counter):
                    getattr(out, f.name).update(v)
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    setattr(out, f.name, getattr(out, f.name) + v)
            out.graphs, out.predicted = r.graphs, r.predicted
        return out

    def as_dict(self):
        """The stats as JSON-ready values (without ``logits``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("logits", "per_row")}
        for f in ("accepted_hist", "bins", "bin_accepted", "bin_verified", "bin_s"):
            d[f] = dict(sorted(getattr(self, f).items()))
        d["tau"] = self.tau
        d["tokens_per_s"] = self.tokens_per_s or 0.0
        d["host_s_per_cycle"] = self.host_s_per_cycle
        d["per_row"] = [r.as_dict() for r in self.per_row]
        return d

    def summary(self):
        """One line: tokens, time and speed, verification calls, verified tree tokens, tau, the accepted-length
        histogram, the bins and the time split (what ``heterospec generate`` prints after its answer)."""
        d = self.as_dict()
        return (f"{d['new_tokens']} tokens in {d['total_s']:.2f} s ({d['tokens_per_s']:.1f} tok/s); verification "
                f"calls {d['cycles']}, tree tokens verified {d['verified_tokens']}, tau {d['tau']:.2f}; "
                f"accepted-length histogram {d['accepted_hist']}; bins {d['bins']}; draft {d['draft_s']:.2f} s, "
                f"verify {d['verify_s']:.2f} s, ops {d['ops_s']:.3f} s")

    def _repr_markdown_(self):
        """Jupyter: the call at a glance (and a batch's rows, one line each) instead of every field."""
        rows = ["| | new tokens | tokens/s | tau | verification calls | verified tree tokens per call | "
                "steps |", "|---|---:|---:|---:|---:|---:|---|"]
        for name, r in [("call", self)] + [(f"row {i}", x) for i, x in enumerate(self.per_row)]:
            per_call = r.verified_tokens / r.cycles if r.cycles else 0.0
            rows.append(f"| {name} | {r.new_tokens} | {r.tokens_per_s or 0.0:.1f} | {r.tau:.2f} | {r.cycles} | "
                        f"{per_call:.1f} | {r.graphs if r.graphs != 'off' else 'eager'} |")
        bins = "" if not self.bins else "\n\nEntropy bins (cycles): " + ", ".join(
            f"{b}: {c}" for b, c in sorted(self.bins.items()))
        return "\n".join(rows) + bins

    @property
    def host_s_per_cycle(self):
        """Wall time per cycle the host spent outside the sync points (on a GPU: Python, launches and the
        ops' argument checks -- what CUDA graphs remove)."""
        return (self.total_s - self.prefill_s - self.sync_s) / self.cycles if self.cycles else 0.0
