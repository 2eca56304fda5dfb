"""``cpu_gemm`` (heterospec.models.cpu_gemm): the target's and the draft's linear layers through oneDNN with
weights packed once, or heterospec's few-rows kernel (``rows``), routed only inside ``HeteroSpec.generate``.
oneDNN's products agree with a float64 reference computed by NumPy to float32 rounding; ``rows`` equals its
NumPy reference (heterospec.reference.rows_linear) bit for bit; greedy decoding stays equal to the target's own
``generate``, and the model is untouched between calls."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _models import eagle3_head, prompts, reference_greedy, tiny_target  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.models import cpu_gemm  # noqa: E402
from heterospec.reference import rows_linear  # noqa: E402

needs = pytest.mark.skipif(not cpu_gemm.available(), reason="this torch build has no oneDNN packed linear")
needs_rows = pytest.mark.skipif(not cpu_gemm.rows_available(), reason="heterospec._gemm was not built here")
PATH_MARKS = [pytest.param("onednn", marks=needs), pytest.param("rows", marks=needs_rows)]


def check_product(path, y, x, lin):
    """``rows``: the reference's bits; ``onednn``: a float64 product to float32 rounding."""
    w = lin.weight.detach().numpy()
    b = None if lin.bias is None else lin.bias.detach().numpy()
    x2 = x.reshape(-1, x.shape[-1]).numpy()
    if path == "rows":
        np.testing.assert_array_equal(y.detach().numpy().reshape(x2.shape[0], -1), rows_linear(x2, w, b))
    else:
        ref = x2.astype(np.float64) @ w.astype(np.float64).T + (0.0 if b is None else b.astype(np.float64))
        np.testing.assert_allclose(y.detach().numpy().reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATH_MARKS)
@pytest.mark.parametrize("rows", [1, 2, 4, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_its_reference(path, rows, bias):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(2, rows, 48)
    with cpu_gemm.PackedLinears([lin], path=path):
        assert "forward" in vars(lin)           # routed inside the block
        y = lin(x)
        y_strided = lin(torch.randn(rows, 96)[:, ::2])   # a strided input: copied, not misread
    assert "forward" not in vars(lin)           # and back to nn.Linear after it
    assert y.shape == (2, rows, 80) and y.dtype == torch.float32
    check_product(path, y, x, lin)
    assert y_strided.shape == (rows, 80)


@pytest.mark.parametrize("path", PATH_MARKS)
def test_a_weight_written_after_packing_is_packed_again(path):
    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(3, 16)
    g = cpu_gemm.PackedLinears([lin], path=path)
    assert g.prepare() == 1
    with torch.no_grad():
        lin.weight.mul_(-2.0)
    with g:
        y = lin(x)
    check_product(path, y, x, lin)


@needs_rows
def test_rows_takes_torchs_default_for_an_input_that_is_not_float32():
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16, dtype=torch.float64)
    with cpu_gemm.PackedLinears([lin], path="rows"):
        with pytest.raises(RuntimeError, match="dtype"):   # exactly what nn.Linear does with it
            lin(x)


def test_layers_it_does_not_pack_are_left_alone():
    lin16 = torch.nn.Linear(8, 8).to(torch.float16)
    conv = torch.nn.Conv1d(2, 2, 1)
    with cpu_gemm.PackedLinears([torch.nn.Sequential(lin16, conv)]):
        assert "forward" not in vars(lin16) and "forward" not in vars(conv)


class _Router(torch.nn.Linear):
    """A linear layer with a forward of its own (PhiMoE's and Llama 4's routers return their top-k too)."""

    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.topk(2, dim=-1).indices


def test_a_linear_subclass_with_its_own_forward_is_left_alone():
    """Routing such a layer to a packed path replaced its forward by a plain product: PhiMoE's MoE blocks then failed
    inside transformers (its router's three outputs unpacked from one tensor)."""
    router, plain = _Router(16, 8), torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    want = router(x)
    with cpu_gemm.PackedLinears([torch.nn.Sequential(router, plain)]):
        assert "forward" not in vars(router) and "forward" in vars(plain)
        got = router(x)
    assert isinstance(got, tuple) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not cpu_gemm.plain_linear(router) and cpu_gemm.plain_linear(plain)


def test_cpu_gemm_argument_errors():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"argument 'cpu_gemm' expected 'auto', True, False, 'onednn' or 'rows', "
                                         r"got 'yes'"):
        cpu_gemm.wanted("yes", model)
    with pytest.raises(ValueError, match=r"argument 'cpu_gemm' expected 'auto' or False here .*float16.*got True"):
        cpu_gemm.wanted(True, model.to(torch.float16))
    with pytest.raises(ValueError, match=r"argument 'cpu_gemm' expected 'auto' or False here \('rows' needs a CPU "
                                         r"model in float32.*bfloat16\), got 'rows'"):
        cpu_gemm.wanted("rows", torch.nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"argument 'path' expected one of"):
        cpu_gemm.PackedLinears([model], path="mkl")
    assert cpu_gemm.wanted(False, model) == ()
    assert cpu_gemm.wanted("auto", model.to(torch.float16)) == ()
    assert cpu_gemm.wanted("auto", model.to(torch.float32)) == cpu_gemm.paths_for(torch.float32)
    if cpu_gemm.rows_available():
        assert cpu_gemm.wanted(True, model) == ("rows",) and cpu_gemm.wanted("rows", model) == ("rows",)


@needs
@needs_rows
def test_true_takes_onednn_where_the_kernel_has_only_its_portable_loop(monkeypatch):
    """A CPU without AVX2 (ARM) runs `rows` in its portable loop, ~8x slower than AVX2: True then means oneDNN;
    'auto' still times `rows` there (and keeps it only where it wins), 'rows' still forces it."""
    model = torch.nn.Linear(4, 4)
    monkeypatch.setattr(cpu_gemm._rows_module(), "isa_best", lambda: 0)
    assert cpu_gemm.wanted(True, model) == ("onednn",)
    assert "rows" in cpu_gemm.wanted("auto", model) and cpu_gemm.wanted("rows", model) == ("rows",)


def test_without_the_kernel_rows_is_refused_and_never_measured(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_rows_module", lambda: None)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"'rows' needs .*heterospec._gemm, absent from this install"):
        cpu_gemm.wanted("rows", model)
    assert "rows" not in cpu_gemm.wanted("auto", model)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("path", PATH_MARKS)
def test_greedy_decoding_with_packed_gemm_equals_the_targets_generate(arch, path, tmp_path):
    model = tiny_target(arch)
    draft = eagle3_head(model, tmp_path / "draft")
    refs = [(p, reference_greedy(model, p)) for p in prompts(6)]
    for pol, d in ((Policy.autoregressive(), None), (Policy.static(3, 3, 10), draft), (Policy.static(2, 1, 4), draft)):
        # one engine (one packing) for every prompt; transformers' forward, whose layers cpu_gemm routes
        with HeteroSpec(model, d, pol, cpu_gemm=path, cpu_decoder=False) as hs:
            for p, ref in refs:
                out, _ = hs.generate(p, max_new_tokens=ref.shape[1] - p.shape[1])
                assert out.tolist() == ref.tolist()
                # between calls the model is plain torch again (HF's generate in the same process is untouched)
                assert not any("forward" in vars(m) for m in model.modules())


def test_heterospec_refuses_cpu_gemm_true_where_it_cannot_run():
    model = tiny_target("llama").to(torch.float16)
    with pytest.raises(ValueError, match="argument 'cpu_gemm'"):
        HeteroSpec(model, cpu_gemm=True, cpu_decoder=False)


def test_auto_packs_bfloat16_only_where_onednn_runs_it(monkeypatch):
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert cpu_gemm.wanted("auto", model) == ()
    with pytest.raises(ValueError, match=r"argument 'cpu_gemm' expected 'auto' or False here .*bfloat16.*got True"):
        cpu_gemm.wanted(True, model)
    assert ("onednn" in cpu_gemm.wanted("auto", model.to(torch.float32))) is cpu_gemm.available()


# --- 'auto' measures the path (issue 42.1) ------------------------------------------------------------------


class FakeTimer:
    """{path: seconds} as a machine would report them: ``fastest[rows]`` (a path) takes 0.5 s at that probed row
    count where it runs, every other path 1 s (ties: the earlier path stays); counts its calls."""

    def __init__(self, fastest=None):
        self.fastest = fastest or {}
        self.calls = []

    def __call__(self, layers, rows, reps, paths):
        self.calls.append((cpu_gemm.shape_key(layers[0]), rows))
        assert set(paths) <= set(cpu_gemm.paths_for(layers[0].weight.dtype))
        return {p: 0.5 if self.fastest.get(rows) == p else 1.0 for p in ("default", *paths)}


def _two_shapes():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64, bias=False),
                               torch.nn.Linear(64, 96))


@pytest.fixture
def fresh_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("HETEROSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_gemm, "_CHOICES", {})
    return tmp_path


EACH_CLASS = {1: "rows", 8: "onednn", 48: "default"}


@needs
@needs_rows
def test_the_fastest_path_of_each_row_class_is_picked(fresh_choices):
    model = _two_shapes()
    timer = FakeTimer(EACH_CLASS)
    choice = cpu_gemm.choose([model], timer=timer)
    assert choice == {"float32 64x96 bias": ("rows", "onednn", "default"),
                      "float32 96x64": ("rows", "onednn", "default")}
    # one timing per shape and probed row count: the two 64x96 layers are one group
    assert sorted(timer.calls) == sorted((k, r) for k in choice for r in cpu_gemm.PROBE_ROWS)
    cpu_gemm._CHOICES.clear()
    never = cpu_gemm.choose([model], timer=FakeTimer(), cache=False)   # all equal: torch's default stays
    assert set(never.values()) == {("default",) * 3}
    off = cpu_gemm.PackedLinears([model], choice=never)
    assert off.prepare() == 0 and off.describe() == "off"
    with off:
        assert not any("forward" in vars(m) for m in model.modules())   # nothing routed, nothing packed


@needs
@needs_rows
def test_the_choice_is_kept_for_the_process_and_on_disk(fresh_choices):
    import json

    model = _two_shapes()
    first = FakeTimer(EACH_CLASS)
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
    # an install without the kernel measures again what names it
    cpu_gemm._CHOICES.clear()
    gone = FakeTimer()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_gemm, "_rows_module", lambda: None)
        assert set(cpu_gemm.choose([model], timer=gone).values()) == {("default",) * 3}
    assert len(gone.calls) == 2 * len(cpu_gemm.PROBE_ROWS)


@needs
@needs_rows
def test_under_torch_compile_rows_is_never_chosen_and_that_choice_is_kept_apart(fresh_choices):
    """dynamo cannot trace a call into heterospec._gemm (a graph break per layer): a compiled forward's choice
    leaves ``rows`` out, and is stored beside the full choice, not over it."""
    import json

    model = _two_shapes()
    full = cpu_gemm.choose([model], timer=FakeTimer(EACH_CLASS))
    timer = FakeTimer(EACH_CLASS)
    traced = cpu_gemm.choose([model], timer=timer, exclude=("rows",))
    assert traced == {k: ("default", "onednn", "default") for k in full} and full != traced
    assert len(timer.calls) == 2 * len(cpu_gemm.PROBE_ROWS)
    stored = json.loads((fresh_choices / cpu_gemm.CHOICES_FILE).read_text())[cpu_gemm.machine_key()]
    assert stored["float32 96x64 without rows"] == ["default", "onednn", "default"]
    assert stored["float32 96x64"] == ["rows", "onednn", "default"]
    with pytest.raises(ValueError, match=r"'rows' needs .*and no torch.compile"):
        cpu_gemm.wanted("rows", model, traced=True)
    assert cpu_gemm.wanted(True, model, traced=True) == ("onednn",)


@needs
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
        cpu_gemm.choose([_two_shapes()], timer=FakeTimer({} if isa == "AMX" else dict.fromkeys((1, 8, 48), "onednn")))
    monkeypatch.setattr(measure, "cpu_isa", real)
    info = measure.machine_info()
    name = info.get("cpu_model") or info["processor"]
    rest = f"| {info['cpus']} cores | torch {info['torch']} | {info['torch_threads']} threads"
    assert keys == [f"{name} (AMX) {rest}", f"{name} (AVX-512) {rest}"]
    stored = json.loads((fresh_choices / cpu_gemm.CHOICES_FILE).read_text())
    assert {k: v["float32 96x64"] for k, v in stored.items()} == {keys[0]: ["default"] * 3,
                                                                  keys[1]: ["onednn"] * 3}


def test_a_broken_choices_file_is_measured_again(fresh_choices):
    (fresh_choices / cpu_gemm.CHOICES_FILE).write_text("{not json")
    t = FakeTimer()
    assert set(cpu_gemm.choose([_two_shapes()], timer=t).values()) == {("default",) * 3}
    assert len(t.calls) == 2 * len(cpu_gemm.PROBE_ROWS)


@needs
@needs_rows
def test_each_row_class_runs_the_path_chosen_for_it(monkeypatch):
    """One row through oneDNN, 2-16 rows through the few-rows kernel, more rows torch's default (all three spied
    on); each output agrees with its reference."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(192, 320)
    seen = []
    g = cpu_gemm._rows_module()
    linear, pointwise, kernel = torch.nn.functional.linear, torch.ops.mkldnn._linear_pointwise, g.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: seen.append("default") or linear(*a))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: seen.append("onednn") or pointwise(*a))
    monkeypatch.setattr(g, "linear", lambda *a: seen.append("rows") or kernel(*a))
    g = cpu_gemm.PackedLinears([lin], choice={cpu_gemm.shape_key(lin): ("onednn", "rows", "default")})
    for rows, path in ((1, "onednn"), (8, "rows"), (16, "rows"), (17, "default"), (40, "default")):
        x = torch.randn(2, rows, 192)[:1]   # [1, rows, 192]: rows per call as the engine sends them
        seen.clear()
        with g:
            y = lin(x)
        assert seen == [path], rows
        assert not y.requires_grad   # inference only, whichever path: the ops take it through DLPack
        check_product("onednn" if path != "rows" else "rows", y, x, lin)


@needs
def test_the_engine_reports_its_matrix_path(fresh_choices, monkeypatch):
    model = tiny_target("llama")
    p = prompts(1)[0]
    monkeypatch.setattr(cpu_gemm, "_time_group", FakeTimer({8: "onednn", 48: "onednn"}))
    with HeteroSpec(model, cpu_gemm="auto", cpu_decoder=False) as hs:
        _, st = hs.generate(p, max_new_tokens=4)
    shapes = len({cpu_gemm.shape_key(m) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    assert st.cpu_gemm == hs.cpu_gemm == (f"matrix paths: 1 row default {shapes}/{shapes} shapes; 2-16 onednn "
                                          f"{shapes}/{shapes}; 17+ onednn {shapes}/{shapes} (measured)")
    with HeteroSpec(model, cpu_gemm="onednn", cpu_decoder=False) as hs:
        assert hs.generate(p, max_new_tokens=2)[1].cpu_gemm.endswith("(forced)")
    with HeteroSpec(model, cpu_gemm=False, cpu_decoder=False) as hs:
        assert hs.generate(p, max_new_tokens=2)[1].cpu_gemm == "off"
