"""Persisting one job: encode its shards from the staging slot and write them durably.

Local repositories go through the C FileWriter (O_DIRECT, several files in flight; the encoder's crc32c per
inner chunk, none again on the way);
object stores through a pool of uploads. Either way this rank's files are durable when
:meth:`ShardWriter.write` returns, before the rank reports them to the coordinator (ucl.write.commit).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from time import perf_counter as clock
from typing import Any

import torch

from ucl.delta.shardfile import encode_delta_shard
from ucl.format import metadata
from ucl.format.records import choose_encoding
from ucl.format.repository import Repository, step_prefix
from ucl.format.shardfile import encode_shard, shard_digest
from ucl.io.native import FileWriter
from ucl.io.stores.local import HAS_SYNCFS
from ucl.plan import save as saveplan
from ucl.write.commit import full_meta
from ucl.write.job import Job
from ucl.write.kinds import DeltaBase
from ucl.write.staging import CopyGate
from ucl.write.step import DocumentCache, FileEntry, StepWriter
from ucl.write.uploads import Uploads

#: The phases :meth:`ShardWriter.write` times (seconds, in ``Job.phases``).
SHARD_PHASES = ("encode", "paths", "submit", "documents", "drain", "sync", "write")


class ShardWriter:
    """Writes the shards of the jobs of one manager (its persister thread only).

    Parameters
    ----------
    repo
        The repository.
    rank
        This rank (the coordinator, rank 0, also writes a full step's documents).
    threads, direct
        C write pool size (also the number of uploads in flight) and O_DIRECT choice
        (see ucl.io.native.FileWriter).
    """

    def __init__(self, repo: Repository, rank: int, threads: int, direct: bool | None,
                 format_version: int = metadata.FORMAT_VERSION, gate: CopyGate | None = None) -> None:
        self.repo, self.rank = repo, rank
        self._gate = gate or CopyGate()  # a save copying its state: start nothing new meanwhile
        self.format_version = format_version  # of a full step's documents (WriteOptions.format_version)
        self._threads, self._direct = threads, direct
        self._file_writer: FileWriter | None = None
        self._uploads = Uploads(repo.store, threads)  # object stores: several uploads in flight, large ones few
        self._paths: ThreadPoolExecutor | None = None  # write_path ahead of the encoding (local stores)
        self._phases: dict[int, dict[str, float]] = {}  # step -> its phases so far (a step in pieces)
        self._documents = DocumentCache()  # the arrays' documents, serialized once per plan

    def write(self, job: Job, base: DeltaBase | None) -> dict[str, FileEntry]:
        """Encode and write ``job``'s shards; returns their entries (relative path -> size, crc32c).

        ``base``: the staged base the job's state is encoded against as a delta (its unchanged shards
        then get no file), None to store it whole. Raises the first write error, after every write
        submitted has finished. The seconds of each phase go to ``job.phases`` (a step's pieces summed
        into its last piece's): ``encode`` (chunk views, crc32c of each inner chunk, delta payloads),
        ``paths`` (checking each file's path, making its directories), ``submit``, ``documents`` (a
        full step's, written while the C threads write the shards), ``drain`` (waiting for the last
        writes after Python's part is done), ``sync`` (the one syncfs) and ``write`` (all of it).
        """
        t_start = clock()
        ph = self._phases.setdefault(job.step, dict.fromkeys(SHARD_PHASES, 0.0))
        try:
            out = self._write(job, base, ph)
        except BaseException:
            self._phases.pop(job.step, None)
            raise
        ph["write"] += clock() - t_start
        if job.last_piece:
            job.phases.update(self._phases.pop(job.step))
        return out

    def _write(self, job: Job, base: DeltaBase | None, ph: dict[str, float]) -> dict[str, FileEntry]:
        store = self.repo.store
        prefix = step_prefix(job.step)
        out: dict[str, FileEntry] = {}
        fw = self._writer()
        jobs: list[tuple[str, Any, Any]] = []
        # the step's documents (the coordinator's last piece of a full step): C job ids, or uploads
        docs: list[tuple[str, Any]] = []
        writes = [(w, job.staged) for w in job.plan.writes]
        comp = job.composite
        if comp is not None:  # a composite step: its stale groups are references, written nowhere
            writes = [(w, st) for w, st in writes if w.source not in comp.stale]
        if job.kind == "gradients":
            assert job.grad is not None
            replayed = job.grad.replayed
            writes = [(w, st) for w, st in writes if w.source not in replayed]
            writes += [(w, job.grad.staged) for w in job.grad.plan.writes]
        ahead: list[Future[str | None]] = []
        if fw is not None and base is None:
            # the files' paths checked and their directories made on a helper thread, ahead of the
            # encoding: mkdir and lstat release the GIL, so the kernel's directory work (a new step makes
            # a few directories per array) overlaps the encoding instead of following it
            pool = self._path_pool()
            ahead = [pool.submit(self._path, f"{prefix}/{w.array.shard_key(w.coords)}") for w, _ in writes]
        try:
            for i, (w, staged) in enumerate(writes):
                self._gate.wait()
                t = clock()
                block = block_of(w, staged[w.source])
                rel = w.array.shard_key(w.coords)
                delta = base is not None and staged is job.staged
                if delta and (comp is None or w.source not in comp.write_full):
                    assert base is not None
                    maybe = encode_delta_shard(w.array, w.coords, block, block_of(w, base.staged[w.source]),
                                               choose_encoding(w.array.name, w.array.dtype))
                    if maybe is None:
                        ph["encode"] += clock() - t
                        continue  # every inner chunk unchanged: no file
                    job.changed.add(w.array.name)  # type: ignore[union-attr]
                    buffers = maybe
                else:
                    buffers = encode_shard(w.array, w.coords, block)
                t1 = clock()
                ph["encode"] += t1 - t
                if fw is not None:
                    # checked (inside the repository, spec/core.md §3, item 2), its directories made under the
                    # same rule: the C writer opens it as given
                    path = ahead[i].result() if ahead else store.write_path(f"{prefix}/{rel}")
                    assert path is not None
                    t2 = clock()
                    ph["paths"] += t2 - t1
                    # the encoder checksummed every inner chunk: the engine need not read the bytes again
                    jobs.append((rel, fw.submit(path, buffers, checksum=False), buffers))
                    ph["submit"] += clock() - t2
                else:  # object stores: several uploads in flight
                    jobs.append((rel, self._uploads.submit(f"{prefix}/{rel}", buffers), buffers))
                    ph["submit"] += clock() - t1
            if self.rank == 0 and job.kind == "full" and job.last_piece and (fw is None or not fw.sync):
                # a full step's documents are known now: write them while the C threads write the
                # shards, so that this rank's one sync covers them too and commit only adds the record
                t = clock()
                writer = StepWriter(self.repo, job.step, documents=self._documents,
                                    format_version=self.format_version)
                for rel, data in writer.documents_of(full_meta(job)).items():
                    if fw is None:  # uploads too, after the shards: one by one here, a GPT-2-like step's
                        # 101 documents took 2.0 s beside its shards' 2.1 s on a loopback S3 server
                        docs.append((rel, self._uploads.submit(f"{prefix}/{rel}", [data])))
                    else:  # on the C threads too, after the shards (the queue is in order)
                        path = store.write_path(f"{prefix}/{rel}")
                        assert path is not None
                        docs.append((rel, fw.submit(path, [data])))
                ph["documents"] += clock() - t
        finally:
            for f in ahead:  # after a failure: the paths not made yet are not made, those being made end
                f.cancel()
            wait_all(ahead)
            t = clock()
            first: BaseException | None = None
            for rel, jid, bufs in jobs:
                try:
                    size = (fw.wait(jid) if fw is not None else jid.result())[0]
                    out[rel] = (size, shard_digest(bufs))
                except BaseException as e:  # noqa: BLE001 - reap every job before raising
                    first = first or e
            documents: dict[str, FileEntry] = {}
            for rel, jid in docs:
                try:  # (size, crc32c of the bytes)
                    documents[rel] = fw.wait(jid) if fw is not None else jid.result()
                except BaseException as e:  # noqa: BLE001
                    first = first or e
            if docs and first is None:
                job.documents = documents
            ph["drain"] += clock() - t
            if first is not None:
                raise first
        if fw is not None and not fw.sync and (jobs or docs):
            t = clock()
            store.sync_all()  # this rank's shards (and documents) are durable before it reports them
            ph["sync"] += clock() - t
        return out

    def _path(self, key: str) -> str | None:
        self._gate.wait()
        return self.repo.store.write_path(key)

    def _writer(self) -> FileWriter | None:
        if self._file_writer is None and self.repo.store.is_local:
            # with syncfs, one call per save makes every shard durable (data, sizes, directory entries)
            # instead of one fdatasync per file: hundreds of journal commits fewer
            self._file_writer = FileWriter(threads=self._threads, direct=self._direct, sync=not HAS_SYNCFS)
            self._gate.listen(self._file_writer.hold)
        return self._file_writer

    def _path_pool(self) -> ThreadPoolExecutor:
        if self._paths is None:
            self._paths = ThreadPoolExecutor(1, thread_name_prefix="ucl-paths")
        return self._paths

    def close(self, timeout: float | None) -> None:
        """Stop the C write pool (bounded by ``timeout``) and the uploads (after those in flight)."""
        if self._file_writer is not None:
            self._file_writer.close(timeout)
        self._uploads.close()
        if self._paths is not None:
            self._paths.shutdown(wait=True)


def block_of(w: saveplan.LocalWrite, staged: torch.Tensor) -> torch.Tensor:
    """The block shard ``w`` stores, from the staged tensor of its source."""
    if w.box is not None:
        return saveplan.block_of(w, staged)
    if tuple(staged.shape) == w.array.shape:  # a whole logical tensor: take this shard's part
        return saveplan.shard_block(w.array, w.coords, staged)
    return staged
