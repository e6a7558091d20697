"""The step writer: a step's shards, then its metadata, then (last, atomically) its commit record.

Every writer goes through :class:`StepWriter`: :func:`ucl.save` (ucl.write.save), the manager's persister
(ucl.write.manager, with the C engine moving the bytes), the DCP storage writer (ucl.adapters.dcp), import
(ucl.tools.convert) and compaction (ucl.tools.compact).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import cache
from typing import Any

import torch

from ucl.errors import CheckpointNotFoundError, StepExistsError, WriteError
from ucl.format import metadata, packed
from ucl.format.lock import WriterLock
from ucl.format.metadata import ArrayMeta, CommitRecord, StepMeta
from ucl.format.repository import Repository, check_step, commit_key, compaction_journal, step_prefix
from ucl.format.shardfile import encode_shard, shard_digest
from ucl.io.native import FileWriter
from ucl.io.stores.base import Store
from ucl.io.stores.local import HAS_SYNCFS
from ucl.write import compaction, events
from ucl.write.uploads import Uploads

FileEntry = tuple[int, int]  # (size, crc32c)


@cache
def _group_document() -> bytes:
    return metadata.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}})


#: How the skeleton of a step document (no arrays) ends: its consolidated metadata, empty.
_EMPTY_TAIL = b'"metadata":{}}}'


class DocumentCache:
    """The serialized documents of the arrays a long-lived writer (a manager's) wrote before.

    A manager writes the same arrays step after step (its plans are cached, and so are their ArrayMeta
    objects, frozen), and their documents never change; serializing them once (Python's json encodes
    the nested dicts of 500 arrays in tens of milliseconds) saves that per step. Keyed by the ArrayMeta
    object itself (held, so that its id is not reused); cleared when it grows past ``limit``.
    """

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self._arrays: dict[int, tuple[ArrayMeta, bytes]] = {}
        self._packed: tuple[bytes, str] | None = None  # the last packed members: (JSON, packed text)

    def packed(self, inner: bytes) -> str:
        """``packed.pack(inner)``, compressed once while a writer's steps pack the same members (a
        manager's steps of one plan differ only in their number, which is not packed)."""
        if self._packed is not None and self._packed[0] == inner:
            return self._packed[1]
        text = packed.pack(inner)
        self._packed = (inner, text)
        return text

    def array(self, meta: ArrayMeta) -> bytes:
        """``metadata.dumps(meta.to_dict())``, serialized once per ArrayMeta object."""
        hit = self._arrays.get(id(meta))
        if hit is not None and hit[0] is meta:
            return hit[1]
        data = metadata.dumps(meta.to_dict())
        if len(self._arrays) >= self.limit:
            self._arrays.clear()
        self._arrays[id(meta)] = (meta, data)
        return data


def step_documents(meta: StepMeta, cache: DocumentCache | None = None,
                   format_version: int = metadata.FORMAT_VERSION) -> dict[str, bytes]:
    """A step's documents (relative path -> bytes): one per group and array node (but delta arrays),
    then the step's own ``zarr.json`` with every node consolidated. The same bytes as ``metadata.dumps`` of
    ``meta.to_dict()`` and of each of its nodes; the array nodes come serialized from ``cache`` and are
    spliced into the step document (compact JSON: a node's text is the same standalone and nested).
    ``format_version`` 1 writes version 1 documents (spec/core.md §9 item 5), serialized whole; 3 packs
    the step document of a step with a layout (version 3, spec/core.md §5.1: its records and consolidated
    metadata are most of its metadata, and compress ~40x) and writes any other as version 2, which
    version 2 readers read."""
    if format_version == 1:
        doc = meta.to_dict(format_version=1)
        out = {f"{rel}/zarr.json": metadata.dumps(node)
               for rel, node in doc["consolidated_metadata"]["metadata"].items()}
        out["zarr.json"] = metadata.dumps(doc)
        return out
    cache = cache or DocumentCache()
    nodes: dict[str, bytes] = {}
    group = _group_document()
    for a in meta.arrays.values():  # the order of StepMeta.to_dict's nodes
        parts = a.key.split("/")
        for i in range(1, len(parts)):
            nodes.setdefault("/".join(parts[:i]), group)
        nodes[a.key] = cache.array(a)
    version = 3 if format_version >= 3 and meta.layout is not None else 2
    skeleton = replace(meta, arrays={}).to_dict(version)
    if meta.logical_from is None and (logical := metadata.pack_logical(meta.arrays)) is not None:
        skeleton["attributes"]["ucl"]["logical"] = logical
    body = b",".join(json.dumps(k).encode() + b":" + v for k, v in nodes.items())
    if version == 3:
        outer, inner = metadata.split_packed(skeleton, body)
        outer["attributes"]["ucl"]["packed"] = cache.packed(inner)
        top = metadata.dumps(outer)
    else:
        top = metadata.dumps(skeleton)
        if not top.endswith(_EMPTY_TAIL):  # not the shape spliced below: serialize it whole
            top = metadata.dumps(meta.to_dict(version))
        elif nodes:
            top = top[: -len(_EMPTY_TAIL)] + b'"metadata":{' + body + b"}}}"
    # a delta array has no document of its own (spec/delta.md §3.2): no Zarr reader could read it (its
    # ucl.delta codec is must-understand), and ucl reads the consolidated copy
    deltas = {a.key for a in meta.arrays.values() if a.delta is not None}
    docs = {f"{rel}/zarr.json": data for rel, data in nodes.items() if rel not in deltas}
    docs["zarr.json"] = top
    return docs


#: :meth:`StepWriter.write_shards`: the bytes of shards being written at once (the CPU copies of device
#: tensors among them).
IN_FLIGHT_BYTES = 1 << 30


class StepWriter:
    """Writes one step of a repository.

    Call sequence (who calls each):

    1. ``begin()``: the coordinator, before any rank writes. Takes the repository's writer lock (unless
       the caller holds it: ``lock=``), so that two writers never race for a step; finishes an
       interrupted compaction of the step (its journal) first; refuses a committed step; removes the
       files of an earlier attempt that never committed.
    2. ``write_shard(meta, coords, block)``: every rank, for each shard it owns. Returns the file's
       entry (relative path, size, crc32c); the file is durable when it returns.
    3. ``commit(meta, files)``: the coordinator, once every rank's shards are durable, with the union of
       their entries: writes the array and step documents, makes directories durable, then writes the
       commit record atomically. The step exists from that moment, and not before. A lock ``begin``
       took is released then (and by ``release()`` or the ``with`` block's end on failure).

    Other ranks of a distributed save only call ``write_shard``; the coordinator holds the lock.
    """

    def __init__(self, repo: Repository, step: int, *, lock: WriterLock | None = None,
                 commit_threads: int = 16, documents: DocumentCache | None = None,
                 format_version: int = metadata.FORMAT_VERSION) -> None:
        self.repo = repo
        self.format_version = format_version  # of the documents and the commit record written
        self.documents = documents  # a long-lived writer's serialized array documents
        self.store: Store = repo.store
        self.step = check_step(step)
        self.commit_threads = commit_threads
        self.prefix = step_prefix(self.step)
        self.lock = lock
        self._owned: WriterLock | None = None
        self._began: float | None = None  # when begin() ran (the committed step's log line times from it)

    def begin(self) -> None:
        self._began = time.perf_counter()
        if self.lock is None:
            self.lock = self._owned = WriterLock.acquire(self.repo)
        try:
            if self.store.exists(compaction_journal(self.step)):
                compaction.finish(self.repo, self.step)  # a crashed `ucl compact` of this step
            try:
                self.repo.commit_record(self.step)
            except CheckpointNotFoundError:  # also StepNotCommittedError: files of an attempt never committed
                self.store.delete_prefix(self.prefix)
            else:
                raise StepExistsError(f"step {self.step} is already committed in {self.repo.url}; committed "
                                      "steps never change", file=commit_key(self.step))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give up the writer lock ``begin`` took (no-op otherwise, and when done already)."""
        if self._owned is not None:
            self._owned.release()
            self._owned = None
            self.lock = None

    def __enter__(self) -> StepWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def write_shard(self, meta: ArrayMeta, coords: tuple[int, ...],
                    block: torch.Tensor) -> tuple[str, FileEntry]:
        rel = meta.shard_key(coords)
        buffers = encode_shard(meta, coords, block)
        size, _ = self.store.write(f"{self.prefix}/{rel}", buffers)
        return rel, (size, shard_digest(buffers))

    def write_shards(self, blocks: Iterable[tuple[ArrayMeta, tuple[int, ...], torch.Tensor]]
                     ) -> dict[str, FileEntry]:
        """Every shard of ``blocks`` (array, shard coordinates, its block) written, several at once, at
        most IN_FLIGHT_BYTES of them; each file's entry (as :meth:`write_shard`), durable on return. On a
        local disk through the C writer (O_DIRECT, 4 requests in flight, one syncfs at the end: one file
        after another, each fsync'ed, took 1.6-2.9x a manager's save of the same state); on an object
        store as uploads (:class:`ucl.write.uploads.Uploads`: each request waits out the store's
        latency)."""
        store = self.store
        fw = FileWriter(threads=4, sync=not HAS_SYNCFS) if store.is_local else None
        uploads = Uploads(store, 4) if fw is None else None

        def submit(rel: str, buffers: list[Any]) -> Any:
            if fw is None:
                assert uploads is not None
                return uploads.submit(f"{self.prefix}/{rel}", buffers)
            path = store.write_path(f"{self.prefix}/{rel}")
            assert path is not None
            return fw.submit(path, buffers, checksum=False)  # the encoder checksummed every inner chunk

        def size(job: Any) -> int:
            return int(fw.wait(job)[0] if fw is not None else job.result()[0])

        files: dict[str, FileEntry] = {}
        pending: deque[tuple[str, Any, int, int, list[Any]]] = deque()  # rel, job, digest, bytes, buffers
        in_flight = 0
        try:
            for meta, coords, block in blocks:
                rel = meta.shard_key(coords)
                buffers = encode_shard(meta, coords, block)
                n = sum(memoryview(b).nbytes for b in buffers)
                pending.append((rel, submit(rel, buffers), shard_digest(buffers), n, buffers))
                in_flight += n
                while in_flight > IN_FLIGHT_BYTES and len(pending) > 1:
                    rel0, job0, digest0, n0, _ = pending.popleft()
                    files[rel0] = (size(job0), digest0)
                    in_flight -= n0
            while pending:
                rel0, job0, digest0, _, _ = pending.popleft()
                files[rel0] = (size(job0), digest0)
        finally:
            if uploads is not None:
                for _, job, _, _, _ in pending:  # after a failure: those not started are not
                    job.cancel()
                uploads.close()
            if fw is not None:
                fw.close(None)  # after a failure: waits for the jobs in flight, whose buffers are alive here
        if fw is not None and not fw.sync:
            store.sync_all()  # every shard durable (data, sizes, directory entries) before the commit
        return files

    def documents_of(self, meta: StepMeta) -> dict[str, bytes]:
        """The step's documents (path relative to the step -> bytes), :func:`step_documents`."""
        return step_documents(meta, self.documents, self.format_version)

    def commit(self, meta: StepMeta, files: Mapping[str, FileEntry],
               documents: Mapping[str, FileEntry] | None = None) -> CommitRecord:
        """Write the documents (unless ``documents`` says they are written and durable), then the record.
        Only a holder of the writer lock commits (``begin``, or ``lock=``)."""
        if self.lock is None:
            raise WriteError(f"step {self.step} of {self.repo.url}: StepWriter.commit without the writer lock "
                             "(call begin() first, or pass lock=)", file=commit_key(self.step))
        try:
            record = self._commit(meta, files, documents)
        finally:
            self.release()
        events.log.debug("commit record of step %d written in %s: %d file(s), %.1f MB", self.step, self.repo.url,
                         len(record.files), record.nbytes / 1e6)
        if self._began is not None:  # one writer from begin to commit (the manager logs its own steps)
            events.committed(self.step, self.repo.url, meta.kind, record.nbytes, time.perf_counter() - self._began)
        return record

    def _commit(self, meta: StepMeta, files: Mapping[str, FileEntry],
                documents: Mapping[str, FileEntry] | None) -> CommitRecord:
        entries = dict(files)
        if documents is not None:
            entries.update(documents)
            record = CommitRecord(step=self.step, kind=meta.kind, parent=meta.parent, files=entries,
                                  version=1 if self.format_version == 1 else metadata.COMMIT_VERSION)
            self.store.write_atomic(commit_key(self.step), record.to_bytes())
            return record
        docs = self.documents_of(meta)
        # Hundreds of small documents and directories must be durable before the commit record. One
        # syncfs(2) does it in one journal commit (5x faster than an fsync each, measured); where it is
        # unavailable, fsyncs are issued concurrently so that the journal still batches them.
        if self.store.is_local:
            for rel, data in docs.items():
                entries[rel] = self.store.write(f"{self.prefix}/{rel}", [data], durable=False)
            if not self.store.sync_all():
                with ThreadPoolExecutor(self.commit_threads, thread_name_prefix="ucl-commit") as pool:
                    list(pool.map(lambda rel: self.store.write(f"{self.prefix}/{rel}", [docs[rel]]), docs))
                    dirs = {self.prefix, "steps"}
                    for rel in entries:
                        parts = f"{self.prefix}/{rel}".split("/")[:-1]
                        dirs.update("/".join(parts[:i]) for i in range(3, len(parts) + 1))
                    list(pool.map(self.store.sync_dir, sorted(dirs)))
        else:  # object stores: every PUT is durable when acknowledged; several in flight
            with ThreadPoolExecutor(self.commit_threads, thread_name_prefix="ucl-commit") as pool:
                entries.update(pool.map(
                    lambda kv: (kv[0], self.store.write(f"{self.prefix}/{kv[0]}", [kv[1]])), docs.items()))
        record = CommitRecord(step=self.step, kind=meta.kind, parent=meta.parent, files=entries,
                              version=1 if self.format_version == 1 else metadata.COMMIT_VERSION)
        self.store.write_atomic(commit_key(self.step), record.to_bytes())
        return record


