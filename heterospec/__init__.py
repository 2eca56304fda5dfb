"""heterospec: lossless speculative decoding (EAGLE-3 drafts, HeteroSpec entropy-adaptive trees) on a C core.

Decoding:
    target, tokenizer, draft = heterospec.default_pair()     # SmolLM2-135M-Instruct + the shipped EAGLE-3 head
    policy = heterospec.default_policy("cpu")                # HeteroSpec: the profile calibrated for this device
    with heterospec.HeteroSpec(target, draft, policy) as hs:
        sequences, stats = hs.generate(input_ids, max_new_tokens=128)   # the target's own output, faster

* :class:`HeteroSpec` (the engine), :func:`custom_generate` (``model.generate(custom_generate=...)``);
* :class:`Policy`: ``Policy.static(...)`` (EAGLE-3), ``Policy.paper(...)``, ``Policy.from_profile(path)`` (a
  calibrated profile, ``heterospec calibrate``), ``Policy.autoregressive()``;
* :class:`Eagle3Draft` (EAGLE-3 heads in the SafeAILab, SpecForge, vLLM and speculators layouts);
* :func:`default_pair`, :func:`default_policy`: the embedded default pair and its shipped profiles;
  :func:`shipped_profile` (which file, and why), :func:`load_profile` (a profile's policy, cost model and fields);
* :func:`compare`: methods side by side on the same prompts through one loop, their turns interleaved (a
  ``Comparison``: ``.mismatches()``, ``.table()``, shown as that table in Jupyter); a method is a
  :class:`Policy` or an :class:`HFMethod` (the model's own ``generate``: ``HFMethod("hf")``, or with
  ``cache_implementation="static"`` or ``prompt_lookup_num_tokens=10``); :func:`demo_prompts`, the demo's
  prompts (none from a benchmark);
* :mod:`heterospec.tune.trace` (for ablations: record a trace once, replay any policy exactly, no model run);
* :mod:`heterospec.ops` (the C core's tree operations) and :mod:`heterospec.reference` (their pure NumPy twin,
  identical semantics; docs/ops.md defines them).
"""
from ._types import VerifyTree

__version__ = "0.1.0"

_LAZY = {  # the torch/transformers side loads on first use, so `import heterospec` needs only NumPy
    "HeteroSpec": ("engine", "HeteroSpec"),
    "GenerationStats": ("engine", "GenerationStats"),
    "custom_generate": ("engine", "custom_generate"),
    "NonFiniteLogitsError": ("engine", "NonFiniteLogitsError"),
    "Policy": ("policy", "Policy"),
    "Eagle3Draft": ("models.draft", "Eagle3Draft"),
    "Eagle3Config": ("models.draft", "Eagle3Config"),
    "default_pair": ("models.default", "default_pair"),
    "default_policy": ("policy.profile", "default_policy"),
    "shipped_profile": ("policy.profile", "shipped_profile"),
    "load_profile": ("policy.profile", "load_profile"),
    "compare": ("tools.demo", "compare"),
    "HFMethod": ("tools.bench.methods", "HFMethod"),
    "demo_prompts": ("tools.demo", "demo_prompts"),
}


_SUBMODULES = ("ops", "reference")  # `import heterospec; heterospec.ops.select(...)` works without importing them


def __getattr__(name):
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'heterospec' has no attribute {name!r}")


def build_info():
    """What the C core was compiled with: ``{"cuda": bool, "version": str, "compiler": str, ...}``."""
    from ._native import _C

    info = dict(_C.build_info())
    info["package_version"] = __version__
    info["cuda_status"] = _cuda_status(info)
    info["cpu_kernels"] = _cpu_kernels()
    return info


def _cpu_kernels():
    """One sentence on heterospec._gemm (the few-rows kernel of ``cpu_gemm='rows'`` and the float32 CPU forwards of
    ``cpu_decoder``): built or not, the instruction set it runs here, its threads."""
    try:
        from . import _gemm
    except ImportError:
        return ("not built (setup.py builds heterospec._gemm where the C compiler has OpenMP): cpu_gemm has oneDNN and "
                "torch's paths, cpu_decoder is off")
    isa = ("the portable loop (no AVX2 with FMA and F16C here; cpu_decoder='auto' stays off)", "AVX2",
           "AVX-512")[_gemm.isa_best()]
    threads = f"OpenMP, {_gemm.threads()} threads" if _gemm.openmp() else "no OpenMP (1 thread)"
    return f"heterospec._gemm built: {isa}, {threads}"


def _cuda_status(info):
    """One sentence on the CUDA path: compiled or not, and whether a GPU is usable here (a CUDA build on a
    machine without a GPU or driver is a normal state, not a broken install)."""
    if not info.get("cuda"):
        return "compiled without CUDA (CPU ops only; rebuild with nvcc on PATH, or HETEROSPEC_CUDA=1, for GPU ops)"
    if info.get("cuda_emulated"):
        return "CUDA kernels compiled in host emulation (HETEROSPEC_CUDA=emu: a test build, CPU speed)"
    n = int(info.get("cuda_devices") or 0)
    archs = info.get("cuda_archs") or "?"
    if n > 0:
        return f"compiled with CUDA ({archs}); {n} GPU{'s' if n != 1 else ''} usable here"
    why = info.get("cuda_unavailable_reason") or "no CUDA device"
    return f"compiled with CUDA ({archs}); no GPU usable here ({why}): the CPU ops work, GPU ops need a GPU machine"


__all__ = ["VerifyTree", "build_info", "__version__", *_LAZY, *_SUBMODULES]
