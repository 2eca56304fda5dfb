"""The head recipe's GPU window (issue 43.2) at a tiny scale on the CPU: a tiny target answers into an answer
store, the head trains on every answered shard with its features computed on the fly, tau is measured on five
benchmark files, and the whole state comes back as parts of at most 16 MiB; ``merge`` puts the answers into
the committed store and the next window, on a fresh work folder, continues from the state's step."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not os.path.isdir(os.path.join(ROOT, "benchmarks")):
    pytest.skip("benchmarks/ is not next to tests/ here", allow_module_level=True)

from benchmarks import head_window as hw  # noqa: E402
from _pairs import WORDS, save_tiny_pair  # noqa: E402

from heterospec.models.answers import PROMPTS, AnswerStore, texts_sha256  # noqa: E402
from heterospec.models.draft import Eagle3Draft  # noqa: E402


def test_the_second_moment_in_8_bits_keeps_its_square_root_within_the_blocks_step():
    g = torch.Generator().manual_seed(0)
    v = torch.exp(torch.empty(1000).uniform_(-28, -5, generator=g))   # AdamW's v spans decades
    v[7] = 0.0                                                         # a weight that never had a gradient
    q, lo, hi = hw.quantize_moment(v)
    assert q.dtype == np.uint8 and q.size == 1000 and lo.size == hi.size == 4
    back = hw.dequantize_moment(q, lo, hi, (1000,))
    assert back[7] == 0.0
    rel = (back.sqrt() / v.sqrt() - 1).abs()
    rel[7] = 0
    bound = float(np.exp((hi - lo).max() / 508) - 1)     # half a code step on the log scale, in sqrt(v)
    assert bound < 0.06 and float(rel.max()) <= bound * 1.01


def test_the_archive_splits_into_parts_and_refuses_a_missing_or_changed_one(tmp_path):
    rng = np.random.default_rng(0)
    members = {"a.bin": rng.bytes(5000), "b/c.json": b'{"x": 1}'}
    paths = hw.write_parts(members, tmp_path / "out", {"step": 3}, part_bytes=2048)
    assert [os.path.basename(p) for p in paths] == [f"head-window.tar.{k:02d}" for k in range(1, len(paths) + 1)]
    assert len(paths) >= 3 and all(os.path.getsize(p) <= 2048 for p in paths)
    index, got = hw.read_parts(list(reversed(paths)))
    assert got == members and index["step"] == 3
    with pytest.raises(ValueError, match="all of them"):
        hw.read_parts(paths[:1] + paths[2:])
    data = bytearray(open(paths[1], "rb").read())
    data[100] ^= 0xFF
    open(paths[1], "wb").write(bytes(data))
    with pytest.raises(ValueError):
        hw.read_parts(paths)


def _bench_files(d):
    d.mkdir()
    for k, name in enumerate(("mt_bench", "humaneval", "gsm8k", "alpaca", "sum")):
        with open(d / f"{name}.jsonl", "w") as f:
            for i in range(2):
                words = " ".join(WORDS[(k * 7 + i * 3 + j) % len(WORDS)] for j in range(5))
                f.write(json.dumps({"question_id": i, "turns": [words]}) + "\n")


@pytest.fixture(scope="module")
def window(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    save_tiny_pair(root)
    data = root / "train.jsonl"
    data.write_text("\n".join(json.dumps({"question": " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(4))})
                              for i in range(12)))
    store = root / "store"
    # the committed store: a list of 12 prompts, its first shard answered (what the repository holds)
    res = subprocess.run([sys.executable, "-m", "heterospec", "train-draft", "--target", str(root / "target"),
                          "--data", str(data), "--answers", str(store), "--max-new-tokens", "12", "--shard-size", "4",
                          "--max-prompts", "4", "--collect-only", "--no-chat-template", "--out", str(root / "x"),
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    repo_copy = root / "repo-store"
    shutil.copytree(store, repo_copy)          # the store as it is in the repository, before the window
    _bench_files(root / "bench")
    args = ["run", "--target", str(root / "target"), "--device", "cpu", "--answers", str(store), "--init-head",
            str(root / "draft"), "--dtype", "float32", "--answer-dtype", "float32", "--autocast", "off",
            "--max-new-tokens", "12", "--shard-size", "4", "--gen-batch-size", "4", "--batch-size", "2",
            "--total-steps", "6", "--warmup", "2", "--save-every", "3", "--seconds", "240", "--collect-seconds", "120",
            "--reserve", "30", "--bench-dir", str(root / "bench"), "--tau-limit", "2", "--tau-tokens", "8",
            "--no-chat-template", "--self-prompts", "0"]
    rc = hw.main(args + ["--work", str(root / "work1"), "--out", str(root / "out1")])
    assert rc == 0
    return root, store, repo_copy, args


def test_a_window_answers_trains_on_every_shard_measures_tau_and_packs_its_state(window):
    root, store, repo_copy, _ = window
    info = json.loads((root / "work1" / "head-window.json").read_text())
    m = AnswerStore.read_manifest(store)
    assert sorted(m["shards"]) == ["00000", "00001", "00002"]          # the two missing shards answered
    assert info["new_answer_files"] == 2 and info["step"] == 6
    assert info["new_answer_tokens"] == m["shards"]["00001"]["answer_tokens"] + m["shards"]["00002"]["answer_tokens"]
    log = json.loads((root / "work1" / "out" / "training_log.json").read_text())
    assert log["sequences"] == sum(s["sequences"] for s in m["shards"].values())   # every answered shard
    assert log["ttt_steps"] == 7
    assert set(info["tau"]["rows"]) == {"mt_bench", "humaneval", "gsm8k", "alpaca", "sum"}
    for r in info["tau"]["rows"].values():
        assert r["tau"] >= 1.0 and r["prompts"] == 2 and 0.0 <= r["first_step_acceptance"] <= 1.0
    parts = sorted(os.listdir(root / "out1"))
    assert parts == ["head-window.tar.01"] and all(os.path.getsize(root / "out1" / p) <= 16 * 2**20 for p in parts)
    index, members = hw.read_parts([str(root / "out1" / p) for p in parts])
    assert {"answers/shard-00001.npz", "answers/shard-00002.npz"} <= set(members)
    assert "answers/shard-00000.npz" not in members                    # the committed shard stays where it is
    # the packed head is the trained one, in float16, and loads as it is
    hdir = root / "unpacked"
    hw.restore_state(members, str(hdir))
    target_cls = __import__("transformers").AutoModelForCausalLM
    target = target_cls.from_pretrained(root / "target")
    packed = Eagle3Draft.from_pretrained(hdir, target=target)
    trained = Eagle3Draft.from_pretrained(root / "work1" / "out", target=target)
    for (k, a), (_, b) in zip(packed.state_dict().items(), trained.state_dict().items()):
        if a.is_floating_point() and a.numel() and k != "embed_tokens.weight":
            assert torch.allclose(a, b.to(torch.float16).float(), atol=0, rtol=0), k
    # the optimizer: step counts kept, the second moment within its quantisation, the first moment dropped
    full = torch.load(root / "work1" / "out" / "trainer_state.pt", weights_only=True)["optimizer"]
    back = torch.load(hdir / "trainer_state.pt", weights_only=True)["optimizer"]
    for i, s in full["state"].items():
        b = back["state"][i]
        assert float(b["step"]) == float(s["step"]) == 6
        assert torch.all(b["exp_avg"] == 0)
        keep = s["exp_avg_sq"] > 1e-16
        assert torch.allclose(b["exp_avg_sq"][keep].sqrt(), s["exp_avg_sq"][keep].sqrt(), rtol=0.1)


def test_merge_adds_the_answers_and_the_next_window_continues_from_the_state(window):
    root, store, repo_copy, args = window
    parts = [str(root / "out1" / p) for p in sorted(os.listdir(root / "out1"))]
    carry = root / "carry"
    assert hw.main(["merge", *parts, "--answers", str(repo_copy), "--carry-out", str(carry)]) == 0
    mine, theirs = AnswerStore.read_manifest(repo_copy), AnswerStore.read_manifest(store)
    assert mine["shards"] == theirs["shards"]
    for k in ("00001", "00002"):
        assert open(repo_copy / f"shard-{k}.npz", "rb").read() == open(store / f"shard-{k}.npz", "rb").read()
    assert hw.main(["merge", *parts, "--answers", str(repo_copy), "--carry-out", str(carry)]) == 0  # idempotent
    _, state = hw.read_parts([str(carry / p) for p in sorted(os.listdir(carry))])
    assert not any(k.startswith("answers/") for k in state)             # the next carry: the state alone
    # the next window: a fresh machine (new work folder), the committed store (all 3 shards), the carried state
    args2 = [a if a != "6" else "9" for a in args]                      # --total-steps 9: three more steps
    i = args2.index("--answers")
    args2[i + 1] = str(repo_copy)
    rc = hw.main(args2 + ["--work", str(root / "work2"), "--out", str(root / "out2"), "--state", str(carry),
                          "--collect-seconds", "0"])
    assert rc == 0
    info = json.loads((root / "work2" / "head-window.json").read_text())
    assert info["step"] == 9 and "step 6" in info["started_from"] and info["new_answer_files"] == 0
    log = json.loads((root / "work2" / "out" / "training_log.json").read_text())
    assert log["steps"] == 9 and log["log"][0][0] <= 6 < log["log"][-1][0]   # the curve goes on from window 1


def test_merge_refuses_a_window_of_another_store(window, tmp_path):
    root, store, _, _ = window
    other = tmp_path / "other"
    shutil.copytree(store, other)
    m = AnswerStore.read_manifest(other)
    m["prompts_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(m))
    parts = [str(root / "out1" / p) for p in sorted(os.listdir(root / "out1"))]
    res = subprocess.run([sys.executable, "-m", "benchmarks.head_window", "merge", *parts, "--answers", str(other),
                          "--carry-out", str(tmp_path / "c")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "prompts_sha256" in res.stderr and "Traceback" not in res.stderr


def test_a_window_adds_self_written_prompts_until_the_list_holds_n_and_merge_takes_the_grown_list(window, tmp_path):
    """--self-prompts N: the first window appends the target's own prompts to the list (the answered shards
    stay, the old short last shard is answered again); merge takes the grown list; a later window adds none
    once the list holds N of them."""
    root, store, _, args = window
    mine, theirs = tmp_path / "repo", tmp_path / "machine"
    shutil.copytree(root / "repo-store", mine)
    shutil.copytree(root / "repo-store", theirs)
    old = AnswerStore.read_prompts(mine)["prompts"]
    run = list(args)
    run[run.index("--answers") + 1] = str(theirs)
    run[run.index("--self-prompts") + 1] = "3"
    run[run.index("--total-steps") + 1] = "1"
    assert hw.main(run + ["--work", str(tmp_path / "w1"), "--out", str(tmp_path / "o1"), "--tau-limit", "0"]) == 0
    grown = AnswerStore.read_prompts(theirs)
    assert grown["prompts"][:len(old)] == old and 1 <= len(grown["prompts"]) - len(old) <= 3
    written = len(grown["prompts"]) - len(old)
    assert grown["added"][-1]["data"] == ["self:3"] and hw.self_written(str(theirs)) == (written, 1)
    m = AnswerStore.read_manifest(theirs)
    assert m["prompts"] == len(grown["prompts"]) and m["extended"] == [
        {"prompts": len(old), "prompts_sha256": AnswerStore.read_manifest(mine)["prompts_sha256"],
         "texts_sha256": texts_sha256(old)}]
    assert m["texts_sha256"] == texts_sha256(grown["prompts"])
    parts = [str(tmp_path / "o1" / p) for p in sorted(os.listdir(tmp_path / "o1"))]
    _, members = hw.read_parts(parts)
    assert "answers/prompts.json.gz" in members
    assert hw.main(["merge", *parts, "--answers", str(mine), "--carry-out", str(tmp_path / "c")]) == 0
    got = AnswerStore.read_manifest(mine)
    assert {k: got[k] for k in ("prompts", "prompts_sha256", "texts_sha256", "extended", "shards")} == \
        {k: m[k] for k in ("prompts", "prompts_sha256", "texts_sha256", "extended", "shards")}
    assert AnswerStore.read_prompts(mine) == grown
    assert sorted(AnswerStore(str(mine), got).present()) == sorted(int(k) for k in got["shards"])
    assert hw.main(["merge", *parts, "--answers", str(mine), "--carry-out", str(tmp_path / "c")]) == 0  # idempotent
    # the next window finds them and adds none
    run[run.index("--self-prompts") + 1] = str(written)
    assert hw.main(run + ["--work", str(tmp_path / "w2"), "--out", str(tmp_path / "o2"), "--tau-limit", "0",
                          "--collect-seconds", "0"]) == 0
    assert AnswerStore.read_prompts(theirs) == grown


def test_merge_of_a_grown_list_replaces_the_old_short_last_shard(tmp_path):
    """The repository's list of 5 ends in a short shard (prompt 4 alone), answered; the window grew the list to
    7, which removed that shard there and answered it again with prompts 4 and 5.  Merge takes the new shard
    and manifest; a window whose manifest does not extend ours, or that lacks the grown list, is refused."""
    from _models import prompts, tiny_target

    model = tiny_target("llama")
    ids = [p.view(-1).numpy() for p in prompts(7)]
    kw = dict(target={"name": "tiny", "config_sha256": "0" * 64, "vocab_size": 64}, dtype="float32",
              max_new_tokens=4, eos_token_id=None, shard_size=2, vocab_size=64)
    mine, theirs = tmp_path / "repo", tmp_path / "machine"
    AnswerStore.open(str(mine), prompt_ids=ids[:5], texts={"prompts": list("abcde")}, **kw).collect(model, ids[:5])
    shutil.copytree(mine, theirs)
    there = AnswerStore.open(str(theirs), prompt_ids=ids[:5], **kw)
    assert there.extend(ids, {"prompts": list("abcdefg")}) == [2]
    there.collect(model, ids)
    members = {"answers/" + f: open(theirs / f, "rb").read()
               for f in ("manifest.json", PROMPTS, "shard-00002.npz", "shard-00003.npz")}
    without = {k: v for k, v in members.items() if not k.endswith(PROMPTS)}
    with pytest.raises(ValueError, match="lacks prompts.json.gz"):
        hw.merge_answers(without, str(mine))
    # the removed short shard's later turns were built on its old answers: they go, the window's rebuilt ones
    # come in under the same name; another shard's stay
    for name, data in (("shard-00002-turn-2", b"old"), ("shard-00001-turn-2", b"kept")):
        (mine / "later-turns" / name).mkdir(parents=True)
        (mine / "later-turns" / name / PROMPTS).write_bytes(data)
    members["answers/later-turns/shard-00002-turn-2/" + PROMPTS] = b"rebuilt"
    assert hw.merge_answers(members, str(mine)) == (2, 4 * (2 + 1))
    assert (mine / "later-turns" / "shard-00002-turn-2" / PROMPTS).read_bytes() == b"rebuilt"
    assert (mine / "later-turns" / "shard-00001-turn-2" / PROMPTS).read_bytes() == b"kept"
    del members["answers/later-turns/shard-00002-turn-2/" + PROMPTS]
    got, want = AnswerStore.read_manifest(mine), AnswerStore.read_manifest(theirs)
    assert got == want
    assert open(mine / "shard-00002.npz", "rb").read() == open(theirs / "shard-00002.npz", "rb").read()
    assert AnswerStore.read_prompts(mine) == {"prompts": list("abcdefg")}
    other = tmp_path / "other"
    AnswerStore.open(str(other), prompt_ids=ids[1:6], texts={"prompts": list("bcdef")}, **kw)
    with pytest.raises(ValueError, match="another store"):
        hw.merge_answers(members, str(other))


def test_a_failure_while_the_target_writes_its_prompts_costs_that_step_only(window, tmp_path, monkeypatch, capsys):
    """The seventh GPU window lost its whole head run to a ValueError raised inside the self-written prompts' step
    (the store refused there; the handler caught SystemExit only).  Any error there now leaves the list as it was
    and the window goes on: it answers, trains and packs.  The prompts are sampled at --self-batch-size."""
    root, store, _, args = window
    theirs = tmp_path / "machine"
    shutil.copytree(root / "repo-store", theirs)
    before = (theirs / "prompts.json.gz").read_bytes()
    real, calls = hw._cli, []

    def failing(argv):
        calls.append(argv)
        if "--add-prompts" in argv:
            raise ValueError("AnswerStore: the store refused")
        return real(argv)

    monkeypatch.setattr(hw, "_cli", failing)
    run = list(args)
    run[run.index("--answers") + 1] = str(theirs)
    run[run.index("--self-prompts") + 1] = "3"
    run[run.index("--total-steps") + 1] = "1"
    rc = hw.main(run + ["--self-batch-size", "7", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
                        "--tau-limit", "0"])
    assert rc == 0
    assert "no self-written prompts added (ValueError: AnswerStore: the store refused)" in capsys.readouterr().err
    (add,) = [a for a in calls if "--add-prompts" in a]
    assert add[add.index("--gen-batch-size") + 1] == "7"
    # bounded in time (--self-seconds), the first window's seed 0
    assert float(add[add.index("--time-limit") + 1]) == 60 and add[add.index("--seed") + 1] == "0"
    assert len(calls) >= 2 and (theirs / "prompts.json.gz").read_bytes() == before
    parts = os.listdir(tmp_path / "o")
    assert parts and all(p.startswith("head-window.tar.") for p in parts)
