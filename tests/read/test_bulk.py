"""The C engine's path of a bulk read (ucl.read.bulk, engine/reader.c): cold segments whose chunks go whole
to contiguous destinations are read with O_DIRECT, checked and copied on C threads. These tests check that
it is taken, that it is bit-exact, and that whatever it cannot vouch for (a damaged chunk, a truncated
file, another writer's chunk order) is read again by the Python path and named exactly as that path
names it."""

from __future__ import annotations

import errno
import os
import re
import resource
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ucl
import ucl.io.ranges
import ucl.read.bulk as bulk
from ucl import _engine
from ucl.errors import ChecksumError, ShardSizeError
from ucl.format.shardfile import chunk_stride
from ucl.io import fds
from ucl.options import ReadOptions, WriteOptions

COLD = ReadOptions(direct_min_bytes=1)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "emb": torch.randn(3001, 257, generator=g),  # 3.1 MB, an awkward row count
        "w": torch.randn(1024, 1536, generator=g),  # 6.3 MB
        "h": torch.randn(4097, 129, generator=g).to(torch.bfloat16),
        "b": torch.randn(77, generator=g),  # a small shard: read with its index, the Python way
        "i": torch.arange(600_001, dtype=torch.int64),
    }


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    st = _state()
    ucl.save(st, tmp_path / "r", step=0, options=WriteOptions(inner_chunk_bytes=256 << 10))
    return tmp_path / "r", st


@pytest.fixture()
def engine(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every file cold (as a freshly booted node sees it); counts the segments the C engine delivered and
    those it handed back."""
    monkeypatch.setattr(ucl.io.ranges, "mostly_cached", lambda *a: False)
    seen = {"delivered": 0, "back": 0}
    orig = bulk.read

    def spy(files: Any, items: Any, threads: int, calls: Any = None) -> Any:
        rest = orig(files, items, threads, calls)
        seen["delivered"] += len(items) - len(rest)
        seen["back"] += len(rest)
        return rest

    monkeypatch.setattr(bulk, "read", spy)
    return seen


def _shard(repo: Path, name: str) -> Path:
    [p] = [p for p in (repo / "steps" / "0" / name / "c").rglob("*") if p.is_file()]
    return p


@pytest.mark.parametrize("segment", [256 << 10, 1 << 20, 8 << 20])
@pytest.mark.parametrize("threads", [1, 4])
def test_a_bulk_read_goes_through_the_engine_bit_exact(saved, engine, segment: int, threads: int) -> None:  # type: ignore[no-untyped-def]
    repo, st = saved
    opts = replace(COLD, segment_bytes=segment, threads=threads)
    with ucl.open(repo, options=opts) as ck:
        out = {n: torch.full_like(t, 7) for n, t in st.items()}
        ck.load_into(out)
        flat = ck.load(flat=True)
        assert ck._pool is not None  # the threaded path, which a read of more than 8 MiB takes
    for n, t in st.items():
        assert torch.equal(out[n], t) and torch.equal(flat[n], t), n
    assert engine["delivered"] >= 5 and engine["back"] == 0


def test_the_python_pipeline_reads_the_same_without_the_engine(saved, engine) -> None:  # type: ignore[no-untyped-def]
    repo, st = saved
    with ucl.open(repo, options=replace(COLD, native=False)) as ck:
        flat = ck.load(flat=True)
    assert all(torch.equal(flat[n], t) for n, t in st.items())
    assert engine["delivered"] == engine["back"] == 0


@pytest.mark.parametrize("where", ["data", "crc"])
def test_a_damaged_chunk_is_named_as_the_python_path_names_it(saved, engine, where: str) -> None:  # type: ignore[no-untyped-def]
    """A flipped bit in a chunk's bytes or in its stored crc32c: the engine hands the segment back, and
    the read fails naming the tensor and the chunk; the other segments were delivered by the engine."""
    repo, st = saved
    p = _shard(repo, "w")
    data = bytearray(p.read_bytes())
    with ucl.open(repo) as ck:
        meta = ck.array("w").meta
    # each inner chunk followed by its crc32c, chunk_stride apart
    at = chunk_stride(meta) * 2 + (1000 if where == "data" else meta.inner_nbytes + 2)
    data[at] ^= 0x20
    p.write_bytes(bytes(data))
    for how in ("load", "load_into"):
        with (ucl.open(repo, options=COLD) as ck,
              pytest.raises(ChecksumError, match=r"inner chunk \[2, 0\] of tensor 'w' fails its crc32c")):
            if how == "load":
                ck.load(flat=True)
            else:
                ck.load_into({n: torch.empty_like(t) for n, t in st.items()})
    assert engine["delivered"] > 0 and engine["back"] >= 2


def test_a_truncated_shard_is_named_as_the_python_path_names_it(saved, engine) -> None:  # type: ignore[no-untyped-def]
    repo, st = saved
    p = _shard(repo, "emb")
    os.truncate(p, p.stat().st_size - 5000)
    with ucl.open(repo, options=COLD) as ck, pytest.raises(ShardSizeError, match="shard of tensor 'emb' is truncated"):
        ck.load_into({n: torch.empty_like(t) for n, t in st.items()})


def test_the_engine_refuses_tables_that_reach_outside_their_buffers() -> None:
    seg = np.zeros(1, bulk._SEG)
    chunk = np.zeros(1, bulk._CHUNK)
    buf = np.zeros(3 * 4096, np.uint8)
    addr = np.asarray([buf.ctypes.data + (-buf.ctypes.data % 4096)], np.uint64).tobytes()
    out = bytearray(8)
    m = memoryview(out)

    def call(s: np.ndarray, c: np.ndarray, tails: bytes = b"", span: int = 4096) -> None:
        _engine.read_segments(s.tobytes(), c.tobytes(), tails, m[:4], m[4:], addr, span)

    cases = [
        ({"length": 100, "first": 0, "nchunks": 2}, {"off": 0, "nbytes": 50}, "chunks outside the chunk table"),
        ({"length": 100, "first": 0, "nchunks": 1}, {"off": 60, "nbytes": 50}, "a chunk outside its segment"),
        ({"length": 100, "first": 0, "nchunks": 1}, {"off": 0, "nbytes": 3}, "a chunk outside its segment"),
        ({"length": 100, "tail_off": 0, "tail_len": 9, "nchunks": 0}, {}, "tail outside the tails"),
        ({"length": 8000, "nchunks": 0}, {}, "larger than the buffers"),
    ]
    for s_fields, c_fields, msg in cases:
        s, c = seg.copy(), chunk.copy()
        for k, v in s_fields.items():
            s[0][k] = v
        for k, v in c_fields.items():
            c[0][k] = v
        with pytest.raises(ValueError, match=re.escape(msg)):
            call(s, c)
    with pytest.raises(ValueError, match="not a multiple"):
        _engine.read_segments(b"\0" * 7, b"", b"", m[:4], m[4:], addr, 4096)
    with pytest.raises(ValueError, match="4 KiB-aligned"):
        bad = np.asarray([buf.ctypes.data + (-buf.ctypes.data % 4096) + 8], np.uint64).tobytes()
        _engine.read_segments(seg.tobytes(), b"", b"", m[:4], m[4:], bad, 4096)


def test_every_engine_call_takes_buffers_of_one_size(saved, engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The C side's segment buffers are of the one size the Python path's O_DIRECT segments take
    (``segment_bytes`` + 3 pages), whatever the largest segment of a call: a size class per call meant
    fresh buffers for most calls of a process's first load, faulted in while the device waited."""
    import ucl.io.buffers

    monkeypatch.setattr(ucl.io.buffers, "_SHARED", None)  # a fresh pool: what this read leaves in it
    repo, st = saved
    seg = 1 << 20
    opts = replace(COLD, segment_bytes=seg, keep_buffer_bytes=1 << 30)
    sizes: list[int] = []
    orig = ucl.io.buffers.BufferPool.get

    def get(self: Any, n: int) -> Any:
        b = orig(self, n)
        sizes.append(b.nbytes)
        return b

    monkeypatch.setattr(ucl.io.buffers.BufferPool, "get", get)
    with ucl.open(repo, options=opts) as ck:
        out = {n: torch.empty_like(t) for n, t in st.items()}
        ck.load_into(out)
    assert engine["delivered"] > 1
    for n, t in st.items():
        assert torch.equal(out[n], t), n
    big = {c for c in sizes if c >= seg}
    assert big == {ucl.io.buffers.BufferPool.capacity(seg + 3 * ucl.io.ranges.ALIGN)}, sorted(big)


def test_a_batch_opens_its_files_before_it_waits_for_the_engine(saved, engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The lock that keeps one engine call at a time is held around the call only: a batch's files are
    opened and its tables built while the previous batch is still being read (the device waited through
    that Python work between calls)."""
    import ucl.read.boxes as boxes

    repo, st = saved
    events: list[str] = []
    orig_open, orig_native = bulk._open, boxes._execute_native

    class Recording:
        def __init__(self, lock: Any) -> None:
            self.lock = lock

        def __enter__(self) -> None:
            self.lock.acquire()
            events.append("enter")

        def __exit__(self, *exc: object) -> None:
            events.append("exit")
            self.lock.release()

    def opened(files: Any, key: str) -> Any:
        events.append("open")
        return orig_open(files, key)

    monkeypatch.setattr(bulk, "_open", opened)
    def native(files: Any, items: Any, threads: int, gate: Any) -> None:
        if not isinstance(gate.calls, Recording):
            gate.calls = Recording(gate.calls)
        orig_native(files, items, threads, gate)

    monkeypatch.setattr(boxes, "_execute_native", native)
    with ucl.open(repo, options=replace(COLD, threads=1, segment_bytes=256 << 10)) as ck:  # one batch at a time
        out = {n: torch.empty_like(t) for n, t in st.items()}
        ck.load_into(out)
    assert engine["delivered"] > 0
    for n, t in st.items():
        assert torch.equal(out[n], t), n
    assert events.count("enter") >= 2 and "open" in events, events
    for i, e in enumerate(events):  # no file opened while a call held the lock
        if e == "enter":
            assert events[i + 1] == "exit", events


@pytest.fixture()
def few_files() -> Any:
    """Lowers this process's limit of open files (soft RLIMIT_NOFILE) to what it holds now plus ``n``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def lower(n: int) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fds.in_use() + n, hard))

    yield lower
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_bulk_read_holds_no_more_files_than_the_process_may_open(tmp_path, engine, few_files) -> None:  # type: ignore[no-untyped-def]
    """1,200 small tensors, a file each, 150 files from the limit: every segment still through the C engine,
    bit-exact. The C side holds a call's files open until it ends and batches waiting for their call hold
    theirs; unbounded, a load of 3,000 such tensors under a limit of 1,024 failed with EMFILE."""
    st = {f"t{i}": torch.arange(2100, dtype=torch.float32) + i for i in range(1200)}  # 10 MB: a threaded read
    ucl.save(st, tmp_path / "r", step=0)
    with ucl.open(tmp_path / "r", options=COLD) as ck:
        few_files(150)
        out = {n: torch.empty_like(t) for n, t in st.items()}
        ck.load_into(out)
    assert engine["delivered"] == 1200 and engine["back"] == 0
    for n, t in st.items():
        assert torch.equal(out[n], t), n


def test_a_read_at_the_limit_of_open_files_says_so(saved, engine, few_files) -> None:  # type: ignore[no-untyped-def]
    repo, st = saved
    with ucl.open(repo, options=COLD) as ck:
        held = []
        few_files(3)
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        try:
            with pytest.raises(OSError, match=r"too many open files: cannot open .*steps/0/.*: this process already "
                                              r"holds its limit of \d+ open files \(RLIMIT_NOFILE\)") as e:
                ck.load_into({n: torch.empty_like(t) for n, t in st.items()})
            assert e.value.errno == errno.EMFILE
        finally:
            for fd in held:
                os.close(fd)


def test_only_a_read_through_the_engine_counts_the_open_files(saved, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Counting the open files lists /proc/self/fd (~1 ms in a process holding 2,000): a lazy read of a
    slice, which never reaches the C engine, must not pay it; a cold bulk read counts once."""
    monkeypatch.setattr(ucl.io.ranges, "mostly_cached", lambda *a: False)
    repo, st = saved
    calls = []
    orig = fds.headroom
    monkeypatch.setattr(fds, "headroom", lambda: calls.append(1) or orig())
    with ucl.open(repo, options=COLD) as ck:
        assert torch.equal(ck["w"][10:20], st["w"][10:20])
        assert calls == []
        ck.load_into({n: torch.empty_like(t) for n, t in st.items()})
    assert calls == [1]
