"""Cost profiling: time the engine's own steps on this machine and fit the
:class:`~heterospec.policy.profile.CostModel` that :meth:`heterospec.tune.Trace.replay` predicts speed with.

:func:`profile_costs` builds the engine (:class:`~heterospec.engine.HeteroSpec`) for the model pair and times
the steps of its cycle where they run, on the engine's static caches, with the engine's settings (its CPU
attention window, its GPU tree buckets, ``cpu_gemm``, CUDA graphs):

* **verify(n, ctx)**: ``TargetAdapter.verify`` of an n-node tree with ctx committed positions (taps captured
  when there is a draft, as the engine does), fitted as ``a + b*n + c*ctx + d*n*ctx``, or with a knee in n
  where that fits better (:func:`_fit_verify_rows`: a step flat in the nodes until its rows stop riding on the
  weights' read, as a GPU's is up to tens of tokens and a CPU's few-rows kernel up to about a dozen);
* **the draft's side of a cycle** for beam width (top_k) K and L levels: ``DraftState.grow`` from the root
  (one draft step and one ``ops.expand`` per level), the verification tree (``ops.select`` +
  ``ops.build_tree``) and the catch-up (``DraftState.follow`` over the L + 2 rows a cycle may commit), fitted as
  ``L*(e + f*K) + g + h*K``: the levels, and the root expansion, tree and catch-up once per cycle;
* **overhead**: the per-cycle time of a real ``generate`` call outside those steps, as the engine's phase clock
  splits it (acceptance, commit, the host loop, its sync points, the stopping checks): :func:`overhead_per_cycle`.

Both fits minimise the relative error (:func:`_fit`).

Replay then predicts tokens per second as new tokens / sum over cycles of
``verify(nodes, ctx) + draft(levels, top_k) + overhead`` (:class:`CostModel`).
"""
from __future__ import annotations

import numpy as np

from ..measure import DeviceTimer
from ..policy.profile import CostModel


def _device(module):
    """A module's device: its ``.device`` when it declares one, else its first parameter or buffer's; the CPU
    without any."""
    import torch

    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device
    tensors = list(module.parameters()) + list(module.buffers()) if isinstance(module, torch.nn.Module) else []
    return tensors[0].device if tensors else torch.device("cpu")


def _recordings(device, emulate=False):
    """A fit's set of timing graphs: one :class:`~heterospec.engine.graphs.StepGraphs`, so they share its
    capture stream and die together, as a recorded set of the engine does (``emulate``: the engine's
    ``cuda_graphs="emulate"``, for a CPU run of the same code)."""
    from ..engine.graphs import StepGraphs

    return StepGraphs(emulate=emulate, device=device)


def _recorded(fn, device, steps):
    """``fn`` recorded into ``steps`` (:func:`_recordings`) after an eager warm-up on its stream; returns the
    replay (what the recorded engine pays for the same work)."""
    from ..engine.graphs import no_collection_while_recording, warm_up

    key = len(steps)
    with no_collection_while_recording():
        warm_up(device, [fn, fn], steps.stream)
        steps.capture(key, fn)

    def replay(fn=fn, steps=steps, key=key):
        # The graph reads fn's tensors (its default arguments, its closure) at the addresses they had when it
        # was recorded: holding fn here keeps them, so the caching allocator cannot hand that memory to a later
        # tensor.  Returning the graph's replay alone let calibrate's draft steps read another tensor's value as
        # their accepted length (a device-side assert, then SIGSEGV, on the second GPU run).
        steps.replay(key)

    return replay


def profile_costs(target, draft=None, *, tree_tokens=(1, 2, 4, 8, 16, 32, 64, 128), contexts=(64, 160, 256),
                  beams=(1, 2, 4, 8, 10), levels=(1, 4, 8), reps=3, graphs=False, cpu_gemm="auto",
                  overhead_tokens=32, cpu_decoder="auto", report=None):
    """Measure this machine and fit a :class:`CostModel` (see the module docstring).  Every timed region is
    synchronised with the device at both ends (:class:`DeviceTimer`) and holds one engine step.
    ``tree_tokens`` x ``contexts``: the verify grid; ``beams`` x ``levels``: the draft grid (at the first
    context); ``graphs=True`` (a CUDA model): each step is timed as a replayed CUDA graph and the overhead
    from ``generate`` with ``cuda_graphs=True`` -- the costs of the recorded engine; ``cpu_gemm``: the engine's
    setting (:mod:`heterospec.models.cpu_gemm`); ``overhead_tokens``: new tokens per ``generate`` call timed for
    the overhead (0: leave it 0); ``cpu_decoder``: the engine's setting (:mod:`heterospec.models.cpu_decoder`);
    ``report``: called with one line per part as it ends (what was timed, how many points, its seconds), so a
    command can say where minutes of measuring go."""
    import time

    import torch

    from ..models import cpu_decoder as decoder
    from ..models import cpu_gemm as gemm

    device = _device(target)
    if graphs and device.type != "cuda":
        raise ValueError(f"profile_costs: argument 'graphs' expected False for a model on {device} (CUDA graphs "
                         f"need a CUDA device), got True")
    # packed once for every engine below, as each of them routes (the target's layers only where it runs on
    # transformers' forward, the draft's where its own step runs: the engines' cpu_decoder)
    on_decoder = decoder.for_target(cpu_decoder, target) is not None   # (shared with the engines: packed once)
    routed = decoder.gemm_modules(draft, decoder.for_draft(cpu_decoder, draft))
    settings = (graphs, cpu_gemm, cpu_decoder)
    say = report or (lambda line: None)
    how = "replayed CUDA graphs" if graphs else "eager steps"
    with gemm.for_models(cpu_gemm, target, routed, route_target=not on_decoder), torch.no_grad():
        t0 = time.perf_counter()
        verify = _fit_verify(target, draft, tree_tokens, contexts, reps, settings, device)
        say(f"costs: verify timed at {len(tree_tokens) * len(contexts)} (tree size, context) points, {how}, "
            f"{reps} rounds, in {time.perf_counter() - t0:.1f} s")
        if draft is not None:
            t0 = time.perf_counter()
            level = _fit_levels(target, draft, beams, levels, contexts[0], reps, settings, device)
            say(f"costs: the draft's side timed at {len(beams) * len(levels)} (levels, beams) points, {how}, "
                f"{reps} rounds, in {time.perf_counter() - t0:.1f} s")
        else:
            level = (0.0, 0.0, 0.0, 0.0)
    cost = CostModel(verify, level, 0.0)
    if overhead_tokens:
        t0 = time.perf_counter()
        cost.overhead = _measure_overhead(target, draft, contexts[0], overhead_tokens, settings, device)
        say(f"costs: overhead {cost.overhead * 1e3:.3f} ms a cycle from a generate call of {overhead_tokens} tokens "
            f"after a warm-up, in {time.perf_counter() - t0:.1f} s")
    return cost


def _engine(target, draft, policy, settings):
    """An engine of the settings (graphs, cpu_gemm, cpu_decoder) being profiled."""
    from ..engine import HeteroSpec

    graphs, cpu_gemm, cpu_decoder = settings
    return HeteroSpec(target, draft, policy, cuda_graphs=bool(graphs), cpu_gemm=cpu_gemm, cpu_decoder=cpu_decoder)


def _prompt(target, length, device):
    import torch

    return torch.randint(0, target.config.vocab_size, (1, length), device=device)


def _fit_verify(target, draft, tree_tokens, contexts, reps, settings, device):
    """verify(n, ctx) from the engine's own verify step: (a, b, c, d)."""
    graphs = settings[0]
    import torch

    from ..engine.tree import bucket_for
    from ..models.target import attention_window
    from ..policy import Policy

    hs = _engine(target, draft, Policy.autoregressive(), settings)
    tgt = hs.cycle.target
    timer = DeviceTimer(device)
    calls = []
    try:
        tgt.allocate(max(contexts) + bucket_for(max(tree_tokens), hs.buckets) + 64)
        tgt.prefill(_prompt(target, max(contexts), device))
        for ctx in contexts:
            for n in tree_tokens:
                m = bucket_for(n, hs.buckets)            # on a GPU the engine pads a tree to its bucket
                tokens = torch.randint(0, target.config.vocab_size, (m,), device=device)
                depths = torch.arange(m, device=device).clamp(max=8)
                mask = torch.ones(m, m, dtype=torch.bool, device=device).tril()
                window = attention_window(device, ctx + 1, m)   # the committed tokens and the root, then the tree

                def forward(tokens=tokens.view(1, m), depths=depths.view(1, m), mask=mask.view(1, m, m), window=window):
                    return tgt.verify(tokens, depths, mask, window)       # the engine's form: a batch of one

                # as in decoding: the prefix at ctx committed positions (a prefill's content, never read back)
                calls.append((n, ctx, lambda c=ctx: tgt.prefix.fill_(c), forward))
        if graphs:
            steps = _recordings(device)
            calls = [(n, ctx, setup, (setup(), _recorded(fn, device, steps))[1]) for n, ctx, setup, fn in calls]
        times = _interleaved(timer, [(setup, call) for *_, setup, call in calls], reps)
        rows = [(n, ctx, t) for (n, ctx, *_), t in zip(calls, times)]
    finally:
        hs.close()
    return _fit_verify_rows(rows)


def _fit_verify_rows(rows):
    """The verify coefficients from measured (nodes, context, seconds): the line ``a + b*n + c*ctx + d*n*ctx``,
    or the same with a knee (a, b, c, d, knee, b0: ``b0`` per node up to ``knee``, ``b`` past it) at the grid's
    node count whose fit has the least relative error among those where the cost per node rises at the knee
    (0 <= b0 <= b), when that error is under 0.8 of the line's and half a percent below it.  A line
    through a step that is flat for few nodes and steep for many misses both ends: on the 2-core Xeon with the
    GGUF's codes it put a one-row step at 12 ms against 6-7.5 measured."""
    y = [t for *_, t in rows]
    line = _fit([[1.0, n, c, n * c] for n, c, _ in rows], y)
    knees = []
    nodes = sorted({n for n, *_ in rows})
    for knee in nodes[1:-1]:   # a node count below it and one past it, at least
        a, b0, b, c, d = _fit([[1.0, min(n, knee), max(n - knee, 0), c, n * c] for n, c, _ in rows], y)
        if b0 >= 0 and b >= b0:   # a knee where the cost per node rises, never a fit of one noisy point
            coef = (a, b, c, d, float(knee), b0)
            knees.append((_relative_error(coef, rows), coef))
    err, coef = min(knees, default=(float("inf"), None))
    line_err = _relative_error(line, rows)
    return coef if err < 0.8 * line_err and line_err - err > 0.005 else line


def _relative_error(coef, rows):
    """Root mean square relative error of the verify coefficients ``coef`` over (nodes, context, seconds)."""
    model = CostModel(tuple(coef), (0.0, 0.0), 0.0)
    return float(np.sqrt(np.mean([(model.verify_cost(n, c) / max(t, 1e-12) - 1.0) ** 2 for n, c, t in rows])))


def _interleaved(timer, points, reps):
    """The median seconds of each (setup, call) of ``points``: every call once untimed first (one-time costs
    stay out), then ``reps`` rounds timing each call once in turn, its setup untimed before it, so that a slow
    spell of a shared machine touches every point alike instead of a block of them.  In a round each call runs
    once untimed right before its timed run: decoding repeats steps of one size, and a step timed right after
    another point's much larger one pays for it (on the 2-core Xeon a one-row verify step right after a 128-row
    one took 11-29 ms against 8-11 after its own size, which put the grid's one-row point above its two-row one)."""
    for setup, call in points:
        setup()
        call()
    times = [[] for _ in points]
    for _ in range(reps):
        for (setup, call), ts in zip(points, times):
            setup()
            call()
            setup()
            ts.append(timer(call)[1])
    return [float(np.median(ts)) for ts in times]


def _fit(X, y):
    """Least squares in relative error (each row weighted by 1 / its time), so that the few-node trees a
    policy verifies weigh as much as the grid's large ones."""
    X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    return tuple(float(v) for v in np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0])


def _nothing():
    pass


def _fit_levels(target, draft, beams, levels, ctx, reps, settings, device):
    """draft(L, K) from the draft's side of the engine's cycle (growth, verification tree, catch-up): (e, f, g, h)."""
    graphs = settings[0]
    import torch

    from ..engine.tree import bucket_for, tree_size, verification_tree
    from ..growth import candidate_count
    from ..policy import Policy

    timer = DeviceTimer(device)
    deepest = max(levels)
    engines, points = [], []
    steps = _recordings(device) if graphs else None
    try:
        for K in beams:
            policy = Policy.static(deepest, K, min(60, candidate_count(K, deepest) + 1))
            hs = _engine(target, draft, policy, settings)
            engines.append(hs)
            cyc = hs.cycle
            tgt, dr = cyc.target, cyc.drafter
            capacity = ctx + max(bucket_for(policy.total_tokens, hs.buckets), deepest + 2) + 1
            tgt.allocate(capacity)
            dr.allocate(capacity, device)
            prompt = _prompt(target, ctx, device)
            _, taps = tgt.prefill(prompt)
            ids = torch.cat([prompt[:, 1:], prompt[:, :1]], dim=1)
            dr.prime(taps, ids, torch.full((1,), ctx - 1, dtype=torch.long, device=device), prompt=prompt)
            for L in levels:
                R = min(L + 2, ctx)                       # the rows a cycle of L levels may commit
                kept = torch.arange(R, device=device).view(1, R)
                path_tokens = prompt[:, :R].clone()
                length = torch.full((1,), R, dtype=torch.long, device=device)
                nxt = prompt[0, :1].clone()
                n = tree_size(K, L, policy.total_tokens) - 1
                T = bucket_for(n + 1, hs.buckets)
                n, m = (torch.full((1,), x, dtype=torch.long, device=device) for x in (n, candidate_count(K, L)))

                def side(L=L, kept=kept, path_tokens=path_tokens, length=length, nxt=nxt, vtaps=taps[:, :R],
                         dr=dr, tgt=tgt, cyc=cyc, n=n, m=m, T=T):
                    g = dr.grow(None, L, tgt.prefix)
                    verification_tree(g, n, m, cyc.state.root, T, device.type != "cuda")
                    dr.follow(vtaps, kept, path_tokens, length, nxt, tgt.prefix)

                points.append((L, K, _recorded(side, device, steps) if graphs else side))
        times = _interleaved(timer, [(_nothing, call) for *_, call in points], reps)
    finally:
        for hs in engines:
            hs.close()
    pts = [(L, K, t) for (L, K, _), t in zip(points, times)]
    return _fit([[L, L * K, 1.0, K] for L, K, _ in pts], [t for *_, t in pts])


def overhead_per_cycle(stats):
    """Seconds per cycle of a ``generate`` call (its :class:`~heterospec.engine.GenerationStats`) outside the
    steps the cost model times, as the engine's own phase clock splits it: the decoding time (prefill excluded)
    less the draft and verify phases (eager engine) or the replayed steps (recorded engine) -- acceptance and
    commit, the host loop, its sync points and the stopping checks."""
    if not stats.cycles:
        return 0.0
    decode = stats.total_s - stats.prefill_s
    return max(0.0, (decode - stats.draft_s - stats.verify_s - stats.graph_s) / stats.cycles)


def _measure_overhead(target, draft, ctx, tokens, settings, device):
    """overhead_per_cycle of a real ``generate`` (EAGLE-3's default static tree with a draft, else
    autoregressive), after a first call that warms up (and records the steps with ``graphs``)."""
    from ..policy import Policy

    policy = Policy.static() if draft is not None else Policy.autoregressive()
    prompt = _prompt(target, ctx, device)
    with _engine(target, draft, policy, settings) as hs:
        hs.generate(prompt, max_new_tokens=min(tokens, 8), eos_token_id=[])   # timed to the budget, EOS or not
        _, stats = hs.generate(prompt, max_new_tokens=tokens, eos_token_id=[])
    return overhead_per_cycle(stats)
