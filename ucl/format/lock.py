"""One writer per repository (spec/core.md §7, item 7).

- Local filesystems: an ``flock`` on ``<repo>/.ucl-writer.lock``; the kernel releases it when the holder
  dies, so a crashed job never blocks its restart.
- Object stores (no flock): a lease object ``<repo>/writer.lock`` created with a conditional write
  (``If-None-Match: *``, fsspec mode ``"xb"``): of two writers creating it, one fails. It holds the
  owner and an expiry time; the holder renews it while it writes (``renew``), and a writer finding an
  expired lease (its holder died) deletes it and retries the conditional create, so again one wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
from typing import Any

from ucl.errors import NotAFileError, WriteError, WriterLockedError
from ucl.format.repository import Repository

LEASE_S = 900.0
LOCAL_NAME = ".ucl-writer.lock"
REMOTE_NAME = "writer.lock"


class WriterLock:
    """The repository's write lock; ``release()`` (or process exit, locally) gives it up."""

    def __init__(self, repo: Repository, fd: int | None = None, lease: float = LEASE_S) -> None:
        self.repo, self.fd, self.lease = repo, fd, lease
        self._remote = fd is None
        self._released = False

    @classmethod
    def acquire(cls, repo: Repository, lease: float = LEASE_S) -> WriterLock:
        """Take the lock or raise WriterLockedError naming the holder."""
        if repo.store.is_local:
            return cls._acquire_local(repo)
        lock = cls(repo, None, lease)
        lock._acquire_remote()
        return lock

    @classmethod
    def _acquire_local(cls, repo: Repository) -> WriterLock:
        import fcntl

        path = repo.store.local_path(LOCAL_NAME)  # inside the repository (spec/core.md §3, item 2)
        assert path is not None
        try:  # never through a symlink planted at the name, never blocking on a FIFO
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise WriteError(f"cannot open the writer lock {path}: {os.strerror(e.errno or 0)}", file=path) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotAFileError(f"the writer lock {path} is not a regular file", file=path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise WriterLockedError(f"another writer holds {path}" + (f" (pid {holder})" if holder else ""),
                                    file=path) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return cls(repo, fd)

    # -- object stores -----------------------------------------------------------------------------
    def _doc(self) -> bytes:
        owner = f"{socket.gethostname()}:{os.getpid()}"
        return json.dumps({"owner": owner, "expires": time.time() + self.lease}).encode()

    def _acquire_remote(self) -> None:
        store: Any = self.repo.store
        path = store.path(REMOTE_NAME)
        for _ in range(2):
            try:
                with store.fs.open(path, "xb") as f:  # conditional create: fails if it exists
                    f.write(self._doc())
                return
            except FileExistsError:
                try:
                    held = json.loads(store.read(REMOTE_NAME))
                except (FileNotFoundError, ValueError):
                    held = {"expires": 0}
                if float(held.get("expires", 0)) > time.time():
                    owner = held.get("owner", "?")
                    raise WriterLockedError(f"another writer ({owner}) holds {self.repo.url}/{REMOTE_NAME} "
                                            "until its lease expires", file=REMOTE_NAME) from None
                store.delete(REMOTE_NAME)  # an expired lease: its holder died; race for it again
        raise WriterLockedError(f"another writer took {self.repo.url}/{REMOTE_NAME} first", file=REMOTE_NAME)

    def renew(self) -> None:
        """Extend the lease (object stores; the engine calls it at every commit)."""
        if self._remote and not self._released:
            self.repo.store.write(REMOTE_NAME, [self._doc()])

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        elif self._remote:
            self.repo.store.delete(REMOTE_NAME)

    def __del__(self) -> None:  # a lock dropped unreleased (a writer that failed): local flock only
        if getattr(self, "fd", None) is not None and not self._released:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # type: ignore[arg-type]
