"""The C fast path of a bulk read (load, load_into): segments read with O_DIRECT, every inner chunk's
crc32c checked and its bytes copied to the destination on C threads without the GIL (engine/reader.c).

Measured first (a 1.49 GB, 444-tensor step; cold cache; fresh processes, interleaved): the C read probe
over the same files took 0.67 s, a Python reader of 8 MiB O_DIRECT requests on 4 threads with no check
or copy 0.81-0.86 s, ucl's Python pipeline 0.97 s, and 0.91 s with its checks and copies taken out. Not
the depth of requests (4-8 threads, 8-16 MiB segments, more buffer slots changed nothing) but the Python
work around each request, on 2 cores and one GIL, kept the device waiting.

Only what the C side can vouch for goes there: a segment whose every chunk goes whole to one contiguous
destination (raw chunks of a tensor, no compression, no chunk shared with another request, not a small
shard already in memory) of a local file that opens with O_DIRECT and is not mostly in the page cache.
The C side reports each segment's verdict; any segment it did not deliver (a short file, a tail that is
not the predicted index, a crc32c mismatch, an I/O error) is read again by the Python path
(:func:`ucl.read.boxes._execute`), which names the problem exactly as it would have, so the errors and
the guessed-index fallback stay in one place.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from ucl import _engine
from ucl.errors import UCLError
from ucl.io import fds, ranges
from ucl.io.ranges import ALIGN, open_regular
from ucl.options import ReadOptions
from ucl.read.chunks import ChunkRead
from ucl.read.files import StepFiles

#: engine/reader.h's ucl_rseg and ucl_rchunk, field for field
_SEG = np.dtype([("fd", "<i8"), ("offset", "<u8"), ("length", "<u8"), ("tail_off", "<u8"), ("tail_len", "<u8"),
                 ("first", "<u8"), ("nchunks", "<u8")])
_CHUNK = np.dtype([("off", "<u8"), ("nbytes", "<u8"), ("dst", "<u8")])
_CRC = struct.Struct("<I")

Item = tuple[list[ChunkRead], bytes | None, bool]  # a segment, the bytes that must follow it, planned by a guess


def eligible(files: StepFiles, group: list[ChunkRead], options: ReadOptions) -> bool:
    """Whether the C side can read, check and deliver this segment (the module docstring): one the
    Python path would read with O_DIRECT too (``options.direct``, not refused by the filesystem, at least
    ``direct_min_bytes``)."""
    if not (options.direct and files.ranges.direct) or group[0].key in files.small:
        return False
    if group[-1].offset + group[-1].nbytes - group[0].offset < options.direct_min_bytes:
        return False
    for c in group:
        d = c.direct
        if d is None or c.also or c.part is not None or d.readonly or not d.contiguous or d.nbytes != c.nbytes - 4:
            return False
    return True


def _open(files: StepFiles, key: str) -> int | None:
    """An O_DIRECT descriptor of ``key``'s file, or None where the Python path should read it (not local,
    missing, not a regular file, no O_DIRECT, mostly cached): that path then reads it or names why not."""
    try:
        path = files.local_path(key)
        if path is None:
            return None
        fd, st = open_regular(path, os.O_RDONLY | os.O_DIRECT, key)
    except (OSError, UCLError):  # the Python path raises it, named
        return None
    if ranges.mostly_cached(fd, 0, st.st_size):  # (the RangeReader's own test, as it reads)
        os.close(fd)
        return None
    return fd


class Gate:
    """What the batches of one bulk read share on their way to the C engine: one engine call at a time
    (``calls``: each call runs ``threads`` C threads on its own buffers), and a budget of descriptors
    (``files``), since the C side holds a call's files open until it ends and a batch waiting for its
    call holds its files too (a state of 3,000 small tensors under a limit of 1,024 files failed with
    EMFILE). A call takes at most half the budget, so that one batch opens its files while another reads."""

    def __init__(self, files: int) -> None:
        self.calls = threading.Lock()
        self.files = fds.Budget(files)
        self.per_call = max(1, self.files.size // 2)


def read(files: StepFiles, items: Sequence[Item], threads: int, gate: Gate | None = None) -> list[Item]:
    """Read, check and deliver ``items`` (all :func:`eligible`) on ``threads`` C threads; the items left to
    the Python path (not opened here, or not delivered: the C side's verdict was not ok). With a ``gate``
    the items go in calls of at most ``gate.per_call`` files, whose files are opened and tables built
    before the call waits its turn (~1-9 ms of Python per call that the device otherwise waited through)."""
    if gate is None:
        return _opened(files, items, threads, None)
    rest: list[Item] = []
    for part, nfiles in _parts(items, gate.per_call):
        with gate.files.hold(nfiles):
            rest += _opened(files, part, threads, gate)
    return rest


def _parts(items: Sequence[Item], per_call: int) -> Iterator[tuple[list[Item], int]]:
    """``items`` in order, in parts of at most ``per_call`` files; each with its number of files."""
    part: list[Item] = []
    keys: set[str] = set()
    for it in items:
        key = it[0][0].key
        if key not in keys and len(keys) == per_call:
            yield part, len(keys)
            part, keys = [], set()
        keys.add(key)
        part.append(it)
    if part:
        yield part, len(keys)


def _opened(files: StepFiles, items: Sequence[Item], threads: int, gate: Gate | None) -> list[Item]:
    opened: dict[str, int | None] = {}
    todo: list[Item] = []
    rest: list[Item] = []
    try:
        for it in items:
            key = it[0][0].key
            if key not in opened:
                opened[key] = _open(files, key)
            (todo if opened[key] is not None else rest).append(it)
        if not todo:
            return rest
        segs = np.zeros(len(todo), _SEG)
        chunks = np.zeros(sum(len(g) for g, _, _ in todo), _CHUNK)
        tails = b"".join(t or b"" for _, t, _ in todo)
        k = at = 0
        span = 0
        for i, (g, tail, _) in enumerate(todo):
            c0 = g[0]
            length = g[-1].offset + g[-1].nbytes - c0.offset
            segs[i] = (opened[c0.key], c0.offset, length, at, len(tail or b""), k, len(g))
            at += len(tail or b"")
            base = c0.offset - c0.offset % ALIGN
            span = max(span, -(-(c0.offset + length + len(tail or b"") - base) // ALIGN) * ALIGN)
            for c in g:
                chunks[k] = (c.offset - c0.offset, c.nbytes, np.frombuffer(c.direct, np.uint8).ctypes.data)  # type: ignore[arg-type]
                k += 1
        out = bytearray(4 * (len(todo) + len(chunks)))  # status (per segment), crc32c (per chunk)
        m = memoryview(out)
        seg_table, chunk_table = segs.tobytes(), chunks.tobytes()
        with gate.calls if gate is not None else contextlib.nullcontext():
            _call(files, seg_table, chunk_table, tails, m, len(todo), threads, span)
        status = np.frombuffer(out, np.int32, len(todo))
        crcs = np.frombuffer(out, np.uint32, offset=4 * len(todo))
        k = 0
        for i, it in enumerate(todo):
            g, tail, _ = it
            if status[i] == _engine.READ_OK:
                for j, c in enumerate(g):
                    c.crc[:] = _CRC.pack(int(crcs[k + j]))
                files.count(int(segs[i]["length"]) + len(tail or b""))
            else:
                rest.append(it)
            k += len(g)
        return rest
    finally:
        for fd in opened.values():
            if fd is not None:
                os.close(fd)


def _call(files: StepFiles, segs: bytes, chunks: bytes, tails: bytes, out: memoryview, nseg: int, threads: int,
          span: int) -> None:
    """One engine call on ``threads`` of the step's pooled buffers (warm pages after the first read)."""
    pool = files.ranges.pool
    bufs: list[np.ndarray] = []
    try:
        views = []
        for _ in range(max(1, min(threads, nseg))):
            # one size for every call, the Python path's: a size class per call's largest segment meant
            # fresh buffers for most calls of a first load, faulted in while the device waited (a cold
            # 1.49 GB load_into: its second call read 18 MB in 65 ms, the device idle 64% of that)
            b = pool.get(max(span + ALIGN, files.segment_buffer_bytes))
            bufs.append(b)
            views.append(b.ctypes.data + -b.ctypes.data % ALIGN)
        _engine.read_segments(segs, chunks, tails, out[: 4 * nseg], out[4 * nseg :],
                              np.asarray(views, np.uint64).tobytes(), span)
    finally:
        for b in bufs:
            pool.put(b)
