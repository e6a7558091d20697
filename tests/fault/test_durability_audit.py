"""A POSIX-strict durability audit of every writer, from the system calls it makes (issue 13 item 7).

Each operation runs under ``strace -f`` (every thread, the C engine's included). Replaying the trace, a
file or directory someone created is *durable* once its data was synced (fsync/fdatasync of it, or a
syncfs) and its directory entry was synced (an fsync of the directory holding it after the entry was made,
or a syncfs). The rules checked: at every commit point (a commit record renamed into place; a commit
record unlinked by compaction) everything created before it is durable; when the operation returns,
everything it created is; and no file of a step is deleted (retention, compaction) before the removal
of its commit record is durable. Before, the first ``commits/`` directory, a new repository's own directory and
compaction's staging directories were never made durable: a power cut after ``save`` returned could lose
the step it had reported committed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

STRACE = shutil.which("strace")
pytestmark = pytest.mark.skipif(STRACE is None, reason="strace is not installed on this machine")

CALLS = "mkdir,mkdirat,openat,open,creat,rename,renameat,renameat2,unlink,unlinkat,rmdir,fsync,fdatasync,syncfs"
_LINE = re.compile(r"^(?P<pid>\d+)\s+(?P<call>\w+)\((?P<args>.*)\)\s+=\s+(?P<rc>-?\d+)")
_STR = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD = re.compile(r"^(\d+)<(.*?)>")


@dataclass
class Node:
    synced_data: bool
    synced_entry: bool
    is_dir: bool


@dataclass
class Audit:
    root: str
    nodes: dict[str, Node] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    unlinked_records: set[str] = field(default_factory=set)  # steps whose record removal is not durable yet

    def inside(self, p: str) -> bool:
        return p == self.root or p.startswith(self.root + "/")

    def create(self, p: str, is_dir: bool) -> None:
        if self.inside(p):
            self.nodes[p] = Node(synced_data=False, synced_entry=False, is_dir=is_dir)

    def remove(self, p: str) -> None:
        for k in [k for k in self.nodes if k == p or k.startswith(p + "/")]:
            del self.nodes[k]

    def unlink(self, p: str) -> None:
        rel = os.path.relpath(p, self.root).split("/")
        if len(rel) == 2 and rel[0] == "commits" and rel[1].endswith(".json"):
            self.unlinked_records.add(rel[1][:-5])
        elif len(rel) >= 3 and rel[0] == "steps" and rel[1] in self.unlinked_records:
            self.problems.append(f"{'/'.join(rel)} deleted before the removal of commits/{rel[1]}.json was durable "
                                 "(a power cut could bring the record back without its files)")
            self.unlinked_records.discard(rel[1])  # once per step
        self.remove(p)

    def fsync(self, p: str) -> None:
        if p == os.path.join(self.root, "commits"):
            self.unlinked_records.clear()
        n = self.nodes.get(p)
        if n is not None:
            n.synced_data = True
        for k, child in self.nodes.items():  # entries made in p before now
            if os.path.dirname(k) == p:
                child.synced_entry = True

    def syncfs(self) -> None:
        self.unlinked_records.clear()
        for n in self.nodes.values():
            n.synced_data = n.synced_entry = True

    def volatile(self, exclude: str = "") -> list[str]:
        out = []
        for k, n in sorted(self.nodes.items()):
            if k == exclude or k.endswith(".ucl-writer.lock") or ".tmp-" in os.path.basename(k):
                continue
            what = [w for w, ok in (("entry", n.synced_entry), ("data", n.synced_data or n.is_dir)) if not ok]
            if what:
                out.append(f"{os.path.relpath(k, os.path.dirname(self.root))} ({' and '.join(what)} not synced)")
        return out

    def commit_point(self, what: str, target: str) -> None:
        vol = self.volatile(exclude=target)
        if vol:
            self.problems.append(f"at {what}: " + ", ".join(vol))


_ARG_FD = re.compile(r'(?:^|, )(?:\d+|AT_FDCWD)<([^>]*)>, "((?:[^"\\]|\\.)*)"')


def _resolved(args: str) -> list[str]:
    """The path arguments of a call, each joined to its directory fd (``unlinkat(5</a/b>, "c")``: a/b/c)."""
    out = [d if n == "" else n if n.startswith("/") else os.path.join(d, n) for d, n in _ARG_FD.findall(args)]
    return out or _STR.findall(args)


def audit(trace: str, root: str, commit_points: re.Pattern[str]) -> list[str]:
    a = Audit(root)  # the repository's own directory counts when the operation creates it
    for line in trace.splitlines():
        m = _LINE.match(line)
        if not m or int(m["rc"]) < 0:
            continue
        call, args = m["call"], m["args"]
        paths = _resolved(args)
        fd = _FD.match(args)
        if call in ("mkdir", "mkdirat") and paths:
            a.create(paths[-1], is_dir=True)
        elif call in ("openat", "open", "creat") and paths and ("O_CREAT" in args or call == "creat"):
            p = paths[-1]
            if a.inside(p) and p not in a.nodes:
                a.create(p, is_dir=False)
        elif call.startswith("rename") and len(paths) >= 2:
            src, dst = paths[-2], paths[-1]
            node = a.nodes.pop(src, None)
            a.remove(dst)
            if a.inside(dst):
                a.nodes[dst] = Node(synced_data=node.synced_data if node else True, synced_entry=False,
                                    is_dir=node.is_dir if node else False)
            if commit_points.search(dst):
                a.commit_point(f"rename to {os.path.relpath(dst, root)}", dst)
        elif call in ("unlink", "unlinkat", "rmdir") and paths:
            p = paths[-1]
            if commit_points.search(p):
                a.commit_point(f"unlink of {os.path.relpath(p, root)}", p)
            a.unlink(p)
        elif call in ("fsync", "fdatasync") and fd:
            a.fsync(fd.group(2))
        elif call == "syncfs":
            a.syncfs()
    end = a.volatile()
    if end:
        a.problems.append("when the operation returned: " + ", ".join(end))
    return a.problems


def traced(tmp: Path, code: str) -> str:
    out = tmp / "trace"
    r = subprocess.run([STRACE, "-f", "-y", "-qq", "-e", f"trace={CALLS}", "-o", str(out), sys.executable, "-c",
                        textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out.read_text()


COMMITS = re.compile(r"/commits/\d+\.json$")


def test_save_into_a_new_repository_is_durable_when_it_returns(tmp_path: Path) -> None:
    repo = str(tmp_path / "new" / "ckpt")
    os.makedirs(os.path.dirname(repo))
    trace = traced(tmp_path, f"""
        import torch, ucl
        ucl.save({{"model": {{"layers": {{"0": {{"w": torch.ones(64, 32)}}}}}}, "b": torch.zeros(50257)}},
                 {repo!r}, step=1)
    """)
    assert audit(trace, repo, COMMITS) == []


def test_manager_saves_full_and_delta_steps_durably(tmp_path: Path) -> None:
    repo = str(tmp_path / "ckpt")
    trace = traced(tmp_path, f"""
        import torch, ucl
        g = torch.Generator().manual_seed(0)
        s = {{"w": torch.randn(256, 128, generator=g), "emb": torch.randn(32001, 8, generator=g)}}
        with ucl.CheckpointManager({repo!r}, delta=ucl.DeltaPolicy(full_every=4), keep_last=2) as mgr:
            for step in range(4):
                s["w"][step] += 1.0
                mgr.save(step, s).result()
    """)
    assert audit(trace, repo, COMMITS) == []


def test_compaction_is_durable_at_every_commit_point(tmp_path: Path) -> None:
    repo = str(tmp_path / "ckpt")
    subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import torch, ucl
        s = {{"w": torch.ones(256, 128), "nested": {{"e": torch.zeros(1000, 3)}}}}
        with ucl.CheckpointManager({repo!r}, delta=ucl.DeltaPolicy(full_every=4)) as mgr:
            mgr.save(0, s).result()
            s["w"][0] = 2.0
            mgr.save(1, s).result()
    """)], check=True, timeout=300)
    trace = traced(tmp_path, f"""
        from ucl.tools.compact import compact
        assert compact({repo!r}, 1).changed
    """)
    # the journal is a commit point too: the staging must be durable before it, it before step 3
    assert audit(trace, repo, re.compile(r"/commits/\d+\.json$|/compact/\d+\.json$")) == []
