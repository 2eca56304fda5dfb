"""Build of heterospec's C core (heterospec._C).

The CPU core and the CPython binding are plain C11, compiled with setuptools against the NumPy 2 headers
(see pyproject.toml).  The CUDA kernels (csrc/cuda/*.cu) are compiled with `nvcc` when it is found, for
sm_80 and sm_90 plus sm_90 PTX (so newer GPUs JIT it), and linked with the static CUDA runtime, so the
wheel needs only the NVIDIA driver at run time (without one, CUDA ops report why and CPU ops still work).
The build never needs a GPU.

Environment switches:
  HETEROSPEC_CUDA=auto    (default) build the CUDA path when nvcc is found, skip it otherwise
  HETEROSPEC_CUDA=1       require it (fail without nvcc)
  HETEROSPEC_CUDA=0       never build it
  HETEROSPEC_CUDA=emu     compile the kernels as host C++ (each CUDA thread a fiber) and treat
                          DLPack "CUDA" tensors as host memory: for testing the kernels' logic on machines
                          without a GPU (the device tests of tests/ops); never for real use
  HETEROSPEC_EMU_BLOCKS=gpu with HETEROSPEC_CUDA=emu: emulate the GPU's block sizes (1024/256 threads)
                          instead of 64, so the kernels' large-block paths run too (slow)
  HETEROSPEC_CUDA_ARCHS   compute capabilities to build, default "80,90" (the last one also as PTX)
  HETEROSPEC_SANITIZE=1   build with AddressSanitizer + UndefinedBehaviorSanitizer (CI runs the op tests
                          on such a build; run them with LD_PRELOAD=$(gcc -print-file-name=libasan.so))
  HETEROSPEC_SANITIZE=fuzz the same, plus libFuzzer's coverage instrumentation (-fsanitize=fuzzer-no-link),
                          for tests/fuzz/fuzz_ops.py under atheris; needs clang (CC=clang-14 CXX=clang++-14,
                          Debian's clang-14) and runs with LD_PRELOAD=<atheris.path()>/asan_with_fuzzer.so
  HETEROSPEC_WERROR=1     turn compiler warnings into errors
"""
import concurrent.futures
import glob
import os
import shutil
import subprocess

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


# -fno-trapping-math / -fno-math-errno: the core never reads FP exception flags or errno, and without them
# gcc refuses to vectorise the compare-and-select loops (row max, exp-sum, top-k block skip).  Results
# stay IEEE: no -ffast-math, no reassociation.
compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-fno-trapping-math", "-fno-math-errno"]
link_args = []
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if os.environ.get("HETEROSPEC_WERROR") == "1":
    compile_args.append("-Werror")
sanitize_mode = os.environ.get("HETEROSPEC_SANITIZE", "0").strip().lower()
if sanitize_mode not in ("0", "", "1", "fuzz"):
    raise SystemExit(f"HETEROSPEC_SANITIZE: expected 0, 1 or fuzz, got {sanitize_mode!r}")
sanitize = sanitize_mode in ("1", "fuzz")
san = []
if sanitize:
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]
    if sanitize_mode == "fuzz":
        for var in ("CC", "CXX"):
            if "clang" not in os.path.basename(os.environ.get(var, "")):
                raise SystemExit(f"HETEROSPEC_SANITIZE=fuzz: environment variable {var} expected a clang compiler "
                                 f"(e.g. {'clang-14' if var == 'CC' else 'clang++-14'}), got {os.environ.get(var)!r}")
        # (vptr, function: C++-only checks whose handlers atheris's runtime lacks; the kernels call no function
        # pointers and have no virtual classes)
        san += ["-fsanitize=fuzzer-no-link", "-fno-sanitize=vptr,function"]
    compile_args = [a for a in compile_args if a != "-O3"] + ["-O1"] + san
    link_args += san
    macros.append(("HS_SANITIZE", "1"))

cuda_sources = sources("csrc/cuda/*.cu")
cuda_mode = os.environ.get("HETEROSPEC_CUDA", "auto").strip().lower()
if cuda_mode not in ("auto", "1", "0", "emu"):
    raise SystemExit(f"HETEROSPEC_CUDA: expected auto, 1, 0 or emu, got {cuda_mode!r}")


def find_nvcc():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_home(nvcc):
    """The toolkit root holding lib64/libcudart_static.a (nvcc may be a wrapper script elsewhere)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    try:  # ask nvcc itself: `nvcc --dryrun` prints its TOP directory
        out = subprocess.run([nvcc, "--dryrun", "--version"], capture_output=True, text=True).stderr
        candidates += [line.split("=", 1)[1].strip() for line in out.splitlines() if "TOP=" in line]
    except OSError:
        pass
    for home in candidates:
        for lib in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            if home and os.path.exists(os.path.join(home, lib, "libcudart_static.a")):
                return home, os.path.join(home, lib)
    raise SystemExit(f"nvcc found at {nvcc}, but not libcudart_static.a (set CUDA_HOME to the toolkit root)")


nvcc = find_nvcc() if cuda_mode in ("auto", "1") and cuda_sources else None
if cuda_mode == "1" and nvcc is None:
    raise SystemExit("HETEROSPEC_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
archs = [a.strip() for a in os.environ.get("HETEROSPEC_CUDA_ARCHS", "80,90").split(",") if a.strip()]
arch_names = [f"sm_{a}" for a in archs] + [f"compute_{archs[-1]}"]


def _compile(cmd):
    print(" ".join(cmd), flush=True)
    subprocess.check_call(cmd)


class BuildExt(build_ext):
    """Compiles csrc/cuda/*.cu first (nvcc, or g++ for the emulation) and links the objects in."""

    def build_extension(self, ext):
        if ext.name == "heterospec._C" and (nvcc or cuda_mode == "emu"):
            objects, commands = [], []
            tmp = os.path.join(self.build_temp, "cuda")
            os.makedirs(tmp, exist_ok=True)
            for src in cuda_sources:
                obj = os.path.join(tmp, os.path.basename(src) + (".emu.o" if cuda_mode == "emu" else ".o"))
                if nvcc:
                    # -fmad=false: the float64 exp and Philox in csrc/core/hd_math.h must round exactly as the
                    # CPU core does (gcc -std=c11 does not contract either), or CPU and GPU sampling could part
                    cmd = [nvcc, "-std=c++17", "-O3", "-fmad=false", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                           "-I", os.path.join(HERE, "csrc", "include"), f'-DHS_CUDA_ARCHS="{",".join(arch_names)}"']
                    for a in archs:
                        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
                    cmd += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
                else:
                    cmd = [os.environ.get("CXX", "g++"), "-std=c++20", "-x", "c++", "-DHS_CUDA_EMU", "-fPIC",
                           "-fvisibility=hidden", "-Wall", "-Wextra", "-I", os.path.join(HERE, "csrc", "include")]
                    cmd += ["-O1", "-g"] + (san if sanitize else [])
                    if os.environ.get("HETEROSPEC_EMU_BLOCKS") == "gpu":  # the GPU's block sizes (slow)
                        cmd += ["-DHS_EMU_ROW_THREADS=1024", "-DHS_EMU_TREE_THREADS=256"]
                    if os.environ.get("HETEROSPEC_WERROR") == "1":
                        cmd.append("-Werror")
                cmd += ["-c", os.path.join(HERE, src), "-o", obj]
                commands.append(cmd)
                objects.append(obj)
            # one compiler per core: nvcc's two architectures per file made this the build's slowest part
            with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                list(pool.map(_compile, commands))   # list(): a failed compile raises here
            ext.extra_objects = list(ext.extra_objects or []) + objects
            if nvcc:
                _, libdir = cuda_home(nvcc)
                ext.extra_link_args = list(ext.extra_link_args or []) + [
                    os.path.join(libdir, "libcudart_static.a"), "-lrt", "-ldl", "-lpthread", "-lstdc++"]
            else:
                ext.extra_link_args = list(ext.extra_link_args or []) + ["-lstdc++", "-pthread"]
            ext.define_macros = list(ext.define_macros or []) + [("HS_WITH_CUDA", "1")]
        super().build_extension(ext)


ext = Extension(
    "heterospec._C",
    sources=sources("csrc/core/*.c") + sources("csrc/py/*.c"),
    include_dirs=[os.path.join("csrc", "include"), numpy.get_include()],
    define_macros=macros,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    depends=sources("csrc/cuda/*.cu") + sources("csrc/cuda/*.cuh") + sources("csrc/core/*.h")
    + sources("csrc/py/*.h") + sources("csrc/include/hs/*.h"),
)

# The few-rows float32 matrix kernel of heterospec.models.cpu_gemm, with OpenMP (csrc/gemm/module.c says why it is
# a module of its own).  Optional: where it does not build (a compiler without OpenMP), cpu_gemm goes without it.
gemm_ext = Extension(
    "heterospec._gemm",
    sources=sources("csrc/gemm/*.c"),
    extra_compile_args=compile_args + ["-fopenmp"],
    extra_link_args=link_args + ["-fopenmp"],
    depends=sources("csrc/gemm/*.h"),
    optional=True,
)

setup(ext_modules=[ext, gemm_ext], cmdclass={"build_ext": BuildExt})
