"""`heterospec bench --batch-size` (issue 29): throughput against batch size for our methods and HF's batched
generate, on a tiny pair saved to disk: the JSON, the table and the plot, every row's greedy tokens equal to
ar's (and to the prompt decoded alone), per-request latencies, the batch size at which a method stops beating
ar, and one-line usage errors."""
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from test_bench import PNG, _pair, _questions, _tiny  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.tools import bench  # noqa: E402
from heterospec.tools.bench.batched import (batch_markdown, batch_prompts, parse_batch_sizes,  # noqa: E402
                                            run_batch_bench)


def test_batch_sizes_parse_and_refuse():
    assert parse_batch_sizes("16,1,4") == [1, 4, 16]
    for bad in ("", "0", "2,2", "a", "1,-3"):
        with pytest.raises(ValueError, match=r"bench: argument '--batch-size' expected distinct ints >= 1 separated "
                                             r"by commas, got"):
            parse_batch_sizes(bad)


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_every_row_of_every_batch_equals_ar_and_the_prompt_alone(tmp_path, graphs):
    """Eager, and through the recorded engine's emulation (what ``--cuda-graphs on`` runs on a GPU: every batch
    size recorded in the warm-up, the last, smaller group's too)."""
    model, tok, qs = _tiny(tmp_path)
    from heterospec.models.draft import Eagle3Draft

    draft = Eagle3Draft.from_pretrained(str(tmp_path / "draft"), target=model)
    prompts = batch_prompts(tok, qs, True, 3)
    assert len(prompts) == 4                      # the 4 first turns (limit 2 of each file), none repeated
    methods = bench.build_methods(["ar", "hf", "hf-static", "eagle3"], draft=draft) + \
        [("heterospec", Policy(4, 3, 12, (1.0, 2.0, 3.0), (2, 1, 0, 0), (4, 8, 12, 12), name="calibrated"))]
    r = run_batch_bench(model, tok, draft, methods, prompts, [1, 3], max_new_tokens=10,
                        eos_token_id=tok.eos_token_id, warmup_tokens=3, cuda_graphs=graphs)
    assert r["mismatches"] == [] and r["cuda_graphs"] == graphs
    assert set(r["results"]) == {1, 3} and r["results"][3]["eagle3"]["groups"] == 2     # 3 + 1 prompts
    hs = HeteroSpec(model, draft, Policy.static(7, 10, 60))
    alone = [hs.generate(p, max_new_tokens=10, eos_token_id=tok.eos_token_id)[0][0, p.shape[1]:].tolist()
             for p in prompts]
    for B in (1, 3):
        for n in ("ar", "hf", "hf-static", "eagle3", "heterospec"):
            row = r["results"][B][n]
            assert row["new_tokens"] == sum(len(a) for a in alone) and row["tokens_per_s"] > 0
            assert row["latency_mean_s"] > 0 and row["latency_p90_s"] >= row["latency_mean_s"] * 0.5
        assert r["results"][B]["hf"]["tau"] is None and r["results"][B]["ar"]["tau"] == 1.0
        assert r["results"][B]["eagle3"]["verified_per_call"] > r["results"][B]["heterospec"]["verified_per_call"] > 0
    # batch 3: a forward verifies the trees of up to 3 rows
    assert r["results"][3]["ar"]["verified_per_call"] > 1.0
    assert set(r["stops_beating_ar"]) == {"eagle3", "heterospec"}
    md = batch_markdown(r, "header")
    assert md.startswith("header") and "| eagle3 | " in md and "B=3 tokens/s (× ar)" in md
    assert "Greedy outputs differing from ar's: 0" in md


def test_a_static_cache_baseline_is_warmed_up_for_the_timed_calls(tmp_path, monkeypatch):
    """hf-static's (and hf-compiled's) warm-up sizes transformers' static cache for the longest prompt and the
    whole budget, and stops after the warm-up tokens: no timed call makes a new cache (on CUDA a new compilation,
    on a CPU with hf-compiled minutes of it).  The other baselines warm up plainly."""
    model, tok, qs = _tiny(tmp_path)
    prompts = batch_prompts(tok, qs, True, 3)
    calls = []
    real = bench.HFGenerate.generate

    def spy(self, input_ids, **kw):
        calls.append((self.method.name, input_ids.shape[0], kw.get("max_new_tokens"), kw.get("cache_len"),
                      kw.get("stop_after")))
        return real(self, input_ids, **kw)

    monkeypatch.setattr(bench.HFGenerate, "generate", spy)
    r = run_batch_bench(model, tok, None, bench.build_methods(["ar", "hf", "hf-static"]), prompts, [1, 3],
                        max_new_tokens=9, eos_token_id=tok.eos_token_id, warmup_tokens=2)
    assert r["mismatches"] == []
    longest = max(p.shape[1] for p in prompts)
    static = [c for c in calls if c[0] == "hf-static"]
    warm = [c for c in static if c[3] is not None]
    # batch 1: one warm-up group; batch 3: the full group and the last, smaller one
    assert [(b, n, cl, st) for _, b, n, cl, st in warm] == [(1, 2, longest + 9, 2), (3, 2, longest + 9, 2),
                                                           (1, 2, longest + 9, 2)]
    assert all(c[2] == 9 and c[4] is None for c in static if c[3] is None)     # the timed calls: the budget
    assert len(static) == len(warm) + 4 + 2                                     # 4 groups of 1, then 3 + 1
    assert all(c[3] is None for c in calls if c[0] == "hf")


def test_stops_beating_ar_is_the_first_batch_size_below_ar():
    res = {B: {"ar": {"tokens_per_s": 10.0 * B}, "eagle3": {"tokens_per_s": t}} for B, t in ((1, 15.0), (4, 30.0))}
    r = {"batch_sizes": [1, 4], "results": res, "mismatches": [], "stops_beating_ar": {"eagle3": 4}}
    for B in (1, 4):
        for n in res[B]:
            res[B][n].update(latency_mean_s=1.0, tau=None, verified_per_call=None)
    md = batch_markdown(r)
    assert "15.0 (1.50×)" in md and "30.0 (0.75×)" in md and "eagle3: 4" in md


def test_the_command_writes_json_table_and_plot(tmp_path):
    pair = _pair(tmp_path)
    qfiles = [str(p) for p in _questions(tmp_path)]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "heterospec", "bench", *pair, "--questions", *qfiles, "--limit", "1",
           "--max-new-tokens", "6", "--batch-size", "1,2", "--methods", "ar,hf,eagle3,heterospec", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads((out / "batch.json").read_text())
    assert r["batch_sizes"] == [1, 2] and set(r["results"]["2"]) == {"ar", "hf", "eagle3", "heterospec"}
    assert r["machine"]["torch"] == torch.__version__ and r["mismatches"] == []
    assert (out / "batch.png").read_bytes().startswith(PNG)
    assert "| heterospec | " in (out / "batch.md").read_text() and "| heterospec | " in res.stdout
    base = [sys.executable, "-m", "heterospec", "bench", *pair, "--questions", *qfiles, "--out", str(tmp_path / "o")]
    for extra, line in (
        (["--batch-size", "0,4"], "heterospec bench: argument '--batch-size' expected distinct ints >= 1 separated "
                                  "by commas, got '0,4'"),
        (["--batch-size", "2", "--methods", "ar,hf-lookup"],
         "heterospec bench: argument '--batch-size' expected methods from ar, hf, hf-static, hf-compiled, eagle3, "
         "heterospec-paper, heterospec, got hf-lookup"),
    ):
        res = subprocess.run(base + extra, capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [line], res.stderr
