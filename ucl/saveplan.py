"""Which shards this rank writes, and the arrays of the step: pure, no I/O.

Three sources of a plan, one shape of result (:class:`SavePlan`):

- one process: every tensor whole, one shard each;
- data-parallel replicas (every rank holds the same tensors): each tensor written by exactly one rank,
  assigned greedily by size so that the bytes are balanced across ranks;
- a layout (spec/layout.md): ``ucl.layout.plan_save`` says which blocks this rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ucl.metadata import ArrayMeta
from ucl.writer import all_shards, array_for

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class LocalWrite:
    """One shard this rank writes: the array, the shard's grid coordinates, and its source tensor."""

    array: ArrayMeta
    coords: tuple[int, ...]
    source: str  # flat name of the rank's local tensor
    box: Box | None = None  # part of the local tensor (None: the whole of it, or the shard's part of a whole tensor)


@dataclass(frozen=True)
class SavePlan:
    arrays: dict[str, ArrayMeta]  # every array of the step (the same on every rank)
    writes: list[LocalWrite]  # what this rank writes
    layout: dict[str, Any] | None = None
    mesh: dict[str, Any] | None = None

    @property
    def sources(self) -> set[str]:
        return {w.source for w in self.writes}


def single(tensors: dict[str, torch.Tensor], compression: dict[str, Any] | None = None) -> SavePlan:
    arrays = {n: array_for(n, t, compression=compression) for n, t in tensors.items()}
    return SavePlan(arrays, [LocalWrite(a, c, n) for n, a in arrays.items() for c in all_shards(a)])


def replicated(tensors: dict[str, torch.Tensor], rank: int, world: int,
               compression: dict[str, Any] | None = None) -> SavePlan:
    """Every rank holds the same tensors: each is written by one rank, bytes balanced (largest first)."""
    arrays = {n: array_for(n, t, compression=compression) for n, t in tensors.items()}
    load = [0] * world
    owner: dict[str, int] = {}
    for n in sorted(arrays, key=lambda n: (-arrays[n].nbytes, n)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[n] = r
        load[r] += max(arrays[n].nbytes, 1)
    writes = [LocalWrite(a, c, n) for n, a in arrays.items() if owner[n] == rank for c in all_shards(a)]
    return SavePlan(arrays, writes)
