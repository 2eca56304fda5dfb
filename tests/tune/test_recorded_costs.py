"""profile_costs(graphs=True) must keep alive every tensor its recorded steps read: a CUDA graph replays the
addresses it recorded, and the caching allocator hands freed memory to the next tensor (calibrate on an H200:
`length` of an earlier _fit_levels side step reused by a later engine's buffer -> ids.scatter_ index out of
bounds in DraftState.follow).  On the CPU a fake torch.cuda.CUDAGraph keeps what a real one keeps -- weak
references to the storages the captured work read from outside itself, never the function -- and its replay
checks that they are all still alive."""
import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from _models import eagle3_head, tiny_target  # noqa: E402

from heterospec import HeteroSpec  # noqa: E402
from heterospec.engine.graphs import tensors_of  # noqa: E402
from heterospec.tune import costs  # noqa: E402


class _FakeGraph:
    def __init__(self):
        self.reads, self.stale = [], []

    def replay(self):
        self.stale.append(sum(ref.expired() for ref in self.reads))


class _Reads(TorchDispatchMode):
    def __init__(self, graph):
        super().__init__()
        self.graph, self.created, self.seen = graph, set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        lifted = func.overloadpacket.__name__.startswith("lift_fresh")     # a Python constant, baked in
        for t in () if lifted else tensors_of([args, kwargs or {}]):
            s = t.untyped_storage()
            if s.data_ptr() and s.data_ptr() not in self.created | self.seen:
                self.seen.add(s.data_ptr())
                self.graph.reads.append(StorageWeakRef(s))
        out = func(*args, **(kwargs or {}))
        self.created.update(t.untyped_storage().data_ptr() for t in tensors_of(out))
        return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tiny_target("llama")
    return model, eagle3_head(model, tmp_path_factory.mktemp("head"))


@pytest.fixture
def fake_graphs(monkeypatch):
    graphs = []

    def new():
        graphs.append(_FakeGraph())
        return graphs[-1]

    @contextlib.contextmanager
    def capture(g, *args, **kwargs):
        with _Reads(g):
            yield g

    monkeypatch.setattr(torch.cuda, "CUDAGraph", new)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    # the engine itself stays eager: only profile_costs' own recordings are under test
    monkeypatch.setattr(costs, "_engine", lambda t, d, p, settings: HeteroSpec(t, d, p, cuda_graphs=False,
                                                                               cpu_gemm=settings[1]))
    return graphs


@pytest.mark.parametrize("part", ["verify", "levels"])
def test_recorded_costs_keep_what_their_graphs_read(pair, fake_graphs, part):
    model, draft = pair
    cpu = torch.device("cpu")
    with torch.no_grad():
        if part == "verify":
            costs._fit_verify(model, draft, (1, 4), (12, 20), 1, (True, False, "auto"), cpu)
        else:
            costs._fit_levels(model, draft, (1, 2), (1, 2), 12, 1, (True, False, "auto"), cpu)
    assert fake_graphs and all(g.stale for g in fake_graphs)            # every recording was replayed
    assert all(g.reads for g in fake_graphs)
    # before the fix: _recorded returned g.replay alone and dropped fn, whose default arguments (the tree
    # tokens / depths / mask; kept, path_tokens, length, nxt, vtaps) were freed while their graph lived on
    assert [sum(g.stale) for g in fake_graphs] == [0] * len(fake_graphs)
