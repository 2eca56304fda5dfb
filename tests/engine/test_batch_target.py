"""The target adapter over a batch (issue 29, step 1): B requests in the rows of one static cache, each with its
own prefix length.  Every batched call must equal the same call on each request alone (the batch-1 adapter),
and batched greedy decoding must equal HuggingFace's greedy ``generate`` of each prompt alone."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _models import DEVICE, left_padded, prompts, reference_greedy, tiny_target  # noqa: E402

from heterospec import ops  # noqa: E402
from heterospec.engine.requests import gap_filled  # noqa: E402
from heterospec.models.target import TargetAdapter  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")
ATOL = 1e-4


def alone(model, prompt, capacity):
    tgt = TargetAdapter(model, capture_taps=True)
    tgt.allocate(capacity)
    logits, taps = tgt.prefill(prompt)
    return tgt, logits, taps


def prefilled_with_singles(model, ps, capacity):
    """The batched adapter over the prompts ``ps``, prefilled left-padded, and each prompt's batch-1 adapter."""
    ids, mask = left_padded(ps)
    tgt = TargetAdapter(model, capture_taps=True, batch=len(ps))
    tgt.allocate(capacity)
    tgt.prefill(ids, attention_mask=mask)
    return tgt, [alone(model, p, capacity)[0] for p in ps]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_equals_each_prompt_alone(arch):
    model = tiny_target(arch)
    ps = prompts(4)
    ids, mask = left_padded(ps)
    tgt = TargetAdapter(model, capture_taps=True, batch=len(ps))
    tgt.allocate(64)
    logits, taps = tgt.prefill(ids, attention_mask=mask)
    assert logits.shape == (len(ps), model.config.vocab_size)
    assert tgt.prefix.tolist() == [p.shape[1] for p in ps]
    for b, p in enumerate(ps):
        one, l1, t1 = alone(model, p, 64)
        n = p.shape[1]
        torch.testing.assert_close(logits[b], l1, atol=ATOL, rtol=0)
        torch.testing.assert_close(taps[b, :n], t1[0], atol=ATOL, rtol=0)     # moved to the front, as the cache
        # the row's cache holds the prompt alone from column 0, as the batch-1 cache does
        torch.testing.assert_close(tgt.kv[b, :, :, :, :n], one.kv[0, :, :, :, :n], atol=ATOL, rtol=0)
        one.close()
    tgt.close()


def random_tree(n, g):
    """parents of a random tree of n nodes (node 0 the root, each parent earlier), its depths and mask."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    depths, mask = [0] * n, torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
        depths[i] = int(mask[i].sum()) - 1
    return (torch.tensor(parents, device=DEVICE), torch.tensor(depths, device=DEVICE), mask.to(DEVICE))


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_tree_verify_and_commit_equal_each_request_alone(arch):
    """Three cycles of random trees per row (the same node count, different shapes and accepted paths):
    logits equal the batch-1 adapter's for that row, and per-row commits keep the rows apart."""
    model = tiny_target(arch)
    tgt, singles = prefilled_with_singles(model, prompts(3, seed=5), 96)
    B, n, V = len(singles), 6, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    for cycle in range(3):
        trees = [random_tree(n, g) for _ in range(B)]
        tokens = torch.randint(0, V, (B, n), generator=g).to(DEVICE)
        depths = torch.stack([t[1] for t in trees])
        masks = torch.stack([t[2] for t in trees])
        window = int(tgt.prefix.max()) + n
        logits, taps = tgt.verify(tokens, depths, masks, window)
        assert logits.shape == (B, n, V) and taps.shape[:2] == (B, n)
        paths, lengths = [], []
        for b in range(B):
            l1, t1 = singles[b].verify(tokens[b], depths[b], masks[b], int(singles[b].prefix) + n)
            torch.testing.assert_close(logits[b], l1, atol=ATOL, rtol=0)
            torch.testing.assert_close(taps[b], t1[0], atol=ATOL, rtol=0)
            # accept the path from the root to a node chosen per row (rows accept different lengths)
            node, path = int(torch.randint(0, n, (1,), generator=g)), []
            while node >= 0:
                path.append(node)
                node = int(trees[b][0][node])
            path = sorted(path)
            paths.append(path + [-1] * (n - len(path)))
            lengths.append(len(path))
            singles[b].commit(torch.tensor(path + [-1] * (n - len(path)), device=DEVICE),
                              torch.tensor([len(path)], device=DEVICE))
        tgt.commit(torch.tensor(paths, device=DEVICE), torch.tensor(lengths, device=DEVICE))
        assert tgt.prefix.tolist() == [int(s.prefix) for s in singles]
    for b, s in enumerate(singles):
        P = int(s.prefix)
        torch.testing.assert_close(tgt.kv[b, :, :, :, :P], s.kv[0, :, :, :, :P], atol=ATOL, rtol=0)
        s.close()
    tgt.close()


def test_dropped_rows_leave_the_kept_rows_as_they_were():
    """keep_rows moves the kept rows in place, their committed columns only (``used``): afterwards each kept
    row's cache, verify logits and commits equal its request alone, over two more cycles."""
    model = tiny_target("llama")
    tgt, singles = prefilled_with_singles(model, prompts(4, seed=9), 64)
    B, n, V = len(singles), 5, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    rows = list(range(B))
    for cycle in range(3):
        if cycle == 1:
            rows = gap_filled([1, 3], B)                 # rows 0 and 2 finished: 3 fills row 0's place, 1 stays
            assert rows == [3, 1]
            tgt.keep_rows(rows, torch.tensor(rows, device=DEVICE), max(int(singles[b].prefix) for b in rows))
            assert tuple(tgt.kv.shape[:1]) == (2,) and tgt.prefix.tolist() == [int(singles[b].prefix) for b in rows]
        trees = [random_tree(n, g) for _ in rows]
        tokens = torch.randint(0, V, (len(rows), n), generator=g).to(DEVICE)
        logits, _ = tgt.verify(tokens, torch.stack([t[1] for t in trees]), torch.stack([t[2] for t in trees]),
                               int(tgt.prefix.max()) + n)
        paths, lengths = [], []
        for j, b in enumerate(rows):
            l1, _ = singles[b].verify(tokens[j], trees[j][1], trees[j][2], int(singles[b].prefix) + n)
            torch.testing.assert_close(logits[j], l1, atol=ATOL, rtol=0)
            path = list(range(int(torch.randint(1, n + 1, (1,), generator=g))))   # a chain: valid in any tree
            path = [k for k in path if k == 0 or int(trees[j][0][k]) in path]
            paths.append(path + [-1] * (n - len(path)))
            lengths.append(len(path))
            singles[b].commit(torch.tensor(paths[-1], device=DEVICE), torch.tensor([len(path)], device=DEVICE))
        tgt.commit(torch.tensor(paths, device=DEVICE), torch.tensor(lengths, device=DEVICE))
    for j, b in enumerate(rows):
        P = int(singles[b].prefix)
        torch.testing.assert_close(tgt.kv[j, :, :, :, :P], singles[b].kv[0, :, :, :, :P], atol=ATOL, rtol=0)
    for s in singles:
        s.close()
    tgt.close()


def test_the_kept_rows_fill_the_finished_rows_places():
    assert gap_filled([0, 1, 2], 4) == [0, 1, 2]             # the last row finished: nothing moves
    assert gap_filled([1, 2, 3], 4) == [3, 1, 2]             # the first: the last row takes its place
    assert gap_filled([0, 3, 5, 6], 7) == [0, 5, 6, 3]       # rows 1 and 2 finished: 5 and 6 fill them, 3 stays
    assert gap_filled([2], 3) == [2]
    with pytest.raises(ValueError, match=r"gap_filled: argument 'keep' expected ascending distinct rows"):
        gap_filled([2, 1], 3)
    model = tiny_target("llama")
    tgt = TargetAdapter(model, capture_taps=False, batch=3)
    tgt.allocate(8)
    with pytest.raises(ValueError, match=r"target: keep_rows expected distinct rows of \[0, 3\), each moved one"):
        tgt.keep_rows([1, 0], torch.tensor([1, 0], device=DEVICE))    # a swap would overwrite a row before it moves
    tgt.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_decoding_equals_huggingface_per_prompt(arch):
    """Autoregressive greedy decoding of a left-padded batch on the batched adapter (one node per row and
    cycle, ops.verify_greedy per row) equals HuggingFace's greedy generate of each prompt alone."""
    model = tiny_target(arch)
    ps = prompts(4, seed=7)
    ids, mask = left_padded(ps)
    B, new = len(ps), 12
    tgt = TargetAdapter(model, capture_taps=False, batch=B)
    tgt.allocate(max(p.shape[1] for p in ps) + new + 1)
    logits, _ = tgt.prefill(ids, attention_mask=mask)
    nxt = logits.argmax(-1)
    out = [[int(t)] for t in nxt]
    zero = torch.zeros((B, 1), dtype=torch.long, device=DEVICE)
    one = torch.ones((B, 1, 1), dtype=torch.bool, device=DEVICE)
    for _ in range(new - 1):
        logits, _ = tgt.verify(nxt.view(B, 1), zero, one, int(tgt.prefix.max()) + 1)
        path, length, nxt = ops.verify_greedy(nxt.view(B, 1), torch.full((B, 1), -1, device=DEVICE), logits,
                                              device_outputs=True)
        tgt.commit(path, length)
        for b in range(B):
            out[b].append(int(nxt[b]))
    for b, p in enumerate(ps):
        ref = reference_greedy(model, p, new)[0, p.shape[1]:].tolist()
        assert out[b] == ref, (arch, b)
    tgt.close()


def test_batch_argument_and_prompt_count_are_checked():
    model = tiny_target("llama")
    with pytest.raises(ValueError, match=r"target: argument 'batch' expected an int >= 1, got 0"):
        TargetAdapter(model, batch=0)
    tgt = TargetAdapter(model, batch=2)
    tgt.allocate(16)
    with pytest.raises(ValueError, match=r"target: prefill expected 2 prompts \(the adapter's batch\), got 1"):
        tgt.prefill(torch.zeros((1, 4), dtype=torch.long, device=DEVICE))
    tgt.close()
