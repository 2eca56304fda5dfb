"""Tensor interop of the C binding: NumPy, torch through DLPack (versioned and legacy capsules), the buffer
protocol, output libraries, import refusals, and what the binding does with foreign devices.

These concern only heterospec.ops (the reference is NumPy-only by design)."""
import array
import ctypes

import numpy as np
import pytest

import heterospec
from heterospec import ops, reference

torch = pytest.importorskip("torch")


def test_build_info():
    info = heterospec.build_info()
    assert isinstance(info["cuda"], bool)
    assert info["version"] == heterospec.__version__
    assert info["cuda"] is False or info.get("cuda_archs")
    import importlib.util

    want = "heterospec._gemm built: " if importlib.util.find_spec("heterospec._gemm") else "not built"
    assert info["cpu_kernels"].startswith(want), info["cpu_kernels"]


def _tree_case(rng, V=50):
    tokens = np.array([3, 7, 9, 7, 11, 2], dtype=np.int64)
    parents = np.array([-1, 0, 0, 1, 1, 3], dtype=np.int64)
    logits = rng.standard_normal((6, V)).astype(np.float32)
    return tokens, parents, logits


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_inputs_give_torch_outputs_matching_numpy(dtype):
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((4, 111)).astype(np.float32)).to(getattr(torch, dtype))
    # the NumPy twin on the same float32 values (bfloat16 is widened exactly)
    x32 = x.float().numpy()
    ent = ops.topk_entropy(x, 7)
    assert isinstance(ent, torch.Tensor) and ent.dtype == torch.float32
    np.testing.assert_allclose(ent.numpy(), reference.topk_entropy(x32, 7), rtol=1e-6, atol=1e-6)

    tok, sc, par, en, nb = ops.expand(x, torch.zeros(4), torch.arange(4), 5, None, 10)
    rtok, rsc, rpar, ren, rnb = reference.expand(x32, np.zeros(4, np.float32), np.arange(4), 5, None, 10)
    for got in (tok, sc, par, en, nb):
        assert isinstance(got, torch.Tensor)
    assert tok.dtype == torch.int64 and sc.dtype == torch.float32
    np.testing.assert_array_equal(tok.numpy(), rtok)
    np.testing.assert_array_equal(nb.numpy(), rnb)
    np.testing.assert_allclose(sc.numpy(), rsc, rtol=1e-6, atol=1e-6)

    tokens, parents, logits = _tree_case(rng)
    lt = torch.from_numpy(logits).to(getattr(torch, dtype))
    path, nxt = ops.verify_greedy(torch.from_numpy(tokens), torch.from_numpy(parents), lt)
    rpath, rnxt = reference.verify_greedy(tokens, parents, lt.float().numpy())
    assert isinstance(path, torch.Tensor)
    assert path.tolist() == rpath.tolist() and nxt == rnxt


def test_numpy_inputs_give_numpy_outputs():
    rng = np.random.default_rng(2)
    tokens, parents, logits = _tree_case(rng)
    path, nxt = ops.verify_greedy(tokens, parents, logits)
    assert type(path) is np.ndarray and path.dtype == np.int64 and isinstance(nxt, int)
    tree = ops.build_tree(tokens, parents, np.array([0, 1, 3]), 5)
    assert all(type(a) is np.ndarray for a in tree)
    assert tree.mask.dtype == np.bool_


def test_torch_build_tree_outputs_and_int32_ids():
    tokens = torch.tensor([4, 5, 6, 7], dtype=torch.int32)
    parents = torch.tensor([-1, -1, 0, 2], dtype=torch.int32)
    tree = ops.build_tree(tokens, parents, torch.tensor([0, 1, 2, 3], dtype=torch.int32), 9)
    assert tree.mask.dtype == torch.bool and tree.tokens.dtype == torch.int64
    assert tree.tokens.tolist() == [9, 4, 5, 6, 7]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert tree.retrieve.tolist() == [[0, 2, -1, -1], [0, 1, 3, 4]]


class LegacyProducer:
    """Exports only an unversioned capsule: __dlpack__ takes no max_version (like torch 1.13)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


class VersionedProducer:
    def __init__(self, t):
        self.t = t
        self.calls = []

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        return self.t.__dlpack__(**kwargs)


def test_dlpack_versioned_and_legacy_capsules_agree():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    want = ops.topk_entropy(x.numpy(), 5)
    versioned = VersionedProducer(x)
    np.testing.assert_array_equal(ops.topk_entropy(versioned, 5), want)
    assert versioned.calls and versioned.calls[0].get("max_version") == (1, 0)
    np.testing.assert_array_equal(ops.topk_entropy(LegacyProducer(x), 5), want)


def test_producers_without_ndim_in_both_forms():
    """heterospec.ops tells the batch-first binding whether a call is batched from the leading array's ndim; an
    array type without ndim (a bare DLPack producer) leaves it to the binding, which reads it from the import."""
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((2, 3, 40)).astype(np.float32))
    assert not hasattr(VersionedProducer(x), "ndim")
    np.testing.assert_array_equal(ops.topk_entropy(VersionedProducer(x), 5), ops.topk_entropy(x.numpy(), 5))
    np.testing.assert_array_equal(ops.topk_entropy(LegacyProducer(x[0]), 5), ops.topk_entropy(x[0].numpy(), 5))
    scores, nodes = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.int64)
    for got, want in zip(ops.expand(LegacyProducer(x), scores, nodes, 4), ops.expand(x.numpy(), scores, nodes, 4)):
        np.testing.assert_array_equal(got, want)
    tree = ops.build_tree(LegacyProducer(torch.tensor([4, 5, 6])), np.array([-1, 0, 1]), np.array([0, 1]), 9)
    assert tree.tokens.tolist() == [9, 4, 5] and tree.retrieve.tolist() == [[0, 1, 2]]


def test_kv_compact_writes_through_dlpack_and_torch():
    kv = [torch.arange(2 * 9 * 3, dtype=torch.float32).reshape(2, 9, 3) for _ in range(3)]
    want = [t.clone() for t in kv]
    slots = [0, 2, 3]
    for t in want:
        t[:, 4:7] = t[:, [4 + s for s in slots]].clone()
    ops.kv_compact(kv, 4, torch.tensor(slots))
    for got, exp in zip(kv, want):
        assert torch.equal(got, exp)
    legacy = [np.arange(9 * 2, dtype=np.float16).reshape(9, 2)]
    exp = legacy[0].copy()
    exp[1:3] = exp[[1 + 1, 1 + 4]]
    ops.kv_compact([LegacyProducer(torch.from_numpy(legacy[0]))], 1, [1, 4])
    np.testing.assert_array_equal(legacy[0], exp)


def test_torch_tensors_skip_the_dlpack_method_only_where_it_would_add_nothing(monkeypatch):
    """Issue 17 (host overhead): an exact CPU torch.Tensor is imported with torch._C._to_dlpack (~0.35 us)
    instead of Tensor.__dlpack__ (~3.5 us); a subclass, or a tensor that requires grad, still goes through
    __dlpack__ (its checks and refusals), and the result is the same either way."""
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((3, 40)).astype(np.float32))
    want = ops.topk_entropy(x.numpy(), 5)
    calls = []
    real = torch.Tensor.__dlpack__

    def spy(self, *a, **kw):
        calls.append(type(self).__name__)
        return real(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "__dlpack__", spy)
    np.testing.assert_array_equal(ops.topk_entropy(x, 5).numpy(), want)
    assert calls == []                                        # the direct import
    kv = [torch.arange(12.0).reshape(6, 2)]
    ops.kv_compact(kv, 1, torch.tensor([2]))                  # writes land in the tensor's own storage
    assert kv[0][1].tolist() == [6.0, 7.0] and calls == []

    class Sub(torch.Tensor):
        pass

    np.testing.assert_array_equal(np.asarray(ops.topk_entropy(x.as_subclass(Sub), 5)), want)
    assert calls and set(calls) == {"Sub"}                    # subclasses keep the protocol
    with pytest.raises(BufferError, match=r"topk_entropy: argument 'logits'.*require"):
        ops.topk_entropy(torch.zeros(2, 8, requires_grad=True), 2)
    assert calls[-1] == "Tensor"                              # so does a tensor that requires grad


def test_buffer_protocol_inputs():
    vals = array.array("d", [0.5, 2.5, 9.0])
    thr = memoryview(np.array([1.0, 2.0, 3.0]))
    assert ops.bucketize(vals, thr).tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match=r"argument 'values'.*C-contiguous"):
        ops.bucketize(memoryview(np.arange(6.0))[::2], thr)
    with pytest.raises(TypeError, match=r"argument 'values' expected an array or tensor"):
        ops.bucketize(object(), thr)


def test_torch_refusals_name_the_argument():
    x = torch.zeros(2, 8, requires_grad=True)
    with pytest.raises(BufferError, match=r"topk_entropy: argument 'logits'"):
        ops.topk_entropy(x, 2)
    with pytest.raises(ValueError, match=r"argument 'logits' expected a C-contiguous"):
        ops.topk_entropy(torch.zeros(8, 4).t(), 2)
    with pytest.raises(TypeError, match=r"argument 'logits' expected dtype float16, bfloat16 or float32, got float64"):
        ops.topk_entropy(torch.zeros(2, 4, dtype=torch.float64), 2)
    with pytest.raises(TypeError, match=r"argument 'k' expected an int"):
        ops.topk_entropy(torch.zeros(2, 4), 2.0)


def test_read_only_output_refused():
    ro = np.zeros((1, 6, 2), np.float32)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match=r"argument 'tensors\[0\]' expected a writeable"):
        ops.kv_compact([ro], 0, [1])

    class ReadOnlyExport:  # NumPy marks read-only arrays in versioned capsules
        def __dlpack__(self, **kw):
            return ro.__dlpack__(**kw)

    with pytest.raises(BufferError, match=r"argument 'tensors\[0\]'"):
        ops.kv_compact([ReadOnlyExport()], 0, [1])


# ---- hand-made DLPack capsules (ctypes) for the cases no library produces on a CPU machine ------------


from _dlpack import (  # noqa: E402
    _DELETER,
    _NAME,
    _Device,
    _DType,
    _ManagedVersioned,
    _PyCapsule_New,
    _Version,
)


class FakeProducer:
    """A DLPack producer over a NumPy array that can lie about its device, dtype lanes or version."""

    def __init__(self, arr, device_type=1, major=1, lanes=1):
        self.arr = np.ascontiguousarray(arr, dtype=np.float32)
        self.shape = (ctypes.c_int64 * self.arr.ndim)(*self.arr.shape)
        self.deleted = 0

        def deleter(_ptr):
            self.deleted += 1

        self._deleter = _DELETER(deleter)
        self.m = _ManagedVersioned()
        self.m.version = _Version(major, 0)
        self.m.deleter = self._deleter
        t = self.m.dl_tensor
        t.data = self.arr.ctypes.data
        t.device = _Device(device_type, 0)
        t.ndim = self.arr.ndim
        t.dtype = _DType(2, 32, lanes)
        t.shape = self.shape

    def __dlpack__(self, **kw):
        return _PyCapsule_New(ctypes.addressof(self.m), _NAME.value, None)


def test_foreign_device_is_refused_with_value_error():
    p = FakeProducer(np.zeros((2, 5)), device_type=2)  # claims to live on cuda:0
    # a CPU-only build refuses every device; a CUDA build refuses it when this process has no such GPU
    # (a FakeProducer's memory is host memory, so it must never reach a kernel either way)
    if heterospec.build_info().get("cuda_devices"):
        pytest.skip("cuda:0 exists here (a GPU, or the emulated build): the fake producer would be taken for it")
    with pytest.raises(ValueError, match=r"argument 'logits' expected a (CPU tensor|tensor on a usable device).*got cuda:0"):
        ops.topk_entropy(p, 2)
    assert p.deleted == 1  # ownership was taken, so the deleter ran exactly once


def test_mixed_devices_are_refused():
    cpu = np.zeros(4, np.float32)
    gpu = FakeProducer(np.zeros(4), device_type=2)
    with pytest.raises(ValueError, match=r"argument 'beam_scores' expected the device of 'logits'"):
        ops.expand(np.zeros((4, 6), np.float32), gpu, np.arange(4), 2)
    with pytest.raises(ValueError, match=r"argument 'thresholds' expected the device of 'values'"):
        ops.bucketize(cpu, FakeProducer(np.zeros(2), device_type=2))


def test_dlpack_major_version_2_is_refused_with_buffer_error():
    p = FakeProducer(np.zeros((2, 5)), major=2)
    with pytest.raises(BufferError, match=r"argument 'logits' expected DLPack major version 1, got 2.0"):
        ops.topk_entropy(p, 2)
    assert p.deleted == 0  # not ours to delete: the capsule kept its name


def test_vector_lanes_are_refused_with_type_error():
    with pytest.raises(TypeError, match=r"argument 'logits' expected a scalar dtype"):
        ops.topk_entropy(FakeProducer(np.zeros((2, 5)), lanes=4), 2)


def test_fake_producer_happy_path_and_deleter():
    x = np.random.default_rng(5).standard_normal((2, 9)).astype(np.float32)
    p = FakeProducer(x)
    np.testing.assert_array_equal(ops.topk_entropy(p, 3), ops.topk_entropy(x, 3))
    assert p.deleted == 1


def test_both_implementations_export_every_op():
    from heterospec._types import OP_NAMES

    for name in OP_NAMES:
        assert callable(getattr(ops, name)) and callable(getattr(reference, name)), name


def test_agree_torch_inputs(c_ops, ref_ops):
    """C outputs follow the input library (torch here); values equal the reference's."""
    from _agree import random_logits, same
    from _oracles import random_tree

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(109)
    x = random_logits(rng, (3, 40))
    tx = torch.from_numpy(x)
    out = c_ops.topk_entropy(tx, 7)
    assert isinstance(out, torch.Tensor)
    same(out, ref_ops.topk_entropy(tx, 7))
    bs, bn = torch.zeros(3, dtype=torch.float32), torch.tensor([-1, 0, 1])
    c_out, r_out = c_ops.expand(tx, bs, bn, 5, node_offset=2), ref_ops.expand(tx, bs, bn, 5, node_offset=2)
    for c, r in zip(c_out, r_out):
        assert isinstance(c, torch.Tensor)
        same(c, r)
    tokens, parents, _ = random_tree(rng, 3, 40, logits=x)
    tt, tp = torch.from_numpy(tokens), torch.from_numpy(parents)
    pc, nc, dc = c_ops.verify_sample(tt, tp, tx, temperature=0.9, seed=3, offset=4)
    pr, nr, dr = ref_ops.verify_sample(tt, tp, tx, temperature=0.9, seed=3, offset=4)
    assert isinstance(pc, torch.Tensor)
    same(pc, pr)
    assert (nc, dc) == (nr, dr)
