"""Delta shards (spec/delta.md §4): encode a writer's block against its base block, inner chunk by chunk.

The writer's side of delta steps, next to ucl.format.shardfile's full shards: the same index and crc32c layout,
but an inner chunk equal to the base's is left absent, and a shard whose chunks all are is not written.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from ucl.delta.codec import encode_chunk, word_dtype
from ucl.format.metadata import ArrayMeta
from ucl.format.shardfile import EMPTY, as_bytes, contiguous_span, inner_chunks, is_full
from ucl.io import native as _native

_CRC = struct.Struct("<I")


def _words(mv: memoryview | bytes, itemsize: int) -> np.ndarray:
    return np.frombuffer(mv, dtype=word_dtype(itemsize))


def encode_delta_shard(meta: ArrayMeta, shard: tuple[int, ...], block: torch.Tensor, base: torch.Tensor,
                       encoding: str) -> list[Any] | None:
    """Buffers of the shard file of ``block`` encoded against ``base`` (same region of the base step),
    or None when every inner chunk is bit-identical (the shard is then not written at all)."""
    origin = [c * s for c, s in zip(shard, meta.chunk_shape, strict=True)]
    block, base = block.detach().contiguous(), base.detach().contiguous()
    raw_new, raw_base = as_bytes(block), as_bytes(base)
    itemsize = meta.itemsize
    buffers: list[Any] = []
    index = np.full((meta.n_inner, 2), EMPTY, dtype="<u8")
    offset = 0
    for c in inner_chunks(meta, shard):
        if c.empty:
            continue
        local = [slice(a - o, b - o) for a, b, o in zip(c.start, c.stop, origin, strict=True)]
        span = contiguous_span(block.shape, local)
        if is_full(meta, c) and span is not None:
            new = raw_new[span[0] * itemsize : span[1] * itemsize]
            old = raw_base[span[0] * itemsize : span[1] * itemsize]
        else:
            new, old = (_padded(meta, t, c, local) for t in (block, base))
        payload = encode_chunk(_words(new, itemsize), _words(old, itemsize), encoding)
        if payload is None:
            continue  # unchanged: absent from the index
        buffers.append(payload)
        buffers.append(_CRC.pack(_native.crc32c(payload)))
        index[c.ordinal] = (offset, len(payload) + 4)
        offset += len(payload) + 4
    if not buffers:
        return None
    idx = index.tobytes()
    buffers.append(idx)
    buffers.append(_CRC.pack(_native.crc32c(idx)))
    return buffers


def _padded(meta: ArrayMeta, t: torch.Tensor, c: Any, local: list[slice]) -> memoryview:
    padded = torch.zeros(meta.inner_chunk_shape, dtype=t.dtype)
    padded[tuple(slice(0, b - a) for a, b in zip(c.start, c.stop, strict=True))] = t[tuple(local)]
    return as_bytes(padded)
