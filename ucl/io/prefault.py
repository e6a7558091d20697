"""Mapping a read's fresh destination pages on a side thread while the device works.

Fresh memory is slow to fault in on this kind of machine (a virtual machine whose free pages go back to
the host): destinations not mapped yet (``load()``'s new tensors) are populated (MADV_POPULATE_WRITE),
which is cheaper than faulting page by page in the copies (a medium ``load()``: 1.25 s instead of
2.0 s). Destinations already mapped (``load_into`` a model's tensors) are found with mincore and left
alone. Content is never changed, so this can race with the readers. (MADV_HUGEPAGE on the destinations
made it 3x slower: synchronous compaction.)
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
from collections.abc import Iterable
from typing import Any

_MADV_POPULATE_WRITE = 23


class Prefaulter:
    """Populates the unmapped pages of some memory regions on a thread; :meth:`stop` joins it."""

    STEP = 8 << 20
    MIN_BYTES = 8 << 20  # reads smaller than this are not worth a thread
    _libc: Any = None

    def __init__(self, steps: list[tuple[int, int]]) -> None:
        self.steps = steps
        self._halt = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ucl-prefault", daemon=True)
        self.thread.start()

    @classmethod
    def start_for(cls, regions: Iterable[tuple[int, int]]) -> Prefaulter | None:
        """A prefaulter for the (address, nbytes) regions, or None when there is nothing worth doing."""
        regions = list(regions)
        if cls._libc is False or sum(n for _, n in regions) < cls.MIN_BYTES:
            return None
        libc = cls._load()
        if libc is None:
            return None
        page = mmap.PAGESIZE
        steps = []
        for a, n in regions:
            lo, hi = -(-a // page) * page, (a + n) // page * page
            if hi - lo < cls.STEP:
                continue
            vec = (ctypes.c_ubyte * ((hi - lo) // page))()
            if libc.mincore(lo, hi - lo, vec) != 0:
                continue
            if 0 not in bytes(vec):
                continue  # every page mapped already
            steps += [(x, min(cls.STEP, hi - x)) for x in range(lo, hi, cls.STEP)]
        return cls(steps) if steps else None

    @classmethod
    def _load(cls) -> Any:
        if cls._libc is None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
                cls._libc = libc
            except (OSError, AttributeError):
                cls._libc = False
        return cls._libc or None

    def _run(self) -> None:
        libc = self._libc
        for a, n in self.steps:
            if self._halt.is_set():
                return
            if libc.madvise(a, n, _MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:  # kernel < 5.14
                    type(self)._libc = False
                return

    def stop(self) -> None:
        self._halt.set()
        self.thread.join()
