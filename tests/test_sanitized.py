"""Guard of the sanitizer run in .ci/run: the tests there must exercise the ASan/UBSan build, not a
normal one that happens to be importable."""
import os

import pytest

import heterospec


@pytest.mark.skipif(os.environ.get("HETEROSPEC_EXPECT_SANITIZERS") != "1", reason="only in the sanitizer run")
def test_sanitizer_build_is_the_one_loaded():
    assert heterospec.build_info()["sanitizers"] is True
