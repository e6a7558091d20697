"""Types of the C extension ``ucl._engine`` (engine/module.c); the API with its checks is ucl.io.native.

Without this stub mypy resolves ``from ucl import _engine`` through ``ucl.__getattr__`` (the lazy loader of
the public names), whose ``Any`` it may not have analysed yet inside the package's import cycle.
"""

from collections.abc import Sequence

from typing_extensions import Buffer

FAULT_NONE: int
FAULT_PWRITE: int
FAULT_SHORT_WRITE: int
FAULT_FDATASYNC: int
FAULT_NO_DIRECT: int
FAULT_STALL: int

class Pool:
    def __init__(self, threads: int, direct: bool, segment: int, sync: bool = True) -> None: ...
    def submit(self, path: bytes, buffers: Sequence[Buffer], checksum: bool = True, /) -> int: ...
    # (errno, op, offset, nbytes, crc, direct, path) once the job is reaped; None on timeout (< 0: forever)
    def wait(self, job: int, timeout: float, /) -> tuple[int, str, int, int, int, int, bytes] | None: ...
    def jobs(self) -> list[int]: ...
    # True once every thread is joined, False on timeout (< 0: forever)
    def close(self, timeout: float, /) -> bool: ...
    def hold(self, on: bool, /) -> None: ...

def crc32c(data: Buffer, value: int = 0, /) -> int: ...
def crc32c_hw() -> bool: ...
def fsync_dir(path: bytes, /) -> int: ...  # errno, 0: done
def map_file(buffer: Buffer, at: int, length: int, fd: int, offset: int, /) -> int: ...  # errno, 0: done
def inject_fault(kind: int, nth: int, errno: int, /) -> None: ...
def device_write(path: bytes, nbytes: int, block: int, inflight: int, /) -> tuple[int, float]: ...  # (errno, s)
def json_lint(data: Buffer, /) -> tuple[int, int]: ...  # (depth, wide integer)

READ_OK: int  # a segment's status: delivered (any other: read it again the caller's way)

# read_segments(segs, chunks, tails, status, crcs, bufs, buf_len): engine/reader.h's tables
def read_segments(segs: Buffer, chunks: Buffer, tails: Buffer, status: Buffer, crcs: Buffer, bufs: Buffer,
                  buf_len: int, /) -> None: ...
