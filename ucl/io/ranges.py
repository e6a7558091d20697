"""The one reader of byte ranges of local files, shared by plain reads, delta-chain reads and the validator.

Large ranges whose pages are not in the page cache (:func:`ucl.io.pagecache.mostly_cached`) are read
with O_DIRECT into an aligned buffer of the process's :class:`~ucl.io.buffers.BufferPool`: the file's
pages never enter the page cache, so a cold load touches each byte of fresh memory once (the
destination) instead of twice (page cache + destination), reads exactly the bytes it needs (no
readahead), and the caller checks the bytes there before copying them anywhere. Other ranges are read
buffered, either into a pooled buffer (:meth:`RangeReader.read`) or straight into the caller's
destinations (:meth:`RangeReader.readinto`, vectored). Short reads are retried until the file ends.

A filesystem that refuses O_DIRECT (tmpfs, some FUSE; or a device wanting more than 4 KiB alignment)
is remembered by the reader, which then reads buffered.

Every local file ucl reads is opened by :func:`open_regular`: a FIFO, a device node, a socket or a
directory where a document or shard should be is refused (``NotAFileError``) before a byte is read, and
opening it never blocks (spec/core.md §8.4).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Sequence

import numpy as np

from ucl.errors import NotAFileError
from ucl.io import fds
from ucl.io.buffers import BufferPool, shared_pool
from ucl.io.pagecache import mostly_cached

ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses (512 B works here; 4 KiB everywhere)
IOV_MAX = 1024


_OPEN_FLAGS = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# errors of open(2) that mean "absent": the callers' FileNotFoundError / NotADirectoryError handling
_ABSENT = (errno.ENOENT, errno.ENOTDIR)


def file_kind(mode: int) -> str:
    """What a st_mode is, in words ("a FIFO")."""
    kinds = [(stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a device node"), (stat.S_ISBLK, "a device node"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISLNK, "a symbolic link")]
    return next((what for test, what in kinds if test(mode)), "a special file")


def not_a_file(path: str, mode: int, name: str | None = None) -> NotAFileError:
    return NotAFileError(f"{path} is {file_kind(mode)}, not a regular file: refused unread",
                         file=name or path)


def open_regular(path: str, flags: int = os.O_RDONLY, name: str | None = None) -> tuple[int, os.stat_result]:
    """Open ``path`` (``flags``: O_RDONLY, optionally O_DIRECT) if it is a regular file: ``(fd, fstat)``.

    Opened with O_NONBLOCK, so that opening a FIFO never waits for a writer, and checked with fstat on the
    opened descriptor (no window between check and open); O_NONBLOCK is cleared again before the caller
    reads. Anything else (FIFO, device, socket, directory) raises :class:`NotAFileError` naming ``name``
    (the key; default the path). A symlink loop raises it too. A missing file raises FileNotFoundError /
    NotADirectoryError as os.open does, too many open files an OSError that says so (:func:`fds.too_many`),
    other errors (EINVAL: no O_DIRECT here) as OSError.
    """
    try:
        fd = os.open(path, flags | _OPEN_FLAGS)
    except OSError as e:
        if e.errno in _ABSENT:
            raise
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise fds.too_many(e, path) from None
        # a device that cannot be opened (ENXIO, ENODEV, EPERM), O_DIRECT on a FIFO (EINVAL), a socket, a loop
        try:
            st = os.stat(path)
        except OSError as e2:
            if e2.errno == errno.ELOOP:
                raise NotAFileError(f"{path} is a symbolic link loop, not a regular file",
                                    file=name or path) from None
            raise e from None
        if not stat.S_ISREG(st.st_mode):
            raise not_a_file(path, st.st_mode, name) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_a_file(path, st.st_mode, name)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)  # sets the status flags only (O_DIRECT kept)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def preadv_all(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    """preadv until every buffer is full or the file ends (short reads and IOV_MAX handled)."""
    buffers = list(buffers)
    total = 0
    i = 0
    while i < len(buffers):
        n = os.preadv(fd, buffers[i : i + IOV_MAX], offset)
        if n == 0:
            break
        total += n
        offset += n
        while n and i < len(buffers):  # advance past whole buffers; split a partially filled one
            b = buffers[i]
            if n >= b.nbytes:
                n -= b.nbytes
                i += 1
            else:
                buffers[i] = b[n:]
                n = 0
    return total


def pread_direct(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset`` (both aligned) on an O_DIRECT descriptor; fewer bytes only at the end
    of the file."""
    got = 0
    while got < buf.nbytes:
        n = os.preadv(fd, [buf[got:]], offset + got)
        got += n
        if n == 0 or n % ALIGN:  # end of file (an unaligned count can only come from there)
            break
    return got


class Lease:
    """Bytes read into a pooled buffer: ``view`` holds exactly the bytes read (fewer than asked only at the
    end of the file) until :meth:`release` gives the buffer back."""

    __slots__ = ("view", "_buf", "_pool")

    def __init__(self, view: memoryview, buf: np.ndarray, pool: BufferPool) -> None:
        self.view = view
        self._buf: np.ndarray | None = buf
        self._pool = pool

    def release(self) -> None:
        if self._buf is not None:
            self.view = memoryview(b"")
            self._pool.put(self._buf)
            self._buf = None


class RangeReader:
    """Reads byte ranges of local files (see the module docstring).

    Parameters
    ----------
    direct
        Use O_DIRECT for cold ranges of at least ``direct_min_bytes`` (False: always buffered).
    direct_min_bytes
        Smaller ranges are read buffered (alignment overhead; readahead helps them).
    pool
        Where buffers come from (default: the process's pool).
    """

    def __init__(self, *, direct: bool = True, direct_min_bytes: int = 256 << 10,
                 pool: BufferPool | None = None) -> None:
        self.direct = direct  # cleared when the filesystem refuses O_DIRECT
        self.direct_min_bytes = direct_min_bytes
        self.pool = pool if pool is not None else shared_pool()

    def read(self, path: str, offset: int, length: int, *, direct_only: bool = False,
             buffer_bytes: int = 0) -> Lease | None:
        """Bytes [offset, offset + length) of ``path`` in a pooled buffer. With ``direct_only``: None when
        the range would be read buffered (the caller then reads it straight into its destinations).
        ``buffer_bytes``: an O_DIRECT read takes a buffer of at least this size, so that reads of varying
        lengths reuse the same few buffers instead of keeping one of each size class resident.

        Raises FileNotFoundError / NotADirectoryError for a missing file, NotAFileError for anything
        but a regular file (:func:`open_regular`), OSError for I/O errors.
        """
        if self.direct and length >= self.direct_min_bytes:
            lease = self._read_direct(path, offset, length, buffer_bytes)
            if lease is not None or direct_only:
                return lease
        elif direct_only:
            return None
        fd, _ = open_regular(path)
        try:
            buf = self.pool.get(length)
            mv = memoryview(buf)[:length]  # type: ignore[arg-type]
            try:
                got = preadv_all(fd, [mv], offset)
            except BaseException:
                self.pool.put(buf)
                raise
        finally:
            os.close(fd)
        return Lease(mv[:got], buf, self.pool)

    def readinto(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Buffered, vectored: fill ``buffers`` in order from ``offset``; the bytes read (fewer only at the
        end of the file)."""
        fd, _ = open_regular(path)
        try:
            return preadv_all(fd, buffers, offset)
        finally:
            os.close(fd)

    def _read_direct(self, path: str, offset: int, length: int, buffer_bytes: int = 0) -> Lease | None:
        """The range with O_DIRECT, or None: mostly cached (a buffered read is faster then), or no
        O_DIRECT on this filesystem (remembered)."""
        try:
            fd, _ = open_regular(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:  # no O_DIRECT here (a FIFO says EINVAL too: open_regular refused it)
                self.direct = False
                return None
            raise
        try:
            if mostly_cached(fd, offset, length):
                return None
            base = offset - offset % ALIGN
            span = -(-(offset + length - base) // ALIGN) * ALIGN
            buf = self.pool.get(max(span + ALIGN, buffer_bytes))
            skip = -buf.ctypes.data % ALIGN
            mv = memoryview(buf)[skip : skip + span]  # type: ignore[arg-type]
            try:
                got = pread_direct(fd, mv, base)
            except BaseException as e:
                self.pool.put(buf)
                if isinstance(e, OSError) and e.errno == errno.EINVAL:
                    self.direct = False  # the device wants more alignment: buffered from now on
                    return None
                raise
            lo = offset - base
            return Lease(mv[lo : max(lo, min(got, lo + length))], buf, self.pool)
        finally:
            os.close(fd)
