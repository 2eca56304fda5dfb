"""Bad input for the op tests (tests/ops/test_<family>.py): every class of bad input raises the documented
exception naming the argument (both implementations).

docs/ops.md: wrong type/dtype -> TypeError; wrong ndim, shape relation, range, order, non-finite value,
non-contiguous array -> ValueError; read-only output -> BufferError; every message starts with
"<op>: argument '<name>'".  (Mixed devices need a GPU and are left to the GPU tests.)  Each family file lists its
cases with :func:`case` and checks them with :func:`check_bad_input`."""
import re

import numpy as np
import pytest

RNG = np.random.default_rng(123)

L = RNG.normal(size=(3, 7)).astype(np.float32)  # valid logits [3, 7]

BS = np.zeros(3)

BN = np.array([-1, 0, 1])

TT = np.array([0, 1, 2])  # valid tree: root with two children

TP = np.array([-1, 0, 0])

TL = RNG.normal(size=(3, 5)).astype(np.float32)

BT_TOK = np.array([5, 6, 7, 8])

BT_PAR = np.array([-1, 0, 0, 1])

BT_SEL = np.array([0, 1, 3])

def with_value(a, index, value):
    a = np.array(a, copy=True)
    a[index] = value
    return a

def noncontig(a):
    """Same values, every other element of a twice-as-wide buffer along the last axis."""
    wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    wide[..., ::2] = a
    return wide[..., ::2]

def vs(impl, tokens=TT, parents=TP, logits=TL, **kw):
    args = dict(temperature=1.0, seed=0, offset=0)
    args.update(kw)
    return impl.verify_sample(tokens, parents, logits, **args)

def both_verifiers(tokens=TT, parents=TP, logits=TL):
    """The same tree/logits case for verify_greedy and verify_sample."""
    return [
        lambda impl: impl.verify_greedy(tokens, parents, logits),
        lambda impl: vs(impl, tokens, parents, logits),
    ]

def case(cases, name, exc, arg, *fns):
    for i, fn in enumerate(fns):
        cases.append(pytest.param(fn, exc, arg, id=f"{name}-{i}" if len(fns) > 1 else name))

# ---------------------------------------------------------------------------------------------- select
S = RNG.normal(size=6)

# row 0 forces node 1 (only token 1 is finite): row 1 is visited, and its NaN is found
_forced = with_value(with_value(TL, 0, -np.inf), (0, 1), 0.0)

def kv_t(s=10):
    return np.zeros((2, s, 4), np.float32)

def readonly():
    t = kv_t()
    t.flags.writeable = False
    return t

SL = np.array([1, 3])

# ---------------------------------------------------------------------------------------------- bucketize
V5 = RNG.normal(size=5)

TH = np.array([-1.0, 0.0, 1.0])

OPS = dict(te="topk_entropy", ex="expand", se="select", bt="build_tree", vf="verify_(?:greedy|sample)",
           vs="verify_sample", kv="kv_compact", kt="KVTensors", bu="bucketize", ph="philox4x32", pu="philox_uniform")

# kv_compact may name the offending element of the list, e.g. argument 'tensors[1]' (the C core does)
ARG_PATTERNS = {"tensors": r"tensors(?:\[\d+\])?"}

def check_bad_input(impl, fn, exc, arg, request):
    """test_bad_input of every family: the call raises ``exc`` whose message starts with the op and the argument
    and goes on to say what was expected and what was given."""
    op = OPS[next(part for part in request.node.callspec.id.split("-") if part in OPS)]
    with pytest.raises(exc, match=rf"^{op}: argument '{ARG_PATTERNS.get(arg, re.escape(arg))}'") as info:
        fn(impl)
    assert len(str(info.value)) > len(f"{op}: argument '{arg}'") + 10  # says what was expected and given
