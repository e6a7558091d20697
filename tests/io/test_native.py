"""The C write engine through ucl.io.native: bytes and checksums on disk, errors, faults, the GIL, close."""

from __future__ import annotations

import errno
import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ucl import _engine
from ucl.errors import InvalidArgumentError, UCLError, WriteError
from ucl.io.native import FileWriter, crc32c, fsync_dir, inject_fault

try:
    from google_crc32c import value as reference_crc32c
except ImportError:  # an independent reference when present, else our own (tested in test_crc32c.py)
    reference_crc32c = _engine.crc32c

MiB = 1 << 20
DIRECT = [pytest.param(True, id="direct"), pytest.param(False, id="buffered")]


@pytest.fixture(autouse=True)
def _no_faults():
    inject_fault(None)
    yield
    inject_fault(None)


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _check(path: Path, expected: bytes, result: tuple[int, int]) -> None:
    assert path.read_bytes() == expected
    assert result == (len(expected), reference_crc32c(expected))


# -- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("direct", DIRECT)
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 8 * MiB - 1, 8 * MiB, 8 * MiB + 1])
def test_round_trip_sizes(tmp_path: Path, direct: bool, n: int) -> None:
    data = _data(n, n)
    with FileWriter(direct=direct) as w:
        result = w.wait(w.submit(tmp_path / "f.bin", [data]))
    _check(tmp_path / "f.bin", data, result)
    assert oct((tmp_path / "f.bin").stat().st_mode & 0o777) == "0o644"


@pytest.mark.parametrize("direct", DIRECT)
@pytest.mark.parametrize("segment", [64 << 10, 8 * MiB])
def test_round_trip_50mib_of_odd_buffers(tmp_path: Path, direct: bool, segment: int) -> None:
    # Buffers of odd sizes and kinds, empty ones among them, cut across segment boundaries.
    sizes = [7, 0, 4093, 13 * MiB + 5, 1, 0, 9 * MiB - 3, 65537, 20 * MiB + 11]
    sizes.append(50 * MiB - sum(sizes))
    raw = [_data(s, i) for i, s in enumerate(sizes)]
    buffers = [
        raw[0],
        bytearray(raw[1]),
        memoryview(raw[2]),
        np.frombuffer(raw[3], dtype=np.uint8),
        raw[4],
        np.frombuffer(raw[5], dtype=np.float32),
        memoryview(b"x" + raw[6])[1:],
        bytearray(raw[7]),
        np.frombuffer(raw[8][: len(raw[8]) // 4 * 4], dtype=np.float32),
        raw[9],
    ]
    expected = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    with FileWriter(threads=3, direct=direct, segment_bytes=segment) as w:
        result = w.wait(w.submit(str(tmp_path / "a" / "b" / "f.bin"), buffers))
    _check(tmp_path / "a" / "b" / "f.bin", expected, result)


@pytest.mark.parametrize("direct", DIRECT)
@pytest.mark.parametrize("segment", [64 << 10, 8 * MiB])
def test_without_checksum_the_same_bytes_and_crc_zero(tmp_path: Path, direct: bool, segment: int) -> None:
    # the shard writer's case: many spans (chunks and their 4-byte crcs), unaligned after the first
    sizes = [4 * MiB, 4, 3 * MiB + 1, 4, 0, 9 * MiB - 3, 4, 4093, 20]
    raw = [_data(s, i) for i, s in enumerate(sizes)]
    buffers = [np.frombuffer(raw[0], dtype=np.uint8), *raw[1:]]
    expected = b"".join(raw)
    with FileWriter(threads=3, direct=direct, segment_bytes=segment) as w:
        plain = w.submit(str(tmp_path / "a.bin"), buffers, checksum=False)
        summed = w.submit(str(tmp_path / "b.bin"), buffers)
        assert w.wait(plain) == (len(expected), 0)
        _check(tmp_path / "b.bin", expected, w.wait(summed))
    assert (tmp_path / "a.bin").read_bytes() == expected


def test_aligned_source_is_written_in_place(tmp_path: Path) -> None:
    raw = np.empty(3 * MiB + 8192, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    src = raw[start : start + 3 * MiB + 100]  # aligned start, unaligned tail
    src[:] = np.frombuffer(_data(len(src)), dtype=np.uint8)
    with FileWriter(direct=True, segment_bytes=MiB) as w:
        result = w.wait(w.submit(tmp_path / "f.bin", [src]))
    _check(tmp_path / "f.bin", src.tobytes(), result)


def test_overwrites_an_existing_longer_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"z" * 100_000)
    with FileWriter() as w:
        result = w.wait(w.submit(path, [b"short"]))
    _check(path, b"short", result)


def test_torch_tensors_via_numpy(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    a = torch.arange(1000, dtype=torch.float32)
    b = torch.arange(333, dtype=torch.bfloat16)
    with FileWriter() as w:
        result = w.wait(w.submit(tmp_path / "t.bin", [a.numpy(), b.view(torch.uint8).numpy()]))
    expected = a.numpy().tobytes() + b.view(torch.uint8).numpy().tobytes()
    _check(tmp_path / "t.bin", expected, result)


def test_falls_back_to_buffered_where_o_direct_is_refused(tmp_path: Path) -> None:
    inject_fault("no_direct", nth=0)
    data = _data(3 * MiB + 5)
    pool = _engine.Pool(2, True, MiB)
    try:
        job = pool.submit(os.fsencode(tmp_path / "f.bin"), [data])
        err, _op, _offset, nbytes, crc, direct, _path = pool.wait(job, -1.0)
    finally:
        assert pool.close(-1.0)
    assert (err, nbytes, crc, direct) == (0, len(data), reference_crc32c(data), 0)
    assert (tmp_path / "f.bin").read_bytes() == data


# -- many jobs, several Python threads -------------------------------------------------------------
@pytest.mark.parametrize("direct", DIRECT)
def test_many_concurrent_jobs(tmp_path: Path, direct: bool) -> None:
    rng = random.Random(1)
    sizes = [rng.choice([0, 1, 4095, 4096, 4097, rng.randrange(1, 300_000)]) for _ in range(300)]
    blob = _data(300_000 + 4097)
    with FileWriter(threads=4, direct=direct, segment_bytes=16 << 10) as w:
        jobs = {}
        for i, n in enumerate(sizes):
            cut = rng.randrange(0, n + 1)
            parts = [blob[:cut], blob[cut + 1 : n + 1]]  # n bytes in two buffers
            jobs[i] = (w.submit(tmp_path / f"d{i % 7}" / f"{i}.bin", parts), b"".join(parts))
        order = list(jobs)
        rng.shuffle(order)
        for i in order:
            job, expected = jobs[i]
            _check(tmp_path / f"d{i % 7}" / f"{i}.bin", expected, w.wait(job))


def test_python_threads_share_a_writer(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def client(k: int, w: FileWriter) -> None:
        try:
            for i in range(40):
                data = _data(random.Random(k * 100 + i).randrange(0, 200_000), k * 100 + i)
                path = tmp_path / f"c{k}" / f"{i}.bin"
                _check(path, data, w.wait(w.submit(path, [data])))
        except BaseException as e:
            errors.append(e)

    with FileWriter(threads=3, segment_bytes=32 << 10) as w:
        ts = [threading.Thread(target=client, args=(k, w)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors


def test_wait_all_reaps_every_job(tmp_path: Path) -> None:
    with FileWriter() as w:
        jobs = [w.submit(tmp_path / f"{i}.bin", [_data(1000 * i, i)]) for i in range(20)]
        w.wait_all()
        with pytest.raises(InvalidArgumentError, match="already waited for"):
            w.wait(jobs[0])
    for i in range(20):
        assert (tmp_path / f"{i}.bin").read_bytes() == _data(1000 * i, i)


# -- buffers are held while in use and released exactly once --------------------------------------
def test_buffers_held_until_wait_then_released(tmp_path: Path) -> None:
    ba = bytearray(_data(5 * MiB))
    arr = np.frombuffer(_data(MiB), dtype=np.uint8).copy()
    refs = sys.getrefcount(arr)
    with FileWriter() as w:
        job = w.submit(tmp_path / "f.bin", [ba, arr])
        with pytest.raises(BufferError):
            ba.append(0)  # exported to the engine
        w.wait(job)
        ba.append(0)
        assert sys.getrefcount(arr) == refs
        # a submit that fails half way releases what it had taken
        with pytest.raises(InvalidArgumentError, match=r"buffers\[1\] .* has no buffer protocol \(int\)"):
            w.submit(tmp_path / "g.bin", [ba, 5])
        ba.append(0)
        with pytest.raises(InvalidArgumentError, match="is not C-contiguous"):
            w.submit(tmp_path / "g.bin", [arr, np.arange(10)[::2]])
        assert sys.getrefcount(arr) == refs


def test_close_releases_buffers_of_jobs_never_waited_for(tmp_path: Path) -> None:
    ba = bytearray(_data(MiB))
    w = FileWriter()
    w.submit(tmp_path / "f.bin", [ba])
    w.close()
    ba.append(0)


# -- errors ---------------------------------------------------------------------------------------
def _raises(w: FileWriter, job: int, err: int, message: str) -> WriteError:
    with pytest.raises(WriteError) as info:
        w.wait(job)
    e = info.value
    assert isinstance(e, OSError) and isinstance(e, UCLError) and e.code == "write_failed"
    assert e.errno == err
    assert e.message == message
    assert os.strerror(err) in str(e) and e.filename in str(e)
    return e


def test_directory_that_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"")
    under_file = str(tmp_path / "afile" / "sub" / "f.bin")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "deeper")
    under_dangling = str(tmp_path / "dangling" / "sub" / "f.bin")
    with FileWriter() as w:
        e = _raises(
            w,
            w.submit(under_file, [b"x"]),
            errno.ENOTDIR,
            f"Not a directory while opening {under_file} at offset 0",
        )
        assert e.filename == e.file == under_file
        _raises(
            w,
            w.submit(under_dangling, [b"x"]),
            errno.ENOENT,
            f"No such file or directory while creating the directory of {under_dangling} at offset 0",
        )
        # the writer still works
        w.wait(w.submit(tmp_path / "ok.bin", [b"x"]))


@pytest.mark.parametrize("direct", DIRECT)
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_injected_pwrite_error(tmp_path: Path, direct: bool, err: int) -> None:
    # One thread, 1 MiB segments: the 2nd pwrite is at 1 MiB with O_DIRECT (one per segment),
    # at 256 KiB buffered (the engine writes 256 KiB pieces, checksummed just before).
    path = str(tmp_path / "f.bin")
    with FileWriter(threads=1, direct=direct, segment_bytes=MiB) as w:
        inject_fault("pwrite", nth=2, errno=err)
        offset = MiB if direct else 256 << 10
        _raises(
            w,
            w.submit(path, [_data(3 * MiB)]),
            err,
            f"{os.strerror(err)} while writing {path} at offset {offset}",
        )
        inject_fault(None)
        w.wait(w.submit(path, [b"fine"]))


@pytest.mark.parametrize("direct", DIRECT)
def test_short_writes_continue(tmp_path: Path, direct: bool) -> None:
    inject_fault("short_write", nth=0)  # every pwrite writes half of what it is asked
    data = _data(5 * MiB + 4097)
    with FileWriter(direct=direct, segment_bytes=MiB) as w:
        result = w.wait(w.submit(tmp_path / "f.bin", [data[:12345], data[12345:]]))
    _check(tmp_path / "f.bin", data, result)


def test_injected_fdatasync_error(tmp_path: Path) -> None:
    path = str(tmp_path / "f.bin")
    with FileWriter() as w:
        inject_fault("fdatasync", nth=1, errno=errno.EIO)
        _raises(
            w,
            w.submit(path, [_data(10_000)]),
            errno.EIO,
            f"Input/output error while syncing {path} at offset 10000",
        )


def test_error_in_one_segment_fails_the_job_once(tmp_path: Path) -> None:
    path = str(tmp_path / "f.bin")
    with FileWriter(threads=4, segment_bytes=64 << 10) as w:
        inject_fault("pwrite", nth=0, errno=errno.ENOSPC)  # every write fails: the first error is reported
        with pytest.raises(WriteError) as info:
            w.wait(w.submit(path, [_data(4 * MiB)]))
        assert info.value.errno == errno.ENOSPC
        assert info.value.message.startswith(f"No space left on device while writing {path} at offset ")
        inject_fault(None)
        _check(Path(path), b"again", w.wait(w.submit(path, [b"again"])))


# -- the GIL ---------------------------------------------------------------------------------------
def test_gil_is_released_while_writing(tmp_path: Path) -> None:
    data = np.frombuffer(_data(8 * MiB), dtype=np.uint8)
    buffers = [data] * 25  # 200 MiB
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=count)
    with FileWriter() as w:
        t.start()
        try:
            t0 = time.perf_counter()
            job = w.submit(tmp_path / "big.bin", buffers)
            assert time.perf_counter() - t0 < 0.1  # submit returns at once
            before = ticks
            nbytes, crc = w.wait(job)
            during = ticks - before
        finally:
            stop.set()
            t.join()
    assert nbytes == 200 * MiB
    assert during > 10_000, f"the Python thread ran {during} loops during the write"


# -- close ------------------------------------------------------------------------------------------
def test_close_with_pending_jobs(tmp_path: Path) -> None:
    data = _data(4 * MiB)
    w = FileWriter(threads=1, segment_bytes=MiB)
    jobs = [w.submit(tmp_path / f"{i}.bin", [data]) for i in range(40)]
    t0 = time.perf_counter()
    w.close()
    assert time.perf_counter() - t0 < 10
    done = cancelled = 0
    for i, job in enumerate(jobs):
        try:
            _check(tmp_path / f"{i}.bin", data, w.wait(job))
            done += 1
        except WriteError as e:
            assert e.errno == errno.ECANCELED
            cancelled += 1
    assert done + cancelled == 40 and cancelled > 0
    with pytest.raises(InvalidArgumentError, match="FileWriter is closed"):
        w.submit(tmp_path / "late.bin", [data])
    w.close()  # twice is fine


def test_a_held_pool_starts_nothing_until_released(tmp_path: Path) -> None:
    # a save's copy while the previous step is written: the threads start no file and no segment
    data = _data(3 * MiB)
    with FileWriter(threads=2, segment_bytes=MiB) as w:
        w.hold(True)
        w.hold(True)  # holds nest
        job = w.submit(tmp_path / "f.bin", [data])
        with pytest.raises(TimeoutError):
            w.wait(job, timeout=0.3)
        assert not (tmp_path / "f.bin").exists()  # not even opened
        w.hold(False)
        with pytest.raises(TimeoutError):
            w.wait(job, timeout=0.3)
        w.hold(False)
        _check(tmp_path / "f.bin", data, w.wait(job, timeout=30))


def test_closing_a_held_pool_does_not_wait_for_the_release(tmp_path: Path) -> None:
    w = FileWriter(threads=1)
    w.hold(True)
    job = w.submit(tmp_path / "f.bin", [b"x"])
    t0 = time.perf_counter()
    w.close()
    assert time.perf_counter() - t0 < 10
    with pytest.raises(WriteError) as e:
        w.wait(job)
    assert e.value.errno == errno.ECANCELED
    w.hold(False)  # after close: nothing to release, no error


def test_wait_timeout_then_wait_again(tmp_path: Path) -> None:
    path = tmp_path / "f"
    inject_fault("stall")  # every open hangs until injection is off
    try:
        with FileWriter(threads=1, direct=False) as w:
            job = w.submit(path, [b"data"])
            with pytest.raises(TimeoutError, match="still running after 0.1 s"):
                w.wait(job, timeout=0.1)
            inject_fault(None)  # the open completes
            assert w.wait(job)[0] == 4 and path.read_bytes() == b"data"
    finally:
        inject_fault(None)


def test_close_timeout_then_close_again(tmp_path: Path) -> None:
    path = tmp_path / "f"
    inject_fault("stall")
    try:
        w = FileWriter(threads=1, direct=False)
        job = w.submit(path, [b"data"])
        time.sleep(0.3)  # let the thread reach the open() that hangs
        with pytest.raises(TimeoutError, match="still busy after 0.2 s"):
            w.close(timeout=0.2)
    finally:
        inject_fault(None)
    w.close(timeout=None)
    _raises(w, job, errno.ECANCELED, f"Operation canceled while writing {path} at offset 0")


def test_special_files_are_never_written(tmp_path: Path) -> None:
    """A FIFO or a symlink at a shard's name: the C writer neither blocks on it nor follows it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(outside)
    with FileWriter(threads=1, direct=False) as w:
        _raises(w, w.submit(fifo, [b"data"]), errno.ENXIO,
                f"No such device or address while opening {fifo} at offset 0")
        _raises(w, w.submit(link, [b"data"]), errno.ELOOP,
                f"Too many levels of symbolic links while opening {link} at offset 0")
    assert outside.read_bytes() == b"keep"


# -- fsync_dir, crc32c, arguments ------------------------------------------------------------------
def test_fsync_dir(tmp_path: Path) -> None:
    fsync_dir(tmp_path)
    missing = str(tmp_path / "missing")
    with pytest.raises(WriteError) as info:
        fsync_dir(missing)
    assert info.value.errno == errno.ENOENT
    assert (
        info.value.message == f"No such file or directory while syncing the directory {missing} at offset 0"
    )


def test_crc32c_wrapper() -> None:
    data = _data(100_003)
    assert crc32c(data) == reference_crc32c(data)
    assert crc32c(data[1000:], crc32c(data[:1000])) == crc32c(data)
    with pytest.raises(InvalidArgumentError):
        crc32c(data, -1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"threads": 0}, "threads must be"),
        ({"threads": True}, "threads must be"),
        ({"direct": "yes"}, "direct must be"),
        ({"segment_bytes": 1000}, "segment_bytes must be"),
        ({"segment_bytes": 0}, "segment_bytes must be"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        FileWriter(**kwargs)


def test_bad_submit_and_wait_arguments(tmp_path: Path) -> None:
    with FileWriter() as w:
        with pytest.raises(InvalidArgumentError, match="sequence of buffers"):
            w.submit(tmp_path / "f", b"bytes, not a list of buffers")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="no job 12345"):
            w.wait(12345)
        with pytest.raises(InvalidArgumentError, match="timeout"):
            w.wait(1, timeout=-1)
    with pytest.raises(InvalidArgumentError, match="kind must be"):
        inject_fault("bogus")
