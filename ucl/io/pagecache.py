"""Whether a byte range of a file is in the page cache (Linux cachestat(2), kernel >= 6.5).

A reader goes to the device with O_DIRECT only for ranges that are mostly not cached: for cached ones a
buffered read (a copy from the page cache) is faster.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
from typing import Any


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                                "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # the same number on every architecture
_syscall: Any = None  # libc's syscall(); False when unavailable


def mostly_cached(fd: int, offset: int, length: int) -> bool:
    """True when at least half of the pages of [offset, offset+length) are in the page cache; False when
    not, or when the kernel cannot say."""
    global _syscall
    if _syscall is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _syscall = libc.syscall
            _syscall.restype = ctypes.c_long
        except (OSError, AttributeError):
            _syscall = False
    if _syscall is False:
        return False
    rng = _CacheStatRange(offset, length)
    st = _CacheStat()
    if _syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(st),
                ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _syscall = False
        return False
    return bool(st.nr_cache * mmap.PAGESIZE * 2 >= length)
