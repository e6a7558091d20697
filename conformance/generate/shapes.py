"""``cases/shapes.json``: 0-d, empty, one-element and odd-rank shapes (core.md §6 Arrays).

Read whole and through boxes (empty boxes and the 0-d box ``[]`` included), and the slices a reader must
refuse: out of bounds, of the wrong rank, or of a tensor the step does not have.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .fixture import Fx, random_tensor
from .suite import S_ARRAYS, Cases


def build(root: Path, cases: Cases) -> None:
    fx = "valid/shapes"
    state = {
        "scalar_f32": random_tensor((), torch.float32, 200),
        "scalar_bool": torch.tensor(True),
        "empty_1d": torch.zeros(0, dtype=torch.float32),
        "empty_3x0": torch.zeros(3, 0, dtype=torch.int64),
        "empty_0x2x0": torch.zeros(0, 2, 0, dtype=torch.bfloat16),
        "one": random_tensor((1,), torch.float16, 201),
        "odd_7x3x5": random_tensor((7, 3, 5), torch.float64, 202),
        "four_d": random_tensor((2, 3, 1, 4), torch.int8, 203),
        "long_1d": random_tensor((1001,), torch.uint8, 204),
    }
    Fx(root, fx).save(state, 3)
    cases.valid("0-d, empty and odd shapes validate", S_ARRAYS, fx, "validate")
    cases.valid("0-d, empty and odd shapes open", S_ARRAYS, fx, "open", step=3, keys=sorted(state))
    cases.reads(
        S_ARRAYS,
        fx,
        state,
        boxes={
            "scalar_f32": [[]],
            "odd_7x3x5": [[[2, 5], [0, 3], [1, 4]], [[6, 7], [2, 3], [4, 5]], [[3, 3], [0, 3], [0, 5]]],
            "four_d": [[[1, 2], [0, 3], [0, 1], [1, 3]]],
            "long_1d": [[[997, 1001]], [[0, 0]]],
            "empty_3x0": [[[1, 3], [0, 0]]],
        },
    )
    cases.error(
        "a slice beyond the shape is refused",
        S_ARRAYS,
        fx,
        "read",
        "invalid_argument",
        {"tensor": "odd_7x3x5", "slice": [[0, 8], [0, 3], [0, 5]]},
    )
    cases.error(
        "a slice of the wrong rank is refused",
        S_ARRAYS,
        fx,
        "read",
        "invalid_argument",
        {"tensor": "odd_7x3x5", "slice": [[0, 1]]},
    )
    cases.error(
        "a tensor that is not in the step",
        S_ARRAYS,
        fx,
        "read",
        "tensor_not_found",
        {"tensor": "nope"},
    )
