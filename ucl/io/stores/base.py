"""The byte-access interface every backend implements (zarr-python's abc/store.py is the model).

A handful of abstract methods; everything else in ucl is built on them. Keys are '/'-separated paths
relative to the repository root, built by ucl from escaped names (ucl.format.names); backends still refuse a
key that could leave the root.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ucl.errors import InvalidArgumentError, InvalidNameError, LimitExceededError

Buffer = Any  # anything with the buffer protocol: bytes, memoryview, numpy array


@dataclass(frozen=True)
class FileInfo:
    """A file (object) of a store: its key, size and modification time (None when the backend does not say)."""

    key: str
    size: int
    mtime: float | None


def check_key(key: str) -> str:
    """Refuse keys that are empty, absolute, or contain '.', '..', empty segments or NUL."""
    if not key or key.startswith("/") or "\x00" in key or "\\" in key:
        raise InvalidNameError(f"storage key {key!r} is not a relative path", file=key)
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise InvalidNameError(f"storage key {key!r} has a segment {seg!r} that could leave the repository",
                                   file=key)
    return key


class Store(ABC):
    """Byte access to one repository.

    Writes are whole objects: ``write`` returns once the object is durable (fsync'd locally, or
    acknowledged by the object store); ``write_atomic`` additionally guarantees that a reader sees either
    nothing or the whole object, which the commit protocol relies on (spec/core.md §7).
    """

    url: str

    @property
    def is_local(self) -> bool:
        return False

    def local_path(self, key: str) -> str | None:
        """The file that holds ``key`` when the store is a local filesystem (checked: it never leaves the
        repository), else None. Readers of local files go through :class:`ucl.io.ranges.RangeReader`."""
        return None

    def write_path(self, key: str) -> str | None:
        """The file a writer that opens files itself (the C FileWriter) writes ``key`` to, on a local
        filesystem: checked like :meth:`local_path`, its directory created inside the repository. None for
        other stores."""
        return None

    @abstractmethod
    def read(self, key: str) -> bytes:
        """The whole object; FileNotFoundError when absent."""

    def read_bounded(self, key: str, limit: int) -> bytes:
        """The whole object, refused (LimitExceededError) when it is larger than ``limit`` bytes: before it
        is read where the size is known (a document's limit, a file's size in its commit record, spec/core.md
        §8.4). Backends that can also bound the read itself override this (LocalStore)."""
        size = self.size(key)
        if size is not None and size > limit:
            raise LimitExceededError(f"{key} is {size} bytes, more than the limit of {limit}", file=key)
        data = self.read(key)
        if len(data) > limit:
            raise LimitExceededError(f"{key} is {len(data)} bytes, more than the limit of {limit}", file=key)
        return data

    @abstractmethod
    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer only at the end of the object)."""

    @abstractmethod
    def write(self, key: str, buffers: Sequence[Buffer], *, durable: bool = True) -> tuple[int, int]:
        """Write the concatenation of ``buffers``; return (size, crc32c). Durable on return unless
        ``durable=False``, in which case a later :meth:`sync_all` makes it so."""

    @abstractmethod
    def write_atomic(self, key: str, data: bytes) -> None:
        """Write ``data`` so that readers see all of it or nothing, durably."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """Size of the object, or None when absent (a local store: NotAFileError when something that is not
        a regular file is there)."""

    @abstractmethod
    def list_dir(self, prefix: str) -> list[str]:
        """Names of the immediate children (objects and 'directories') under ``prefix``."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete ``prefix`` and everything under it (no error when absent)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object (no error when absent)."""

    # -- built on the abstract methods ------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def readinto(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` in order from ``offset``; returns the bytes read."""
        total = sum(b.nbytes for b in buffers)
        data = self.read_range(key, offset, total)
        pos = 0
        for b in buffers:
            n = min(b.nbytes, len(data) - pos)
            b[:n] = memoryview(data)[pos : pos + n].cast("B")
            pos += n
        return pos

    def walk(self, prefix: str) -> Iterator[FileInfo]:
        """Every file under ``prefix`` (recursively; ``prefix`` itself when it is a file), with size and
        modification time, for maintenance tools (gc, compact). Backends that cannot list raise."""
        raise InvalidArgumentError(f"cannot list {self.url}: the backend has no filesystem listing")
        yield  # pragma: no cover  (a generator)

    def makedirs(self, prefix: str) -> None:  # noqa: B027 - object stores: nothing to do
        """Create the directory ``prefix`` (object stores have none: nothing to do)."""

    def sync_dir(self, prefix: str) -> None:  # noqa: B027 - a default: object stores need nothing
        """Make directory entries under ``prefix`` durable (object stores need nothing)."""

    def sync_all(self) -> bool:
        """Make everything written so far durable at once, if the backend can (True), else False."""
        return not self.is_local

    def close(self) -> None:  # noqa: B027 - a default: a backend with nothing to release keeps it
        """Release resources (connections, pools)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
