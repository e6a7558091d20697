"""``cases/sharding.json``: arrays of several shards (core.md §6 Arrays, §6.1 Shard encoding).

Written shard by shard with ``StepWriter``, as ranks would, with chunk grids of one writer's block: clipped
edge shards, padded edge chunks and absent inner chunks wholly outside the array; read through boxes that
cross shard and inner-chunk boundaries.
"""

from __future__ import annotations

from pathlib import Path

from .fixture import Fx, multi_shard_arrays
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
