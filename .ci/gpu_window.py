#!/usr/bin/env python3
"""The GPU window plan: which of .ci/gpu's phases a lent window runs, from a ledger of what passed on which code.

GPU time comes in rare windows of about 15 minutes (machine start, carried files and idle waits included).
``benchmarks/results/gpu-ledger.json`` (committed) records, per phase, the result of its last run on a GPU
and the digest of the code it depended on then:

    {"phases": {NAME: {"kind": "correctness" | "speed", "commit", "digest", "state", "passed", "failed",
                       "device", "date", "minutes", "expected_minutes", "numbers": {...}}},
     "windows": [{"date", "device", "commit", "phases": [...]}]}

``passed`` / ``failed`` count tests (pytest phases) or steps (the others); ``state`` is the phase's own
(pass, fail, timeout, skip, interrupted); ``minutes`` is what the run took, ``expected_minutes`` what the
plan expected.  A phase is *done* when its entry passed on the digest the current code gives it; the plan
takes the phases that are not done, correctness first (in PRIORITY order), then speed, and keeps what fits:

* the correctness phases run side by side on the one GPU (each pytest spread over the machine's cores with
  pytest-xdist), so together they cost about the longest of them, plus CONTENTION of the rest; those that need
  the default pair (its wheels come in the later bundles) start in the group once the bundles are in
  (PAIR_WAIT_S at most; the fifth window carried its four in 20 s, while `build` ran);
* the speed phases run alone, one after another, each only if it still fits what is left of the window.

A phase's expected minutes are its last measured minutes in the ledger when it ran to an end, else the
table's estimate (from the two windows of 2026-11-26 where a phase ran then).

The digest of a phase covers the code every phase depends on (``setup.py``, ``pyproject.toml``, ``csrc/``, the
package's data files, this runner's phase definition; the C sources of the CPU-only extension ``heterospec._gemm``,
``csrc/gemm/``, count for ``build`` alone: no GPU phase runs them on CUDA tensors, CPU CI tests every change of
them, and ``build`` compiles and imports them), the files its own commands name (test files or folders
with the tests' helpers, benchmark modules, data files) and the package's modules those reach by import
(:func:`reached`): the same bytes give the same digest in a checkout, in the device tool's copy of the working
tree (no ``.git`` needed) and at a commit (``git show``).

A library of ``.ci/gpu_phases.py`` (which holds the phases), with no command of its own:

    bash .ci/gpu --record RESULTS                # a window's results into the ledger
    bash .ci/gpu --window MINUTES [--dry-run]    # the plan (and its run)
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LEDGER = os.path.join(REPO, "benchmarks", "results", "gpu-ledger.json")
WINDOW_FILE = "WINDOW.json"     # in a window's raw folder: its date, device, commit and start
WINDOWS_DIR = "gpu-windows"   # beside the ledger: the small raw files of each window, one folder a window

KINDS = ("correctness", "speed")
# most important first, within each kind
PRIORITY = ("build", "kernels", "engine", "engine-chi2-oracle", "engine-chi2-noisy", "graphs", "sanitizer",
            "calibrate", "smoke", "head",
            "kernels-bench", "bench-bf16", "bench", "profile-gpu", "bench-batch", "bench-eager", "graphs-bench",
            "bench-tuned", "scale")
START_MINUTES = 2.0      # machine start, the first call's transfer, the bundle calls: off the top of a window
# side by side on one GPU, each further correctness phase adds this share of its minutes.  The ledger's minutes
# were measured side by side, so they hold the contention already: in the fourth window (H100) six phases ran
# together and the group ended with its longest (engine, 8.9 min); the other five's 19.3 minutes added nothing.
CONTENTION = 0.1
# the head recipe runs HEAD_SECONDS (500 by default: the table's 9 minutes); its minutes in the plan follow a
# HEAD_SECONDS given to the window, plus this for loading the pair and packing past --seconds, so a shorter
# head leaves a speed phase room in the same window
HEAD_OVERHEAD_MINUTES = 0.67
# how long a correctness phase of the side-by-side group that needs the default pair waits for its bundles (they
# come in the calls after the first; the fifth window's four took 20 s) before it is skipped
PAIR_WAIT_S = 240
SETUP_PHASES = ("build",)  # run first whenever a CUDA phase runs (a fresh machine has no build)

COMMON_DEPS = ("setup.py", "pyproject.toml", "csrc/")   # and heterospec/: its data always, its modules as reached
CPU_ONLY_SOURCES = ("csrc/gemm/",)   # heterospec._gemm's C sources: in the digest of SETUP_PHASES only
PKG = "heterospec"
SKIP_SUFFIXES = (".so", ".pyc", ".pyo", ".o", ".pyd")
SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".hypothesis"}
TEST_HELPERS = ("tests/conftest.py", "tests/_doubles.py", "tests/_oracles.py", "tests/_dlpack.py", "tests/_models.py",
                "tests/_pairs.py")
# how a command runs the command line (heterospec/__main__.py); a benchmark module is found by its `-m benchmarks.`
RUNS_CLI = re.compile(r"-m heterospec\b|\bheterospec (demo|bench|generate|calibrate|train-draft|info)\b")


class LedgerError(ValueError):
    pass


# ---- digests ------------------------------------------------------------------------------------------------

def phase_deps(phase, tree=None):
    """The paths (files, or folders ending in /) a phase's result depends on.  The package's modules count as far
    as the phase reaches them by import (with the tree: :func:`reached`), from the test files and helpers its
    commands name, the benchmark modules they run and the command line when they run it; its other files (the
    shipped head, profiles, data) always count.  Without the tree, or where a file does not parse, the whole
    package counts."""
    deps = list(COMMON_DEPS)
    text = " ".join(s.cmd for s in phase.steps)
    named = re.findall(r"\b(tests/[\w/.-]*\w)", text)   # test files, or folders of them (tests/ops)
    starts = [f for f in named if f.endswith(".py")]
    folders = [f + "/" for f in named if not f.endswith(".py")]
    deps += folders
    if tree is not None:
        starts += [f for f in tree.files() if f.endswith(".py") and any(f.startswith(d) for d in folders)]
    starts += [f"benchmarks/{m.replace('.', '/')}.py" for m in re.findall(r"-m benchmarks\.([\w.]+)", text)]
    if "pytest" in text:
        starts += list(TEST_HELPERS)
    if RUNS_CLI.search(text):
        starts.append(f"{PKG}/__main__.py")
    deps += re.findall(r"\b(benchmarks/data/[\w/.-]+)", text)
    files = reached(starts, tree) if tree is not None else None
    if files is None:
        return sorted(set(deps + starts + [f"{PKG}/"]))
    data = [f for f in tree.files() if f.startswith(f"{PKG}/") and not f.endswith(".py")]
    return sorted(set(deps + starts + files + data))


def _imports(text, path):
    """The modules a Python file imports anywhere in it (functions included), as dotted names, relative ones
    resolved against ``path``; with ``from M import a`` both M and M.a (a may be a module), and ``heterospec.X``
    for an attribute X of the package bound by ``import heterospec``.  None if it does not parse."""
    import ast

    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    pkg = path[:-len(".py")].split("/")[:-1]   # a module's package; a package's __init__ is its own
    out = set()
    bound = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
             if a.name == PKG}   # `import heterospec [as hs]`: hs.X is an import of heterospec.X
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            out.add(f"{PKG}.{node.attr}")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else [])) if node.level \
                else node.module or ""
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _lazy_names(tree):
    """heterospec/__init__.py's lazy names ({name: submodule}): ``from heterospec import X`` or ``heterospec.X``
    imports the submodule only when X is used (its ``_LAZY`` and ``_SUBMODULES``)."""
    import ast

    path = f"{PKG}/__init__.py"
    if path not in set(tree.files()):
        return {}
    names = {}
    for node in ast.walk(ast.parse(tree.read(path))):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = ast.literal_eval(node.value) if node.targets[0].id in ("_LAZY", "_SUBMODULES") else None
            if isinstance(value, dict):
                names.update({k: v[0] for k, v in value.items()})
            elif isinstance(value, tuple):
                names.update({k: k for k in value})
    return names


def reached(starts, tree):
    """The files of the package, the benchmarks and the tests' helper modules that ``starts`` (files of the tree)
    reach by import, transitively; importing a.b.c runs a/__init__.py and a/b/__init__.py too.  One of
    heterospec/__init__.py's lazy names imported from the package (or read as an attribute of it) counts as an
    import of its submodule.  None when a file on the way does not parse (then the caller counts the whole
    package)."""
    have = set(tree.files())
    lazy = _lazy_names(tree)
    seen, todo = set(), [f for f in starts if f in have]

    def files_of(name):
        parts = name.split(".")
        if parts[0] not in (PKG, "benchmarks") and not (len(parts) == 1 and f"tests/{name}.py" in have):
            return []
        if parts[0] not in (PKG, "benchmarks"):
            return [f"tests/{name}.py"]   # a helper of the tests (tests/ is on their path)
        out = []
        for i in range(1, len(parts) + 1):
            stem = "/".join(parts[:i])
            out += [f for f in (f"{stem}.py", f"{stem}/__init__.py") if f in have]
        return out

    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        if not f.endswith(".py"):
            continue
        text = tree.read(f).decode("utf-8", "replace")
        names = _imports(text, f)
        if names is None:
            return None
        names |= {f"{PKG}.{lazy[n.split('.')[1]]}" for n in names if n.count(".") == 1
                  and n.startswith(PKG + ".") and n.split(".")[1] in lazy}
        for n in names:
            todo += [g for g in files_of(n) if g not in seen]
    return sorted(seen)


def _skipped(path):
    parts = path.split("/")
    return path.endswith(SKIP_SUFFIXES) or any(p in SKIP_PARTS or p.endswith(".egg-info") for p in parts)


class Tree:
    """Files of a working tree (``root``) or of a commit (``commit``, read with git in ``root``)."""

    def __init__(self, root=REPO, commit=None):
        self.root, self.commit = root, commit
        self._files = None
        self._bytes = {}   # a tree is read for one plan or record: its files do not change meanwhile

    def files(self):
        if self._files is None:
            if self.commit:
                out = subprocess.run(["git", "ls-tree", "-r", "--name-only", self.commit], cwd=self.root,
                                     capture_output=True, text=True, check=True).stdout
                files = out.splitlines()
            else:
                files = []
                for d in COMMON_DEPS + (PKG, "tests", "benchmarks"):
                    p = os.path.join(self.root, d)
                    if os.path.isfile(p):
                        files.append(d)
                    for base, dirs, names in os.walk(p):
                        dirs[:] = sorted(x for x in dirs if x not in SKIP_PARTS)
                        rel = os.path.relpath(base, self.root).replace(os.sep, "/")
                        files += [f"{rel}/{n}" for n in names]
            self._files = sorted(f for f in set(files) if not _skipped(f))
        return self._files

    def read(self, path):
        if path not in self._bytes:
            if self.commit:
                self._bytes[path] = subprocess.run(["git", "show", f"{self.commit}:{path}"], cwd=self.root,
                                                   capture_output=True, check=True).stdout
            else:
                with open(os.path.join(self.root, path), "rb") as f:
                    self._bytes[path] = f.read()
        return self._bytes[path]

    def matching(self, deps):
        """The files some dep names ("PATH", or "FOLDER/" for every file under it)."""
        return [f for f in self.files() if any(f == d or (d.endswith("/") and f.startswith(d)) for d in deps)]


def phase_definition(phase):
    """A short hash of how the phase runs (its steps, needs and workers): measured minutes carry over to the
    plan only while it stays the same."""
    text = json.dumps([phase.name, [[s.name, s.cmd, s.ok] for s in phase.steps], list(phase.needs), phase.workers])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def phase_files(phase, tree):
    """The files of ``tree`` a phase's digest covers: :func:`phase_deps`' matches, less the CPU-only extension's C
    sources (:data:`CPU_ONLY_SOURCES`) for every phase but the setup phases."""
    files = tree.matching(phase_deps(phase, tree))
    if phase.name in SETUP_PHASES:
        return files
    return [f for f in files if not f.startswith(CPU_ONLY_SOURCES)]


def phase_digest(phase, tree):
    """sha256 of the phase's definition and of every file it depends on (path and bytes: :func:`phase_files`)."""
    h = hashlib.sha256()
    h.update(phase_definition(phase).encode())
    for path in phase_files(phase, tree):
        h.update(path.encode() + b"\0" + hashlib.sha256(tree.read(path)).digest())
    return h.hexdigest()[:16]


# ---- the ledger -----------------------------------------------------------------------------------------------

def load_ledger(path=LEDGER):
    if not os.path.exists(path):
        return {"phases": {}, "windows": []}
    try:
        with open(path) as f:
            led = json.load(f)
    except ValueError as e:
        raise LedgerError(f"{path}: not JSON ({e})") from None
    if not isinstance(led, dict) or not isinstance(led.get("phases"), dict):
        raise LedgerError(f"{path}: expected {{\"phases\": {{NAME: entry}}}}, got {type(led).__name__}")
    led.setdefault("windows", [])
    return led


def save_ledger(led, path=LEDGER):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(led, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def redigest(table, ledger_path=LEDGER, out=sys.stdout):
    """Recompute every ledger entry's digest at its commit (after a change of what a digest covers:
    :func:`phase_deps`), so a phase that passed stays done where the code it depends on did not change.  Entries
    without a commit of this repository (unknown, or uncommitted code) keep theirs.  Returns the names changed."""
    led = load_ledger(ledger_path)
    trees, changed = {}, []
    for name, entry in sorted(led["phases"].items()):
        commit = entry.get("commit") or ""
        if name not in table or not re.fullmatch(r"[0-9a-f]{7,40}", commit) or _git("cat-file", "-e", commit) is None:
            continue
        tree = trees.setdefault(commit, Tree(REPO, commit))
        digest = phase_digest(table[name], tree)
        if digest != entry.get("digest"):
            print(f"redigest: {name}: {entry.get('digest')} -> {digest} (commit {commit})", file=out)
            entry["digest"] = digest
            changed.append(name)
    if changed:
        save_ledger(led, ledger_path)
    return changed


def is_done(entry, digest):
    return bool(entry) and entry.get("state") == "pass" and entry.get("digest") == digest


def expected_minutes(phase, entry):
    """The last measured minutes when the phase, run as it is defined now, passed; the table's estimate
    otherwise, and at least the minutes it took when it failed or was cut (a failure can end early: the third
    window's `kernels` stopped at collection after 13 s, which says nothing of a full run)."""
    if not entry or entry.get("definition") != phase_definition(phase) or entry.get("minutes") is None:
        return float(phase.minutes)
    if entry.get("state") == "pass":
        return float(entry["minutes"])
    return max(float(entry["minutes"]), float(phase.minutes))


_PAST = {"pass": "passed", "fail": "failed", "timeout": "was cut at its limit", "skip": "was skipped",
         "interrupted": "was interrupted"}


def _order(name):
    return PRIORITY.index(name) if name in PRIORITY else len(PRIORITY)


def head_minutes(env):
    """The head phase's expected minutes from HEAD_SECONDS in ``env`` (None when it is not set)."""
    raw = env.get("HEAD_SECONDS")
    if raw in (None, ""):
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 60 <= seconds <= 540:
        raise LedgerError(f"HEAD_SECONDS: expected seconds from 60 to 540 (one call of at most 9 minutes), got {raw!r}")
    return round(seconds / 60 + HEAD_OVERHEAD_MINUTES, 2)


def plan(table, ledger, window_minutes, digests, env=None):
    """The window's plan: {"run": [names in order], "group": correctness names run side by side,
    "serial": the rest in order, "left": [(name, why)], "minutes": expected wall minutes,
    "why": {name: why it runs}, "expected": {name: minutes}}."""
    budget = window_minutes - START_MINUTES
    entries = ledger["phases"]
    pending, why = [], {}
    for name in sorted((n for n, p in table.items() if p.window), key=_order):
        e = entries.get(name)
        if is_done(e, digests[name]) and not table[name].beside:
            continue
        when = f"{_PAST.get(e.get('state'), e.get('state'))} on {(e.get('date') or '?')[:10]}" if e else ""
        why[name] = ("never run on a GPU" if not e else
                     f"code changed since it {when}" if e.get("digest") != digests[name] else f"it {when} on this code")
        if table[name].beside:
            why[name] = f"every window, beside the correctness group ({why[name]})"
        pending.append(name)
    # correctness first; then the speed phases that have never passed on a GPU (no numbers at all yet) before
    # those that passed on older code (numbers to refresh): the sixth window re-ran bench-bf16 while profile-gpu,
    # graphs-bench, bench-batch, bench-tuned and scale had never run.  PRIORITY order within each.
    # A phase run beside the correctness group (the head recipe) comes right after it.
    def rank(n):
        if table[n].kind == "correctness":
            return 0
        if table[n].beside:
            return 1
        return 3 if (entries.get(n) or {}).get("state") == "pass" else 2

    pending.sort(key=rank)
    exp = {n: expected_minutes(table[n], entries.get(n)) for n in table}
    head = head_minutes(os.environ if env is None else env)
    if head is not None and "head" in exp:
        exp["head"] = head
    cuda = any("cuda" in table[n].needs for n in pending)
    setup = [n for n in SETUP_PHASES if n in table and (n in pending or cuda)]
    for n in setup:
        why.setdefault(n, "a fresh machine has no CUDA build")
    used = sum(exp[n] for n in setup)
    group, serial_corr, speed, left = [], [], [], []

    def group_wall(names):
        if not names:
            return 0.0
        ms = sorted((exp[n] for n in names), reverse=True)
        return ms[0] + CONTENTION * sum(ms[1:])

    for n in pending:
        if n in setup:
            continue
        p = table[n]
        if (p.kind == "correctness" and "questions" not in p.needs) or p.beside:
            cost = group_wall(group + [n]) - group_wall(group)
            target = group
        else:
            cost = exp[n]
            target = serial_corr if p.kind == "correctness" else speed
        if used + cost <= budget:
            target.append(n)
            used += cost
        else:
            left.append((n, f"{exp[n]:g} min expected, {max(budget - used, 0):.1f} left"))
    serial = serial_corr + speed
    return {"run": setup + group + serial, "setup": setup, "group": group, "serial": serial, "left": left,
            "minutes": round(used + START_MINUTES, 2), "window": window_minutes, "why": why, "expected": exp}


def plan_text(table, p, ledger_path=LEDGER):
    lines = [f"GPU window plan: {p['window']:g} minutes ({START_MINUTES:g} for the machine's start and the "
             f"carried bundles), ledger {os.path.relpath(ledger_path, REPO)}", "",
             "| order | phase | kind | how | expected min | why |", "|---:|---|---|---|---:|---|"]
    i = 0
    for how, names in (("first", p["setup"]), ("side by side", p["group"]), ("alone", p["serial"])):
        for n in names:
            i += 1
            h = how + (", once the pair's bundles are in" if how == "side by side" and "pair" in table[n].needs else "")
            lines.append(f"| {i} | {n} | {table[n].kind} | {h} | {p['expected'][n]:g} | {p['why'].get(n, '')} |")
    lines += ["", f"Expected: about {p['minutes']:g} of {p['window']:g} minutes."]
    if p["left"]:
        lines += ["", "Left for a later window (not done on this code, does not fit):"]
        lines += [f"- {n} ({w})" for n, w in p["left"]]
    if not p["run"]:
        lines += ["", "Every phase has passed on this code: nothing to run."]
    return "\n".join(lines)


# ---- recording a window's results -------------------------------------------------------------------------

def _results_dir(path, tmp):
    """A folder holding phase folders (each with status.json) from RESULTS: a work folder, a folder with
    gpu-results.tar.gz (the device tool's files_at), or the tarball itself."""
    tar = None
    if os.path.isfile(path) and tarfile.is_tarfile(path):
        tar = path
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "gpu-results.tar.gz")):
        tar = os.path.join(path, "gpu-results.tar.gz")
    if tar:
        with tarfile.open(tar) as t:
            members = [m for m in t.getmembers() if m.isfile() and not m.name.startswith(("/", ".."))
                       and ".." not in m.name.split("/")]
            t.extractall(tmp, members=members)
        return tmp
    if os.path.isdir(path):
        return path
    raise LedgerError(f"RESULTS: expected a results folder, a folder with gpu-results.tar.gz or the tarball, "
                      f"got {path!r}")


def _git(*args):
    r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def _raw_folder(root, base, window):
    """The folder for one window's raw files: BASE (date-device), or BASE-2, BASE-3... when an earlier window of
    the same day and device holds it.  A folder is this window's when its WINDOW.json names the same start;
    one without WINDOW.json (kept before it was written) is another window's."""
    for k in range(1, 100):
        dest = os.path.join(root, base if k == 1 else f"{base}-{k}")
        mark = os.path.join(dest, WINDOW_FILE)
        if not os.path.exists(dest):
            break
        if os.path.isfile(mark):
            with open(mark) as f:
                if json.load(f).get("started") == window["started"]:
                    break
    else:
        raise LedgerError(f"RESULTS: 99 windows of {base} already kept under {root}")
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, WINDOW_FILE), "w") as f:
        json.dump({k: window[k] for k in ("date", "device", "commit", "started")}, f, indent=1)
        f.write("\n")
    return dest


def record(results, table, ledger_path=LEDGER, keep_raw=True, out=sys.stdout):
    """Turn a window's returned results into ledger entries (and keep the small raw files under
    benchmarks/results/gpu-windows/).  Returns the names recorded."""
    led = load_ledger(ledger_path)
    head = _git("rev-parse", "--short", "HEAD")
    here, at_head = Tree(REPO), Tree(REPO, head) if head else None
    with tempfile.TemporaryDirectory() as tmp:
        src = _results_dir(results, tmp)
        found = []
        for name in sorted(os.listdir(src)):
            st_path = os.path.join(src, name, "status.json")
            if not os.path.isfile(st_path):
                continue
            with open(st_path) as f:
                st = json.load(f)
            found.append((name, st))
        if not found:
            raise LedgerError(f"RESULTS: no phase folder with a status.json in {results!r}")
        recorded, device, date = [], None, None
        for name, st in found:
            if name not in table:
                print(f"record: {name}: not a phase of .ci/gpu, left out", file=out)
                continue
            digest = st.get("digest")
            commit = None
            if digest and at_head is not None and digest == phase_digest(table[name], at_head):
                commit = head
            elif digest and digest == phase_digest(table[name], here):
                commit = f"{head}+uncommitted"
            old = led["phases"].get(name)
            if st.get("state") == "skip" and old:
                print(f"record: {name}: skipped there ({st.get('reason', '')}); the entry of "
                      f"{old.get('date', '?')} stays", file=out)
                continue
            if st.get("state") not in _PAST:
                # still running (or waiting) when these results came back: if the window ends here, it never
                # ended; a later call's results of the same window replace this entry
                st = dict(st, state="interrupted", reason=f"{st.get('state') or 'not started'} when the results "
                                                          f"came back")
            entry = {"kind": table[name].kind, "commit": commit, "digest": digest, "state": st.get("state"),
                     "definition": st.get("definition"),
                     "passed": st.get("passed"), "failed": st.get("failed"), "device": st.get("device"),
                     "date": st.get("ended") or st.get("started"),
                     "minutes": round(st["seconds"] / 60, 2) if st.get("seconds") is not None else None,
                     "expected_minutes": st.get("expected_min"), "numbers": st.get("numbers") or {}}
            if st.get("reason"):
                entry["reason"] = st["reason"]
            led["phases"][name] = entry
            recorded.append(name)
            device = device or st.get("device")
            date = date or (entry["date"] or "")[:10]
            print(f"record: {name}: {entry['state']} ({entry['passed']} passed, {entry['failed']} failed, "
                  f"{entry['minutes']} min) on {entry['device']}, commit {commit or 'unknown (digest differs)'}",
                  file=out)
        if recorded:
            # the run's start (its first phase's) tells two windows of one day and device apart
            started = min((st.get("started") for n, st in found if n in recorded and st.get("started")), default=None)
            window = {"date": date, "device": device, "commit": head, "started": started, "phases": recorded}
            last = led["windows"][-1] if led["windows"] else None
            # the same window recorded again (its later calls return every phase so far) replaces its entry
            if last and {k: last.get(k) for k in ("date", "device", "commit")} == \
                    {k: window[k] for k in ("date", "device", "commit")} and set(last["phases"]) <= set(recorded) \
                    and last.get("started", started) == started:
                led["windows"][-1] = window
            else:
                led["windows"].append(window)
            save_ledger(led, ledger_path)
            if keep_raw:
                dest = _raw_folder(os.path.join(os.path.dirname(os.path.abspath(ledger_path)), WINDOWS_DIR),
                                   f"{date}-{re.sub(r'[^A-Za-z0-9]+', '-', device or 'gpu').strip('-')}".lower(),
                                   window)
                for name in recorded:
                    shutil.copytree(os.path.join(src, name), os.path.join(dest, name), dirs_exist_ok=True,
                                    ignore=lambda d, names: [n for n in names if os.path.isfile(os.path.join(d, n))
                                                             and os.path.getsize(os.path.join(d, n)) > 2**20])
                for fn in ("background.log", "monitor.log"):   # the run's own log and the machine's samples
                    if os.path.isfile(os.path.join(src, fn)) and os.path.getsize(os.path.join(src, fn)) <= 2**20:
                        shutil.copyfile(os.path.join(src, fn), os.path.join(dest, fn))
                print(f"record: raw results (files up to 1 MiB) in {dest}", file=out)
    return recorded
