"""The target's own answers to the training prompts, kept as token ids in a directory that grows across runs.

A draft head learns from the target's answers.  Generating them is the slow part of training on a CPU (the
target decodes token by token), so they are kept, compactly, where the next run finds them: a directory with

- ``manifest.json``: what the answers depend on, pinned: the prompt list (count and sha256 of the prompts'
  token ids, and the sha256 of their texts: a machine whose tokenizer splits a listed prompt differently still
  has the same list, and each shard keeps the ids it was answered from), the target's identity, the dtype it
  answered in, the generation settings (greedy, ``max_new_tokens``, the end-of-turn id, the cache) and the
  shard size.  A run with other prompts, another target or other settings is refused, never mixed in.
- ``prompts.json.gz``: the training prompts (texts, shuffled once, seeded) with their sources, so the prompts of
  the shards still to answer are the same on every machine, whatever is installed there.
- ``shard-NNNNN.npz``: the answers to prompts ``[N * shard_size, (N + 1) * shard_size)`` of that list (those
  the caller kept, e.g. not too long): for each, the prompt and answer ids concatenated (``tokens``, uint16
  when the vocabulary fits, else int32), where each sequence ``offsets`` and where its answer ``starts``, and
  its ``prompt_index`` in the list.  Written whole under a temporary name, then renamed: a stopped run resumes
  at the first missing shard.

No hidden states are kept: the features training needs are one teacher-forced forward of these sequences away
(:func:`heterospec.models.train.shard_features`), cached outside the repository.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import time

import numpy as np
import torch

FORMAT = 1
MANIFEST = "manifest.json"
PROMPTS = "prompts.json.gz"
_SHARD = re.compile(r"shard-\d{5}\.npz")


def prompts_sha256(prompt_ids):
    """sha256 over the prompts' token ids (each as int64 bytes, '|'-separated): the list the shards are cut from."""
    h = hashlib.sha256()
    for p in prompt_ids:
        h.update(np.ascontiguousarray(np.asarray(p).reshape(-1), dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def texts_sha256(texts):
    """sha256 over what a list of prompts was rendered from (its texts, as JSON): the list's identity where the
    tokenizer splits some prompt differently from the machine that listed it (another transformers version: 5.17
    and 5.23 split a ShareGPT prompt holding control characters differently)."""
    return hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode("utf-8")).hexdigest()


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@torch.no_grad()
def answer(target, prompts, *, max_new_tokens, eos_token_id, batch_size=64, static_cache=True, progress=None):
    """Greedy answers of ``target`` (in its own dtype) to ``prompts`` (1-D int token arrays), batched with left
    padding (prompts sorted by length, so a batch pads little) through HuggingFace's ``generate`` on the static
    cache.  Returns one int64 array per prompt, in prompt order: the answer up to and including the first
    ``eos_token_id``, or ``max_new_tokens`` tokens."""
    dev = next(target.parameters()).device
    prompts = [torch.as_tensor(np.asarray(p).reshape(-1), dtype=torch.long) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].numel())
    out = [None] * len(prompts)
    pad = eos_token_id if eos_token_id is not None else 0
    extra = {"cache_implementation": "static"} if static_cache else {}
    done = 0
    for b0 in range(0, len(order), batch_size):
        idx = order[b0: b0 + batch_size]
        S = max(prompts[i].numel() for i in idx)
        ids = torch.full((len(idx), S), pad, dtype=torch.long)
        mask = torch.zeros(len(idx), S, dtype=torch.long)
        for r, i in enumerate(idx):
            n = prompts[i].numel()
            ids[r, S - n:] = prompts[i]
            mask[r, S - n:] = 1
        gen = target.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                              do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=eos_token_id,
                              pad_token_id=pad, **extra)[:, S:].cpu().numpy()
        for r, i in enumerate(idx):
            a = gen[r]
            if eos_token_id is not None:
                hit = np.flatnonzero(a == eos_token_id)
                a = a[: hit[0] + 1] if hit.size else a
            out[i] = a.astype(np.int64)
        done += len(idx)
        if progress is not None:
            progress(done, len(prompts))
    return out


def short_last_shard(prompts, shard_size):
    """The index of a list's last shard when it holds fewer than ``shard_size`` prompts (its range grows when the
    list does), else None."""
    return prompts // shard_size if prompts % shard_size else None


def _write_prompts(directory, texts):
    """``prompts.json.gz``, the same bytes for the same texts (no time or name in the gzip header)."""
    with open(os.path.join(directory, PROMPTS + ".tmp"), "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(json.dumps(texts).encode("utf-8"))
    os.replace(os.path.join(directory, PROMPTS + ".tmp"), os.path.join(directory, PROMPTS))


def _token_dtype(vocab_size):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


class AnswerStore:
    """A directory of the target's answers (see the module's docstring).  ``open`` checks or writes the
    manifest; ``collect`` answers the missing shards; ``sequences`` reads what is there."""

    def __init__(self, directory, manifest):
        self.directory = directory
        self.manifest = manifest
        self.retokenized = False   # opened on the texts' sha256: this machine's ids for the list differ

    # -- the manifest ---------------------------------------------------------------------------------------
    @classmethod
    def open(cls, directory, *, prompt_ids, target, dtype, max_new_tokens, eos_token_id, shard_size=256,
             vocab_size=None, texts=None, create=True, prompt_texts=None):
        """The store in ``directory`` for these prompts (token ids; ``texts`` with their sources are written to
        ``prompts.json.gz`` on creation) and settings.  ``target`` is the target's identity (a dict, as profiles
        store it, never a path).  A directory written for other prompts or settings raises ValueError naming
        every field that differs.

        ``prompt_texts``: what ``prompt_ids`` were rendered from (JSON-able, one item per prompt).  The manifest
        records their sha256; when only the ids' sha256 differs and the texts' matches, the list is the same one
        tokenized differently here, and the store opens with ``retokenized`` set (the caller says so)."""
        if shard_size < 1:
            raise ValueError(f"AnswerStore: argument 'shard_size' expected an int >= 1, got {shard_size}")
        want = {"format": FORMAT, "target": target, "dtype": str(dtype).replace("torch.", ""),
                "generation": {"greedy": True, "max_new_tokens": int(max_new_tokens),
                               "eos_token_id": None if eos_token_id is None else int(eos_token_id),
                               "cache": "static", "padding": "left"},
                "prompts": len(prompt_ids), "prompts_sha256": prompts_sha256(prompt_ids),
                "shard_size": int(shard_size), "vocab_size": vocab_size}
        path = os.path.join(directory, MANIFEST)
        if os.path.exists(path):
            with open(path) as f:
                have = json.load(f)
            pinned = {k: v for k, v in have.items() if k in want}
            diff = [k for k in want if pinned.get(k) != want[k]]
            texts_sha = None if prompt_texts is None else texts_sha256(prompt_texts)
            retokenized = (diff == ["prompts_sha256"] and texts_sha is not None
                           and have.get("texts_sha256") == texts_sha)
            if diff and not retokenized:
                raise ValueError(f"AnswerStore: {directory} holds answers for other prompts or settings "
                                 f"({'; '.join(f'{k}: {pinned.get(k)!r} there, {want[k]!r} now' for k in diff)}); "
                                 f"use another directory")
            store = cls(directory, have)
            store.retokenized = retokenized
            if texts_sha is not None and "texts_sha256" not in have:   # a store written before the record
                have["texts_sha256"] = texts_sha
                store._write_manifest()
            return store
        if not create:
            raise FileNotFoundError(f"AnswerStore: {directory} has no {MANIFEST}")
        os.makedirs(directory, exist_ok=True)
        if texts is not None:
            _write_prompts(directory, texts)
        if prompt_texts is not None:
            want["texts_sha256"] = texts_sha256(prompt_texts)
        want["shards"] = {}
        store = cls(directory, want)
        store._write_manifest()
        return store

    def extend(self, prompt_ids, texts=None, prompt_texts=None):
        """Append prompts to the store's list: ``prompt_ids`` is the whole new list, which must begin with the
        list the store was cut from (its count and sha256 pinned in the manifest, or the sha256 of its texts
        when ``prompt_texts``, the whole new list's, are given: see :meth:`open`); ``texts`` replaces
        ``prompts.json.gz``.  Shards keep their ranges, so the answered ones stay valid, except a last shard
        of the old list that was short (its range now holds more prompts): it is removed, to be answered again.
        The manifest keeps each earlier list's count and sha256 under ``"extended"``.  Returns the removed
        shards' indices."""
        m = self.manifest
        n = m["prompts"]
        same = len(prompt_ids) >= n and prompts_sha256(prompt_ids[:n]) == m["prompts_sha256"]
        if not same and prompt_texts is not None and len(prompt_texts) >= n and "texts_sha256" in m:
            same = texts_sha256(prompt_texts[:n]) == m["texts_sha256"]
        if not same:
            raise ValueError(f"AnswerStore.extend: argument 'prompt_ids' expected a list beginning with the {n} "
                             f"prompts of {self.directory}, got {len(prompt_ids)} prompts that do not")
        removed = []
        short = short_last_shard(n, m["shard_size"])
        if len(prompt_ids) > n and short is not None and os.path.exists(self.shard_path(short)):
            os.remove(self.shard_path(short))
            m.get("shards", {}).pop(f"{short:05d}", None)
            removed.append(short)
        if texts is not None:
            _write_prompts(self.directory, texts)
        if len(prompt_ids) > n:
            m.setdefault("extended", []).append({k: m[k] for k in ("prompts", "prompts_sha256", "texts_sha256")
                                                 if k in m})
            m["prompts"] = len(prompt_ids)
            m["prompts_sha256"] = prompts_sha256(prompt_ids)
        if prompt_texts is not None and len(prompt_texts) == len(prompt_ids):
            m["texts_sha256"] = texts_sha256(prompt_texts)
        self._write_manifest()
        return removed

    @staticmethod
    def read_manifest(directory):
        with open(os.path.join(directory, MANIFEST)) as f:
            return json.load(f)

    @staticmethod
    def read_prompts(directory):
        """The ``prompts.json.gz`` of a store (whatever it holds: by convention {"data", "seed", "prompts"}), or
        None."""
        path = os.path.join(directory, PROMPTS)
        if not os.path.exists(path):
            return None
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)

    def _write_manifest(self):
        tmp = os.path.join(self.directory, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.manifest, f, indent=1)
        os.replace(tmp, os.path.join(self.directory, MANIFEST))

    # -- shards -----------------------------------------------------------------------------------------------
    def shard_path(self, k):
        return os.path.join(self.directory, f"shard-{k:05d}.npz")

    def n_shards(self, limit=None):
        n = self.manifest["prompts"] if limit is None else min(limit, self.manifest["prompts"])
        return -(-n // self.manifest["shard_size"])

    def present(self):
        """Indices of the shards on disk (``shard-NNNNN.npz``; not a ``.tmp.npz`` a stopped save left)."""
        return sorted(int(f[6:11]) for f in os.listdir(self.directory) if _SHARD.fullmatch(f))

    def shard_sha256(self, k):
        """The sha256 of shard ``k`` as the manifest records it.  A shard on disk with no entry (a run stopped
        between the shard's rename and the manifest's write: the file is whole) is entered now."""
        entry = self.manifest.setdefault("shards", {}).get(f"{k:05d}")
        if entry is None:
            with np.load(self.shard_path(k)) as z:
                starts, offsets = z["starts"], z["offsets"]
            entry = {"sha256": file_sha256(self.shard_path(k)), "sequences": int(starts.size),
                     "answer_tokens": int((np.diff(offsets) - starts).sum()),
                     "seconds": None, "recovered": True}
            self.manifest["shards"][f"{k:05d}"] = entry
            self._write_manifest()
        return entry["sha256"]

    def collect(self, target, prompt_ids, *, batch_size=64, limit=None, keep=None, progress=None, log=None,
                deadline=None):
        """Answer the shards covering the first ``limit`` prompts (all by default) that are not on disk yet,
        in order, each saved as soon as it is answered.  ``keep(i)`` says whether prompt ``i`` is answered (a
        skipped prompt is simply absent from its shard).  ``log(k, seconds, answer_tokens)`` hears of each new
        shard.  ``deadline`` (a ``time.monotonic()`` value): no shard is started that the last one's time says
        would end past it.  Returns the indices of the shards written."""
        m = self.manifest
        if len(prompt_ids) != m["prompts"]:
            raise ValueError(f"AnswerStore.collect: argument 'prompt_ids' expected the {m['prompts']} prompts of "
                             f"{self.directory}, got {len(prompt_ids)}")
        gen = m["generation"]
        S = m["shard_size"]
        written, last = [], 0.0
        for k in range(self.n_shards(limit)):
            if os.path.exists(self.shard_path(k)):
                continue
            if deadline is not None and time.monotonic() + last > deadline:
                break
            which = [i for i in range(k * S, min((k + 1) * S, m["prompts"])) if keep is None or keep(i)]
            t0 = time.perf_counter()
            inner = None if progress is None else (lambda i, n, k=k: progress(k, i, n))
            ans = answer(target, [prompt_ids[i] for i in which], max_new_tokens=gen["max_new_tokens"],
                         eos_token_id=gen["eos_token_id"], batch_size=batch_size, progress=inner)
            seconds = last = time.perf_counter() - t0
            ntok = self._record(k, which, prompt_ids, ans, seconds, next(target.parameters()).device.type)
            written.append(k)
            if log is not None:
                log(k, seconds, ntok)
        return written

    def _record(self, k, which, prompt_ids, answers, seconds, device):
        """Shard ``k`` written with ``answers`` to prompts ``which`` of ``prompt_ids``, and entered in the
        manifest; returns its answer tokens."""
        seqs = [np.concatenate([np.asarray(prompt_ids[i]).reshape(-1), a]) for i, a in zip(which, answers)]
        starts = [int(np.asarray(prompt_ids[i]).size) for i in which]
        self._save(k, which, seqs, starts)
        ntok = int(sum(a.size for a in answers))
        self.manifest["shards"][f"{k:05d}"] = {"sha256": file_sha256(self.shard_path(k)), "sequences": len(which),
                                               "answer_tokens": ntok, "seconds": round(seconds, 1), "device": device}
        self._write_manifest()
        return ntok

    @staticmethod
    def collect_together(target, jobs, *, batch_size=64, group=None, deadline=None, last=0.0, log=None):
        """Answer the one-shard stores of ``jobs`` ([(store, prompt_ids, keep)], ``keep(i)`` as in ``collect``)
        together: a group of stores holding about ``group`` prompts (default 4 x ``batch_size``) goes to the
        target as one list, sorted by length and batched, so stores of a few prompts each (a conversation's late
        turns) share batches instead of each running at a batch of one or two.  Each store's shard is saved as
        its group ends; a group's seconds are shared among its stores by answer tokens; a store answered already
        is left as it is.  ``deadline``: no group is started that the last one's time (``last``: that of an
        earlier call, to begin with) says would end past it.  ``log(stores, seconds, answer_tokens)`` hears of
        each group.  Returns (the stores answered, the last group's seconds)."""
        group = group or 4 * batch_size
        for store, ids, _ in jobs:
            m = store.manifest
            if m["shard_size"] < m["prompts"]:
                raise ValueError(f"AnswerStore.collect_together: argument 'jobs' expected stores of one shard, "
                                 f"got {store.directory} with {m['prompts']} prompts in shards of {m['shard_size']}")
            if len(ids) != m["prompts"]:
                raise ValueError(f"AnswerStore.collect_together: argument 'jobs' expected the {m['prompts']} prompts "
                                 f"of {store.directory}, got {len(ids)}")
        jobs = [j for j in jobs if not os.path.exists(j[0].shard_path(0))]
        done, i = [], 0
        while i < len(jobs):
            if deadline is not None and time.monotonic() + last > deadline:
                break
            part, n = [], 0
            while i < len(jobs) and (not part or n < group):
                store, ids, keep = jobs[i]
                which = [j for j in range(len(ids)) if keep is None or keep(j)]
                part.append((store, ids, which))
                n += len(which)
                i += 1
            gen = part[0][0].manifest["generation"]
            if any(s.manifest["generation"] != gen for s, _, _ in part):
                raise ValueError("AnswerStore.collect_together: argument 'jobs' expected stores with the same "
                                 "generation settings, got several")
            t0 = time.perf_counter()
            ans = answer(target, [ids[j] for _, ids, which in part for j in which],
                         max_new_tokens=gen["max_new_tokens"], eos_token_id=gen["eos_token_id"],
                         batch_size=batch_size)
            last = time.perf_counter() - t0
            total = max(1, sum(a.size for a in ans))
            device = next(target.parameters()).device.type
            at = 0
            for store, ids, which in part:
                mine = ans[at: at + len(which)]
                at += len(which)
                store._record(0, which, ids, mine, last * sum(a.size for a in mine) / total, device)
                done.append(store)
            if log is not None:
                log([store for store, _, _ in part], last, int(sum(a.size for a in ans)))
        return done, last

    def _save(self, k, which, seqs, starts):
        dt = _token_dtype(self.manifest.get("vocab_size") or 2**31)
        lengths = np.array([s.size for s in seqs], np.int64)
        tokens = np.concatenate(seqs).astype(dt) if seqs else np.zeros(0, dt)
        tmp = self.shard_path(k)[:-4] + ".tmp.npz"
        np.savez_compressed(tmp, tokens=tokens, offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                            starts=np.array(starts, np.int32), prompt_index=np.array(which, np.int32))
        os.replace(tmp, self.shard_path(k))

    def load_shard(self, k):
        """[(prompt_index, ids int64 tensor [S], start)] of shard ``k``, checked against the manifest's sha256."""
        path = self.shard_path(k)
        want = self.manifest.get("shards", {}).get(f"{k:05d}", {}).get("sha256")
        if want is not None and file_sha256(path) != want:
            raise ValueError(f"AnswerStore: {path} does not match the sha256 in {MANIFEST} (a changed or "
                             f"truncated file); delete it to answer that shard again")
        with np.load(path) as z:
            tokens, offsets, starts, index = z["tokens"], z["offsets"], z["starts"], z["prompt_index"]
        return [(int(index[j]), torch.from_numpy(tokens[offsets[j]: offsets[j + 1]].astype(np.int64)), int(starts[j]))
                for j in range(starts.size)]

    def answer_tokens(self):
        return sum(s["answer_tokens"] for s in self.manifest.get("shards", {}).values())
