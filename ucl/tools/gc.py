"""Repository maintenance: ``gc`` deletes what no commit record references.

It takes the repository's writer lock (``<repo>/.ucl-writer.lock``, the one the engine holds while it
runs) on local filesystems, so they never race a training job's writer; on object stores the caller
must make sure no writer runs.

**gc** deletes, under ``steps/``, ``commits/`` and ``compact/`` only:

- the files of uncommitted steps (``steps/<N>/`` without ``commits/<N>.json``), unless a file there is
  younger than ``grace`` seconds (it may be a save in progress);
- files inside a committed step that its commit record does not list (committed files are never
  touched; a step whose record is unreadable is left alone entirely);
- leftovers: temporary files in ``commits/``, entries of ``steps/`` that are not step numbers, staging
  of a compaction that never reached its journal (all subject to ``grace``).

A compaction journal (``compact/<N>.json``) stops gc from touching anything of step N: run
``compact`` again to finish it.

gc never touches anything outside the repository (spec/core.md §3, item 2): on local filesystems a
directory it would list or walk that resolves through a symlink outside the root fails the whole run
with ``invalid_name`` before anything is deleted; a symlink it deletes is removed itself, never
followed.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ucl.errors import InvalidArgumentError, UCLError
from ucl.format.lock import WriterLock
from ucl.format.repository import Repository, commit_key, compaction_journal
from ucl.io.stores.base import FileInfo
from ucl.io.stores.local import LocalStore

__all__ = ["GCReport", "gc"]

DEFAULT_GRACE_S = 3600.0
_STEP = re.compile(r"^(0|[1-9][0-9]{0,18})$")
_RECORD = re.compile(r"^(0|[1-9][0-9]{0,18})\.json$")
_OWNED = ("steps", "commits", "compact")


# -- gc --------------------------------------------------------------------------------------------
@dataclass
class GCReport:
    """What :func:`gc` deleted (or would delete, with ``dry_run``) and what it left, and why."""

    path: str
    dry_run: bool
    deleted: list[str] = field(default_factory=list)  # file keys
    bytes: int = 0
    kept: list[dict[str, str]] = field(default_factory=list)  # {"key", "reason"}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gc(path: Any, *, dry_run: bool = False, grace: float = DEFAULT_GRACE_S,
       storage_options: dict[str, Any] | None = None, now: float | None = None) -> GCReport:
    """Delete the files of uncommitted steps and the files no commit record references.

    Parameters
    ----------
    path
        Repository directory or fsspec URL.
    dry_run
        Report what would be deleted; delete nothing (and take no lock).
    grace
        Seconds: files of uncommitted steps and leftovers younger than this are kept (a save may be
        writing them). 0 deletes them whatever their age. On backends that report no modification
        time, such files are kept unless ``grace`` is 0.

    Returns
    -------
    GCReport

    Raises
    ------
    WriterLockedError
        A writer (the engine) holds the repository.
    """
    repo = Repository.open(path, storage_options)
    store = repo.store
    if store.list_dir("parts"):  # ucl.write.peers: its steps are committed there, not in commits/
        raise InvalidArgumentError(f"{repo.url} is a node's part of a memory tier spread over nodes (its "
                                   "commit records are in parts/): gc would remove the steps it holds; its "
                                   "manager's retention removes them")
    now = time.time() if now is None else now
    report = GCReport(repo.url, dry_run)
    lock = None if dry_run else WriterLock.acquire(repo)
    try:
        journals = {int(m.group(1)) for n in store.list_dir("compact") if (m := _RECORD.match(n))}
        doomed: list[FileInfo] = []

        def young(files: list[FileInfo]) -> bool:
            if grace <= 0:
                return False
            return any(f.mtime is None or now - f.mtime < grace for f in files)

        def leftover(key: str, what: str) -> None:
            files = list(store.walk(key))
            if not files:
                return
            if young(files):
                report.kept.append({"key": key, "reason": f"{what} younger than {grace:g} s (a save may be "
                                                          "writing it)"})
            else:
                doomed.extend(files)

        for name in store.list_dir("commits"):
            if not _RECORD.match(name):
                leftover(f"commits/{name}", "leftover")
        for name in store.list_dir("steps"):
            prefix = f"steps/{name}"
            if name == "zarr.json":
                continue
            m = _STEP.match(name)
            if m is None:
                leftover(prefix, "leftover")
                continue
            step = int(name)
            if step in journals:
                continue  # reported with its journal below
            if not store.exists(commit_key(step)):
                leftover(prefix, f"uncommitted step {step}")
                continue
            try:
                record = repo.commit_record(step)
            except UCLError as e:
                report.kept.append({"key": prefix, "reason": f"commit record unreadable ({e.code}): left alone"})
                continue
            doomed.extend(f for f in store.walk(prefix) if f.key[len(prefix) + 1:] not in record.files)
        for step in sorted(journals):
            report.kept.append({"key": compaction_journal(step),
                                "reason": f"compaction of step {step} is unfinished: run "
                                          f"'ucl compact {repo.url} --step {step}'"})
        for name in store.list_dir("compact"):
            m = _STEP.match(name) or _RECORD.match(name)
            if m is not None and int(m.group(1)) in journals:
                continue
            leftover(f"compact/{name}", "compaction staging")
        for f in doomed:
            report.deleted.append(f.key)
            report.bytes += f.size
            if not dry_run:
                store.delete(f.key)
        if not dry_run and isinstance(store, LocalStore):
            for top in _OWNED:  # checked: a directory that resolves outside the root is refused, never walked
                _remove_empty_dirs(store.local_path(top), keep_root=True)
    finally:
        if lock is not None:
            lock.release()
    return report


def _remove_empty_dirs(root: str, keep_root: bool) -> None:
    # os.walk never enters a symlinked directory below root (followlinks=False); rmdir never follows one
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: len(w[0]), reverse=True):
        if keep_root and dirpath == root:
            continue
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)  # only succeeds when empty
