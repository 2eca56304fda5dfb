"""Shared fixtures: every op test runs against both implementations.

``impl`` is parametrised with ids ``c`` (``heterospec.ops``, the C core) and ``ref``
(``heterospec.reference``, the NumPy executable specification).  The C module is imported inside the
fixture and NOT through ``pytest.importorskip``: when it is missing or broken the ``[c]`` tests error out
instead of being skipped silently.  Select one implementation with ``-k ref`` or ``-k "not ref"``
(``-k c`` is a substring match and selects nearly everything).  No test name may contain "ref".
"""
import importlib
import os
import sys

import numpy as np
import pytest

# pytest-xdist workers share the machine's cores: each worker's torch (and the CLI subprocesses it starts) gets
# its share of them instead of one intra-op thread per core each, which oversubscribes the cores and slows every
# worker down. Set before any test imports torch; an OMP_NUM_THREADS given by the caller wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

# the repository's root, where benchmarks/ sits beside tests/ (a checkout, not CI's copies of tests/ beside an
# installed wheel): the tests of the benchmark scripts import them as `benchmarks.*`, whichever xdist worker runs
# them and whatever ran before
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(ROOT, "benchmarks")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)

IMPLS = {"c": "heterospec.ops", "ref": "heterospec.reference"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "statistical: large Monte-Carlo tests (10^5 verify_sample calls); they run by default, "
        "deselect with -m 'not statistical' for a quick run",
    )
    config.addinivalue_line(
        "markers",
        "device: the op tests on a device (tests/ops: a real GPU, or the emulated build); .ci/gpu's kernel phases "
        "select them with -m device",
    )


@pytest.fixture(scope="session", params=list(IMPLS), ids=list(IMPLS))
def impl(request):
    # session scope: usable from hypothesis @given tests without the function-scoped-fixture health check
    return importlib.import_module(IMPLS[request.param])


@pytest.fixture(scope="session")
def c_ops():
    """The C implementation (import failure = test error, never a skip)."""
    return importlib.import_module(IMPLS["c"])


@pytest.fixture(scope="session")
def ref_ops():
    return importlib.import_module(IMPLS["ref"])


def to_numpy(x):
    """Outputs of the C ops follow the library of the inputs; compare everything as NumPy."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    return np.asarray(x)
