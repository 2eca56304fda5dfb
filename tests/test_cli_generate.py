"""`heterospec generate` on a tiny target + EAGLE-3 draft saved to disk, with a word-level tokenizer."""
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from test_decoding import THRESHOLDS, eagle3_head, reference_greedy, tiny_target  # noqa: E402

WORDS = [f"w{i}" for i in range(94)]


def save_tiny_pair(root):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    model = tiny_target("llama", vocab=97)
    (root / "target").mkdir()
    model.save_pretrained(root / "target")
    fast.save_pretrained(root / "target")
    eagle3_head(model, root / "draft")
    return model, fast


@pytest.mark.parametrize("method", ["ar", "eagle3", "heterospec"])
def test_generate_command_streams_the_targets_greedy_answer(tmp_path, method):
    model, tok = save_tiny_pair(tmp_path)
    prompt = "w5 w17 w3 w40 w22"
    cmd = [sys.executable, "-m", "heterospec", "generate", "--target", str(tmp_path / "target"), "--draft",
           str(tmp_path / "draft"), "--prompt", prompt, "--method", method, "--max-new-tokens", "16", "--no-eos",
           "--depth", "4", "--top-k-tree", "3", "--total-tokens", "12",
           "--thresholds", ",".join(str(t) for t in THRESHOLDS), "--device", "cpu"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    ref = reference_greedy(model, ids, 16)[0, ids.shape[1]:]
    expected = tok.decode(ref)
    assert expected.strip() in res.stdout
    assert f"[{method}] 16 tokens" in res.stdout and "tau" in res.stdout


def test_generate_command_needs_thresholds_for_heterospec(tmp_path):
    save_tiny_pair(tmp_path)
    res = subprocess.run([sys.executable, "-m", "heterospec", "generate", "--target", str(tmp_path / "target"),
                          "--draft", str(tmp_path / "draft"), "--prompt", "w1", "--method", "heterospec"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "--thresholds" in res.stderr


# ---- --device (issue 15): passed to the models and the inputs; a bad one is a one-line usage error ----------

COMMANDS = {
    "generate": ["generate", "--target", "T", "--draft", "D", "--prompt", "w1"],
    "calibrate": ["calibrate", "--target", "T", "--draft", "D", "--prompts", "q.jsonl", "--out", "p.json"],
    "train-draft": ["train-draft", "--target", "T", "--data", "q.jsonl", "--out", "o"],
}
BAD_DEVICES = ["foo", "cuda:x", "meta"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:1"])


@pytest.mark.parametrize("device", BAD_DEVICES)
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_a_bad_device_is_a_one_line_usage_error(cmd, device, capsys, monkeypatch):
    from heterospec.tools import cli

    monkeypatch.setattr(cli, "load_pair", lambda *a, **k: pytest.fail("loaded models with a bad --device"))
    with pytest.raises(SystemExit) as e:
        cli.main(COMMANDS[cmd] + ["--device", device])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"heterospec {cmd}: error: argument --device: "), err
    assert repr(device) in err


def test_a_bad_device_has_no_traceback():
    res = subprocess.run([sys.executable, "-m", "heterospec", "generate", "--target", "T", "--prompt", "w1",
                          "--device", "cuda:7" if torch.cuda.is_available() else "cuda"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "argument --device" in res.stderr


class _Loaded(Exception):
    pass


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_device_reaches_load_pair(cmd, monkeypatch, tmp_path):
    from heterospec.tools import cli

    seen = {}

    def load_pair(args, device="cpu"):
        seen["device"] = device
        raise _Loaded

    monkeypatch.setattr(cli, "load_pair", load_pair)
    monkeypatch.setattr("heterospec.models.default.load_pair", load_pair)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_Loaded):
        cli.main(COMMANDS[cmd] + ["--device", "cpu:0", "--dtype", "bfloat16"])
    assert seen["device"] == "cpu:0"


# ---- --cuda-graphs (issue 16) ----------------------------------------------------------------------------------

GRAPH_COMMANDS = {
    "generate": COMMANDS["generate"],
    "calibrate": COMMANDS["calibrate"],
    "bench": ["bench", "--questions", "q.jsonl"],
}


@pytest.mark.parametrize("cmd", list(GRAPH_COMMANDS))
def test_cuda_graphs_on_without_a_gpu_is_a_one_line_usage_error(cmd, capsys, monkeypatch):
    from heterospec.tools import cli

    monkeypatch.setattr(cli, "load_pair", lambda *a, **k: pytest.fail("loaded models before checking --cuda-graphs"))
    monkeypatch.setattr("heterospec.models.default.load_pair", lambda *a, **k: pytest.fail("loaded models"))
    with pytest.raises(SystemExit) as e:
        cli.main(GRAPH_COMMANDS[cmd] + ["--device", "cpu", "--cuda-graphs", "on"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"heterospec {cmd}: error: argument --cuda-graphs: "), err
    assert "expected off or auto with --device cpu" in err and err.rstrip().endswith("got on")


@pytest.mark.parametrize("given, want", [("auto", "auto"), ("off", False)])
def test_cuda_graphs_reaches_the_engine(tmp_path, monkeypatch, given, want):
    """generate hands the switch to HeteroSpec ('auto' as such: the engine resolves it, off on the CPU, and
    falls back to eager decoding if recording fails)."""
    from heterospec.tools import cli

    import heterospec

    save_tiny_pair(tmp_path)
    seen = {}
    real = heterospec.HeteroSpec

    def spy(*a, **k):
        seen["cuda_graphs"] = k.get("cuda_graphs")
        hs = real(*a, **k)
        seen["resolved"] = hs.cuda_graphs
        return hs

    monkeypatch.setattr(heterospec, "HeteroSpec", spy)
    cli.main(["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt",
              "w5 w17", "--method", "eagle3", "--max-new-tokens", "4", "--depth", "2", "--top-k-tree", "2",
              "--total-tokens", "4", "--cuda-graphs", given])
    assert seen["cuda_graphs"] == want and seen["resolved"] is False
