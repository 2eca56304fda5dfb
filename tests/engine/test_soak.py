"""Long and repeated runs (issue 31, item 3), CI-sized on a tiny model: memory flat after warm-up, the static
caches never beyond their declared size, and every output equal to a fresh engine's.  The default pair's figures
(4,096 tokens, 200 calls, the plot) come from benchmarks/soak.py and are in benchmarks/RESULTS.md."""
import gc
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _models import THRESHOLDS, eagle3_head, prompts, tiny_target  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.engine.cycle import MAX_GRAPH_SETS  # noqa: E402

LONG = 1024
CALLS = 100


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tiny_target("llama", layers=8)
    model.config.max_position_embeddings = 4 * LONG
    return model, eagle3_head(model, tmp_path_factory.mktemp("head"))


def policy():
    return Policy.paper(3, 3, 12, thresholds=THRESHOLDS)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set size from /proc")
def test_repeated_calls_keep_memory_and_caches_flat_and_outputs_exact(pair, graphs=False):
    model, head = pair
    ps = prompts(10)
    with HeteroSpec(model, head, policy()) as fresh:
        want = [fresh.generate(p, max_new_tokens=16)[0][0].tolist() for p in ps]
    with HeteroSpec(model, head, policy(), cuda_graphs=graphs) as hs:
        for p in ps:                                   # warm-up: caches, recordings, allocator pools
            hs.generate(p, max_new_tokens=16)
        gc.collect()
        start, capacity, kv = rss_mb(), hs.target.capacity, hs.target.kv.data_ptr()
        for i in range(CALLS):
            seq, _ = hs.generate(ps[i % 10], max_new_tokens=16)
            assert seq[0].tolist() == want[i % 10], i
            assert hs.target.capacity == capacity and hs.target.kv.data_ptr() == kv, i   # never reallocated
        gc.collect()
        grown = rss_mb() - start
        assert len(hs.cycle._recorded) <= MAX_GRAPH_SETS
    assert grown < 8, f"resident memory grew {grown:.1f} MB over {CALLS} calls"


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set size from /proc")
def test_a_long_generation_keeps_memory_flat(pair):
    """RSS read every 128 tokens of one 1,024-token call: flat once the caches exist, and the output is the
    target's own greedy continuation (autoregressive decoding on a fresh engine)."""
    model, head = pair
    p = prompts(1)[0]
    samples = []

    class Every128:
        n = 0

        def put(self, t):
            self.n += int(t.numel())
            if self.n % 128 == 0:
                samples.append(rss_mb())

        def end(self):
            pass

    with HeteroSpec(model, head, policy()) as hs:
        hs.generate(p, max_new_tokens=LONG)           # warm-up at this size
        seq, stats = hs.generate(p, max_new_tokens=LONG, streamer=Every128())
        capacity = hs.target.capacity
    with HeteroSpec(model, None) as ar:
        want, _ = ar.generate(p, max_new_tokens=LONG)
    assert seq[0].tolist() == want[0].tolist()
    assert stats.new_tokens == LONG and capacity < p.shape[1] + LONG + 64   # the declared size, not more
    assert len(samples) >= 8 and max(samples) - samples[1] < 4, samples
