"""The plan of a plain read: which inner chunks of which shards a box needs, and where each one goes.

Planned once the shards' indexes are in (:class:`ucl.read.files.StepFiles` reads them). A chunk whose
part of the destination is one contiguous run and that is whole, unpadded and uncompressed is read
straight into the destination (:attr:`ChunkRead.direct`); others are read into a scratch buffer (or
checked in the reader's pooled buffer) and placed from there, decoded (:attr:`ChunkRead.place`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ucl.errors import CorruptShardIndexError
from ucl.format import dtypes
from ucl.format.metadata import ArrayMeta
from ucl.format.shardfile import EMPTY, PAGE, as_bytes, contiguous_span, decode_chunk
from ucl.read.files import StepFiles


class ChunkRead:
    """One inner chunk to read: where it lies in its shard and where its bytes go."""

    __slots__ = ("meta", "key", "coords", "offset", "nbytes", "direct", "scratch", "crc", "place", "part", "also")

    def __init__(self, meta: ArrayMeta, key: str, coords: tuple[int, ...], offset: int, nbytes: int,
                 direct: memoryview | None, scratch: bytearray | None = None,
                 place: Callable[[memoryview], None] | None = None) -> None:
        self.meta = meta
        self.key = key
        self.coords = coords
        self.offset = offset
        self.nbytes = nbytes  # encoded size including the 4-byte crc
        self.direct = direct  # destination bytes when read in place
        self.scratch = scratch  # allocated when first needed (an O_DIRECT read places from its pooled buffer)
        self.crc = bytearray(4)
        self.place = place  # copies decoded scratch bytes into the destination
        # (lo, hi, destination): the chunk's bytes [lo, hi) are one contiguous run of the destination
        # (a raw chunk at the edge of a row slice). A buffered read then reads that run in place and the
        # rest through a small reused buffer, checksumming as it goes (read/boxes.py: _read_part), so
        # the edge chunks of a slice cost no chunk-sized buffer of fresh memory
        self.part: tuple[int, int, memoryview] | None = None
        self.also: list[ChunkRead] = []  # other requests' reads of this same chunk: delivered from this one

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


def shards_of(meta: ArrayMeta, start: tuple[int, ...], stop: tuple[int, ...]) -> list[tuple[int, ...]]:
    ranges = [range(a // c, -(-b // c)) for a, b, c in zip(start, stop, meta.chunk_shape, strict=True)]
    return list(itertools.product(*ranges))


@dataclass
class WholeShard:
    """A shard whose every present chunk a request reads: its digest is checked once they are in."""

    meta: ArrayMeta
    key: str
    rel: str
    index: np.ndarray
    chunks: list[ChunkRead]  # in index order


def plan_request(files: StepFiles, req: Request, digests: list[WholeShard] | None = None,
                 guessed: Mapping[tuple[str, tuple[int, ...]], np.ndarray] | None = None) -> list[ChunkRead]:
    """The chunks ``req`` needs. ``digests``: where to note the shards it reads whole (full arrays only).
    ``guessed``: predicted indexes of shards (by array name and coordinates), used before the cache's:
    the caller's own, confirmed by its read (ucl.read.boxes), never seen by other reads meanwhile."""
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
    chunks: list[ChunkRead] = []
    for shard in shards_of(meta, req.start, stop):
        key, _ = files.shard(meta, shard)
        index = guessed.get((meta.name, shard)) if guessed else None
        if index is None:
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
            digests.append(WholeShard(meta, key, meta.shard_key(shard), index, chunks[n0:]))
    return chunks


def _plan_grid(files: StepFiles, req: Request, stop: tuple[int, ...], key: str, index: np.ndarray,
               origin: list[int], ranges: list[range], out_bytes: memoryview, raw_codec: bool,
               chunks: list[ChunkRead]) -> None:
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
    # one contiguous run of the destination (shard.contiguous_span): every dimension before the last
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
            chunks.append(ChunkRead(meta, key, ic, off, nb, out_bytes[f : f + n]))
        return
    for ic, dsl, ssl, off, nb, dr, f in zip(coords, itertools.product(*dst), itertools.product(*src),
                                            offs.tolist(), nbs.tolist(), direct.ravel().tolist(),
                                            (first.ravel() * item).tolist(), strict=True):
        if dr:
            chunks.append(ChunkRead(meta, key, ic, off, nb, out_bytes[f : f + n]))
        else:
            chunks.append(ChunkRead(meta, key, ic, off, nb, None, place=place(dsl, ssl, ic)))


def _plan_rows(files: StepFiles, req: Request, stop: tuple[int, ...], key: str, index: np.ndarray,
               origin: list[int], ks: range, out_bytes: memoryview, chunks: list[ChunkRead]) -> None:
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
            chunks.append(ChunkRead(meta, key, (k, *rest), off, nb, out_bytes[d : d + i0 * run]))
        else:
            c = _chunk(files, req, stop, key, index, origin, (k, *rest), k, out_bytes, True)
            lo, hi = max(a, a0), min(b, b0, n0)
            if c.direct is None and nb == meta.inner_nbytes + 4:
                d = (lo - a0) * run
                c.part = ((lo - a) * run, (hi - a) * run, out_bytes[d : d + (hi - lo) * run])
            chunks.append(c)


def _chunk(files: StepFiles, req: Request, stop: tuple[int, ...], key: str, index: np.ndarray,
           origin: list[int], ic: tuple[int, ...], ordinal: int, out_bytes: memoryview,
           raw_codec: bool) -> ChunkRead:
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
    span = contiguous_span(tuple(req.shape), region) if whole and raw_codec else None
    if span is not None:
        return ChunkRead(meta, key, ic, off, nb, out_bytes[span[0] * meta.itemsize : span[1] * meta.itemsize])
    src = tuple(slice(a - c, b - c) for a, b, c in zip(lo_, hi_, c_start, strict=True))
    place = _placer(meta, req.out, tuple(region), src, files, key, ic)
    return ChunkRead(meta, key, ic, off, nb, None, place=place)


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


#: a read goes on through fewer bytes than this between two chunks of a file rather than split in two:
#: the padding of the page-aligned layout (spec/core.md §6.1, at most a page less 4 bytes after a chunk
#: of 1 MiB or more) costs less than a request, and the bytes between are never delivered
GAP = PAGE


def follows(end: int, offset: int) -> bool:
    """Whether bytes at ``offset`` are read with a range ending at ``end`` (at most :data:`GAP` after)."""
    return 0 <= offset - end < GAP


def near(prev: ChunkRead, c: ChunkRead) -> bool:
    """Whether ``c`` follows ``prev`` in the same file close enough to be read with it."""
    return prev.key == c.key and follows(prev.offset + prev.nbytes, c.offset)


def segments(chunks: list[ChunkRead], max_bytes: int) -> list[list[ChunkRead]]:
    """Group chunks of the same file whose bytes follow each other (at most :data:`GAP` bytes apart), up
    to ``max_bytes`` per group, the bytes between included (a chunk read in part,
    :attr:`ChunkRead.part`, is a group of its own). A group is read as one range: from its first chunk's
    offset to its last chunk's end."""
    chunks = sorted(chunks, key=lambda c: (c.key, c.offset))
    groups: list[list[ChunkRead]] = []
    for c in chunks:
        g = groups[-1] if groups else None
        if (g and near(g[-1], c) and c.offset + c.nbytes - g[0].offset <= max_bytes and c.part is None
                and g[-1].part is None):
            g.append(c)
        else:
            groups.append([c])
    return groups


def covers(meta: ArrayMeta, shard: tuple[int, ...], start: tuple[int, ...], stop: tuple[int, ...]) -> bool:
    """True when the box [start, stop) contains the shard's whole region (clipped to the array)."""
    for c, cs, n, a, b in zip(shard, meta.chunk_shape, meta.shape, start, stop, strict=True):
        if a > c * cs or b < min((c + 1) * cs, n):
            return False
    return True
