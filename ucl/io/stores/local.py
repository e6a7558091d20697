"""Local filesystem backend: positional reads (preadv, GIL released), durable writes, atomic rename."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

from ucl.errors import InvalidNameError, WriteError
from ucl.io import native as _native
from ucl.io.ranges import preadv_all
from ucl.io.stores.base import Buffer, FileInfo, Store, check_key


def _load_syncfs() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_syncfs = _load_syncfs()
#: Whether :meth:`LocalStore.sync_all` can make everything durable with one syncfs(2) (a writer that
#: knows it skips its per-file fdatasync).
HAS_SYNCFS = _syncfs is not None


class LocalStore(Store):
    """A repository in a local directory.

    Every path is resolved under the root and refused if, through a symlink, it would leave it.
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self._real_root = os.path.realpath(self.root)

    @property
    def is_local(self) -> bool:
        return True

    def path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def local_path(self, key: str) -> str:
        return self._checked(key)

    def _checked(self, key: str) -> str:
        p = self.path(key)
        real = os.path.realpath(p)
        if real != self._real_root and not real.startswith(self._real_root + os.sep):
            raise InvalidNameError(f"{key!r} resolves to {real}, outside the repository {self.root}", file=key)
        return p

    def read(self, key: str) -> bytes:
        with open(self._checked(key), "rb") as f:
            return f.read()

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        fd = os.open(self._checked(key), os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def readinto(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        fd = os.open(self._checked(key), os.O_RDONLY)
        try:
            return preadv_all(fd, list(buffers), offset)
        finally:
            os.close(fd)

    def write(self, key: str, buffers: Sequence[Buffer], *, durable: bool = True) -> tuple[int, int]:
        p = self.path(key)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        crc = 0
        size = 0
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for b in buffers:
                    mv = memoryview(b).cast("B")
                    crc = _native.crc32c(mv, crc)
                    while mv.nbytes:
                        n = os.write(fd, mv)
                        mv = mv[n:]
                        size += n
                if durable:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _write_error(e, p, size) from e
        return size, crc

    def write_atomic(self, key: str, data: bytes) -> None:
        p = self.path(key)
        d = os.path.dirname(p)
        os.makedirs(d, exist_ok=True)
        tmp = f"{p}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fdatasync(f.fileno())
            os.replace(tmp, p)
            fsync_dir(d)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise _write_error(e, p, 0) from e

    def size(self, key: str) -> int | None:
        try:
            p = self._checked(key)
            return os.stat(p).st_size if os.path.isfile(p) else None
        except FileNotFoundError:
            return None

    def list_dir(self, prefix: str) -> list[str]:
        p = self._checked(prefix) if prefix else self.root
        try:
            return sorted(os.listdir(p))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete_prefix(self, prefix: str) -> None:
        p = self.path(prefix)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            self.delete(prefix)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    def walk(self, prefix: str) -> Iterator[FileInfo]:
        root = self.path(prefix)
        if os.path.isfile(root) or os.path.islink(root):
            st = os.lstat(root)
            yield FileInfo(prefix, st.st_size, st.st_mtime)
            return
        for dirpath, _, filenames in os.walk(root):
            for f in filenames:
                p = os.path.join(dirpath, f)
                st = os.lstat(p)
                yield FileInfo(os.path.relpath(p, self.root).replace(os.sep, "/"), st.st_size, st.st_mtime)

    def sync_dir(self, prefix: str) -> None:
        fsync_dir(self.path(prefix) if prefix else self.root)

    def sync_all(self) -> bool:
        """Make everything written to this filesystem durable with one syncfs(2): data, inodes and
        directory entries (one journal commit instead of one fsync per file and directory).
        Returns False where syncfs is unavailable (the caller then syncs file by file)."""
        if _syncfs is None:
            return False
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise _write_error(OSError(err, os.strerror(err)), self.root, 0)
        finally:
            os.close(fd)
        return True


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(e: OSError, path: str, offset: int) -> WriteError:
    err = WriteError(f"{os.strerror(e.errno or errno.EIO)} while writing {path} at offset {offset}", file=path)
    err.errno = e.errno
    err.filename = path
    return err
