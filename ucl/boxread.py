"""Reading boxes of stored arrays: only the inner chunks a box needs, checksummed, assembled in place.

A read runs in three phases over any number of (array, box, destination) requests:

1. load the index of every shard involved (concurrently; each is checked: crc32c, bounds, overlaps);
2. plan: for each needed inner chunk, either read it straight into the destination (a whole, unpadded,
   uncompressed chunk whose bytes are one contiguous run there) or into a scratch buffer; coalesce
   neighbouring chunks of a file into one vectored read (preadv) of at most SEGMENT_BYTES;
3. execute the segments concurrently, then verify each chunk's crc32c and copy scratch chunks.

Any mismatch raises a ucl IntegrityError naming the tensor and file; a read never returns zeros for
data that was written.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ucl import dtypes
from ucl.errors import CorruptShardIndexError, MissingShardError, ShardSizeError
from ucl.metadata import ArrayMeta, CommitRecord
from ucl.repo import step_prefix
from ucl.shard import EMPTY, _contiguous_span, as_bytes, check_chunk, decode_chunk, index_nbytes, parse_index
from ucl.storage import Store

SEGMENT_BYTES = 32 << 20
_CRC = struct.Struct("<I")


@dataclass
class StepFiles:
    """What a reader of one committed step needs: its store, prefix, commit record and index cache."""

    store: Store
    step: int
    record: CommitRecord
    indexes: dict[tuple[str, tuple[int, ...]], np.ndarray] = field(default_factory=dict)
    bytes_read: int = 0

    @property
    def prefix(self) -> str:
        return step_prefix(self.step)

    def shard(self, meta: ArrayMeta, coords: tuple[int, ...]) -> tuple[str, int]:
        rel = meta.shard_key(coords)
        if rel not in self.record.files:
            raise MissingShardError(f"shard {self.prefix}/{rel} of tensor {meta.name!r} is not in the commit record "
                                    f"of step {self.step}", tensor=meta.name, file=f"{self.prefix}/{rel}")
        return f"{self.prefix}/{rel}", self.record.files[rel][0]

    def index(self, meta: ArrayMeta, coords: tuple[int, ...]) -> np.ndarray:
        cached = self.indexes.get((meta.name, coords))
        if cached is not None:
            return cached
        key, size = self.shard(meta, coords)
        n = index_nbytes(meta.n_inner)
        if size < n:
            raise ShardSizeError(f"{key}: the commit record's size {size} cannot hold the {n}-byte index",
                                 tensor=meta.name, file=key)
        try:
            raw = self.store.read_range(key, size - n, n)
        except (FileNotFoundError, NotADirectoryError):
            raise MissingShardError(f"shard {key} of tensor {meta.name!r} is missing", tensor=meta.name, file=key) from None
        self.bytes_read += len(raw)
        idx = parse_index(meta, raw, size, key)
        self.indexes[(meta.name, coords)] = idx
        return idx


@dataclass
class _Chunk:
    meta: ArrayMeta
    key: str
    coords: tuple[int, ...]
    offset: int
    nbytes: int  # encoded size including the 4-byte crc
    direct: memoryview | None  # destination bytes when read in place
    scratch: bytearray | None = None
    crc: bytearray = field(default_factory=lambda: bytearray(4))
    place: Callable[[memoryview], None] | None = None  # copies decoded scratch bytes into the destination


@dataclass
class Request:
    meta: ArrayMeta
    start: tuple[int, ...]
    shape: tuple[int, ...]
    out: torch.Tensor  # contiguous, shape == shape


def _shards_of(meta: ArrayMeta, start: tuple[int, ...], stop: tuple[int, ...]) -> list[tuple[int, ...]]:
    import itertools

    ranges = [range(a // c, -(-b // c)) for a, b, c in zip(start, stop, meta.chunk_shape, strict=True)]
    return list(itertools.product(*ranges))


def _plan(files: StepFiles, req: Request) -> list[_Chunk]:
    import itertools

    meta, out = req.meta, req.out
    stop = tuple(a + n for a, n in zip(req.start, req.shape, strict=True))
    if any(n == 0 for n in req.shape):
        return []
    out_bytes = as_bytes(out)
    itemsize = meta.itemsize
    raw_codec = meta.compression is None and meta.delta is None
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
        for ic in itertools.product(*ranges):
            ordinal = int(np.ravel_multi_index(ic, meta.inner_grid)) if ic else 0
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
                chunks.append(_Chunk(meta, key, ic, off, nb, out_bytes[span[0] * itemsize : span[1] * itemsize]))
            else:
                src = tuple(slice(a - c, b - c) for a, b, c in zip(lo_, hi_, c_start, strict=True))
                chunks.append(_Chunk(meta, key, ic, off, nb, None, bytearray(nb - 4),
                                     place=_placer(meta, out, tuple(region), src, files, key, ic)))
    return chunks


def _placer(meta: ArrayMeta, out: torch.Tensor, dst: tuple[slice, ...], src: tuple[slice, ...],
            files: StepFiles, key: str, ic: tuple[int, ...]) -> Callable[[memoryview], None]:
    def place(encoded: memoryview) -> None:
        raw = decode_chunk(meta, encoded, key, ic)
        arr = np.frombuffer(raw, dtype=np.uint8)
        t = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
        t = t.view(dtypes.to_torch(meta.dtype) if meta.dtype != "bool" else torch.uint8)
        t = t.reshape(meta.inner_chunk_shape) if meta.inner_chunk_shape else t.reshape(())
        if meta.dtype == "bool":
            t = t.view(torch.bool)
        out[dst] = t[src]

    return place


def _segments(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    """Group chunks of the same file whose bytes are adjacent, up to SEGMENT_BYTES per group."""
    chunks = sorted(chunks, key=lambda c: (c.key, c.offset))
    groups: list[list[_Chunk]] = []
    for c in chunks:
        g = groups[-1] if groups else None
        if g and g[-1].key == c.key and g[-1].offset + g[-1].nbytes == c.offset and \
                sum(x.nbytes for x in g) + c.nbytes <= SEGMENT_BYTES:
            g.append(c)
        else:
            groups.append([c])
    return groups


def _execute(files: StepFiles, group: list[_Chunk]) -> int:
    bufs: list[memoryview] = []
    for c in group:
        bufs.append(c.direct if c.direct is not None else memoryview(c.scratch))  # type: ignore[arg-type]
        bufs.append(memoryview(c.crc))
    want = sum(c.nbytes for c in group)
    try:
        got = files.store.readinto(group[0].key, group[0].offset, bufs)
    except (FileNotFoundError, NotADirectoryError):
        c = group[0]
        raise MissingShardError(f"shard {c.key} of tensor {c.meta.name!r} is missing", tensor=c.meta.name, file=c.key) from None
    if got != want:
        c = group[0]
        raise ShardSizeError(f"{c.key}: read {got} of {want} bytes at offset {c.offset}: the shard is truncated",
                             tensor=c.meta.name, file=c.key)
    for c in group:
        data = c.direct if c.direct is not None else memoryview(c.scratch)  # type: ignore[arg-type]
        check_chunk(c.meta, data, _CRC.unpack(c.crc)[0], c.key, c.coords)
        if c.place is not None:
            c.place(data)
    return want


def read(files: StepFiles, requests: Iterable[Request], pool: Executor | None = None) -> None:
    """Fill every request's ``out`` from the step (the three phases in the module docstring)."""
    requests = list(requests)
    # phase 1: shard indexes, concurrently
    need = {(r.meta.name, s): (r.meta, s) for r in requests
            for s in _shards_of(r.meta, r.start, tuple(a + n for a, n in zip(r.start, r.shape, strict=True)))
            if all(r.shape)}
    todo = [v for k, v in need.items() if k not in files.indexes]
    _run(pool, [lambda m=m, s=s: files.index(m, s) for m, s in todo])
    # phase 2: plan
    chunks: list[_Chunk] = []
    for r in requests:
        chunks.extend(_plan(files, r))
    # phase 3: read, verify, place
    sizes = _run(pool, [lambda g=g: _execute(files, g) for g in _segments(chunks)])
    files.bytes_read += sum(sizes)


def _run(pool: Executor | None, tasks: list[Callable[[], Any]]) -> list[Any]:
    if pool is None or len(tasks) <= 1:
        return [t() for t in tasks]
    return list(pool.map(lambda t: t(), tasks))


def total_elements(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
