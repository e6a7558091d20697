"""Delta shards (spec/delta.md §4): encode a writer's block against its base block, inner chunk by chunk.

The writer's side of delta steps, next to ucl.format.shardfile's full shards: the same index and crc32c layout,
but an inner chunk equal to the base's is left absent, and a shard whose chunks all are is not written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ucl.delta.codec import encode_chunk, word_dtype
from ucl.format.metadata import ArrayMeta
from ucl.format.shardfile import as_bytes, assemble, chunk_bytes, inner_chunks


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
    payloads = []
    for c in inner_chunks(meta, shard):
        if c.empty:
            continue
        new, old = (chunk_bytes(meta, c, t, raw, origin) for t, raw in ((block, raw_new), (base, raw_base)))
        payload = encode_chunk(_words(new, itemsize), _words(old, itemsize), encoding)
        if payload is not None:  # else unchanged: absent from the index
            payloads.append((c.ordinal, payload))
    return assemble(meta, payloads) if payloads else None

