"""The archive tier (ucl.write.tiers.ArchiveTier): due steps of the durable tier copied on, verified, with
their commit records; its own retention; restore reads it last; the durable tier keeps a step until it
is archived. On S3: tests/io/stores/test_s3.py::test_archive_tier_on_s3."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ucl
from ucl import CheckpointManager
from ucl.errors import InvalidArgumentError
from ucl.write.tiers import ArchiveTier, MemoryTier


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.arange(step, step + 9)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_memory_disk_archive_chain(tmp_path: Path) -> None:
    mem, disk, arc = tmp_path / "mem", tmp_path / "disk", tmp_path / "archive"
    # the durable tier keeps one step only: every archived step must still reach the archive
    with CheckpointManager(disk, keep_last=1, memory=MemoryTier(mem, keep_last=2),
                           archive=ArchiveTier(arc, every=3, keep_last=3)) as mgr:
        for s in range(10):
            mgr.save(s, _state(s))
        mgr.wait()
        assert ucl.Repository.open(arc).steps() == [3, 6, 9]  # 0 archived too, then retention
        assert ucl.Repository.open(disk).steps()[-1] == 9 and mgr.latest_step() == 9
    assert ucl.validate(arc).ok and ucl.validate(disk).ok
    a, d = ucl.Repository.open(arc).commit_record(9), ucl.Repository.open(disk).commit_record(9)
    assert (a.files, a.kind) == (d.files, d.kind)
    # memory and disk lost: the archive's newest step
    shutil.rmtree(mem)
    shutil.rmtree(disk)
    with CheckpointManager(disk, memory=MemoryTier(mem), archive=ArchiveTier(arc, every=3)) as mgr:
        assert _equal(mgr.restore(), _state(9))
        rep = mgr.last_restore
        assert rep is not None and (rep.tier, rep.step) == ("archive", 9)


def test_without_memory_tier_and_damaged_durable_copy(tmp_path: Path) -> None:
    disk, arc = tmp_path / "disk", tmp_path / "archive"
    with CheckpointManager(disk, keep_last=3, archive=ArchiveTier(arc, every=2)) as mgr:
        for s in range(7):
            mgr.save(s, _state(s))
        mgr.wait()
    assert ucl.Repository.open(arc).steps() == [0, 2, 4, 6]
    # the durable copy of step 6 damaged: restore passes over it to the archive's, and leaves it in place
    shard = next(p for p in sorted((disk / "steps" / "6" / "w").rglob("*")) if p.is_file() and "/c/" in str(p))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with CheckpointManager(disk, keep_last=3, archive=ArchiveTier(arc, every=2)) as mgr:
        assert _equal(mgr.restore(), _state(6))
        rep = mgr.last_restore
        assert rep is not None and (rep.tier, rep.step) == ("archive", 6)
        assert "step 6 in the durable tier" in rep.reasons[0]
    assert (disk / "commits" / "6.json").exists()  # a durable copy is never deleted by a restore


def test_bad_arguments(tmp_path: Path) -> None:
    for bad in ({"every": 0}, {"keep_last": 0}, {"every": True}):
        with pytest.raises(InvalidArgumentError):
            ArchiveTier(tmp_path, **bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="ArchiveTier"):
        CheckpointManager(tmp_path, archive=str(tmp_path / "a"))  # type: ignore[arg-type]
