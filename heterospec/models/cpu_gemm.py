"""Pre-packed oneDNN weights for the linear layers of a model on the CPU (``cpu_gemm``).

Why: PyTorch's CPU ``linear`` goes to MKL, which takes a matrix-vector path for one row and a general matrix
product for two or more, repacking the weight on every call.  A speculative cycle verifies a few rows at once,
so on a 2-core CPU one SmolLM2-135M forward over 2-12 rows cost 84-97 ms against 57 ms for one row, while
the weights streamed from memory are the same (benchmarks/RESULTS.md, issue 28).  oneDNN with the weight
reordered once into its blocked layout (what ``torch.compile``'s CPU freezing does) runs the same forward in
40-50 ms for 1-12 rows.  The results are the same products summed in another order: logits agree to ~1e-4.

:class:`PackedLinears` gives every ``nn.Linear`` of the modules it is given (float32 or bfloat16 weights on the
CPU) a packed copy and, inside its ``with`` block only, routes the layer's ``forward`` to it.  The packed copies
cost as much memory as the weights they mirror (one copy per layer, shared by every engine on the model); a
weight written since it was packed is packed again at the next entry.
"""
from __future__ import annotations

import weakref

import torch

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def available():
    """Whether this torch build has the oneDNN linear with pre-packed weights (x86 and ARM builds with mkldnn)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
                    and hasattr(ops, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def wanted(setting, module):
    """``cpu_gemm`` setting ('auto', True or False) -> whether to pack ``module``: 'auto' packs a CPU module with
    float32 or bfloat16 weights when :func:`available`; True insists (ValueError where it cannot)."""
    if setting not in ("auto", True, False):
        raise ValueError(f"HeteroSpec: argument 'cpu_gemm' expected 'auto', True or False, got {setting!r}")
    if setting is False:
        return False
    p = next(module.parameters(), None)
    fits = p is not None and p.device.type == "cpu" and p.dtype in PACKED_DTYPES
    if fits and p.dtype == torch.bfloat16:   # oneDNN refuses bfloat16 on CPUs without AVX-512 (or ARM's bf16)
        check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        fits = bool(check()) if check is not None else False
    if setting is True and not (fits and available()):
        why = ("this torch build has no oneDNN packed linear" if not available() else
               f"it needs a CPU model in float32, or in bfloat16 on a CPU that oneDNN runs bfloat16 on, got "
               f"{getattr(p, 'device', None)} {getattr(p, 'dtype', None)}")
        raise ValueError(f"HeteroSpec: argument 'cpu_gemm' expected 'auto' or False here ({why}), got True")
    return fits and available()


# nn.Linear -> ((weight data_ptr, weight version), packed weight): one packed copy per layer, however many engines
# route through it; repacked when the weight was written since
_CACHE = weakref.WeakKeyDictionary()


def _packed(lin, rows):
    w = lin.weight
    key = (w.data_ptr(), w._version)
    hit = _CACHE.get(lin)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows))
        _CACHE[lin] = hit
    return hit[1]


def _packed_forward(lin, packed):
    bias = None if lin.bias is None else lin.bias.detach()

    def forward(x):
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias, "none", [], "")
        return y.view(*shape[:-1], y.shape[-1])
    return forward


def _linears(modules):
    for m in modules:
        for lin in m.modules():
            w = getattr(lin, "weight", None)
            if isinstance(lin, torch.nn.Linear) and w is not None and w.device.type == "cpu" \
                    and w.dtype in PACKED_DTYPES:
                yield lin


class PackedLinears:
    """A context manager: inside it, every ``nn.Linear`` of ``modules`` with a float32 / bfloat16 CPU weight runs
    through its oneDNN-packed copy (inference only: no gradient flows through it); on exit the layers are
    ``nn.Linear`` again, so other code that shares the model (HuggingFace's ``generate`` in the same process)
    never sees the packed path.  The packed copies are made once per layer (:meth:`prepare`, or the first
    entry) and kept while the layer lives.  ``rows``: the typical rows per call (a layout hint; any count
    works).  Re-entrant: a layer already routed is left to the outer context."""

    def __init__(self, modules, rows=4):
        self._modules = [m for m in modules if m is not None]
        self._rows = rows
        self._patched = []

    def prepare(self):
        """Pack every layer now (outside any timed region); returns the number of layers."""
        return sum(1 for lin in _linears(self._modules) if _packed(lin, self._rows) is not None)

    def __enter__(self):
        for lin in _linears(self._modules):
            if "forward" not in vars(lin):
                lin.forward = _packed_forward(lin, _packed(lin, self._rows))
                self._patched.append(lin)
        return self

    def __exit__(self, *exc):
        for lin in self._patched:
            if "forward" in vars(lin):
                del lin.forward
        self._patched = []


def for_models(setting, target, *others):
    """The packed layers of ``target`` and ``others`` (None skipped) for a ``cpu_gemm`` setting (:func:`wanted`
    decides from the target), packed now: the one way the engine and the cost profile set it up."""
    packed = PackedLinears([target, *others] if wanted(setting, target) else [])
    packed.prepare()
    return packed

