"""The GPU cycle benchmark's torch baseline (benchmarks/bench_cuda_cycle.py) must be a faithful EAGLE cycle:
before timing, the benchmark checks that it builds the same tree (tokens, parents, retrieve rows) and
accepts the same length as heterospec.ops.  These tests run that cross-check on the CPU at small sizes,
and show it fires when the two disagree, so the GPU run cannot time a baseline that computes something
else."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.exists(os.path.join(ROOT, "benchmarks", "bench_cuda_cycle.py")):
    pytest.skip("benchmarks/ is not next to tests/ (installed-package run)", allow_module_level=True)
sys.path.insert(0, ROOT)
from benchmarks import bench_cuda_cycle as bench  # noqa: E402

from heterospec import ops  # noqa: E402

CPU = torch.device("cpu")


def _small(seed, **kw):
    shape = dict(Vd=400, V=2000, k=4, depth=4, n=20, layers=2, S=128, seed=seed)
    shape.update(kw)
    x = bench.make_inputs(torch, CPU, **shape)
    state = bench.make_state(torch, CPU)
    state["slots"] = torch.tensor([0, 2, 5])
    return x, state


@pytest.mark.parametrize("seed", range(4))
def test_torch_baseline_builds_the_same_tree_and_accepts_the_same(seed):
    x, state = _small(seed)
    planted = bench.plant_accepts(ops, torch, x, state, accept=3)
    assert planted >= 1
    leaves, accept = bench.cross_check(ops, torch, x, state)
    assert accept == planted
    assert 1 <= leaves <= x["n"]


def test_the_benchmark_shape_agrees_on_cpu():
    """Issue 7's shape (k=10, depth 7, n=59, Vd=32000, V=128256) with one KV layer: the same tree."""
    x = bench.make_inputs(torch, CPU, layers=1, S=600)
    state = bench.make_state(torch, CPU)
    planted = bench.plant_accepts(ops, torch, x, state)
    assert bench.cross_check(ops, torch, x, state)[1] == planted


class _Skewed:
    """heterospec.ops, except build_tree reports a different token at one node."""

    def __getattr__(self, name):
        return getattr(ops, name)

    def build_tree(self, *a, **kw):
        tree, leaves, depth = ops.build_tree(*a, **kw)
        tree.tokens[3] += 1
        return tree, leaves, depth


def test_cross_check_fires_when_the_variants_disagree():
    x, state = _small(0)
    with pytest.raises(AssertionError, match="tree tokens differ"):
        bench.cross_check(_Skewed(), torch, x, state)
