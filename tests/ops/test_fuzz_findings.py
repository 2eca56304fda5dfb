"""What fuzzing the ops found (tests/fuzz/fuzz_ops.py, issue 31 item 1), each as a test on both implementations.

Every finding is written out by hand here, input and expectation, so it stays a regression test without the
fuzzer; the fuzzer's own input files stay in tests/fuzz/corpus/ and are replayed by every fuzzing run
(.ci/run stage 2b).  Expected results come from docs/ops.md, never from the code under test."""
import numpy as np
import pytest


def misaligned(values):
    """``values`` copied into memory one byte past an aligned address (a NumPy view at an odd byte offset)."""
    values = np.asarray(values)
    buf = np.zeros(values.nbytes + values.itemsize, np.uint8)
    a = buf[1:1 + values.nbytes].view(values.dtype).reshape(values.shape)
    a[...] = values
    assert a.ctypes.data % values.itemsize == 1 and not a.flags.aligned
    return a


LOGITS = np.array([[0.5, 1.5, -2.0, 3.0]], np.float32)
TREE_TOKENS, TREE_PARENTS = np.array([0, 1, 2]), np.array([-1, 0, 0])
TREE_LOGITS = np.zeros((3, 4), np.float32)


# Finding 1 (UBSan: "load of misaligned address ... for type 'const int64_t'", csrc/core/common.h): an array one byte
# off its alignment was read as its C type -- undefined behaviour, and a fault on a GPU.  Now refused at import.
@pytest.mark.parametrize("call", [
    pytest.param(lambda o: o.topk_entropy(misaligned(LOGITS), 2), id="topk_entropy-logits"),
    pytest.param(lambda o: o.select(misaligned(np.array([0.1, 0.3, 0.2])), 2), id="select-scores"),
    pytest.param(lambda o: o.build_tree(misaligned(np.array([5, 6])), np.array([-1, 0]), np.array([0, 1]), 3),
                 id="build_tree-tokens"),
    pytest.param(lambda o: o.verify_greedy(TREE_TOKENS, misaligned(TREE_PARENTS), TREE_LOGITS), id="verify-parents"),
    pytest.param(lambda o: o.bucketize(np.array([0.5]), misaligned(np.array([0.0, 1.0]))), id="bucketize-thresholds"),
    pytest.param(lambda o: o.kv_compact([misaligned(np.zeros((4, 2), np.float32))], 0, np.array([1])),
                 id="kv_compact-tensors"),
])
def test_misaligned_arrays_are_rejected_naming_the_argument(impl, call):
    with pytest.raises(ValueError, match=r"argument '[a-z_\[\]0-9]+' expected an array aligned to its \d-byte items"):
        call(impl)


def test_an_empty_misaligned_array_is_not_read_so_not_rejected(impl):
    buf = np.zeros(9, np.uint8)
    empty = buf[1:1].view(np.float64)
    assert impl.bucketize(np.array([0.5]), empty).tolist() == [0]


# Finding 2 (the reference accepted what the C core refused): a selected candidate's negative token.  docs/ops.md now
# says which entries build_tree reads: the selected candidates' tokens and parents only.
def test_build_tree_rejects_a_selected_candidates_negative_token(impl):
    with pytest.raises(ValueError, match="argument 'tokens'"):
        impl.build_tree(np.array([5, -1, 7]), np.array([-1, 0, 0]), np.array([0, 1]), 3)


def test_build_tree_ignores_the_unselected_candidates_entries(impl):
    # candidate 1 is not selected: its token (-9) and its parent (99, out of range) are never read
    tree = impl.build_tree(np.array([5, -9, 7]), np.array([-1, 99, 0]), np.array([0, 2]), 3)
    assert np.asarray(tree.tokens).tolist() == [3, 5, 7]
    assert np.asarray(tree.parents).tolist() == [-1, 0, 1]


# Finding 3 (the reference accepted what the C core refused): batched arrays that are not C-contiguous as a whole,
# though each row is (a zero-stride broadcast, every other element of a wider buffer).
@pytest.mark.parametrize("call", [
    pytest.param(lambda o: o.select(np.broadcast_to(np.array([[0.1, 0.2]]), (3, 2)), 1), id="select-broadcast"),
    pytest.param(lambda o: o.select(np.zeros((2, 8))[:, ::2], np.array([1, 1])), id="select-per-row"),
    pytest.param(lambda o: o.select(np.zeros((2, 4)), np.array([1, 1]), m=np.array([4, 0, 4, 0])[::2]),
                 id="select-m-strided"),
    pytest.param(lambda o: o.build_tree(np.zeros((2, 4), np.int64)[:, ::2], np.full((2, 2), -1), np.zeros((2, 1)),
                                        0), id="build_tree-tokens"),
    pytest.param(lambda o: o.expand(np.zeros((2, 1, 8), np.float32)[:, :, ::2], np.zeros((2, 1)),
                                    np.zeros((2, 2), np.int64)[:, ::2], 1), id="expand-logits"),
    pytest.param(lambda o: o.verify_greedy(np.zeros((2, 4), np.int64)[:, ::2], np.array([[-1, 0], [-1, 0]]),
                                           np.zeros((2, 2, 3), np.float32)), id="verify-tokens"),
])
def test_batched_arrays_must_be_contiguous_as_a_whole(impl, call):
    with pytest.raises(ValueError, match="C-contiguous"):
        call(impl)


# Finding 4 (the reference raised OverflowError): integers past int64 where nothing else refused them.
def test_ints_beyond_int64_are_a_value_error(impl):
    with pytest.raises(ValueError, match="argument 'root_token'"):
        impl.build_tree(np.array([5]), np.array([-1]), np.array([0]), 2**64)
    with pytest.raises(ValueError, match="argument 'prefix_len'"):
        impl.kv_compact([], 2**63, np.array([0]))       # no tensors: nothing moves, the int is still checked


# Finding 5 (heterospec.ops accepted what the reference refused): bools as Philox words.
def test_philox_words_are_ints_not_bools(impl):
    with pytest.raises(TypeError, match="argument 'counter'"):
        impl.philox4x32([True, 0, 0, 0], [0, 0])
    assert impl.philox4x32([1, 0, 0, 0], [0, 0]) == impl.philox4x32([np.int64(1), 0, 0, 0], [0, 0])


# Finding 6 (UBSan: "null pointer passed as argument 1, which is declared to never be null", csrc/core/kv.c): a
# tensor with D = 0 (no bytes per row; torch gives an empty tensor no memory, a NULL data pointer) reached memcpy.
def test_kv_compact_on_rows_of_no_bytes_moves_nothing(impl):
    torch = pytest.importorskip("torch")
    empty = torch.zeros((8, 0), dtype=torch.float32)
    impl.kv_compact([empty], 2, np.array([1, 3]))
    assert tuple(empty.shape) == (8, 0)
    full = np.arange(16, dtype=np.float32).reshape(8, 2)
    impl.kv_compact([full, np.zeros((8, 0), np.float32)], 2, np.array([1, 3]))
    assert full[:, 0].tolist() == [0, 2, 6, 10, 8, 10, 12, 14]   # rows 2, 3 <- rows 3, 5 (docs/ops.md kv_compact)


# Finding 7 (the reference accepted what the C core refused): a batch of no rows with n > M.
def test_select_checks_n_against_m_even_without_rows(impl):
    with pytest.raises(ValueError, match="argument 'n'"):
        impl.select(np.zeros((0, 1), np.float32), 2**31 - 1)
    assert impl.select(np.zeros((0, 3), np.float32), 2).shape == (0, 2)


# Finding 8 (the device refused what the CPU accepted): a read-only `seed` (or `offset` without advance_offset) on
# a device was imported for writing; only an offset that advance_offset=True writes must be writable, and then a
# read-only one is the same ValueError on the CPU and on the device (the emulated build: torch has no read-only
# tensors, and DLPack's read-only flag is what a device producer would set).
def test_read_only_seed_and_offset_are_read_alike_on_cpu_and_device(c_ops):
    import heterospec

    def on_cpu(values, readonly=False):
        a = np.array(values)
        a.flags.writeable = not readonly
        return a

    def on_device(values, readonly=False):
        from _dlpack import EmuCuda

        return EmuCuda(np.array(values), readonly=readonly)

    logits = np.array([[0.0, 1.0, 2.0]], np.float32)
    for put in [on_cpu] + ([on_device] if heterospec.build_info().get("cuda_emulated") else []):
        tok, par, lg = put([0]), put([-1]), put(logits)
        out = c_ops.verify_sample(tok, par, lg, temperature=1.0, seed=put([7], True), offset=put([3], True),
                                  device_outputs=True)
        assert len(out) == 4, put
        with pytest.raises(ValueError, match="argument 'offset' expected a writable"):
            c_ops.verify_sample(tok, par, lg, temperature=1.0, seed=put([7], True), offset=put([3], True),
                                device_outputs=True, advance_offset=True)


# Finding 10 (the reference accepted what the C core refused; CI's fuzz stage, 2026-11-26): thresholds -inf, -inf
# are not strictly ascending, but the twin checked np.diff(t) <= 0 and -inf - -inf is NaN, which compares False.
# Both now refuse; so do equal infinities at the top, and the integer checks of the same form (selected, slots)
# compare neighbours instead of subtracting them, which cannot overflow.
@pytest.mark.parametrize("thresholds", [[-np.inf, -np.inf], [0.0, np.inf, np.inf], [-np.inf, -np.inf, 1.0]])
def test_bucketize_refuses_repeated_infinite_thresholds(impl, thresholds):
    with pytest.raises(ValueError, match="argument 'thresholds' expected strictly ascending"):
        impl.bucketize(np.array([0.5]), np.array(thresholds))


def test_bucketize_accepts_ascending_infinite_thresholds(impl):
    # -inf < 0 < inf: the value 0.5 exceeds -inf and 0, not inf (docs/ops.md: bin = thresholds strictly below)
    assert impl.bucketize(np.array([0.5, -np.inf]), np.array([-np.inf, 0.0, np.inf])).tolist() == [2, 0]


def test_kv_compact_slots_at_the_int64_extremes_are_compared_not_subtracted(impl):
    # slots -2**63 then 2**63 - 1 ascend; subtracting them overflows.  Either way the first slot is out of range,
    # the same ValueError from both implementations.
    with pytest.raises(ValueError, match="argument 'slots'"):
        impl.kv_compact([np.zeros((4, 2), np.float32)], 0, np.array([-2**63, 2**63 - 1]))


# Finding 12 (timeouts: the open input timeout-f2d350db of tests/fuzz/open/, and timeout-ea3880da from a replica of
# CI's fuzz stage): the CUDA kv_compact launched one block per leading row of every tensor, even of tensors without
# bytes (S or the row size 0) -- 35,568 blocks for a (2, 234, 76, 0, 1) tensor, a wasted launch on a GPU and a 20 s
# hang in the emulation.  Tensors without bytes now get no blocks; between real tensors they must not shift the
# others' blocks.  The emulated build counts the blocks it runs (_C._emu_blocks), so the launch itself is checked.
def test_device_kv_compact_launches_no_blocks_for_tensors_without_bytes(c_ops):
    import heterospec
    from heterospec import _C

    if not heterospec.build_info().get("cuda_emulated"):
        pytest.skip("needs the emulated CUDA build (HETEROSPEC_CUDA=emu), which counts kernel blocks")
    from _dlpack import EmuCuda

    def full(seed):
        return (np.arange(2 * 8 * 3, dtype=np.float32) + 100 * seed).reshape(2, 8, 3)

    tensors = [np.zeros((64, 8, 0), np.float32), full(1), np.zeros((3, 214, 8, 0), np.float16), full(2),
               np.zeros((40, 8, 0), np.float32)]
    before = _C._emu_blocks()
    c_ops.kv_compact([EmuCuda(t) for t in tensors], 2, EmuCuda(np.array([1, 3])))
    _C.cuda_check(0, 0)
    # the two 2-row tensors: one block per leading row; the three tensors without bytes: none
    assert _C._emu_blocks() - before == 4
    for t, seed in ((tensors[1], 1), (tensors[3], 2)):
        want = full(seed)
        want[:, 2], want[:, 3] = full(seed)[:, 3], full(seed)[:, 5]   # rows 2, 3 <- rows 3, 5 (docs/ops.md)
        assert np.array_equal(t, want)
    # nothing to move anywhere: one block, which only checks the slots
    before = _C._emu_blocks()
    c_ops.kv_compact([EmuCuda(np.zeros((2, 234, 76, 4, 0), np.uint8))], 0, EmuCuda(np.array([0, 2])))
    _C.cuda_check(0, 0)
    assert _C._emu_blocks() - before == 1
    # and a bad slot is still refused when no tensor holds bytes: the checks run in that one block
    before = _C._emu_blocks()
    with pytest.raises(ValueError, match="argument 'slots' expected strictly ascending"):
        c_ops.kv_compact([EmuCuda(np.zeros((4, 8, 0), np.float32))], 0, EmuCuda(np.array([3, 1])))
    assert _C._emu_blocks() - before == 1


# Finding 11 (UBSan in the emulated kernels: "-nan is outside the range of representable values of type 'int'",
# csrc/core/hd_math.h): verify_sample at temperature 5e-324 computed z = x / T = inf for a logit of 6.76, and
# z - max z = inf - inf = NaN reached exp's int conversion; topk_entropy gave 0 for tied maxima at such
# temperatures (the note of the earlier fuzz run).  Temperatures below MIN_TEMPERATURE = 1e-30 are refused now
# (docs/ops.md "Conventions"): at 1e-30 any finite float32 logit divided by T stays finite in float64.
def test_temperatures_at_the_floor_handle_the_largest_logits(impl):
    from heterospec import ops

    assert ops.MIN_TEMPERATURE == 1e-30
    top = np.float32(3.4e38)
    # two tied maxima among extreme logits: softmax(z) over the top 2 is (1/2, 1/2), entropy ln 2
    got = impl.topk_entropy(np.array([[top, -top, top, 0.0]], np.float32), 2, 1e-30)
    assert abs(float(got[0]) - np.log(2)) < 1e-6
    # the fuzzer's row: one clear maximum; at T = 1e-30 every other token has probability 0, so the root's draw
    # is token 0 whatever the uniform (root only: path [0], next token 0)
    logits = np.array([[6.76, 0.85, -np.inf]], np.float32)
    for seed in range(5):
        path, nxt, _ = impl.verify_sample(np.array([2]), np.array([-1]), logits, temperature=1e-30, seed=seed,
                                          offset=1048560)
        assert list(path) == [0] and nxt == 0


def test_generate_refuses_temperatures_between_greedy_and_the_floor():
    from heterospec.engine.loop import _check_generate_args

    with pytest.raises(ValueError, match=r"^generate: argument 'temperature' expected 0 \(greedy\) or a finite "
                                         r"value >= 1e-30, got 1e-31$"):
        _check_generate_args(8, 1e-31, 0, 1.0)
    _check_generate_args(8, 0, 0, 1.0)
    _check_generate_args(8, 1e-30, 0, 1.0)


# Finding 13 (the C core refused what the reference accepted; a CPU-only fuzz worker): kv_compact with no tensors
# and prefix_len 2**63 - 1.  The binding's "no tensors" was S = INT64_MAX, which still refused prefix + slot >=
# INT64_MAX; docs/ops.md bounds the slots by every tensor's S, so with no tensors nothing bounds them.
def test_kv_compact_without_tensors_bounds_no_slot(impl):
    impl.kv_compact([], 2**63 - 1, np.array([0, 5]))
    with pytest.raises(ValueError, match=r"argument 'slots' expected prefix_len \+ slot.* < S = 4"):
        impl.kv_compact([np.zeros((4, 1), np.float32)], 2**63 - 1, np.array([0]))


def test_device_kv_compact_without_tensors_bounds_no_slot(c_ops):
    import heterospec

    if not heterospec.build_info().get("cuda_emulated"):
        pytest.skip("needs the emulated CUDA build for device slots without a GPU")
    from _dlpack import EmuCuda

    c_ops.kv_compact([], 2**63 - 1, EmuCuda(np.array([0, 5])))
    c_ops.kv_compact([], EmuCuda(np.array([2**63 - 1])), EmuCuda(np.array([0, 5])))


# Finding 14 (the C core accepted what the reference refused; a CPU-only worker): select(scores[1, M], n=[1]).
# heterospec.ops turns a Python list given for an array argument into a NumPy array (n, m, a batched root_token,
# ...); the reference refused the list as "not an int".  Both now apply the one rule (_types.sequence_as_array) to
# the same arguments.
def test_a_list_for_per_row_counts_is_an_array_in_both(impl):
    scores = np.array([[0.1, 0.9, 0.5]], np.float32)
    assert impl.select(scores, [1]).tolist() == [[1, -1, -1]]   # width M for per-row n, padded with -1
    assert impl.select(scores, [2], m=[2]).tolist() == [[0, 1, -1]]
    toks, pars = np.array([[5, 6]]), np.array([[-1, 0]])
    tree = impl.build_tree(toks, pars, np.array([[0, 1]]), [7], n=[1])[0]
    assert np.asarray(tree.tokens).tolist() == [[7, 5, -1]]
    logits = np.zeros((1, 2, 8), np.float32)
    logits[0, 0, 5] = 1.0
    path, length, nxt = impl.verify_greedy(np.array([[7, 5]]), np.array([[-1, 0]]), logits, n=[2])
    assert np.asarray(length).tolist() == [2] and np.asarray(path)[0, :2].tolist() == [0, 1]


# Finding 15 (the C core refused what the reference accepted; a CPU-only worker, after 1,026,341 executions): a
# batched expand of no rows with k = 2**31 - 1 > Vd.  As finding 7 for select: the reference checked nothing but
# k >= 1 without rows; it now checks k, d2t and node_offset on a row of zeros, as the C core checks them.
def test_expand_checks_k_against_vd_even_without_rows(impl):
    empty = np.zeros((0, 1, 3), np.float32), np.zeros((0, 1), np.float32), np.zeros((0, 1), np.int64)
    with pytest.raises(ValueError, match="argument 'k'"):
        impl.expand(*empty, 2**31 - 1)
    with pytest.raises(ValueError, match="argument 'd2t'"):
        impl.expand(*empty, 2, d2t=np.array([0, 1]))   # d2t needs one entry per draft token (Vd = 3)
    out = impl.expand(*empty, 2)
    assert [tuple(np.shape(o)) for o in out] == [(0, 2), (0, 2), (0, 2), (0, 1), (0, 2)]
