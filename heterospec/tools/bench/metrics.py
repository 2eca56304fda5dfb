"""The numbers of a run, from its per-question records (docs/design.md, "Measuring").

tokens/s = new tokens (up to and including EOS) / decoding wall time (prefill included, after a warm-up
whose time is reported apart; CUDA events on a GPU); speedup = the mean over questions of (the method's
tokens/s / ar's), a question's tokens/s pooling its turns as EAGLE's ``speed.py`` does; speedup over HF = the
same ratio against the strongest HuggingFace baseline of the run (of ``hf``, ``hf-static``, ``hf-compiled``,
``hf-lookup``, the one with the best mean tokens/s); tau = committed tokens / verification calls (the bonus token counts);
verification calls and verified tokens; per entropy bin the share of cycles and the mean accepted length;
the time split into prefill / drafting / verifying / ops / the rest of the loop.  The engine's stats of a
method's turns are pooled with :meth:`heterospec.GenerationStats.pooled` and binned with its
:meth:`~heterospec.GenerationStats.per_bin`.  The HuggingFace baselines have no verification calls, tau or
time split: those are ``None``."""
from __future__ import annotations

from collections import Counter

from .methods import HF_METHODS

# a bin's fields in results.json (GenerationStats.per_bin's, but for mean_nodes)
BIN_FIELDS = ("cycles", "share", "mean_accepted", "seconds", "tau", "tokens_per_s")


def bin_rows(stats):
    """results.json's ``bins`` of a (pooled) GenerationStats: {"bin": {cycles, share, mean_accepted, seconds,
    tau, tokens_per_s}} from its :meth:`~heterospec.GenerationStats.per_bin`: tau and tokens/s count the
    committed tokens (accepted + the bonus) of the bin's cycles, over those cycles' time (each cycle up to
    its accepted-tokens sync)."""
    return {str(b): {k: v[k] for k in BIN_FIELDS} for b, v in stats.per_bin().items()}


def pooled_bins(per_file):
    """:func:`bin_rows` pooled over files' saved ``bins`` dicts (weighted by their cycles): the per-bin
    counters are rebuilt from each file's cycles, mean accepted length and seconds and pooled as the
    engine's stats are."""
    from ...engine.stats import GenerationStats

    return bin_rows(GenerationStats.pooled(
        GenerationStats(bins=Counter({int(k): v["cycles"] for k, v in bins.items()}),
                        bin_accepted=Counter({int(k): v["mean_accepted"] * v["cycles"] for k, v in bins.items()}),
                        bin_s=Counter({int(k): v.get("seconds") or 0.0 for k, v in bins.items()}))
        for bins in per_file))


def _per_question(recs):
    """Each question's tokens/s, pooling its turns (EAGLE's speed.py)."""
    return [sum(r["new_tokens"]) / sum(r["wall_time"]) if sum(r["wall_time"]) else 0.0 for r in recs]


def file_row(recs, ar_recs):
    """One method on one benchmark file, from its per-question records (``ar_recs``: ar's on the same file,
    for the speedup; None without ar).  A HuggingFace baseline (stats without verification calls) gets None
    for tau, the counts and the time split."""
    from ...engine.stats import GenerationStats

    new = sum(sum(r["new_tokens"]) for r in recs)
    secs = sum(sum(r["wall_time"]) for r in recs)
    stats = [s for r in recs for s in r["stats"]]
    if not all(isinstance(s, GenerationStats) for s in stats):
        row = file_row([dict(r, stats=[]) for r in recs], ar_recs)
        row.update(turns=len(stats), tau=None, verification_calls=None, verified_tokens=None,
                   verified_per_new_token=None, time_split_s=None, time_split_share=None,
                   host_ms_per_cycle=None)
        return row
    pooled = GenerationStats.pooled(stats)
    split = {k: getattr(pooled, k + "_s") for k in ("prefill", "draft", "verify", "ops", "graph", "idle")}
    total = pooled.total_s
    split["loop"] = max(0.0, total - sum(split.values()))  # the Python loop, streaming, stopping checks
    q_tps = _per_question(recs)
    speedup = None
    if ar_recs is not None:
        ratios = [a / b for a, b in zip(q_tps, _per_question(ar_recs)) if b > 0]
        speedup = sum(ratios) / len(ratios) if ratios else None
    return {
        "questions": len(recs), "turns": len(stats), "new_tokens": new, "seconds": secs,
        "tokens_per_s": new / secs if secs else 0.0, "speedup": speedup,
        "tau": pooled.tau, "verification_calls": pooled.cycles, "verified_tokens": pooled.verified_tokens,
        "verified_per_new_token": pooled.verified_tokens / new if new else 0.0,
        "bins": bin_rows(pooled),
        "time_split_s": split, "time_split_share": {k: v / total if total else 0.0 for k, v in split.items()},
        # host time per cycle outside the declared sync points (on a GPU: what is left to remove by CUDA graphs)
        "host_ms_per_cycle": 1000.0 * pooled.host_s_per_cycle if pooled.cycles else None,
        "per_question_tokens_per_s": q_tps,
    }


def mean_row(rows):
    """The paper's "Mean" column: the mean of the per-benchmark speedups and taus; totals of the counts
    (None where they do not apply)."""
    def mean(k):
        v = [r[k] for r in rows if r.get(k) is not None]
        return sum(v) / len(v) if v else None

    def total(k):
        return None if any(r[k] is None for r in rows) else sum(r[k] for r in rows)

    return {"speedup": mean("speedup"), "tau": None if any(r["tau"] is None for r in rows) else mean("tau"),
            "tokens_per_s": sum(r["tokens_per_s"] for r in rows) / len(rows),
            "verification_calls": total("verification_calls"), "verified_tokens": total("verified_tokens"),
            "new_tokens": sum(r["new_tokens"] for r in rows)}


def speedup_over(files, name, baseline):
    """Method ``name`` against method ``baseline`` in a run's ``files`` ({bench: {method: metrics}}): per file
    the mean over questions of (name's tokens/s / baseline's), as the speedup over ar.  Returns
    ({bench: ratio or None}, the mean over the files that have one, or None)."""
    per = {}
    for b, rows in files.items():
        ratios = [a / c for a, c in zip(rows[name]["per_question_tokens_per_s"],
                                         rows[baseline]["per_question_tokens_per_s"]) if c > 0]
        per[b] = sum(ratios) / len(ratios) if ratios else None
    vals = [v for v in per.values() if v is not None]
    return per, (sum(vals) / len(vals) if vals else None)


def add_speedup_over_hf(files, mean):
    """The strongest HuggingFace baseline present (of :data:`HF_METHODS`, the best mean tokens/s in
    ``mean``), and every row's ``speedup_over_hf`` set in place (:func:`speedup_over` that baseline): per
    file in ``files``, the mean over files in ``mean``.  With no HF baseline the rows get None and the
    result is None."""
    hf = [n for n in HF_METHODS if n in mean]
    best = max(hf, key=lambda n: mean[n]["tokens_per_s"]) if hf else None
    for n in mean:
        per, avg = speedup_over(files, n, best) if best is not None else ({b: None for b in files}, None)
        for b in files:
            files[b][n]["speedup_over_hf"] = per[b]
        mean[n]["speedup_over_hf"] = avg
    return best


def first_diff(a, b):
    """The first position where token lists ``a`` and ``b`` differ (the shorter one's length when one is a
    prefix of the other)."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mismatch_report(per_q, names):
    """[{bench, question_id, turn, method, reference, first_diff}]: every (question, turn) where a method's
    tokens differ from the first method's."""
    bad = []
    ref_name = names[0]
    for b, by_method in per_q.items():
        for name in names[1:]:
            for ref, rec in zip(by_method[ref_name], by_method[name]):
                for t, (a, c) in enumerate(zip(ref["ids"], rec["ids"])):
                    if a != c:
                        bad.append({"bench": b, "question_id": rec["question_id"], "turn": t, "method": name,
                                    "reference": ref_name, "first_diff": first_diff(a, c)})
    return bad
