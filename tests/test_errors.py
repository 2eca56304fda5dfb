"""Every class of bad input raises the documented exception naming the argument (both implementations).

docs/ops.md: wrong type/dtype -> TypeError; wrong ndim, shape relation, range, order, non-finite value,
non-contiguous array -> ValueError; read-only output -> BufferError; every message starts with
"<op>: argument '<name>'".  (Mixed devices need a GPU and are left to the GPU tests.)
"""
import re

import numpy as np
import pytest
import torch

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


CASES = []


def case(name, exc, arg, *fns):
    for i, fn in enumerate(fns):
        CASES.append(pytest.param(fn, exc, arg, id=f"{name}-{i}" if len(fns) > 1 else name))


# ---------------------------------------------------------------------------------------------- topk_entropy
case("te-int-logits", TypeError, "logits", lambda m: m.topk_entropy(L.astype(np.int32), 2))
case("te-float64-logits", TypeError, "logits", lambda m: m.topk_entropy(L.astype(np.float64), 2))
case("te-str-logits", TypeError, "logits", lambda m: m.topk_entropy("logits", 2))
case("te-1d", ValueError, "logits", lambda m: m.topk_entropy(L[0], 2))
case("te-4d", ValueError, "logits", lambda m: m.topk_entropy(L[None, None], 2))  # 3-D is the batched form
case("te-noncontig", ValueError, "logits", lambda m: m.topk_entropy(noncontig(L), 2))
case("te-k-range", ValueError, "k",
     lambda m: m.topk_entropy(L, 0), lambda m: m.topk_entropy(L, 8), lambda m: m.topk_entropy(L, -1))
case("te-k-float", TypeError, "k", lambda m: m.topk_entropy(L, 2.0))
case("te-temperature", ValueError, "temperature",
     lambda m: m.topk_entropy(L, 2, 0.0), lambda m: m.topk_entropy(L, 2, -1.0),
     lambda m: m.topk_entropy(L, 2, float("nan")), lambda m: m.topk_entropy(L, 2, float("inf")),
     lambda m: m.topk_entropy(L, 2, 5e-324), lambda m: m.topk_entropy(L, 2, 9.9e-31))  # below 1e-30 (docs/ops.md)
case("te-nan", ValueError, "logits", lambda m: m.topk_entropy(with_value(L, (1, 3), np.nan), 2))
case("te-posinf", ValueError, "logits", lambda m: m.topk_entropy(with_value(L, (2, 0), np.inf), 2))
case("te-all-neginf", ValueError, "logits", lambda m: m.topk_entropy(with_value(L, 1, -np.inf), 2))

# ---------------------------------------------------------------------------------------------- expand
case("ex-int-logits", TypeError, "logits", lambda m: m.expand(L.astype(np.int64), BS, BN, 2))
case("ex-int-beam-scores", TypeError, "beam_scores", lambda m: m.expand(L, np.zeros(3, np.int64), BN, 2))
case("ex-f16-beam-scores", TypeError, "beam_scores", lambda m: m.expand(L, np.zeros(3, np.float16), BN, 2))
case("ex-float-beam-nodes", TypeError, "beam_nodes", lambda m: m.expand(L, BS, BN.astype(np.float64), 2))
case("ex-float-d2t", TypeError, "d2t", lambda m: m.expand(L, BS, BN, 2, d2t=np.zeros(7)))
case("ex-k-float", TypeError, "k", lambda m: m.expand(L, BS, BN, 1.5))
case("ex-beam-scores-len", ValueError, "beam_scores", lambda m: m.expand(L, np.zeros(2), BN, 2))
case("ex-beam-scores-2d", ValueError, "beam_scores", lambda m: m.expand(L, np.zeros((3, 1)), BN, 2))
case("ex-beam-nodes-len", ValueError, "beam_nodes", lambda m: m.expand(L, BS, np.array([-1, 0, 1, 2]), 2))
case("ex-d2t-len", ValueError, "d2t", lambda m: m.expand(L, BS, BN, 2, d2t=np.zeros(6, np.int64)))
case("ex-k-range", ValueError, "k", lambda m: m.expand(L, BS, BN, 0), lambda m: m.expand(L, BS, BN, 8))
case("ex-beam-scores-nonfinite", ValueError, "beam_scores",
     lambda m: m.expand(L, with_value(BS, 1, np.nan), BN, 2),
     lambda m: m.expand(L, with_value(BS, 2, np.inf), BN, 2))
case("ex-beam-nodes-below-minus1", ValueError, "beam_nodes", lambda m: m.expand(L, BS, with_value(BN, 0, -2), 2))
case("ex-node-offset-negative", ValueError, "node_offset", lambda m: m.expand(L, BS, BN, 2, node_offset=-1))
case("ex-d2t-negative-token", ValueError, "d2t",
     lambda m: m.expand(L, BS, BN, 2, d2t=np.full(7, -10, np.int64)))
case("ex-logits-nan", ValueError, "logits", lambda m: m.expand(with_value(L, (0, 0), np.nan), BS, BN, 2))
case("ex-logits-all-neginf", ValueError, "logits", lambda m: m.expand(with_value(L, 2, -np.inf), BS, BN, 2))
case("ex-noncontig", ValueError, "logits", lambda m: m.expand(noncontig(L), BS, BN, 2))
case("ex-noncontig-beam-scores", ValueError, "beam_scores", lambda m: m.expand(L, noncontig(BS), BN, 2))
case("ex-noncontig-beam-nodes", ValueError, "beam_nodes", lambda m: m.expand(L, BS, noncontig(BN), 2))

# ---------------------------------------------------------------------------------------------- select
S = RNG.normal(size=6)
case("se-int-scores", TypeError, "scores", lambda m: m.select(np.arange(6), 2))
case("se-3d", ValueError, "scores", lambda m: m.select(S.reshape(1, 2, 3), 2))  # 2-D is the batched form
case("se-n-range", ValueError, "n", lambda m: m.select(S, -1), lambda m: m.select(S, 7))
case("se-n-float", TypeError, "n", lambda m: m.select(S, 2.0))
case("se-nan", ValueError, "scores", lambda m: m.select(with_value(S, 4, np.nan), 2))
case("se-noncontig", ValueError, "scores", lambda m: m.select(noncontig(S), 2))

# ---------------------------------------------------------------------------------------------- build_tree
case("bt-float-tokens", TypeError, "tokens", lambda m: m.build_tree(BT_TOK.astype(np.float32), BT_PAR, BT_SEL, 0))
case("bt-float-parents", TypeError, "parents", lambda m: m.build_tree(BT_TOK, BT_PAR.astype(np.float64), BT_SEL, 0))
case("bt-float-selected", TypeError, "selected", lambda m: m.build_tree(BT_TOK, BT_PAR, BT_SEL.astype(np.float64), 0))
case("bt-tokens-3d", ValueError, "tokens", lambda m: m.build_tree(BT_TOK.reshape(1, 2, 2), BT_PAR, BT_SEL, 0))
case("bt-parents-len", ValueError, "parents", lambda m: m.build_tree(BT_TOK, BT_PAR[:3], np.array([0, 1]), 0))
case("bt-selected-order", ValueError, "selected",
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([1, 0]), 0),
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([0, 0, 1]), 0))
case("bt-selected-range", ValueError, "selected",
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([0, 4]), 0),
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([-1, 0]), 0))
case("bt-parents-range", ValueError, "parents",
     lambda m: m.build_tree(BT_TOK, np.array([-1, -2, 0, 1]), np.array([0, 1]), 0),
     lambda m: m.build_tree(BT_TOK, np.array([-1, 0, 0, 4]), BT_SEL, 0))
case("bt-parents-precede", ValueError, "parents",
     lambda m: m.build_tree(BT_TOK, np.array([-1, 2, -1, 1]), np.array([1, 2]), 0),
     lambda m: m.build_tree(BT_TOK, np.array([-1, 1, -1, 1]), np.array([1]), 0))
case("bt-not-parent-closed", ValueError, "selected",
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([1]), 0),
     lambda m: m.build_tree(BT_TOK, BT_PAR, np.array([0, 3]), 0))
case("bt-root-token-negative", ValueError, "root_token", lambda m: m.build_tree(BT_TOK, BT_PAR, BT_SEL, -1))
case("bt-root-token-float", TypeError, "root_token", lambda m: m.build_tree(BT_TOK, BT_PAR, BT_SEL, 1.0))
case("bt-noncontig", ValueError, "tokens", lambda m: m.build_tree(noncontig(BT_TOK), BT_PAR, BT_SEL, 0))

# ---------------------------------------------------------------------------------------------- verify_greedy / verify_sample
case("vf-float-tokens", TypeError, "tree_tokens", *both_verifiers(tokens=TT.astype(np.float64)))
case("vf-float-parents", TypeError, "tree_parents", *both_verifiers(parents=TP.astype(np.float32)))
case("vf-int-logits", TypeError, "target_logits", *both_verifiers(logits=TL.astype(np.int32)))
case("vf-parents-len", ValueError, "tree_parents", *both_verifiers(parents=np.array([-1, 0])))
case("vf-logits-rows", ValueError, "target_logits", *both_verifiers(logits=TL[:2].copy()))
case("vf-logits-1d", ValueError, "target_logits", *both_verifiers(logits=TL[0].copy()))
case("vf-parents-root", ValueError, "tree_parents", *both_verifiers(parents=np.array([0, 0, 0])))
case("vf-parents-order", ValueError, "tree_parents",
     *both_verifiers(parents=np.array([-1, 0, 2])), *both_verifiers(parents=np.array([-1, 2, 0])))
case("vf-parents-range", ValueError, "tree_parents", *both_verifiers(parents=np.array([-1, -2, 0])))
case("vf-tokens-range", ValueError, "tree_tokens",
     *both_verifiers(tokens=np.array([0, 5, 1])), *both_verifiers(tokens=np.array([0, 1, -1])),
     *both_verifiers(tokens=np.array([5, 1, 2])))  # the root's token is checked too
case("vf-logits-nan", ValueError, "target_logits", *both_verifiers(logits=with_value(TL, (0, 2), np.nan)))
case("vf-logits-posinf", ValueError, "target_logits", *both_verifiers(logits=with_value(TL, (0, 4), np.inf)))
case("vf-logits-all-neginf", ValueError, "target_logits", *both_verifiers(logits=with_value(TL, 0, -np.inf)))
# row 0 forces node 1 (only token 1 is finite): row 1 is visited, and its NaN is found
_forced = with_value(with_value(TL, 0, -np.inf), (0, 1), 0.0)
case("vf-visited-row-nan", ValueError, "target_logits", *both_verifiers(logits=with_value(_forced, (1, 3), np.nan)))
case("vf-noncontig", ValueError, "target_logits", *both_verifiers(logits=noncontig(TL)))
case("vf-noncontig-tokens", ValueError, "tree_tokens", *both_verifiers(tokens=noncontig(TT)))
case("vs-temperature", ValueError, "temperature",
     lambda m: vs(m, temperature=0.0), lambda m: vs(m, temperature=-0.5),
     lambda m: vs(m, temperature=float("nan")), lambda m: vs(m, temperature=float("inf")),
     lambda m: vs(m, temperature=5e-324), lambda m: vs(m, temperature=9.9e-31))
case("vs-temperature-type", TypeError, "temperature", lambda m: vs(m, temperature="1.0"))
case("vs-top-k", ValueError, "top_k", lambda m: vs(m, top_k=-1))
case("vs-top-k-type", TypeError, "top_k", lambda m: vs(m, top_k=1.5))
case("vs-top-p", ValueError, "top_p",
     lambda m: vs(m, top_p=0.0), lambda m: vs(m, top_p=1.5), lambda m: vs(m, top_p=-0.1),
     lambda m: vs(m, top_p=float("nan")))
case("vs-seed", ValueError, "seed", lambda m: vs(m, seed=-1), lambda m: vs(m, seed=2**64))
case("vs-seed-type", TypeError, "seed", lambda m: vs(m, seed=1.0))
case("vs-offset", ValueError, "offset", lambda m: vs(m, offset=-1), lambda m: vs(m, offset=2**64))

# ---------------------------------------------------------------------------------------------- kv_compact


def kv_t(s=10):
    return np.zeros((2, s, 4), np.float32)


def readonly():
    t = kv_t()
    t.flags.writeable = False
    return t


SL = np.array([1, 3])
case("kv-not-a-list", TypeError, "tensors", lambda m: m.kv_compact(kv_t(), 2, SL))
case("kv-element-not-array", TypeError, "tensors", lambda m: m.kv_compact([kv_t(), 5], 2, SL))
case("kv-1d", ValueError, "tensors", lambda m: m.kv_compact([np.zeros(10)], 2, SL))
case("kv-noncontig", ValueError, "tensors", lambda m: m.kv_compact([kv_t(), noncontig(kv_t())], 2, SL))
case("kv-readonly", BufferError, "tensors", lambda m: m.kv_compact([readonly()], 2, SL))
case("kv-slots-float", TypeError, "slots", lambda m: m.kv_compact([kv_t()], 2, SL.astype(np.float64)))
case("kv-slots-3d", ValueError, "slots", lambda m: m.kv_compact([kv_t()], 2, SL.reshape(1, 1, 2)))
case("kv-slots-order", ValueError, "slots",
     lambda m: m.kv_compact([kv_t()], 2, np.array([3, 1])), lambda m: m.kv_compact([kv_t()], 2, np.array([2, 2])))
case("kv-slots-below-i", ValueError, "slots",
     lambda m: m.kv_compact([kv_t()], 2, np.array([-1, 3])), lambda m: m.kv_compact([kv_t()], 2, np.array([0, 1, 1])))
case("kv-slots-past-S", ValueError, "slots",
     lambda m: m.kv_compact([kv_t()], 2, np.array([1, 8])),
     lambda m: m.kv_compact([kv_t(20), kv_t(9)], 0, np.array([0, 9])))  # only the second tensor is too short
case("kv-plen-negative", ValueError, "prefix_len", lambda m: m.kv_compact([kv_t()], -1, SL))
case("kv-plen-float", TypeError, "prefix_len", lambda m: m.kv_compact([kv_t()], 2.0, SL))
# -1 padding: entries from the first -1 on are ignored and must all be -1
case("kv-slots-pad-then-valid", ValueError, "slots",
     lambda m: m.kv_compact([kv_t()], 2, np.array([0, -1, 3])), lambda m: m.kv_compact([kv_t()], 2, np.array([-1, 0])),
     lambda m: m.kv_compact([kv_t()], 2, np.array([1, -1, -1, 4], np.int32)),
     lambda m: m.kv_compact([kv_t()], 2, np.array([1, -2])))  # -2 is no padding: slots[1] >= 1
case("kv-slots-overflow", ValueError, "slots",  # prefix_len + slot overflows int64: refused, never wrapped
     lambda m: m.kv_compact([kv_t()], 2**62, np.array([2**62])),
     lambda m: m.kv_compact([kv_t()], np.array(2**63 - 1), np.array([0, 2**63 - 1])))
# prefix_len as an int64 array with exactly one element (shape [] or [1])
case("kv-plen-array-negative", ValueError, "prefix_len",
     lambda m: m.kv_compact([kv_t()], np.array([-1]), SL), lambda m: m.kv_compact([kv_t()], np.array(-3), SL),
     lambda m: m.kv_compact([kv_t()], np.array([-1]), np.full(2, -1)))  # refused even when nothing moves
case("kv-plen-array-dtype", TypeError, "prefix_len",
     lambda m: m.kv_compact([kv_t()], np.array([2], np.int32), SL),
     lambda m: m.kv_compact([kv_t()], np.array([2.0]), SL),
     lambda m: m.kv_compact([kv_t()], np.array([True]), SL),
     lambda m: m.kv_compact([kv_t()], torch.tensor([2], dtype=torch.int32), SL))
case("kv-plen-array-size", ValueError, "prefix_len",
     lambda m: m.kv_compact([kv_t()], np.array([2, 3]), SL), lambda m: m.kv_compact([kv_t()], np.zeros(0, np.int64), SL),
     lambda m: m.kv_compact([kv_t()], np.array([[2]]), SL),
     lambda m: m.kv_compact([kv_t()], torch.tensor([1, 2]), SL))
# KVTensors: the checks of kv_compact's 'tensors', once
case("kt-not-a-list", TypeError, "tensors", lambda m: m.KVTensors(kv_t()), lambda m: m.KVTensors(5))
case("kt-element-not-array", TypeError, "tensors", lambda m: m.KVTensors([kv_t(), "x"]))
case("kt-1d", ValueError, "tensors", lambda m: m.KVTensors([np.zeros(10)]))
case("kt-noncontig", ValueError, "tensors", lambda m: m.KVTensors([noncontig(kv_t())]))
case("kt-readonly", BufferError, "tensors", lambda m: m.KVTensors([kv_t(), readonly()]))
case("kt-overlap", ValueError, "tensors", lambda m: (lambda t: m.KVTensors([t, t[1:]]))(kv_t()))
case("kv-kvtensors-slots", ValueError, "slots",
     lambda m: m.kv_compact(m.KVTensors([kv_t()]), 2, np.array([3, 1])),
     lambda m: m.kv_compact(m.KVTensors([kv_t(20), kv_t(9)]), 0, np.array([0, 9])))
case("kv-kvtensors-plen", ValueError, "prefix_len", lambda m: m.kv_compact(m.KVTensors([kv_t()]), np.array([-1]), SL))

# ---------------------------------------------------------------------------------------------- bucketize
V5 = RNG.normal(size=5)
TH = np.array([-1.0, 0.0, 1.0])
case("bu-int-values", TypeError, "values", lambda m: m.bucketize(np.arange(5), TH))
case("bu-int-thresholds", TypeError, "thresholds", lambda m: m.bucketize(V5, np.arange(3)))
case("bu-f16-values", TypeError, "values", lambda m: m.bucketize(V5.astype(np.float16), TH))
case("bu-thresholds-order", ValueError, "thresholds",
     lambda m: m.bucketize(V5, np.array([0.0, -1.0])), lambda m: m.bucketize(V5, np.array([0.0, 0.0, 1.0])))
case("bu-thresholds-nan", ValueError, "thresholds", lambda m: m.bucketize(V5, np.array([0.0, np.nan])))
case("bu-values-nan", ValueError, "values", lambda m: m.bucketize(with_value(V5, 3, np.nan), TH))
case("bu-values-2d", ValueError, "values", lambda m: m.bucketize(V5[:4].reshape(2, 2), TH))
case("bu-noncontig", ValueError, "values", lambda m: m.bucketize(noncontig(V5), TH))

# ---------------------------------------------------------------------------------------------- philox
case("ph-counter-len", ValueError, "counter", lambda m: m.philox4x32((0, 0, 0), (0, 0)))
case("ph-key-len", ValueError, "key", lambda m: m.philox4x32((0, 0, 0, 0), (0, 0, 0)))
case("ph-counter-range", ValueError, "counter",
     lambda m: m.philox4x32((0, 2**32, 0, 0), (0, 0)), lambda m: m.philox4x32((0, 0, -1, 0), (0, 0)))
case("ph-key-range", ValueError, "key", lambda m: m.philox4x32((0, 0, 0, 0), (2**32, 0)))
case("ph-counter-type", TypeError, "counter", lambda m: m.philox4x32((0, 1.5, 0, 0), (0, 0)))
case("pu-n", ValueError, "n", lambda m: m.philox_uniform(-1, seed=0, offset=0))
case("pu-n-type", TypeError, "n", lambda m: m.philox_uniform(2.0, seed=0, offset=0))
case("pu-seed", ValueError, "seed", lambda m: m.philox_uniform(2, seed=-1, offset=0))
case("pu-offset", ValueError, "offset", lambda m: m.philox_uniform(2, seed=0, offset=2**64))


OPS = dict(te="topk_entropy", ex="expand", se="select", bt="build_tree", vf="verify_(?:greedy|sample)",
           vs="verify_sample", kv="kv_compact", kt="KVTensors", bu="bucketize", ph="philox4x32", pu="philox_uniform")
# kv_compact may name the offending element of the list, e.g. argument 'tensors[1]' (the C core does)
ARG_PATTERNS = {"tensors": r"tensors(?:\[\d+\])?"}


@pytest.mark.parametrize("fn,exc,arg", CASES)
def test_bad_input(impl, fn, exc, arg, request):
    op = OPS[next(part for part in request.node.callspec.id.split("-") if part in OPS)]
    with pytest.raises(exc, match=rf"^{op}: argument '{ARG_PATTERNS.get(arg, re.escape(arg))}'") as info:
        fn(impl)
    assert len(str(info.value)) > len(f"{op}: argument '{arg}'") + 10  # says what was expected and given


# ---------------------------------------------------------------------------------------------- details


def test_message_names_row_and_column(impl):
    x = with_value(L, (2, 5), np.nan)
    with pytest.raises(ValueError, match=r"^topk_entropy: argument 'logits'") as info:
        impl.topk_entropy(x, 2)
    msg = str(info.value)
    assert re.search(r"\b2\b", msg) and re.search(r"\b5\b", msg), msg
    with pytest.raises(ValueError, match=r"^expand: argument 'logits'") as info:
        impl.expand(with_value(L, 1, -np.inf), BS, BN, 2)
    assert re.search(r"\b1\b", str(info.value)), str(info.value)


def test_message_says_expected_and_given(impl):
    with pytest.raises(ValueError, match=r"^select: argument 'n'") as info:
        impl.select(S, 9)
    assert "9" in str(info.value) and len(str(info.value)) > len("select: argument 'n'") + 5


def test_empty_tree(impl):
    empty = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match=r"argument '(tree_tokens|tree_parents|target_logits)'"):
        impl.verify_greedy(empty, empty, np.zeros((0, 5), np.float32))
    with pytest.raises(ValueError, match=r"argument '(tree_tokens|tree_parents|target_logits)'"):
        vs(impl, empty, empty, np.zeros((0, 5), np.float32))


def test_keyword_only_arguments(impl):
    with pytest.raises(TypeError):
        impl.verify_sample(TT, TP, TL, 1.0, 0, 1.0, 0, 0)  # temperature.. must be keywords
    with pytest.raises(TypeError):
        impl.verify_sample(TT, TP, TL, temperature=1.0, offset=0)  # seed is required
    with pytest.raises(TypeError):
        impl.philox_uniform(3, 0, 0)


def test_unvisited_rows_are_not_checked(impl):
    x = with_value(_forced, 2, np.nan)  # row 2 (node 2) is never visited: node 1 is always taken
    x = with_value(x, (1, 0), 5.0)  # row 1 has a clear argmax (0); node 1 is a leaf
    path, nxt = impl.verify_greedy(TT, TP, x)
    assert np.asarray(path).tolist() == [0, 1] and nxt == 0
    path, nxt, draws = vs(impl, logits=x)
    assert np.asarray(path).tolist() == [0, 1] and draws == 2


def test_valid_edge_values_accepted(impl):
    """The boundaries of every range are accepted (so the error tests above are not vacuous)."""
    impl.topk_entropy(L, 1)
    impl.topk_entropy(L, 7)
    impl.expand(L, with_value(BS, 0, -np.inf), with_value(BN, 1, -1), 7, d2t=np.zeros(7, np.int32), node_offset=0)
    impl.select(S, 0)
    impl.select(S, 6)
    impl.build_tree(BT_TOK, BT_PAR, BT_SEL, 0)
    impl.build_tree(BT_TOK, BT_PAR, np.zeros(0, np.int64), 0)
    vs(impl, temperature=1e-6, top_k=0, top_p=1.0, seed=2**64 - 1, offset=2**64 - 1)
    vs(impl, top_k=10**9, top_p=1e-12)
    impl.kv_compact([kv_t()], 2, np.array([1, 7]))  # prefix_len + slots[-1] = S - 1
    impl.kv_compact([kv_t()], 0, np.zeros(0, np.int32))
    impl.kv_compact([kv_t()], np.array(2), np.array([1, 7, -1]))  # a 0-d prefix array, padded slots
    impl.kv_compact([kv_t()], np.array([0]), np.array([-1, -1], np.int32))
    impl.kv_compact(impl.KVTensors([kv_t()]), np.array([8], np.int64), np.array([1]))
    impl.bucketize(V5, np.zeros(0))
    impl.bucketize(V5, np.array([-np.inf, np.inf]))
    assert impl.philox4x32((2**32 - 1,) * 4, (2**32 - 1,) * 2) is not None
    assert impl.philox_uniform(0, seed=2**64 - 1, offset=2**64 - 1).shape == (0,)
