"""The reference writer: a step's shards, then its metadata, then (last, atomically) its commit record.

This is the synchronous, pure-Python path behind :func:`ucl.save`; the engine (ucl.engine) uses the same
:class:`StepWriter` protocol with its own byte movers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ucl import dtypes, metadata, names
from ucl.errors import CheckpointNotFoundError, InvalidArgumentError, StepExistsError
from ucl.metadata import ArrayMeta, CommitRecord, StepMeta
from ucl.repo import Repository, check_step, commit_key, step_prefix
from ucl.shard import choose_inner_chunk, encode_shard, shard_digest
from ucl.storage import Store

FileEntry = tuple[int, int]  # (size, crc32c)
COMMIT_THREADS = 16


def array_for(name: str, t: torch.Tensor, chunk_shape: tuple[int, ...] | None = None,
              compression: dict[str, Any] | None = None) -> ArrayMeta:
    """The stored-array metadata for a tensor written whole by one writer (or with a given block)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor", tensor=name)
    dtype = dtypes.from_torch(t.dtype)
    shape = tuple(t.shape)
    block = tuple(max(1, s) for s in (chunk_shape or shape))
    inner = choose_inner_chunk(block, dtypes.itemsize(dtype))
    return ArrayMeta(name=names.check_name(name), shape=shape, dtype=dtype, chunk_shape=block,
                     inner_chunk_shape=inner, compression=compression)


def shard_block(meta: ArrayMeta, coords: tuple[int, ...], t: torch.Tensor) -> torch.Tensor:
    """The part of a whole (logical) tensor that shard ``coords`` holds, clipped to the array."""
    idx = tuple(slice(c * s, min((c + 1) * s, n)) for c, s, n in zip(coords, meta.chunk_shape, meta.shape, strict=True))
    return t[idx]


def all_shards(meta: ArrayMeta) -> list[tuple[int, ...]]:
    import itertools

    return list(itertools.product(*(range(g) for g in meta.grid)))


class StepWriter:
    """Writes one step of a repository.

    Call sequence (who calls each):

    1. ``begin()``: the coordinator, before any rank writes. Refuses a committed step; removes the files
       of an earlier attempt that never committed.
    2. ``write_shard(meta, coords, block)``: every rank, for each shard it owns. Returns the file's
       entry (relative path, size, crc32c); the file is durable when it returns.
    3. ``commit(meta, files)``: the coordinator, once every rank's shards are durable, with the union of
       their entries: writes the array and step documents, makes directories durable, then writes the
       commit record atomically. The step exists from that moment, and not before.
    """

    def __init__(self, repo: Repository, step: int) -> None:
        self.repo = repo
        self.store: Store = repo.store
        self.step = check_step(step)
        self.prefix = step_prefix(self.step)

    def begin(self) -> None:
        try:
            self.repo.commit_record(self.step)
        except CheckpointNotFoundError:  # also StepNotCommittedError: files of an attempt that never committed
            self.store.delete_prefix(self.prefix)
        else:
            raise StepExistsError(f"step {self.step} is already committed in {self.repo.url}; committed steps "
                                  "never change", file=commit_key(self.step))

    def write_shard(self, meta: ArrayMeta, coords: tuple[int, ...], block: torch.Tensor) -> tuple[str, FileEntry]:
        rel = meta.shard_key(coords)
        buffers = encode_shard(meta, coords, block)
        size, _ = self.store.write(f"{self.prefix}/{rel}", buffers)
        return rel, (size, shard_digest(buffers))

    def write_documents(self, meta: StepMeta) -> dict[str, FileEntry]:
        """Write the step's documents without making them durable (local stores), for a writer that
        overlaps them with its shard writes and then makes everything durable with one ``sync_all``.
        Pass the result to :meth:`commit` as ``documents``."""
        return {rel: self.store.write(f"{self.prefix}/{rel}", [data], durable=False)
                for rel, data in self._documents(meta).items()}

    def _documents(self, meta: StepMeta) -> dict[str, bytes]:
        doc = meta.to_dict()
        docs = {f"{rel}/zarr.json": metadata.dumps(node) for rel, node in doc["consolidated_metadata"]["metadata"].items()}
        docs["zarr.json"] = metadata.dumps(doc)
        return docs

    def commit(self, meta: StepMeta, files: Mapping[str, FileEntry],
               documents: Mapping[str, FileEntry] | None = None) -> CommitRecord:
        """Write the documents (unless ``documents`` says they are written and durable), then the record."""
        entries = dict(files)
        if documents is not None:
            entries.update(documents)
            record = CommitRecord(step=self.step, kind=meta.kind, parent=meta.parent, files=entries)
            self.store.write_atomic(commit_key(self.step), record.to_bytes())
            return record
        docs = self._documents(meta)
        # Hundreds of small documents and directories must be durable before the commit record. One
        # syncfs(2) does it in one journal commit (5x faster than an fsync each, measured); where it is
        # unavailable, fsyncs are issued concurrently so that the journal still batches them.
        if self.store.is_local:
            for rel, data in docs.items():
                entries[rel] = self.store.write(f"{self.prefix}/{rel}", [data], durable=False)
            if not self.store.sync_all():
                with ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="ucl-commit") as pool:
                    list(pool.map(lambda rel: self.store.write(f"{self.prefix}/{rel}", [docs[rel]]), docs))
                    dirs = {self.prefix, "steps"}
                    for rel in entries:
                        parts = f"{self.prefix}/{rel}".split("/")[:-1]
                        dirs.update("/".join(parts[:i]) for i in range(3, len(parts) + 1))
                    list(pool.map(self.store.sync_dir, sorted(dirs)))
        else:  # object stores: every PUT is durable when acknowledged; several in flight
            with ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="ucl-commit") as pool:
                entries.update(pool.map(lambda kv: (kv[0], self.store.write(f"{self.prefix}/{kv[0]}", [kv[1]])),
                                        docs.items()))
        record = CommitRecord(step=self.step, kind=meta.kind, parent=meta.parent, files=entries)
        self.store.write_atomic(commit_key(self.step), record.to_bytes())
        return record


def save(state: Mapping[str, Any], path: str | os.PathLike[str] | Store, step: int, *,
         storage_options: dict[str, Any] | None = None, compression: str | None = None,
         layout: Any = None, mesh: Any = None, rank: int = 0) -> CommitRecord:
    """Write ``state`` as a committed full step (the synchronous reference writer).

    Parameters
    ----------
    state
        A state dict: tensors, possibly nested in dicts and lists (model and optimizer state together),
        with JSON-able leaves (numbers, strings) kept in the step's structure tree.
    path
        A local directory or an fsspec URL (``file://``, ``memory://``, ``s3://``); created if needed.
    step
        The step number; a committed step is never overwritten.
    storage_options
        Passed to fsspec for URLs.
    compression
        ``None`` (default: raw bytes + crc32c, fastest) or ``"zstd"``.
    layout, mesh, rank
        Save ``state`` as the local state of rank ``rank`` of a one-rank mesh under a layout
        (spec/layout.md; see :func:`ucl.reshard.save_local`): the step records the layout and its logical
        tensors (e.g. a padded vocabulary stored without its padding). For many ranks use
        :class:`ucl.engine.CheckpointManager` on each, or :func:`ucl.reshard.save_sharded`.

    Returns
    -------
    CommitRecord
        The record of the committed step.

    Raises
    ------
    StepExistsError
        When ``step`` is already committed.
    InvalidArgumentError, InvalidNameError, UnsupportedDTypeError
        When the state holds something ucl cannot store; nothing is written then.
    """
    if layout is not None:
        from ucl.reshard import save_local

        return save_local(state, path, step, layout=layout, mesh=mesh, rank=rank, storage_options=storage_options,
                          compression=compression)
    if mesh is not None:
        raise InvalidArgumentError("mesh= needs a layout= to go with it")
    tensors, tree = names.flatten(state)
    comp = {"name": "zstd", "configuration": {"level": 1, "checksum": False}} if compression == "zstd" else None
    if compression not in (None, "zstd"):
        raise InvalidArgumentError(f"compression must be None or 'zstd', got {compression!r}")
    arrays = {n: array_for(n, t, compression=comp) for n, t in tensors.items()}  # all checks before any write
    repo = Repository.open(path, storage_options, create=True)
    w = StepWriter(repo, step)
    w.begin()
    files: dict[str, FileEntry] = {}
    for name, t in tensors.items():
        meta = arrays[name]
        cpu = t.detach().to("cpu")
        for coords in all_shards(meta):
            rel, entry = w.write_shard(meta, coords, shard_block(meta, coords, cpu))
            files[rel] = entry
    return w.commit(StepMeta(step=step, kind="full", tree=tree, arrays=arrays), files)
