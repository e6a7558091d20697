"""The compaction journal: how an interrupted ``ucl compact`` is rolled forward (protocol: ucl/tools/compact.py).

A journal ``compact/<N>.json`` names the commit record it replaces (the crc32c of its bytes) and holds the
new one. Finishing it (steps 3-6 of the protocol) is idempotent, and is done by whoever next holds the
writer lock and meets it: ``ucl compact`` (re-run), a :class:`~ucl.write.step.StepWriter` beginning step
N, a :class:`~ucl.CheckpointManager` opening the repository (so that a restarted job sees step N again).

The record it replaces is checked before anything is touched: a journal whose step was committed again
by a writer that did not know of it (the old record is gone and another stands in its place) is stale,
and is discarded, never applied over the new step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from ucl.errors import PendingCompactionError
from ucl.format.metadata import CommitRecord
from ucl.format.repository import Repository, commit_key, compaction_journal, compaction_prefix, step_prefix
from ucl.io import native
from ucl.io.stores.base import Store

__all__ = ["finish", "finish_pending", "journal_bytes", "pending"]

JOURNAL_VERSION = 1


def journal_bytes(replaced: bytes, record: CommitRecord) -> bytes:
    """The journal of a compaction replacing the commit record whose bytes are ``replaced`` by ``record``."""
    return json.dumps({"ucl_compaction": JOURNAL_VERSION, "step": record.step,
                       "replaces": native.crc32c(replaced), "record": record.to_bytes().decode()}).encode()


def _parse(data: bytes, what: str, step: int) -> tuple[int | None, CommitRecord]:
    """(crc32c of the replaced record or None for a journal of an older ucl, the new record)."""
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and "ucl_compaction" in doc:
        return int(doc["replaces"]), CommitRecord.from_bytes(str(doc["record"]).encode(), what, step)
    return None, CommitRecord.from_bytes(data, what, step)  # older journals: the record alone


def pending(repo: Repository) -> list[int]:
    """Steps with an unfinished compaction journal."""
    out = []
    for name in repo.store.list_dir("compact"):
        stem = name[:-5] if name.endswith(".json") else ""
        if stem.isdigit() and str(int(stem)) == stem:
            out.append(int(stem))
    return sorted(out)


def finish(repo: Repository, step: int, hook: Callable[[str], None] | None = None) -> str:
    """Roll the journal of ``step`` forward (the caller holds the writer lock); returns what was done:
    ``"finished"`` or ``"stale"`` (the step was committed anew meanwhile: the journal was discarded)."""
    hook = hook or (lambda phase: None)
    store = repo.store
    key = compaction_journal(step)
    replaces, record = _parse(store.read(key), f"{repo.url}/{key}", step)
    staging = compaction_prefix(step)
    new = record.to_bytes()
    current = store.read(commit_key(step)) if store.exists(commit_key(step)) else None
    if current is not None and current != new:
        if replaces is None:
            raise PendingCompactionError(
                f"{repo.url}/{key}: an interrupted compaction of step {step} from an older ucl, and step {step} is "
                f"committed with another record: remove the journal and compact/{step}/ if that record is the "
                "one to keep", file=key)
        if native.crc32c(current) != replaces:  # step 3 never ran for *this* record: it is a new step
            store.delete_prefix(staging)
            store.delete(key)
            return "stale"
    if current != new:
        staged = store.exists(f"{staging}/zarr.json")  # else: moved into place already (step 4 ran)
        if current is not None and not staged:
            raise PendingCompactionError(
                f"{repo.url}/{key}: the journal of step {step} has no complete staging under {staging}/ while the "
                "record it replaces is still committed; remove the journal to keep the step as it is", file=key)
        if staged:
            store.delete(commit_key(step))
            store.sync_dir("commits")  # the record's removal is durable before any file of the step goes
            hook("uncommitted")
            store.delete_prefix(step_prefix(step))
            hook("removed")
            _move(store, staging, step_prefix(step))
            hook("moved")
        store.write_atomic(commit_key(step), new)
    hook("committed")
    store.delete_prefix(staging)
    store.delete(key)
    return "finished"


def finish_pending(repo: Repository) -> list[int]:
    """Finish every pending compaction (the caller holds the writer lock); the steps finished."""
    return [s for s in pending(repo) if finish(repo, s) == "finished"]


def _move(store: Store, src: str, dst: str) -> None:
    """Move every file under ``src`` to ``dst`` (a rename on local disks, then both parents made durable)."""
    src_path, dst_path = store.local_path(src), store.local_path(dst)
    if src_path is not None and dst_path is not None:
        os.rename(src_path, dst_path)
        store.sync_dir(os.path.dirname(dst) or "")
        store.sync_dir(os.path.dirname(src) or "")
        return
    for f in list(store.walk(src)):
        rel = f.key[len(src) + 1:]
        store.write(f"{dst}/{rel}", [store.read(f.key)])  # one object in memory
    store.delete(f"{src}/zarr.json")  # first: staging without it is never taken for complete
    store.delete_prefix(src)
