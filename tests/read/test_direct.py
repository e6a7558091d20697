"""The O_DIRECT path of plain reads (ucl.io.ranges under ucl.read.boxes): same bytes, same checks, same errors
as buffered reads. O_DIRECT is for bulk reads (load, load_into, layout and DCP loads: ``direct=True``); a
lazy read of a tensor or slice reads through the page cache, so the tests here read in bulk (:func:`_bulk`)."""

from __future__ import annotations

import errno
import os
import re
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ucl
import ucl.format.shardfile
import ucl.io.ranges
from ucl.errors import ChecksumError, ShardSizeError
from ucl.io.pagecache import mostly_cached
from ucl.io.ranges import RangeReader
from ucl.options import ReadOptions, WriteOptions
from ucl.read.chunks import Request
from ucl.read.tensors import apply_post, normalize_index


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(3001, 513, generator=g),  # 3001 is prime: 3001 inner chunks of one row
        "b": torch.randn(700, 300, generator=g).bfloat16(),  # inner chunks of 350 rows (210 kB)
        "c": torch.randn(5, generator=g),
        "d": torch.rand(2049, 1025, generator=g) > 0.5,
        "z": torch.zeros(400, 1000).index_fill_(0, torch.arange(0, 400, 3), 2.5),
    }


def _bulk(ck: ucl.Checkpoint, name: str, index: object = ...) -> torch.Tensor:
    """``ck[name][index]`` read as a bulk read reads it (cold segments may go O_DIRECT)."""
    lt = ck[name]
    start, shape, post = normalize_index(index, tuple(lt.shape), name)
    out = torch.empty(shape, dtype=lt.dtype)
    ck.read_requests([Request(lt.meta, start, shape, out)], direct=True)
    return apply_post(out, post)


def _drop(root: Path) -> None:
    for dirpath, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@pytest.fixture()
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, torch.Tensor]]:
    st = _state()
    opts = WriteOptions(inner_chunk_bytes=300_000)
    ucl.save({k: v for k, v in st.items() if k != "z"}, tmp_path / "r", step=0, options=opts)
    ucl.save({"z": st["z"]}, tmp_path / "rz", step=0, compression="zstd", options=opts)
    return tmp_path, st


ALL_DIRECT = ReadOptions(direct_min_bytes=1)  # every segment through O_DIRECT, however small


@pytest.fixture()
def direct(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every segment through O_DIRECT (cached or not; read with ALL_DIRECT); counts the reads that were."""
    calls = {"direct": 0}
    orig = RangeReader._read_direct

    def spy(self, *a):  # type: ignore[no-untyped-def]
        r = orig(self, *a)
        calls["direct"] += r is not None
        return r

    monkeypatch.setattr(RangeReader, "_read_direct", spy)
    monkeypatch.setattr(ucl.io.ranges, "mostly_cached", lambda *a: False)
    return calls


@pytest.mark.parametrize("segment", [8192, 300_004, 1 << 20, 8 << 20])
def test_direct_reads_are_bit_exact(saved, direct, monkeypatch, segment) -> None:  # type: ignore[no-untyped-def]
    root, st = saved
    opts = replace(ALL_DIRECT, segment_bytes=segment)  # 8192: every segment one chunk
    for repo, names in ((root / "r", "abcd"), (root / "rz", "z")):
        with ucl.open(repo, options=opts) as ck:
            for n in names:
                t = st[n]
                assert torch.equal(_bulk(ck, n), t)
                for sl in (slice(1, 2), slice(17, 1500), slice(None, None, 3), slice(-7, None)):
                    assert torch.equal(_bulk(ck, n, sl), t[sl])
                if t.dim() == 2:
                    assert torch.equal(_bulk(ck, n, (slice(5, 390), slice(7, 300))), t[5:390, 7:300])
            out = {n: torch.empty_like(st[n]) for n in names}
            ck.load_into(out)
            assert all(torch.equal(out[n], st[n]) for n in names)
    assert direct["direct"] > 0


def test_cold_segments_of_bulk_reads_go_direct_lazy_and_warm_ones_buffered(saved, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    root, st = saved
    shard = root / "r" / "steps" / "0" / "a" / "c" / "0" / "0"
    fd = os.open(shard, os.O_RDONLY)
    try:
        os.pread(fd, 1 << 20, 0)
        if mostly_cached(fd, 0, 1 << 20) is False:
            pytest.skip("the kernel cannot say what is cached (no cachestat)")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert not mostly_cached(fd, 0, 1 << 20)
    finally:
        os.close(fd)
    kinds: list[str] = []
    orig_d, orig_b = RangeReader._read_direct, RangeReader.readinto

    def d(self, *a):  # type: ignore[no-untyped-def]
        r = orig_d(self, *a)
        kinds.append("d" if r is not None else "-")
        return r

    monkeypatch.setattr(RangeReader, "_read_direct", d)
    monkeypatch.setattr(RangeReader, "readinto", lambda self, *a: kinds.append("b") or orig_b(self, *a))
    _drop(root)
    assert torch.equal(_bulk(ucl.open(root / "r"), "a"), st["a"])
    assert kinds and set(kinds) == {"d"}  # cold: every segment of 'a' (6 MB) through O_DIRECT
    kinds.clear()
    out = {"a": torch.empty_like(st["a"])}
    ucl.open(root / "r").load_into(out)
    assert torch.equal(out["a"], st["a"])
    assert set(kinds) == {"d"}  # O_DIRECT left nothing in the page cache
    kinds.clear()
    assert torch.equal(ucl.open(root / "r")["a"][100:2000], st["a"][100:2000])  # a lazy read, cold
    assert kinds and set(kinds) == {"b"}  # through the page cache, which holds those bytes now
    fd = os.open(shard, os.O_RDONLY)
    try:
        assert mostly_cached(fd, 100 * 513 * 4, 1800 * 513 * 4)
    finally:
        os.close(fd)
    shard.read_bytes()  # warm it all
    kinds.clear()
    assert torch.equal(_bulk(ucl.open(root / "r"), "a"), st["a"])
    assert kinds and set(kinds) == {"-", "b"}  # warm: buffered, bulk read or not


@pytest.mark.parametrize("segment", [8192, 8 << 20])
@pytest.mark.parametrize("pos", [10, 300_002, 1_000_000])
def test_direct_reads_check_every_chunk(saved, direct, monkeypatch, segment, pos) -> None:  # type: ignore[no-untyped-def]
    root, _ = saved
    shard = root / "r" / "steps" / "0" / "a" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[pos] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"inner chunk \[\d+, 0\] of tensor 'a' fails its crc32c"):
        _bulk(ucl.open(root / "r", options=replace(ALL_DIRECT, segment_bytes=segment)), "a")


def test_direct_read_of_a_truncated_shard_raises(saved, direct) -> None:  # type: ignore[no-untyped-def]
    root, _ = saved
    ck = ucl.open(root / "r", options=ALL_DIRECT)
    ck["a"][:1]  # the index is read (and cached) while the shard is whole
    shard = root / "r" / "steps" / "0" / "a" / "c" / "0" / "0"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(ShardSizeError, match="the shard is truncated"):
        _bulk(ck, "a")


def test_filesystem_without_o_direct_falls_back(saved, direct, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    root, st = saved
    real_open = os.open

    def no_direct(path, flags, *a):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    ck = ucl.open(root / "r", options=ALL_DIRECT)
    assert torch.equal(_bulk(ck, "a"), st["a"])
    assert not ck._files.ranges.direct and direct["direct"] == 0


def test_small_shards_are_read_with_their_index_once(saved) -> None:  # type: ignore[no-untyped-def]
    root, st = saved
    ck = ucl.open(root / "r")
    size = ck.record.files["c/c/0"][0]
    out = ck.load(flat=True)
    assert torch.equal(out["c"], st["c"])
    ck2 = ucl.open(root / "r")
    assert torch.equal(ck2["c"][...], st["c"]) and ck2.bytes_read == size  # one read: data + index


@pytest.mark.parametrize("index", [(slice(None),), (slice(300, 400),), (slice(None), slice(0, 5))])
def test_an_absent_chunk_is_an_error_on_every_path(tmp_path, monkeypatch, index) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    from ucl.errors import CorruptShardIndexError
    from ucl.io import native as _native

    t = torch.randn(1024, 256)  # 16 inner chunks of 64 rows: whole rows (bulk plan) or a column box
    ucl.save({"t": t}, tmp_path, step=0, options=WriteOptions(inner_chunk_bytes=64 << 10))
    shard = tmp_path / "steps" / "0" / "t" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    n = 16 * 16 + 4
    idx = np.frombuffer(bytes(data[-n:-4]), dtype="<u8").reshape(16, 2).copy()
    idx[5] = ucl.format.shardfile.EMPTY
    body = idx.tobytes()
    data[-n:] = body + _native.crc32c(body).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShardIndexError, match=r"inner chunk \[5, 0\] of tensor 't' is absent"):
        ucl.open(tmp_path)["t"][index]


def test_device_refusing_the_alignment_falls_back(saved, direct, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    root, st = saved

    def refuse(*a):  # type: ignore[no-untyped-def]
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(ucl.io.ranges, "pread_direct", refuse)
    ck = ucl.open(root / "r", options=ALL_DIRECT)
    assert torch.equal(_bulk(ck, "a"), st["a"]) and torch.equal(_bulk(ck, "b", slice(3, 600)), st["b"][3:600])
    assert not ck._files.ranges.direct and direct["direct"] == 0


def _many(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A step of 40 arrays, 9.6 MB in all (a threaded read planned in several batches), inner chunks of
    60 kB: segments of several chunks each."""
    g = torch.Generator().manual_seed(5)
    st = {f"t{i:02d}": torch.randn(60 + i, 1000, generator=g) for i in range(40)}
    ucl.save(st, tmp_path / "m", step=0, options=WriteOptions(inner_chunk_bytes=60_000))
    return tmp_path / "m", st


@pytest.mark.parametrize("check_threads", [0, 2])
def test_a_bulk_read_checks_on_its_check_threads(tmp_path, direct, monkeypatch, check_threads) -> None:  # type: ignore[no-untyped-def]
    """Segments read with O_DIRECT are checked and copied on the step's check threads (the read threads
    go on reading), or on the read threads with ``check_threads=0``; bit-exact either way, every segment
    read once, in batches of arrays (the first read starts before the last array is planned)."""
    import ucl.read.boxes as boxes

    repo, st = _many(tmp_path)
    where: list[str] = []
    orig = boxes._from_memory

    def spy(*a):  # type: ignore[no-untyped-def]
        where.append(threading.current_thread().name)
        return orig(*a)

    monkeypatch.setattr(boxes, "_from_memory", spy)
    batches: list[int] = []
    orig_b = boxes._batches
    monkeypatch.setattr(boxes, "_batches", lambda live, t: [batches.append(len(b)) or b for b in orig_b(live, t)])
    # the Python pipeline (the C engine's path, ucl.read.bulk, has its own tests: test_bulk.py)
    opts = replace(ALL_DIRECT, check_threads=check_threads, segment_bytes=256 << 10, native=False)
    with ucl.open(repo, options=opts) as ck:
        out = {n: torch.empty_like(t) for n, t in st.items()}
        ck.load_into(out)
        assert all(torch.equal(out[n], st[n]) for n in st)
    assert batches == [4, 8, 16, 12]  # every array in exactly one batch, in order
    assert direct["direct"] == len(where) > 40
    prefix = "ucl-check" if check_threads else "ucl-read"
    assert all(w.startswith(prefix) for w in where), set(where)


def test_a_damaged_chunk_found_on_a_check_thread_fails_the_read_and_frees_its_buffers(tmp_path, direct) -> None:  # type: ignore[no-untyped-def]
    """A crc32c mismatch found on a check thread is the read's ChecksumError, naming the tensor; every
    buffer slot comes back, so the next reads on the same step still run (and run bit-exact)."""
    repo, st = _many(tmp_path)
    [shard] = [p for p in (repo / "steps" / "0" / "t17").rglob("*") if p.is_file() and p.name != "zarr.json"]
    data = bytearray(shard.read_bytes())
    data[70_000] ^= 8  # the second inner chunk
    shard.write_bytes(bytes(data))
    healthy = {n: torch.empty_like(t) for n, t in st.items() if n != "t17"}
    failed: list[BaseException] = []

    def reads() -> None:
        # the Python pipeline's check threads (the C engine's path: test_bulk.py)
        with ucl.open(repo, options=replace(ALL_DIRECT, segment_bytes=256 << 10, native=False)) as ck:
            for _ in range(8):  # more failed reads than slots: a slot leaked by each would block a later one
                try:
                    ck.load_into({n: torch.empty_like(t) for n, t in st.items()})
                except ChecksumError as e:
                    failed.append(e)
            ck.load_into(healthy)

    t = threading.Thread(target=reads, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "a read after failed ones did not finish"
    assert len(failed) == 8
    assert all(re.search(r"inner chunk \[1, 0\] of tensor 't17' fails its crc32c", str(e)) for e in failed)
    assert all(torch.equal(healthy[n], st[n]) for n in healthy)


def test_segments_a_bulk_read_reads_buffered_hold_no_buffer_slot(tmp_path, direct) -> None:  # type: ignore[no-untyped-def]
    """A bulk read's segments below ``direct_min_bytes`` are read buffered, straight into their
    destinations: the buffer slot each took for an O_DIRECT read is given back at once (hundreds of
    them, far more than the slots, still finish), and the bytes are exact."""
    repo, st = _many(tmp_path)
    out = {n: torch.empty_like(t) for n, t in st.items()}

    def read() -> None:
        with ucl.open(repo, options=ReadOptions(segment_bytes=128 << 10)) as ck:
            ck.load_into(out)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the read did not finish"
    assert direct["direct"] == 0  # every segment buffered
    assert all(torch.equal(out[n], st[n]) for n in st)
