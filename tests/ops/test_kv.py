"""The kv family of ops, kv_compact and KVTensors: every test of the family in one file, as the C sources are
(csrc/core/kv.c, csrc/cuda/kv.cu, csrc/py/kv.c, heterospec/reference/kv.py; docs/ops.md).

In order: the cases against brute-force expectations (C core and NumPy twin, fixture ``impl``); the C core against
the NumPy twin on random input; batched calls against the same calls row by row; bad input (the documented exception
naming the argument); and on the device (``on_device``): CPU <-> CUDA parity and device-side checks, on a real GPU
or on the emulated build (HETEROSPEC_CUDA=emu, CI stage 2), skipped elsewhere."""
import numpy as np
import pytest
import torch
from _cases import _kv_case
from _device import D, _set_scalar, need_gpu, on_device
from conftest import to_numpy

from heterospec import ops

# ---- against brute-force expectations, C core and NumPy twin (fixture `impl`) --------------------------------------


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_kv_compact(impl, slot_dtype):
    rng = np.random.default_rng(61)
    for trial in range(20):
        plen = int(rng.integers(0, 6))
        m = int(rng.integers(0, 9))
        s_min = plen + m + int(rng.integers(0, 6))
        slots = np.sort(rng.choice(np.arange(s_min - plen + 3), size=m, replace=False)).astype(slot_dtype)
        slots = np.maximum(slots, np.arange(m)).astype(slot_dtype)  # keep slots[i] >= i
        slots = np.array(sorted(set(slots.tolist())), slot_dtype)
        m = len(slots)
        last = int(slots[-1]) if m else 0
        tensors = [
            rng.normal(size=(2, 3, plen + last + 1 + int(rng.integers(0, 4)), 5)).astype(np.float16),
            rng.integers(-100, 100, size=(plen + last + 2, 3)).astype(np.int8),
            rng.random(size=(4, plen + last + 1, 1)) < 0.5,
            rng.normal(size=(1, plen + last + 3, 8)).astype(np.float32),
        ]
        expected = []
        for t in tensors:
            e = t.copy()
            dst = plen + np.arange(m)
            e[..., dst, :] = t[..., plen + slots.astype(np.int64), :]  # fancy indexing copies first
            expected.append(e)
        assert impl.kv_compact(tensors, plen, slots) is None
        for t, e in zip(tensors, expected):
            np.testing.assert_array_equal(t, e)


def test_kv_compact_noop_and_identity(impl):
    rng = np.random.default_rng(62)
    t = rng.normal(size=(3, 10, 4)).astype(np.float32)
    before = t.copy()
    impl.kv_compact([t], 2, np.zeros(0, np.int64))
    np.testing.assert_array_equal(t, before)
    impl.kv_compact((t,), 2, np.arange(5))  # slots == arange: rows copied onto themselves
    np.testing.assert_array_equal(t, before)
    impl.kv_compact([t], 0, np.array([9]))
    np.testing.assert_array_equal(t[:, 0], before[:, 9])
    np.testing.assert_array_equal(t[:, 1:], before[:, 1:])


def test_kv_compact_torch_in_place(impl):
    t = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    before = t.clone()
    impl.kv_compact([t], 1, np.array([1, 4, 6]))
    assert torch.equal(t[:, 1], before[:, 2])
    assert torch.equal(t[:, 2], before[:, 5])
    assert torch.equal(t[:, 3], before[:, 7])
    assert torch.equal(t[:, 0], before[:, 0]) and torch.equal(t[:, 4:], before[:, 4:])


@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_kv_compact_array_plen_equals_int_plen(impl, shape, lib):
    rng = np.random.default_rng(63)
    for trial in range(10):
        plen = int(rng.integers(0, 7))
        slots = np.array(sorted(set((np.arange(5) + rng.integers(0, 3, size=5).cumsum()).tolist())), np.int64)
        a = _kv_case(rng, plen, slots)
        b = [t.copy() for t in a]
        p = np.full(shape, plen, np.int64)
        if lib == "torch":
            p = torch.from_numpy(p)
        impl.kv_compact(a, plen, slots)
        assert impl.kv_compact(b, p, slots) is None
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        assert int(p.reshape(-1)[0]) == plen  # read, never written


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_kv_compact_padded_slots_equal_unpadded(impl, slot_dtype):
    rng = np.random.default_rng(64)
    for trial in range(20):
        plen = int(rng.integers(0, 5))
        m = int(rng.integers(0, 7))
        slots = np.array(sorted(set((np.arange(m) + rng.integers(0, 4, size=m).cumsum()).tolist())), slot_dtype)
        pad = int(rng.integers(1, 6))
        padded = np.concatenate([slots, np.full(pad, -1, slot_dtype)])
        a = _kv_case(rng, plen, slots)
        b = [t.copy() for t in a]
        impl.kv_compact(a, plen, slots)
        impl.kv_compact(b, plen if trial % 2 else np.array(plen), padded)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_kv_compact_all_padding_is_noop(impl):
    rng = np.random.default_rng(65)
    t = rng.normal(size=(3, 10, 4)).astype(np.float32)
    before = t.copy()
    for slots in (np.full(4, -1, np.int64), np.full(1, -1, np.int32), np.full(10, -1, np.int64)):
        impl.kv_compact([t], 9, slots)  # 9 + anything past S would be refused if it were read
        impl.kv_compact([t], np.array([9]), slots)
        np.testing.assert_array_equal(t, before)


def test_kv_tensors_equals_the_list(impl):
    rng = np.random.default_rng(67)
    a = [rng.normal(size=(2, 16, 4)).astype(np.float32), rng.normal(size=(3, 1, 18, 2)).astype(np.float16),
         torch.arange(5 * 17 * 3, dtype=torch.float32).reshape(5, 17, 3)]
    b = [t.clone() if isinstance(t, torch.Tensor) else t.copy() for t in a]
    kvt = impl.KVTensors(b)
    assert len(kvt) == 3 and len(kvt.tensors) == 3 and kvt.tensors[0] is b[0]
    prefix = np.array(3, np.int64)
    for slots in (np.array([1, 4, 5, -1]), np.array([0, 1, 2]), np.array([2, 6, -1, -1], np.int32), np.array([-1])):
        impl.kv_compact(a, int(prefix), slots)
        assert impl.kv_compact(kvt, prefix, slots) is None
        for x, y in zip(a, b):
            np.testing.assert_array_equal(to_numpy(x), to_numpy(y))
        prefix += 2  # a new value each call, same array
    # the same checks as kv_compact's list, before anything moves
    with pytest.raises(ValueError, match=r"argument 'slots' expected prefix_len \+ slot"):
        impl.kv_compact(kvt, 2, np.array([14]))  # 2 + 14 >= 16 (the shortest S)
    empty = impl.KVTensors([])
    assert len(empty) == 0
    impl.kv_compact(empty, 0, np.array([0, 1]))


def test_kv_tensors_keeps_the_tensors_alive(impl):
    import gc

    base = np.arange(4 * 12 * 2, dtype=np.float64).reshape(4, 12, 2)
    kvt = impl.KVTensors([torch.from_numpy(base.copy())])  # the only reference to the tensor
    gc.collect()
    impl.kv_compact(kvt, 1, np.array([3, 5]))
    t = to_numpy(kvt.tensors[0])
    np.testing.assert_array_equal(t[:, 1], base[:, 4])
    np.testing.assert_array_equal(t[:, 2], base[:, 6])
    np.testing.assert_array_equal(t[:, 3:], base[:, 3:])


def test_kv_compact_releases_what_it_imports(impl):
    import sys

    t, slots, prefix = np.zeros((2, 10, 4)), np.array([1, 3, -1]), np.array([2])
    before = [sys.getrefcount(x) for x in (t, slots, prefix)]
    for _ in range(20):
        impl.kv_compact([t], prefix, slots)
        with pytest.raises(ValueError):
            impl.kv_compact([t], prefix, np.array([0, -1, 1]))
        with pytest.raises(TypeError):
            impl.kv_compact([t], prefix.astype(np.int32), slots)
        with pytest.raises(ValueError):
            impl.kv_compact([t], np.array([-1]), slots)
        kvt = impl.KVTensors([t])
        impl.kv_compact(kvt, prefix, slots)
        with pytest.raises(ValueError):
            impl.kv_compact(kvt, prefix, np.array([9]))
        del kvt
    assert [sys.getrefcount(x) for x in (t, slots, prefix)] == before


def test_kv_compact_rejects_slots_or_plen_inside_a_tensor(impl):
    kv = np.zeros((2, 10, 4), np.int64)
    kv[0, 0, :2] = [1, 2]
    with pytest.raises(ValueError, match=r"argument 'slots' expected memory not shared with the tensors"):
        impl.kv_compact([kv], 0, kv[0, 0, :2])
    with pytest.raises(ValueError, match=r"argument 'prefix_len' expected memory not shared with the tensors"):
        impl.kv_compact([kv], kv[1, 9, 3:], np.array([1, 2]))
    assert kv.sum() == 3


def test_kv_compact_rejects_overlapping_tensors(impl):
    # the same tensor twice (keys passed as values too) would be compacted twice: refused, nothing moved
    kv = np.arange(2 * 8 * 3, dtype=np.float32).reshape(2, 8, 3)
    before = kv.copy()
    with pytest.raises(ValueError, match=r"argument 'tensors\[1\]'.*overlap"):
        impl.kv_compact([kv, kv], 2, np.array([0, 2]))
    with pytest.raises(ValueError, match=r"argument 'tensors\[1\]'.*overlap"):
        impl.kv_compact([kv, kv[1:]], 2, np.array([0, 2]))
    np.testing.assert_array_equal(kv, before)
    # disjoint slices of one buffer (a stacked KV cache) are fine
    impl.kv_compact([kv[0], kv[1]], 2, np.array([0, 2]))
    before[:, 3] = before[:, 4]
    np.testing.assert_array_equal(kv, before)


# ---- C core against the NumPy twin on random (hypothesis) inputs ---------------------------------------------------


def test_agree_kv_compact(c_ops, ref_ops):
    rng = np.random.default_rng(106)
    for trial in range(100):
        plen = int(rng.integers(0, 5))
        m = int(rng.integers(0, 8))
        slots = np.array(sorted(set((np.arange(m) + rng.integers(0, 4, size=m).cumsum()).tolist())), np.int64)
        s_len = plen + (int(slots[-1]) if len(slots) else 0) + 1 + int(rng.integers(0, 3))
        tensors = [
            rng.normal(size=(2, s_len, 3)).astype(np.float32),
            rng.integers(0, 1000, size=(3, 1, s_len + 2, 4)).astype(np.int64),
            rng.normal(size=(s_len, 1)).astype(np.float16),
        ]
        copies = [t.copy() for t in tensors]
        slots = slots.astype(rng.choice([np.int32, np.int64]))
        c_ops.kv_compact(tensors, plen, slots)
        ref_ops.kv_compact(copies, plen, slots)
        for a, b in zip(tensors, copies):
            np.testing.assert_array_equal(a, b)


def test_agree_kv_compact_padded_slots_and_plen_arrays(c_ops, ref_ops):
    """-1-padded slots (valid, all padding, or padding followed by an entry), int / 0-d / [1] prefixes, lists and
    KVTensors: the same rows move, or both refuse with the same exception naming the same argument."""
    rng = np.random.default_rng(108)
    outcomes = set()
    for trial in range(200):
        plen = int(rng.integers(0, 5))
        m = int(rng.integers(0, 7))
        slots = (np.arange(m) + rng.integers(0, 4, size=m).cumsum()).astype(np.int64)
        pad = int(rng.integers(0, 4))
        slots = np.concatenate([slots, np.full(pad, -1, np.int64)])
        if pad and rng.random() < 0.2:  # a valid-looking entry after the padding began
            slots[-1] = int(rng.integers(0, 8))
        if len(slots) and rng.random() < 0.1:  # out of order
            slots[int(rng.integers(0, len(slots)))] = int(rng.integers(-1, 9))
        s_len = plen + int(rng.integers(1, 10))
        tensors = [rng.normal(size=(2, s_len, 3)).astype(np.float32),
                   rng.integers(0, 1000, size=(3, s_len + 1, 2)).astype(np.int32)]
        copies = [t.copy() for t in tensors]
        kind = trial % 3
        prefix = plen if kind == 0 else np.array(plen, np.int64) if kind == 1 else np.array([plen], np.int64)
        slots = slots.astype(rng.choice([np.int32, np.int64]))
        results = []
        for m, ts in ((c_ops, tensors), (ref_ops, copies)):
            arg = m.KVTensors(ts) if trial % 2 else ts
            try:
                m.kv_compact(arg, prefix, slots)
                results.append(None)
            except ValueError as e:
                results.append(str(e).split("'")[1])
        assert results[0] == results[1], (trial, plen, slots, s_len, results)
        outcomes.add(results[0])
        for a, b in zip(tensors, copies):
            np.testing.assert_array_equal(a, b)
    assert outcomes == {None, "slots"}, outcomes  # both kinds of case were drawn


# ---- batched calls equal to the same calls row by row --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("per_row_prefix", [False, True])
def test_kv_compact_batch_equals_its_rows(impl, seed, per_row_prefix):
    """kv_compact with slots [batch, m] (rows -1-padded differently) on [batch, ..., S, D] tensors: request b of
    every tensor ends as the unbatched call with slots[b] and prefix_len[b] leaves it."""
    rng = np.random.default_rng(110 + seed)
    B, S, m = 4, 24, 6
    prefixes = rng.integers(0, 8, B).astype(np.int64) if per_row_prefix else 5
    slots = np.full((B, m), -1, np.int64)
    for b in range(B):
        k = int(rng.integers(0, m + 1))
        slots[b, :k] = np.sort(rng.choice(10, k, replace=False))     # distinct, ascending: slots[i] >= i
    kv = [rng.normal(size=(B, 2, S, 4)).astype(np.float32), rng.normal(size=(B, S, 3)).astype(np.float16)]
    want = [a.copy() for a in kv]
    for b in range(B):
        p = int(prefixes[b]) if per_row_prefix else 5
        rows = [w[b] for w in want]
        impl.kv_compact(rows, p, slots[b])
        for w, r in zip(want, rows):
            w[b] = r
    impl.kv_compact(kv, prefixes, slots)
    for got, w in zip(kv, want):
        np.testing.assert_array_equal(got, w)


def test_bad_batched_kv_compact(impl):
    kv = [np.zeros((2, 10, 4), np.float32)]
    good = np.array([[0, 2], [1, -1]], np.int64)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected strictly ascending"):
        impl.kv_compact(kv, 1, np.array([[0, 2], [3, 3]], np.int64))
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected prefix_len \+ slot"
                                         r"|kv_compact: argument 'slots' expected prefix_len \+ slots\[-1\]"):
        impl.kv_compact(kv, np.array([1, 9], np.int64), good)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'prefix_len' expected"):
        impl.kv_compact(kv, np.array([1, 2, 3], np.int64), good)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'prefix_len' expected >= 0"):
        impl.kv_compact(kv, np.array([1, -2], np.int64), good)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'tensors\[0\]' expected an array \[batch = 3"):
        impl.kv_compact(kv, 1, np.zeros((3, 2), np.int64))
    before = kv[0].copy()
    with pytest.raises(ValueError):           # request 1 is bad: request 0 must not have moved either
        impl.kv_compact(kv, 1, np.array([[1, 2], [5, 4]], np.int64))
    np.testing.assert_array_equal(kv[0], before)


# ---- on the device: CPU <-> CUDA parity (a real GPU, or the emulated build), device-side checks --------------------


@on_device
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "uint8"])
def test_kv_compact_parity_many_tensors_one_launch(dtype):
    rng = np.random.default_rng(5)
    shapes = [(2, 3, 20, 8), (1, 20, 5), (4, 20, 16)] * 25  # 75 tensors: more than one launch's 64
    host = [(rng.normal(size=s) * 100).astype(dtype) for s in shapes]
    devs = [D.put(h) for h in host]
    slots = np.array([0, 2, 3, 7, 9], np.int64)
    ops.kv_compact(host, 6, slots)
    ops.kv_compact(devs, 6, D.put(slots))
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)


@on_device
@pytest.mark.parametrize("prepared", [False, True])
def test_kv_compact_tensors_without_bytes_among_others_parity(prepared):
    # Tensors with S > 0 but no bytes per row (D = 0) get no blocks (csrc/cuda/kv.cu, fuzz finding 12); interleaved
    # with real tensors, over more than one launch's 64, every real tensor must still get its own blocks.
    rng = np.random.default_rng(8)
    shapes = [(2, 3, 20, 8), (40, 20, 0), (1, 20, 5), (3, 7, 20, 0), (4, 20, 16)] * 15   # 75 tensors, 30 empty
    host = [(rng.normal(size=s) * 100).astype(np.float32) for s in shapes]
    devs = [D.put(h) for h in host]
    slots = np.array([0, 2, 3, 7, 9], np.int64)
    ops.kv_compact(host, 6, slots)
    ops.kv_compact(ops.KVTensors(devs) if prepared else devs, 6, D.put(slots))
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)


@on_device
def test_kv_compact_bad_slots_move_nothing():
    a = np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)
    d = D.put(a)
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected prefix_len \+ slot < S = 10"):
        ops.kv_compact([d], 5, D.put(np.array([1, 5], np.int64)))
    np.testing.assert_array_equal(D.get(d), a)
    with pytest.raises(ValueError, match=r"argument 'slots' expected strictly ascending"):
        ops.kv_compact([d], 0, D.put(np.array([2, 2], np.int32)))
    np.testing.assert_array_equal(D.get(d), a)


@on_device
@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("prepared", [False, True])
def test_kv_compact_device_plen_and_padded_slots_parity(shape, prepared):
    rng = np.random.default_rng(6)
    shapes = [(2, 3, 20, 8), (1, 20, 5), (4, 20, 16)] * (25 if prepared else 2)  # 75: more than one launch
    host = [(rng.normal(size=s) * 100).astype(np.float32) for s in shapes]
    devs = [D.put(h) for h in host]
    slots = np.array([0, 2, 3, 7, 9, -1, -1], np.int64)
    ops.kv_compact(host, 6, slots[:5])
    ops.kv_compact(ops.KVTensors(devs) if prepared else devs, D.put(np.full(shape, 6, np.int64)), D.put(slots))
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)


@on_device
@pytest.mark.parametrize("prepared", [False, True])
def test_kv_compact_device_plen_is_read_when_the_kernel_runs(prepared):
    """The device-resident loop: one prefix tensor advanced between calls, check=False, padded paths."""
    rng = np.random.default_rng(7)
    host = [rng.normal(size=(2, 40, 8)).astype(np.float32), rng.integers(0, 99, size=(3, 1, 44, 4)).astype(np.int64)]
    devs = [D.put(h) for h in host]
    target = ops.KVTensors(devs) if prepared else devs
    prefix = D.put(np.array([0], np.int64))
    n, p = 6, 0
    for step in range(5):
        length = int(rng.integers(1, n + 1))
        path = np.full(n, -1, np.int64)
        path[:length] = [0] + sorted(rng.choice(np.arange(1, n), size=length - 1, replace=False).tolist())
        ops.kv_compact(host, p, path[:length])
        ops.kv_compact(target, prefix, D.put(path), check=False)  # prefix is read by the kernel, not here
        p += length
        _set_scalar(prefix, p)
    ops.cuda_check(0)
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)
    assert int(D.get(prefix)[0]) == p  # read, never written


@on_device
def test_kv_compact_bad_device_plen_raises_at_cuda_check_and_moves_nothing():
    a = np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)
    d = D.put(a)
    prefix = D.put(np.array([-2], np.int64))
    ops.kv_compact([d], prefix, D.put(np.array([0, 3, -1], np.int64)), check=False)  # no error yet
    with pytest.raises(ValueError, match=r"^cuda_check: argument 'prefix_len' expected >= 0, got -2$"):
        ops.cuda_check(0)  # (the record is raised under the name of the call that checks it)
    np.testing.assert_array_equal(D.get(d), a)
    with pytest.raises(ValueError, match=r"argument 'prefix_len' expected >= 0, got -2"):
        ops.kv_compact(ops.KVTensors([d]), prefix, D.put(np.array([0, 3], np.int32)))
    # refused even with nothing to move: all padding, no slots, no tensors
    for tensors, slots in (([d], np.full(3, -1, np.int64)), ([d], np.zeros(0, np.int64)), ([], np.array([1]))):
        with pytest.raises(ValueError, match=r"argument 'prefix_len' expected >= 0, got -2"):
            ops.kv_compact(tensors, prefix, D.put(slots))
    np.testing.assert_array_equal(D.get(d), a)
    _set_scalar(prefix, 2)  # the same tensor, now valid
    ops.kv_compact([d], prefix, D.put(np.array([0, 3, -1], np.int64)))
    a[:, 3] = a[:, 5]
    np.testing.assert_array_equal(D.get(d), a)


@on_device
def test_kv_compact_device_padding_errors_move_nothing():
    a = np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)
    d = D.put(a)
    with pytest.raises(ValueError, match=r"argument 'slots' expected only -1 \(padding\) after the first -1, got 4 at "
                                         r"\[2\] after -1 at \[1\]"):
        ops.kv_compact([d], D.put(np.array(1, np.int64)), D.put(np.array([0, -1, 4, -1], np.int64)))
    with pytest.raises(ValueError, match=r"argument 'slots' expected only -1"):
        ops.kv_compact([d], 0, D.put(np.array([-1, 0], np.int32)))
    for prefix in (2**62, 2**63 - 1):  # prefix + slot would overflow int64: refused, never wrapped
        with pytest.raises(ValueError, match=r"argument 'slots' expected prefix_len \+ slot < S = 10"):
            ops.kv_compact([d], D.put(np.array([prefix], np.int64)), D.put(np.array([2**62, -1], np.int64)))
    np.testing.assert_array_equal(D.get(d), a)
    ops.kv_compact([d], D.put(np.array([9], np.int64)), D.put(np.full(5, -1, np.int64)))  # all padding: a no-op
    np.testing.assert_array_equal(D.get(d), a)


@on_device
def test_kv_compact_garbage_inputs_agree_with_the_cpu_core():
    """Random slot lists (garbage included: negative, huge, unordered, -1 anywhere) and prefixes up to the int64
    limit: the kernel raises exactly the CPU core's error, or moves exactly the same rows.  On the sanitized
    emulated build (CI stage 2) an out-of-bounds access or an int64 overflow here aborts the run."""
    rng = np.random.default_rng(8)
    pool = np.array([-1, -1, 0, 1, 2, 3, 5, 8, 13, -2, 2**31, 2**62, 2**63 - 1, -(2**63)], np.int64)
    for trial in range(60):
        m = int(rng.integers(0, 6))
        if trial % 3 == 0:  # mostly valid: ascending + padding
            slots = np.sort(rng.choice(9, size=m, replace=False)).astype(np.int64) if m else np.zeros(0, np.int64)
            slots = np.concatenate([slots, np.full(int(rng.integers(0, 3)), -1, np.int64)])
        else:
            slots = rng.choice(pool, size=m)
        prefix = int(rng.choice([0, 1, 3, 2**62, 2**63 - 1, -1, -(2**63)]))
        a = rng.normal(size=(2, 12, 3)).astype(np.float32)
        host, d = a.copy(), D.put(a)
        errors = []
        for fn in (lambda: ops.kv_compact([host], prefix, slots.copy()),
                   lambda: ops.kv_compact([d], D.put(np.array([prefix], np.int64)), D.put(slots))):
            try:
                fn()
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        assert errors[0] == errors[1], (prefix, slots, errors)
        np.testing.assert_array_equal(D.get(d), host)


@on_device
def test_kv_compact_plen_and_kv_tensors_devices():
    d = D.put(np.zeros((2, 10, 4), np.float32))
    with pytest.raises(ValueError, match=r"kv_compact: argument 'prefix_len' expected the device of 'slots'"):
        ops.kv_compact([d], np.array([1], np.int64), D.put(np.array([0, 1])))
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected the device of 'tensors' \(cuda:0\)"):
        ops.kv_compact(ops.KVTensors([d]), 0, np.array([0, 1]))
    with pytest.raises(ValueError, match=r"KVTensors: argument 'tensors\[1\]' expected the device of 'tensors\[0\]'"):
        ops.KVTensors([d, np.zeros((2, 10, 4), np.float32)])
    with pytest.raises(TypeError, match=r"kv_compact: argument 'prefix_len' expected dtype int64"):
        ops.kv_compact([d], D.put(np.array([1], np.int32)), D.put(np.array([0, 1])))
    with pytest.raises(ValueError, match=r"kv_compact: argument 'prefix_len' expected an int or an int64 array with exactly one"):
        ops.kv_compact([d], D.put(np.array([1, 2], np.int64)), D.put(np.array([0, 1])))


@on_device
@need_gpu
def test_graph_captured_kv_compact_follows_the_plen_tensor():
    """A captured commit (KVTensors, padded device path, device prefix) replayed after the prefix changes."""
    import torch

    kv = [torch.randn(2, 4, 64, 16, device="cuda") for _ in range(3)] + [torch.randn(64, 7, device="cuda")]
    kvt = ops.KVTensors(kv)
    prefix = torch.zeros(1, dtype=torch.int64, device="cuda")
    path = torch.tensor([0, 2, 5, -1, -1], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.kv_compact(kvt, prefix, path, check=False)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ops.kv_compact(kvt, prefix, path, check=False)
    torch.cuda.synchronize()
    for p in (3, 10, 40):
        want = [t.clone() for t in kv]
        for w in want:
            w[..., p:p + 3, :] = w[..., [p, p + 2, p + 5], :].clone()
        prefix.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        ops.cuda_check(0)
        for t, w in zip(kv, want):
            assert torch.equal(t, w)
    before = [t.clone() for t in kv]
    prefix.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"argument 'prefix_len' expected >= 0, got -1"):
        ops.cuda_check(0)
    prefix.fill_(60)  # 60 + 5 >= 64: the slots error, nothing moved
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"argument 'slots' expected prefix_len \+ slot < S = 64"):
        ops.cuda_check(0)
    for t, b in zip(kv, before):
        assert torch.equal(t, b)


@on_device
@pytest.mark.parametrize("dtype", ["float16", "uint8"])
def test_batched_kv_compact_on_the_device_equals_the_cpu_batch(dtype):
    """kv_compact with slots [batch, m] and a device prefix array [batch] over 65 [batch, ..., S, D] tensors (two
    launches; 16-byte and odd rows): the CPU core's batch (the batched cases above: equal to the rows); a bad request
    moves nothing in any request."""
    rng = np.random.default_rng(8)
    B = 3
    shapes = [(B, 20, 8), (B, 20, 5)] * 32 + [(B, 1, 20, 8)]
    host = [(rng.normal(size=s) * 100).astype(dtype) for s in shapes]
    devs = [D.put(h) for h in host]
    slots = np.array([[0, 2, 3, -1], [1, 4, 6, 9], [-1, -1, -1, -1]], np.int64)
    prefix = np.array([6, 2, 19], np.int64)
    ops.kv_compact(host, prefix, slots)
    ops.kv_compact(devs, D.put(prefix), D.put(slots))
    for h, d in zip(host, devs):
        np.testing.assert_array_equal(D.get(d), h)
    before = [D.get(d).copy() for d in devs]
    with pytest.raises(ValueError, match=r"kv_compact: argument 'slots' expected prefix_len \+ slot < S = 20, got 12 \+ 9"):
        ops.kv_compact(devs, D.put(np.array([0, 12, 0], np.int64)), D.put(slots))
    for b, d in zip(before, devs):
        np.testing.assert_array_equal(D.get(d), b)
