"""``cases/dtypes.json``: every data type of the spec's table (core.md §4 Data types).

One step saved by ``ucl.save`` holds a 3x5 tensor of each type, of random bit patterns (NaN payloads,
subnormals and negative zeros included); a reader must return them bit-exactly, whole and in slices.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .fixture import Fx, random_tensor
from .suite import S_DTYPES, Cases

# name in the spec's table, torch dtype
DTYPES = [
    ("bool", torch.bool),
    ("int8", torch.int8),
    ("int16", torch.int16),
    ("int32", torch.int32),
    ("int64", torch.int64),
    ("uint8", torch.uint8),
    ("uint16", torch.uint16),
    ("uint32", torch.uint32),
    ("uint64", torch.uint64),
    ("float16", torch.float16),
    ("float32", torch.float32),
    ("float64", torch.float64),
    ("bfloat16", torch.bfloat16),
    ("float8_e4m3fn", torch.float8_e4m3fn),
    ("float8_e5m2", torch.float8_e5m2),
    ("complex64", torch.complex64),
    ("complex128", torch.complex128),
]


def build(root: Path, cases: Cases) -> None:
    fx = "valid/dtypes"
    state = {"dtype": {n: random_tensor((3, 5), dt, 100 + i) for i, (n, dt) in enumerate(DTYPES)}}
    flat_dtypes = {f"dtype/{n}": t for n, t in state["dtype"].items()}
    Fx(root, fx).save(state, 1)
    cases.valid("every data type of the spec's table validates", S_DTYPES, fx, "validate")
    cases.valid(
        "the step opens with one tensor per data type",
        S_DTYPES,
        fx,
        "open",
        step=1,
        keys=sorted(flat_dtypes),
    )
    cases.reads(S_DTYPES, fx, flat_dtypes, boxes={k: [[[1, 3], [2, 5]]] for k in flat_dtypes})
