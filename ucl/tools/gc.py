"""Repository maintenance: ``gc`` (delete what no commit record references) and ``compact`` (delta -> full).

Both take the repository's writer lock (``<repo>/.ucl-writer.lock``, the one the engine holds while it
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

**compact** rewrites a committed delta step as a full step with the same number and the same values,
bit for bit. The commit record is the truth, and a step's files live at fixed paths under
``steps/<N>/``, so the two versions cannot sit side by side; the protocol is:

1. Write the full version, shards and documents, under ``compact/<N>/`` (the delta step stays
   committed and readable throughout). A crash here leaves only staging, which gc removes.
2. Write the journal ``compact/<N>.json`` atomically: the new commit record. From here on the
   compaction rolls forward, never back: every later step is idempotent and ``compact`` redoes them.
3. Delete ``commits/<N>.json``. Step N is invisible from now until step 5 (a reader that opens it
   in this window gets ``not_found``; one that had it open fails its size/checksum checks loudly,
   never silently).
4. Delete ``steps/<N>/`` and move ``compact/<N>/`` there (a rename on local disks; copy + delete on
   object stores, where a crash mid-copy is redone from step 4).
5. Write ``commits/<N>.json`` (the journal's record) atomically: the full step is committed.
6. Delete the journal.

Delta steps whose chains pass through N stay valid: a delta records differences of *values*, which
compaction does not change. Compaction reads the delta step tensor shard by tensor shard through
:func:`ucl.open` (so it works for any delta encoding the reader resolves) and holds one shard in memory.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ucl.errors import InvalidArgumentError, UCLError
from ucl.format import metadata
from ucl.format.lock import WriterLock
from ucl.format.metadata import ArrayMeta, CommitRecord, StepMeta
from ucl.format.records import GRADIENT_RECORDS
from ucl.format.repository import Repository, check_step, commit_key, step_prefix
from ucl.format.shardfile import choose_inner_chunk, encode_shard, shard_digest
from ucl.io.stores.base import Store
from ucl.io.stores.local import LocalStore
from ucl.plan.save import all_shards, array_for
from ucl.read.checkpoint import Checkpoint
from ucl.tools.progress import Progress
from ucl.write.step import FileEntry

__all__ = ["CompactResult", "GCReport", "compact", "gc"]

DEFAULT_GRACE_S = 3600.0
_STEP = re.compile(r"^(0|[1-9][0-9]{0,18})$")
_RECORD = re.compile(r"^(0|[1-9][0-9]{0,18})\.json$")
_OWNED = ("steps", "commits", "compact")


# -- listing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _File:
    key: str
    size: int
    mtime: float | None  # None when the backend does not say


def _files(store: Store, prefix: str) -> Iterator[_File]:
    """Every file under ``prefix`` (recursively), with size and modification time."""
    if isinstance(store, LocalStore):
        root = store.path(prefix)
        if os.path.isfile(root) or os.path.islink(root):
            st = os.lstat(root)
            yield _File(prefix, st.st_size, st.st_mtime)
            return
        for dirpath, _, filenames in os.walk(root):
            for f in filenames:
                p = os.path.join(dirpath, f)
                st = os.lstat(p)
                yield _File(os.path.relpath(p, store.root).replace(os.sep, "/"), st.st_size, st.st_mtime)
        return
    fs = getattr(store, "fs", None)
    if fs is None:
        raise InvalidArgumentError(f"gc cannot list {store.url}: the backend has no filesystem listing")
    base = store.path(prefix)  # type: ignore[attr-defined]
    try:
        found = fs.find(base, detail=True)
    except FileNotFoundError:
        return
    root = store.root.rstrip("/") + "/"  # type: ignore[attr-defined]
    for name, info in found.items():
        rel = name[name.find(root.lstrip("/")) + len(root.lstrip("/")):] if root.lstrip("/") in name else name
        yield _File(rel.lstrip("/"), int(info.get("size") or 0), _mtime_of(info))


def _mtime_of(info: dict[str, Any]) -> float | None:
    for k in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if isinstance(v, int | float):
            return float(v)
        stamp = getattr(v, "timestamp", None)
        if callable(stamp):
            return float(stamp())
    return None


def _lock(repo: Repository) -> Any:

    return WriterLock.acquire(repo)


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
    now = time.time() if now is None else now
    report = GCReport(repo.url, dry_run)
    lock = None if dry_run else _lock(repo)
    try:
        journals = {int(m.group(1)) for n in store.list_dir("compact") if (m := _RECORD.match(n))}
        doomed: list[_File] = []

        def young(files: list[_File]) -> bool:
            if grace <= 0:
                return False
            return any(f.mtime is None or now - f.mtime < grace for f in files)

        def leftover(key: str, what: str) -> None:
            files = list(_files(store, key))
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
            doomed.extend(f for f in _files(store, prefix) if f.key[len(prefix) + 1:] not in record.files)
        for step in sorted(journals):
            report.kept.append({"key": _journal(step), "reason": f"compaction of step {step} is unfinished: run "
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
            for top in _OWNED:
                _remove_empty_dirs(store.path(top), keep_root=True)
    finally:
        if lock is not None:
            lock.release()
    return report


def _remove_empty_dirs(root: str, keep_root: bool) -> None:
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: len(w[0]), reverse=True):
        if keep_root and dirpath == root:
            continue
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)  # only succeeds when empty


# -- compact ---------------------------------------------------------------------------------------
@dataclass
class CompactResult:
    """What :func:`compact` did. ``changed`` is False when the step was already full."""

    step: int
    changed: bool
    message: str
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _staging(step: int) -> str:
    return f"compact/{step}"


def _journal(step: int) -> str:
    return f"compact/{step}.json"


def compact(path: Any, step: int, *, compression: str | None = None, force: bool = False,
            storage_options: dict[str, Any] | None = None, progress: bool | None = None,
            _hook: Callable[[str], None] | None = None) -> CompactResult:
    """Rewrite committed delta step ``step`` as a full step with the same number (protocol: module doc).

    Parameters
    ----------
    path
        Repository directory or fsspec URL.
    step
        The step to compact. An unfinished compaction of it (a journal) is finished first.
    compression
        None or ``"zstd"`` for the full step's chunks.
    force
        Rewrite a step that is already full too (to change its compression, say).
    progress
        Draw a progress bar on stderr: None (default) when stderr is a terminal.

    Returns
    -------
    CompactResult
        ``changed=False`` with a message when the step is already full (and ``force`` is not set).

    Raises
    ------
    CheckpointNotFoundError
        The step is not committed (and no journal of it exists).
    WriterLockedError
        A writer holds the repository.
    """
    if compression not in (None, "zstd"):
        raise InvalidArgumentError(f"compression must be None or 'zstd', got {compression!r}")
    step = check_step(step)
    hook = _hook or (lambda phase: None)
    repo = Repository.open(path, storage_options)
    lock = _lock(repo)
    try:
        if repo.store.exists(_journal(step)):
            _finish(repo, step, hook)
            return CompactResult(step, True, f"finished the interrupted compaction of step {step}")
        record = repo.commit_record(step)
        meta = repo.step_meta(step, record)
        if meta.kind == "full" and not force:
            return CompactResult(step, False, f"step {step} is already a full step: nothing to do")
        new_record, nbytes = _stage(repo, step, record, meta, compression, progress)
        hook("staged")
        repo.store.write_atomic(_journal(step), new_record.to_bytes())
        hook("journal")
        _finish(repo, step, hook)
        return CompactResult(step, True, f"step {step} rewritten as a full step", nbytes)
    finally:
        lock.release()


def _stage(repo: Repository, step: int, record: CommitRecord, meta: StepMeta, compression: str | None,
           progress: bool | None) -> tuple[CommitRecord, int]:
    """Write the full version of ``step`` under compact/<step>/; return its commit record-to-be and size."""
    store = repo.store
    staging = _staging(step)
    store.delete_prefix(staging)
    comp = {"name": "zstd", "configuration": {"level": 1, "checksum": False}} if compression == "zstd" else None
    arrays = {n: ArrayMeta(name=a.name, shape=a.shape, dtype=a.dtype, chunk_shape=a.chunk_shape,
                           inner_chunk_shape=choose_inner_chunk(a.chunk_shape, a.itemsize), compression=comp,
                           logical=a.logical) for n, a in meta.arrays.items()}
    extensions = meta.extensions
    files: dict[str, FileEntry] = {}
    with Checkpoint(repo, step, record, meta) as ckpt, \
            Progress(sum(a.nbytes for a in arrays.values()), "compact", enabled=progress) as bar:
        if meta.gradient_records is not None:  # the full step stores what the replay defines, not gradients
            arrays = {}
            for n in ckpt.keys():
                t = ckpt[n]
                arrays[n] = array_for(n, torch.empty(t.shape, dtype=t.dtype, device="meta"), compression=comp)
            extensions = tuple(e for e in extensions if e.get("name") != GRADIENT_RECORDS)
        for name, a in arrays.items():
            # the stored array (a layout step's ckpt[name] is the logical tensor); a gradient step's tensor
            lt = ckpt[name] if meta.gradient_records is not None else ckpt.array(name)
            for coords in all_shards(a):
                start = tuple(c * k for c, k in zip(coords, a.chunk_shape, strict=True))
                size = tuple(min(k, n - s) for k, n, s in zip(a.chunk_shape, a.shape, start, strict=True))
                block = lt.read_box(start, size)  # one shard in memory
                rel = a.shard_key(coords)
                buffers = encode_shard(a, coords, block)
                files[rel] = (store.write(f"{staging}/{rel}", buffers)[0], shard_digest(buffers))
                bar.update(block.numel() * block.element_size())
    full = StepMeta(step=step, kind="full", tree=meta.tree, arrays=arrays, parent=None, layout=meta.layout,
                    mesh=meta.mesh, extensions=extensions)
    doc = full.to_dict()
    for rel, node in doc["consolidated_metadata"]["metadata"].items():
        files[f"{rel}/zarr.json"] = store.write(f"{staging}/{rel}/zarr.json", [metadata.dumps(node)])
    files["zarr.json"] = store.write(f"{staging}/zarr.json", [metadata.dumps(doc)])
    if store.is_local:
        for d in sorted({os.path.dirname(f"{staging}/{rel}") for rel in files}, key=len, reverse=True):
            store.sync_dir(d)
    return CommitRecord(step=step, kind="full", parent=None, files=files), sum(a.nbytes for a in arrays.values())


def _finish(repo: Repository, step: int, hook: Callable[[str], None]) -> None:
    """Steps 3-6 of the protocol, each idempotent, driven by the journal."""
    store = repo.store
    key = _journal(step)
    record = CommitRecord.from_bytes(store.read(key), f"{repo.url}/{key}", step)
    staging = _staging(step)
    if store.exists(f"{staging}/zarr.json"):  # the new files are not in place yet
        store.delete(commit_key(step))
        hook("uncommitted")
        store.delete_prefix(step_prefix(step))
        hook("removed")
        _move(store, staging, step_prefix(step))
        hook("moved")
    store.write_atomic(commit_key(step), record.to_bytes())
    hook("committed")
    store.delete_prefix(staging)
    store.delete(key)


def _move(store: Store, src: str, dst: str) -> None:
    """Move every file under ``src`` to ``dst`` (a rename on local disks)."""
    if isinstance(store, LocalStore):
        os.rename(store.path(src), store.path(dst))
        store.sync_dir(os.path.dirname(dst) or "")
        store.sync_dir(os.path.dirname(src) or "")
        return
    for f in list(_files(store, src)):
        rel = f.key[len(src) + 1:]
        store.write(f"{dst}/{rel}", [store.read(f.key)])  # one object in memory
    store.delete(f"{src}/zarr.json")  # first: staging without it is never taken for complete
    store.delete_prefix(src)
