"""File descriptors: how many this process may still open, and the budget a read's concurrent batches
share so that a state of thousands of files never needs more than the process may hold (RLIMIT_NOFILE is
1,024 by default on many systems; a bulk read's C engine keeps a batch's files open until its call ends,
and batches waiting for the engine keep theirs)."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import threading
from collections.abc import Iterator

_UNLIMITED = 1 << 20


def limit() -> int:
    """The soft RLIMIT_NOFILE: the descriptors this process may hold."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _UNLIMITED if soft == resource.RLIM_INFINITY else int(soft)


def in_use() -> int:
    """Descriptors open now (0 where the system does not list them, or no descriptor is left to list them)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(d)) - 1  # less the listing's own
    return 0


def headroom() -> int:
    """Descriptors this process may still open."""
    return max(0, limit() - in_use())


def too_many(e: OSError, path: str) -> OSError:
    """EMFILE / ENFILE from opening ``path``, said in words (still an OSError with its errno)."""
    if e.errno == errno.ENFILE:
        why = "the system's table of open files is full"
    else:
        why = (f"this process already holds its limit of {limit()} open files (RLIMIT_NOFILE): raise it "
               "(ulimit -n) or close files")
    return OSError(e.errno, f"too many open files: cannot open {path}: {why}", path)


class Budget:
    """``size`` descriptors that several threads take and give back in whole batches: a batch waits until
    all it asks for is free (never part of it, so two batches never wait for each other's)."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._free = self.size
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        n = min(n, self.size)
        with self._cond:
            self._cond.wait_for(lambda: self._free >= n)
            self._free -= n
        try:
            yield
        finally:
            with self._cond:
                self._free += n
                self._cond.notify_all()
