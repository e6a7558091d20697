"""``cases/compression.json``: zstd-compressed inner chunks (core.md §6 Arrays).

A step saved with ``compression="zstd"``, a multi-shard one written with ``StepWriter``, and a hand-made
zstd frame that does not declare its content size: valid zstd, which a reader must accept. Frames that
must be refused (bombs, short or not zstd at all) are in hostile.json.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import torch

from ucl.plan.save import array_for

from .fixture import ZSTD, Fx, random_tensor
from .suite import S_ARRAYS, Cases, le_bytes


def build(root: Path, cases: Cases) -> None:
    fx = "valid/zstd"
    zstate = {
        "w": random_tensor((64, 16), torch.float32, 500),
        "b": random_tensor((33,), torch.bool, 501),
        "z": torch.zeros(40, 40, dtype=torch.bfloat16),
        "s": random_tensor((), torch.int16, 502),
    }
    f = Fx(root, fx)
    f.save(zstate, 1, compression="zstd")
    t = random_tensor((11, 6), torch.float16, 503)
    meta = dataclasses.replace(
        array_for("sharded", t, chunk_shape=(4, 6), compression=ZSTD), inner_chunk_shape=(2, 3)
    )
    f.write(2, [(meta, t)])
    cases.valid("zstd-compressed inner chunks validate", S_ARRAYS, fx, "validate")
    cases.reads(S_ARRAYS, fx, zstate, step=1, boxes={"w": [[[10, 50], [3, 9]]], "b": [[[30, 33]]]})
    cases.reads(S_ARRAYS, fx, {"sharded": t}, step=2, boxes={"sharded": [[[3, 11], [2, 5]]]})

    fx = "valid/zstd_without_content_size"
    f = Fx(root, fx)
    zt = {"w": random_tensor((10, 10), torch.float32, 1440)}
    f.save(zt, 1, compression="zstd")
    payload = le_bytes(zt["w"])  # one raw block in a frame that declares no content size (1 KiB window)
    f.put_shard(
        1, "w/c/0/0", [b"\x28\xb5\x2f\xfd\x00\x00" + struct.pack("<I", (len(payload) << 3) | 1)[:3] + payload]
    )
    cases.valid(
        "a zstd frame that does not declare its content size (valid zstd) validates",
        S_ARRAYS,
        fx,
        "validate",
    )
    cases.reads(S_ARRAYS, fx, zt)
