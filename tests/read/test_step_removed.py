"""A step deleted while it is read is ``step_removed``, not corruption (issue 13 item 7).

Before, a reader holding a step open when retention, gc or compaction removed it reported
``missing_shard`` (or ``broken_chain`` for a delta step whose base went), the codes of a damaged
repository. Now a reader that finds a listed file gone checks the step's commit record: gone or replaced
means the step was removed (``step_removed``, a ``CheckpointNotFoundError``); still the same record means
the file is missing (``missing_shard``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ucl
from ucl.errors import CheckpointNotFoundError, MissingShardError, StepRemovedError
from ucl.format.repository import Repository
from ucl.tools.compact import compact
from ucl.write.retention import Retention


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 64, generator=g), "emb": torch.randn(50257, 4, generator=g).bfloat16()}


def repo_with_chain(path: Path) -> None:
    with ucl.CheckpointManager(path, delta=ucl.DeltaPolicy(full_every=4)) as mgr:
        s = state(0)
        mgr.save(0, s)
        mgr.wait()
        s["w"][:3] += 1.0
        mgr.save(1, s)
    assert Repository.open(path).commit_record(1).parent == 0


def test_reading_a_step_retention_deleted(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    ucl.save(state(0), p, step=0)
    ckpt = ucl.open(p, 0)  # opened: its record and documents read, no shard yet
    Retention(Repository.open(p), None, None).delete_step(0)
    with pytest.raises(StepRemovedError, match="step 0 was removed while it was read .*commit record is gone") as e:
        ckpt["w"].read()  # before: missing_shard
    assert e.value.code == "step_removed" and isinstance(e.value, CheckpointNotFoundError)
    assert e.value.tensor == "w"


def test_reading_a_delta_step_whose_base_was_deleted(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    repo_with_chain(p)
    ckpt = ucl.open(p, 1)
    Retention(Repository.open(p), None, None).delete_steps([0, 1])
    with pytest.raises(StepRemovedError) as e:
        ckpt["w"][:, :8]  # before: broken_chain or missing_shard
    assert e.value.code == "step_removed"


def test_reading_a_step_compaction_replaced(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    repo_with_chain(p)
    want = ucl.load(p, 1, flat=True)
    ckpt = ucl.open(p, 1)
    compact(p, 1)
    with pytest.raises(StepRemovedError, match="replaced"):
        ckpt["w"].read()
    got = ucl.load(p, 1, flat=True)  # opened anew: the compacted step, the same values
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_missing_file_of_a_standing_step_is_still_missing_shard(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    ucl.save(state(0), p, step=0)
    ckpt = ucl.open(p, 0)
    os.unlink(p / "steps" / "0" / "w" / "c" / "0" / "0")
    with pytest.raises(MissingShardError):
        ckpt["w"].read()
    report = ucl.validate(p)
    assert [pr.code for pr in report.problems] == ["missing_shard"]
