"""Brute-force expectations of the op tests (tests/ops/test_<family>.py: the cases against independent
expectations, for both implementations through the fixture ``impl``): sizes, tolerances and the entropy, expand
and tree oracles."""

import numpy as np
import scipy.special
import scipy.stats
import torch
from _oracles import (
    random_tree,
)
from conftest import to_numpy

SIZES = (1, 7, 111, 32000, 49152, 128256)

TOL = dict(rtol=1e-6, atol=1e-6)


def rows_for(v):
    return 3 if v <= 1000 else 2


def entropy_oracle(row, k, temperature=1.0):
    """scipy on the k largest values (sorted), float64."""
    top = np.sort(np.asarray(row, np.float32).astype(np.float64))[::-1][:k]
    return scipy.stats.entropy(scipy.special.softmax(top / temperature))


def k_values(v):
    return sorted({1, max(1, v // 3), v})


def expand_oracle(x, beam_scores, beam_nodes, k, d2t=None, node_offset=0):
    x64 = np.asarray(x, np.float32).astype(np.float64)
    b, v = x64.shape
    toks, scs, pars, ents = [], [], [], []
    for r in range(b):
        lp = scipy.special.log_softmax(x64[r])
        ids = np.lexsort((np.arange(v), -x64[r]))[:k]  # by value descending, then id ascending
        toks += [int(i) + (int(d2t[i]) if d2t is not None else 0) for i in ids]
        scs += [float(beam_scores[r]) + lp[i] for i in ids]
        pars += [int(beam_nodes[r])] * k
        ents.append(entropy_oracle(x64[r], k))
    return np.array(toks, np.int64), np.array(scs), np.array(pars, np.int64), np.array(ents)


def next_beams_oracle(scores32, k, node_offset):
    order = sorted(range(len(scores32)), key=lambda i: (-float(scores32[i]), i))[:k]
    return np.array([node_offset + i for i in order], np.int64)


def check_expand(impl, x, bs, bn, k, d2t=None, node_offset=0):
    kwargs = {} if d2t is None else {"d2t": d2t}
    out = impl.expand(x, bs, bn, k, node_offset=node_offset, **kwargs)
    tokens, scores, parents, entropy, next_beams = map(to_numpy, out)
    b = x.shape[0]
    assert tokens.dtype == np.int64 and tokens.shape == (b * k,)
    assert scores.dtype == np.float32 and scores.shape == (b * k,)
    assert parents.dtype == np.int64 and parents.shape == (b * k,)
    assert entropy.dtype == np.float32 and entropy.shape == (b,)
    assert next_beams.dtype == np.int64 and next_beams.shape == (k,)
    w_tok, w_sc, w_par, w_ent = expand_oracle(x, bs, bn, k, d2t, node_offset)
    np.testing.assert_array_equal(tokens, w_tok)
    np.testing.assert_allclose(scores, w_sc, **TOL)
    np.testing.assert_array_equal(parents, w_par)
    np.testing.assert_allclose(entropy, w_ent, **TOL)
    np.testing.assert_array_equal(next_beams, next_beams_oracle(scores, k, node_offset))
    return tokens, scores, parents, entropy, next_beams


def select_oracle(scores, n):
    return sorted(sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:n])


def check_tree(tree, want):
    assert tuple(tree._fields) == ("tokens", "parents", "depths", "mask", "retrieve")
    for name in ("tokens", "parents", "depths", "retrieve"):
        got = to_numpy(getattr(tree, name))
        assert got.dtype == np.int64, name
        np.testing.assert_array_equal(got, want[name], err_msg=name)
    mask = to_numpy(tree.mask)
    assert mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, want["mask"])


# (temperature, top_k, top_p, min_p)
SAMPLE_SETTINGS = [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 3, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.8, 4, 0.9, 0.0),
                   (2.0, 100, 0.5, 0.0), (1.0, 0, 1.0, 0.2), (1.5, 0, 0.9, 0.1), (0.8, 4, 1.0, 0.5), (1.0, 0, 1.0, 1.0)]

TENSOR_KINDS = ["numpy[1]", "numpy[]", "torch[1]", "torch[]"]


def as_tensor(kind, value):
    """value (an int in [0, 2^64)) as a 1-element int64 tensor of `kind` holding its bits."""
    bits = int(np.array(value, np.uint64).view(np.int64))
    a = np.array([bits] if kind.endswith("[1]") else bits, np.int64)
    return torch.from_numpy(a) if kind.startswith("torch") else a


def tensor_value(t):
    """The uint64 value held by a 1-element int64 tensor."""
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return int(a.reshape(-1).view(np.uint64)[0])


def sample_case(rng):
    n, v = int(rng.integers(1, 12)), int(rng.choice([1, 5, 37]))
    x = (rng.normal(size=(n, v)) * 1.5).astype(np.float32)
    tokens, parents, _ = random_tree(rng, n, v, p_greedy=0.6, logits=x)
    return tokens, parents, x


def same_sample(a, b):
    assert len(a) == len(b)
    assert to_numpy(a[0]).tolist() == to_numpy(b[0]).tolist()
    for p, q in zip(a[1:], b[1:]):
        assert int(p) == int(q)


SEEDS_OFFSETS = [(0, 0), (5, 123), (2**63 + 11, 2**64 - 3), (2**64 - 1, 2**63 - 1), (0xDEADBEEFCAFEF00D, 2**63)]


class FakeCudaInt64:
    """A 1-element int64 DLPack export that claims to live on cuda:0 (its memory is host memory, and must never
    be read)."""

    def __init__(self):
        import ctypes

        from _dlpack import (
            _DELETER,
            _NAME,
            _Device,
            _DType,
            _ManagedVersioned,
            _PyCapsule_New,
            _Version,
        )

        self._ctypes, self._name, self._new = ctypes, _NAME, _PyCapsule_New
        self.arr = np.zeros(1, np.int64)
        self.shape = (ctypes.c_int64 * 1)(1)
        self._deleter = _DELETER(lambda _p: None)
        self.m = _ManagedVersioned()
        self.m.version = _Version(1, 0)
        self.m.deleter = self._deleter
        t = self.m.dl_tensor
        t.data = self.arr.ctypes.data
        t.device = _Device(2, 0)
        t.ndim = 1
        t.dtype = _DType(0, 64, 1)
        t.shape = self.shape

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        return self._new(self._ctypes.addressof(self.m), self._name.value, None)


def _read_only(a):
    a = np.array(a, np.int64)
    a.flags.writeable = False
    return a


BAD_SEED_OFFSET = [
    ("float-offset", TypeError, "offset", dict(offset=np.array([1.0]))),
    ("float-seed-torch", TypeError, "seed", dict(seed=torch.zeros(1))),
    ("int32-offset", TypeError, "offset", dict(offset=np.array([3], np.int32))),
    ("uint64-seed", TypeError, "seed", dict(seed=np.array([3], np.uint64))),
    ("two-elements", ValueError, "offset", dict(offset=np.array([1, 2], np.int64))),
    ("two-elements-torch-seed", ValueError, "seed", dict(seed=torch.zeros(2, dtype=torch.int64))),
    ("no-element", ValueError, "offset", dict(offset=np.zeros(0, np.int64))),
    ("advance-int", ValueError, "advance_offset", dict(offset=3, advance_offset=True)),
    ("advance-np-scalar", ValueError, "advance_offset", dict(offset=np.int64(3), advance_offset=True)),
    ("advance-read-only", ValueError, "offset", dict(offset=_read_only([3]), advance_offset=True)),
    ("other-device", ValueError, "offset", dict(offset="cuda")),
    ("other-device-seed", ValueError, "seed", dict(seed="cuda")),
]


def _kv_case(rng, plen, slots, extra=3):
    last = int(np.asarray(slots)[-1]) if len(slots) else 0
    return [
        rng.normal(size=(2, 3, plen + last + 1 + extra, 5)).astype(np.float32),
        rng.integers(-100, 100, size=(plen + last + 2, 3)).astype(np.int8),
    ]
