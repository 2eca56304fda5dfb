"""The scale rehearsal (issue 44) at its `tiny` shape on the CPU: the same code path as the 8B run on a GPU --
a target of transformers' own class built from a config with random weights, an EAGLE-3 head saved in SafeAILab's
and vLLM's layouts and loaded back, every method timed, the cost model fitted, the caches allocated, greedy output
checked against ar's, and a projection that says it is one."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not os.path.isdir(os.path.join(ROOT, "benchmarks")):
    pytest.skip("benchmarks/ is not next to tests/ here", allow_module_level=True)

from benchmarks import scale_rehearsal  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    rc = scale_rehearsal.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "1",
                               "--prompt-len", "24", "--new-tokens", "12", "--batch", "2", "--cache-check", "256",
                               "--out", str(out)])
    with open(out / "scale.json") as f:
        r = json.load(f)
    with open(out / "scale.md") as f:
        md = f.read()
    with open(out / "progress.json") as f:
        r["_progress"] = json.load(f)
    return rc, r, md


def test_the_tiny_rehearsal_runs_every_method_and_is_lossless(run):
    rc, r, _ = run
    assert rc == 0
    assert set(r["methods"]) == {"hf", "hf-static", "ar", "eagle3", "heterospec"}
    for m, rows in r["methods"].items():
        assert set(rows) == {"1", "2"}, m
        assert all(x["tokens"] == 12 * int(B) and x["tokens_per_s"] > 0 for B, x in rows.items()), m
    assert r["enforced"] and all(all(v.values()) for v in r["same_as_ar"].values())
    # random weights accept no draft token: the prefill's token, then one per cycle
    assert r["methods"]["eagle3"]["1"]["cycles"] == 11 and r["methods"]["eagle3"]["1"]["tau"] == 1.0


def test_every_stage_is_reported_as_it_finishes(run):
    """A window's phase limit can kill the run: progress.json holds every stage it finished, each method with
    its warm-up (capture, compile) seconds, and the phase's numbers fall back to it."""
    _, r, md = run
    p = r["_progress"]
    stages = [x["stage"] for x in p["stages"]]
    assert stages == ["build", "head", "bandwidth", "hf", "hf-static", "ar", "eagle3", "heterospec", "cost model"]
    assert all(x["at_s"] >= 0 for x in p["stages"])
    at = [x["at_s"] for x in p["stages"]]
    assert at == sorted(at)
    for x in p["stages"][3:8]:
        assert set(x["rows"]) == {"1", "2"} and all(row["warmup_s"] > 0 for row in x["rows"].values())
    assert "warm-up s" in md


def test_the_head_is_saved_in_both_layouts_and_loaded_back_equal(run):
    _, r, _ = run
    assert set(r["loaders"]) == {"safeailab", "vllm-speculators"}
    assert all(v["equal"] and v["bytes"] > 0 for v in r["loaders"].values())
    # the head has the target's RoPE (transformers 5 keeps it in rope_parameters: reading config.rope_theta there
    # found nothing and gave the head the default base 10000)
    for v in r["loaders"].values():
        assert v["rope_theta"] == 500000.0
        assert v["rope_scaling"]["rope_type"] == "llama3" and v["rope_scaling"]["factor"] == 4.0
    # the head's own bytes: its embedding is the target's, shared (not counted): fc, one layer, four norms, lm_head;
    # d2t / t2d buffers are not parameters
    c = scale_rehearsal.SHAPES["tiny"]["config"]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    own = (3 * h * h + (2 * h) * h + 2 * (2 * h) * kv + h * h + 3 * h * i + 4 * h
           + scale_rehearsal.SHAPES["tiny"]["draft_vocab"] * h)
    assert r["caches"]["head_bytes"] == 4 * own


def test_costs_floor_and_caches_are_reported(run):
    _, r, _ = run
    c = scale_rehearsal.SHAPES["tiny"]["config"]
    kv_heads, hd = c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"]
    assert r["caches"]["target_bytes"] == 8 * 2 * c["num_hidden_layers"] * kv_heads * 256 * hd * 4
    assert r["weight_bytes"] == sum(4 * n for n in (
        c["vocab_size"] * c["hidden_size"],                                   # lm_head (the embedding is not read)
        c["num_hidden_layers"] * (2 * c["hidden_size"] * c["hidden_size"]     # q, o
                                  + 2 * c["hidden_size"] * kv_heads * hd      # k, v
                                  + 3 * c["hidden_size"] * c["intermediate_size"]
                                  + 2 * c["hidden_size"]),                    # two norms
        c["hidden_size"]))                                                    # the final norm
    assert r["memory_floor_ms"] > 0 and r["ar_over_floor"] == pytest.approx(r["ar_step_ms"] / r["memory_floor_ms"])
    assert set(r["verify_ms"]) == {"1", "8", "16", "32", "60"}
    for m in ("ar", "eagle3", "heterospec"):
        x = r["per_cycle"][m]
        assert x["cycle_ms"] == pytest.approx(x["verify_ms"] + x["draft_ms"] + x["rest_ms"])


def test_the_projection_is_labelled_and_follows_from_the_measured_cycle(run):
    _, r, md = run
    cyc = r["per_cycle"]["eagle3"]["cycle_ms"] / 1e3
    assert r["projection"]["eagle3"]["4"]["tokens_per_s"] == pytest.approx(4 / cyc)
    assert "PROJECTED" in r["projection_note"]
    measured, projected = md.split("## PROJECTED (not measured)")
    assert "(projected)" not in measured
    rows = [line for line in projected.splitlines() if line.startswith("| eagle3") or line.startswith("| heterospec")]
    assert rows and all("(projected)" in line for line in rows)
    assert "6.57" in projected


def test_fewer_layers_keep_every_width_and_say_so(run):
    full = scale_rehearsal.target_config("llama-3.1-8b")
    cut = scale_rehearsal.target_config("llama-3.1-8b", layers=7)
    assert (full.num_hidden_layers, cut.num_hidden_layers) == (32, 7)
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "rope_parameters"):
        assert getattr(cut, k) == getattr(full, k), k
    _, r, md = run
    assert r["layers"] == r["shape_layers"] == 8 and "decoder layers**" not in md
    assert "7 of the shape's 8 decoder layers" in scale_rehearsal.markdown(dict(r, layers=7))
    assert r["ar_over_hf_compiled"] is None and "hf-compiled" not in md   # (--hf-compiled not given)
    assert "x hf-static, 2.50x hf-compiled." in scale_rehearsal.markdown(dict(r, ar_over_hf_compiled=2.5))


def test_float16_values_are_a_float16_checkpoint_in_float32(tmp_path, monkeypatch):
    """--values float16 (Pythia's checkpoints hold float16 values): the float32 model's weights are float16 values,
    every method is still lossless, and the report says the decoder reads half the floor's bytes."""
    seen = []
    real = scale_rehearsal.run_methods

    def spy(model, *a, **kw):
        seen.append(all(torch.equal(p, p.half().float()) and p.dtype == torch.float32 for p in model.parameters()))
        return real(model, *a, **kw)

    monkeypatch.setattr(scale_rehearsal, "run_methods", spy)
    rc = scale_rehearsal.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--values", "float16",
                               "--prompts", "1", "--prompt-len", "16", "--new-tokens", "6", "--batch", "0",
                               "--cache-check", "0", "--out", str(tmp_path)])
    assert rc == 0 and seen == [True]
    with open(tmp_path / "scale.json") as f:
        r = json.load(f)
    assert r["values"] == "float16" and all(all(v.values()) for v in r["same_as_ar"].values())
    md = scale_rehearsal.markdown(r)
    assert "(float32, weights of float16 values, cpu)" in md and "read by our CPU decoder as float16 codes" in md


def test_too_few_layers_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        scale_rehearsal.main(["--shape", "tiny", "--device", "cpu", "--layers", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--layers" in err and "at least 7" in err and "got 3" in err


def test_a_run_cut_short_leaves_no_earlier_report_behind(tmp_path, monkeypatch):
    out = tmp_path / "scale"
    out.mkdir()
    for name in ("scale.md", "scale.json", "progress.json"):
        (out / name).write_text("an earlier run's")

    def killed(*a, **k):
        raise KeyboardInterrupt   # the window's phase limit, while the 8B weights are made

    monkeypatch.setattr(scale_rehearsal, "build_target", killed)
    with pytest.raises(KeyboardInterrupt):
        scale_rehearsal.main(["--shape", "tiny", "--device", "cpu", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == []


@pytest.mark.parametrize("shape", sorted(set(scale_rehearsal.SHAPES) - {"tiny"}))
def test_every_shape_builds_its_family_and_a_head_config(shape):
    """Each named shape (on the meta device: no memory) is its family's own class with the shape's layer count, and
    the head the run makes for it gets the target's width and the shape's draft vocabulary."""
    from heterospec.models.target import _decoder_layers
    from heterospec.models.train import draft_config_for

    model = scale_rehearsal.build_target(shape, torch.device("meta"), torch.float32, layers=7)
    want = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gpt_neox": "GPTNeoXForCausalLM",
            "gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM", "phi": "PhiForCausalLM",
            "codegen": "CodeGenForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
            "stablelm": "StableLmForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "cohere": "CohereForCausalLM",
            "cohere2": "Cohere2ForCausalLM", "exaone4": "Exaone4ForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
            "olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "granitemoehybrid": "GraniteMoeHybridForCausalLM"}[scale_rehearsal.SHAPES[shape]["arch"]]
    assert type(model).__name__ == want and len(_decoder_layers(model)) == 7
    head = draft_config_for(model, scale_rehearsal.SHAPES[shape]["draft_vocab"])
    assert head.hidden_size == model.config.hidden_size and head.draft_vocab_size == scale_rehearsal.SHAPES[shape][
        "draft_vocab"]
