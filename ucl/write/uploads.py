"""Uploads to an object store: many objects in flight, few large ones.

Each request to an object store waits out its latency (tens of ms on S3), and a step is hundreds of
objects, most of them small (array documents, biases, norms), so they are sent many at once. An object
of LARGE_UPLOAD bytes or more (an S3 multipart upload from ``FsspecStore.write``, with parts of its own
in flight and in memory) takes one of a few slots, which bounds the memory of those parts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ucl.io.stores.base import Store

#: Uploads in flight.
UPLOADS = 16
#: Objects at least this large take a slot (``large`` of them at once).
LARGE_UPLOAD = 8 << 20


class Uploads:
    """``store.write`` calls on a pool of UPLOADS threads (at least ``large``), at most ``large`` of them
    for objects of LARGE_UPLOAD bytes or more. Made on first use; ``close`` waits for those in flight."""

    def __init__(self, store: Store, large: int) -> None:
        self.store = store
        self.threads = max(UPLOADS, large)
        self._large = threading.BoundedSemaphore(large)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, key: str, buffers: Sequence[Any]) -> Future[tuple[int, int]]:
        """Write ``buffers`` as object ``key``; the future gives ``store.write``'s (size, crc32c)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ucl-upload")
        if sum(memoryview(b).nbytes for b in buffers) < LARGE_UPLOAD:
            return self._pool.submit(self.store.write, key, buffers)
        return self._pool.submit(self._write_large, key, buffers)

    def _write_large(self, key: str, buffers: Sequence[Any]) -> tuple[int, int]:
        with self._large:
            return self.store.write(key, buffers)

    def close(self) -> None:
        """Wait for the uploads in flight; no new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
