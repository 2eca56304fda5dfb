"""The head recipe in GPU windows (issue 43.2): answer, train, measure, and carry the state to the next window.

A window of ours is one device call of at most 10 minutes on a fresh machine, days apart; what comes back is
at most a few files of 16 MiB.  So one call of ``run`` does everything a window can, inside ``--seconds``:

1. **continue**: the training state of the last window (``--state DIR``: the parts ``merge`` made, carried in
   by ``.ci/gpu_carry.py prepare --head-state``), or the state already in ``--work`` on this machine, or the
   shipped head (``--init-head``);
2. **answer**: until the list holds ``--self-prompts`` prompts the target wrote for itself, it first writes more
   (``--self-seconds`` at most a window), appended to the list; then it answers the later turns of
   conversations begun in earlier windows and the next prompts of the committed answer store (``--answers``: HF's
   ``generate`` on the static cache at ``--gen-batch-size``, bfloat16), no shard started past its share of
   the time;
3. **train** on every answered shard (the committed ones and the new), the features recomputed on the fly
   by one teacher-forced forward per batch (no feature files), bf16 autocast, TTT 7, until the time left
   for the last steps;
4. **measure** tau and first-step acceptance on the five benchmark files (static 7/10/60, greedy, 10
   questions each, 256 tokens, float32; the questions of a file decoded as one batch);
5. **pack** the whole state into ``--out``: one archive split into parts of at most 16 MiB
   (``head-window.tar.NN``, three for a window of ours): the new answer shards as token ids (compressed
   .npz, as the repository keeps them), the head (float16, loadable as it is) and the optimizer (AdamW's
   second moment, 8 bits a value on a log scale per block of 256; its first moment is not kept -- it
   forgets in ~10 steps, and carrying it would not fit the three files).

Back here, ``merge`` puts the new answers into the committed store (checked against their sha256) and writes
the state without them to ``--carry-out`` (default ``.gpu-carry/head-state``, ignored by git) for the next
window:

    python -m benchmarks.head_window run --out $OUT --device cuda [--state DIR] [--seconds 500]
    python -m benchmarks.head_window merge PART... [--answers DIR] [--carry-out DIR]
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # a checkout without pip install

FORMAT = "heterospec.head-window/1"
PART_BYTES = 16 * 2**20          # what one file back from the device tool may hold
PREFIX = "head-window.tar."
ANSWERS = os.path.join("benchmarks", "answers", "smollm2-135m-instruct")
BLOCK = 256                      # values per quantisation block of the second moment
FLOOR = 1e-18                    # smaller second moments are kept as this (AdamW's eps**2 is 1e-16)


# ---- the optimizer in 8 bits -------------------------------------------------------------------------------

def quantize_moment(v):
    """AdamW's second moment (a float tensor >= 0) in 8 bits a value: code 0 for a value <= :data:`FLOOR` (it
    weighs nothing next to AdamW's eps), codes 1..255 on a log scale between each block's smallest and largest
    larger value (blocks of :data:`BLOCK`).  Returns (codes uint8 [n], lo [blocks], hi [blocks]) as NumPy
    arrays; the relative error of sqrt(v) is at most exp((hi - lo) / 508) - 1 in a block."""
    import numpy as np

    v = v.detach().float().cpu().numpy().reshape(-1).astype(np.float64)
    n = v.size
    pad = (-n) % BLOCK
    vb = np.concatenate([v, np.zeros(pad)]).reshape(-1, BLOCK)
    live = vb > FLOOR
    x = np.log(np.where(live, vb, 1.0))
    lo = np.where(live.any(1), np.where(live, x, np.inf).min(1), 0.0)
    hi = np.where(live.any(1), np.where(live, x, -np.inf).max(1), 0.0)
    span = np.where(hi > lo, hi - lo, 1.0)
    q = np.where(live, 1 + np.rint((x - lo[:, None]) / span[:, None] * 254), 0).astype(np.uint8).reshape(-1)[:n]
    return q, lo.astype(np.float32), hi.astype(np.float32)


def dequantize_moment(q, lo, hi, shape):
    import numpy as np
    import torch

    n = q.size
    pad = (-n) % BLOCK
    qb = np.concatenate([q, np.zeros(pad, np.uint8)]).reshape(-1, BLOCK).astype(np.float64)
    lo, hi = lo.astype(np.float64), hi.astype(np.float64)
    v = np.where(qb > 0, np.exp(lo[:, None] + (qb - 1) / 254 * (hi - lo)[:, None]), 0.0).reshape(-1)[:n]
    return torch.from_numpy(v.astype(np.float32)).view(shape)


def compact_optimizer(state):
    """AdamW's state dict -> (npz bytes, json-able meta): the second moments in 8 bits, the step counts."""
    import numpy as np

    arrays, meta = {}, {"param_groups": state["param_groups"], "params": {}}
    for i, s in state["state"].items():
        q, lo, hi = quantize_moment(s["exp_avg_sq"])
        arrays[f"q{i}"], arrays[f"lo{i}"], arrays[f"hi{i}"] = q, lo, hi
        meta["params"][str(i)] = {"shape": list(s["exp_avg_sq"].shape), "step": float(s["step"])}
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue(), meta


def restore_optimizer(npz_bytes, meta):
    """The AdamW state dict of :func:`compact_optimizer`'s output: the second moments back, the first moments 0."""
    import numpy as np
    import torch

    z = np.load(io.BytesIO(npz_bytes))
    state = {}
    for key, p in meta["params"].items():
        v = dequantize_moment(z[f"q{key}"], z[f"lo{key}"], z[f"hi{key}"], tuple(p["shape"]))
        state[int(key)] = {"step": torch.tensor(p["step"]), "exp_avg": torch.zeros_like(v), "exp_avg_sq": v}
    return {"state": state, "param_groups": meta["param_groups"]}


# ---- the archive --------------------------------------------------------------------------------------------

def _sha(b):
    return hashlib.sha256(b).hexdigest()


def _file_sha(path):
    with open(path, "rb") as f:
        return _sha(f.read())


def _head_fp16(path):
    """The checkpoint's model.safetensors with its float tensors in float16 (as a head ships), as bytes."""
    import torch
    from safetensors.torch import load_file, save

    sd = load_file(path)
    return save({k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()},
                metadata={"format": "pt"})


def state_members(head_dir):
    """{archive name: bytes} of the training state in ``head_dir`` (train_draft's out_dir without validation:
    the head, training_log.json and trainer_state.pt)."""
    import torch

    st = torch.load(os.path.join(head_dir, "trainer_state.pt"), weights_only=True)
    npz, opt_meta = compact_optimizer(st["optimizer"])
    trainer = {"step": int(st["step"]), "log": st["log"], "val_log": st["val_log"], "best": st.get("best"),
               "stale": st.get("stale", 0), "optimizer": opt_meta}
    with open(os.path.join(head_dir, "config.json"), "rb") as f:
        cfg = json.loads(f.read())
    cfg["torch_dtype"] = "float16"
    out = {"head/config.json": json.dumps(cfg, indent=2).encode(),
           "head/model.safetensors": _head_fp16(os.path.join(head_dir, "model.safetensors")),
           "optimizer.npz": npz, "trainer.json": json.dumps(trainer).encode()}
    log = os.path.join(head_dir, "training_log.json")
    if os.path.exists(log):
        with open(log, "rb") as f:
            out["head/training_log.json"] = f.read()
    return out


def write_parts(members, out_dir, info, part_bytes=PART_BYTES):
    """One uncompressed tar of ``index.json`` (``info`` and every member's sha256) and ``members``, written as
    ``out_dir/head-window.tar.01, .02, ...`` of at most ``part_bytes`` each.  Returns the part paths."""
    index = dict(info, format=FORMAT, members={k: _sha(v) for k, v in members.items()})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [("index.json", json.dumps(index, indent=1).encode())] + sorted(members.items()):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
            tar.addfile(ti, io.BytesIO(data))
    data = buf.getvalue()
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        if f.startswith(PREFIX):
            os.remove(os.path.join(out_dir, f))
    paths = []
    for k in range(0, max(len(data), 1), part_bytes):
        p = os.path.join(out_dir, f"{PREFIX}{k // part_bytes + 1:02d}")
        with open(p, "wb") as f:
            f.write(data[k: k + part_bytes])
        paths.append(p)
    return paths


def read_parts(paths):
    """(index, {name: bytes}) of the parts of one archive (every part, any order); a missing part or a member
    that does not match its sha256 raises ValueError naming it."""
    paths = sorted(paths, key=os.path.basename)
    nums = [int(os.path.basename(p)[len(PREFIX):]) for p in paths if os.path.basename(p).startswith(PREFIX)]
    if len(nums) != len(paths) or nums != list(range(1, len(paths) + 1)):
        raise ValueError(f"head_window: argument 'parts' expected {PREFIX}01..NN, all of them, got "
                         f"{[os.path.basename(p) for p in paths]}")
    data = b"".join(open(p, "rb").read() for p in paths)
    members = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for ti in tar:
                members[ti.name] = tar.extractfile(ti).read()
    except tarfile.TarError as e:
        raise ValueError(f"head_window: parts {paths[0]}..: not one whole archive ({e}); is a part missing?") from e
    index = json.loads(members.pop("index.json", b"{}"))
    if index.get("format") != FORMAT:
        raise ValueError(f"head_window: argument 'parts' expected an archive of format {FORMAT}, got "
                         f"{index.get('format')!r}")
    for name, want in index["members"].items():
        if name not in members or _sha(members[name]) != want:
            raise ValueError(f"head_window: member {name} of {paths[0]}.. is missing or does not match its sha256")
    return index, members


def restore_state(members, head_dir):
    """Write the training state of an archive into ``head_dir`` as train_draft's --resume reads it."""
    import torch

    os.makedirs(head_dir, exist_ok=True)
    for name, data in members.items():
        if name.startswith("head/"):
            with open(os.path.join(head_dir, name[len("head/"):]), "wb") as f:
                f.write(data)
    t = json.loads(members["trainer.json"])
    opt = restore_optimizer(members["optimizer.npz"], t["optimizer"])
    torch.save({"step": t["step"], "optimizer": opt, "log": t["log"], "val_log": t["val_log"],
                "best": t["best"], "stale": t["stale"]}, os.path.join(head_dir, "trainer_state.pt"))
    return t["step"]


# ---- the answers --------------------------------------------------------------------------------------------

def self_written(store):
    """(prompts, calls): how many prompts the target wrote for itself are in the store's list, added by how
    many --add-prompts calls (windows)."""
    from heterospec.models.answers import AnswerStore

    saved = AnswerStore.read_prompts(store) or {}
    adds = [add for add in saved.get("added", []) if any(d.startswith("self:") for d in add.get("data", []))]
    return sum(int(add.get("prompts", 0)) for add in adds), len(adds)


def answer_files(store):
    """{path relative to the store: sha256 from its manifest} of every answered shard of ``store`` and of its
    later-turn stores (their manifests and prompt lists too, as whole files)."""
    from heterospec.models.answers import MANIFEST, PROMPTS, AnswerStore
    from heterospec.tools.commands import LATER

    out = {}
    m = AnswerStore.read_manifest(store)
    for k, s in m.get("shards", {}).items():
        if os.path.exists(os.path.join(store, f"shard-{k}.npz")):
            out[f"shard-{k}.npz"] = s["sha256"]
    later = os.path.join(store, LATER)
    for d in sorted(os.listdir(later)) if os.path.isdir(later) else []:
        sub = os.path.join(later, d)
        if os.path.exists(os.path.join(sub, MANIFEST)):
            for rel, sha in answer_files(sub).items():
                out[f"{LATER}/{d}/{rel}"] = sha
            for f in (MANIFEST, PROMPTS):
                if os.path.exists(os.path.join(sub, f)):
                    out[f"{LATER}/{d}/{f}"] = None
    return out


def merge_answers(members, store):
    """Put an archive's answers (``answers/...``) into the store at ``store``: new shard files and later-turn
    stores are written, the main manifest gains their entries; a file already there must be equal.  Returns
    (new shards, new answer tokens)."""
    from heterospec.models.answers import MANIFEST, PROMPTS, AnswerStore, short_last_shard

    mine = AnswerStore.read_manifest(store)
    theirs = json.loads(members["answers/" + MANIFEST])
    # a window that grew the list (--add-prompts) carries a manifest whose earlier lists include ours
    grew = any(e.get("prompts") == mine.get("prompts") and e.get("prompts_sha256") == mine.get("prompts_sha256")
               for e in theirs.get("extended", []))
    if grew and "answers/" + PROMPTS not in members:
        raise ValueError(f"head_window: the window grew the prompt list but its archive lacks {PROMPTS}")
    for key in ("target", "dtype", "generation", "prompts", "prompts_sha256", "shard_size", "vocab_size"):
        if mine.get(key) != theirs.get(key) and not (grew and key in ("prompts", "prompts_sha256")):
            raise ValueError(f"head_window: the window's answers are for another store ({key}: {theirs.get(key)!r} "
                             f"there, {mine.get(key)!r} in {store})")
    if grew:
        k = short_last_shard(mine["prompts"], mine["shard_size"])   # removed by the extension
        short = None if k is None else f"{k:05d}"
        if short in mine.get("shards", {}):   # the window's shard of that index, if any, comes in below
            del mine["shards"][short]
            os.remove(os.path.join(store, f"shard-{short}.npz"))
        if k is not None:   # its later turns were built on the answers removed; the window's come in below
            from heterospec.tools.commands import drop_later_turns

            drop_later_turns(store, k)
        for key in ("prompts", "prompts_sha256", "texts_sha256", "extended"):
            if key in theirs:
                mine[key] = theirs[key]
    new = tokens = 0
    for name, data in sorted(members.items()):
        if not name.startswith("answers/") or name == "answers/" + MANIFEST:
            continue
        rel = name[len("answers/"):]
        dst = os.path.join(store, rel)
        if rel == PROMPTS:
            if os.path.exists(dst) and _file_sha(dst) == _sha(data):
                continue
            if not grew:
                raise ValueError(f"head_window: the window's {PROMPTS} differs but its manifest does not "
                                 f"extend {store}'s list")
        elif os.path.exists(dst):
            with open(dst, "rb") as f:
                same = f.read() == data
            if same:
                continue
            if not rel.endswith("/" + MANIFEST):   # a later-turn store's manifest: the window's is the newer one
                raise ValueError(f"head_window: {dst} differs from the window's copy; not overwritten")
        if "/" not in rel and rel != PROMPTS:   # a main store's shard: its manifest entry must say this sha256
            entry = theirs["shards"][rel[len("shard-"):-len(".npz")]]
            if entry["sha256"] != _sha(data):
                raise ValueError(f"head_window: {rel} does not match the sha256 of the window's manifest")
            mine.setdefault("shards", {})[rel[len("shard-"):-len(".npz")]] = entry
            new += 1
            tokens += entry["answer_tokens"]
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
    mine["shards"] = dict(sorted(mine["shards"].items()))
    with open(os.path.join(store, MANIFEST + ".tmp"), "w") as f:
        json.dump(mine, f, indent=1)
    os.replace(os.path.join(store, MANIFEST + ".tmp"), os.path.join(store, MANIFEST))
    return new, tokens


# ---- the window ---------------------------------------------------------------------------------------------

def _cli(argv):
    from heterospec.tools.cli import main as cli_main

    print("+ heterospec " + " ".join(argv), flush=True)
    rc = cli_main(argv)
    if rc:
        raise SystemExit(f"head_window: heterospec {argv[0]} exited {rc}")


def run(a):
    t0 = time.monotonic()
    end = t0 + a.seconds
    head = os.path.join(a.work, "out")
    store = a.answers
    started = dict(source=None, step=0)
    if os.path.exists(os.path.join(head, "trainer_state.pt")):
        started["source"] = f"{head} (this machine)"
    elif a.state and os.path.isdir(a.state):
        parts = sorted(os.path.join(a.state, f) for f in os.listdir(a.state) if f.startswith(PREFIX))
        if parts:
            _, members = read_parts(parts)
            started["step"] = restore_state(members, head)
            started["source"] = f"{a.state} ({len(parts)} parts, step {started['step']})"
    print(f"head_window: continuing from {started['source'] or a.init_head}", flush=True)
    before = answer_files(store)
    # whole files (later-turn stores' manifests and prompt lists) by their bytes: a store rebuilt under the same
    # name (the short shard's, when the list grows) or given its built_on record changes them
    whole = {k: _file_sha(os.path.join(store, k)) for k, sha in before.items() if sha is None}
    common = ["--target", a.target, "--device", a.device, "--answers", store, "--answer-dtype", a.answer_dtype,
              "--max-new-tokens", str(a.max_new_tokens), "--shard-size", str(a.shard_size), "--out", head]
    common += ["--no-chat-template"] if a.no_chat_template else []
    from heterospec.models.answers import MANIFEST, PROMPTS

    listed = os.path.join(store, PROMPTS)
    prompts_before = _file_sha(listed) if os.path.exists(listed) else None
    t_collect = time.monotonic()
    written, calls = self_written(store)
    if a.self_prompts > written and a.self_seconds > 0:
        # the target writes prompts for itself (issue 43.1), appended to the list, --self-seconds a window until
        # the list holds --self-prompts of them (a new seed each window); answering them is for this and later
        # windows.  A failure here costs this step only.  Unbounded, the 33,000 took 400 s of the seventh
        # window's H200 at batch 256 and 320 s of the eighth's at 1,024, beside the tests
        try:
            _cli(["train-draft"] + common + ["--dtype", a.answer_dtype, "--collect-only", "--max-prompts", "0",
                                             "--add-prompts", "--data", f"self:{a.self_prompts - written}",
                                             "--seed", str(calls), "--time-limit", str(a.self_seconds),
                                             "--gen-batch-size", str(a.self_batch_size)])
        except (SystemExit, Exception) as e:
            print(f"head_window: no self-written prompts added ({type(e).__name__}: {e}); answering goes on",
                  file=sys.stderr, flush=True)
    collect_s = min(a.collect_seconds - (time.monotonic() - t_collect), end - a.reserve - time.monotonic())
    if collect_s > 0:
        _cli(["train-draft"] + common + ["--dtype", a.answer_dtype, "--collect-only", "--gen-batch-size",
                                         str(a.gen_batch_size), "--time-limit", str(collect_s)])
    t_train = time.monotonic()
    after = answer_files(store)
    # new files, and a shard answered again (the old list's short last shard, when the list grew)
    fresh = sorted(k for k, sha in after.items() if k not in before or (sha is not None and before[k] != sha))
    # a later-turn store's manifest or prompt list changed (answered now, recorded, or rebuilt)
    fresh += sorted(k for k in whole if k in after and _file_sha(os.path.join(store, k)) != whole[k])
    train_s = end - a.reserve - time.monotonic()
    if train_s > 0:
        _cli(["train-draft"] + common + ["--dtype", a.dtype, "--on-the-fly", "--init-head", a.init_head, "--resume",
                                         "--ttt-steps", "7", "--steps", str(a.total_steps), "--warmup", str(a.warmup),
                                         "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--autocast",
                                         a.autocast, "--val-fraction", "0", "--save-every", str(a.save_every),
                                         "--time-limit", str(train_s)]
             + (["--draft-vocab-size", str(a.draft_vocab_size)] if a.draft_vocab_size else []))
    t_tau = time.monotonic()
    tau = measure_head(a, head) if a.tau_limit > 0 else None
    t_pack = time.monotonic()
    members = state_members(head)
    if os.path.exists(listed) and _file_sha(listed) != prompts_before:   # the list grew in this window
        fresh.append(PROMPTS)
    for rel in fresh:
        with open(os.path.join(store, rel), "rb") as f:
            members["answers/" + rel] = f.read()
    with open(os.path.join(store, MANIFEST), "rb") as f:
        members["answers/" + MANIFEST] = f.read()
    trainer = json.loads(members["trainer.json"])
    m = json.loads(members["answers/" + MANIFEST])
    info = {"started_from": started["source"] or a.init_head, "step": trainer["step"],
            "new_answer_files": len(fresh), "answer_tokens_total": sum(s["answer_tokens"] for s in m["shards"].values()),
            "new_answer_tokens": sum(m["shards"][r[6:-4]]["answer_tokens"] for r in fresh if r.startswith("shard-")),
            "tau": tau, "device": a.device,
            "seconds": {"setup": round(t_collect - t0, 1), "answer": round(t_train - t_collect, 1),
                        "train": round(t_tau - t_train, 1), "tau": round(t_pack - t_tau, 1)}}
    paths = write_parts(members, a.out, info)
    info["seconds"]["pack"] = round(time.monotonic() - t_pack, 1)
    info["parts"] = {os.path.basename(p): os.path.getsize(p) for p in paths}
    with open(os.path.join(a.report or a.work, "head-window.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info, indent=1))
    if len(paths) > 3:
        print(f"head_window: the state is {len(paths)} parts, more than the 3 files a window plans for: answer less "
              f"(--collect-seconds)", file=sys.stderr)
    return 0


def measure_head(a, head):
    """tau and first-step acceptance of the head in ``head`` on the five benchmark files (see measure_tau)."""
    import torch

    from benchmarks.measure_tau import measure, table
    from heterospec import HeteroSpec, Policy
    from heterospec.models.default import load_pair

    ns = argparse.Namespace(target=a.target, gguf_file=None, draft=head, dtype=a.tau_dtype)
    tok, target, draft = load_pair(ns, a.device)
    draft = draft.to(a.device)
    with HeteroSpec(target, draft, Policy.static(7, 10, 60)) as hs:
        rows, mean = measure(hs, tok, a.bench_dir, limit=a.tau_limit, max_new_tokens=a.tau_tokens, batch=a.tau_limit,
                             progress=False, chat=not a.no_chat_template)
    print(table(rows, mean), flush=True)
    del target, draft
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"mean": mean, "rows": rows, "settings": {"policy": "static 7/10/60", "questions": a.tau_limit,
                                                     "max_new_tokens": a.tau_tokens, "dtype": a.tau_dtype}}


def merge(a):
    index, members = read_parts(a.parts)
    new, tokens = merge_answers(members, a.answers)
    state = {k: v for k, v in members.items() if not k.startswith("answers/")}
    info = {k: v for k, v in index.items() if k not in ("members", "format", "parts")}
    paths = write_parts(state, a.carry_out, dict(info, merged_from=[os.path.basename(p) for p in a.parts]))
    print(f"{a.answers}: {new} new shards, {tokens} answer tokens added; the state (step {index.get('step')}) for "
          f"the next window: {len(paths)} part(s) in {a.carry_out} (carry them with .ci/gpu_carry.py prepare "
          f"--head-state {a.carry_out})")
    if index.get("tau"):
        print(f"tau of this state's head: {index['tau']['mean']:.2f} (mean of the five files)")
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks.head_window", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one window: continue, answer, train, measure, pack")
    r.add_argument("--out", required=True, help="where the parts go ($OUT on the device machine)")
    r.add_argument("--work", default="head-window", help="this machine's working state (kept between calls)")
    r.add_argument("--state", default=None, help="a folder holding the parts of the last window's state")
    r.add_argument("--report", default=None, help="where head-window.json goes (default --work)")
    r.add_argument("--target", default="default")
    r.add_argument("--answers", default=os.path.join(REPO, ANSWERS))
    r.add_argument("--init-head", default="default", help="the head a first window starts from")
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16", help="the target's dtype for the features")
    r.add_argument("--answer-dtype", default="bfloat16")
    r.add_argument("--autocast", default="bfloat16")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--shard-size", type=int, default=256)
    r.add_argument("--gen-batch-size", type=int, default=256)
    r.add_argument("--batch-size", type=int, default=16, help="sequences per training step")
    r.add_argument("--lr", type=float, default=7e-4, help="5e-4 at 8 sequences a step, scaled by the square root")
    r.add_argument("--warmup", type=int, default=200)
    r.add_argument("--total-steps", type=int, default=100000, help="the schedule's length over every window")
    r.add_argument("--save-every", type=int, default=500)
    r.add_argument("--draft-vocab-size", type=int, default=None)
    r.add_argument("--seconds", type=float, default=500, help="the whole window, packing included")
    r.add_argument("--collect-seconds", type=float, default=170, help="answering's share")
    r.add_argument("--reserve", type=float, default=75, help="seconds kept for tau and packing")
    r.add_argument("--bench-dir", default=None, help="the five benchmark files (default: measure_tau's)")
    r.add_argument("--tau-limit", type=int, default=10, help="questions per benchmark file (0: no tau)")
    r.add_argument("--tau-tokens", type=int, default=256)
    r.add_argument("--tau-dtype", default="float32")
    r.add_argument("--no-chat-template", action="store_true")
    r.add_argument("--self-prompts", type=int, default=33000,
                   help="the target writes prompts for itself, appended to the list (train-draft --add-prompts "
                        "--data self:N), until the list holds this many of them, inside answering's share")
    r.add_argument("--self-seconds", type=float, default=60,
                   help="a window's time for writing them (no batch started past it; 0: none)")
    r.add_argument("--self-batch-size", type=int, default=2048,
                   help="the batch the self-written prompts are sampled in")
    m = sub.add_parser("merge", help="here, after a window: its answers into the store, its state for the next")
    m.add_argument("parts", nargs="+")
    m.add_argument("--answers", default=os.path.join(REPO, ANSWERS))
    m.add_argument("--carry-out", default=os.path.join(REPO, ".gpu-carry", "head-state"))
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.cmd == "run":
        if a.bench_dir is None:
            from benchmarks.measure_tau import default_bench_dir

            a.bench_dir = default_bench_dir()
        return run(a)
    try:
        return merge(a)
    except (ValueError, OSError) as e:
        print(f"head_window merge: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
