"""Plain reads: boxes of stored arrays, only the inner chunks a box needs, checksummed, assembled in place.

A read runs in three phases over any number of (array, box, destination) requests:

1. load the index of every shard involved (on ``index_threads`` threads: small latency-bound reads;
   each index is checked: crc32c, bounds, overlaps). A small shard that a request needs whole is read
   in one request with its index. A shard read whole whose recorded size is that of ucl's own layout
   (``ucl.format.shardfile.canonical_index``) is not waited for: it is planned by that predicted index,
   its last segment reads on to the end of the file and must find exactly that index there, and if
   any check of such a shard fails the whole read is done again by the real indexes (another writer
   may lay chunks out in any order, spec/core.md §6.1), which then name any real defect;
2. plan (:mod:`ucl.read.chunks`): for each needed inner chunk, either read it straight into the
   destination or place it from a buffer; coalesce neighbouring chunks of a file into segments of at
   most ``segment_bytes``;
3. execute the segments on the caller's pool (a threaded read plans and starts them in batches of
   whole arrays, so that the first reads do not wait for the last array's plan): read
   each through the step's :class:`~ucl.io.ranges.RangeReader` (a cold segment of a bulk read -- load,
   load_into -- with O_DIRECT into a pooled buffer, checked there, then copied, on the step's check
   threads when it has them (:class:`Handoff`), so each read thread goes on to its next request; others, and every
   segment of a lazy read, which leaves its pages cached for the next read, vectored straight into
   their destinations, checked
   after; the edge chunk of a row slice read in part: its rows in place, the rest through a small
   buffer), verify each chunk's crc32c, deliver it. Meanwhile a side thread maps the destinations' fresh
   pages (:mod:`ucl.io.prefault`).

Any mismatch raises a ucl IntegrityError naming the tensor and file; a read never returns zeros for
data that was written.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

import numpy as np

from ucl.errors import ChecksumError, ShardSizeError
from ucl.format.metadata import ArrayMeta
from ucl.format.shardfile import check_chunk, chunk_checksum_error, index_nbytes
from ucl.io import fds
from ucl.io import native as _native
from ucl.io.prefault import Prefaulter
from ucl.io.ranges import Lease
from ucl.options import DEFAULT_READ, ReadOptions
from ucl.read import bulk
from ucl.read.chunks import ChunkRead, Request, WholeShard, covers, plan_request, segments, shards_of
from ucl.read.files import StepFiles, truncated

_CRC = struct.Struct("<I")


def _check_digests(files: StepFiles, digests: list[WholeShard]) -> None:
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


def _from_memory(group: list[ChunkRead], mv: memoryview, base: int) -> None:
    """Check and deliver chunks whose encoded bytes (and crcs) are in ``mv``, which holds the shard's
    bytes from file offset ``base``."""
    for c in group:
        o = c.offset - base
        data = mv[o : o + c.nbytes - 4]
        c.crc[:] = mv[o + c.nbytes - 4 : o + c.nbytes]
        check_chunk(c.meta, data, _CRC.unpack(c.crc)[0], c.key, c.coords)
        if c.direct is not None:
            _copy(c.direct, data)
        else:
            c.place(data)  # type: ignore[misc]
        _deliver_also(c, data)


def _deliver_also(c: ChunkRead, data: memoryview) -> None:
    """The checked bytes of chunk ``c`` to the other requests that need the same chunk."""
    for d in c.also:
        d.crc[:] = c.crc  # a shard read whole checks its digest over every request's chunks
        if d.direct is not None:
            _copy(d.direct, data)
        else:
            d.place(data)  # type: ignore[misc]


class _Mispredicted(Exception):
    """A shard read by its predicted index did not hold what the prediction said (internal: the read is
    done again by the shards' real indexes, which name any real defect)."""


class Handoff:
    """The second stage of a bulk read: segments read with O_DIRECT are checked and copied to their
    destinations on ``pool`` (the step's check threads) while the read threads go on to the next
    segment, so the device keeps every read thread's request in flight instead of waiting while each
    thread checks and copies what it read. ``slots`` bounds the leased buffers, read or being checked
    (the read threads' and the check threads', each one segment buffer)."""

    def __init__(self, pool: Executor, slots: int) -> None:
        self.pool = pool
        self.slots = threading.BoundedSemaphore(slots)
        self.futures: list[Future[None]] = []  # appended by the read threads (list.append is atomic)


def _execute(files: StepFiles, group: list[ChunkRead], direct: bool = True, tail: bytes | None = None,
             guessed: bool = False, handoff: Handoff | None = None) -> None:
    """Read one segment (chunks of one file at most chunks.GAP apart, read with the bytes between),
    check every chunk's crc32c, deliver it. A cold segment of a bulk read (``direct``) goes to the device
    with O_DIRECT into a pooled buffer and is checked there before it is copied anywhere (on
    ``handoff``'s threads when given); other segments are read vectored straight into their targets,
    then checked.

    ``guessed``: the chunks were planned by the shard's predicted index (``StepFiles.predicted_index``);
    ``tail``: the bytes that must follow the segment to the end of the file (the predicted index and its
    crc32c), read in the same request. Any check that fails then raises :class:`_Mispredicted`."""
    if not guessed:
        return _read_segment(files, group, direct, b"", False, handoff)
    try:
        _read_segment(files, group, direct, tail or b"", True, handoff)
    except (ChecksumError, ShardSizeError):
        raise _Mispredicted(group[0].key) from None


def _read_segment(files: StepFiles, group: list[ChunkRead], direct: bool, tail: bytes, guessed: bool,
                  handoff: Handoff | None) -> None:
    c0 = group[0]
    want = group[-1].offset + group[-1].nbytes - c0.offset  # (chunks.segments: the bytes between too)
    raw = files.small.get(c0.key)
    if raw is not None:  # read whole with its index
        _from_memory(group, raw, 0)
        return
    lease = None
    if handoff is not None:  # (a bulk read's: direct) a buffer slot, kept while the lease is handed off
        handoff.slots.acquire()
    try:
        lease = files.read_direct(c0.key, c0.offset, want + len(tail)) if direct else None
    except (FileNotFoundError, NotADirectoryError):
        raise files.missing(c0.key, c0.meta.name) from None
    finally:
        if handoff is not None and lease is None:
            handoff.slots.release()  # nothing leased (read buffered below, or failed)
    if lease is not None:
        if handoff is not None:
            handoff.futures.append(handoff.pool.submit(_checked, files, group, lease, want, tail, guessed,
                                                       handoff.slots))
            return
        _from_lease(files, group, lease, want, tail)
        return
    if len(group) == 1 and c0.part is not None and not tail:
        _read_part(files, c0)
        return
    bufs: list[memoryview] = []
    at = c0.offset
    for c in group:
        if c.offset > at:  # padding between chunks (chunks.GAP): read, never delivered
            bufs.append(memoryview(bytearray(c.offset - at)))
        bufs.append(c.target)
        bufs.append(memoryview(c.crc))
        at = c.offset + c.nbytes
    end = bytearray(len(tail))
    if tail:
        bufs.append(memoryview(end))
    try:
        got = files.readinto(c0.key, c0.offset, bufs)
    except (FileNotFoundError, NotADirectoryError):
        raise files.missing(c0.key, c0.meta.name) from None
    if got != want + len(tail):
        raise truncated(c0.key, c0.meta.name, got, want + len(tail), c0.offset)
    if end != tail:
        raise _Mispredicted(c0.key)
    for c in group:
        data = c.target
        check_chunk(c.meta, data, _CRC.unpack(c.crc)[0], c.key, c.coords)
        if c.place is not None:
            c.place(data)
        _deliver_also(c, data)
        c.scratch = None  # delivered: its buffer is not needed any more (only its crc, for a digest)


def _from_lease(files: StepFiles, group: list[ChunkRead], lease: Lease, want: int, tail: bytes) -> None:
    """Check and deliver a segment read into a pooled buffer (and any tail after it); the buffer given
    back whatever happens."""
    c0 = group[0]
    try:
        if lease.view.nbytes < want + len(tail):
            raise truncated(c0.key, c0.meta.name, lease.view.nbytes, want + len(tail), c0.offset)
        if tail and lease.view[want:] != tail:
            raise _Mispredicted(c0.key)
        _from_memory(group, lease.view, c0.offset)
    finally:
        lease.release()


def _execute_native(files: StepFiles, items: list[bulk.Item], threads: int, gate: bulk.Gate) -> None:
    """Segments of a bulk read through the C side (:mod:`ucl.read.bulk`); those it did not deliver read
    again here the Python way, which raises what it finds (:class:`_Mispredicted` for a guessed shard)."""
    rest = bulk.read(files, items, threads, gate)
    for g, tail, planned in rest:
        _execute(files, g, True, tail, planned)


def _checked(files: StepFiles, group: list[ChunkRead], lease: Lease, want: int, tail: bytes, guessed: bool,
             slots: threading.BoundedSemaphore) -> None:
    """:func:`_from_lease` on a check thread (:class:`Handoff`), with :func:`_execute`'s verdicts; its
    slot given back after the buffer."""
    try:
        _from_lease(files, group, lease, want, tail)
    except (ChecksumError, ShardSizeError):
        if not guessed:
            raise
        raise _Mispredicted(group[0].key) from None
    finally:
        slots.release()


def _plan_once(files: StepFiles, requests: list[Request], digests: list[WholeShard],
               known: dict[Shard, np.ndarray] | None = None) -> list[ChunkRead]:
    """The chunks of every request, each inner chunk read once: a chunk several requests need (the row
    runs of a column-split member of a flat buffer each take a piece of the same chunks) is read by the
    first and delivered from it to the others (:attr:`ChunkRead.also`). ``known``: the predicted indexes
    to plan by (:func:`_guess`)."""
    chunks: list[ChunkRead] = []
    first: dict[tuple[str, int], ChunkRead] = {}
    for r in requests:
        for c in plan_request(files, r, digests, known):
            p = first.get((c.key, c.offset))
            if p is None:
                first[(c.key, c.offset)] = c
                chunks.append(c)
            else:
                p.part = None  # read whole: the others need the rest of it
                p.also.append(c)
    return chunks


def _copy(dst: memoryview, src: memoryview) -> None:
    if src.nbytes >= 1 << 16:  # numpy copies with the GIL released
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


_SCRATCH = 256 << 10  # per thread: the bytes of an edge chunk outside the destination pass through it
_EDGE_REQUEST = 16 << 20  # object stores: an edge chunk up to this much outside the destination is one request
_local = threading.local()


def _read_part(files: StepFiles, c: ChunkRead) -> None:
    """A buffered read of a chunk whose bytes [lo, hi) are one run of the destination: that run read in
    place, the rest through the thread's small buffer, the crc32c computed over all of it in order."""
    lo, hi, dst = c.part  # type: ignore[misc]
    n = c.nbytes - 4
    scratch = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = memoryview(bytearray(_SCRATCH))
    crc = 0

    def read(at: int, bufs: list[memoryview]) -> None:
        want = sum(b.nbytes for b in bufs)
        try:
            got = files.readinto(c.key, c.offset + at, bufs)
        except (FileNotFoundError, NotADirectoryError):
            raise files.missing(c.key, c.meta.name) from None
        if got != want:
            raise truncated(c.key, c.meta.name, got, want, c.offset + at)

    def through_scratch(a: int, b: int) -> int:
        crc_ = crc
        while a < b:
            k = min(_SCRATCH, scratch.nbytes, b - a)
            read(a, [scratch[:k]])
            crc_ = _native.crc32c(scratch[:k], crc_)
            a += k
        return crc_

    if not files.store.is_local and lo + n - hi <= _EDGE_REQUEST:
        # an object store: a request costs milliseconds whatever its size (in 256 KiB pieces, the edge
        # chunk of a 13 MB slice from a loopback S3 server took ten requests one after another, 0.5 s of
        # the slice's 0.8 s), so the chunk is one request, the bytes outside the destination into buffers
        # of their own (at most an inner chunk's: 1-8 MiB)
        pre, post = memoryview(bytearray(lo)), memoryview(bytearray(n - hi))
        read(0, [pre, dst, post, memoryview(c.crc)])
        crc = _native.crc32c(post, _native.crc32c(dst, _native.crc32c(pre, 0)))
    else:
        crc = through_scratch(0, lo)
        read(lo, [dst, memoryview(c.crc)] if hi == n else [dst])
        crc = _native.crc32c(dst, crc)
        crc = through_scratch(hi, n)
        if hi != n:
            read(n, [memoryview(c.crc)])
    if crc != _CRC.unpack(c.crc)[0]:
        raise chunk_checksum_error(c.meta, c.key, c.coords)


def read(files: StepFiles, requests: Iterable[Request], pool: Executor | None = None,
         options: ReadOptions = DEFAULT_READ, *, direct: bool = True, checks: Executor | None = None) -> None:
    """Fill every request's ``out`` from the step (the three phases in the module docstring).
    ``direct``: cold segments may bypass the page cache (O_DIRECT, where ``options.direct``): a bulk read
    (a whole state) that would otherwise pass every byte through the cache; a lazy read of a tensor or a
    slice reads through it (False), so that the next read of those bytes is served from memory.
    ``checks``: with ``pool``, the ``options.check_threads`` threads that check and copy the segments
    read with O_DIRECT (:class:`Handoff`); without it the read threads do."""
    requests = list(requests)
    pre = (Prefaulter.start_for((r.out.data_ptr(), r.out.nbytes) for r in requests)
           if options.prefault and pool is not None and files.store.is_local else None)
    try:
        _read(files, requests, pool, options, direct, checks)
    finally:
        if pre is not None:
            pre.stop()
        files.ranges.pool.trim(options.keep_buffer_bytes)


Shard = tuple[str, tuple[int, ...]]  # (array name, shard coordinates): a key of StepFiles.indexes


def _read(files: StepFiles, requests: list[Request], pool: Executor | None, options: ReadOptions,
          direct: bool, checks: Executor | None, speculate: bool = True) -> None:
    live = []
    for r in requests:
        if all(r.shape):
            stop = tuple(a + n for a, n in zip(r.start, r.shape, strict=True))
            shards = shards_of(r.meta, r.start, stop)
            live.append((r, [(s, covers(r.meta, s, r.start, stop)) for s in shards]))
    # A shard read whole whose recorded size is that of ucl's own layout is planned by the index that
    # layout gives (predicted) instead of waiting for its index read (hundreds of small reads before the
    # first byte of data): its last segment reads on to the end of the file and must find that very
    # index there, and every chunk must pass its crc32c; else the read is done again by the real indexes
    guessed: dict[str, _Guess] = {}
    again = False
    dfut: list[Future[None]] = []
    handoff = (Handoff(checks, options.threads + options.check_threads)
               if checks is not None and pool is not None and direct else None)
    # batches through the C engine one at a time, each on ``threads`` threads with a segment buffer each:
    # as many buffers as the read threads have (two at once measured the same: 1.04 against 1.05 s); the
    # files they hold open at once within what the process may still open, less what the Python path's
    # threads hold (one each) and a margin for the rest of the process. Made by the first batch that
    # needs it: counting the open files takes ~1 ms in a process holding 2,000, on every lazy read else
    gate: bulk.Gate | None = None
    try:
        digests: list[WholeShard] = []
        unread: set[str] = set()  # guessed shards whose index no segment reads (none, as planned: checked below)
        for batch in _batches(live, pool is not None):
            # planned and started batch by batch, so the device works while the rest is planned
            # (planning hundreds of arrays takes tens of ms); a batch holds every request of its arrays,
            # so a chunk several requests need is still read once (_plan_once)
            new = _guess(files, batch) if speculate else {}
            guessed.update(new)
            unread.update(new)
            _indexes(files, batch, {(g.meta.name, g.coords) for g in new.values()}, options,
                     threads=pool is not None)
            known = {(g.meta.name, g.coords): g.predicted for g in new.values()}
            native: list[bulk.Item] = []  # this batch's segments for the C side (ucl.read.bulk)
            for g in segments(_plan_once(files, [r for r, _ in batch], digests, known), options.segment_bytes):
                tail = _tail(guessed.get(g[0].key), g)
                if tail is not None:
                    unread.discard(g[0].key)
                planned = g[0].key in guessed
                if direct and pool is not None and options.native and bulk.eligible(files, g, options):
                    native.append((g, tail, planned))
                    continue
                if pool is not None:
                    # no list of the chunks kept here: a segment's buffers go as soon as it is delivered
                    dfut.append(pool.submit(_execute, files, g, direct, tail, planned, handoff))
                    continue
                try:
                    _execute(files, g, direct, tail, planned)
                except _Mispredicted:
                    again = True
                    break
            if native:
                assert pool is not None
                if gate is None:
                    gate = bulk.Gate(fds.headroom() - options.threads - options.check_threads
                                     - options.index_threads - 32)
                dfut.append(pool.submit(_execute_native, files, native, options.threads, gate))
            if again:
                break
        if dfut:
            wait(dfut)  # every read done: the checks they handed off are all in handoff.futures
            done = dfut + (handoff.futures if handoff is not None else [])
            wait(done)
            again = any(isinstance(f.exception(), _Mispredicted) for f in done)
            if not again:
                for f in done:
                    f.result()
        for key in unread if not again else ():
            u = guessed[key]
            if not np.array_equal(files.read_index(u.meta, u.coords), u.predicted):
                again = True
                break
        if not again:
            _check_digests(files, digests)
        if not again:  # confirmed: cached for the next read
            files.indexes.update({(g.meta.name, g.coords): g.predicted for g in guessed.values()})
    finally:
        _settle(dfut)  # after an error in planning or reading, none of this read's work goes on
        if handoff is not None:  # never cancelled: each gives back its buffer and its slot
            wait(handoff.futures)
        files.small.clear()
    if again:
        _read(files, requests, pool, options, direct, checks, speculate=False)


def _batches(live: Live, threaded: bool) -> list[Live]:
    """``live`` in batches of whole arrays (every request of an array in one batch), growing from a few
    arrays to many, in order; one batch when the read is not threaded."""
    by_array: dict[str, Live] = {}
    for item in live:
        by_array.setdefault(item[0].meta.name, []).append(item)
    groups = list(by_array.values())
    if not threaded:
        return [live]
    out: list[Live] = []
    i, n = 0, 4
    while i < len(groups):
        out.append([item for group in groups[i : i + n] for item in group])
        i, n = i + n, n * 2
    return out


def _tail(guess: _Guess | None, g: list[ChunkRead]) -> bytes | None:
    """For the segment of a guessed shard that ends where its data ends: the predicted index and its
    crc32c, which the file must hold right after the segment (read in the same request)."""
    if guess is None or g[-1].offset + g[-1].nbytes != guess.size - index_nbytes(len(guess.predicted)):
        return None
    body = guess.predicted.tobytes()
    return body + _CRC.pack(_native.crc32c(body))


class _Guess(NamedTuple):
    """A shard planned by its predicted index."""

    meta: ArrayMeta
    coords: tuple[int, ...]
    predicted: np.ndarray  # the index
    size: int  # the file's size in the commit record


Live = list[tuple[Request, list[tuple[tuple[int, ...], bool]]]]  # each request and its (shard, read whole)


def _guess(files: StepFiles, live: Live) -> dict[str, _Guess]:
    """The predicted indexes of the shards read whole that have none cached, by file key (not cached: other
    reads of the step must not plan by them before this read confirms them)."""
    guessed: dict[str, _Guess] = {}
    for r, shards in live:
        for s, whole in shards:
            if whole and (r.meta.name, s) not in files.indexes:
                guess = files.predicted_index(r.meta, s)
                if guess is not None:
                    key, size = files.shard(r.meta, s)
                    guessed[key] = _Guess(r.meta, s, guess, size)
    return guessed


def _indexes(files: StepFiles, live: Live, guessed: set[Shard], options: ReadOptions, threads: bool) -> None:
    """Every index the plan needs that is not cached (nor guessed), read and checked; several on their own
    threads (small latency-bound reads)."""
    todo: dict[Shard, tuple[ArrayMeta, tuple[int, ...], bool]] = {}
    for r, shards in live:
        for s, whole in shards:
            k = (r.meta.name, s)
            if k not in files.indexes and k not in todo and k not in guessed:
                todo[k] = (r.meta, s, whole)
    if not threads or len(todo) < 2:
        for v in todo.values():
            files.index(*v)
        return
    ipool = ThreadPoolExecutor(min(options.index_threads, len(todo)), "ucl-index")
    ifut = [ipool.submit(files.index, *v) for v in todo.values()]
    try:
        for f in ifut:
            f.result()
    finally:
        _settle(ifut)
        ipool.shutdown(wait=False)


def _settle(futures: Sequence[Future[Any]]) -> None:
    """On an error: nothing of this read keeps running after it returns (the work not started is
    cancelled, the work started is waited for)."""
    for f in futures:
        f.cancel()
    wait(futures)
