"""Reading boxes of stored arrays: only the inner chunks a box needs, checksummed, assembled in place.

A read runs in three phases over any number of (array, box, destination) requests:

1. load the index of every shard involved (on INDEX_THREADS threads: small latency-bound reads; each
   index is checked: crc32c, bounds, overlaps). A small shard that a request needs whole is read in one
   request with its index;
2. plan, per request as soon as its indexes are in: for each needed inner chunk, either read it straight
   into the destination (a whole, unpadded, uncompressed chunk whose bytes are one contiguous run there)
   or place it from a buffer; coalesce neighbouring chunks of a file into segments of at most
   SEGMENT_BYTES;
3. execute the segments on the caller's pool (so data flows while later indexes are still read): verify
   each chunk's crc32c and deliver it.

On a local filesystem, segments of at least DIRECT_MIN_BYTES whose bytes are not in the page cache
(cachestat) are read with O_DIRECT into a reused, page-aligned bounce buffer, checked there, then
copied (or placed) into their destination: the file's pages never enter the page cache, so a cold load
touches each byte of fresh memory once (the destination) instead of twice (page cache + destination),
reads exactly the bytes it needs (no readahead), and never copies unchecked bytes into the destination.
Meanwhile a side thread maps the destinations' missing pages (MADV_POPULATE_WRITE). Warm segments,
small ones, other stores and filesystems without O_DIRECT use vectored buffered reads (preadv)
straight into the destination, checked after.

Any mismatch raises a ucl IntegrityError naming the tensor and file; a read never returns zeros for
data that was written.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import math
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ucl.errors import ChecksumError, CorruptShardIndexError, MissingShardError, ShardSizeError
from ucl.format import dtypes
from ucl.format.metadata import ArrayMeta, CommitRecord
from ucl.format.repository import step_prefix
from ucl.format.shardfile import (
    EMPTY,
    _contiguous_span,
    as_bytes,
    check_chunk,
    decode_chunk,
    index_nbytes,
    parse_index,
)
from ucl.io import native as _native
from ucl.io.stores.base import Store
from ucl.io.stores.local import preadv_all

SEGMENT_BYTES = 8 << 20  # one task of the pool, and one O_DIRECT request at most
DIRECT_MIN_BYTES = 256 << 10  # smaller segments are read buffered (alignment overhead, readahead helps)
DIRECT = True  # O_DIRECT on local files for cold segments; False: always buffered
SMALL_SHARD_BYTES = 128 << 10  # a small shard read whole is read in one request with its index
INDEX_THREADS = 8  # index reads are small and latency-bound: more in flight than the data reads
_ALIGN = 4096
_CRC = struct.Struct("<I")


@dataclass
class StepFiles:
    """What a reader of one committed step needs: its store, prefix, commit record and index cache."""

    store: Store
    step: int
    record: CommitRecord
    indexes: dict[tuple[str, tuple[int, ...]], np.ndarray] = field(default_factory=dict)
    bytes_read: int = 0
    direct_ok: bool = True  # cleared when the filesystem refuses O_DIRECT
    small: dict[str, memoryview] = field(default_factory=dict)  # whole small shards read with their index
    _paths: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def prefix(self) -> str:
        return step_prefix(self.step)

    def count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def shard(self, meta: ArrayMeta, coords: tuple[int, ...]) -> tuple[str, int]:
        rel = meta.shard_key(coords)
        if rel not in self.record.files:
            raise MissingShardError(f"shard {self.prefix}/{rel} of tensor {meta.name!r} is not in the commit record "
                                    f"of step {self.step}", tensor=meta.name, file=f"{self.prefix}/{rel}")
        return f"{self.prefix}/{rel}", self.record.files[rel][0]

    def local_path(self, key: str) -> str | None:
        """The file of ``key`` on a local store (checked once per checkpoint: it must not leave the
        repository through a symlink), or None for other stores."""
        p = self._paths.get(key)
        if p is None:
            checked = getattr(self.store, "_checked", None) if self.store.is_local else None
            if checked is None:
                return None
            p = self._paths[key] = checked(key)
        return p

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        path = self.local_path(key)
        if path is None:
            return self.store.read_range(key, offset, length)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def index(self, meta: ArrayMeta, coords: tuple[int, ...], whole: bool = False) -> np.ndarray:
        """The checked index of a shard. ``whole``: the caller needs every chunk of the shard, so a small
        shard is read in one request with its index, and its bytes kept in ``small`` for the chunks."""
        cached = self.indexes.get((meta.name, coords))
        if cached is not None:
            return cached
        key, size = self.shard(meta, coords)
        n = index_nbytes(meta.n_inner)
        if size < n:
            raise ShardSizeError(f"{key}: the commit record's size {size} cannot hold the {n}-byte index",
                                 tensor=meta.name, file=key)
        try:
            if whole and size <= SMALL_SHARD_BYTES:
                data = self.read_range(key, 0, size)
                if len(data) == size:  # else: truncated, reported by the index read below
                    self.count(size)
                    idx = parse_index(meta, data[size - n :], size, key)
                    self.small[key] = memoryview(data)
                    self.indexes[(meta.name, coords)] = idx
                    return idx
            raw = self.read_range(key, size - n, n)
        except (FileNotFoundError, NotADirectoryError):
            raise MissingShardError(f"shard {key} of tensor {meta.name!r} is missing", tensor=meta.name, file=key) from None
        self.count(len(raw))
        idx = parse_index(meta, raw, size, key)
        self.indexes[(meta.name, coords)] = idx
        return idx


class _Chunk:
    """One inner chunk to read: where it lies in its shard and where its bytes go."""

    __slots__ = ("meta", "key", "coords", "offset", "nbytes", "direct", "scratch", "crc", "place")

    def __init__(self, meta: ArrayMeta, key: str, coords: tuple[int, ...], offset: int, nbytes: int,
                 direct: memoryview | None, scratch: bytearray | None = None,
                 place: Callable[[memoryview], None] | None = None) -> None:
        self.meta = meta
        self.key = key
        self.coords = coords
        self.offset = offset
        self.nbytes = nbytes  # encoded size including the 4-byte crc
        self.direct = direct  # destination bytes when read in place
        self.scratch = scratch  # allocated when first needed (an O_DIRECT read places from its bounce buffer)
        self.crc = bytearray(4)
        self.place = place  # copies decoded scratch bytes into the destination

    @property
    def target(self) -> memoryview:
        """Where the chunk's encoded bytes (without the crc) are read to."""
        if self.direct is not None:
            return self.direct
        if self.scratch is None:
            self.scratch = bytearray(self.nbytes - 4)
        return memoryview(self.scratch)


@dataclass
class Request:
    meta: ArrayMeta
    start: tuple[int, ...]
    shape: tuple[int, ...]
    out: torch.Tensor  # contiguous, shape == shape


def _shards_of(meta: ArrayMeta, start: tuple[int, ...], stop: tuple[int, ...]) -> list[tuple[int, ...]]:
    ranges = [range(a // c, -(-b // c)) for a, b, c in zip(start, stop, meta.chunk_shape, strict=True)]
    return list(itertools.product(*ranges))


@dataclass
class _Digest:
    """A shard whose every present chunk a request reads: its digest is checked once they are in."""

    meta: ArrayMeta
    key: str
    rel: str
    index: np.ndarray
    chunks: list[_Chunk]  # in index order


def _plan(files: StepFiles, req: Request, digests: list[_Digest] | None = None) -> list[_Chunk]:
    """The chunks ``req`` needs. ``digests``: where to note the shards it reads whole (full arrays only)."""
    meta, out = req.meta, req.out
    stop = tuple(a + n for a, n in zip(req.start, req.shape, strict=True))
    if any(n == 0 for n in req.shape):
        return []
    out_bytes = as_bytes(out)
    raw_codec = meta.compression is None and meta.delta is None
    # row slabs: inner chunks split only the first dimension, and the request takes whole rows. Then a
    # whole inner chunk is one contiguous run of the destination: planned in bulk (a 206 MB embedding
    # has 1733 of them), only the chunks at the edges of the request take the general path.
    rows = raw_codec and len(meta.shape) >= 1 and all(
        meta.inner_chunk_shape[d] == meta.chunk_shape[d] == meta.shape[d] and req.start[d] == 0
        and req.shape[d] == meta.shape[d] for d in range(1, len(meta.shape)))
    chunks: list[_Chunk] = []
    for shard in _shards_of(meta, req.start, stop):
        key, _ = files.shard(meta, shard)
        index = files.index(meta, shard)
        origin = [c * s for c, s in zip(shard, meta.chunk_shape, strict=True)]
        ranges = []
        for d in range(len(shard)):
            i = meta.inner_chunk_shape[d]
            lo = max(0, (req.start[d] - origin[d]) // i)
            hi = min(meta.inner_grid[d], -(-(stop[d] - origin[d]) // i))
            ranges.append(range(lo, hi))
        n0 = len(chunks)
        if rows:
            _plan_rows(files, req, stop, key, index, origin, ranges[0], out_bytes, chunks)
        elif not ranges:  # a 0-d array: one chunk
            chunks.append(_chunk(files, req, stop, key, index, origin, (), 0, out_bytes, raw_codec))
        else:
            _plan_grid(files, req, stop, key, index, origin, ranges, out_bytes, raw_codec, chunks)
        # every present chunk of the shard is read (each planned one is present, none twice)
        if (digests is not None and meta.delta is None
                and len(chunks) - n0 == int(np.count_nonzero(index[:, 0] != EMPTY))):
            digests.append(_Digest(meta, key, meta.shard_key(shard), index, chunks[n0:]))
    return chunks


def _check_digests(files: StepFiles, digests: list[_Digest]) -> None:
    """spec/core.md §8.1: the digest of a shard read whole (its chunks' crc32c's, already checked
    against their data, in index order, then its index's) must be the commit record's checksum:
    chunks whose crc32c's pass can still belong to another file (two equal-sized shards swapped)."""
    for d in digests:
        crcs = b"".join(c.crc for c in d.chunks) + _CRC.pack(_native.crc32c(d.index.tobytes()))
        got, want = _native.crc32c(crcs), files.record.files[d.rel][1]
        if got != want:
            raise ChecksumError(f"{d.key}: shard of tensor {d.meta.name!r} does not hold the chunks its "
                                f"commit record names (digest {got:08x}, recorded {want:08x})",
                                tensor=d.meta.name, file=d.key)


def _plan_grid(files: StepFiles, req: Request, stop: tuple[int, ...], key: str, index: np.ndarray,
               origin: list[int], ranges: list[range], out_bytes: memoryview, raw_codec: bool,
               chunks: list[_Chunk]) -> None:
    """The chunks of one shard that a request needs (the inner-grid box ``ranges``), in index order,
    planned in bulk: per dimension, numpy computes each inner chunk's intersection with the request;
    over the box, the ordinals, index entries and whether a chunk is read in place (a whole, unpadded,
    uncompressed chunk whose part of the destination is one contiguous run). Python builds only the
    chunk objects (and, for chunks placed from a buffer, their slices)."""
    meta = req.meta
    if any(len(r) == 0 for r in ranges):
        return
    nd = len(ranges)
    sub = tuple(len(r) for r in ranges)

    def bcast(v: np.ndarray, d: int) -> np.ndarray:  # a per-dimension vector, broadcast over the box
        return v.reshape((1,) * d + (-1,) + (1,) * (nd - d - 1))

    gstride = [math.prod(meta.inner_grid[d + 1 :]) for d in range(nd)]
    ostride = [math.prod(req.shape[d + 1 :]) for d in range(nd)]
    ordinal = np.zeros(sub, dtype=np.int64)
    whole = np.ones(sub, dtype=bool)
    first = np.zeros(sub, dtype=np.int64)  # element offset of the chunk's part in the destination
    full_out = []  # per dimension: the chunk's part spans the request's whole extent
    ext1 = []  # per dimension: the chunk's part has extent 1
    dst: list[list[slice]] = []
    src: list[list[slice]] = []
    for d, r in enumerate(ranges):
        i = meta.inner_chunk_shape[d]
        k = np.arange(r.start, r.stop, dtype=np.int64)
        a = origin[d] + k * i  # chunk start, array coordinates
        c = np.minimum(a + i, meta.shape[d])  # chunk stop, clipped to the array
        lo = np.maximum(a, req.start[d])
        hi = np.minimum(c, stop[d])
        rs, re_ = lo - req.start[d], hi - req.start[d]
        ordinal = ordinal + bcast(k * gstride[d], d)
        whole = whole & bcast((lo == a) & (hi == c) & (c - a == i), d)
        first = first + bcast(rs * ostride[d], d)
        full_out.append(bcast((rs == 0) & (re_ == req.shape[d]), d))
        ext1.append(bcast(re_ - rs == 1, d))
        dst.append([slice(x, y) for x, y in zip(rs.tolist(), re_.tolist(), strict=True)])
        src.append([slice(x, y) for x, y in zip((lo - a).tolist(), (hi - a).tolist(), strict=True)])
    ordinal = ordinal.ravel()
    offs = index[ordinal, 0]
    if np.any(offs == EMPTY):
        j = int(np.argmax(offs == EMPTY))
        ic = tuple(r[x] for r, x in zip(ranges, np.unravel_index(j, sub), strict=True))
        raise CorruptShardIndexError(f"{key}: inner chunk {list(ic)} of tensor {meta.name!r} is absent from "
                                     "its shard", tensor=meta.name, file=key)
    nbs = index[ordinal, 1]
    # one contiguous run of the destination (shard._contiguous_span): every dimension before the last
    # one the part does not span whole has extent 1
    direct = np.zeros(sub, dtype=bool)
    if raw_codec:
        contig = np.ones(sub, dtype=bool)
        suffix = np.ones(sub, dtype=bool)  # the part spans the request whole in every dimension after d
        for d in range(nd - 1, -1, -1):
            contig = contig & (ext1[d] | suffix)
            suffix = suffix & full_out[d]
        direct = whole & contig
    item = meta.itemsize
    n = meta.inner_nbytes
    place = _placers(meta, req.out, files, key)
    coords = itertools.product(*ranges)
    if direct.all():
        for ic, off, nb, f in zip(coords, offs.tolist(), nbs.tolist(), (first.ravel() * item).tolist(),
                                  strict=True):
            chunks.append(_Chunk(meta, key, ic, off, nb, out_bytes[f : f + n]))
        return
    for ic, dsl, ssl, off, nb, dr, f in zip(coords, itertools.product(*dst), itertools.product(*src),
                                            offs.tolist(), nbs.tolist(), direct.ravel().tolist(),
                                            (first.ravel() * item).tolist(), strict=True):
        if dr:
            chunks.append(_Chunk(meta, key, ic, off, nb, out_bytes[f : f + n]))
        else:
            chunks.append(_Chunk(meta, key, ic, off, nb, None, place=place(dsl, ssl, ic)))


def _plan_rows(files: StepFiles, req: Request, stop: tuple[int, ...], key: str, index: np.ndarray,
               origin: list[int], ks: range, out_bytes: memoryview, chunks: list[_Chunk]) -> None:
    """The chunks ``ks`` of a row-slab shard (see ``_plan``): ordinals are the row-chunk numbers."""
    meta = req.meta
    i0 = meta.inner_chunk_shape[0]
    run = math.prod(meta.shape[1:]) * meta.itemsize  # bytes per row
    offs = index[ks.start : ks.stop, 0]
    if np.any(offs == EMPTY):
        k = ks.start + int(np.argmax(offs == EMPTY))  # _chunk raises, naming it
        _chunk(files, req, stop, key, index, origin, (k,) + (0,) * (len(origin) - 1), k, out_bytes, True)
    rest = (0,) * (len(origin) - 1)
    a0, b0, n0 = req.start[0], stop[0], meta.shape[0]
    for k, off, nb in zip(ks, offs.tolist(), index[ks.start : ks.stop, 1].tolist(), strict=True):
        a = origin[0] + k * i0
        b = a + i0
        if a >= a0 and b <= b0 and b <= n0:
            d = (a - a0) * run
            chunks.append(_Chunk(meta, key, (k, *rest), off, nb, out_bytes[d : d + i0 * run]))
        else:
            chunks.append(_chunk(files, req, stop, key, index, origin, (k, *rest), k, out_bytes, True))


def _chunk(files: StepFiles, req: Request, stop: tuple[int, ...], key: str, index: np.ndarray,
           origin: list[int], ic: tuple[int, ...], ordinal: int, out_bytes: memoryview,
           raw_codec: bool) -> _Chunk:
    """One inner chunk of a request: read in place when its part of the request is the whole chunk and
    one contiguous run of the destination, else placed from a buffer."""
    meta = req.meta
    off, nb = (int(x) for x in index[ordinal])
    c_start = [o + c * i for o, c, i in zip(origin, ic, meta.inner_chunk_shape, strict=True)]
    c_stop = [min(a + i, s) for a, i, s in zip(c_start, meta.inner_chunk_shape, meta.shape, strict=True)]
    if off == EMPTY:
        raise CorruptShardIndexError(f"{key}: inner chunk {list(ic)} of tensor {meta.name!r} is absent from "
                                     "its shard", tensor=meta.name, file=key)
    # intersection with the request, in array coordinates
    lo_ = [max(a, b) for a, b in zip(c_start, req.start, strict=True)]
    hi_ = [min(a, b) for a, b in zip(c_stop, stop, strict=True)]
    region = [slice(a - s, b - s) for a, b, s in zip(lo_, hi_, req.start, strict=True)]
    whole = lo_ == c_start and hi_ == c_stop and all(
        b - a == i for a, b, i in zip(c_start, c_stop, meta.inner_chunk_shape, strict=True))
    span = _contiguous_span(tuple(req.shape), region) if whole and raw_codec else None
    if span is not None:
        return _Chunk(meta, key, ic, off, nb, out_bytes[span[0] * meta.itemsize : span[1] * meta.itemsize])
    src = tuple(slice(a - c, b - c) for a, b, c in zip(lo_, hi_, c_start, strict=True))
    place = _placer(meta, req.out, tuple(region), src, files, key, ic)
    return _Chunk(meta, key, ic, off, nb, None, place=place)


def _placer(meta: ArrayMeta, out: torch.Tensor, dst: tuple[slice, ...], src: tuple[slice, ...],
            files: StepFiles, key: str, ic: tuple[int, ...]) -> Callable[[memoryview], None]:
    return _placers(meta, out, files, key)(dst, src, ic)


_Place = Callable[[memoryview], None]


def _placers(meta: ArrayMeta, out: torch.Tensor, files: StepFiles,
             key: str) -> Callable[[tuple[slice, ...], tuple[slice, ...], tuple[int, ...]], _Place]:
    """A factory of placers for the chunks of one shard: each decodes a checked chunk and copies its
    part ``src`` to ``out[dst]``."""
    is_bool = meta.dtype == "bool"
    tdtype = torch.uint8 if is_bool else dtypes.to_torch(meta.dtype)
    shape = meta.inner_chunk_shape

    def make(dst: tuple[slice, ...], src: tuple[slice, ...], ic: tuple[int, ...]) -> _Place:
        def place(encoded: memoryview) -> None:
            raw = decode_chunk(meta, encoded, key, ic)
            arr = np.frombuffer(raw, dtype=np.uint8)
            t = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr).view(tdtype)
            t = t.reshape(shape) if shape else t.reshape(())
            if is_bool:
                t = t.view(torch.bool)
            out[dst] = t[src]

        return place

    return make


def _segments(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    """Group chunks of the same file whose bytes are adjacent, up to SEGMENT_BYTES per group."""
    chunks = sorted(chunks, key=lambda c: (c.key, c.offset))
    groups: list[list[_Chunk]] = []
    size = 0
    for c in chunks:
        g = groups[-1] if groups else None
        adjacent = g is not None and g[-1].key == c.key and g[-1].offset + g[-1].nbytes == c.offset
        if g and adjacent and size + c.nbytes <= SEGMENT_BYTES:
            g.append(c)
            size += c.nbytes
        else:
            groups.append([c])
            size = c.nbytes
    return groups


def _execute(files: StepFiles, group: list[_Chunk]) -> int:
    want = sum(c.nbytes for c in group)
    raw = files.small.get(group[0].key)
    if raw is not None:  # read with its index (and counted there)
        _from_memory(group, raw, 0)
        return 0
    if DIRECT and files.direct_ok and want >= DIRECT_MIN_BYTES and files.store.is_local:
        got = _execute_direct(files, group, want)
        if got is not None:
            return got
    return _execute_buffered(files, group, want)


def _execute_buffered(files: StepFiles, group: list[_Chunk], want: int) -> int:
    bufs: list[memoryview] = []
    for c in group:
        bufs.append(c.target)
        bufs.append(memoryview(c.crc))
    try:
        path = files.local_path(group[0].key)
        if path is None:
            got = files.store.readinto(group[0].key, group[0].offset, bufs)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                got = preadv_all(fd, bufs, group[0].offset)
            finally:
                os.close(fd)
    except (FileNotFoundError, NotADirectoryError):
        raise _missing(group[0]) from None
    if got != want:
        raise _truncated(group[0], got, want)
    for c in group:
        data = c.target
        check_chunk(c.meta, data, _CRC.unpack(c.crc)[0], c.key, c.coords)
        if c.place is not None:
            c.place(data)
    return want


def _missing(c: _Chunk) -> MissingShardError:
    return MissingShardError(f"shard {c.key} of tensor {c.meta.name!r} is missing", tensor=c.meta.name,
                             file=c.key)


def _truncated(c: _Chunk, got: int, want: int) -> ShardSizeError:
    return ShardSizeError(f"{c.key}: read {got} of {want} bytes at offset {c.offset}: the shard is truncated",
                          tensor=c.meta.name, file=c.key)


# -- O_DIRECT ----------------------------------------------------------------------------------------
def _execute_direct(files: StepFiles, group: list[_Chunk], want: int) -> int | None:
    """Read a group with O_DIRECT through a bounce buffer; None when it should be read buffered instead
    (its pages are mostly cached already, or the filesystem refuses O_DIRECT)."""
    c0 = group[0]
    start, end = c0.offset, c0.offset + want
    path = files.local_path(c0.key)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise _missing(c0) from None
    except OSError as e:
        if e.errno == errno.EINVAL:  # no O_DIRECT on this filesystem (tmpfs, some FUSE)
            files.direct_ok = False
            return None
        raise
    try:
        if _mostly_cached(fd, start, want):
            return None
        buf = _bounce_get()
        try:
            if want + 2 * _ALIGN <= buf.size:
                _whole(fd, group, start, end, buf)
                return want
            crcs = _stream(fd, group, start, end, buf)
        finally:
            _bounce_put(buf)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        files.direct_ok = False  # a device that wants more alignment than 4 KiB: read it all buffered
        return None
    finally:
        os.close(fd)
    for c, crc in zip(group, crcs, strict=True):
        _check(c, crc, _CRC.unpack(c.crc)[0])
        if c.place is not None:
            c.place(c.target)
    return want


def _check(c: _Chunk, computed: int, stored: int) -> None:
    if computed != stored:  # the message of shard.check_chunk
        raise ChecksumError(f"{c.key}: inner chunk {list(c.coords)} of tensor {c.meta.name!r} fails its "
                            "crc32c", tensor=c.meta.name, file=c.key)


def _whole(fd: int, group: list[_Chunk], start: int, end: int, buf: _Bounce) -> None:
    """Read a group that fits the bounce buffer in one request; check each chunk there, then copy it
    to its destination or place it from there (no scratch buffer)."""
    mv = buf.mv
    base = start - start % _ALIGN
    got = _pread_direct(fd, mv[: -(-(end - base) // _ALIGN) * _ALIGN], base)
    if base + got < end:
        raise _truncated(group[0], max(0, base + got - start), end - start)
    _from_memory(group, mv, base)


def _from_memory(group: list[_Chunk], mv: memoryview, base: int) -> None:
    """Check and deliver chunks whose encoded bytes (and crcs) are in ``mv``, which holds the shard's
    bytes from file offset ``base``."""
    for c in group:
        o = c.offset - base
        data = mv[o : o + c.nbytes - 4]
        c.crc[:] = mv[o + c.nbytes - 4 : o + c.nbytes]
        _check(c, _native.crc32c(data), _CRC.unpack(c.crc)[0])
        if c.direct is not None:
            _copy(c.direct, data)
        else:
            c.place(data)  # type: ignore[misc]


def _stream(fd: int, group: list[_Chunk], start: int, end: int, buf: _Bounce) -> list[int]:
    """Read file bytes [start, end) in aligned windows of the bounce buffer, copying each chunk's data
    to its target and its crc to ``c.crc``; returns the crc32c computed over each chunk's data."""
    mv = buf.mv
    crcs = [0] * len(group)
    first = 0  # first chunk not yet complete
    pos = start - start % _ALIGN
    while pos < end:
        n = min(buf.size, -(-(end - pos) // _ALIGN) * _ALIGN)
        got = _pread_direct(fd, mv[:n], pos)
        lo, hi = max(pos, start), min(pos + got, end)
        j = first
        while j < len(group):
            c = group[j]
            if c.offset >= hi:
                break
            c_end = c.offset + c.nbytes
            d_end = c_end - 4
            a, b = max(lo, c.offset), min(hi, d_end)
            if b > a:
                src = mv[a - pos : b - pos]
                crcs[j] = _native.crc32c(src, crcs[j])
                _copy(c.target[a - c.offset : b - c.offset], src)
            a, b = max(lo, d_end), min(hi, c_end)
            if b > a:
                c.crc[a - d_end : b - d_end] = mv[a - pos : b - pos]
            if c_end <= hi:
                first = j + 1
            j += 1
        if hi < min(pos + n, end):
            c = group[first]
            raise _truncated(c, hi - start, end - start)
        pos += n
    return crcs


def _pread_direct(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset`` (both aligned); fewer bytes only at the end of the file."""
    got = 0
    while got < buf.nbytes:
        n = os.preadv(fd, [buf[got:]], offset + got)
        got += n
        if n == 0 or n % _ALIGN:  # end of file (an unaligned count can only come from there)
            break
    return got


def _copy(dst: memoryview, src: memoryview) -> None:
    if src.nbytes >= 1 << 16:  # numpy copies with the GIL released
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


class _Bounce:
    """A reusable O_DIRECT buffer: private anonymous memory, 2 MiB-aligned and backed by huge pages
    where the kernel allows. Physically contiguous memory lets the block layer build large requests:
    on this project's virtual disks, 4 MiB requests read ~1.7x faster than the ~0.5 MiB ones that
    scattered 4 KiB pages (or shared memory) give."""

    HUGE = 2 << 20

    def __init__(self, size: int) -> None:
        self.size = size
        self.mm = mmap.mmap(-1, size + self.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(self.mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self.mm.madvise(mmap.MADV_HUGEPAGE)
        addr = np.frombuffer(self.mm, dtype=np.uint8).ctypes.data
        skip = -addr % self.HUGE
        self.mv = memoryview(self.mm)[skip : skip + size]

    def close(self) -> None:
        self.mv.release()
        with contextlib.suppress(BufferError):  # a view still alive (a traceback's): the collector unmaps it
            self.mm.close()


_BOUNCE_LOCK = threading.Lock()
_BOUNCE_FREE: list[_Bounce] = []
_BOUNCE_KEEP = 8


def _bounce_get() -> _Bounce:
    """A buffer for one segment (SEGMENT_BYTES plus alignment), reused across reads: warm memory,
    since touching fresh pages costs more than the copy out of it."""
    size = SEGMENT_BYTES + 2 * _ALIGN
    with _BOUNCE_LOCK:
        while _BOUNCE_FREE:
            b = _BOUNCE_FREE.pop()
            if b.size == size:
                return b
            b.close()
    return _Bounce(size)


def _bounce_put(b: _Bounce) -> None:
    with _BOUNCE_LOCK:
        if len(_BOUNCE_FREE) < _BOUNCE_KEEP:
            _BOUNCE_FREE.append(b)
            return
    b.close()


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                                "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # Linux >= 6.5, same number on every architecture
_cachestat: Any = None  # the libc syscall function; False when unavailable


def _mostly_cached(fd: int, offset: int, length: int) -> bool:
    """True when at least half of the pages of [offset, offset+length) are in the page cache (then a
    buffered read is faster than going to the device); False when not, or when the kernel cannot say."""
    global _cachestat
    if _cachestat is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _cachestat = libc.syscall
            _cachestat.restype = ctypes.c_long
        except (OSError, AttributeError):
            _cachestat = False
    if _cachestat is False:
        return False
    rng = _CacheStatRange(offset, length)
    st = _CacheStat()
    if _cachestat(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(st),
                  ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _cachestat = False
        return False
    return st.nr_cache * mmap.PAGESIZE * 2 >= length


def read(files: StepFiles, requests: Iterable[Request], pool: Executor | None = None) -> None:
    """Fill every request's ``out`` from the step (the three phases in the module docstring)."""
    requests = list(requests)
    pre = _Prefaulter.start_for(requests) if pool is not None and files.store.is_local else None
    try:
        _read(files, requests, pool)
    finally:
        if pre is not None:
            pre.stop()


def _read(files: StepFiles, requests: list[Request], pool: Executor | None) -> None:
    live = []
    for r in requests:
        if all(r.shape):
            stop = tuple(a + n for a, n in zip(r.start, r.shape, strict=True))
            shards = _shards_of(r.meta, r.start, stop)
            live.append((r, [(s, _covers(r.meta, s, r.start, stop)) for s in shards]))
    try:
        if pool is None:
            for r, shards in live:
                for s, whole in shards:
                    files.index(r.meta, s, whole)
                digests: list[_Digest] = []
                for g in _segments(_plan(files, r, digests)):
                    files.count(_execute(files, g))
                _check_digests(files, digests)
            return
        # indexes on their own threads; each request's data is read as soon as its indexes are in
        todo = {}
        for r, shards in live:
            for s, whole in shards:
                if (r.meta.name, s) not in files.indexes and (r.meta.name, s) not in todo:
                    todo[(r.meta.name, s)] = (r.meta, s, whole)
        ipool = ThreadPoolExecutor(min(INDEX_THREADS, len(todo)), "ucl-index") if len(todo) > 1 else None
        ifut = {k: ipool.submit(files.index, *v) for k, v in todo.items()} if ipool is not None else {}
        dfut: list[Future[int]] = []
        digests = []
        try:
            for r, shards in live:
                for s, whole in shards:
                    f = ifut.get((r.meta.name, s))
                    if f is not None:
                        f.result()
                    else:
                        files.index(r.meta, s, whole)
                dfut += [pool.submit(_execute, files, g) for g in _segments(_plan(files, r, digests))]
            for f in dfut:
                files.count(f.result())
            _check_digests(files, digests)
        finally:  # on an error: nothing of this read keeps running after it returns
            for f in [*ifut.values(), *dfut]:
                f.cancel()
            wait([*ifut.values(), *dfut])
            if ipool is not None:
                ipool.shutdown(wait=False)
    finally:
        files.small.clear()


def _covers(meta: ArrayMeta, shard: tuple[int, ...], start: tuple[int, ...], stop: tuple[int, ...]) -> bool:
    """True when the box [start, stop) contains the shard's whole region (clipped to the array)."""
    for c, cs, n, a, b in zip(shard, meta.chunk_shape, meta.shape, start, stop, strict=True):
        if a > c * cs or b < min((c + 1) * cs, n):
            return False
    return True


class _Prefaulter:
    """Maps the destinations' missing pages on a side thread while the pool waits for the device.

    Fresh memory is slow to fault in on this kind of machine (a virtual machine whose free pages go
    back to the host): destinations not mapped yet (``load()``'s new tensors) are populated
    (MADV_POPULATE_WRITE), which is cheaper than faulting page by page in the copies (a medium
    ``load()``: 1.25 s instead of 2.0 s). Destinations already mapped (``load_into`` a model's tensors)
    are found with mincore and left alone. Content is never changed, so this can race with the
    readers. (MADV_HUGEPAGE on the destinations made it 3x slower: synchronous compaction.)"""

    STEP = 8 << 20
    MIN_BYTES = 8 << 20  # reads smaller than this are not worth a thread
    _libc: Any = None

    def __init__(self, steps: list[tuple[int, int]]) -> None:
        self.steps = steps
        self._halt = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ucl-prefault", daemon=True)
        self.thread.start()

    @classmethod
    def start_for(cls, requests: list[Request]) -> _Prefaulter | None:
        if cls._libc is False or sum(r.out.nbytes for r in requests) < cls.MIN_BYTES:
            return None
        libc = cls._load()
        if libc is None:
            return None
        page = mmap.PAGESIZE
        steps = []
        for r in requests:
            a, n = r.out.data_ptr(), r.out.nbytes
            lo, hi = -(-a // page) * page, (a + n) // page * page
            if hi - lo < cls.STEP:
                continue
            vec = (ctypes.c_ubyte * ((hi - lo) // page))()
            if libc.mincore(lo, hi - lo, vec) != 0:
                continue
            if 0 not in bytes(vec):
                continue  # every page mapped already
            steps += [(x, min(cls.STEP, hi - x)) for x in range(lo, hi, cls.STEP)]
        return cls(steps) if steps else None

    @classmethod
    def _load(cls) -> Any:
        if cls._libc is None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
                cls._libc = libc
            except (OSError, AttributeError):
                cls._libc = False
        return cls._libc or None

    def _run(self) -> None:
        libc = self._libc
        for a, n in self.steps:
            if self._halt.is_set():
                return
            if libc.madvise(a, n, _MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:  # kernel < 5.14
                    type(self)._libc = False
                return

    def stop(self) -> None:
        self._halt.set()
        self.thread.join()


_MADV_POPULATE_WRITE = 23


def total_elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
