"""Reading tensors of delta steps (spec/delta.md §6.3): per inner chunk, walk the tensor's links back to
the newest one that defines the chunk, read only those inner chunks (crc32c verified), decode forward.

:meth:`ChainReader.read_many` reads any number of boxes at once, as a pipeline on two thread pools that
every reader of the process shares (their tasks never wait for each other; the calling thread schedules
them); :meth:`ChainReader.read` is the same for one box:

1. plan: each request's inner chunks, shard by shard, in groups of at most ``group_bytes`` (times the
   links read: a deep chain reads more per chunk). A chunk that
   lies whole in its box and whose part of the destination is one contiguous run is rebuilt straight
   into the destination; others go through a scratch buffer and are placed after.
2. fetch, on ``io_threads`` threads, per group and link: the chunks the group needs from the link's shard,
   in as few reads as possible (a shard needed whole, small enough and whose index is not cached yet:
   one read of the whole file; else the index, cached per step, then each run of chunks at most a page
   apart, chunks.GAP, in one read), through the step's :class:`~ucl.io.ranges.RangeReader` (large
   ranges not in the page cache with O_DIRECT), into buffers of the process's pool (fresh pages cost
   more to fault in than the copy). Each chunk's
   crc32c is verified there.
   What reading a chunk gives (its payload, absent, or the error reading it raised) is kept, not raised.
   Groups reading little (``small_bytes``) are fetched and rebuilt a batch to a task: their reads are
   latency, and a task each would cost more than they do.
3. rebuild, on ``decode_threads`` threads, each chunk once every link it may need is fetched:
   :func:`reconstruct_inner` walks the links newest first over those outcomes exactly as it would over
   the reads themselves (same stops, same errors, same messages). Chunks of at least ``parallel_min_bytes``
   are then decoded as tasks (each payload, or each share of a payload's frames, unpacked on its own;
   all applied oldest first in one pass over the destination, split in word ranges) that the rebuilding
   thread shares with idle decode threads; smaller ones payload after payload. The C code releases the
   GIL. Meanwhile a side thread maps the destinations' fresh pages (ucl.io.prefault).

At most ``inflight_bytes`` of fetched data wait for their decode: groups start in order as earlier ones
finish, so reading overlaps decoding. Links are fetched concurrently, not newest first: a chunk whose
newer link holds full values (mode 0) has its older links read for nothing (spec §6.3.2 allows a reader
to stop there; it does not require it); their bytes count in ``bytes_read``, their errors are never
raised (the walk does not reach them). A failing read raises the error a sequential read (request by
request, shard by shard, chunk by chunk in C order: :meth:`ChainReader.read_sequential`) meets first;
work after it is not started.

The thresholds are :class:`ucl.options.ChainOptions` (``ReadOptions.chain``).
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ucl.delta.chain import (
    DEFAULT_MAX_CHAIN,
    ArrayInfo,
    StepInfo,
    reconstruct_inner,
    resolve_array_chain,
    resolve_chain,
)
from ucl.delta.codec import ENCODINGS, word_dtype
from ucl.format.metadata import ArrayMeta, StepMeta
from ucl.format.records import REFERENCE_MODES, DeltaRecord
from ucl.format.shardfile import EMPTY, as_bytes, check_chunk, decode_chunk
from ucl.io.buffers import shared_pool
from ucl.io.prefault import Prefaulter
from ucl.io.ranges import Lease
from ucl.options import DEFAULT_READ, ReadOptions
from ucl.read.chunks import Request, covers, follows, shards_of
from ucl.read.files import StepFiles, absent, truncated

_CRC = struct.Struct("<I")

StepSource = Callable[[int], tuple[StepMeta, StepFiles]]  # step -> its metadata and files (the caller caches)


class ChainReader:
    """Reads delta-encoded tensors of one step through its chain."""

    def __init__(self, step: int, get: StepSource, max_chain: int = DEFAULT_MAX_CHAIN,
                 options: ReadOptions = DEFAULT_READ) -> None:
        self.step = step
        self.get = get
        self.options = options
        self.opts = options.chain

        def info(s: int) -> StepInfo:
            m, _ = get(s)
            return StepInfo(s, m.kind, m.parent)

        self.steps = resolve_chain(step, info, max_chain)
        self.max_chain = max_chain
        self._links: dict[str, list[ArrayInfo]] = {}
        self._buffers = shared_pool()  # shared by every reader of the process: warm pages
        self._scratch = threading.local()

    def links(self, name: str) -> list[ArrayInfo]:
        if name not in self._links:
            def get_array(s: int, n: str) -> ArrayInfo | None:
                a = self.get(s)[0].arrays.get(n)
                if a is None:
                    return None
                rec = DeltaRecord.from_dict(a.delta) if a.delta is not None else None
                return ArrayInfo(s, n, a.shape, a.dtype, a.chunk_shape, a.inner_chunk_shape, rec)

            self._links[name] = resolve_array_chain(self.step, name, get_array, self.steps, self.max_chain)
        return self._links[name]

    # -- reading -----------------------------------------------------------------------------------
    def read(self, req: Request) -> None:
        """Fill ``req.out`` with the box of the delta-step tensor ``req.meta``, bit-exactly."""
        self.read_many([req])

    def read_many(self, requests: Sequence[Request]) -> None:
        """Fill every request's ``out`` (boxes of delta-step tensors), bit-exactly, as one pipeline.

        Raises the error that reading the requests one after the other, each chunk by chunk, would raise
        first (:meth:`read_sequential`); the destinations then hold unspecified values.
        """
        groups, errors = self._plan(requests)
        if not groups and not errors:
            return
        # destinations not mapped yet (load()'s fresh tensors) are populated on a side thread while
        # the first reads wait for the device (as ucl.read.boxes.read does)
        pre = (Prefaulter.start_for((r.out.data_ptr(), r.out.nbytes) for r in requests)
               if self.options.prefault else None)
        try:
            _Run(self, groups, errors).run()
        finally:
            if pre is not None:
                pre.stop()

    def read_sequential(self, req: Request) -> None:
        """The plain algorithm, one inner chunk after the other with one read per chunk and link: the
        reference :meth:`read_many` must agree with, in data and in errors."""
        meta, out = req.meta, req.out
        if any(n == 0 for n in req.shape):
            return
        links = self.links(meta.name)
        word = word_dtype(meta.itemsize)
        buf = np.empty(meta.inner_nbytes // word.itemsize, dtype=word)
        dst_v = _cells(as_bytes(out), meta.itemsize, req.shape)
        src_v = _cells(buf, meta.itemsize, meta.inner_chunk_shape)
        for shard, ordinal, _whole, src, dst in _chunks_of(req):
            reconstruct_inner(links, (*shard, ordinal), self._read_inner, buf)
            dst_v[dst] = src_v[src]

    def _read_inner(self, step: int, name: str, coords: tuple[int, ...]) -> bytes | memoryview | None:
        meta, files = self.get(step)
        arr = meta.arrays[name]
        shard, ordinal = coords[:-1], coords[-1]
        rel = arr.shard_key(shard)
        chunked = arr.delta is not None
        if chunked and rel not in files.record.files:
            return None  # the whole shard is unchanged
        index = files.index(arr, shard)
        off, nb = (int(x) for x in index[ordinal])
        key, _ = files.shard(arr, shard)
        if off == EMPTY:
            if chunked:
                return None
            raise absent(key, ordinal, name)
        try:
            raw = files.store.read_range(key, off, nb)
        except (FileNotFoundError, NotADirectoryError):
            raise files.missing(key, name) from None
        files.count(len(raw))
        if len(raw) != nb:
            raise truncated(key, name)
        return _checked(arr, files, key, ordinal, memoryview(raw), chunked)

    # -- planning ----------------------------------------------------------------------------------
    def _plan(self, requests: Sequence[Request]) -> tuple[list[_Group], dict[int, BaseException]]:
        groups: list[_Group] = []
        errors: dict[int, BaseException] = {}
        order = 0
        for req in requests:
            if any(n == 0 for n in req.shape):
                continue
            meta = req.meta
            try:
                links = self.links(meta.name)
                metas = [self.get(link.step)[0].arrays[meta.name] for link in links]
            except Exception as e:  # noqa: BLE001 - raised in request order, after earlier requests' errors
                errors[order] = e
                break
            fetched = [(link, m) for link, m in zip(links, metas, strict=True)
                       if link.kind not in REFERENCE_MODES]
            word = word_dtype(meta.itemsize)
            stop = tuple(a + n for a, n in zip(req.start, req.shape, strict=True))
            out_bytes = as_bytes(req.out)
            out_words = np.frombuffer(out_bytes, dtype=word)
            dst_cells = None
            per = meta.inner_nbytes // word.itemsize  # words of an inner chunk
            wpe = meta.itemsize // word.itemsize  # words per element (2 for complex128)
            cur: _Group | None = None
            for shard, ordinal, whole, src, dst in _chunks_of(req):
                full = cur is not None and (cur.nbytes + meta.inner_nbytes) * len(fetched) > self.opts.group_bytes
                if cur is None or cur.shard != shard or full:
                    cur = _Group(meta, shard, links, fetched, covers(meta, shard, req.start, stop))
                    groups.append(cur)
                direct = None
                run = _run_of(dst, req.shape) if whole else None
                if run is not None:
                    direct = out_words[run[0] * wpe : run[0] * wpe + per]
                place = None
                if direct is None:
                    if dst_cells is None:
                        dst_cells = _cells(out_bytes, meta.itemsize, req.shape)
                    place = (dst_cells, dst, src)
                cur.jobs.append(_Job(order, (*shard, ordinal), direct, place))
                cur.nbytes += meta.inner_nbytes
                order += 1
        for g in groups:
            # needed whole: every in-bounds chunk of a shard its request covers
            g.whole = g.covers and len(g.jobs) == _in_bounds(g.meta, g.shard)
            ordinals = [job.coords[-1] for job in g.jobs]
            rel = g.meta.shard_key(g.shard)  # the same key in every link (same name and chunking)
            for link, arr in g.fetched:
                files = self.get(link.step)[1]
                g.fetches.append(_Fetch(link.step, arr, files, g.shard, rel, ordinals, g.whole))
                rec = files.record.files.get(rel)
                size = rec[0] if rec is not None else 0  # a shard not listed: not read
                g.cost += size if g.whole else min(size, len(g.jobs) * (arr.inner_nbytes + 4))
            g.cost = max(1, g.cost)
        return groups, errors

    # -- the pieces the pipeline runs ------------------------------------------------------------
    def _pools_get(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        return _pools(self.opts.io_threads, self.opts.decode_threads)

    def _fetch(self, f: _Fetch) -> None:
        """Read what the group needs of one link's shard; keep each chunk's outcome (never raises)."""
        arr, files, name, shard = f.arr, f.files, f.arr.name, f.shard
        chunked = arr.delta is not None
        if chunked and f.rel not in files.record.files:
            return  # the whole shard is unchanged: every chunk absent
        try:
            index, data = self._index(files, arr, shard, f.whole, f)
            key = f"{files.prefix}/{f.rel}"  # listed: _index checked it (files.shard)
        except Exception as e:  # noqa: BLE001 - what reading any chunk of this shard raises
            f.error = e
            return
        res = f.results
        spans = []
        for ordinal in f.ordinals:
            off, nb = int(index[ordinal, 0]), int(index[ordinal, 1])
            if off == EMPTY:
                res[ordinal] = None if chunked else absent(key, ordinal, name)
            elif data is not None:
                res[ordinal] = self._outcome(arr, files, key, ordinal, data[off : off + nb], chunked)
            else:
                spans.append((off, nb, ordinal))
        if not spans:
            return
        spans.sort()
        seg: list[tuple[int, int, int]] = []
        for s in spans:
            # a run of chunks at most GAP apart (the padding of the page-aligned layout) is one read
            if seg and (not follows(seg[-1][0] + seg[-1][1], s[0])
                        or s[0] + s[1] - seg[0][0] > self.opts.segment_max_bytes):
                self._segment(f, key, seg, chunked)
                seg = []
            seg.append(s)
        self._segment(f, key, seg, chunked)

    def _segment(self, f: _Fetch, key: str, seg: list[tuple[int, int, int]], chunked: bool) -> None:
        """One read of adjacent chunks [(offset, nbytes, ordinal), ...]; each checked on its own."""
        arr, files = f.arr, f.files
        start, end = seg[0][0], seg[-1][0] + seg[-1][1]
        try:
            got = self._pread(files, key, start, end - start, f)
        except (FileNotFoundError, NotADirectoryError):
            for _, _, ordinal in seg:
                f.results[ordinal] = files.missing(key, arr.name)
            return
        except Exception as e:  # noqa: BLE001 - an I/O error: what reading each of these chunks raises
            for _, _, ordinal in seg:
                f.results[ordinal] = e
            return
        for off, nb, ordinal in seg:
            part = got[off - start : off - start + nb]
            f.results[ordinal] = (self._outcome(arr, files, key, ordinal, part, chunked) if len(part) == nb
                                  else truncated(key, arr.name))

    def _outcome(self, arr: ArrayMeta, files: StepFiles, key: str, ordinal: int, raw: memoryview,
                 chunked: bool) -> Any:
        try:
            return _checked(arr, files, key, ordinal, raw, chunked)
        except Exception as e:  # noqa: BLE001
            return e

    def _index(self, files: StepFiles, arr: ArrayMeta, shard: tuple[int, ...], whole: bool,
               f: _Fetch) -> tuple[np.ndarray, memoryview | None]:
        """The shard's checked index (as ``files.index``), and the whole file when it was read whole (a
        shard needed whole, at most ``whole_max_bytes``, whose index is not cached yet)."""
        key, size = files.shard(arr, shard)  # raises its missing_shard
        if not whole or size > self.opts.whole_max_bytes:
            return files.index(arr, shard), None
        idx, got = files.whole(arr, shard)
        return idx, self._hold(got, f)

    def _pread(self, files: StepFiles, key: str, offset: int, length: int, f: _Fetch) -> memoryview:
        """``length`` bytes at ``offset`` (fewer only at the end of the file), counted: through the step's
        range reader (local files: a pooled buffer the fetch holds until its group is rebuilt; O_DIRECT
        when the range is large and not in the page cache)."""
        view = self._hold(files.read(key, offset, length), f)
        assert view is not None
        return view

    @staticmethod
    def _hold(got: Lease | memoryview | None, f: _Fetch) -> memoryview | None:
        if isinstance(got, Lease):
            f.leases.append(got)
            return got.view
        return got

    def _rebuild(self, g: _Group, job: _Job) -> None:
        """Rebuild one chunk from its group's fetched outcomes, into its destination."""
        by_step = {f.step: f for f in g.fetches}
        ordinal = job.coords[-1]

        def replay(step: int, name: str, coords: tuple[int, ...]) -> bytes | memoryview | None:
            f = by_step[step]
            if f.error is not None:
                raise f.error
            v = f.results.get(ordinal)
            if isinstance(v, BaseException):
                raise v
            return v  # type: ignore[no-any-return]

        meta = g.meta
        out = job.direct
        if out is None:
            out = self._scratch_for(meta)
        taken: list[np.ndarray] = []

        def scratch(n: int) -> np.ndarray:
            taken.append(self._buffers.get(n))
            return taken[-1][:n]

        par = meta.inner_nbytes >= self.opts.parallel_min_bytes
        try:
            reconstruct_inner(g.links, job.coords, replay, out, run=self._run_tasks if par else None,
                              scratch=scratch, parts=self.opts.decode_threads)
        finally:
            for b in taken:
                self._buffers.put(b)
        if job.place is not None:
            cells, dst, src = job.place
            cells[dst] = _cells(out, meta.itemsize, meta.inner_chunk_shape)[src]

    def _run_tasks(self, fns: list[Callable[[], Any]]) -> list[Any]:
        """Call every function, on the calling thread and idle decode threads; results in order. Never
        waits for a task that has not started (it runs it itself), so rebuilds running on every decode
        thread cannot deadlock."""
        if len(fns) == 1 or self.opts.decode_threads == 1:
            return [f() for f in fns]
        results: list[Any] = [None] * len(fns)
        todo = iter(range(len(fns)))
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                results[i] = fns[i]()

        _, cpu = self._pools_get()
        helpers = [cpu.submit(work) for _ in range(min(len(fns), self.opts.decode_threads) - 1)]
        try:
            work()
        finally:
            for h in helpers:
                if not h.cancel():
                    h.result()  # started: it finishes what it took (raises its error, if any)
        return results

    def _scratch_for(self, meta: ArrayMeta) -> np.ndarray:
        word = word_dtype(meta.itemsize)
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.nbytes < meta.inner_nbytes:
            buf = self._scratch.buf = np.empty(max(meta.inner_nbytes, 1 << 16), np.uint8)
        return buf[: meta.inner_nbytes].view(word)


# -- the pipeline ------------------------------------------------------------------------------------
class _Job:
    """One inner chunk of one request: where it goes."""

    __slots__ = ("order", "coords", "direct", "place")

    def __init__(self, order: int, coords: tuple[int, ...], direct: np.ndarray | None,
                 place: tuple[np.ndarray, tuple[slice, ...], tuple[slice, ...]] | None) -> None:
        self.order = order  # position in the sequential read: errors are raised in this order
        self.coords = coords  # (*shard, ordinal)
        self.direct = direct  # the destination's words, when the chunk is rebuilt in place
        self.place = place  # (destination cells, destination slices, chunk slices) otherwise


class _Fetch:
    """What one group needs of one link's shard, and what reading it gave."""

    __slots__ = ("step", "arr", "files", "shard", "rel", "ordinals", "whole", "results", "error", "leases")

    def __init__(self, step: int, arr: ArrayMeta, files: StepFiles, shard: tuple[int, ...], rel: str,
                 ordinals: list[int], whole: bool) -> None:
        self.step, self.arr, self.files, self.shard, self.rel = step, arr, files, shard, rel
        self.ordinals = ordinals
        self.whole = whole
        self.results: dict[int, Any] = {}  # ordinal -> payload | None (absent) | the error reading it raised
        self.error: BaseException | None = None  # what reading any chunk of the shard raises (its index)
        self.leases: list[Lease] = []  # pooled buffers the results point into, released once rebuilt


class _Group:
    """Adjacent inner chunks of one request in one shard: fetched together, each link in one task."""

    def __init__(self, meta: ArrayMeta, shard: tuple[int, ...], links: list[ArrayInfo],
                 fetched: list[tuple[ArrayInfo, ArrayMeta]], covers: bool) -> None:
        self.meta = meta
        self.shard = shard
        self.links = links
        self.fetched = fetched  # the links read (not unchanged) and their array documents
        self.jobs: list[_Job] = []
        self.nbytes = 0
        self.covers = covers  # the request's box covers the shard
        self.whole = False  # the group is every in-bounds chunk of the shard
        self.fetches: list[_Fetch] = []
        self.waiting = 0  # fetches not done
        self.left = 0  # jobs not rebuilt
        self.cost = 0  # bytes charged to the in-flight budget

    @property
    def first(self) -> int:
        return self.jobs[0].order


class _Run:
    """One read_many call: schedules fetches and rebuilds on the reader's pools from the calling thread."""

    def __init__(self, reader: ChainReader, groups: list[_Group], errors: dict[int, BaseException]) -> None:
        self.r = reader
        self.groups = groups
        self.errors = errors
        self.cut = min(errors) if errors else math.inf  # nothing after the first error is started
        self.events: queue.SimpleQueue[tuple[str, _Group, Any, Future[Any]]] = queue.SimpleQueue()
        self.running = 0
        self.inflight = 0

    def run(self) -> None:
        io, cpu = self.r._pools_get()
        o = self.r.opts
        fatal: BaseException | None = None
        nxt = 0
        try:
            while True:
                while (fatal is None and nxt < len(self.groups) and self.groups[nxt].first < self.cut
                       and (self.inflight == 0 or self.inflight + self.groups[nxt].cost <= o.inflight_bytes)):
                    g = self.groups[nxt]
                    if g.cost > o.small_bytes:
                        self._start(io, g)
                        nxt += 1
                        continue
                    # small groups: several in one task (their reads are latency, not bandwidth)
                    batch, cost = [], 0
                    while (nxt < len(self.groups) and self.groups[nxt].cost <= o.small_bytes
                           and self.groups[nxt].first < self.cut and cost < o.small_batch_bytes):
                        batch.append(self.groups[nxt])
                        cost += self.groups[nxt].cost
                        nxt += 1
                    self._start_small(io, batch, alone=nxt == len(self.groups) and self.running == 0)
                if self.running == 0:
                    break
                kind, g, item, fut = self.events.get()
                self.running -= 1
                exc = fut.exception()
                if kind == "small":
                    errors: dict[int, BaseException] = fut.result() if exc is None else {}
                    fatal = fatal or exc
                    self._small_done(item, errors)
                elif kind == "fetch":
                    if exc is not None:  # not an error of the data (those are kept): a bug, memory
                        fatal = fatal or exc
                    g.waiting -= 1
                    if g.waiting == 0 and item is g.fetches[-1] and len(g.fetches) > 1 and fatal is None:
                        older = _older(g)  # the newest link is in: the older ones, for what it left open
                        g.waiting = len(older)
                        for f in reversed(older):
                            self._submit(io, "fetch", g, f, self.r._fetch, f)
                    if g.waiting == 0:
                        for job in g.jobs:
                            if job.order < self.cut and fatal is None:
                                self._submit(cpu, "rebuild", g, job, self.r._rebuild, g, job)
                            else:
                                self._done(g)
                else:
                    if exc is not None:
                        self.errors[item.order] = exc
                        self.cut = min(self.cut, item.order)
                    self._done(g)
        finally:
            while self.running:  # on an unexpected error: nothing of this read keeps running after it returns
                self.events.get()
                self.running -= 1
            self.r._buffers.trim(self.r.options.keep_buffer_bytes)
        if fatal is not None:
            raise fatal
        if self.errors:
            raise self.errors[min(self.errors)]

    def _start(self, io: ThreadPoolExecutor, g: _Group) -> None:
        self.inflight += g.cost
        g.left = len(g.jobs)
        g.waiting = 1  # the newest link first: every walk starts there, and it may end them all
        self._submit(io, "fetch", g, g.fetches[-1], self.r._fetch, g.fetches[-1])

    def _start_small(self, io: ThreadPoolExecutor, batch: list[_Group], alone: bool) -> None:
        """Small groups read and rebuilt one after the other by one task (by the calling thread when
        they are all there is: a thread costs more than they do)."""
        for g in batch:
            self.inflight += g.cost
            g.left = len(g.jobs)
        if alone:
            self._small_done(batch, self._small(batch))
        else:
            self._submit(io, "small", batch[0], batch, self._small, batch)

    def _small(self, batch: list[_Group]) -> dict[int, BaseException]:
        errors: dict[int, BaseException] = {}
        for g in batch:
            self.r._fetch(g.fetches[-1])
            for f in reversed(_older(g)):
                self.r._fetch(f)
            for job in g.jobs:
                if job.order < self.cut and not errors:  # nothing after an error (a newer one)
                    try:
                        self.r._rebuild(g, job)
                    except Exception as e:  # noqa: BLE001 - raised in order, at the end
                        errors[job.order] = e
        return errors

    def _small_done(self, batch: list[_Group], errors: dict[int, BaseException]) -> None:
        if errors:
            self.errors.update(errors)
            self.cut = min(self.cut, *errors)
        for g in batch:
            for _ in g.jobs:
                self._done(g)

    def _submit(self, pool: ThreadPoolExecutor, kind: str, g: _Group, item: Any, fn: Callable[..., Any],
                *args: Any) -> None:
        fut = pool.submit(fn, *args)
        self.running += 1
        fut.add_done_callback(lambda fu: self.events.put((kind, g, item, fu)))

    def _done(self, g: _Group) -> None:
        g.left -= 1
        if g.left == 0:  # every chunk of the group rebuilt (or skipped): its buffers go back
            for f in g.fetches:
                for lease in f.leases:
                    lease.release()
                f.leases.clear()
                f.results.clear()
            self.inflight -= g.cost


def _older(g: _Group) -> list[_Fetch]:
    """Once a group's newest link is fetched: its older links' fetches, each for the chunks the newest
    leaves open (present there as a delta, or absent). A chunk the newest link ends (full values, a mode
    the walk rejects, an error: the walk stops there) is not read in older links, nor is any chunk when
    none is open (the older fetches are then dropped)."""
    newest = g.fetches[-1]
    if newest.error is not None:
        want: list[int] = []
    else:
        link = g.links[-1] if g.links[-1].step == newest.step else next(
            x for x in g.links if x.step == newest.step)
        delta_mode = ENCODINGS.get(link.delta.encoding or "", -1) if link.delta is not None else -1
        want = []
        for o in newest.ordinals:
            v = newest.results.get(o)
            if v is None or (not isinstance(v, BaseException) and len(v) and v[0] == delta_mode):
                want.append(o)
    older = g.fetches[:-1]
    if not want:
        g.fetches = [newest]
        return []
    if len(want) < len(newest.ordinals):
        for f in older:
            f.ordinals, f.whole = want, False  # a part of the shard: read those chunks only
    return older


_POOLS: tuple[tuple[int, int, int], ThreadPoolExecutor, ThreadPoolExecutor] | None = None
_POOLS_LOCK = threading.Lock()


def _pools(io_threads: int, decode_threads: int) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """The process's I/O and decode pools (every reader shares them: their tasks never wait for each
    other). Made again in a forked child, whose copies have no threads."""
    global _POOLS
    key = (os.getpid(), io_threads, decode_threads)
    with _POOLS_LOCK:
        if _POOLS is None or _POOLS[0] != key:  # idle threads of pools dropped here exit with them
            _POOLS = (key, ThreadPoolExecutor(io_threads, thread_name_prefix="ucl-delta-io"),
                      ThreadPoolExecutor(decode_threads, thread_name_prefix="ucl-delta-decode"))
        return _POOLS[1], _POOLS[2]


# -- helpers -----------------------------------------------------------------------------------------
def _chunks_of(req: Request) -> Any:
    """(shard, ordinal, whole, chunk slices, destination slices) of each inner chunk the box touches, in
    the sequential reading order; ``whole``: the chunk lies whole in the box (not clipped by it or by the
    array's edge)."""
    meta = req.meta
    stop = tuple(a + n for a, n in zip(req.start, req.shape, strict=True))
    for shard in shards_of(meta, req.start, stop):
        origin = [c * s for c, s in zip(shard, meta.chunk_shape, strict=True)]
        ranges = []
        for d in range(len(shard)):
            i = meta.inner_chunk_shape[d]
            ranges.append(range(max(0, (req.start[d] - origin[d]) // i),
                                min(meta.inner_grid[d], -(-(stop[d] - origin[d]) // i))))
        for ic in itertools.product(*ranges):
            ordinal = int(np.ravel_multi_index(ic, meta.inner_grid)) if ic else 0
            c_start = [o + c * i for o, c, i in zip(origin, ic, meta.inner_chunk_shape, strict=True)]
            lo = [max(a, b) for a, b in zip(c_start, req.start, strict=True)]
            hi = [min(a + i, s, b) for a, i, s, b in zip(c_start, meta.inner_chunk_shape, meta.shape, stop,
                                                         strict=True)]
            whole = all(b - a == i for a, b, i in zip(lo, hi, meta.inner_chunk_shape, strict=True))
            src = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, c_start, strict=True))
            dst = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, req.start, strict=True))
            yield shard, ordinal, whole, src, dst


def _run_of(dst: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The box ``dst`` of a C-contiguous array of ``shape`` as one run of elements (start, count), or
    None when it is not one run: every dimension after the first one of extent > 1 must be whole."""
    ext = [s.stop - s.start for s in dst]
    k = next((d for d, e in enumerate(ext) if e != 1), len(ext))
    if any(ext[d] != shape[d] for d in range(k + 1, len(ext))):
        return None
    start = 0
    for s, n in zip(dst, shape, strict=True):
        start = start * n + s.start
    return start, math.prod(ext)


def _cells(buf: Any, itemsize: int, shape: tuple[int, ...]) -> np.ndarray:
    """A buffer as an array of ``shape`` whose elements are opaque ``itemsize``-byte cells (any dtype)."""
    return np.frombuffer(buf, dtype=np.dtype((np.void, itemsize))).reshape(shape)




def _in_bounds(meta: ArrayMeta, shard: tuple[int, ...]) -> int:
    """Inner chunks of a shard that are not wholly outside the array."""
    n = 1
    for c, cs, i, g, s in zip(shard, meta.chunk_shape, meta.inner_chunk_shape, meta.inner_grid, meta.shape,
                              strict=True):
        n *= min(g, -(-(s - c * cs) // i))
    return n


def _checked(arr: ArrayMeta, files: StepFiles, key: str, ordinal: int, raw: memoryview, chunked: bool) -> Any:
    """A chunk's stored bytes (payload and crc32c) -> the payload, crc verified (a full link: its values)."""
    data = raw[:-4]
    check_chunk(arr, data, _CRC.unpack(raw[-4:])[0], key, (ordinal,))
    return data if chunked else decode_chunk(arr, data, key, (ordinal,))








def needs_chain(meta: ArrayMeta) -> bool:
    return meta.delta is not None


__all__: list[Any] = ["ChainReader", "needs_chain"]
