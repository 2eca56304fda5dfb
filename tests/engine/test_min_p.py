"""min-p sampling (HuggingFace's ``MinPLogitsWarper``; vLLM's and llama.cpp's ``min_p``) in the speculative cycle:
the acceptance's warp (``ops.verify_sample``'s ``min_p``, held by tests/ops/test_verify.py to the walk of
``_oracles.hf_keep``) against HuggingFace's own warper objects applied in its order, the sampled draws through
``custom_generate`` against ``HeteroSpec.generate``, and bad input.  The distribution itself is tested by chi-square
in test_decoding (its ``minp`` case) and recorded steps against the eager engine in test_graphs."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import NoisyDraft  # noqa: E402
from _models import DEVICE, V, prompts, tiny_target  # noqa: E402
from _oracles import hf_keep  # noqa: E402

from heterospec import HeteroSpec, Policy, custom_generate, ops  # noqa: E402

W = transformers.generation.logits_process


def _hf_chain(logits, temperature, top_k, top_p, min_p):
    """HuggingFace's warpers as its generate builds them from a generation config, in its order."""
    chain = [W.TemperatureLogitsWarper(temperature)]
    if top_k:
        chain.append(W.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        chain.append(W.TopPLogitsWarper(top_p))
    if min_p:
        chain.append(W.MinPLogitsWarper(min_p))
    z = logits.float()
    for w in chain:
        z = w(None, z)
    return z


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.3), (1.3, 40, 1.0, 0.1), (1.0, 0, 0.8, 0.2), (0.6, 50, 0.9, 0.5),
    (1.0, 0, 0.5, 1.0)])
def test_the_acceptances_warp_is_huggingfaces_warpers_in_their_order(temperature, top_k, top_p, min_p):
    """Random rows [15, 300] with repeated values (ties): the tokens the ops' oracle keeps (``hf_keep``, which the C
    core, its NumPy twin and the kernels are held to draw for draw) are the ones HuggingFace's chain keeps, and
    min-p matters (it removes tokens the other warpers keep).  Min-p before top-p would keep fewer."""
    g = torch.Generator().manual_seed(int(1000 * min_p) + top_k)
    logits = (torch.randn(15, 300, generator=g) * 3).round(decimals=1)
    ref = ~torch.isinf(_hf_chain(logits, temperature, top_k, top_p, min_p)).numpy()
    without = ~torch.isinf(_hf_chain(logits, temperature, top_k, top_p, 0.0)).numpy()
    ours = np.stack([hf_keep(row, temperature, top_k, top_p, min_p)[1] for row in logits.numpy()])
    assert (ours == ref).all()
    assert ref.sum() < without.sum()
    if top_p < 1.0 and min_p < 1.0:
        first = _hf_chain(logits, temperature, 0, 1.0, min_p) * temperature   # min-p alone, back to logits
        before = ~torch.isinf(_hf_chain(first, temperature, top_k, top_p, 0.0)).numpy()
        assert before.sum() <= ref.sum()


@pytest.mark.parametrize("min_p", [0.0, 0.3, 1.0])
def test_a_min_p_of_one_keeps_only_the_largest(min_p):
    """A root-only tree samples the warped row itself: with min_p 1 every draw is the row's argmax (of two tied
    maxima, either); with 0.3 only tokens within ln(0.3) of the max in z; with 0 (off) others come up too."""
    x = np.array([[2.0, 5.0, 4.5, 5.0, -1.0, 3.0]], np.float32)
    allowed = {1.0: {1, 3}, 0.3: {1, 2, 3}, 0.0: set(range(6))}[min_p]
    seen = set()
    for seed in range(300):
        _, nxt, _ = ops.verify_sample(np.zeros(1, np.int64), np.full(1, -1, np.int64), x, temperature=1.0,
                                      min_p=min_p, seed=seed, offset=0)
        seen.add(nxt)
    assert seen <= allowed and len(seen) >= min(len(allowed), 4)


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
