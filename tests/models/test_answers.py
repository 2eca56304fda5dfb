"""The target's answers kept as token ids (heterospec.models.answers) and the training features computed from them
by one teacher-forced forward (heterospec.models.train.teacher_forced / store_features), on a tiny random target;
the CLI's --answers."""
import json
import os
import shutil
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _models import prompts, reference_greedy, tiny_target  # noqa: E402

from heterospec.models import answers as am  # noqa: E402
from heterospec.models import train as tr  # noqa: E402

IDENT = {"name": "tiny", "config_sha256": "0" * 64, "vocab_size": 64}


def _ids(ps):
    return [p.view(-1).cpu().numpy() for p in ps]


def test_batched_answers_equal_each_prompt_decoded_alone():
    """answer(): left-padded batches on the static cache give every prompt the target's own greedy answer (HF
    generate on that prompt alone, no padding), cut after the first end-of-turn id."""
    model = tiny_target("llama")
    ps = prompts(7)
    got = am.answer(model, _ids(ps), max_new_tokens=9, eos_token_id=None, batch_size=3)
    for p, a in zip(ps, got):
        want = reference_greedy(model, p, new=9)[0, p.shape[1]:].numpy()
        assert a.dtype == np.int64 and np.array_equal(a, want)
    eos = int(got[0][3])                                    # a token the first answer emits at its 4th step
    cut = am.answer(model, _ids(ps), max_new_tokens=9, eos_token_id=eos, batch_size=4)
    for a, c in zip(got, cut):
        hit = np.flatnonzero(a == eos)
        assert np.array_equal(c, a[: hit[0] + 1] if hit.size else a)
    assert cut[0].size == np.flatnonzero(got[0] == eos)[0] + 1


def _open(d, ps, **kw):
    args = dict(prompt_ids=_ids(ps), target=IDENT, dtype="float32", max_new_tokens=6, eos_token_id=None,
                shard_size=2, vocab_size=64)
    args.update(kw)
    return am.AnswerStore.open(d, **args)


def test_the_store_grows_shard_by_shard_and_refuses_other_settings(tmp_path, monkeypatch):
    model = tiny_target("llama")
    ps = prompts(5)
    d = tmp_path / "answers"
    store = _open(d, ps, texts={"prompts": [f"p{i}" for i in range(5)]})
    assert store.collect(model, _ids(ps), limit=3) == [0, 1]
    assert store.present() == [0, 1]
    calls = []
    real = am.answer
    monkeypatch.setattr(am, "answer", lambda m, p, **k: calls.append(len(p)) or real(m, p, **k))
    again = _open(d, ps)                                   # a later run, reading the manifest back
    assert again.collect(model, _ids(ps), keep=lambda i: i != 4) == [2]
    assert calls == [0]                                    # only the third shard, whose one prompt is skipped
    assert am.AnswerStore.read_prompts(d) == {"prompts": [f"p{i}" for i in range(5)]}
    for k in (0, 1):
        for j, (i, ids, start) in enumerate(again.load_shard(k)):
            assert i == 2 * k + j and start == ps[i].shape[1]
            want = reference_greedy(model, ps[i], new=6)[0]
            assert torch.equal(ids, want)                  # prompt + answer, as int64
    assert again.load_shard(2) == []
    with np.load(again.shard_path(0)) as z:
        assert z["tokens"].dtype == np.uint16              # a vocabulary of 64 fits 16 bits
    m = am.AnswerStore.read_manifest(d)
    assert m["shards"]["00000"]["sequences"] == 2 and again.answer_tokens() == 4 * 6
    with pytest.raises(ValueError, match=r"max_new_tokens.*6.*7"):
        _open(d, ps, max_new_tokens=7)
    with pytest.raises(ValueError, match="prompts_sha256"):
        _open(d, ps[::-1])
    with pytest.raises(ValueError, match="dtype: 'float32' there, 'bfloat16' now"):
        _open(d, ps, dtype="bfloat16")
    with pytest.raises(ValueError, match="argument 'prompt_ids' expected the 5 prompts"):
        again.collect(model, _ids(ps[:4]))
    raw = bytearray(open(again.shard_path(1), "rb").read())
    raw[-3] ^= 0xFF
    open(again.shard_path(1), "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="does not match the sha256"):
        again.load_shard(1)


def test_teacher_forced_features_equal_those_recorded_while_decoding():
    """One forward over prompt + answer gives what collect() records token by token: the same top-k ids, the
    same taps (to float16 rounding and summation order) and, for an fp32 answer, full agreement."""
    model = tiny_target("llama")
    ps = prompts(5)
    rec = tr.collect(model, ps, max_new_tokens=7, eos_token_id=None, batch_size=2, topk=4)
    seqs = [(r["ids"], r["start"]) for r in rec]
    got, agree, total = tr.teacher_forced(model, seqs, topk=4, token_budget=40)
    assert total == 5 * 7 and agree == total
    for a, b in zip(got, rec):
        assert a["start"] == b["start"] and torch.equal(a["ids"], b["ids"])
        assert a["taps"].shape == b["taps"].shape and a["taps"].dtype == torch.float16
        assert torch.allclose(a["taps"].float(), b["taps"].float(), atol=3e-3, rtol=2e-3)
        s = a["start"] - 1
        assert torch.equal(a["top_ids"][s:], b["top_ids"][s:])
        assert torch.allclose(a["top_lp"].float(), b["top_lp"].float(), atol=2e-3)
        assert not a["top_ids"][:s].any()                  # rows before the answer are unused zeros
    wrong = [(torch.cat([ids[:s], (ids[s:] + 1) % 64]), s) for ids, s in seqs]
    _, agree2, _ = tr.teacher_forced(model, wrong, topk=4)
    assert agree2 < total


def test_features_are_cached_per_shard_and_recomputed_for_other_settings(tmp_path, monkeypatch):
    model = tiny_target("llama")
    ps = prompts(5)
    store = _open(tmp_path / "answers", ps)
    store.collect(model, _ids(ps), limit=4)
    calls = []
    real = tr.teacher_forced
    monkeypatch.setattr(tr, "teacher_forced", lambda m, s, **k: calls.append(len(s)) or real(m, s, **k))
    cache = tmp_path / "features"
    recs, agree, total = tr.store_features(model, store, cache, IDENT, topk=4)
    assert calls == [2, 2] and len(recs) == 4 and agree == total == 4 * 6
    recs2, agree2, _ = tr.store_features(model, store, cache, IDENT, topk=4)
    assert calls == [2, 2] and agree2 == agree               # from the cache
    for a, b in zip(recs, recs2):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["taps"], b["taps"])
    tr.store_features(model, store, cache, IDENT, topk=3, limit=2)
    assert calls == [2, 2, 2]                                 # another top-k: the first shard again, not the second
    store.collect(model, _ids(ps))
    recs3, _, _ = tr.store_features(model, store, cache, IDENT, topk=4)
    assert calls == [2, 2, 2, 2, 1] and len(recs3) == 5      # shard 0 was overwritten with top-k 3; shard 2 is new


def test_train_draft_on_answers_command(tmp_path, capsys):
    """The CLI: --answers DIR --collect-only answers the shuffled list (kept in DIR/prompts.json.gz); a later run
    trains on the first --max-prompts from them, the features cached in --features; bad combinations exit 2."""
    from _cli import run_cli
    from _pairs import save_tiny_pair

    save_tiny_pair(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"w{i} w{i + 3} w{i + 7}"}) for i in range(7)))
    ans = tmp_path / "answers"
    base = ["train-draft", "--target", str(tmp_path / "target"), "--data",
            str(data), "--out", str(tmp_path / "trained"), "--max-new-tokens", "8", "--answers", str(ans),
            "--shard-size", "3", "--device", "cpu", "--features", str(tmp_path / "feat")]
    rc, out, err = run_cli(base + ["--collect-only", "--max-prompts", "5"], capsys)
    assert rc == 0, err
    assert "0 of 3 shards answered" in out and not (tmp_path / "trained").exists()
    listed = am.AnswerStore.read_prompts(ans)["prompts"]
    assert sorted(listed) == sorted(f"w{i} w{i + 3} w{i + 7}" for i in range(7))
    assert am.AnswerStore(ans, am.AnswerStore.read_manifest(ans)).present() == [0, 1]
    data.write_text("")                                   # a rerun reads the saved list, not --data
    rc, out, err = run_cli(base + ["--max-prompts", "6", "--steps", "3", "--val-fraction", "0.2",
                                 "--draft-vocab-size", "40"], capsys)
    assert rc == 0, err
    assert "features of shard 1" in out and "100.00 %" in out
    assert sorted(p.name for p in (tmp_path / "feat").glob("*.pt")) == ["features-00000.pt", "features-00001.pt"]
    meta = json.loads((tmp_path / "trained" / "training_log.json").read_text())
    assert meta["sequences"] + meta["validation_sequences"] == 6
    # without --max-prompts a training run answers nothing new: it trains on the answered shards, --epochs
    # passes over them (6 sequences, batches of 4: 2 epochs = 3 steps)
    rc, out, err = run_cli(base + ["--epochs", "2", "--batch-size", "4", "--val-fraction", "0", "--draft-vocab-size",
                                 "40", "--out", str(tmp_path / "epochs")], capsys)
    assert rc == 0, err
    assert "2 of 3 shards answered" in out and "0 to answer now" in out
    assert am.AnswerStore(ans, am.AnswerStore.read_manifest(ans)).present() == [0, 1]
    meta = json.loads((tmp_path / "epochs" / "training_log.json").read_text())
    assert meta["sequences"] == 6 and meta["steps"] == 3
    rc, out, err = run_cli(base + ["--epochs", "0"], capsys)
    assert rc == 2 and "--epochs: expected a number > 0, got 0" in err
    rc, out, err = run_cli(base + ["--records", str(tmp_path / "rec")], capsys)
    assert rc == 2 and "--answers" in err and "Traceback" not in err
    rc, out, err = run_cli(base + ["--max-new-tokens", "9", "--collect-only"], capsys)
    assert rc == 2 and "--max-new-tokens: expected 8 (the answers in" in err
    assert "got 9" in err and "Traceback" not in err
    rc, out, err = run_cli(base + ["--answer-dtype", "bfloat16", "--collect-only"], capsys)
    assert rc == 2 and "--answer-dtype: expected float32" in err


def test_training_under_bf16_autocast_lowers_the_loss(tmp_path, monkeypatch):
    """--autocast bfloat16: the head's forward runs in bf16 (seen by the linear layers), its weights stay fp32, and
    training still learns; anything but bfloat16 / float16 / None is refused."""
    model = tiny_target("llama")
    ps = prompts(6)
    records = tr.collect(model, ps, max_new_tokens=32, eos_token_id=None, batch_size=3, topk=8)
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, b=None: (seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                                                          else None), real(x, w, b))[1])
    log = tr.train_draft(model, None, tmp_path, records=records, draft_vocab_size=60, steps=100, lr=3e-3,
                         ttt_steps=3, log_every=10, autocast="bfloat16")
    assert seen and set(seen) == {torch.bfloat16}
    first, last = log[0][1], np.mean([loss for _, loss, _ in log[-3:]])
    assert last < 0.7 * first, log
    head = torch.load(tmp_path / "trainer_state.pt", weights_only=True)["optimizer"]["state"][0]["exp_avg"]
    assert head.dtype == torch.float32
    assert json.loads((tmp_path / "training_log.json").read_text())["autocast"] == "bfloat16"
    with pytest.raises(ValueError, match="argument 'autocast' expected"):
        tr.train_draft(model, None, tmp_path / "x", records=records, steps=1, autocast="int8")


def test_later_turns_are_answered_after_the_targets_own_earlier_answers(tmp_path, capsys):
    """Issue 43.1, multi-turn: a conversation's turn t is asked after turns 1..t-1 and the target's own answers to
    them (the chat rendering of encode_turn), in a store of its own per answered shard and turn; training reads
    them all."""
    from _cli import run_cli
    from _pairs import save_tiny_pair

    from heterospec.tools.commands import LATER
    from heterospec.tools.prompts import encode_turn

    model, tok = save_tiny_pair(tmp_path)
    data = tmp_path / "conv.jsonl"
    convs = [["w1 w2 w3", "w4 w5", "w6"], ["w7 w8"], ["w9 w10 w11", "w12 w13"]]
    data.write_text("\n".join(json.dumps({"turns": c}) for c in convs))
    ans = tmp_path / "answers"
    base = ["train-draft", "--target", str(tmp_path / "target"), "--data",
            str(data), "--out", str(tmp_path / "trained"), "--max-new-tokens", "6", "--answers", str(ans),
            "--shard-size", "2", "--device", "cpu", "--features", str(tmp_path / "feat")]
    rc, _, err = run_cli(base + ["--collect-only"], capsys)
    assert rc == 0, err
    saved = am.AnswerStore.read_prompts(ans)
    order = saved["prompts"]                                    # the first turns, shuffled
    assert sorted(order) == sorted(c[0] for c in convs)
    assert {order[int(i)]: t for i, t in saved["later_turns"].items()} == {c[0]: c[1:] for c in convs if len(c) > 1}
    first = {}
    store = am.AnswerStore(ans, am.AnswerStore.read_manifest(ans))
    for k in store.present():
        for i, seq, start in store.load_shard(k):
            first[order[i]] = seq[start:]
    later = sorted(p.name for p in (ans / LATER).iterdir())
    checked = 0
    for name in later:
        d = ans / LATER / name
        s = am.AnswerStore(d, am.AnswerStore.read_manifest(d))
        meta = am.AnswerStore.read_prompts(d)
        for j, seq, start in s.load_shard(0):
            c = next(c for c in convs if c[0] == order[meta["conversations"][j]])
            t = meta["turn"]
            answers = [tok.decode(first[c[0]], skip_special_tokens=True)]
            if t == 3:   # the turn-2 answer of the same conversation, from its own store
                d2 = ans / LATER / name.replace("turn-3", "turn-2")
                m2 = am.AnswerStore.read_prompts(d2)
                s2 = am.AnswerStore(d2, am.AnswerStore.read_manifest(d2))
                a2 = {m2["conversations"][jj]: sq[st:] for jj, sq, st in s2.load_shard(0)}
                answers.append(tok.decode(a2[meta["conversations"][j]], skip_special_tokens=True))
            prompt = encode_turn(tok, c[:t], answers, chat=True)
            assert np.array_equal(seq[:start], prompt[0].numpy())
            want = reference_greedy(model, prompt, new=6)[0, prompt.shape[1]:].numpy()
            assert np.array_equal(seq[start:], want)
            checked += 1
    assert checked == 3                                          # turn 2 of two conversations, turn 3 of one
    rc, _, err = run_cli(base + ["--steps", "2", "--val-fraction", "0", "--draft-vocab-size", "40"], capsys)
    assert rc == 0, err
    meta = json.loads((tmp_path / "trained" / "training_log.json").read_text())
    assert meta["sequences"] == 3 + 3                            # three first turns, three later ones


def _collect_conversations(tmp_path, convs, new, capsys):
    """train-draft --collect-only over ``convs`` (lists of user turns) into tmp_path/answers, with the tiny pair
    saved in tmp_path/target: (the answers' directory, what the command printed)."""
    from _cli import run_cli

    data = tmp_path / "conv.jsonl"
    data.write_text("\n".join(json.dumps({"turns": c}) for c in convs))
    ans = tmp_path / "answers"
    rc, out, err = run_cli(["train-draft", "--target", tmp_path / "target", "--data", data, "--out", tmp_path / "o",
                            "--max-new-tokens", new, "--answers", ans, "--shard-size", "2", "--device", "cpu",
                            "--collect-only"], capsys)
    assert rc == 0, err
    return ans, out


def test_stores_answered_together_hold_what_each_would_alone(tmp_path, monkeypatch):
    """collect_together: one-shard stores share the target's batches (a group of about `group` prompts goes as
    one sorted list); each store's shard holds exactly the answers it would get alone, its kept prompts only, and
    its manifest entry; a past deadline starts nothing; a store of several shards is refused."""
    model = tiny_target("llama")
    ps = prompts(9)
    sizes = [1, 3, 2, 1, 2]                                       # five stores, 9 prompts
    jobs, at = [], 0
    for n, size in enumerate(sizes):
        mine = ps[at: at + size]
        at += size
        store = _open(tmp_path / f"s{n}", mine, shard_size=size)
        keep = (lambda j: j != 1) if n == 1 else None                # the second store leaves its prompt 1 out
        jobs.append((store, _ids(mine), keep))
    with pytest.raises(ValueError, match="one shard"):
        am.AnswerStore.collect_together(model, [(_open(tmp_path / "x", ps[:3]), _ids(ps[:3]), None)])
    with pytest.raises(ValueError, match="expected the 3 prompts"):
        am.AnswerStore.collect_together(model, [(jobs[1][0], _ids(ps[:2]), None)])
    assert am.AnswerStore.collect_together(model, jobs, deadline=0.0) == ([], 0.0)   # monotonic() is past 0
    # an earlier call's last group took 1,000 s: none fits a deadline 100 s away
    assert am.AnswerStore.collect_together(model, jobs, deadline=time.monotonic() + 100, last=1000.0)[0] == []
    assert all(s.present() == [] for s, _, _ in jobs)
    calls, logged = [], []
    real = am.answer
    monkeypatch.setattr(am, "answer", lambda m, p, **k: calls.append(len(p)) or real(m, p, **k))
    done, last = am.AnswerStore.collect_together(model, jobs, batch_size=2, group=4,
                                                 log=lambda part, sec, ntok: logged.append((part, ntok)))
    assert done == [s for s, _, _ in jobs] and last > 0
    assert [p for p, _ in logged] == [done[:3], done[3:]]
    logged = [(len(p), n) for p, n in logged]
    # a group takes stores until it holds at least 4 kept prompts: stores 0-2 (1 + 2 + 2), then 3-4 (1 + 2)
    assert calls == [5, 3] and [n for n, _ in logged] == [3, 2]
    at = 0
    for n, (store, ids, keep) in enumerate(jobs):
        mine = ps[at: at + sizes[n]]
        at += sizes[n]
        rows = store.load_shard(0)
        assert [i for i, _, _ in rows] == [j for j in range(sizes[n]) if keep is None or keep(j)]
        for i, seq, start in rows:
            assert start == mine[i].shape[1]
            assert torch.equal(seq, reference_greedy(model, mine[i], new=6)[0])
        entry = am.AnswerStore.read_manifest(store.directory)["shards"]["00000"]
        assert entry["sequences"] == len(rows) and entry["answer_tokens"] == sum(x.numel() - st for _, x, st in rows)
        assert entry["sha256"] == am.file_sha256(store.shard_path(0))
    assert sum(ntok for _, ntok in logged) == sum(s.answer_tokens() for s in done)
    # answered stores are left as they are
    calls.clear()
    assert am.AnswerStore.collect_together(model, jobs)[0] == [] and calls == []


def test_a_stopped_save_leaves_no_shard_and_an_unrecorded_whole_shard_is_entered(tmp_path):
    """present() counts shard-NNNNN.npz only (not the .tmp.npz a stopped save leaves); a shard renamed into
    place whose manifest entry was never written (a stop between the two) gets its entry from the file."""
    model = tiny_target("llama")
    ps = prompts(4)
    store = _open(tmp_path / "a", ps)
    store.collect(model, _ids(ps), limit=2)
    (tmp_path / "a" / "shard-00001.tmp.npz").write_bytes(b"half")
    assert store.present() == [0]
    entry = dict(store.manifest["shards"]["00000"])
    del store.manifest["shards"]["00000"]
    store._write_manifest()
    again = am.AnswerStore(store.directory, am.AnswerStore.read_manifest(store.directory))
    assert again.shard_sha256(0) == entry["sha256"]
    got = am.AnswerStore.read_manifest(store.directory)["shards"]["00000"]
    assert {k: got[k] for k in ("sha256", "sequences", "answer_tokens")} == \
        {k: entry[k] for k in ("sha256", "sequences", "answer_tokens")} and got["recovered"]


def test_answered_later_turns_are_reopened_without_rendering_unless_their_answers_changed(tmp_path, monkeypatch,
                                                                                          capsys):
    """Later turns are answered turn by turn, every shard's turn t together.  A run over answered later turns
    (training's, or a window's second pass) opens each turn store by the sha256s of the answers its prompts were
    built on: nothing decoded or rendered.  A store without that record
    (written before it) is rendered and checked once, then recorded; a changed first-turn answer makes its turn
    stores fail the check, as before."""
    import io
    import types

    from _pairs import save_tiny_pair

    from heterospec.tools import commands

    _, tok = save_tiny_pair(tmp_path)
    ans, out = _collect_conversations(tmp_path, [["w1 w2", "w3", "w4"], ["w5 w6", "w7"], ["w8 w9", "w10", "w11"],
                                                 ["w12 w13", "w14"]], new=6, capsys=capsys)
    # both shards' second turns in one group of the target's batches, then the third turns
    assert "later-turns turn 2 (2 stores, 4 prompts)" in out and "later-turns turn 3 (" in out
    saved = am.AnswerStore.read_prompts(ans)
    args = types.SimpleNamespace(answers=str(ans), max_new_tokens=6, max_prompts=None, no_chat_template=False,
                                 gen_batch_size=4, max_prompt_tokens=1024, deadline=None)
    rendered = []
    real = commands.encode_turn
    monkeypatch.setattr(commands, "encode_turn", lambda *a, **k: rendered.append(1) or real(*a, **k))

    decoded = []
    real_decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda *a, **k: decoded.append(1) or real_decode(*a, **k))

    def stores(collect=False):
        store = am.AnswerStore(str(ans), am.AnswerStore.read_manifest(ans))
        got = commands.later_turn_stores(args, None, tok, store, saved["prompts"], saved["later_turns"], None,
                                         collect, io.StringIO(), None)
        return sorted(os.path.basename(s.directory) for s in got)

    names = sorted(p.name for p in (ans / commands.LATER).iterdir())
    assert any(n.endswith("turn-3") for n in names) and stores() == names and rendered == [] and decoded == []
    # collecting over shards whose conversations are all answered: nothing to decode, render or answer (the
    # answerer is None: any answering would fail)
    assert stores(collect=True) == names and rendered == [] and decoded == []
    turn3 = next(n for n in names if n.endswith("turn-3"))
    m = am.AnswerStore.read_manifest(ans / commands.LATER / turn3)
    assert len(m["built_on"]) == 2                                 # the first turns' shard, then turn 2's
    del m["built_on"]                                              # a store written before the record
    (ans / commands.LATER / turn3 / "manifest.json").write_text(json.dumps(m))
    assert stores() == names and len(rendered) == m["prompts"]     # its prompts rendered and checked
    assert "built_on" in am.AnswerStore.read_manifest(ans / commands.LATER / turn3)
    rendered.clear()
    assert stores() == names and rendered == []
    # a first-turn answer changes: the turn stores built on it no longer match their prompts
    store = am.AnswerStore(str(ans), am.AnswerStore.read_manifest(ans))
    k = int(turn3[6:11])
    rows = store.load_shard(k)
    seqs = [ids.numpy().copy() for _, ids, _ in rows]
    seqs[0][-1] = (seqs[0][-1] + 1) % 97
    store._save(k, [i for i, _, _ in rows], seqs, [st for _, _, st in rows])
    store.manifest["shards"][f"{k:05d}"]["sha256"] = am.file_sha256(store.shard_path(k))
    store._write_manifest()
    with pytest.raises(ValueError, match="holds answers for other prompts"):
        stores()


def test_a_turn_cut_by_the_deadline_starts_no_later_turn(tmp_path, monkeypatch, capsys):
    """When the deadline stops a turn's answering partway, no later turn is started in that call (the turn
    stores answered go on in the next run), and the stores made but not answered are returned unanswered."""
    import io
    import types

    from _pairs import save_tiny_pair

    from heterospec.tools import commands

    model, tok = save_tiny_pair(tmp_path)
    ans, _ = _collect_conversations(tmp_path, [["w1 w2", "w3", "w4"], ["w5 w6", "w7", "w8"],
                                               ["w9 w10", "w11", "w12"], ["w13 w14", "w15", "w16"]], new=4,
                                     capsys=capsys)
    shutil.rmtree(ans / commands.LATER)                         # the first turns answered, no later turn yet
    store = am.AnswerStore(str(ans), am.AnswerStore.read_manifest(ans))
    assert store.present() == [0, 1]
    saved = am.AnswerStore.read_prompts(ans)
    real = am.AnswerStore.collect_together

    def first_only(target, jobs, **kw):   # the deadline came after the first group (one store)
        done, last = real(target, jobs[:1], **kw)
        return done, last

    monkeypatch.setattr(am.AnswerStore, "collect_together", staticmethod(first_only))
    args = types.SimpleNamespace(answers=str(ans), max_new_tokens=4, max_prompts=None, no_chat_template=False,
                                 gen_batch_size=4, max_prompt_tokens=1024, deadline=None)
    got = commands.later_turn_stores(args, model, tok, store, saved["prompts"], saved["later_turns"], None, True,
                                     io.StringIO(), lambda *a: None)
    assert [(os.path.basename(s.directory), s.present()) for s in got] == \
        [("shard-00000-turn-2", [0]), ("shard-00001-turn-2", [])]
    assert sorted(p.name for p in (ans / commands.LATER).iterdir()) == ["shard-00000-turn-2", "shard-00001-turn-2"]


def test_a_store_grows_its_prompt_list_and_keeps_its_answered_shards(tmp_path):
    """extend(): the new list must begin with the old; the answered shards keep their ranges and stay valid,
    except the old list's short last shard (its range now holds more prompts), which is removed and answered
    again; the manifest keeps the old list's count and sha256."""
    model = tiny_target("llama")
    ps = prompts(7)
    d = tmp_path / "answers"
    store = _open(d, ps[:5], texts={"prompts": ["a"] * 5})
    assert store.collect(model, _ids(ps[:5])) == [0, 1, 2]         # shard 2 holds prompt 4 alone
    kept = {k: open(store.shard_path(k), "rb").read() for k in (0, 1)}
    old_sha = store.manifest["prompts_sha256"]
    with pytest.raises(ValueError, match=r"argument 'prompt_ids' expected a list beginning with the 5 prompts"):
        store.extend(_ids(ps[1:7]))
    with pytest.raises(ValueError, match="argument 'prompt_ids'"):
        store.extend(_ids(ps[:4]))
    assert store.extend(_ids(ps[:5])) == [] and store.present() == [0, 1, 2]   # the same list: nothing changes
    assert store.extend(_ids(ps), {"prompts": ["a"] * 7}) == [2]
    assert store.present() == [0, 1] and "00002" not in store.manifest["shards"]
    m = am.AnswerStore.read_manifest(d)
    assert m["prompts"] == 7 and m["prompts_sha256"] == am.prompts_sha256(_ids(ps))
    assert m["extended"] == [{"prompts": 5, "prompts_sha256": old_sha}]
    assert am.AnswerStore.read_prompts(d) == {"prompts": ["a"] * 7}
    again = _open(d, ps)                                           # the grown list opens; the old one no longer
    with pytest.raises(ValueError, match="prompts_sha256"):
        _open(d, ps[:5])
    assert again.collect(model, _ids(ps)) == [2, 3]
    for k in (0, 1):
        assert open(again.shard_path(k), "rb").read() == kept[k]
    for k in (2, 3):
        for j, (i, ids, start) in enumerate(again.load_shard(k)):
            assert i == 2 * k + j and torch.equal(ids, reference_greedy(model, ps[i], new=6)[0])
    # the prompt list's file is the same bytes for the same texts (a window's copy compares equal)
    before = (d / am.PROMPTS).read_bytes()
    again.extend(_ids(ps), {"prompts": ["a"] * 7})
    assert (d / am.PROMPTS).read_bytes() == before


def test_a_list_tokenized_differently_elsewhere_opens_on_its_texts_and_grows(tmp_path):
    """The seventh GPU window's head failure: transformers 5.17 there split one committed ShareGPT prompt (it holds
    control characters) differently from 5.23 here, so the ids' sha256 differed and the store was refused.  With
    the texts' sha256 recorded, the same texts tokenized differently open (``retokenized``) and the list grows;
    other texts are still refused, and a store without the record (written before it) still needs equal ids."""
    ps = prompts(5)
    texts = [f"p{i}" for i in range(5)]
    other = _ids(ps)
    other[3] = np.concatenate([other[3][:2], [0], other[3][2:]])          # one prompt split differently
    d = tmp_path / "answers"
    store = _open(d, ps, prompt_texts=texts)
    assert not store.retokenized and store.manifest["texts_sha256"] == am.texts_sha256(texts)
    again = _open(d, ps, prompt_ids=other, prompt_texts=texts)
    assert again.retokenized
    with pytest.raises(ValueError, match="prompts_sha256"):
        _open(d, ps, prompt_ids=other, prompt_texts=texts[:4] + ["q4"])
    with pytest.raises(ValueError, match="prompts_sha256"):
        _open(d, ps, prompt_ids=other)                                       # no texts: the ids decide
    with pytest.raises(ValueError, match="prompts_sha256"):
        _open(d, ps, prompt_ids=other, prompt_texts=texts, max_new_tokens=6, dtype="float32", shard_size=3)
    grown = other + _ids(prompts(7))[5:]
    with pytest.raises(ValueError, match="argument 'prompt_ids' expected a list beginning"):
        again.extend(grown, prompt_texts=["x"] * 7)
    old = dict(again.manifest)
    assert again.extend(grown, prompt_texts=texts + ["p5", "p6"]) == []
    m = am.AnswerStore.read_manifest(d)
    assert m["prompts"] == 7 and m["prompts_sha256"] == am.prompts_sha256(grown)
    assert m["texts_sha256"] == am.texts_sha256(texts + ["p5", "p6"])
    assert m["extended"] == [{"prompts": 5, "prompts_sha256": old["prompts_sha256"],
                              "texts_sha256": old["texts_sha256"]}]
    assert not _open(d, ps, prompt_ids=grown, prompt_texts=texts + ["p5", "p6"]).retokenized
    assert _open(d, ps, prompt_ids=_ids(ps) + grown[5:], prompt_texts=texts + ["p5", "p6"]).retokenized
    # a store written before the record gains it when its ids match, and is refused when they do not
    e = tmp_path / "old"
    _open(e, ps)
    assert "texts_sha256" not in am.AnswerStore.read_manifest(e)
    with pytest.raises(ValueError, match="prompts_sha256"):
        _open(e, ps, prompt_ids=other, prompt_texts=texts)
    _open(e, ps, prompt_texts=texts)
    assert am.AnswerStore.read_manifest(e)["texts_sha256"] == am.texts_sha256(texts)
    assert _open(e, ps, prompt_ids=other, prompt_texts=texts).retokenized


def test_add_prompts_gives_a_first_turn_list_its_later_turns_and_appends_new_conversations(tmp_path, capsys):
    """train-draft --add-prompts (issue 43.1): a store made from first turns alone gains its conversations'
    later turns, new conversations are appended to the list, the answered shards stay; the later turns of
    answered shards are answered before new shards; the same --data again adds nothing."""
    from _cli import run_cli
    from _pairs import save_tiny_pair

    from heterospec.tools.commands import LATER

    save_tiny_pair(tmp_path)
    convs = [["w1 w2 w3", "w4 w5", "w6"], ["w7 w8"], ["w9 w10 w11", "w12 w13"], ["w14 w15", "w16"]]
    firsts = tmp_path / "firsts.txt"
    firsts.write_text("\n".join(c[0] for c in convs[:3]))
    full = tmp_path / "conv.jsonl"
    full.write_text("\n".join(json.dumps({"turns": c}) for c in convs))
    ans = tmp_path / "answers"

    def run(data, *extra):
        cmd = ["train-draft", "--target", str(tmp_path / "target"), "--data",
               str(data), "--out", str(tmp_path / "trained"), "--max-new-tokens", "5", "--answers", str(ans),
               "--shard-size", "2", "--device", "cpu", "--collect-only", *extra]
        rc, out, err = run_cli(cmd, capsys)
        assert rc == 0, err
        return out

    run(firsts, "--max-prompts", "2")                          # shard 0 answered, shard 1 (one prompt) not
    before = am.AnswerStore.read_prompts(ans)
    assert "later_turns" not in before or not before["later_turns"]
    shard0 = (ans / "shard-00000.npz").read_bytes()
    out = run(full, "--add-prompts")
    assert "1 prompts appended to the 3 there, 4 later turns added" in out
    saved = am.AnswerStore.read_prompts(ans)
    assert saved["prompts"][:3] == before["prompts"] and saved["prompts"][3] == "w14 w15"
    assert {saved["prompts"][int(i)]: t for i, t in saved["later_turns"].items()} == \
        {c[0]: c[1:] for c in convs if len(c) > 1}
    assert saved["added"] == [{"data": [str(full)], "seed": 0, "prompts": 1, "later_turns": 4}]
    m = am.AnswerStore.read_manifest(ans)
    assert m["prompts"] == 4 and m["extended"][0]["prompts"] == 3
    assert (ans / "shard-00000.npz").read_bytes() == shard0     # answered before, kept as it was
    store = am.AnswerStore(ans, m)
    assert store.present() == [0, 1]
    # every conversation's later turns were answered, the first shard's before the second was started
    later = sorted(p.name for p in (ans / LATER).iterdir())
    assert (ans / LATER / "shard-00000-turn-2" / "shard-00000.npz").stat().st_mtime_ns < \
        (ans / "shard-00001.npz").stat().st_mtime_ns
    n_turns = sum(am.AnswerStore.read_manifest(ans / LATER / n)["prompts"] for n in later)
    assert n_turns == 4                                        # turns 2 and 3 of w1.., turn 2 of w9.. and of w14..
    assert "0 prompts appended to the 4 there, 0 later turns added" in run(full, "--add-prompts")
    assert am.AnswerStore.read_manifest(ans)["prompts"] == 4
    # a later turn for a prompt whose shard's later turns are answered already is left out (their lists are pinned)
    i = saved["prompts"].index("w7 w8")
    assert any(n.startswith(f"shard-{i // 2:05d}-") for n in later)
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"turns": ["w7 w8", "w17"]}))
    assert "1 conversations' later turns left out" in run(more, "--add-prompts")
    assert str(i) not in am.AnswerStore.read_prompts(ans)["later_turns"]
    # the old list's short last shard is answered again when the list grows, and its later turns with it (they
    # were built on the answers removed)
    (tmp_path / "a.jsonl").write_text(json.dumps({"turns": ["w18", "w19"]}))
    run(tmp_path / "a.jsonl", "--add-prompts")                 # 5 prompts: shard 2 holds one, with a later turn
    d2 = ans / LATER / "shard-00002-turn-2"
    assert am.AnswerStore.read_manifest(d2)["prompts"] == 1
    (tmp_path / "b.jsonl").write_text(json.dumps({"turns": ["w20", "w21"]}))
    assert "shard 2 was the old list's short last shard" in run(tmp_path / "b.jsonl", "--add-prompts")
    m2 = am.AnswerStore.read_manifest(d2)
    assert m2["prompts"] == 2
    assert m2["built_on"] == [am.AnswerStore.read_manifest(ans)["shards"]["00002"]["sha256"]]


def test_train_draft_grows_a_store_its_tokenizer_splits_differently(tmp_path, capsys, monkeypatch):
    """The CLI side of the seventh window's failure: a store listed with one tokenizer, then grown with
    --add-prompts (and answered) where one listed prompt encodes differently, goes on and says so; the shards
    answered before keep their bytes."""
    from _cli import run_cli
    from _pairs import save_tiny_pair

    from heterospec.tools import commands

    save_tiny_pair(tmp_path)
    firsts = tmp_path / "firsts.txt"
    firsts.write_text("w1 w2 w3\nw7 w8\nw9 w10 w11")
    more = tmp_path / "more.txt"
    more.write_text("w14 w15\nw16")
    ans = tmp_path / "answers"

    def run(data, *extra):
        rc, out, err = run_cli(["train-draft", "--target", tmp_path / "target", "--data", data, "--out",
                                tmp_path / "trained", "--max-new-tokens", "4", "--answers", ans, "--shard-size", "2",
                                "--device", "cpu", "--collect-only", *extra], capsys)
        assert rc == 0, err
        return out

    run(firsts, "--max-prompts", "2")
    shard0 = (ans / "shard-00000.npz").read_bytes()
    real = commands.encode_many

    def other_tokenizer(tokenizer, texts, chat=True):   # another version: one more token in one listed prompt
        return [np.concatenate([ids[:1], ids]) if text == "w7 w8" else ids
                for text, ids in zip(texts, real(tokenizer, texts, chat))]

    monkeypatch.setattr(commands, "encode_many", other_tokenizer)
    out = run(more, "--add-prompts")
    assert "splits some listed prompt differently" in out and "2 prompts appended to the 3 there" in out
    m = am.AnswerStore.read_manifest(ans)
    assert m["prompts"] == 5 and am.AnswerStore(ans, m).present() == [0, 1, 2]
    assert (ans / "shard-00000.npz").read_bytes() == shard0
    monkeypatch.setattr(commands, "encode_many", real)               # back on the first machine
    assert "splits some listed prompt differently" in run(more)
