"""The target's attention on the CPU (heterospec.models.target.gqa_sdpa_attention): transformers' sdpa with the
key/value heads read in place instead of repeated.  Its output must be transformers' own ``sdpa_attention_forward``
output bit for bit (the function under test is held to transformers' code, not to itself), and a verify forward
of a model with key/value groups must take it and give the logits of a forward without it, bit for bit."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _models import prompts, tiny_target  # noqa: E402

from heterospec.models import target as target_mod  # noqa: E402
from heterospec.models.target import TargetAdapter, gqa_sdpa_attention  # noqa: E402


class Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("heads,kv_heads,rows,keys", [(9, 3, 6, 192), (4, 2, 2, 37), (9, 3, 12, 448),
                                                      (8, 1, 60, 512), (4, 4, 5, 64), (9, 3, 1, 100)])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_output_is_transformers_sdpa_bit_for_bit(heads, kv_heads, rows, keys, batch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(rows * keys + batch)
    q = torch.randn(batch, heads, rows, 64, generator=gen)
    cache = torch.randn(batch, 2, kv_heads, keys + 30, 64, generator=gen)
    k, v = cache[:, 0, :, :keys], cache[:, 1, :, :keys]       # strided views of a wider cache, as ours are
    allowed = torch.rand(batch, 1, rows, keys, generator=gen) > 0.4
    allowed[..., 0] = True
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    m = Module(heads // kv_heads)
    ours, _ = gqa_sdpa_attention(m, q, k, v, mask, scaling=0.125)
    theirs, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=0.125)
    assert ours.shape == (batch, rows, heads, 64) and ours.is_contiguous()
    assert torch.equal(ours, theirs)


def test_a_verify_forward_takes_it_and_gives_the_same_logits(monkeypatch):
    model = tiny_target("llama")          # 4 query heads over 2 key/value heads
    seen = []
    real = target_mod.gqa_sdpa_attention

    def spy(module, query, *a, **kw):
        seen.append(query.shape[2])
        return real(module, query, *a, **kw)

    from transformers import AttentionInterface

    target_mod._register_attention()   # (registered once per process: the spy goes over it)
    monkeypatch.setitem(AttentionInterface._global_mapping, target_mod.GQA_ATTN, spy)
    p = prompts(1)[0]
    n = 5
    toks, depths = torch.arange(10, 10 + n), torch.arange(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    out = []
    for gqa in (True, False):
        tgt = TargetAdapter(model, capture_taps=False)
        tgt._gqa = gqa
        tgt.allocate(64)
        tgt.prefill(p)
        out.append(tgt.verify(toks, depths, mask)[0])
    assert seen and n in seen                          # the verify's rows came through it (the prefill's too)
    assert model.config._attn_implementation == "sdpa"   # and the user's model is as it was
    assert torch.equal(out[0], out[1])
