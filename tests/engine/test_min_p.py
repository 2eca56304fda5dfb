"""min-p sampling (HuggingFace's ``MinPLogitsWarper``; vLLM's and llama.cpp's ``min_p``) in the speculative cycle:
the warpers' mask against HuggingFace's own warper objects applied in its order, the sampled draws through
``custom_generate`` against ``HeteroSpec.generate``, and bad input.  The distribution itself is tested by chi-square
in test_decoding (its ``minp`` case) and recorded steps against the eager engine in test_graphs."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft  # noqa: E402
from _models import DEVICE, V, prompts, tiny_target  # noqa: E402

from heterospec import HeteroSpec, Policy, custom_generate  # noqa: E402
from heterospec.engine.processors import with_min_p  # noqa: E402

W = transformers.generation.logits_process


def _hf_chain(logits, temperature, top_k, top_p, min_p):
    """HuggingFace's warpers as its generate builds them from a generation config, in its order."""
    chain = [W.TemperatureLogitsWarper(temperature)]
    if top_k:
        chain.append(W.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        chain.append(W.TopPLogitsWarper(top_p))
    chain.append(W.MinPLogitsWarper(min_p))
    z = logits.float()
    for w in chain:
        z = w(None, z)
    return z


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.3), (1.3, 40, 1.0, 0.1), (1.0, 0, 0.8, 0.2), (0.6, 50, 0.9, 0.5),
    (1.0, 0, 0.5, 1.0)])
def test_the_mask_is_huggingfaces_warpers_in_its_order(temperature, top_k, top_p, min_p):
    """Random logits [3, 5, 300] with repeated values (ties): the tokens set to -inf are the ones HF's chain removes,
    top-k and top-p come back off, and softmax at the temperature over the rest is HF's distribution."""
    g = torch.Generator().manual_seed(int(1000 * min_p) + top_k)
    logits = (torch.randn(3, 5, 300, generator=g) * 3).round(decimals=1)
    out, k, p = with_min_p(logits, temperature, top_k, top_p, min_p)
    ref = _hf_chain(logits.view(15, 300), temperature, top_k, top_p, min_p).view(3, 5, 300)
    assert (k, p) == (0, 1.0)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert 0 < torch.isinf(out).sum() < out.numel()
    assert torch.allclose(torch.softmax(out / temperature, -1), torch.softmax(ref, -1), atol=1e-6)
    # min-p after top-p is not min-p before it: the nucleus of the renormalised tokens would be smaller
    if top_p < 1.0 and min_p < 1.0:
        first = with_min_p(logits, temperature, 0, 1.0, min_p)[0]
        before = _hf_chain(first.view(15, 300), temperature, top_k, top_p, 1e-9).view(3, 5, 300)
        assert torch.isinf(before).sum() >= torch.isinf(out).sum()


def test_without_min_p_the_logits_pass_through():
    logits = torch.randn(2, 3, 50)
    out, k, p = with_min_p(logits, 0.8, 7, 0.9, 0.0)
    assert out is logits and (k, p) == (7, 0.9)


def test_min_p_changes_the_draws_and_custom_generate_takes_it_from_the_config():
    """The generation config's min_p reaches the cycle (its MinPLogitsWarper is no longer refused): custom_generate
    draws what HeteroSpec.generate draws with the same seed and min_p, which is not what it draws without."""
    model = tiny_target("llama")
    draft = NoisyDraft(32, V).to(DEVICE)
    policy = Policy.static(3, 3, 10)
    p = prompts(1)[0]
    kw = dict(max_new_tokens=24, temperature=1.5, top_p=0.95)
    with HeteroSpec(model, draft, policy, cuda_graphs=False) as hs:
        ours = [hs.generate(p, seed=s, min_p=0.2, eos_token_id=[], **kw)[0] for s in range(4)]
        plain = [hs.generate(p, seed=s, eos_token_id=[], **kw)[0] for s in range(4)]
    assert [o.tolist() for o in ours] != [o.tolist() for o in plain]
    for s in range(4):
        out = model.generate(p, attention_mask=torch.ones_like(p), custom_generate=custom_generate, draft=draft,
                             policy=policy, seed=s, do_sample=True, min_p=0.2, top_k=0, pad_token_id=0,
                             eos_token_id=None, **kw)
        assert out.cpu().tolist() == ours[s].tolist()


def test_greedy_ignores_min_p_as_huggingface_does():
    model = tiny_target("llama")
    p = prompts(1)[0]
    with HeteroSpec(model, cuda_graphs=False) as hs:
        a = hs.generate(p, max_new_tokens=12, min_p=0.9)[0]
        b = hs.generate(p, max_new_tokens=12)[0]
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.1", True])
def test_bad_min_p_is_one_line(bad):
    model = tiny_target("llama")
    with pytest.raises(ValueError, match=r"^generate: argument 'min_p' expected None or a value in \[0, 1\], got"):
        HeteroSpec(model, cuda_graphs=False).generate(prompts(1)[0], max_new_tokens=4, temperature=1.0, min_p=bad)
