"""Build of heterospec's C core (heterospec._C).

The CPU core and the CPython binding are plain C11, compiled with setuptools against the NumPy 2 headers
(see pyproject.toml).  CUDA sources under csrc/cuda/ are compiled only when `nvcc` is found (the next step
of the roadmap); the build never needs a GPU.

Environment switches:
  HETEROSPEC_SANITIZE=1   build with AddressSanitizer + UndefinedBehaviorSanitizer (CI runs the op tests
                          on such a build; run them with LD_PRELOAD=$(gcc -print-file-name=libasan.so))
  HETEROSPEC_WERROR=1     turn compiler warnings into errors
"""
import glob
import os
import shutil

import numpy
from setuptools import Extension, setup

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
if os.environ.get("HETEROSPEC_SANITIZE") == "1":
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]
    compile_args = [a for a in compile_args if a != "-O3"] + ["-O1"] + san
    link_args += san
    macros.append(("HS_SANITIZE", "1"))

cuda_sources = sources("csrc/cuda/*.cu")
nvcc = shutil.which("nvcc") or (
    os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None
)
if cuda_sources and nvcc:  # pragma: no cover - no CUDA sources yet (next issue)
    raise NotImplementedError("CUDA sources are present but the CUDA build step is not written yet")

ext = Extension(
    "heterospec._C",
    sources=sources("csrc/core/*.c") + sources("csrc/py/*.c"),
    include_dirs=[os.path.join("csrc", "include"), numpy.get_include()],
    define_macros=macros,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(ext_modules=[ext])
