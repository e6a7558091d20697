"""``compact``: rewrite a committed delta step as a full one (journaled, crash-safe).

It takes the repository's writer lock on local filesystems, as gc does.

**compact** rewrites a committed delta step as a full step with the same number and the same values,
bit for bit. The commit record is the truth, and a step's files live at fixed paths under
``steps/<N>/``, so the two versions cannot sit side by side; the protocol is:

1. Write the full version, shards and documents, under ``compact/<N>/`` (the delta step stays
   committed and readable throughout). A crash here leaves only staging, which gc removes.
2. Write the journal ``compact/<N>.json`` atomically: the new commit record and the crc32c of the one it
   replaces. From here on the compaction rolls forward, never back: every later step is idempotent, and
   whoever next holds the writer lock redoes them (``compact``, a writer of step N, a manager opening the
   repository: ucl/write/compaction.py), after checking that the record it replaces is still the one
   committed (else step N was saved anew and the journal is discarded, never applied over it).
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

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ucl.errors import InvalidArgumentError
from ucl.format.lock import WriterLock
from ucl.format.metadata import ArrayMeta, CommitRecord, StepMeta
from ucl.format.records import GRADIENT_RECORDS
from ucl.format.repository import (
    Repository,
    check_step,
    commit_key,
    compaction_journal,
    compaction_prefix,
)
from ucl.format.shardfile import encode_shard, shard_digest
from ucl.options import DEFAULT_WRITE, WriteOptions
from ucl.plan.save import all_shards, array_for_shape
from ucl.read.checkpoint import Checkpoint
from ucl.tools.progress import Progress
from ucl.write import compaction as journal
from ucl.write.step import FileEntry, step_documents

__all__ = ["CompactResult", "compact"]


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
            options: WriteOptions = DEFAULT_WRITE, _hook: Callable[[str], None] | None = None) -> CompactResult:
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
    lock = WriterLock.acquire(repo)
    try:
        if repo.store.exists(compaction_journal(step)):
            if journal.finish(repo, step, hook) == "stale":
                return CompactResult(step, False, f"discarded the journal of an interrupted compaction of step {step}: "
                                     "the step was committed again since; it is left as committed")
            return CompactResult(step, True, f"finished the interrupted compaction of step {step}")
        raw = repo.store.read(commit_key(step)) if repo.store.exists(commit_key(step)) else None
        record = repo.commit_record(step)
        meta = repo.step_meta(step, record)
        if meta.kind == "full" and not force:
            return CompactResult(step, False, f"step {step} is already a full step: nothing to do")
        new_record, nbytes = _stage(repo, step, record, meta, compression, progress, options)
        hook("staged")
        assert raw is not None
        repo.store.write_atomic(compaction_journal(step), journal.journal_bytes(raw, new_record))
        hook("journal")
        journal.finish(repo, step, hook)
        return CompactResult(step, True, f"step {step} rewritten as a full step", nbytes)
    finally:
        lock.release()


def _stage(repo: Repository, step: int, record: CommitRecord, meta: StepMeta, compression: str | None,
           progress: bool | None, options: WriteOptions) -> tuple[CommitRecord, int]:
    """Write the full version of ``step`` under compact/<step>/; return its commit record-to-be and size."""
    store = repo.store
    staging = compaction_prefix(step)
    store.delete_prefix(staging)
    comp = {"name": "zstd", "configuration": {"level": 1, "checksum": False}} if compression == "zstd" else None
    arrays = {n: ArrayMeta(name=a.name, shape=a.shape, dtype=a.dtype, chunk_shape=a.chunk_shape,
                           inner_chunk_shape=a.inner_chunk_shape, compression=comp,
                           logical=a.logical) for n, a in meta.arrays.items()}
    extensions = meta.extensions
    files: dict[str, FileEntry] = {}
    with Checkpoint(repo, step, record, meta) as ckpt, \
            Progress(sum(a.nbytes for a in arrays.values()), "compact", enabled=progress) as bar:
        if meta.gradient_records is not None:  # the full step stores what the replay defines, not gradients
            arrays = {}
            for n in ckpt:
                t = ckpt[n]
                arrays[n] = array_for_shape(n, tuple(t.shape), t.dtype, compression=comp,
                                            inner_bytes=options.inner_chunk_bytes)
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
    # the documents any writer of these options writes (a layout step's packed, spec/core.md §5.1)
    for rel, data in step_documents(full, format_version=options.format_version).items():
        files[rel] = store.write(f"{staging}/{rel}", [data])
    if store.is_local:
        for d in sorted({os.path.dirname(f"{staging}/{rel}") for rel in files}, key=len, reverse=True):
            store.sync_dir(d)
    return CommitRecord(step=step, kind="full", parent=None, files=files), sum(a.nbytes for a in arrays.values())
