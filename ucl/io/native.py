"""The C write engine (``ucl._engine``) behind a small Python API.

A :class:`FileWriter` owns a pool of C threads that write whole files from the caller's memory with the
GIL released: each file is split into segments written by several threads at once (several requests in
flight), its crc32c is computed on the way, and it is ``fdatasync``'ed and closed before its job
completes. Policy (what to write, when to commit) stays with the caller; arguments are checked here,
the C side only moves bytes.
"""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from ucl import _engine  # the C extension; its types: ucl/_engine.pyi
from ucl.errors import InvalidArgumentError, WriteError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["DEFAULT_DIRECT", "FileWriter", "crc32c", "fsync_dir", "inject_fault"]

#: What ``direct=None`` means. Measured with bench/device_limit.py (2 GiB files, /dev/vda ext4, 2 shared
#: cores): O_DIRECT reached the device limit (1.5-1.9 GB/s median against 1.7-2.3, 0.19 CPU s/GB with the
#: bounce copy, 0.1 without) where buffered writes with early writeback gave 0.4-0.6 GB/s median at
#: 0.6-0.9 CPU s/GB, collapsing when the CPUs are busy (buffered peaked at 2.5 GB/s only on a quiet
#: machine). O_DIRECT also leaves the page cache to the training job.
DEFAULT_DIRECT = True

_FAULTS = {
    None: _engine.FAULT_NONE,
    "pwrite": _engine.FAULT_PWRITE,
    "short_write": _engine.FAULT_SHORT_WRITE,
    "fdatasync": _engine.FAULT_FDATASYNC,
    "no_direct": _engine.FAULT_NO_DIRECT,
    "stall": _engine.FAULT_STALL,
}


def _write_error(err: int, op: str, path: str, offset: int) -> WriteError:
    """The :class:`WriteError` for an errno the engine reported while doing ``op`` on ``path``."""
    e = WriteError(f"{os.strerror(err)} while {op} {path} at offset {offset}", file=path)
    e.errno = err
    # OSError.__str__ shows strerror and filename once filename is set: keep the offset in it.
    e.strerror = f"{os.strerror(err)} while {op} at offset {offset}"
    e.filename = path
    return e


class FileWriter:
    """Writes whole files on a pool of C threads, from the caller's memory, with the GIL released.

    Call sequence (one owner): ``submit`` each file, which returns at once; ``wait`` for each job (or
    ``wait_all``); ``close`` (or leave the ``with`` block). The buffers of a job are used in place (no
    copy at submit): they must stay alive and unchanged until ``wait`` has returned for that job.

    A file is opened with ``O_CREAT | O_TRUNC`` (mode 0644, missing parent directories created),
    allocated to its full size, written, ``fdatasync``'ed and closed. With ``direct``, the bulk goes
    through ``O_DIRECT`` from a 4 KiB-aligned bounce buffer per thread (no copy when the caller's
    memory is aligned) and the unaligned tail through a buffered descriptor; where the filesystem
    refuses ``O_DIRECT`` (``EINVAL``), and without ``direct``, writes are buffered and writeback starts
    every 32 MiB so that the final ``fdatasync`` has little left to do.

    Parameters
    ----------
    threads : int
        C threads, hence requests in flight (default 4).
    direct : bool or None
        ``O_DIRECT`` where the filesystem allows it (True), buffered writes (False), or the measured
        default :data:`DEFAULT_DIRECT` (None).
    segment_bytes : int
        Unit of work and of each write request: a multiple of 4096 (default 8 MiB).
    sync : bool
        ``fdatasync`` each file before its job completes (default). False leaves durability to the
        caller, who then makes everything durable at once (``syncfs``, as the engine does per save).

    Raises
    ------
    InvalidArgumentError
        For an argument out of range.
    OSError
        When the threads cannot be started.
    """

    def __init__(self, threads: int = 4, direct: bool | None = None, segment_bytes: int = 8 << 20,
                 sync: bool = True) -> None:
        if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 256:
            raise InvalidArgumentError(f"threads must be an int in [1, 256], got {threads!r}")
        if direct is not None and not isinstance(direct, bool):
            raise InvalidArgumentError(f"direct must be True, False or None, got {direct!r}")
        if (
            not isinstance(segment_bytes, int)
            or isinstance(segment_bytes, bool)
            or not 4096 <= segment_bytes <= 1 << 30
            or segment_bytes % 4096
        ):
            raise InvalidArgumentError(
                f"segment_bytes must be a multiple of 4096 in [4096, 1 GiB], got {segment_bytes!r}"
            )
        self.direct = DEFAULT_DIRECT if direct is None else direct
        self.sync = bool(sync)
        self._pool = _engine.Pool(threads, self.direct, segment_bytes, self.sync)
        self._closed = False

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def submit(self, path: str | os.PathLike[str], buffers: Sequence[Buffer], *,
               checksum: bool = True) -> int:
        """Queue the writing of ``path`` with the concatenation of ``buffers``; return at once.

        Parameters
        ----------
        path : str or os.PathLike
            The file to create or truncate. A relative path is resolved now.
        buffers : sequence of buffers
            C-contiguous objects with the buffer protocol (bytes, memoryview, numpy arrays, ...),
            used in place until ``wait`` returns for this job.
        checksum : bool
            Compute the content's crc32c on the way (default), returned by :meth:`wait`. False for a
            caller that checksums the bytes itself (the shard encoder does, chunk by chunk): one pass
            over the memory fewer, and :meth:`wait` returns 0 for it.

        Returns
        -------
        int
            The job id, for :meth:`wait`.

        Raises
        ------
        InvalidArgumentError
            If the writer is closed, or a buffer is not a C-contiguous buffer.
        """
        if self._closed:
            raise InvalidArgumentError("FileWriter is closed")
        if isinstance(buffers, (bytes, bytearray, memoryview, str)) or not isinstance(buffers, Sequence):
            raise InvalidArgumentError(
                f"buffers must be a sequence of buffers (a list or tuple), got {type(buffers).__name__}"
            )
        views: list[memoryview] = []
        try:
            for i, b in enumerate(buffers):
                try:
                    views.append(memoryview(b))
                except TypeError:
                    raise InvalidArgumentError(
                        f"buffers[{i}] of {os.fspath(path)!r} has no buffer protocol ({type(b).__name__})"
                    ) from None
                if not views[-1].c_contiguous:
                    raise InvalidArgumentError(f"buffers[{i}] of {os.fspath(path)!r} is not C-contiguous")
            job: int = self._pool.submit(os.fsencode(os.path.abspath(path)), views, bool(checksum))
            return job
        except BaseException:
            for v in views:  # the traceback keeps this frame: do not keep the callers' buffers exported
                v.release()
            raise

    def wait(self, job: int, timeout: float | None = None) -> tuple[int, int]:
        """Wait for a job to be written, synced and closed, and reap it.

        Parameters
        ----------
        job : int
            An id from :meth:`submit`, not yet waited for.
        timeout : float or None
            Seconds; None waits for as long as it takes.

        Returns
        -------
        tuple of (int, int)
            The file's size and the crc32c of its content (0 for a job submitted with
            ``checksum=False``).

        Raises
        ------
        WriteError
            If the file could not be written (``errno``, ``filename`` and the offset in the message);
            ``ECANCELED`` for a job that :meth:`close` cancelled.
        TimeoutError
            If the job is still running after ``timeout`` (it can be waited for again).
        InvalidArgumentError
            If ``job`` is unknown, already reaped or being waited for by another thread.
        """
        if timeout is not None and timeout < 0:
            raise InvalidArgumentError(f"timeout must be >= 0 or None, got {timeout!r}")
        try:
            res = self._pool.wait(job, -1.0 if timeout is None else float(timeout))
        except KeyError:
            raise InvalidArgumentError(
                f"no job {job!r} to wait for (unknown, or already waited for)"
            ) from None
        if res is None:
            raise TimeoutError(f"write job {job} still running after {timeout} s")
        err, op, offset, nbytes, crc, _direct, path = res
        if err:
            raise _write_error(err, op, os.fsdecode(path), offset)
        return nbytes, crc

    def wait_all(self) -> None:
        """Wait for every job not yet waited for, and reap them all.

        Raises
        ------
        WriteError
            The first failed job's error (by submission order), once every job is reaped.
        """
        first: WriteError | None = None
        for job in self._pool.jobs():
            try:
                self.wait(job)
            except WriteError as e:
                first = first or e
            except InvalidArgumentError:  # another thread is waiting for it
                pass
        if first is not None:
            raise first

    def hold(self, on: bool) -> None:
        """``True``: the threads start no new file or segment until a matching ``hold(False)`` (holds
        nest; what is in flight goes on; :meth:`close` ignores holds). For a caller that needs the CPU
        for a moment: a save's copy while the previous step is written (ucl.write.staging.CopyGate)."""
        if not self._closed:
            self._pool.hold(bool(on))

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the pool: cancel what has not started, let writes in flight end, join the threads.

        Jobs not yet started, and the unstarted segments of a job in progress, fail with
        ``ECANCELED``; results stay available to :meth:`wait`. Closing twice is allowed (a second call
        retries the join after a timeout).

        Parameters
        ----------
        timeout : float or None
            Seconds to wait for the threads; None waits for as long as it takes.

        Raises
        ------
        TimeoutError
            If a thread is still in a system call after ``timeout``.
        """
        self._closed = True
        if not self._pool.close(-1.0 if timeout is None else max(0.0, float(timeout))):
            raise TimeoutError(f"FileWriter threads still busy after {timeout} s")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` a directory, making the creation and renaming of its entries durable.

    Raises
    ------
    WriteError
        If it cannot be opened or synced.
    """
    err = _engine.fsync_dir(os.fsencode(path))
    if err:
        raise _write_error(err, "syncing the directory", os.fspath(path), 0)


def map_file(buffer: Buffer, at: int, length: int, fd: int, offset: int) -> int:
    """Map ``length`` bytes of ``fd`` from ``offset`` copy-on-write over bytes ``[at, at + length)`` of
    ``buffer``, an anonymous ``mmap.mmap`` that owns the address range (closing it unmaps the file's
    pages too). Page-aligned offsets and length only. Returns 0, or the errno of a refusal (EINVAL:
    not aligned or outside ``buffer``; ENODEV: a file system that cannot map)."""
    return _engine.map_file(buffer, at, length, fd, offset)


def crc32c(data: Buffer, value: int = 0) -> int:
    """The CRC-32C (Castagnoli) of ``data``, continuing from ``value`` (hardware when the CPU has it)."""
    if not 0 <= value < 1 << 32:
        raise InvalidArgumentError(f"value must be a 32-bit unsigned int, got {value!r}")
    crc: int = _engine.crc32c(data, value)
    return crc


def json_lint(data: Buffer) -> tuple[int, bool]:
    """(nesting depth, holds an integer outside [-2^63, 2^64)) of a JSON text, in one pass in C, so that
    the limits of spec/core.md §8.4 are checked before a parser recurses or converts huge numbers."""
    depth, wide = _engine.json_lint(data)
    return int(depth), bool(wide)


def inject_fault(kind: str | None, nth: int = 1, errno: int = _errno.EIO) -> None:
    """Test hook: make the engine fail, counting calls over all threads from now on.

    Parameters
    ----------
    kind : str or None
        ``"pwrite"`` fails the nth ``pwrite`` with ``errno``; ``"short_write"`` makes it write half
        of what it was asked (still 4 KiB-aligned with ``O_DIRECT``); ``"fdatasync"`` fails the nth
        ``fdatasync`` with ``errno``; ``"no_direct"`` refuses the nth ``O_DIRECT`` open with
        ``EINVAL``, as a filesystem without ``O_DIRECT`` does; ``"stall"`` holds every file's open until
        injection is turned off (a job that hangs, as on a stuck device). None turns injection off.
    nth : int
        Which call, from 1; 0 means every call.
    errno : int
        The error for ``"pwrite"`` and ``"fdatasync"`` (EIO, ENOSPC, ...).
    """
    if kind not in _FAULTS:
        raise InvalidArgumentError(
            f"kind must be one of {sorted(k for k in _FAULTS if k)} or None, got {kind!r}"
        )
    if not 0 <= nth < 1 << 32:
        raise InvalidArgumentError(f"nth must be >= 0, got {nth!r}")
    if errno <= 0:
        raise InvalidArgumentError(f"errno must be a positive errno value, got {errno!r}")
    _engine.inject_fault(_FAULTS[kind], nth, errno)
