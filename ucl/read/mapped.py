"""A lazy slice of rows served from the page cache by mapping it, not copying it.

A row slice of an :func:`~ucl.format.shardfile.aligned` array lies in whole inner chunks whose bytes are
whole pages of the shard file at page offsets (spec/core.md §6.1); so does any slice of a shard of one
inner chunk, at offset 0. When those pages are cached, mapping
each chunk copy-on-write into one reserved run of address space gives the rows as one contiguous tensor
with no copy: what safetensors' ``get_slice`` returns, but checked. Every mapped chunk's crc32c is
verified before the tensor is returned (reading it through the mapping is what maps its pages in), so
no check is dropped. Writes to the tensor stay private to it (MAP_PRIVATE).

A mapping is only made where a copy would cost more: a slice of at least :data:`MIN_BYTES`, all of a
tensor's trailing dimensions, inside one shard of a local file whose pages are mostly cached. Anything
else (a cold file, a compressed or delta array, a box across shards) returns None, and the caller reads
it as before (:mod:`ucl.read.boxes`). Committed files are never rewritten (spec/core.md §7), so the
mapped bytes stay those checked; a file truncated by hand under a live mapping would fault its reader
(SIGBUS), as any mapped reader does (``ReadOptions(map_slices=False)`` turns mapping off).
"""

from __future__ import annotations

import math
import mmap
import os
import struct

import torch

from ucl.errors import NotAFileError
from ucl.format import dtypes
from ucl.format.metadata import ArrayMeta
from ucl.format.shardfile import EMPTY, PAGE, chunk_checksum_error
from ucl.io import native as _native
from ucl.io.pagecache import mostly_cached
from ucl.io.ranges import open_regular
from ucl.read.files import StepFiles, absent, not_a_file, truncated

#: smaller slices are copied: a mapping's system calls and faults cost more than copying a few pages
MIN_BYTES = 1 << 20
_CRC = struct.Struct("<I")


def rows(files: StepFiles, meta: ArrayMeta, start: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor | None:
    """Rows ``[start[0], start[0] + shape[0])`` of ``meta`` (every other dimension whole) as a tensor over
    mapped, checked page-cache pages, or None when this box is not one to map (module docstring)."""
    if not shape or meta.delta is not None or meta.compression is not None:
        return None
    if any(start[1:]) or tuple(shape[1:]) != tuple(meta.shape[1:]) or shape[0] <= 0:
        return None
    inner = meta.inner_chunk_shape
    if tuple(inner[1:]) != tuple(meta.shape[1:]) or tuple(meta.chunk_shape[1:]) != tuple(meta.shape[1:]):
        return None  # an inner chunk is not a run of whole rows
    row = math.prod(meta.shape[1:]) * meta.itemsize
    if shape[0] * row < MIN_BYTES:
        return None
    a, b = start[0], start[0] + shape[0]
    cs = meta.chunk_shape[0]
    if a // cs != (b - 1) // cs:
        return None  # across shards
    coords = (a // cs,) + (0,) * (len(shape) - 1)
    key, size = files.shard(meta, coords)
    path = files.local_path(key)
    if path is None:
        return None
    origin = coords[0] * cs
    k0, k1 = (a - origin) // inner[0], (b - 1 - origin) // inner[0] + 1  # the inner chunks covered
    n = meta.inner_nbytes
    if k1 - k0 > 1 and n % PAGE:
        return None  # chunks that are not whole pages cannot follow each other in one mapping
    last = -(-n // PAGE) * PAGE  # the last chunk's mapping ends in the page holding its last byte
    try:
        fd, st = open_regular(path, name=key)
    except (FileNotFoundError, NotADirectoryError):
        raise files.missing(key, meta.name) from None
    except NotAFileError as e:
        raise not_a_file(e, key, meta.name) from None
    try:
        index = files.index(meta, coords)
        offs = [int(x) for x in index[k0:k1, 0]]
        for k, off in zip(range(k0, k1), offs, strict=True):
            if off == EMPTY:
                raise absent(key, [k, *([0] * (len(shape) - 1))], meta.name)
        if any(off % PAGE for off in offs):
            return None  # another writer's layout: copied
        if st.st_size < size:
            raise truncated(key, meta.name, st.st_size, size, 0)
        if not mostly_cached(fd, offs[0], offs[-1] + n - offs[0]):
            return None  # cold: the planned reads are faster than faulting pages in one by one
        view = mmap.mmap(-1, (k1 - k0 - 1) * n + last, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for j, off in enumerate(offs):
            err = _native.map_file(view, j * n, n if j < k1 - k0 - 1 else last, fd, off)
            if err:
                view.close()
                return None  # (ENOMEM: too many mappings, ENODEV: a file system without mmap) copied
        try:
            with memoryview(view) as mv:
                for j, off in enumerate(offs):
                    stored = os.pread(fd, 4, off + n)
                    if len(stored) != 4:
                        raise truncated(key, meta.name, None, off + n + 4, off + n)
                    # (not check_chunk: a raised error's frame would keep the slice of mv exported)
                    if _native.crc32c(mv[j * n : (j + 1) * n]) != _CRC.unpack(stored)[0]:
                        raise chunk_checksum_error(meta, key, (k0 + j,) + (0,) * (len(shape) - 1))
        except BaseException:
            view.close()
            raise
        flat = torch.frombuffer(view, dtype=torch.uint8)  # its storage keeps the mapping alive
        files.count((k1 - k0) * (n + 4))
    finally:
        os.close(fd)
    lo = (a - origin - k0 * inner[0]) * row
    return flat[lo : lo + shape[0] * row].view(dtypes.to_torch(meta.dtype)).reshape(shape)
