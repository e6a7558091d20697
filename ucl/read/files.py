"""The files of one committed step, as every reader of it sees them (plain reads, chain reads, validation).

:class:`StepFiles` finds a shard in the commit record, reads and checks its index (cached), reads byte
ranges through the one :class:`~ucl.io.ranges.RangeReader` (local files) or the store, and counts the
bytes read. The errors of reading shards are made here, so that every reader names a missing, truncated
or corrupt shard the same way. Local files are opened by :func:`ucl.io.ranges.open_regular` only: a
FIFO, device or directory where a shard should be is ``NotAFileError``, never read.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ucl.errors import (
    ChecksumError,
    CorruptShardIndexError,
    MissingShardError,
    NotAFileError,
    ShardSizeError,
    StepRemovedError,
    UCLError,
)
from ucl.format import metadata
from ucl.format.metadata import ArrayMeta, CommitRecord
from ucl.format.repository import commit_key, read_listed, step_prefix
from ucl.format.shardfile import canonical_index, index_nbytes, parse_index
from ucl.io import native as _native
from ucl.io.ranges import ALIGN, Lease, RangeReader, open_regular
from ucl.io.stores.base import Store
from ucl.options import DEFAULT_READ, ReadOptions


@dataclass
class StepFiles:
    """What a reader of one committed step needs: its store, commit record, index cache and byte reader."""

    store: Store
    step: int
    record: CommitRecord
    ranges: RangeReader = field(default_factory=RangeReader)
    format_version: int = metadata.FORMAT_VERSION  # the step document's: what its array documents hold
    small_shard_bytes: int = 128 << 10  # a small shard a read needs whole is read in one request
    segment_buffer_bytes: int = 0  # the buffer of an O_DIRECT segment of a plain read (read_direct)
    indexes: dict[tuple[str, tuple[int, ...]], np.ndarray] = field(default_factory=dict)
    bytes_read: int = 0
    small: dict[str, memoryview] = field(default_factory=dict)  # whole small shards read with their index
    documents_read: int = 0  # array documents read to confirm a consolidated entry (see confirm)
    _confirmed: set[str] = field(default_factory=set)
    _paths: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def prefix(self) -> str:
        return step_prefix(self.step)

    def count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def confirm(self, meta: ArrayMeta) -> None:
        """The consolidated entry ``meta`` says what the array's own document says, once per array
        (spec/core.md §5.1): a step whose document lies about a shape, dtype or codec while every
        array document holds the truth is ``inconsistent_metadata``, never read as the lie says. The
        entry serialized as a writer writes it has the commit record's size and crc32c: confirmed
        without a read (every step ucl writes); else the document is read, verified and compared."""
        if meta.name in self._confirmed:
            return
        rel = f"{meta.key}/zarr.json"
        listed = self.record.files.get(rel)
        if listed is not None:  # a version 2 delta array has no document (spec/delta.md §3.2)
            text = metadata.array_document(meta, self.format_version)
            if (len(text), _native.crc32c(text)) != tuple(listed):
                raw = read_listed(self.store, self.step, rel, self.record)
                with self._lock:
                    self.documents_read += 1
                metadata.check_array_document(raw, meta, self.format_version, f"{self.prefix}/{rel}")
        with self._lock:
            self._confirmed.add(meta.name)

    def shard(self, meta: ArrayMeta, coords: tuple[int, ...]) -> tuple[str, int]:
        """(key, recorded size) of a shard, its array's entry confirmed; MissingShardError when the
        commit record does not list it."""
        self.confirm(meta)
        rel = meta.shard_key(coords)
        if rel not in self.record.files:
            raise MissingShardError(f"shard {self.prefix}/{rel} of tensor {meta.name!r} is not in the commit record "
                                    f"of step {self.step}", tensor=meta.name, file=f"{self.prefix}/{rel}")
        return f"{self.prefix}/{rel}", self.record.files[rel][0]

    def local_path(self, key: str) -> str | None:
        """The file of ``key`` on a local store (checked once per step: it must not leave the repository
        through a symlink), or None for other stores."""
        p = self._paths.get(key)
        if p is None:
            q = self.store.local_path(key)
            if q is None:
                return None
            p = self._paths[key] = q
        return p

    def removed(self, what: str = "") -> StepRemovedError | None:
        """``step_removed`` when this step's commit record is gone or is another one now (retention, gc or
        compaction deleted the step while it was read), else None (also for a damaged record: that is not a
        removal). ``what`` says what the reader found missing."""
        try:
            now = CommitRecord.from_bytes(self.store.read(commit_key(self.step)), commit_key(self.step), self.step)
        except (FileNotFoundError, NotADirectoryError):
            now = None
        except UCLError:
            return None
        if now == self.record:
            return None
        how = "its commit record is gone" if now is None else "its commit record was replaced (compacted)"
        return StepRemovedError(f"step {self.step} was removed while it was read ({how})"
                                + (f": {what}" if what else ""), file=commit_key(self.step))

    def missing(self, key: str, name: str) -> UCLError:
        """The error for a listed shard that is not there: ``step_removed`` when the step was removed while
        it was read, else ``missing_shard`` (the record still names the file: corruption)."""
        gone = self.removed(f"shard {key} of tensor {name!r} is gone with it")
        if gone is None:
            return missing(key, name)
        gone.tensor, gone.file = name, key
        return gone

    # -- bytes ---------------------------------------------------------------------------------------
    def read(self, key: str, offset: int, length: int) -> Lease | memoryview:
        """Bytes [offset, offset + length) (fewer only at the end of the file), counted: a pooled
        :class:`Lease` for local files (release it), a memoryview otherwise. FileNotFoundError when absent."""
        path = self.local_path(key)
        if path is None:
            data = memoryview(self.store.read_range(key, offset, length))
            self.count(data.nbytes)
            return data
        lease = self.ranges.read(path, offset, length)
        assert lease is not None
        self.count(lease.view.nbytes)
        return lease

    def read_direct(self, key: str, offset: int, length: int) -> Lease | None:
        """As :meth:`read` when the range goes to the device with O_DIRECT, else None (then read it
        straight into its destinations with :meth:`readinto`)."""
        path = self.local_path(key)
        if path is None:
            return None
        lease = self.ranges.read(path, offset, length, direct_only=True, buffer_bytes=self.segment_buffer_bytes)
        if lease is not None:
            self.count(lease.view.nbytes)
        return lease

    def readinto(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Buffered, vectored, straight into ``buffers``; the bytes read, counted."""
        path = self.local_path(key)
        got = (self.ranges.readinto(path, offset, buffers) if path is not None
               else self.store.readinto(key, offset, list(buffers)))
        self.count(got)
        return got

    # -- indexes -------------------------------------------------------------------------------------
    def index(self, meta: ArrayMeta, coords: tuple[int, ...], whole: bool = False) -> np.ndarray:
        """The checked index of a shard (cached). ``whole``: the caller needs every chunk of the shard, so a
        small shard is read in one request with its index, its bytes kept in ``small`` for the chunks."""
        cached = self.indexes.get((meta.name, coords))
        if cached is not None:
            return cached
        key, size = self.shard(meta, coords)
        n = index_nbytes(meta.n_inner)
        if size < n:
            raise ShardSizeError(f"{key}: the commit record's size {size} cannot hold the {n}-byte index",
                                 tensor=meta.name, file=key)
        if whole and size <= self.small_shard_bytes:
            try:
                data = self._pread(key, 0, size)
            except (FileNotFoundError, NotADirectoryError):
                raise self.missing(key, meta.name) from None
            except NotAFileError as e:
                raise not_a_file(e, key, meta.name) from None
            if len(data) == size:  # else: truncated, reported by the index read below
                self.count(size)
                idx = parse_index(meta, data[size - n :], size, key)
                self.small[key] = memoryview(data)
                self.indexes[(meta.name, coords)] = idx
                return idx
        idx = self.read_index(meta, coords)
        self.indexes[(meta.name, coords)] = idx
        return idx

    def read_index(self, meta: ArrayMeta, coords: tuple[int, ...]) -> np.ndarray:
        """A shard's index read from its file and checked, whatever the cache holds (not cached)."""
        key, size = self.shard(meta, coords)
        n = index_nbytes(meta.n_inner)
        if size < n:
            raise ShardSizeError(f"{key}: the commit record's size {size} cannot hold the {n}-byte index",
                                 tensor=meta.name, file=key)
        try:
            raw = self._pread(key, size - n, n)
        except (FileNotFoundError, NotADirectoryError):
            raise self.missing(key, meta.name) from None
        except NotAFileError as e:
            raise not_a_file(e, key, meta.name) from None
        self.count(len(raw))
        return parse_index(meta, raw, size, key)

    def predicted_index(self, meta: ArrayMeta, coords: tuple[int, ...]) -> np.ndarray | None:
        """The index the shard has if its writer laid it out as ucl does (``canonical_index``) and the
        commit record's size agrees, else None. Not checked against the file: the caller reads the real
        index beside the data and uses the bytes only once the two are equal."""
        guess = canonical_index(meta, coords)
        if guess is None:
            return None
        _, size = self.shard(meta, coords)
        return guess[0] if guess[1] == size else None

    def whole(self, meta: ArrayMeta, coords: tuple[int, ...]) -> tuple[np.ndarray, Lease | memoryview | None]:
        """A listed shard read whole in one request (its index parsed from it and cached), or only its
        index when the index is cached already (then None). The caller releases a returned Lease."""
        key, size = self.shard(meta, coords)
        cached = self.indexes.get((meta.name, coords))
        n = index_nbytes(meta.n_inner)
        if cached is not None or size < n:
            return self.index(meta, coords), None
        try:
            got = self.read(key, 0, size)
        except (FileNotFoundError, NotADirectoryError):
            raise self.missing(key, meta.name) from None
        except NotAFileError as e:
            raise not_a_file(e, key, meta.name) from None
        view = got.view if isinstance(got, Lease) else got
        try:  # a copy of the index: the buffer is reused later
            idx = parse_index(meta, bytes(view[size - n :]), size, key)
        except BaseException:
            if isinstance(got, Lease):
                got.release()
            raise
        self.indexes[(meta.name, coords)] = idx
        return idx, got

    def _pread(self, key: str, offset: int, length: int) -> bytes:
        """A small read (an index, a small shard): one pread of a local file, no pooled buffer."""
        path = self.local_path(key)
        if path is None:
            return self.store.read_range(key, offset, length)
        fd, _ = open_regular(path, name=key)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)


def step_files(store: Store, step: int, record: CommitRecord, options: ReadOptions = DEFAULT_READ, *,
               format_version: int = metadata.FORMAT_VERSION) -> StepFiles:
    """The files of a committed step (whose document is of ``format_version``), read as ``options`` say."""
    ranges = RangeReader(direct=options.direct, direct_min_bytes=options.direct_min_bytes)
    # a segment's aligned span and the buffer's own alignment: one buffer size for every segment
    return StepFiles(store, step, record, ranges, format_version, small_shard_bytes=options.small_shard_bytes,
                     segment_buffer_bytes=options.segment_bytes + 3 * ALIGN)


# -- the errors of reading shards, one wording for every reader --------------------------------------
def missing(key: str, name: str) -> MissingShardError:
    return MissingShardError(f"shard {key} of tensor {name!r} is missing", tensor=name, file=key)


def not_a_file(e: NotAFileError, key: str, name: str) -> NotAFileError:
    return NotAFileError(f"shard {key} of tensor {name!r}: {e.message}", tensor=name, file=key)


def truncated(key: str, name: str, got: int | None = None, want: int | None = None,
              offset: int | None = None) -> ShardSizeError:
    detail = f" (read {got} of {want} bytes at offset {offset})" if got is not None else ""
    return ShardSizeError(f"{key}: the shard is truncated{detail}: tensor {name!r}", tensor=name, file=key)


def absent(key: str, chunk: object, name: str) -> CorruptShardIndexError:
    return CorruptShardIndexError(f"{key}: inner chunk {chunk} of tensor {name!r} is absent from its shard",
                                  tensor=name, file=key)


def corrupt_chunk(key: str, chunk: object, name: str) -> ChecksumError:
    return ChecksumError(f"{key}: inner chunk {chunk} of tensor {name!r} fails its crc32c", tensor=name, file=key)

