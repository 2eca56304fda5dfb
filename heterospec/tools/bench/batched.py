"""``heterospec bench --batch-size 1,4,16``: throughput against batch size (issue 29).

The first turn of every loaded question is a prompt; the list is repeated to the largest batch size when it
is shorter, and every batch size decodes the same prompts, in consecutive groups of that size.  For each
batch size every method decodes every group in turn (methods inner, so drift of the machine touches all
alike), after one untimed warm-up group.  Greedy (temperature 0) only: each row's tokens are checked against
``ar``'s for the same prompt.

Per method and batch size: total throughput (new tokens of all rows / the groups' wall time), per-request
latency (our engine: from the group's start to the request's last token, ``GenerationStats.per_row``; the HF
baselines only report the group, so a request's latency is its group's time), τ (mean over the requests),
verified tree tokens per batched forward and per new token.  HF's baselines run ``model.generate`` on the
left-padded group, as a transformers user batches."""
from __future__ import annotations

import statistics

from ...measure import DeviceTimer
from ..prompts import encode_turn
from .baselines import HFGenerate, eos_list
from .methods import HFMethod, arithmetic_note, engine_options, split_mismatches, static_hf
from .metrics import first_diff


def parse_batch_sizes(text):
    """'1,4,16' -> [1, 4, 16] (ascending, distinct, each >= 1); a ValueError names the argument."""
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"bench: argument '--batch-size' expected distinct ints >= 1 separated by commas, got {text!r}")
    return sorted(sizes)


def batch_prompts(tokenizer, questions, chat, count):
    """The first turn of every question as [1, S] ids, repeated in order to at least ``count`` prompts."""
    firsts = [encode_turn(tokenizer, q["turns"][:1], [], chat) for qs in questions.values() for q in qs]
    out = list(firsts)
    while len(out) < count:
        out += firsts[: count - len(out)]
    return out


def run_batch_bench(target, tokenizer, draft, methods, prompts, batch_sizes, *, max_new_tokens, device="cpu",
                    eos_token_id=None, warmup_tokens=16, progress=None, cuda_graphs=False, cpu_decoder="auto"):
    """{"batch_sizes", "results": {B: {method: row}}, "mismatches": [...], "other_arithmetic": [...] (not
    failures: :func:`.methods.split_mismatches`), "stops_beating_ar": {method: B or None}, "cuda_graphs"}; a
    row: tokens_per_s, latency_mean_s, latency_p90_s, tau, verified_per_call, verified_per_token, new_tokens,
    seconds, groups.  ``cuda_graphs``: passed to our engines, sized once for
    the longest prompt (each batch size is recorded in its untimed warm-up, the last, smaller group's too);
    ``cpu_decoder``: our engines' setting."""
    import torch

    from ...engine.requests import left_pad
    from ...engine.loop import HeteroSpec

    timer = DeviceTimer(device)
    eos = eos_list(eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    engines = {}
    longest = max(p.shape[1] for p in prompts)
    for name, pol in methods:
        engines[name] = (HFGenerate(target, pol, pad_token_id=pad) if isinstance(pol, HFMethod) else
                         HeteroSpec(target, draft if pol.drafts else None, pol, cuda_graphs=cuda_graphs,
                                    max_length=longest + max_new_tokens if cuda_graphs else None,
                                    cpu_decoder=cpu_decoder, **engine_options(name)))
    results, tokens = {}, {}
    steps = sum(-(-len(prompts) // B) for B in batch_sizes) * len(methods)
    step = 0
    try:
        for B in batch_sizes:
            groups = [prompts[i:i + B] for i in range(0, len(prompts), B)]
            acc = {n: {"new": 0, "s": 0.0, "lat": [], "tau": [], "verified": 0, "calls": 0, "rows": []}
                   for n, _ in methods}
            warm = [groups[0]] + ([groups[-1]] if len(groups[-1]) != len(groups[0]) else [])
            for name, pol in methods:                         # warm-up (and recording, compiling), untimed
                # a static cache sized for the timed calls, so that none of them compiles again
                kw = ({"cache_len": longest + max_new_tokens, "stop_after": warmup_tokens}
                      if static_hf(pol) else {})
                for group in warm:
                    _decode(engines[name], group, warmup_tokens, eos_token_id, pad, device, left_pad, torch, **kw)
            for gi, group in enumerate(groups):
                for name, _ in methods:
                    if progress is not None:
                        progress(f"batch {B} group {gi + 1}/{len(groups)} {name}", step, steps)
                    (rows, st), dt = timer(lambda: _decode(engines[name], group, max_new_tokens, eos_token_id, pad,
                                                           device, left_pad, torch))
                    step += 1
                    a = acc[name]
                    a["new"] += sum(len(r) for r in rows)
                    a["s"] += dt
                    a["rows"] += rows
                    if st is None:                            # an HF baseline: the group's time for each request
                        a["lat"] += [dt] * len(rows)
                        continue
                    per = st.per_row or [st]
                    a["lat"] += [r.total_s for r in per]
                    a["tau"] += [r.tau for r in per]
                    a["verified"] += st.verified_tokens
                    a["calls"] += st.batch_calls or st.cycles
            results[B] = {n: _row(a, len(groups)) for n, a in acc.items()}
            tokens[B] = {n: a["rows"] for n, a in acc.items()}
    finally:
        for e in engines.values():
            e.close()
    names = [n for n, _ in methods]
    mism = []
    if "ar" in names:
        for B in batch_sizes:
            for n in names:
                for i, (x, ref) in enumerate(zip(tokens[B][n], tokens[B]["ar"])):
                    if x != ref:
                        mism.append({"batch_size": B, "method": n, "reference": "ar", "prompt": i,
                                     "first_diff": first_diff(x, ref)})
    mism, notes = split_mismatches(mism, target.dtype,
                                   [e.cpu_decoder for e in engines.values() if isinstance(e, HeteroSpec)])
    stops = {}
    if "ar" in names:
        for n in names:
            if n == "ar" or isinstance(dict(methods)[n], HFMethod):
                continue
            stops[n] = next((B for B in batch_sizes
                             if results[B][n]["tokens_per_s"] < results[B]["ar"]["tokens_per_s"]), None)
    return {"batch_sizes": list(batch_sizes), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "results": results, "mismatches": mism, "other_arithmetic": notes, "stops_beating_ar": stops,
            "cuda_graphs": cuda_graphs}


def _decode(engine, group, max_new_tokens, eos_token_id, pad, device, left_pad, torch, **hf_kw):
    """One group through one method -> (each row's new tokens, our GenerationStats or None for a baseline).
    ``hf_kw``: an HF baseline's warm-up arguments (``cache_len``, ``stop_after``)."""
    if isinstance(engine, HFGenerate):
        if len(group) == 1:
            seq, _ = engine.generate(group[0].to(device), max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                     **hf_kw)
            return [seq[0, group[0].shape[1]:].tolist()], None
        ids, mask = left_pad([g[0] for g in group], pad, device)
        rows, _ = engine.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                  **hf_kw)
        return rows, None
    outs, st = engine.generate([g[0].to(device) for g in group], max_new_tokens=max_new_tokens,
                               eos_token_id=eos_token_id)
    return [o[g.shape[1]:].tolist() for o, g in zip(outs, group)], st


def _row(a, groups):
    lat = sorted(a["lat"])
    return {"tokens_per_s": a["new"] / a["s"] if a["s"] > 0 else 0.0, "new_tokens": a["new"], "seconds": a["s"],
            "groups": groups, "latency_mean_s": statistics.fmean(lat) if lat else None,
            "latency_p90_s": lat[min(len(lat) - 1, int(0.9 * len(lat)))] if lat else None,
            "tau": statistics.fmean(a["tau"]) if a["tau"] else None,
            "verified_per_call": a["verified"] / a["calls"] if a["calls"] else None,
            "verified_per_token": a["verified"] / a["new"] if a["calls"] and a["new"] else None}


def batch_markdown(r, header=""):
    """The throughput-vs-batch table: one row per method, per batch size tokens/s (x ar), mean latency, tau and
    verified tokens per batched forward."""
    sizes = r["batch_sizes"]
    results = {int(k): v for k, v in r["results"].items()}     # int keys, or str keys from the JSON
    names = list(results[sizes[0]])
    lines = [header] if header else []
    cols = " | ".join(f"B={B} tokens/s (× ar) | B={B} latency s | B={B} τ | B={B} verified/forward" for B in sizes)
    lines += [f"| method | {cols} |", "|---|" + "---:|" * (4 * len(sizes))]
    for n in names:
        cells = []
        for B in sizes:
            x, ar = results[B][n], results[B].get("ar")
            ratio = f" ({x['tokens_per_s'] / ar['tokens_per_s']:.2f}×)" if ar and ar["tokens_per_s"] else ""
            cells += [f"{x['tokens_per_s']:.1f}{ratio}", _f(x["latency_mean_s"], "{:.2f}"), _f(x["tau"], "{:.2f}"),
                      _f(x["verified_per_call"], "{:.1f}")]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if r["stops_beating_ar"]:
        lines += ["", "Batch size at which a speculative method stops beating ar: " + "; ".join(
            f"{n}: {B if B is not None else f'none up to {sizes[-1]}'}" for n, B in r["stops_beating_ar"].items())]
    lines += ["", f"Greedy outputs differing from ar's: {len(r['mismatches'])}"]
    if r.get("other_arithmetic"):
        lines.append(f"Not counted there, {len(r['other_arithmetic'])} outputs of transformers' generate: "
                     f"{arithmetic_note(r.get('dtype', 'float32'))}.")
    return "\n".join(lines)


def _f(v, fmt):
    return "–" if v is None else fmt.format(v)


def batch_plot(r, path):
    """Throughput against batch size, one line per method (log-2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = r["batch_sizes"]
    results = {int(k): v for k, v in r["results"].items()}
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in results[sizes[0]]:
        ax.plot(sizes, [results[B][n]["tokens_per_s"] for B in sizes], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(B) for B in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (all requests)")
    ax.set_title("throughput against batch size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

