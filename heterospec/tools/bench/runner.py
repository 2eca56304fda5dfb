"""The run: :func:`run_bench` answers every question with every method, in one process with one model
load.

Each question is answered by every method in turn before the next question (so drift of the machine during
the run touches all methods alike), with the same prompt, settings and seed.  MT-bench's second turn is
asked after the method's own first answer (EAGLE's evaluation does the same).  Every method has an untimed
warm-up whose time is reported apart.  At temperature 0 every method's tokens are checked against the first
method's (:func:`.metrics.mismatch_report`)."""
from __future__ import annotations

from ...measure import DeviceTimer
from ..prompts import encode_turn
from .baselines import HFGenerate, eos_list
from .methods import HFMethod, engine_options, split_mismatches, static_hf
from .metrics import add_speedup_over_hf, file_row, mean_row, mismatch_report


def run_bench(target, tokenizer, draft, methods, questions, *, max_new_tokens=512, temperature=0.0, seed=0,
              device="cpu", warmup_tokens=32, chat=True, eos_token_id=None, progress=None, cuda_graphs=False,
              cpu_decoder="auto"):
    """Answer every question with every method (questions outer, methods inner).  Returns
    {"temperature", "files": {bench: {method: metrics}}, "mean": {method: metrics}, "mismatches": [...],
    "other_arithmetic": [...] (greedy differences of transformers' half arithmetic from ours, not failures:
    :func:`.methods.split_mismatches`),
    "warmup_s": {method: seconds}, "cpu_gemm": {our method: its CPU matrix path (HeteroSpec.cpu_gemm)},
    "cpu_decoder": {our method: which forwards ran on heterospec's CPU code (HeteroSpec.cpu_decoder)},
    "strongest_hf": name or None, "hf_static": {...} (with hf-static), "hf_compiled": {...} (with hf-compiled),
    "answers": [records]}.  ``methods``: [(name, Policy or HFMethod)] (:func:`.methods.build_methods`).
    ``cuda_graphs``: passed to our engines (sized once for the longest conversation, so each tree shape is
    recorded once, in the warm-up); capture time is kept out of the timings and reported as "capture_s".
    ``cpu_decoder``: our engines' setting (:class:`HeteroSpec`)."""
    from ...engine.loop import HeteroSpec

    timer = DeviceTimer(device)
    total_steps = sum(len(q["turns"]) for qs in questions.values() for q in qs) * len(methods)
    step = 0
    engines = {}
    warmup_s = {}
    compiled = {}   # static-cache HF method -> [whether transformers compiled its forward, per call]
    eos = eos_list(eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    cache_len = None
    engine_len = None
    if cuda_graphs:
        engine_len = static_cache_len(tokenizer, questions, max_new_tokens, chat,
                                      getattr(target.config, "max_position_embeddings", None))
    capture_s = {}
    if any(static_hf(m) for _, m in methods):
        cache_len = static_cache_len(tokenizer, questions, max_new_tokens, chat,
                                     getattr(target.config, "max_position_embeddings", None))
    try:
        for name, pol in methods:
            if isinstance(pol, HFMethod):
                engines[name] = HFGenerate(target, pol, pad_token_id=pad)
            else:
                engines[name] = HeteroSpec(target, draft if pol.drafts else None, pol, cuda_graphs=cuda_graphs,
                                           max_length=engine_len, cpu_decoder=cpu_decoder, **engine_options(name))
        if warmup_tokens:
            first = next(iter(questions.values()))[0]
            ids = encode_turn(tokenizer, first["turns"], [], chat).to(device)
            for name, pol in methods:
                kw = {}
                if static_hf(pol):
                    kw = {"cache_len": cache_len, "stop_after": warmup_tokens}  # compiles (where it does)
                (_, st), warmup_s[name] = timer(lambda: engines[name].generate(
                    ids, max_new_tokens=warmup_tokens, temperature=temperature, seed=seed, eos_token_id=[], **kw))
                capture_s[name] = capture_s.get(name, 0.0) + getattr(st, "capture_s", 0.0)
                if kw and st.compiled is not None:
                    compiled.setdefault(name, []).append(st.compiled)
        per_q = {b: {n: [] for n, _ in methods} for b in questions}  # one record per question
        answers = []
        for b, qs in questions.items():
            for qi, q in enumerate(qs):
                for name, pol in methods:
                    rec = {"question_id": q["question_id"], "turns": [], "ids": [], "new_tokens": [],
                           "wall_time": [], "stats": []}
                    texts = []
                    for t in range(len(q["turns"])):
                        if progress is not None:
                            progress(f"{b} q{qi + 1}/{len(qs)} turn {t + 1} {name}", step, total_steps)
                        ids = encode_turn(tokenizer, q["turns"], texts, chat).to(device)
                        turn_seed = (seed * 1_000_003 + qi * 16 + t) % 2**62
                        (seq, st), dt = timer(lambda: engines[name].generate(
                            ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=turn_seed,
                            eos_token_id=eos_token_id))
                        if getattr(st, "capture_s", 0.0):   # recorded in this call: apart from decoding time
                            dt -= st.capture_s
                            capture_s[name] = capture_s.get(name, 0.0) + st.capture_s
                        new = seq[0, ids.shape[1]:].tolist()
                        texts.append(tokenizer.decode(new, skip_special_tokens=True))
                        rec["ids"].append(new)
                        rec["new_tokens"].append(st.new_tokens)
                        rec["wall_time"].append(dt)
                        rec["stats"].append(st)
                        if getattr(st, "compiled", None) is not None and static_hf(pol):
                            compiled.setdefault(name, []).append(st.compiled)
                        step += 1
                    rec["turns"] = texts
                    per_q[b][name].append(rec)
                    answers.append({"bench": b, "question_id": q["question_id"], "method": name,
                                    "turns": texts, "new_tokens": rec["new_tokens"], "wall_time": rec["wall_time"]})
        if progress is not None:
            progress("done", total_steps, total_steps)
    finally:
        for hs in engines.values():
            hs.close()
    names = [n for n, _ in methods]
    files = {b: {n: file_row(per_q[b][n], per_q[b]["ar"] if "ar" in names else None) for n in names}
             for b in questions}
    mean = {n: mean_row([files[b][n] for b in questions]) for n in names}
    strongest = add_speedup_over_hf(files, mean)
    gemm = {n: e.cpu_gemm for n, e in engines.items() if isinstance(e, HeteroSpec)}
    decoder = {n: e.cpu_decoder for n, e in engines.items() if isinstance(e, HeteroSpec)}
    mism, notes = split_mismatches(mismatch_report(per_q, names) if temperature == 0 else [], target.dtype,
                                   decoder.values())
    out = {"temperature": temperature, "files": files, "mean": mean, "mismatches": mism, "other_arithmetic": notes,
           "warmup_s": warmup_s,
           "strongest_hf": strongest, "cuda_graphs": cuda_graphs, "capture_s": capture_s, "cpu_gemm": gemm,
           "cpu_decoder": decoder}
    for n, pol in methods:
        if static_hf(pol):
            seen = compiled.get(n)
            out[n.replace("-", "_")] = {"compiled": any(seen) if seen else None, "static_cache_len": cache_len,
                                        "warmup_s": warmup_s.get(n), "device": str(device)}
    out["answers"] = answers
    return out



def static_cache_len(tokenizer, questions, max_new_tokens, chat=True, max_positions=None):
    """Positions enough for the longest conversation of ``questions`` (every turn's prompt with earlier
    answers of ``max_new_tokens`` tokens, plus a margin for re-tokenising them), capped at
    ``max_positions``: ``hf-static``'s warm-up sizes the static cache with it, so that no timed call
    allocates a new one (on CUDA that is a recompile inside the timing)."""
    longest = 0
    for qs in questions.values():
        for q in qs:
            n = len(q["turns"])
            ids = encode_turn(tokenizer, q["turns"], [""] * (n - 1), chat)
            longest = max(longest, ids.shape[1] + n * (max_new_tokens + 16))
    return min(longest, max_positions) if max_positions else longest
