"""Guard of the sanitizer run in .ci/run: the tests there must exercise the ASan/UBSan build, not a
normal one that happens to be importable."""
import os

import pytest

import heterospec


@pytest.mark.skipif(os.environ.get("HETEROSPEC_EXPECT_SANITIZERS") != "1", reason="only in the sanitizer run")
def test_sanitizer_build_is_the_one_loaded():
    assert heterospec.build_info()["sanitizers"] is True


@pytest.mark.skipif(os.environ.get("HETEROSPEC_EXPECT_CUDA_EMU") != "1", reason="only in the sanitizer run")
def test_cuda_kernels_run_emulated_here():
    # CI stage 2 builds the kernels in their host emulation, so the device tests of tests/ops must run, not skip
    import heterospec

    info = heterospec.build_info()
    assert info["cuda"] and info["cuda_emulated"], info
