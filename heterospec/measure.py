"""How heterospec measures: the one timer and the one description of the machine a number was taken on.

* :func:`synchronize` waits for the work queued on a device; :class:`DeviceTimer` times a piece of work
  synchronised at both ends (what calibration and the benchmarks time);
* :class:`PhaseClock` splits a decoding call into phases without adding host syncs (what the engine
  reports): CUDA events on a GPU, ``perf_counter`` stamps elsewhere, read after the cycle's own sync;
* :func:`machine_info` is what every result file says about the machine (processor, cores, versions), and
  :func:`available_bytes` the memory a new allocation can take there.

Torch is imported lazily, so importing this module needs only the standard library.
"""
from __future__ import annotations

import os
import platform
import time


def synchronize(device):
    """Wait until the work queued on ``device`` has finished: ``torch.cuda.synchronize`` on CUDA,
    ``torch.accelerator.synchronize`` on other accelerators (torch >= 2.6; else the backend module's own
    ``synchronize`` when it has one), nothing on the CPU (whose ops run synchronously) or meta.
    ``device``: a ``torch.device``, a string such as ``"cuda:1"``, or anything with a ``.type``."""
    import torch

    kind = getattr(device, "type", None)
    if kind is None:
        device = torch.device(device)
        kind = device.type
    if kind in ("cpu", "meta"):
        return
    if kind == "cuda":
        torch.cuda.synchronize(device)
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)
        return
    backend = getattr(torch, kind, None)
    if backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize()


class DeviceTimer:
    """Wall-clock seconds of work on ``device``, synchronised at both ends so that a GPU is timed doing
    the work and not only queueing it: the device is synchronised before the start is read (so earlier
    queued work is not counted) and before the stop is read (so the timed work has finished).

    ``with timer: ...`` then ``timer.seconds``, or ``result, seconds = timer(fn, *args, **kwargs)``."""

    def __init__(self, device):
        self.device = device
        self.seconds = None
        self._t0 = None

    def __enter__(self):
        synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            synchronize(self.device)
            self.seconds = time.perf_counter() - self._t0
        return False

    def __call__(self, fn, *args, **kwargs):
        with self:
            result = fn(*args, **kwargs)
        return result, self.seconds

    def median(self, fn, reps):
        """The median of ``reps`` timed calls of ``fn`` after one untimed warm-up call."""
        fn()
        times = sorted(self(fn)[1] for _ in range(reps))
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])


def device_timer(device):
    """A :class:`DeviceTimer` for ``device`` (a torch device, a string, or a module's ``.device``)."""
    return DeviceTimer(device)


class PhaseClock:
    """Accumulates the time between consecutive :meth:`lap` calls into fields of ``stats`` (any object
    with float attributes) without a host sync: on a CUDA device each stamp is an event recorded on the
    stream and the laps are read by :meth:`flush`, which the caller runs after a sync of its own."""

    def __init__(self, device, stats):
        self.cuda = getattr(device, "type", None) == "cuda"
        self.stats = stats
        self.pending = []
        self.last = None

    def _now(self):
        if self.cuda:
            import torch

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


def cache_path(*parts):
    """A path in heterospec's cache (``$HETEROSPEC_CACHE``, default ``~/.cache/heterospec``): the converted
    default model, the measured CPU matrix paths."""
    root = os.environ.get("HETEROSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "heterospec")
    return os.path.join(root, *parts)


# /proc/cpuinfo flags -> the word for the widest matrix or vector unit among them, widest first: what decides
# which CPU matrix path wins (cpu_gemm) and how bfloat16 rounds (an AMX Xeon and an AVX-512 one share a model name)
CPU_ISA = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"),
           ("sve", "SVE"), ("asimd", "NEON"))


def cpu_isa(flags):
    """The :data:`CPU_ISA` word for a CPU's flags (the words of /proc/cpuinfo's ``flags`` or ``Features``
    line), or ``""`` when none is among them."""
    have = set(flags)
    return next((word for flag, word in CPU_ISA if flag in have), "")


def machine_info(device="cpu"):
    """The machine and software a measurement was taken with: platform, processor, CPU model and its widest unit
    (:func:`cpu_isa`), cores,
    torch threads, the versions of Python, NumPy, torch, transformers and heterospec (with what its C core
    was compiled with), the GPU on a CUDA ``device``; ``summary`` is the one line to print next to a number."""
    import numpy
    import torch

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "torch_threads": torch.get_num_threads()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
        info["cpu_isa"] = cpu_isa(next((ln.split(":", 1)[1].split() for ln in lines
                                        if ln.startswith(("flags", "Features"))), []))
    except OSError:
        pass
    from . import __version__, build_info

    info["heterospec"] = __version__
    info["build"] = build_info()
    if str(device).startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    cpu = info.get("cpu_model") or info["processor"]
    info["cpu"] = f"{cpu} ({info['cpu_isa']})" if info.get("cpu_isa") else cpu   # the CPU as every line names it
    info["summary"] = (f"{info.get('gpu') or info['cpu']}, {info['cpus']} cores, "
                       f"Python {info['python']}, torch {info['torch']}, transformers {info.get('transformers', '?')}")
    return info


def load_warning(load=None, cores=None):
    """One line when the machine's load (the 1-minute average: other processes included) exceeds its cores, so
    that timings taken meanwhile mean little; None otherwise or where the load cannot be read."""
    try:
        load = os.getloadavg()[0] if load is None else load
    except (AttributeError, OSError):
        return None
    cores = cores or os.cpu_count() or 1
    if load <= cores:
        return None
    return (f"warning: the machine's load ({load:.1f}) exceeded its {cores} cores during this run, so these timings "
            "are unreliable (torch's threads compete with the other work); run again when it is idle, or with fewer "
            "intra-op threads (OMP_NUM_THREADS) when cores are shared")


def available_bytes(device):
    """Memory a new allocation can take on ``device``: free GPU memory, or the host's MemAvailable; None when
    it cannot be told."""
    if getattr(device, "type", device) == "cuda":   # free memory, and what torch's caching allocator holds unused
        import torch

        return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
