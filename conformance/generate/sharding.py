"""``cases/sharding.json``: arrays of several shards (core.md §6 Arrays, §6.1 Shard encoding).

Written shard by shard with ``StepWriter``, as ranks would, with chunk grids of one writer's block: clipped
edge shards, padded edge chunks and absent inner chunks wholly outside the array; read through boxes that
cross shard and inner-chunk boundaries. And grid chunks rounded up past the array's end along a dimension
one writer holds whole (core.md §6 "Inner chunks"), with inner chunks that split two dimensions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ucl.format.metadata import ArrayMeta
from ucl.plan.save import array_for

from .fixture import Fx, multi_shard_arrays, random_tensor
from .suite import S_ARRAYS, S_SHARD, Cases


def build(root: Path, cases: Cases) -> None:
    # multi-shard arrays (chunk grid = one writer's block)
    fx = "valid/multi_shard"
    arrays = multi_shard_arrays(400)
    Fx(root, fx).write(2, arrays)
    tensors = {m.name: t for m, t in arrays}
    cases.valid(
        "multi-shard arrays with clipped edge shards and absent outside chunks validate",
        S_SHARD,
        fx,
        "validate",
    )
    cases.valid("multi-shard step opens", S_ARRAYS, fx, "open", step=2, keys=sorted(tensors))
    cases.reads(
        S_SHARD,
        fx,
        tensors,
        boxes={
            "w": [
                [[3, 9], [2, 5]],
                [[9, 10], [6, 7]],
                [[0, 10], [3, 4]],
                [[4, 4], [0, 7]],
                [[8, 10], [0, 7]],
            ],
            "v": [[[3, 9]], [[8, 9]]],
            "m": [[[1, 4], [1, 3], [1, 3]], [[4, 5], [0, 4], [2, 3]]],
            "i": [[[2, 4], [2, 4]]],
            "f8": [[[0, 7], [1, 4]], [[6, 7], [4, 5]]],
        },
    )

    # grid chunks past the array's end (core.md §6 "Inner chunks"): a writer holding a dimension whole
    # rounds its chunk up to a multiple of the inner chunk; edge inner chunks padded, those wholly outside
    # absent; and inner chunks splitting two dimensions of a writer's block
    fx = "valid/rounded_grid"
    arrays = rounded_grid_arrays(420)
    Fx(root, fx).write(1, arrays)
    tensors = {m.name: t for m, t in arrays}
    cases.valid(
        "grid chunks larger than the array along a dimension held whole validate",
        S_ARRAYS,
        fx,
        "validate",
    )
    cases.valid("a step with grid chunks past the array's end opens", S_ARRAYS, fx, "open", step=1,
                keys=sorted(tensors))
    cases.reads(
        S_ARRAYS,
        fx,
        tensors,
        boxes={
            "w": [[[8, 10], [0, 7]], [[2, 9], [3, 5]], [[9, 10], [6, 7]]],
            "far": [[[7, 10], [1, 2]], [[0, 10], [0, 3]]],
            "v": [[[4, 9]], [[8, 9]]],
            "m": [[[3, 7], [1, 5]], [[6, 7], [4, 5]], [[0, 4], [2, 3]]],
        },
    )


def rounded_grid_arrays(seed: int) -> list[tuple[ArrayMeta, torch.Tensor]]:
    """Arrays whose grid chunk passes the array's end along a dimension one writer holds whole."""
    specs = [
        # name, shape, dtype, chunk (rounded up past the shape), inner chunk
        ("w", (10, 7), torch.float32, (12, 7), (3, 7)),  # one shard; its last inner chunk: 1 row, 2 padded
        ("far", (10, 3), torch.int16, (16, 3), (4, 3)),  # 6 rows past the end: the 4th chunk is absent
        ("v", (9,), torch.bfloat16, (10,), (5,)),  # 1-d, one padded element
        ("m", (7, 5), torch.float32, (4, 6), (4, 2)),  # rows split among 2 writers, columns rounded 5 -> 6
    ]
    out = []
    for k, (name, shape, dt, chunk, inner) in enumerate(specs):
        t = random_tensor(shape, dt, seed + k)
        meta = dataclasses.replace(array_for(name, t), chunk_shape=chunk, inner_chunk_shape=inner)
        out.append((meta, t))
    return out
