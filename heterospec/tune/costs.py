"""Cost profiling: time this machine and fit the :class:`~heterospec.policy.profile.CostModel` that
:meth:`heterospec.tune.Trace.replay` predicts speed with.

:func:`profile_costs` times one target verification forward as a function of tree tokens and context length
and one draft level as a function of beam width, and fits ``verify(n, ctx) = a + b*n + c*ctx + d*n*ctx`` and
``level(beam) = e + f*beam`` by least squares.  Replay then predicts tokens per second as new tokens / sum over
cycles of (verify(nodes, ctx) + (levels + 1) * level(top_k) + overhead).
"""
from __future__ import annotations

import numpy as np

from ..measure import DeviceTimer
from ..policy.profile import CostModel


def _place(module):
    """(device, floating dtype) of a module: its ``.device`` / ``.dtype`` when it declares them, else its
    first parameter or buffer (the first floating one for the dtype); CPU / the default dtype without any."""
    import torch

    tensors = list(module.parameters()) + list(module.buffers()) if isinstance(module, torch.nn.Module) else []
    device = getattr(module, "device", None)
    if not isinstance(device, torch.device):
        device = tensors[0].device if tensors else torch.device("cpu")
    dtype = getattr(module, "dtype", None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.get_default_dtype())
    return device, dtype


def _recorded(fn, device):
    """``fn`` recorded in a CUDA graph after an eager warm-up; returns the replay (what the recorded engine
    pays for the same work)."""
    import torch

    from ..engine.graphs import warm_up

    warm_up(device, [fn, fn])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def profile_costs(target, draft=None, *, tree_tokens=(1, 2, 4, 8, 16, 32, 64, 128), contexts=(64, 256),
                  beams=(1, 2, 4, 8, 10), reps=3, graphs=False, cpu_gemm="auto"):
    """Measure this machine and fit a :class:`CostModel` (see the module docstring).  Every input is made
    on the model's own device (the draft's inputs in its dtype too), and every timed region is
    synchronised with the device at both ends (:class:`DeviceTimer`).  ``graphs=True`` (a CUDA model)
    times each verify forward and draft level as a replayed CUDA graph -- the costs of the engine with
    ``cuda_graphs`` -- instead of eager calls.  ``cpu_gemm``: time the linear layers the way the engine runs
    them with the same setting (:mod:`heterospec.models.cpu_gemm`)."""
    from ..models import cpu_gemm as gemm

    with gemm.for_models(cpu_gemm, target, draft):
        return _profile_costs(target, draft, tree_tokens, contexts, beams, reps, graphs)


def _profile_costs(target, draft, tree_tokens, contexts, beams, reps, graphs):
    import torch

    from ..models.target import TargetAdapter

    adapter = TargetAdapter(target, capture_taps=False)
    device, _ = _place(target)
    if graphs and device.type != "cuda":
        raise ValueError(f"profile_costs: argument 'graphs' expected False for a model on {device} (CUDA graphs "
                         f"need a CUDA device), got True")
    timer = DeviceTimer(device)
    vocab = target.config.vocab_size
    allocate = getattr(adapter, "allocate", None)  # a static cache: sized once for the largest prompt + tree
    if allocate is not None:
        allocate(max(contexts) + max(tree_tokens))
    rows = []
    try:
        for ctx in contexts:
            prompt = torch.randint(0, vocab, (1, ctx), device=device)
            for n in tree_tokens:
                tokens = torch.randint(0, vocab, (n,), device=device)
                depths = torch.arange(n, device=device).clamp(max=8)
                mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()

                def forward():
                    return adapter.verify(tokens, depths, mask)

                adapter.prefill(prompt)
                call = _recorded(forward, device) if graphs else forward

                def run():
                    adapter.prefill(prompt)
                    return timer(call)[1]

                run()
                rows.append((n, ctx, float(np.median([run() for _ in range(reps)]))))
    finally:
        adapter.close()
    X = np.array([[1.0, n, c, n * c] for n, c, _ in rows])
    y = np.array([t for _, _, t in rows])
    verify = tuple(float(v) for v in np.linalg.lstsq(X, y, rcond=None)[0])
    level = (0.0, 0.0)
    if draft is not None:
        h = getattr(getattr(draft, "config", None), "hidden_size", None) or draft.hidden_size
        d_device, d_dtype = _place(draft)
        pts = []
        for beam in beams:
            hid = torch.zeros(1, beam, h, dtype=d_dtype, device=d_device)
            ids = torch.zeros(1, beam, dtype=torch.long, device=d_device)
            pos = torch.full((1, beam), 64, dtype=torch.long, device=d_device)
            with torch.no_grad():
                def one_level():
                    return draft(hid, ids, pos)

                call = _recorded(one_level, d_device) if graphs else one_level
                pts.append((beam, DeviceTimer(d_device).median(call, reps)))
        A = np.array([[1.0, b] for b, _ in pts])
        level = tuple(float(v) for v in np.linalg.lstsq(A, np.array([t for _, t in pts]), rcond=None)[0])
    return CostModel(verify, level, 0.0)
