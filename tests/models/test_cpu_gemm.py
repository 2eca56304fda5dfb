"""``cpu_gemm`` (heterospec.models.cpu_gemm): the target's and the draft's linear layers through oneDNN with
weights packed once, routed only inside ``HeteroSpec.generate``.  The products agree with ``torch.nn.functional
.linear`` to float32 rounding (checked here against a float64 reference computed by NumPy, not by the code under
test), greedy decoding stays equal to the target's own ``generate``, and the model is untouched between calls."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _models import eagle3_head, prompts, reference_greedy, tiny_target  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.models import cpu_gemm  # noqa: E402

needs = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN packed linear")


@needs
@pytest.mark.parametrize("rows", [1, 2, 4, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_a_float64_product(rows, bias):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(2, rows, 48)
    with cpu_gemm.PackedLinears([lin]):
        assert "forward" in vars(lin)           # routed inside the block
        y = lin(x)
    assert "forward" not in vars(lin)           # and back to nn.Linear after it
    ref = x.double().numpy() @ lin.weight.detach().double().numpy().T
    if bias:
        ref = ref + lin.bias.detach().double().numpy()
    assert y.shape == (2, rows, 80) and y.dtype == torch.float32
    np.testing.assert_allclose(y.detach().numpy(), ref, rtol=1e-5, atol=1e-5)


@needs
def test_a_weight_written_after_packing_is_packed_again():
    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(3, 16)
    g = cpu_gemm.PackedLinears([lin])
    assert g.prepare() == 1
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    with g:
        y = lin(x)
    np.testing.assert_allclose(y.detach().numpy(), x.numpy() @ lin.weight.detach().numpy().T, rtol=1e-5, atol=1e-5)


def test_layers_it_does_not_pack_are_left_alone():
    lin16 = torch.nn.Linear(8, 8).to(torch.float16)
    conv = torch.nn.Conv1d(2, 2, 1)
    with cpu_gemm.PackedLinears([torch.nn.Sequential(lin16, conv)]):
        assert "forward" not in vars(lin16) and "forward" not in vars(conv)


def test_cpu_gemm_argument_errors():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"argument 'cpu_gemm' expected 'auto', True or False, got 'yes'"):
        cpu_gemm.wanted("yes", model)
    with pytest.raises(ValueError, match=r"argument 'cpu_gemm' expected 'auto' or False here .*float16.*got True"):
        cpu_gemm.wanted(True, model.to(torch.float16))
    assert cpu_gemm.wanted(False, model) is False
    assert cpu_gemm.wanted("auto", model.to(torch.float16)) is False


@needs
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_decoding_with_packed_gemm_equals_the_targets_generate(arch, tmp_path):
    model = tiny_target(arch)
    draft = eagle3_head(model, tmp_path / "draft")
    refs = [(p, reference_greedy(model, p)) for p in prompts(6)]
    for pol, d in ((Policy.autoregressive(), None), (Policy.static(3, 3, 10), draft), (Policy.static(2, 1, 4), draft)):
        with HeteroSpec(model, d, pol, cpu_gemm=True) as hs:      # one engine (one packing) for every prompt
            for p, ref in refs:
                out, _ = hs.generate(p, max_new_tokens=ref.shape[1] - p.shape[1])
                assert out.tolist() == ref.tolist()
                # between calls the model is plain torch again (HF's generate in the same process is untouched)
                assert not any("forward" in vars(m) for m in model.modules())


def test_heterospec_refuses_cpu_gemm_true_where_it_cannot_run():
    model = tiny_target("llama").to(torch.float16)
    with pytest.raises(ValueError, match="argument 'cpu_gemm'"):
        HeteroSpec(model, cpu_gemm=True)


def test_auto_packs_bfloat16_only_where_onednn_runs_it(monkeypatch):
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert cpu_gemm.wanted("auto", model) is False
    with pytest.raises(ValueError, match=r"argument 'cpu_gemm' expected 'auto' or False here .*bfloat16.*got True"):
        cpu_gemm.wanted(True, model)
    assert cpu_gemm.wanted("auto", model.to(torch.float32)) is cpu_gemm.available()


# --- 'auto' measures the path (issue 42.1) ------------------------------------------------------------------


class FakeTimer:
    """(default, packed) seconds as a machine would report them: the packed path ``slow`` at the row counts
    listed, fast elsewhere; counts its calls."""

    def __init__(self, packed_slow_at=()):
        self.slow = set(packed_slow_at)
        self.calls = []

    def __call__(self, layers, rows, reps):
        self.calls.append((cpu_gemm.shape_key(layers[0]), rows))
        return (1.0, 2.0) if rows in self.slow else (1.0, 0.5)


def _two_shapes():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64, bias=False),
                               torch.nn.Linear(64, 96))


@pytest.fixture
def fresh_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_gemm, "_CHOICES", {})
    return tmp_path


def test_a_slower_packed_path_is_never_picked(fresh_choices):
    model = _two_shapes()
    one_row_slow = FakeTimer(packed_slow_at=(1,))
    choice = cpu_gemm.choose([model], timer=one_row_slow)
    assert choice == {"float32 64x96 bias": (False, True, True), "float32 96x64": (False, True, True)}
    # one timing per shape and probed row count: the two 64x96 layers are one group
    assert sorted(one_row_slow.calls) == sorted((k, r) for k in choice for r in cpu_gemm.PROBE_ROWS)
    cpu_gemm._CHOICES.clear()
    never = cpu_gemm.choose([model], timer=FakeTimer(packed_slow_at=cpu_gemm.PROBE_ROWS), cache=False)
    assert set(never.values()) == {(False, False, False)}
    off = cpu_gemm.PackedLinears([model], choice=never)
    assert off.prepare() == 0 and off.describe() == "off"
    with off:
        assert not any("forward" in vars(m) for m in model.modules())   # nothing routed, nothing packed


def test_the_choice_is_kept_for_the_process_and_on_disk(fresh_choices):
    import json

    model = _two_shapes()
    first = FakeTimer(packed_slow_at=(48,))
    choice = cpu_gemm.choose([model], timer=first)
    assert len(first.calls) == 2 * len(cpu_gemm.PROBE_ROWS)
    again = FakeTimer()
    assert cpu_gemm.choose([model], timer=again) == choice and again.calls == []      # this process
    stored = json.loads((fresh_choices / cpu_gemm.CHOICES_FILE).read_text())
    assert stored == {cpu_gemm.machine_key(): {k: list(v) for k, v in choice.items()}}
    cpu_gemm._CHOICES.clear()                                                           # a new process
    assert cpu_gemm.choose([model], timer=again) == choice and again.calls == []
    # another shape is measured and added; the stored ones stay
    bigger = torch.nn.Linear(64, 128)
    cpu_gemm.choose([bigger], timer=again)
    assert again.calls == [("float32 64x128 bias", r) for r in cpu_gemm.PROBE_ROWS]
    stored = json.loads((fresh_choices / cpu_gemm.CHOICES_FILE).read_text())[cpu_gemm.machine_key()]
    assert set(stored) == {"float32 64x96 bias", "float32 96x64", "float32 64x128 bias"}


def test_a_choice_is_kept_apart_for_cpus_of_one_model_name_with_other_units(fresh_choices, monkeypatch):
    import json

    from heterospec import measure

    # cloud VMs of different generations report the same model name; their fastest matrix paths differ
    assert measure.cpu_isa("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile".split()) == "AMX"
    assert measure.cpu_isa("fpu avx2 avx512f avx512_bf16".split()) == "AVX-512 BF16"
    assert measure.cpu_isa("fpu sse4_2 avx2 fma".split()) == "AVX2"
    assert measure.cpu_isa("fp asimd sve".split()) == "SVE" and measure.cpu_isa(["fpu"]) == ""
    real = measure.cpu_isa
    keys = []
    for isa in ("AMX", "AVX-512"):   # this CPU as if its flags named each unit
        monkeypatch.setattr(measure, "cpu_isa", lambda flags, isa=isa: isa)
        keys.append(cpu_gemm.machine_key())
        cpu_gemm.choose([_two_shapes()], timer=FakeTimer(packed_slow_at=(1,) if isa == "AMX" else ()))
    monkeypatch.setattr(measure, "cpu_isa", real)
    info = measure.machine_info()
    name = info.get("cpu_model") or info["processor"]
    rest = f"| {info['cpus']} cores | torch {info['torch']} | {info['torch_threads']} threads"
    assert keys == [f"{name} (AMX) {rest}", f"{name} (AVX-512) {rest}"]
    stored = json.loads((fresh_choices / cpu_gemm.CHOICES_FILE).read_text())
    assert {k: v["float32 96x64"] for k, v in stored.items()} == {keys[0]: [False, True, True],
                                                                  keys[1]: [True, True, True]}


def test_a_broken_choices_file_is_measured_again(fresh_choices):
    (fresh_choices / cpu_gemm.CHOICES_FILE).write_text("{not json")
    t = FakeTimer()
    assert set(cpu_gemm.choose([_two_shapes()], timer=t).values()) == {(True, True, True)}
    assert len(t.calls) == 2 * len(cpu_gemm.PROBE_ROWS)


@needs
def test_each_row_class_runs_the_path_chosen_for_it(monkeypatch):
    """One row through torch's default, 2-16 rows packed, more rows default (both paths spied on); each output
    agrees with a float64 product."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(192, 320)
    seen = []
    linear, pointwise = torch.nn.functional.linear, torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: seen.append("default") or linear(*a))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: seen.append("packed") or pointwise(*a))
    g = cpu_gemm.PackedLinears([lin], choice={cpu_gemm.shape_key(lin): (False, True, False)})
    for rows, path in ((1, "default"), (8, "packed"), (16, "packed"), (17, "default"), (40, "default")):
        x = torch.randn(2, rows, 192)[:1]   # [1, rows, 192]: rows per call as the engine sends them
        seen.clear()
        with g:
            y = lin(x)
        assert seen == [path], rows
        assert not y.requires_grad   # inference only, whichever path: the ops take it through DLPack
        ref = x.double().numpy() @ lin.weight.detach().double().numpy().T + lin.bias.detach().double().numpy()
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)


@needs
def test_the_engine_reports_its_matrix_path(fresh_choices, monkeypatch):
    model = tiny_target("llama")
    p = prompts(1)[0]
    monkeypatch.setattr(cpu_gemm, "_time_group", FakeTimer(packed_slow_at=(1,)))
    with HeteroSpec(model, cpu_gemm="auto") as hs:
        _, st = hs.generate(p, max_new_tokens=4)
    shapes = len({cpu_gemm.shape_key(m) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    assert st.cpu_gemm == hs.cpu_gemm == (f"packed for 1 row: 0/{shapes} shapes, 2-16: {shapes}/{shapes}, "
                                          f"17+: {shapes}/{shapes} (measured)")
    with HeteroSpec(model, cpu_gemm=True) as hs:
        assert hs.generate(p, max_new_tokens=2)[1].cpu_gemm.endswith("(forced)")
    with HeteroSpec(model, cpu_gemm=False) as hs:
        assert hs.generate(p, max_new_tokens=2)[1].cpu_gemm == "off"
