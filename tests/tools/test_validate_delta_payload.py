"""``ucl validate`` decodes what it vouches for: a delta payload whose zstd frames do not decode is a
problem, even when every crc32c and the digest match (issue 13 item 7; before, validate called such a
step valid while ``load`` refused it)."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import ucl
from ucl.errors import UCLError
from ucl.format.repository import Repository
from ucl.format.shardfile import EMPTY, index_nbytes
from ucl.io import native

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def delta_repo(path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    s = {"w": torch.randn(512, 256, generator=g), "emb": torch.randn(50257, 16, generator=g).bfloat16()}
    with ucl.CheckpointManager(path, delta=ucl.DeltaPolicy(full_every=4)) as mgr:
        mgr.save(0, s)
        mgr.wait()
        s["w"][:, :8] += 1e-3  # a sparse change: a masked payload with zstd frames
        mgr.save(1, s)


def break_a_frame_keeping_every_checksum(path: Path) -> str:
    """Corrupt one zstd frame header inside a delta payload of step 1, then re-seal the chunk's crc32c
    and the commit record's digest of that shard, as a buggy or hostile writer would."""
    repo = Repository.open(path)
    record = repo.commit_record(1)
    meta = repo.step_meta(1, record)
    arr = meta.arrays["w"]
    assert arr.delta is not None
    for rel in sorted(record.files):
        if not rel.startswith("w/c"):
            continue
        f = path / "steps" / "1" / rel
        data = bytearray(f.read_bytes())
        n = index_nbytes(arr.n_inner)
        index = np.frombuffer(bytes(data[-n:-4]), "<u8").reshape(-1, 2)
        crcs = []
        done = False
        for off, nb in index:
            if off == EMPTY:
                continue
            off, nb = int(off), int(nb)
            payload = data[off : off + nb - 4]
            at = bytes(payload).find(ZSTD_MAGIC)
            if not done and at >= 0:
                data[off + at] ^= 0xFF  # no longer a zstd frame
                data[off + nb - 4 : off + nb] = struct.pack("<I", native.crc32c(bytes(data[off : off + nb - 4])))
                done = True
            crcs.append(bytes(data[off + nb - 4 : off + nb]))
        if not done:
            continue
        crcs.append(bytes(data[-4:]))
        f.write_bytes(bytes(data))
        files = dict(record.files)
        files[rel] = (len(data), native.crc32c(b"".join(crcs)))
        (path / "commits" / "1.json").write_bytes(dataclasses.replace(record, files=files).to_bytes())
        return rel
    raise AssertionError("no delta payload with a zstd frame")


def test_validate_reports_a_delta_payload_that_does_not_decode(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    delta_repo(p)
    assert ucl.validate(p).ok
    rel = break_a_frame_keeping_every_checksum(p)
    with pytest.raises(UCLError, match="zstd"):
        ucl.load(p, 1)  # the reader refuses it
    report = ucl.validate(p, step=1)
    assert not report.ok  # before the fix: ok, every checksum matches
    problems = [pr for pr in report.problems if pr.tensor == "w"]
    assert problems and problems[0].code == "integrity_error" and "zstd" in problems[0].message
    assert problems[0].file == f"steps/1/{rel}"
    assert ucl.validate(p, step=0).ok  # the base is sound
