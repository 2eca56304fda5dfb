"""Row-invariant bfloat16 verification (issue 42, item 3): in bf16 the sums of a forward over many rows round
differently from a one-row step's, so a verified tree node could get other logits than the autoregressive step
over the same tokens, and speculative output would drift from the model's own.  With ``batch_invariant`` every
row attends to exactly its keys (``exact_keys_attention``) and every linear layer of the target runs one path
for every row count (every call in blocks of 8 rows): a node's logits are then bit for bit the one-row step's.

This is transformers' bf16 forward (``cpu_decoder=False``; our own decoder computes a bf16 model in float32).
The models here are random, in bfloat16, with the default target's layer shapes, so that the matrix kernels' row-count paths
really differ; every comparison is exact (``torch.equal``), never a tolerance."""
import copy
import os
import warnings
import weakref

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _doubles import OracleDraft  # noqa: E402
from _models import eagle3_head  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.models import cpu_gemm as gemm  # noqa: E402
from heterospec.models import target as target_mod  # noqa: E402
from heterospec.models.target import TargetAdapter, attention_window, key_groups  # noqa: E402

V = 512
# transformers' bf16 forward, what these tests are about: our own decoder (cpu_decoder='auto') computes a bf16 model
# in float32, each row on its own, and needs none of this (tests/models/test_cpu_decoder.py)
TRANSFORMERS = dict(cpu_decoder=False)


def bf16_target(arch="llama", seed=0):
    torch.manual_seed(seed)
    # SmolLM2-135M's layer shapes (the default target), 7 layers: shapes where bf16's row-count paths differ
    common = dict(vocab_size=V, hidden_size=576, intermediate_size=1536, num_hidden_layers=7, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=512, attn_implementation="sdpa")
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(head_dim=64, **common), transformers.Qwen3ForCausalLM
    model = cls(cfg).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.to(torch.bfloat16)


def _prompt(n, seed):
    return torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(seed))


# a tree of 8 nodes: 0 -> 1, 2; 1 -> 3, 4; 3 -> 5; 5 -> 7; 2 -> 6
PARENTS = [-1, 0, 0, 1, 1, 3, 2, 5]


def _tree():
    n = len(PARENTS)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depths = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(PARENTS):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depths[i] = depths[p] + 1
    return mask, depths


def _path(j):
    out = []
    while j >= 0:
        out.append(j)
        j = PARENTS[j]
    return out[::-1]


def _one_row_steps(model, prompt, tokens, invariant):
    """The engine's autoregressive step (a one-node verify, then its slot committed) over ``tokens``: the last
    step's logits."""
    a = TargetAdapter(model, capture_taps=False, invariant=invariant)
    a.allocate(prompt.shape[1] + 16)
    a.prefill(prompt)
    for t in tokens:
        P = int(a.prefix)
        logits, _ = a.verify(t.view(1), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                             attention_window("cpu", P + 1, 1))
        a.prefix += 1
    return logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_verified_tree_gives_each_node_what_one_row_steps_give(arch):
    model = bf16_target(arch)
    # 120 committed tokens: on the 2-core AMD EPYC, without the exact keys nodes 5 and 7 differ here, and without
    # the one-path linears nodes 1, 3, 4, 5 and 7 (Qwen3 shapes)
    prompt = _prompt(120, 1)
    tokens = torch.randint(0, V, (len(PARENTS),), generator=torch.Generator().manual_seed(2))
    mask, depths = _tree()
    with gemm.for_models(False, model, invariant=True):
        a = TargetAdapter(model, capture_taps=False, invariant=True)
        a.allocate(160)
        a.prefill(prompt)
        tree, _ = a.verify(tokens, depths, mask, attention_window("cpu", 121, len(PARENTS)))
        for j in range(len(PARENTS)):
            one = _one_row_steps(model, prompt, tokens[_path(j)], invariant=True)
            assert torch.equal(tree[j], one), f"node {j} (path {_path(j)}): logits differ from the one-row steps"
    assert model.config._attn_implementation == "sdpa"   # the user's model is left as it was


def test_key_groups_lists_each_rows_exact_keys_in_cache_order():
    # 2 committed columns, then a 3-node tree 0 -> 1 -> 2 at columns 2, 3, 4 and a node 3 under 0 at column 5
    allowed = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0],
                            [1, 1, 1, 1, 0, 0, 0, 0],
                            [1, 1, 1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 0, 0, 1, 0, 0]], dtype=torch.bool).view(1, 4, 8)
    groups = key_groups(allowed)
    assert [(r, b) for r, b, _ in groups] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    cols = [c if isinstance(c, int) else c.tolist() for _, _, c in groups]
    # columns 0 .. c-1 are a view (an int); others are gathered in cache order
    assert cols == [3, 4, 5, [0, 1, 2, 5]]
    one = key_groups(torch.ones(1, 1, 6, dtype=torch.bool))
    assert one == [(None, 0, 6)]


def test_two_rows_of_one_length_each_get_what_they_get_alone():
    """The case that showed batching rows of equal length is not enough (layer 14 of the default target on a
    held-out question, two tree nodes at depth 1 over 104 keys): torch's CPU attention, given both rows in one
    call on 2 threads, gave the first row other low bits than the row alone on the 2-core AMD EPYC, and a
    HeteroSpec answer drifted from bf16 ar at new token 84.  Each row now has its own call."""
    f = torch.load(os.path.join(os.path.dirname(__file__), "..", "data", "bf16_attention_rows.pt"), weights_only=True)
    q, k, v, scale = f["q"], f["k"], f["v"], f["scale"]      # q [2, kv_heads, rep, D]; k, v [2, kv_heads, c, D]
    g, kv_heads, rep, D = q.shape
    c = k.shape[2]
    assert torch.equal(k[0, :, :c - 1], k[1, :, :c - 1])     # a shared prefix, then each row's own last key
    K = torch.cat([k[0], k[1, :, c - 1:]], 1).unsqueeze(0)    # one cache row: [1, kv_heads, c + 1, D]
    V = torch.cat([v[0], v[1, :, c - 1:]], 1).unsqueeze(0)
    allowed = torch.zeros(1, 2, c + 1, dtype=torch.bool)
    allowed[0, :, :c - 1] = True
    allowed[0, 0, c - 1] = allowed[0, 1, c] = True
    query = q.reshape(g, kv_heads * rep, D).transpose(0, 1).unsqueeze(0)    # [1, heads, 2, D]
    both = target_mod.exact_keys_attention(None, query, K, V, None, scaling=scale,
                                           heterospec_keys=key_groups(allowed))[0]
    for r in range(2):
        alone = torch.nn.functional.scaled_dot_product_attention(q[r:r + 1], k[r:r + 1], v[r:r + 1], scale=scale)
        assert torch.equal(both[0, r], alone[0].reshape(kv_heads * rep, D)), f"row {r}"


def _ids(outs):
    return [o[0].tolist() for o in outs]


def test_speculative_bf16_output_equals_the_engines_own_bf16_ar(tmp_path):
    model = bf16_target()
    prompts = [_prompt(n, s) for n, s in ((9, 3), (23, 4), (40, 5), (5, 6))]
    with HeteroSpec(model, None, Policy.autoregressive(), **TRANSFORMERS) as ar:
        assert ar.batch_invariant
        refs = [ar.generate(p, max_new_tokens=48)[0] for p in prompts]
    # the oracle proposes from a float32 copy: it re-reads every node's whole context each level, which in bf16
    # on a CPU without bf16 matrix units took 55 s a prompt (4.5 times float32); its proposals only have to be
    # the target's picks mostly (long accepted paths), the output is checked against bf16 ar exactly
    oracle = OracleDraft(copy.deepcopy(model).float())
    with HeteroSpec(model, oracle, Policy.static(5, 3, 12), **TRANSFORMERS) as hs:
        assert hs.batch_invariant and "row-invariant" in hs.cpu_gemm
        outs = []
        for p in prompts:
            seq, st = hs.generate(p, max_new_tokens=48)
            outs.append(seq)
            assert "row-invariant" in st.cpu_gemm
        assert st.tau > 1.5   # long accepted paths: the tree really ran
    assert _ids(outs) == _ids(refs)
    # a batch of the same prompts (a random EAGLE-3 head: the batched engine's drafter): each row prefilled
    # alone, every row equal to its prompt decoded alone
    draft = eagle3_head(model.float(), tmp_path).to(torch.bfloat16)
    model.to(torch.bfloat16)
    with HeteroSpec(model, draft, Policy.static(4, 4, 16), **TRANSFORMERS) as hs:
        rows, _ = hs.generate([p[0] for p in prompts], max_new_tokens=48)
    assert [r.tolist() for r in rows] == [r[0].tolist() for r in refs]


def test_batch_invariant_argument_and_auto():
    model = bf16_target()
    with pytest.raises(ValueError, match=r"argument 'batch_invariant' expected 'auto', True or False, got 'yes'"):
        HeteroSpec(model, batch_invariant="yes")
    fp32 = bf16_target().float()
    with pytest.raises(ValueError, match=r"argument 'batch_invariant' expected 'auto' or False for a float32 "
                                         r"target on cpu .*got True"):
        HeteroSpec(fp32, batch_invariant=True)
    with HeteroSpec(fp32) as hs:
        assert hs.batch_invariant is False and "row-invariant" not in hs.cpu_gemm
    with HeteroSpec(model, batch_invariant=False) as hs:
        assert hs.batch_invariant is False and "row-invariant" not in hs.cpu_gemm


def test_auto_turns_off_with_a_warning_where_the_kernel_is_not_invariant(monkeypatch):
    model = bf16_target()
    monkeypatch.setattr(target_mod, "check_invariant_attention", lambda *a: False)
    with pytest.raises(ValueError, match="attention kernel gives a row of a batched call another result"):
        HeteroSpec(model, batch_invariant=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with HeteroSpec(model, **TRANSFORMERS) as hs:
            assert hs.batch_invariant is False
    assert any("batch_invariant='auto' is off here" in str(w.message) for w in caught)
    layers = target_mod._decoder_layers(model)
    assert all(not layer._forward_pre_hooks for layer in layers)   # the failed adapter's hooks are gone


def test_check_invariant_catches_a_path_that_depends_on_the_row_count():
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    fair = gemm._invariant_forward(lin, "default", None)
    assert gemm.check_invariant(fair, lin)
    shifted = lambda x: fair(x) + x.reshape(-1, x.shape[-1]).shape[0] * 1e-2   # noqa: E731
    assert not gemm.check_invariant(shifted, lin)
    wide = torch.nn.Linear(1536, 576).to(torch.bfloat16)
    # calls of one fixed size: invariant on every machine measured (with AMX, a one-row call padded to two was not)
    assert gemm.check_invariant(gemm._invariant_forward(wide, "default", None), wide)
    if gemm.rows_available():   # the few-rows kernel: invariant by construction, every call as it comes
        lin32 = torch.nn.Linear(1536, 576)
        assert gemm.check_invariant(gemm._invariant_forward(lin32, "rows", gemm._packed(lin32, 4, "rows")), lin32)


_LINEAR = torch.nn.functional.linear


def _kernel_by_rows(monkeypatch, offset):
    """torch's linear replaced by one whose rows get ``offset(rows of the call, row index)`` added: a matrix
    kernel whose result depends on the call's shape, as oneDNN's bfloat16 kernels on an AMX machine do."""
    def linear(x, w, b=None):
        y = _LINEAR(x, w, b)
        n = x.shape[0]
        return y + torch.tensor([offset(n, i) for i in range(n)], dtype=y.dtype).view(n, 1)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    monkeypatch.setattr(gemm, "_INVARIANT", {})
    monkeypatch.setattr(gemm, "_CHECKED", weakref.WeakKeyDictionary())


def test_a_machine_whose_kernels_change_from_two_rows_on_gets_calls_of_one_size(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    exact = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
    # 0.5 added to every row of a call over more than two rows (padding one row to two would not hide it),
    # 0.25 more past 9 rows
    _kernel_by_rows(monkeypatch, lambda n, i: 0.5 * (n > 2) + 0.25 * (n > 9))
    with gemm.PackedLinears([model], invariant=[model], path=None) as p:
        assert "every call in blocks of 8 rows" in p.describe()
        one, some, eleven = model[0](x[:1]), model[0](x[:3]), model[0](x)
    # each call ran as blocks of 8 rows, so each row got the 8-row kernel's result (the exact product + 0.5),
    # alone, among 3 or among 11 (a block of 8 and a padded block of 3)
    assert torch.equal(one[0], eleven[0]) and torch.equal(some, eleven[:3])
    assert torch.equal(eleven, exact + 0.5)
    # a row's result that depends on its place in the call: no fixed size helps, and the error says so
    _kernel_by_rows(monkeypatch, lambda n, i: 0.25 * i)
    with pytest.raises(ValueError, match=r"the default matrix path of the bfloat16 (16x8|8x4) bias layers gives a "
                                         r"row another result .* even when every call has 8 rows"):
        gemm.PackedLinears([model], invariant=[model], path=None)
