"""Reading tensors of delta steps (spec/delta.md §6.3): per inner chunk, walk the tensor's links back to
the newest one that defines the chunk, read only those inner chunks (crc32c verified), decode forward.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ucl import dtypes
from ucl.boxread import Request, StepFiles, _shards_of
from ucl.delta.chain import (
    DEFAULT_MAX_CHAIN,
    ArrayInfo,
    StepInfo,
    reconstruct_inner,
    resolve_array_chain,
    resolve_chain,
)
from ucl.delta.codec import word_dtype
from ucl.delta.records import DeltaRecord
from ucl.errors import ChecksumError, CorruptShardIndexError, MissingShardError, ShardSizeError, UCLError
from ucl.metadata import ArrayMeta, StepMeta
from ucl.shard import EMPTY, decode_chunk

_CRC = struct.Struct("<I")

StepSource = Callable[[int], tuple[StepMeta, StepFiles]]  # step -> its metadata and files (cached by the caller)


class ChainReader:
    """Reads delta-encoded tensors of one step through its chain."""

    def __init__(self, step: int, get: StepSource, max_chain: int = DEFAULT_MAX_CHAIN) -> None:
        self.step = step
        self.get = get

        def info(s: int) -> StepInfo:
            m, _ = get(s)
            return StepInfo(s, m.kind, m.parent)

        self.steps = resolve_chain(step, info, max_chain)
        self.max_chain = max_chain
        self._links: dict[str, list[ArrayInfo]] = {}

    def links(self, name: str) -> list[ArrayInfo]:
        if name not in self._links:
            def get_array(s: int, n: str) -> ArrayInfo | None:
                a = self.get(s)[0].arrays.get(n)
                if a is None:
                    return None
                rec = DeltaRecord.from_dict(a.delta) if a.delta is not None else None
                return ArrayInfo(s, n, a.shape, a.dtype, a.chunk_shape, a.inner_chunk_shape, rec)

            self._links[name] = resolve_array_chain(self.step, name, get_array, self.steps, self.max_chain)
        return self._links[name]

    def _read_inner(self, step: int, name: str, coords: tuple[int, ...]) -> bytes | memoryview | None:
        meta, files = self.get(step)
        arr = meta.arrays[name]
        shard, ordinal = coords[:-1], coords[-1]
        rel = arr.shard_key(shard)
        chunked = arr.delta is not None
        if chunked and rel not in files.record.files:
            return None  # the whole shard is unchanged
        index = files.index(arr, shard)
        off, nb = (int(x) for x in index[ordinal])
        key, _ = files.shard(arr, shard)
        if off == EMPTY:
            if chunked:
                return None
            raise CorruptShardIndexError(f"{key}: inner chunk {ordinal} of tensor {name!r} is absent from its shard",
                                         tensor=name, file=key)
        try:
            raw = files.store.read_range(key, off, nb)
        except (FileNotFoundError, NotADirectoryError):
            raise MissingShardError(f"shard {key} of tensor {name!r} is missing", tensor=name, file=key) from None
        files.bytes_read += len(raw)
        if len(raw) != nb:
            raise ShardSizeError(f"{key}: the shard of tensor {name!r} is truncated", tensor=name, file=key)
        data = memoryview(raw)[:-4]
        from ucl import _native

        if _native.crc32c(data) != _CRC.unpack(raw[-4:])[0]:
            raise ChecksumError(f"{key}: inner chunk {ordinal} of tensor {name!r} (step {step}) fails its crc32c",
                                tensor=name, file=key)
        return data if chunked else decode_chunk(arr, data, key, (ordinal,))

    def read(self, req: Request) -> None:
        """Fill ``req.out`` with the box of the delta-step tensor ``req.meta``, bit-exactly."""
        meta, out = req.meta, req.out
        if any(n == 0 for n in req.shape):
            return
        links = self.links(meta.name)
        stop = tuple(a + n for a, n in zip(req.start, req.shape, strict=True))
        word = word_dtype(meta.itemsize)
        buf = np.empty(meta.inner_nbytes // np.dtype(word).itemsize, dtype=word)
        tdtype = dtypes.to_torch(meta.dtype)
        for shard in _shards_of(meta, req.start, stop):
            origin = [c * s for c, s in zip(shard, meta.chunk_shape, strict=True)]
            ranges = []
            for d in range(len(shard)):
                i = meta.inner_chunk_shape[d]
                ranges.append(range(max(0, (req.start[d] - origin[d]) // i),
                                    min(meta.inner_grid[d], -(-(stop[d] - origin[d]) // i))))
            for ic in itertools.product(*ranges):
                ordinal = int(np.ravel_multi_index(ic, meta.inner_grid)) if ic else 0
                try:
                    reconstruct_inner(links, (*shard, ordinal), self._read_inner, buf)
                except UCLError:
                    raise
                c_start = [o + c * i for o, c, i in zip(origin, ic, meta.inner_chunk_shape, strict=True)]
                lo = [max(a, b) for a, b in zip(c_start, req.start, strict=True)]
                hi = [min(a + i, s, b) for a, i, s, b in zip(c_start, meta.inner_chunk_shape, meta.shape, stop,
                                                             strict=True)]
                src = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, c_start, strict=True))
                dst = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, req.start, strict=True))
                t = _as_tensor(buf, meta, tdtype)
                out[dst] = t[src]


def _as_tensor(buf: np.ndarray, meta: ArrayMeta, tdtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(buf).view(torch.uint8)
    t = t.view(torch.uint8 if tdtype == torch.bool else tdtype)
    t = t.reshape(meta.inner_chunk_shape) if meta.inner_chunk_shape else t.reshape(())
    return t.view(torch.bool) if tdtype == torch.bool else t


def needs_chain(meta: ArrayMeta) -> bool:
    return meta.delta is not None


__all__: list[Any] = ["ChainReader", "needs_chain"]
