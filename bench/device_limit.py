"""The disk's write limit beside the write engine's, in one run: is the engine in the way?

    ./dev bench device_limit [--gib 2] [--dir DIR] [--repeat 3]

Rows (GB/s = 1e9 bytes/s, from open to fsync done, median and best of --repeat runs taken in turn):

- device limit: plain O_DIRECT sequential write, 8 MiB blocks, 4 in flight, fdatasync (no copy, no crc),
  in the engine (``_engine.device_write``, engine/devbench.c: timed from open to fdatasync done)
- probe.c: the same from bench/probe.c, the probe of bench/peers.py and bench/save.py (a separate
  process, built with the system cc; timed from open to close): the two must agree
- FileWriter direct: the engine with O_DIRECT, source memory not aligned (copied into bounce buffers)
- FileWriter direct, aligned: the same with 4 KiB-aligned source memory (written in place)
- FileWriter buffered: the engine without O_DIRECT (page cache, writeback every 32 MiB)
- Python write + fsync: one buffered file.write of the whole buffer, then os.fsync

Sources are warm (page-touched) numpy buffers, so the figures are about the disk, not page faults.
CPU s/GB is this process's CPU time (all its threads, user + system) per GB written; the kernel's
writeback threads, which do the buffered rows' disk work, are not in it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import _common as c
import numpy as np

from ucl import _engine
from ucl.io.native import FileWriter

BLOCK = 8 << 20
INFLIGHT = 4


def device_limit(path_dir: str, nbytes: int, block: int = BLOCK, inflight: int = INFLIGHT) -> float:
    """Write ``nbytes`` to a new file in ``path_dir`` with plain O_DIRECT and return GB/s.

    Sequential ``block``-sized writes, ``inflight`` at a time (one C thread each, from pre-touched
    aligned memory), after allocating the file, then ``fdatasync``.

    Parameters
    ----------
    path_dir : str
        A directory on the device to measure (its filesystem must take O_DIRECT).
    nbytes : int
        Bytes to write, a multiple of 4096.
    block, inflight : int
        Request size (multiple of 4096) and requests in flight.

    Returns
    -------
    float
        GB/s (1e9 bytes per second).
    """
    if nbytes <= 0 or nbytes % 4096 or block <= 0 or block % 4096 or inflight < 1:
        raise ValueError("nbytes and block must be positive multiples of 4096, inflight >= 1")
    path = os.path.join(path_dir, "device_limit.bin")
    try:
        err, seconds = _engine.device_write(os.fsencode(path), nbytes, block, inflight)
        if err:
            raise OSError(err, os.strerror(err), path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return nbytes / seconds / 1e9


def probe_limit(path_dir: str, nbytes: int, block: int = BLOCK, inflight: int = INFLIGHT) -> float:
    """:func:`device_limit` through bench/probe.c (GB/s)."""
    where = os.path.join(path_dir, "probe")
    try:
        r = c.probe_write(where, [nbytes], threads=inflight, block=block)
    finally:
        for f in c.files_under([where]):
            os.unlink(f)
    return float(r["bytes"]) / float(r["seconds"]) / 1e9


def _filewriter(path_dir: str, src: memoryview, direct: bool) -> float:
    path = os.path.join(path_dir, "filewriter.bin")
    try:
        with FileWriter(threads=INFLIGHT, direct=direct, segment_bytes=BLOCK) as w:
            t0 = time.perf_counter()
            w.wait(w.submit(path, [src]))
            seconds = time.perf_counter() - t0
    finally:
        os.unlink(path)
    return len(src) / seconds / 1e9


def _python_buffered(path_dir: str, src: memoryview) -> float:
    path = os.path.join(path_dir, "python.bin")
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(src)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - t0
    finally:
        os.unlink(path)
    return len(src) / seconds / 1e9


def _warm_buffer(nbytes: int, aligned: bool) -> memoryview:
    """nbytes of non-repeating, page-touched memory; 4 KiB-aligned or deliberately not."""
    raw = np.empty(nbytes + 8192, dtype=np.uint8)
    start = -raw.ctypes.data % 4096 + (0 if aligned else 64)
    buf = raw[start : start + nbytes]
    seed = np.random.default_rng(0).integers(0, 256, size=1 << 20, dtype=np.uint8)
    for off in range(0, nbytes, len(seed)):  # touches every page
        n = min(len(seed), nbytes - off)
        buf[off : off + n] = seed[:n]
        buf[off : off + 8] = np.frombuffer(off.to_bytes(8, "little"), dtype=np.uint8)
    return memoryview(buf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="GiB per file (default 2)")
    ap.add_argument(
        "--dir", default=None, help="directory on the device to measure (default: a temp dir in .)"
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs of each row (default 3)")
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30)) // 4096 * 4096
    unaligned = _warm_buffer(nbytes, aligned=False)
    aligned = _warm_buffer(nbytes, aligned=True)
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="ucl-bench-") as d:
        rows: dict[str, Callable[[], float]] = {
            f"device limit (O_DIRECT, {BLOCK >> 20} MiB x{INFLIGHT})": lambda: device_limit(d, nbytes),
            "probe.c (the same, bench/probe.c)": lambda: probe_limit(d, nbytes),
            "FileWriter direct": lambda: _filewriter(d, unaligned, direct=True),
            "FileWriter direct, aligned": lambda: _filewriter(d, aligned, direct=True),
            "FileWriter buffered": lambda: _filewriter(d, unaligned, direct=False),
            "Python write + fsync": lambda: _python_buffered(d, unaligned),
        }
        runs: dict[str, list[float]] = {name: [] for name in rows}
        cpu: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.repeat):  # in turn, so a busy moment of a shared disk hits every row
            for name, fn in rows.items():
                c0 = time.process_time()
                runs[name].append(fn())
                cpu[name].append((time.process_time() - c0) / (nbytes / 1e9))
        print(f"{nbytes / (1 << 30):.2f} GiB per file, {args.repeat} runs, dir {os.path.abspath(d)}")
        print(f"{'':36} {'median GB/s':>11} {'best':>6} {'CPU s/GB':>9}   runs (GB/s)")
        for name, r in runs.items():
            print(
                f"{name:36} {statistics.median(r):11.2f} {max(r):6.2f} {statistics.median(cpu[name]):9.2f}   "
                + " ".join(f"{x:.2f}" for x in r)
            )


if __name__ == "__main__":
    main()
