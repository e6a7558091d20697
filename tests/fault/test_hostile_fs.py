"""A repository on a hostile filesystem: something that is not what the format says where a document, a
shard or a directory should be (spec/core.md §3, item 2, §8.4).

Every (kind x position x operation) case must end within TIMEOUT seconds, with a UCLError (the
validator: a problem in its report) of the right code where the operation needs what is at that
position, never change a file outside the repository, and hold memory bounded. A writer that succeeds
must have written a step every reader accepts.

Kinds: a FIFO (an open would block forever), a character device like /dev/zero (a read never ends), a
directory, a symlink to a file or a directory outside the root (a copy of what belongs there: followed,
it would read fine and write outside), a symlink loop. Device cases run in one subprocess with an
address-space limit, where their peak RSS growth is measured.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from tests.fs import snapshot
from ucl.errors import UCLError

TIMEOUT = 10.0
STEP = 1  # the step the hostile object belongs to; step 0 stays healthy
NEW = 5  # the step writers write
FILES = {
    "repo_doc": "zarr.json",
    "steps_doc": "steps/zarr.json",
    "commit": f"commits/{STEP}.json",
    "step_doc": f"steps/{STEP}/zarr.json",
    "array_doc": f"steps/{STEP}/model/w/zarr.json",
    "shard": f"steps/{STEP}/model/w/c/0/0",
}
DIRS = {
    "steps_dir": "steps",
    "commits_dir": "commits",
    "step_dir": f"steps/{STEP}",
    "array_dir": f"steps/{STEP}/model/w",
    "compact_dir": "compact",
}
POSITIONS = {**FILES, **DIRS}
KINDS = ["fifo", "chardev", "directory", "link_file", "link_dir", "link_loop"]
OPS = ["open_read", "load", "validate", "ls", "save", "manager", "gc"]

# the positions each operation needs: there it must fail (elsewhere it may succeed)
NEEDS = {
    "open_read": {"repo_doc", "commit", "step_doc", "shard", "steps_dir", "commits_dir", "step_dir",
                  "array_dir"},
    "validate": set(POSITIONS) - {"compact_dir"},
    "ls": {"repo_doc"},
    "save": {"repo_doc", "steps_dir", "commits_dir"},
    "manager": {"repo_doc", "steps_dir", "commits_dir"},
    "gc": {"repo_doc"},
}
NEEDS["load"] = NEEDS["open_read"]
LINKS = {"link_file", "link_dir", "link_loop"}
# the directories gc walks: a symlink there that resolves outside is refused (invalid_name)
GC_OWNED = {"steps_dir", "commits_dir", "compact_dir"}


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(64, 8, generator=g)}, "b": torch.randn(8, generator=g)}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "repo"
    make_pristine(root)
    return root


def make_pristine(root: Path) -> None:
    for s in (0, STEP):
        ucl.save(state(), root, s)


def case_name(kind: str, position: str) -> str:
    return f"{kind}-{position}"


def applicable(kind: str, position: str) -> bool:
    return not (kind == "directory" and position in DIRS)  # a directory where one belongs is no fault


def expected_code(kind: str, position: str) -> str | None:
    """The code of the failure (None: any UCLError; the position is a directory that is not one)."""
    if kind in LINKS:
        return "invalid_name"
    return "not_a_file" if position in FILES else None


# -- building a case -------------------------------------------------------------------------------
def plant(base: Path, pristine: Path, kind: str, position: str) -> tuple[Path, Path]:
    """A copy of ``pristine`` at base/repo with ``kind`` at ``position``, and the outside directory
    base/outside whose contents nothing may change."""
    repo, outside = base / "repo", base / "outside"
    shutil.copytree(pristine, repo, symlinks=True)
    outside.mkdir()
    # what a writer or gc following a symlinked directory would delete or overwrite
    (outside / "afile").write_text("a file outside")
    (outside / "adir").mkdir()
    (outside / "adir" / "sentinel").write_text("a directory outside")
    rel = POSITIONS[position]
    p = repo / rel
    copy = outside / "copy"
    if p.is_dir():
        shutil.copytree(p, copy, symlinks=True)
    elif p.exists():
        shutil.copy2(p, copy)
    if position == "steps_dir":  # a save of NEW deletes steps/NEW first; gc deletes uncommitted steps
        for d in (f"{NEW}", "7"):
            (copy / d).mkdir()
            (copy / d / "sentinel").write_text("outside")
    elif position == "commits_dir":
        (copy / "9.json.tmp-1").write_text("a leftover gc would delete")
    elif position in ("step_dir", "array_dir"):
        (copy / "junk").write_text("a file no commit record lists")
    elif position == "compact_dir":
        copy.mkdir()
        (copy / "9").mkdir()
        (copy / "9" / "junk").write_text("staging gc would delete")
    old = time.time() - 7200  # older than any grace
    for dirpath, dirnames, filenames in os.walk(outside):
        for n in dirnames + filenames:
            os.utime(Path(dirpath) / n, (old, old), follow_symlinks=False)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "chardev":
        os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    elif kind == "directory":
        p.mkdir()
    elif kind == "link_file":
        os.symlink(copy if copy.is_file() else outside / "afile", p)
    elif kind == "link_dir":
        os.symlink(copy if copy.is_dir() else outside / "adir", p)
    elif kind == "link_loop":
        os.symlink(p.name, p)
    return repo, outside


# -- the operations --------------------------------------------------------------------------------
def cli(*argv: str) -> tuple[int, Any]:
    from ucl.tools.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([*argv])
    return rc, json.loads(buf.getvalue())


def op_open_read(repo: Path) -> None:
    with ucl.open(repo, STEP) as ckpt:
        for name in ckpt.keys():  # noqa: SIM118 - a Checkpoint's names
            ckpt[name][:]


def op_load(repo: Path) -> None:
    ucl.load(repo, STEP, flat=True)


def op_validate(repo: Path) -> Any:
    return ucl.validate(repo)


def op_ls(repo: Path) -> Any:
    return cli("ls", "--json", str(repo))


def op_save(repo: Path) -> None:
    ucl.save(state(), repo, NEW)


def op_manager(repo: Path) -> None:
    mgr = ucl.CheckpointManager(repo, keep_last=1)  # retention deletes steps 0 and STEP
    try:
        mgr.save(NEW, state()).result()
        mgr.wait()
    finally:
        mgr.close()


def op_gc(repo: Path) -> Any:
    return cli("gc", "--json", "--grace", "0", str(repo))


OP_FNS = {"open_read": op_open_read, "load": op_load, "validate": op_validate, "ls": op_ls, "save": op_save,
          "manager": op_manager, "gc": op_gc}


def bounded(fn, arg, fifo: Path | None) -> tuple[str, Any]:
    """("ok", value), ("error", exception) or ("timeout", None): ``fn(arg)`` in a daemon thread."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["ok"] = fn(arg)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(TIMEOUT)
    if t.is_alive():
        if fifo is not None:  # release a reader blocked opening it, so the thread ends
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        return "timeout", None
    return ("error", out["error"]) if "error" in out else ("ok", out.get("ok"))


def run_case(base: Path, pristine: Path, kind: str, position: str, op: str) -> list[str]:
    """The case's violations (empty: it passed)."""
    repo, outside = plant(base, pristine, kind, position)
    before = snapshot(outside)
    fifo = repo / POSITIONS[position] if kind == "fifo" else None
    healthy = healthy_step(repo)
    status, value = bounded(OP_FNS[op], repo, fifo)
    bad = check(kind, position, op, status, value, repo)
    if op == "gc" and healthy_step(repo) != healthy:
        bad.append("gc changed the files of the healthy step 0")
    after = snapshot(outside)
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        bad.append(f"changed outside the repository: {changed}")
    return bad


def check(kind: str, position: str, op: str, status: str, value: Any, repo: Path) -> list[str]:
    want = expected_code(kind, position)
    needed = position in NEEDS[op] or (op == "gc" and kind in LINKS and position in GC_OWNED)
    if status == "timeout":
        return [f"did not end within {TIMEOUT} s"]
    if status == "error":
        if not isinstance(value, UCLError):
            return [f"raised {type(value).__name__}: {value} (not a UCLError)"]
        codes = [value.code]
    elif op == "validate":
        codes = [p.code for p in value.problems]
        if not codes:
            return ["validate reported no problem"] if needed else []
    elif op in ("ls", "gc"):
        rc, doc = value
        if rc != 0:
            codes = [doc.get("error", {}).get("code")]
        elif op == "ls" and position == "commit":  # the step is listed with its record's error
            codes = [r.get("error") for r in doc if r["step"] == STEP] or [None]
        else:
            codes = []
    else:
        codes = []
    if not codes:
        if needed:
            return [f"succeeded although it needs {POSITIONS[position]}"]
        return verify_written(op, repo)
    if want is not None and (needed or op in ("validate", "ls")) and want not in codes:
        return [f"failed with {codes}, expected {want}"]
    if any(c not in ucl.errors.ALL_CODES for c in codes):
        return [f"failed with {codes}: not UCL error codes"]
    return []


def healthy_step(repo: Path) -> dict[str, tuple]:
    """The files of step 0 (nothing hostile is planted in it): gc must never delete one."""
    out = {}
    for top in ("commits/0.json", "steps/0"):
        p = repo / top
        if p.is_dir() and not p.is_symlink():
            out.update({f"{top}/{k}": v for k, v in snapshot(p).items()})
        elif os.path.lexists(p):
            st = os.lstat(p)
            out[top] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return out


def verify_written(op: str, repo: Path) -> list[str]:
    """After a writer succeeded: every reader accepts what it wrote."""
    step = {"save": NEW, "manager": NEW}.get(op)
    if step is None:
        return []
    try:
        got = ucl.load(repo, step, flat=True)
    except UCLError as e:
        return [f"{op} succeeded, but step {step} is then refused: {e.code}: {e}"]
    want = state()
    if not torch.equal(got["model/w"], want["model"]["w"]) or not torch.equal(got["b"], want["b"]):
        return [f"{op} succeeded, but step {step} reads back wrong"]
    return []


def cases(kinds: list[str]) -> list[tuple[str, str, str]]:
    return [(k, p, o) for k in kinds for p in POSITIONS for o in OPS if applicable(k, p)]


# -- the tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "position", "op"), cases([k for k in KINDS if k != "chardev"]))
def test_hostile(tmp_path: Path, pristine: Path, kind: str, position: str, op: str) -> None:
    bad = run_case(tmp_path, pristine, kind, position, op)
    assert not bad, f"{kind} at {POSITIONS[position]}, {op}: " + "; ".join(bad)


@pytest.mark.parametrize("kind", ["fifo", "directory", "link_file", "link_loop"])
def test_latest_skips_a_hostile_commit_record(tmp_path: Path, pristine: Path, kind: str) -> None:
    """Readers looking for the latest step skip a commit record that is not a file, as a corrupt one."""
    repo, _ = plant(tmp_path, pristine, kind, "commit")
    fifo = repo / FILES["commit"] if kind == "fifo" else None
    status, value = bounded(lambda r: ucl.open(r).step, repo, fifo)
    assert (status, value) == ("ok", 0), (status, value)


_DEVICE_MAIN = """
import sys
from tests.fault.test_hostile_fs import device_main
device_main(sys.argv[1], sys.argv[2])
"""


def device_main(base: str, out: str) -> None:
    """Every device case in this process, after one warm-up run of each operation; results and the peak
    RSS growth to ``out``. An address-space limit turns a runaway read into a MemoryError."""
    base_p = Path(base)
    pristine = base_p / "pristine"
    make_pristine(pristine)
    for op in OPS:  # warm up: imports, pools, threads of every operation
        repo = base_p / f"warm-{op}" / "repo"
        shutil.copytree(pristine, repo, symlinks=True)
        bounded(OP_FNS[op], repo, None)
    with open("/proc/self/status") as f:
        vm = int(next(line for line in f if line.startswith("VmSize:")).split()[1]) << 10
    resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = {}
    for kind, position, op in cases(["chardev"]):
        d = base_p / f"{position}-{op}"
        d.mkdir()
        try:
            results[f"{position}/{op}"] = run_case(d, pristine, kind, position, op)
        except BaseException as e:  # noqa: BLE001 - reported per case
            results[f"{position}/{op}"] = [f"the case itself failed: {type(e).__name__}: {e}"]
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    Path(out).write_text(json.dumps({"results": results, "rss_growth_kib": growth}))


def test_hostile_devices(tmp_path: Path) -> None:
    """A /dev/zero-like node at every position, every operation, all in one subprocess (one test, so that
    it runs once however the tests are distributed): the cases' checks, and peak RSS growth bounded."""
    try:
        os.mknod(tmp_path / "probe", stat.S_IFCHR | 0o600, os.makedev(1, 5))
        os.unlink(tmp_path / "probe")
    except OSError as e:
        pytest.skip(f"cannot make a device node here ({e.strerror}): needs root")
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, "-c", _DEVICE_MAIN, str(tmp_path), str(out)], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and out.exists(), r.stderr[-4000:]
    got = json.loads(out.read_text())
    bad = {case: b for case, b in got["results"].items() if b}
    assert not bad, bad
    assert len(got["results"]) == len(cases(["chardev"]))
    assert got["rss_growth_kib"] < 512 << 10, f"peak RSS grew by {got['rss_growth_kib']} KiB"
