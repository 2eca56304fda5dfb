"""The agreement cases of the op tests (tests/ops/test_<family>.py): heterospec.ops (C core) against
heterospec.reference (NumPy specification) on random inputs.

Integers (ids, paths, next_token, draws, masks, bins) must agree exactly.  Floats agree to
rtol=1e-6 AND atol=1e-6: both sides round the same float64 value to float32, but the float64 sums may be
accumulated in a different order, which moves the result by a few float64 ulps and can flip the float32
rounding by one float32 ulp (relative 6e-8, covered by rtol).  Log-probabilities and entropies near 0 have
no relative scale (an entropy of 1e-9 vs 0 after cancellation in -sum p ln p), hence the absolute term.
Philox uniforms are exact (x0 * 2^-32) and compared exactly.

These tests need both modules; they fail (never skip) when heterospec.ops cannot be imported."""
import numpy as np
from _cases import TOL
from _oracles import parent_closure
from conftest import to_numpy
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

HYP = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def same(c_out, r_out, what=""):
    c, r = to_numpy(c_out), to_numpy(r_out)
    assert c.dtype == r.dtype, (what, c.dtype, r.dtype)
    assert c.shape == r.shape, (what, c.shape, r.shape)
    if np.issubdtype(c.dtype, np.floating):
        np.testing.assert_allclose(c, r, err_msg=what, **TOL)
    else:
        np.testing.assert_array_equal(c, r, err_msg=what)


def same_tree(c_tree, r_tree):
    for name in r_tree._fields:
        same(getattr(c_tree, name), getattr(r_tree, name), name)


def random_logits(rng, shape, dtype=np.float32, p_ninf=0.05, scale=2.0):
    x = rng.normal(size=shape) * scale
    if rng.random() < 0.3:
        x = np.round(x)  # ties
    x[rng.random(shape) < p_ninf] = -np.inf
    x[..., 0] = np.where(np.isinf(x).all(axis=-1), 0.0, x[..., 0])
    return x.astype(dtype)


score_elems = st.one_of(
    st.sampled_from([0.0, -1.0, 1.0, -np.inf, np.inf, 2.5]),  # ties and infinities
    st.floats(allow_nan=False, width=32),
)


@st.composite
def candidate_forests(draw):
    m = draw(st.integers(1, 40))
    parents = [-1]
    for i in range(1, m):
        parents.append(draw(st.integers(-1, i - 1)))
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=m, max_size=m))
    picks = draw(st.lists(st.integers(0, m - 1), max_size=m))
    id_dtype = draw(st.sampled_from([np.int32, np.int64]))
    parents = np.array(parents, id_dtype)
    return np.array(tokens, id_dtype), parents, parent_closure(parents, picks).astype(id_dtype), draw(
        st.integers(0, 2**40)
    )


logit_elems = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, -np.inf]), st.floats(-60, 60, allow_nan=False, width=32)
)


@st.composite
def expand_inputs(draw):
    b = draw(st.integers(1, 4))
    v = draw(st.integers(1, 16))
    x = draw(hnp.arrays(np.float32, (b, v), elements=logit_elems))
    x[:, 0] = np.where(np.isinf(x).all(axis=1), 0.0, x[:, 0])
    k = draw(st.integers(1, v))
    bs = draw(hnp.arrays(np.float32, b, elements=st.one_of(st.just(-np.inf), st.floats(-100, 0, width=32))))
    bn = draw(hnp.arrays(np.int64, b, elements=st.integers(-1, 100)))
    d2t = draw(st.one_of(st.none(), hnp.arrays(np.int64, v, elements=st.integers(0, 50))))
    off = draw(st.integers(0, 10**6))
    return x, bs, bn, k, d2t, off
