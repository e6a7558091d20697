"""The sharding_indexed codec as UCL uses it (spec/core.md §6): one shard file per writer's block.

A shard is its inner chunks in C order of the inner grid, each encoded by the inner codecs and followed
by its crc32c, then the index: per inner chunk (offset, nbytes) as little-endian uint64, 2^64-1 twice for
an absent chunk, followed by the index's crc32c. Pure functions: bytes in, bytes out.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ucl.errors import ChecksumError, CorruptShardIndexError, IntegrityError, ShardSizeError
from ucl.format.metadata import ArrayMeta
from ucl.io import native as _native

EMPTY = (1 << 64) - 1
INNER_CHUNK_BYTES = 4 << 20  # the default target (ucl.options.WriteOptions.inner_chunk_bytes)
_CRC = struct.Struct("<I")


def index_nbytes(n_inner: int) -> int:
    return 16 * n_inner + 4


def choose_inner_chunk(block: tuple[int, ...], itemsize: int, target: int | None = None) -> tuple[int, ...]:
    """Largest inner chunk <= ``target`` bytes that divides ``block``, splitting leading dimensions first.

    Each inner chunk is one contiguous run of the block, but for a dimension with no divisor near the
    target it can be tiny (3 rows of a [32001, 4096] tensor): writers use :func:`choose_chunks`. Kept for
    chunkings that must be contiguous runs of their block (the zarr_store adapter's views).
    """
    return _leading_divisors(tuple(max(1, b) for b in block), itemsize,
                             INNER_CHUNK_BYTES if target is None else target)


def choose_chunks(shape: tuple[int, ...], block: tuple[int, ...], itemsize: int, target: int | None = None,
                  free: Iterable[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(grid chunk shape, inner chunk shape) for a writer's ``block`` of an array of ``shape``
    (spec/core.md §6): inner chunks of INNER_LO..INNER_HI times ``target`` bytes (1-8 MiB by default)
    whenever the block is that large, for any shape.

    ``free``: the dimensions along which the writer may round the grid chunk up to a multiple of the
    inner chunk, past the array's end (default: those the block holds whole, ``block[d] >= shape[d]``);
    the grid chunk of every other dimension stays ``block[d]``, which the inner chunk then divides. In
    order of preference:

    1. the inner chunk the divisors of the block give, splitting leading dimensions only (one
       contiguous run of the writer's tensor, no copies), when it is within the range or the whole block
       (all shapes whose dimensions have divisors near the target: nothing changes for them);
    2. one split dimension ``p`` (the first whose trailing dimensions fit the target), the dimensions
       before it 1 and after it whole: still one contiguous run; along a free ``p`` any size, the grid
       chunk rounded up to ``m`` equal inner chunks (the padding, in the last one, is under ``m`` rows);
    3. a second split dimension ``q > p``, which costs a gather copy of each inner chunk on write and read
       (a writer's block of ``ceil(n/k)`` rows without a divisor near the target);
    4. out of range, as close to it as the divisors allow (a prime block along every dimension).
    """
    target = INNER_CHUNK_BYTES if target is None else target
    block = tuple(max(1, b) for b in block)
    shape = tuple(shape)
    nd = len(block)
    if nd == 0:
        return (), ()
    ext = tuple(max(1, min(s, b)) for s, b in zip(shape, block, strict=True))  # the data along each dim
    free_ = {d for d in range(nd) if block[d] >= shape[d]} if free is None else set(free)
    old = _leading_divisors(block, itemsize, target)
    lo, hi = max(1, int(target * INNER_LO)), int(target * INNER_HI)
    if old == block or lo <= math.prod(old) * itemsize <= hi:
        return _in_pages(block, ext, old, itemsize, target, lo, hi, free_) or (block, old)
    best = _search(block, ext, itemsize, target, lo, hi, free_)
    inner = best if best is not None else old
    paged = _in_pages(block, ext, inner, itemsize, target, lo, hi, free_)
    if paged is not None:
        return paged
    chunk = tuple(-(-e // i) * i if d in free_ and b % i else b
                  for d, (e, b, i) in enumerate(zip(ext, block, inner, strict=True)))
    return chunk, inner


def _in_pages(block: tuple[int, ...], ext: tuple[int, ...], inner: tuple[int, ...], itemsize: int, target: int,
              lo: int, hi: int, free: set[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The choice ``inner`` in whole pages when it is not (several inner chunks of a number of bytes that is
    not a multiple of :data:`PAGE`, split along one free dimension ``p``): ``inner[p]`` rounded to a
    multiple of the rows that make whole pages, the grid chunk rounded up to a multiple of it, for the
    least padding (at most 1/256 of the dimension) within the range and large enough to be laid out at
    page offsets (:data:`ALIGNED_MIN_BYTES`: a smaller one would be padded for nothing); None to keep
    ``inner``. GPT-2's
    ``[50257, 768]`` float32: 1733 rows (5,323,776 bytes) become 1676 (30 chunks of 5,148,672 bytes, 23
    rows of padding), so that a row slice can be mapped instead of copied (:func:`aligned`)."""
    nbytes = math.prod(inner) * itemsize
    if nbytes % PAGE == 0 or inner == block:
        return None
    p = next(d for d in range(len(inner)) if inner[d] != block[d])
    if p not in free or any(x != 1 for x in inner[:p]) or inner[p + 1 :] != block[p + 1 :]:
        return None
    rest = math.prod(block[p + 1 :]) * itemsize
    step = PAGE // math.gcd(PAGE, rest)  # rows per whole number of pages
    n = ext[p]
    best: tuple[tuple[int, float], int] | None = None
    m0 = max(1, round(n / inner[p]))
    for m in range(max(1, m0 - 4), m0 + 5):
        rows = -(-n // m)  # m equal pieces, then rounded up to whole pages
        x = -(-rows // step) * step
        if not max(lo, ALIGNED_MIN_BYTES) <= x * rest <= hi or x >= n:
            continue
        pad = -(-n // x) * x - n
        key = (pad, abs(math.log2(x * rest / target)))
        if pad * 256 <= n and (best is None or key < best[0]):
            best = (key, x)
    if best is None:
        return None
    x = best[1]
    chunk = (*block[:p], -(-n // x) * x, *block[p + 1 :])
    return chunk, (*inner[:p], x, *inner[p + 1 :])


#: inner chunks within [INNER_LO, INNER_HI] times the target are good (1-8 MiB for the default 4 MiB)
INNER_LO, INNER_HI = 0.25, 2.0
_HEAVY_PAD = 1 / 16  # padding above this fraction of the block ranks below every other choice in range


def _leading_divisors(block: tuple[int, ...], itemsize: int, target: int) -> tuple[int, ...]:
    """Largest inner chunk <= ``target`` bytes that divides ``block``, splitting leading dimensions first
    (ucl <= 1.1's only choice; still :func:`choose_chunks`' first)."""
    inner = list(block)
    for d in range(len(inner)):
        rest = math.prod(inner[d + 1 :]) * itemsize
        if math.prod(inner) * itemsize <= target:
            break
        best = 1
        for k in _divisors(block[d]):
            if k * rest <= target:
                best = max(best, k)
        inner[d] = best
    return tuple(max(1, x) for x in inner)


def _search(block: tuple[int, ...], ext: tuple[int, ...], itemsize: int, target: int, lo: int, hi: int,
            free: set[int]) -> tuple[int, ...] | None:
    """The best inner chunk of the families 2-4 of :func:`choose_chunks` (None: none within limits)."""
    nd = len(block)
    rest = [math.prod(block[d + 1 :]) * itemsize for d in range(nd)]
    p = next((d for d in range(nd) if rest[d] <= target), nd - 1)
    total = math.prod(ext) * itemsize
    best: tuple[tuple[float, ...], tuple[int, ...]] | None = None

    def sizes(d: int, want: float) -> set[int]:
        """Candidate inner sizes along ``d`` near ``want`` elements: the divisors of the block just below
        and above it; along a free dimension also ``ceil(ext/m)`` for the piece counts m around it."""
        j = bisect.bisect_left(divs[d], want)
        out = set(divs[d][max(0, j - 1) : j + 1])
        if d in free and want < ext[d]:
            m0 = max(1, round(ext[d] / max(want, 1)))
            out.update(-(-ext[d] // m) for m in range(max(1, m0 - 3), m0 + 4))
        return {x for x in out if 1 <= x <= block[d]}

    def consider(inner: list[int], two_d: bool) -> None:
        nonlocal best
        nbytes = math.prod(inner) * itemsize
        if nbytes > _MAX_INNER_BYTES:
            return
        chunk = [-(-e // i) * i if d in free and b % i else b
                 for d, (e, b, i) in enumerate(zip(ext, block, inner, strict=True))]
        if math.prod(c // i for c, i in zip(chunk, inner, strict=True)) > _MAX_INNER_CHUNKS:
            return
        padded = math.prod(chunk) * itemsize > math.prod(block) * itemsize
        pad = (math.prod(chunk) - math.prod(ext)) * itemsize / max(total, 1) if padded else 0.0
        dist = 0.0 if lo <= nbytes <= hi else abs(math.log2(nbytes / (lo if nbytes < lo else hi)))
        # one split dimension: unpadded first (the grid stays the array's); two: the runs along q
        # matter more than padding (a 4-byte run per row would be unpadded)
        tier = 3 if pad > _HEAVY_PAD else 2 if two_d else int(pad > 0)
        # two split dimensions: the fewest elements along the first (p), so that a slice of a few
        # indices along it reads the least and runs along q are the longest; then closeness to the
        # target, in quarters of a doubling (sizes that close are as good), the least padding, the closest
        near = abs(math.log2(nbytes / target))
        key = (dist, tier, inner[p] if two_d else 0, math.floor(near * 4), pad, near)
        if best is None or key < best[0]:
            best = (key, tuple(inner))

    base = [1] * p + list(block[p:])
    divs = {d: sorted(set(_divisors(block[d]))) for d in range(p, nd)}
    for x in sizes(p, target / rest[p]):  # one split dimension: contiguous runs
        consider([*base[:p], x, *base[p + 1 :]], False)
    if best is not None and best[0][0] == 0 and best[0][1] < 2:
        return best[1]
    for x in divs[p]:  # a second split dimension q > p
        if x * rest[p] <= hi:
            continue  # the contiguous family has it
        for q in range(p + 1, nd):
            mid = x * math.prod(block[p + 1 : q]) * itemsize
            for y in sizes(q, target / (mid * math.prod(block[q + 1 :]))):
                consider([*base[:p], x, *block[p + 1 : q], y, *block[q + 1 :]], True)
    if p > 0 and (best is None or best[0][0] > 0):
        # nothing in range yet: the first split one dimension earlier (a block of 2 x 23 two-byte
        # elements for 16 bytes: 1 x 23 is too large, 1 x 1 too small, 2 x 1 fits)
        for x in _divisors(block[p - 1]):
            for q in range(p, nd):
                mid = x * math.prod(block[p:q]) * itemsize
                for y in sizes(q, target / (mid * math.prod(block[q + 1 :]))):
                    consider([*base[: p - 1], x, *block[p:q], y, *block[q + 1 :]], True)
    return best[1] if best is not None else None


_MAX_INNER_BYTES = 1 << 31  # spec/core.md §6 item 4
_MAX_INNER_CHUNKS = 1 << 24


def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of n, as Python ints (a numpy integer would overflow in the callers' products)."""
    return _divisors_of(int(n))


@functools.lru_cache(maxsize=4096)
def _divisors_of(n: int) -> tuple[int, ...]:
    # cached: a plan asks for the same dimensions many times, and a flat buffer's ~10^9-element
    # partition takes 30,000 steps; keyed by a Python int only (lru_cache would hand a numpy integer's
    # result, overflowing products included, to an equal int)
    out = []
    i = 1
    while i * i <= n:
        if n % i == 0:
            out += [i, n // i]
        i += 1
    return tuple(out)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (any dtype, 0-d and empty included), no copy."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy().data.cast("B")


@dataclass(frozen=True)
class InnerChunk:
    """One inner chunk of a shard: its position and its region clipped to the array."""

    ordinal: int  # position in the index (C order of the inner grid)
    coords: tuple[int, ...]  # inner-grid coordinates within the shard
    start: tuple[int, ...]  # region start in array coordinates
    stop: tuple[int, ...]  # region stop (exclusive), clipped to the array

    @property
    def clipped(self) -> bool:
        return False

    @property
    def empty(self) -> bool:
        return any(b <= a for a, b in zip(self.start, self.stop, strict=True))


def inner_chunks(meta: ArrayMeta, shard: tuple[int, ...]) -> Iterator[InnerChunk]:
    """Every inner chunk of a shard, in index order."""
    origin = [c * s for c, s in zip(shard, meta.chunk_shape, strict=True)]
    for ordinal, coords in enumerate(itertools.product(*(range(g) for g in meta.inner_grid))):
        start = tuple(o + c * i for o, c, i in zip(origin, coords, meta.inner_chunk_shape, strict=True))
        stop = tuple(min(a + i, s) for a, i, s in zip(start, meta.inner_chunk_shape, meta.shape, strict=True))
        yield InnerChunk(ordinal, coords, start, stop)


def is_full(meta: ArrayMeta, c: InnerChunk) -> bool:
    """True when the inner chunk lies wholly inside the array (no padding in its encoding)."""
    return all(b - a == i for a, b, i in zip(c.start, c.stop, meta.inner_chunk_shape, strict=True))


# -- encoding --------------------------------------------------------------------------------------
def _compressor(meta: ArrayMeta) -> Any:
    if meta.compression is None:
        return None
    from numcodecs import Zstd

    return Zstd(level=int(meta.compression.get("configuration", {}).get("level", 1)))


def chunk_bytes(meta: ArrayMeta, c: InnerChunk, block: torch.Tensor, raw: memoryview,
                origin: list[int]) -> memoryview:
    """The raw bytes of inner chunk ``c`` of a shard's ``block`` (contiguous, its ``as_bytes`` is ``raw``):
    a view when the chunk is whole and one contiguous run of the block, else a zero-padded copy."""
    local = [slice(a - o, b - o) for a, b, o in zip(c.start, c.stop, origin, strict=True)]
    span = contiguous_span(block.shape, local)
    if is_full(meta, c) and span is not None:
        return raw[span[0] * meta.itemsize : span[1] * meta.itemsize]
    padded = torch.zeros(meta.inner_chunk_shape, dtype=block.dtype)
    padded[tuple(slice(0, b - a) for a, b in zip(c.start, c.stop, strict=True))] = block[tuple(local)]
    return as_bytes(padded)


#: the page size a shard's inner chunks are aligned to (:func:`aligned`)
PAGE = 4096
_PAD = bytes(PAGE)


#: inner chunks smaller than this stay back to back: their page of padding would be a large share of
#: them, and a read of many small neighbours would no longer be one request (96 KiB chunks of a layout
#: made for resharding: 2-3x slower reads, measured with bench/reshard.py)
ALIGNED_MIN_BYTES = 1 << 20


def aligned(meta: ArrayMeta) -> bool:
    """Whether ucl's writer starts each inner chunk of this array's shards at a multiple of :data:`PAGE`
    (spec/core.md §6.1): uncompressed, not a delta, several inner chunks of whole pages, each of at least
    :data:`ALIGNED_MIN_BYTES`. Then every chunk's bytes are whole pages of the file at page offsets, so a
    reader can map a run of chunks into one contiguous view of the array's elements
    (:mod:`ucl.read.mapped`) and a writer or reader can move them with O_DIRECT straight from or to a
    page-aligned tensor; each costs a page of padding after its crc32c (<= 0.4% of the chunk)."""
    return (meta.compression is None and meta.delta is None and meta.n_inner > 1
            and meta.inner_nbytes % PAGE == 0 and meta.inner_nbytes >= ALIGNED_MIN_BYTES)


def chunk_stride(meta: ArrayMeta) -> int:
    """Bytes from one stored inner chunk's start to the next one's in ucl's own layout."""
    n = meta.inner_nbytes + 4
    return -(-n // PAGE) * PAGE if aligned(meta) else n


def assemble(meta: ArrayMeta, payloads: Iterable[tuple[int, Any]]) -> list[Any]:
    """The buffers of a shard file from its stored chunks (ordinal, encoded bytes), in file order: each
    chunk followed by its crc32c, then the index (absent chunks: EMPTY) and the index's crc32c. Data and
    crc32c buffers alternate; for an :func:`aligned` array a crc32c buffer also holds the zeros that pad
    its chunk to the next page when another chunk follows."""
    buffers: list[Any] = []
    index = np.full((meta.n_inner, 2), EMPTY, dtype="<u8")
    offset = 0
    pad = aligned(meta)
    for ordinal, data in payloads:
        if pad and offset % PAGE:
            gap = PAGE - offset % PAGE
            buffers[-1] = buffers[-1] + _PAD[:gap]
            offset += gap
        n = memoryview(data).nbytes + 4
        buffers.append(data)
        buffers.append(_CRC.pack(_native.crc32c(data)))
        index[ordinal] = (offset, n)
        offset += n
    idx = index.tobytes()
    buffers.append(idx)
    buffers.append(_CRC.pack(_native.crc32c(idx)))
    return buffers


def canonical_index(meta: ArrayMeta, shard: tuple[int, ...]) -> tuple[np.ndarray, int] | None:
    """The index and file size of a shard as :func:`encode_shard` lays it out (its present inner chunks
    in index order from offset 0, each ``inner_nbytes + 4`` bytes, :func:`chunk_stride` apart), or None
    for a compressed or delta array, whose chunks vary in size. A reader may read a shard by this index
    while it reads the real one, and trusts those bytes only once the two are equal (spec/core.md §6.1
    lets a writer lay chunks out in any order, so another writer's shard may differ)."""
    if meta.compression is not None or meta.delta is not None:
        return None
    size = meta.inner_nbytes + 4
    stride = chunk_stride(meta)
    if all(c * cs + (g - 1) * i < n for c, cs, i, g, n in zip(shard, meta.chunk_shape, meta.inner_chunk_shape,
                                                               meta.inner_grid, meta.shape, strict=True)):
        # every inner chunk present (a shard inside the array: all but edge shards): no mask to build
        index = np.empty((meta.n_inner, 2), dtype="<u8")
        index[:, 0] = np.arange(0, meta.n_inner * stride, stride, dtype=np.uint64)
        index[:, 1] = size
        return index, (meta.n_inner - 1) * stride + size + index_nbytes(meta.n_inner)
    # along each dimension: which inner chunks of this shard start inside the array (the others are
    # wholly outside it, absent); a chunk is present when it is along every dimension
    present: np.ndarray = np.ones((), dtype=bool)
    for c, cs, i, g, n in zip(shard, meta.chunk_shape, meta.inner_chunk_shape, meta.inner_grid, meta.shape,
                              strict=True):
        present = np.logical_and.outer(present, c * cs + np.arange(g, dtype=np.int64) * i < n)
    present = present.reshape(-1)
    index = np.full((meta.n_inner, 2), EMPTY, dtype="<u8")
    count = int(np.count_nonzero(present))
    index[present, 0] = np.arange(count, dtype=np.uint64) * np.uint64(stride)
    index[present, 1] = size
    return index, max(0, count - 1) * stride + (size if count else 0) + index_nbytes(meta.n_inner)


def encode_shard(meta: ArrayMeta, shard: tuple[int, ...], block: torch.Tensor) -> list[Any]:
    """Buffers whose concatenation is the shard file for ``block`` (the shard's region clipped to the array).

    Inner chunks that are whole contiguous runs of ``block`` are passed through without a copy.
    """
    origin = [c * s for c, s in zip(shard, meta.chunk_shape, strict=True)]
    block = block.detach().contiguous()
    raw = as_bytes(block)
    comp = _compressor(meta)

    def payloads() -> Iterator[tuple[int, Any]]:
        for c in inner_chunks(meta, shard):
            if not c.empty:
                data: Any = chunk_bytes(meta, c, block, raw, origin)
                yield c.ordinal, comp.encode(np.frombuffer(data, dtype=np.uint8)) if comp is not None else data

    return assemble(meta, payloads())


def shard_digest(buffers: list[Any]) -> int:
    """The commit record's checksum of a shard file (spec/core.md §7): crc32c of the 4-byte crc32c's
    of its inner chunks (index order) and of its index, concatenated.

    A crc32c over the whole file would be useless here: every chunk and the index end in their own
    crc32c, and crc32c(x || crc32c(x)) is a constant, so it would depend on the chunk sizes only and
    could not tell two equal-sized shards apart. ``buffers`` is what encode_shard returns: data and crc
    alternate, the index crc last (a crc32c buffer's padding, :func:`assemble`, is not part of it).
    """
    return _native.crc32c(b"".join(bytes(b[:4]) for b in buffers[1::2]))


def file_digest(data: bytes | memoryview, n_inner: int, *, verify: bool = False, where: str = "") -> int:
    """:func:`shard_digest` of a shard file's bytes. Entries pointing outside the file are skipped, so
    any bytes digest (for tools that rewrite shards, e.g. the conformance generator); with ``verify``,
    every present chunk's crc32c and the index's are checked first (ChecksumError naming ``where``)."""
    data = memoryview(data)
    n = index_nbytes(n_inner)
    if len(data) < n:
        if verify:
            raise ChecksumError(f"{where}: the shard is shorter than its {n}-byte index", file=where)
        return _native.crc32c(data)
    body = data[len(data) - n : len(data) - 4]
    if verify and _native.crc32c(body) != _CRC.unpack(data[len(data) - 4 :])[0]:
        raise ChecksumError(f"{where}: shard index fails its crc32c", file=where)
    crcs = []
    for i in range(n_inner):
        off, nb = struct.unpack_from("<QQ", body, 16 * i)
        if off != EMPTY and nb >= 4 and off + nb <= len(data) - n:
            stored = bytes(data[off + nb - 4 : off + nb])
            if verify and _native.crc32c(data[off : off + nb - 4]) != _CRC.unpack(stored)[0]:
                raise ChecksumError(f"{where}: inner chunk {i} fails its crc32c", file=where)
            crcs.append(stored)
    crcs.append(bytes(data[len(data) - 4 :]))
    return _native.crc32c(b"".join(crcs))


def contiguous_span(shape: tuple[int, ...] | torch.Size, region: list[slice]) -> tuple[int, int] | None:
    """(first, last+1) element offsets when ``region`` of a C-contiguous array is one contiguous run."""
    if not region:
        return (0, 1)
    # every dim after the first partial one must be full; dims before it must have extent 1
    k = len(region)
    for d in range(len(region) - 1, -1, -1):
        if region[d].start != 0 or region[d].stop != shape[d]:
            k = d
            break
    else:
        n = math.prod(shape)
        return (0, n)
    if any(region[d].stop - region[d].start != 1 for d in range(k)):
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    first = sum(r.start * s for r, s in zip(region, strides, strict=True))
    n = math.prod(r.stop - r.start for r in region)
    return (first, first + n)


# -- decoding --------------------------------------------------------------------------------------
def parse_index(meta: ArrayMeta, raw: bytes, file_size: int, where: str) -> np.ndarray:
    """Check and return a shard's index as an (n_inner, 2) uint64 array of (offset, nbytes)."""
    n = meta.n_inner
    if len(raw) != index_nbytes(n):
        raise ShardSizeError(f"{where}: shard of tensor {meta.name!r} is truncated (read {len(raw)} of its "
                             f"{index_nbytes(n)}-byte index)", tensor=meta.name, file=where)
    body, crc = raw[:-4], _CRC.unpack(raw[-4:])[0]
    if _native.crc32c(body) != crc:
        raise ChecksumError(f"{where}: shard index of tensor {meta.name!r} fails its crc32c", tensor=meta.name,
                            file=where)
    index = np.frombuffer(body, dtype="<u8").reshape(n, 2)
    data_end = file_size - index_nbytes(n)
    present = index[:, 0] != EMPTY
    if np.any((index[:, 1] == EMPTY) != ~present):
        raise CorruptShardIndexError(f"{where}: an index entry is half empty", tensor=meta.name, file=where)
    off = index[present, 0]
    nb = index[present, 1]
    if np.any(nb < 4) or np.any(off > data_end) or np.any(nb > data_end) or np.any(off + nb > data_end):
        raise CorruptShardIndexError(f"{where}: an index entry points outside the shard's {data_end} data bytes",
                                     tensor=meta.name, file=where)
    if meta.compression is None and meta.delta is None and np.any(nb != meta.inner_nbytes + 4):
        raise CorruptShardIndexError(f"{where}: an index entry's length differs from the inner chunk size "
                                     f"{meta.inner_nbytes} + 4", tensor=meta.name, file=where)
    order = np.argsort(off)
    if np.any(off[order][1:] < (off + nb)[order][:-1]):
        raise CorruptShardIndexError(f"{where}: index entries overlap", tensor=meta.name, file=where)
    return index


def check_chunk(meta: ArrayMeta, data: memoryview, crc: int, where: str, coords: tuple[int, ...]) -> None:
    if _native.crc32c(data) != crc:
        raise chunk_checksum_error(meta, where, coords)


def chunk_checksum_error(meta: ArrayMeta, where: str, coords: tuple[int, ...]) -> ChecksumError:
    return ChecksumError(f"{where}: inner chunk {list(coords)} of tensor {meta.name!r} fails its crc32c",
                         tensor=meta.name, file=where)


def decode_chunk(meta: ArrayMeta, encoded: memoryview, where: str, coords: tuple[int, ...]) -> memoryview:
    """Inner chunk bytes (without its crc, already checked) -> raw little-endian values."""
    if meta.compression is None:
        out = encoded
    else:
        comp = _compressor(meta)
        declared = zstd_content_size(encoded)
        if declared is not None and declared != meta.inner_nbytes:  # never allocate what a frame claims
            raise IntegrityError(f"{where}: inner chunk {list(coords)} declares {declared} bytes, expected "
                                 f"{meta.inner_nbytes}", tensor=meta.name, file=where)
        try:  # into a buffer of exactly the inner chunk's size: a frame that holds more fails
            out = memoryview(comp.decode(bytes(encoded), out=np.empty(meta.inner_nbytes, np.uint8))).cast("B")
        except Exception as e:
            raise IntegrityError(f"{where}: inner chunk {list(coords)} does not decompress: {e}",
                                 tensor=meta.name, file=where) from None
    if out.nbytes != meta.inner_nbytes:
        raise IntegrityError(f"{where}: inner chunk {list(coords)} decodes to {out.nbytes} bytes, expected "
                             f"{meta.inner_nbytes}", tensor=meta.name, file=where)
    return out


def zstd_content_size(frame: memoryview | bytes) -> int | None:
    """The content size a zstd frame header declares (RFC 8878 §3.1.1.1), or None when it has none."""
    head = bytes(frame[:18])
    if len(head) < 5 or head[:4] != b"\x28\xb5\x2f\xfd":
        return None  # not a zstd frame: the decoder says so
    fhd = head[4]
    single = (fhd >> 5) & 1
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    size = (single, 2, 4, 8)[fhd >> 6]
    if size == 0 or len(head) < pos + size:
        return None
    value = int.from_bytes(head[pos : pos + size], "little")
    return value + 256 if size == 2 else value
