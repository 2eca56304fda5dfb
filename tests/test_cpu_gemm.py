"""``cpu_gemm`` (heterospec.models.cpu_gemm): the target's and the draft's linear layers through oneDNN with
weights packed once, routed only inside ``HeteroSpec.generate``.  The products agree with ``torch.nn.functional
.linear`` to float32 rounding (checked here against a float64 reference computed by NumPy, not by the code under
test), greedy decoding stays equal to the target's own ``generate``, and the model is untouched between calls."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_decoding import eagle3_head, prompts, reference_greedy, tiny_target  # noqa: E402

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
    for p in prompts(6):
        ref = reference_greedy(model, p)
        for pol, d in ((Policy.autoregressive(), None), (Policy.static(3, 3, 10), draft),
                       (Policy.static(2, 1, 4), draft)):
            with HeteroSpec(model, d, pol, cpu_gemm=True) as hs:
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
