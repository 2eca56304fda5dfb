"""heterospec.growth: the one tree grower and path entropy.  The same growth on NumPy arrays and on torch
tensors gives the same candidates and path entropy, and the path entropy equals a brute-force walk up P*
that sums the reference top-K entropy of each distribution that produced a token of the path."""
import numpy as np
import pytest

from heterospec import reference
from heterospec.growth import Growth, candidate_count

K, V, LEVELS = 4, 50, 3


def _logits(rng, rows):
    x = rng.normal(0.0, 1.0, (rows, V)).astype(np.float32)
    x[np.arange(rows), rng.integers(0, V, rows)] += 4.0
    return x


def _grow(level_logits, wrap):
    g = Growth.root(wrap(level_logits[0]), K)
    for lg in level_logits[1:]:
        g = g.extend(wrap(lg))
    return g


@pytest.fixture
def level_logits():
    rng = np.random.default_rng(7)
    return [_logits(rng, 1)] + [_logits(rng, K) for _ in range(LEVELS)]


def test_path_entropy_is_the_sum_along_the_best_path(level_logits):
    g = _grow(level_logits, lambda x: x)
    tokens, scores, parents = g.candidates()
    assert tokens.shape == (candidate_count(K, LEVELS),) and g.level == LEVELS
    # walk up from the best candidate of the last level; a level-l candidate c (l >= 1) was produced by row
    # (c - offset_l) // K of that level's logits, a root child by the root's logits
    offsets = [0] + [K + K * K * (lev - 1) for lev in range(1, LEVELS + 1)]
    c, level, h = int(g.beams[0]), LEVELS, 0.0
    assert scores[c] == scores[offsets[LEVELS]:].max()
    while level >= 1:
        row = (c - offsets[level]) // K
        h += float(reference.topk_entropy(level_logits[level][row:row + 1], K)[0])
        c, level = int(parents[c]), level - 1
    assert parents[c] == -1 and c < K
    h += float(reference.topk_entropy(level_logits[0], K)[0])
    assert float(g.path_entropy()[0]) == pytest.approx(h, rel=1e-6)


def test_numpy_and_torch_grow_the_same_tree(level_logits):
    torch = pytest.importorskip("torch")
    a = _grow(level_logits, lambda x: x)
    b = _grow(level_logits, torch.from_numpy)
    for x, y in zip(a.candidates(), b.candidates()):
        np.testing.assert_array_equal(x, y.numpy())
    np.testing.assert_array_equal(a.cum_h, b.cum_h.numpy())
    assert float(a.path_entropy()[0]) == float(b.path_entropy()[0])
    assert b.path_entropy().dtype == torch.float64 and b.path_entropy().shape == (1,)


def test_growing_in_steps_is_growing_at_once(level_logits):
    g = _grow(level_logits, lambda x: x)
    part = _grow(level_logits[:2], lambda x: x)
    for lg in level_logits[2:]:
        part = part.extend(lg)
    assert (part.level, part.offset, part.prev_offset) == (g.level, g.offset, g.prev_offset)
    for x, y in zip(part.candidates(), g.candidates()):
        np.testing.assert_array_equal(x, y)
