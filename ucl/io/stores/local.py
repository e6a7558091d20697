"""Local filesystem backend: positional reads (preadv, GIL released), durable writes, atomic rename; every
path contained in the root, every read of a regular file only."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import stat
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ucl.errors import InvalidNameError, LimitExceededError, NotAFileError, WriteError
from ucl.io import native as _native
from ucl.io.ranges import file_kind as _kind
from ucl.io.ranges import not_a_file, open_regular, preadv_all
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

    Containment (spec/core.md §3, item 2): every path, read or written, is resolved under the root and
    refused (``InvalidNameError``) if through a symlink it would leave it, or if it is a symlink loop. A
    path that is deleted may itself be a symlink (the link is removed, never followed); its directory may
    not leave the root. Reads open regular files only (:func:`ucl.io.ranges.open_regular`: a FIFO, device or
    directory is ``NotAFileError``, and opening never blocks). Creating files and directories fails with
    ``WriteError`` naming the path (a full disk, no inodes left, a file where a directory should be).
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self._real_root = os.path.realpath(self.root)
        # Directories this store created an entry in (a file, a directory) that is not durable yet. Every
        # commit point (write_atomic) makes them durable first, so that nothing a commit record names
        # can vanish in a power cut (spec/core.md §7, item 2c); sync_dir and sync_all clear them.
        self._dirty: set[str] = set()
        self._dirty_lock = threading.Lock()
        # Directories verified to be directories inside the root (or created by this store): a writer's
        # path costs one lstat per new directory, not a realpath per file. Forgotten when deleted.
        self._dirs_ok: set[str] = set()

    @property
    def is_local(self) -> bool:
        return True

    def path(self, key: str) -> str:
        """The path of ``key`` under the root, not resolved: callers that open it use :meth:`local_path`."""
        return os.path.join(self.root, *check_key(key).split("/"))

    def local_path(self, key: str) -> str:
        return self._checked(key)

    def write_path(self, key: str) -> str:
        """The path of ``key`` for a writer that opens it itself (the C FileWriter): checked like every
        path, its directory created inside the root, not a FIFO or device (an open would block)."""
        p, st = self._writable(key)
        self._entry_in(os.path.dirname(p))  # the writer creates the file
        if st is not None:
            if stat.S_ISLNK(st.st_mode):
                st = os.stat(p)  # contained (checked): what it points to must be a regular file too
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(p, st.st_mode)
        return p

    def _writable(self, key: str) -> tuple[str, os.stat_result | None]:
        """The path of ``key`` for writing, its directory made (inside the root), and what is there now
        (lstat; None when absent). A symlink there must resolve inside the root."""
        p = self.path(key)
        self._ensure_dir(os.path.dirname(p), key)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return p, None
        except OSError as e:
            raise _write_error(e, p, 0) from e
        if stat.S_ISLNK(st.st_mode):
            self._contained(p, key)
        return p, st

    # -- containment ---------------------------------------------------------------------------------
    def _contained(self, p: str, key: str) -> None:
        """Refuse ``p`` (the path of ``key`` or its directory) when it resolves outside the root."""
        real = os.path.realpath(p)
        if real != self._real_root and not real.startswith(self._real_root + os.sep):
            raise InvalidNameError(f"{key!r} resolves to {real}, outside the repository {self.root}",
                                   file=key)
        # realpath leaves a symlink loop unresolved: the result is the loop itself, or a path through it
        try:
            looped = stat.S_ISLNK(os.lstat(real).st_mode)
        except OSError as e:
            looped = e.errno == errno.ELOOP
        if looped:
            raise InvalidNameError(f"{key!r} does not resolve: a symbolic link loop at {real}", file=key)

    def _checked(self, key: str) -> str:
        """The path of ``key``, which must resolve (symlinks followed) inside the root. A path that is no
        symlink, in a directory known to resolve inside the root, costs one lstat (a read of a step opens
        hundreds of files: a realpath of each, one lstat per component in Python, held the GIL for ~30 ms
        of every load); any other is resolved whole."""
        p = self.path(key)
        if self._dir_inside(os.path.dirname(p)):
            try:
                if not stat.S_ISLNK(os.lstat(p).st_mode):
                    return p
            except OSError:
                pass  # absent, or not a directory on the way: the full check (and then the open) says which
        self._contained(p, key)
        return p

    def _dir_inside(self, d: str) -> bool:
        """True when directory ``d`` is known to resolve inside the root: checked or made by this store
        before, or now found to be a real directory (one lstat) whose parent is. A symlinked directory
        is left to the full check, every time, unless a writer of this store checked it."""
        if d in self._dirs_ok:
            return True
        if d != self.root and not (d.startswith(self.root + os.sep) and self._dir_inside(os.path.dirname(d))):
            return False
        try:
            st = os.stat(d) if d == self.root else os.lstat(d)  # the root may be a symlink: it is the root
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):  # below the root a symlink (lstat), or no directory at all
            return False
        self._dirs_ok.add(d)  # (writers skip making a directory in this set: it must exist)
        return True

    def _checked_parent(self, key: str) -> str:
        """The path of ``key``, whose directory must resolve inside the root; ``key`` itself may be a symlink
        (for deleting: the link is removed, never followed)."""
        p = self.path(key)
        self._contained(os.path.dirname(p), key)
        return p

    # -- reading -------------------------------------------------------------------------------------
    def _open(self, key: str) -> tuple[int, os.stat_result]:
        return open_regular(self._checked(key), name=key)

    def read(self, key: str) -> bytes:
        fd, _ = self._open(key)
        with open(fd, "rb", buffering=0) as f:  # closes fd
            return f.readall()

    def read_bounded(self, key: str, limit: int) -> bytes:
        """The whole file, refused unread (LimitExceededError) when its size exceeds ``limit``; never more
        than ``limit + 1`` bytes are read, even from a file that grows."""
        fd, st = self._open(key)
        try:
            if st.st_size > limit:
                raise _too_large(key, st.st_size, limit)
            data = _read_upto(fd, min(st.st_size, limit) + 1)
        finally:
            os.close(fd)
        if len(data) > limit:
            raise _too_large(key, len(data), limit)
        return data

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        fd, _ = self._open(key)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def readinto(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        fd, _ = self._open(key)
        try:
            return preadv_all(fd, list(buffers), offset)
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        """The size of a regular file, None when absent; NotAFileError for a FIFO, device or directory."""
        p = self._checked(key)
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):
            raise not_a_file(p, st.st_mode, key)
        return st.st_size

    def exists(self, key: str) -> bool:
        """Whether anything is at ``key``: also a FIFO, device or directory (present; refused when read)."""
        try:
            os.stat(self._checked(key))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def list_dir(self, prefix: str) -> list[str]:
        """The names in directory ``prefix`` ([] when absent); NotAFileError when something that is not a
        directory is there (a FIFO where ``commits/`` should be would hide every step)."""
        p = self._checked(prefix) if prefix else self.root
        try:
            return sorted(os.listdir(p))
        except (FileNotFoundError, NotADirectoryError) as e:
            try:
                st = os.stat(p)
            except OSError:
                return []
            if isinstance(e, NotADirectoryError) and not stat.S_ISDIR(st.st_mode):
                raise NotAFileError(f"{p} is {_kind(st.st_mode)}, not a directory", file=prefix) from None
            return []

    def walk(self, prefix: str) -> Iterator[FileInfo]:
        """Every file under ``prefix`` (which must resolve inside the root), never following a symlink:
        a symlink, FIFO or device is reported as a file itself (lstat), a symlinked directory below
        ``prefix`` is not entered."""
        root = self._checked(prefix)
        try:
            st = os.lstat(root)
        except (FileNotFoundError, NotADirectoryError):
            return
        if not stat.S_ISDIR(st.st_mode):
            yield FileInfo(prefix, st.st_size, st.st_mtime)
            return
        for dirpath, _, filenames in os.walk(root):  # followlinks=False
            for f in filenames:
                p = os.path.join(dirpath, f)
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                yield FileInfo(os.path.relpath(p, self.root).replace(os.sep, "/"), st.st_size, st.st_mtime)

    # -- writing -------------------------------------------------------------------------------------
    def makedirs(self, prefix: str) -> None:
        """Create the directory ``prefix`` and its parents, inside the root."""
        self._ensure_dir(self.path(prefix) if prefix else self.root, prefix)

    def _ensure_dir(self, d: str, key: str) -> None:
        """``d`` (the root or a directory below it) exists as a directory inside the root, the missing ones
        created: each directory is checked once (lstat; a symlink must resolve inside the root) and then
        remembered."""
        if d in self._dirs_ok:
            return
        if d == self.root:
            self._makedirs(d)  # the repository's own directory (and its parents, outside it)
            self._dirs_ok.add(d)
            return
        self._ensure_dir(os.path.dirname(d), key)
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            try:
                os.mkdir(d)
            except FileExistsError:  # made meanwhile (another thread): checked below
                st = os.lstat(d)
            except OSError as e:  # ENOSPC / EDQUOT (no inodes), EACCES
                raise _write_error(e, d, 0, "creating the directory") from e
            else:
                self._entry_in(os.path.dirname(d))
                self._dirs_ok.add(d)
                return
        except OSError as e:
            raise _write_error(e, d, 0, "creating the directory") from e
        if stat.S_ISLNK(st.st_mode):
            self._contained(d, key)  # followed, as readers follow it, only when it stays inside
            st = os.stat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise _write_error(OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)), d, 0, "creating the directory")
        self._dirs_ok.add(d)

    def _forget_dirs(self, p: str) -> None:
        """``p`` and what was below it are gone: their directories must be checked again."""
        # a snapshot (copied under the GIL), then removed in place: another thread (a manager's persister)
        # may add to the set meanwhile, and iterating a set that grows raises
        gone = [d for d in self._dirs_ok.copy() if d == p or d.startswith(p + os.sep)]
        self._dirs_ok.difference_update(gone)

    def _makedirs(self, d: str) -> None:
        if os.path.isdir(d):
            return
        missing = []  # the directories this call creates, deepest first
        q = d
        while not os.path.isdir(q) and os.path.dirname(q) != q:
            missing.append(q)
            q = os.path.dirname(q)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:  # ENOSPC / EDQUOT (no inodes), ENOTDIR, EEXIST (a file is there), EACCES
            raise _write_error(e, d, 0, "creating the directory") from e
        for m in missing:  # each new directory is an entry in its parent (a new repository's: outside it)
            self._entry_in(os.path.dirname(m))

    def _entry_in(self, d: str) -> None:
        with self._dirty_lock:
            self._dirty.add(d)

    def _synced(self, dirs: set[str] | str) -> None:
        with self._dirty_lock:
            self._dirty -= {dirs} if isinstance(dirs, str) else dirs

    def sync_created(self, *, but: str | None = None) -> None:
        """fsync every directory this store created entries in since they were last made durable (all but
        ``but``, which the caller syncs itself)."""
        with self._dirty_lock:
            dirs = sorted(self._dirty - {but}, key=len, reverse=True)
        for d in dirs:
            try:
                fsync_dir(d)
            except FileNotFoundError:  # removed since (a staging directory moved into place)
                pass
            except OSError as e:
                raise _write_error(e, d, 0, "syncing the directory") from e
        self._synced(set(dirs))

    def write(self, key: str, buffers: Sequence[Buffer], *, durable: bool = True) -> tuple[int, int]:
        p, _ = self._writable(key)
        crc = 0
        size = 0
        try:
            try:
                fd = _create(p, os.O_TRUNC)
            except FileNotFoundError:  # its directory went since it was checked (moved, deleted): again
                self._forget_dirs(os.path.dirname(p))
                self._ensure_dir(os.path.dirname(p), key)
                fd = _create(p, os.O_TRUNC)
            self._entry_in(os.path.dirname(p))
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
        except WriteError:
            raise
        except OSError as e:
            raise _write_error(e, p, size) from e
        return size, crc

    def write_atomic(self, key: str, data: bytes) -> None:
        p, _ = self._writable(key)
        d = os.path.dirname(p)
        tmp = f"{p}.tmp-{os.getpid()}-{threading.get_native_id()}"  # two threads may write one key at once
        try:
            fd = _create(tmp, os.O_TRUNC | os.O_NOFOLLOW)  # never through a symlink planted at the name
            try:
                mv = memoryview(data).cast("B")
                while mv.nbytes:
                    mv = mv[os.write(fd, mv):]
                os.fdatasync(fd)
            finally:
                os.close(fd)
            self.sync_created()  # a commit point: everything created before it durable first
            os.replace(tmp, p)
            fsync_dir(d)
            self._synced(d)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # never follows: a symlink planted at the name goes, not its target
            if isinstance(e, WriteError):
                raise
            raise _write_error(e, p, 0) from e

    def delete_prefix(self, prefix: str) -> None:
        p = self._checked_parent(prefix)
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            self._forget_dirs(p)  # gone already (moved away): nothing of it is known any more
            return
        if stat.S_ISDIR(st.st_mode):  # a real directory (not a symlink to one): rmtree never follows links
            shutil.rmtree(p, ignore_errors=True)
            self._forget_dirs(p)
        else:
            self.delete(prefix)

    def delete(self, key: str) -> None:
        p = self._checked_parent(key)
        try:
            os.unlink(p)  # a symlink: the link itself
            self._forget_dirs(p)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:  # a directory where a file should be (EISDIR), permissions
            raise _write_error(e, p, 0, "deleting") from e

    def sync_dir(self, prefix: str) -> None:
        p = self._checked(prefix) if prefix else self.root
        try:
            fsync_dir(p)
        except OSError as e:
            raise _write_error(e, p, 0, "syncing the directory") from e
        self._synced(p)

    def sync_all(self) -> bool:
        """Make everything written to this filesystem durable with one syncfs(2): data, inodes and
        directory entries (one journal commit instead of one fsync per file and directory).
        Returns False where syncfs is unavailable (the caller then syncs file by file)."""
        if _syncfs is None:
            return False
        with self._dirty_lock:
            dirs = set(self._dirty)  # what syncfs covers: entries made before it
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise _write_error(OSError(err, os.strerror(err)), self.root, 0)
        finally:
            os.close(fd)
        # a new repository's own entry is in its parent, maybe on another filesystem than syncfs covered
        self._synced({d for d in dirs if d == self._real_root or d.startswith(self.root)})
        return True


def _create(path: str, flags: int) -> int:
    """Open ``path`` for writing, created if absent; a FIFO, device or directory there is refused without
    blocking (O_NONBLOCK: a FIFO without a reader fails with ENXIO instead of waiting for one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | flags, 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # O_NONBLOCK off again
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_upto(fd: int, n: int) -> bytes:
    """At most ``n`` bytes from the file's offset (fewer only at its end)."""
    first = os.read(fd, n)
    if len(first) == n or not first:
        return first
    parts, got = [first], len(first)
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _too_large(key: str, size: int, limit: int) -> LimitExceededError:
    return LimitExceededError(f"{key} is {size} bytes, more than the limit of {limit}", file=key)


def _not_regular(path: str, mode: int) -> WriteError:
    err = WriteError(f"{path} is {_kind(mode)}, not a regular file: not written", file=path)
    err.filename = path
    return err


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(e: OSError, path: str, offset: int, what: str = "") -> WriteError:
    where = f"{what} {path}" if what else f"writing {path} at offset {offset}"
    err = WriteError(f"{os.strerror(e.errno or errno.EIO)} while {where}", file=path)
    err.errno = e.errno
    err.filename = path
    return err
