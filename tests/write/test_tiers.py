"""The memory tier (ucl.write.tiers): saves commit to it, due steps drain to the durable repository,
restore reads the newest copy that verifies and says which tier it read. Kill tests use real processes."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucl
from ucl import CheckpointManager
from ucl.errors import InvalidArgumentError
from ucl.write.tiers import MemoryTier


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 130, generator=g), "b": torch.arange(step, step + 7)}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _flip(repo: Path, step: int) -> None:
    p = repo / "steps" / str(step) / "w" / "c" / "0" / "0"
    data = bytearray(p.read_bytes())
    data[200] ^= 1
    p.write_bytes(bytes(data))


def test_drain_every_retention_and_restore(tmp_path: Path) -> None:
    disk, mem = tmp_path / "disk", tmp_path / "mem"
    with CheckpointManager(disk, keep_last=2, memory=MemoryTier(mem, keep_last=2, drain_every=2)) as mgr:
        for s in range(7):
            mgr.save(s, _state(s)).result()
        mgr.wait()
        # step 4 may still have been draining when step 6's commit ran the memory tier's retention: it is
        # then kept (never the only copy of a step due to drain) until the next commit's retention
        assert mgr.repo.steps() in ([5, 6], [4, 5, 6])
        assert mgr.durable is not None and mgr.durable.steps() == [4, 6]
        assert mgr.steps() == [4, 5, 6] and mgr.latest_step() == 6
        assert _equal(mgr.restore(), _state(6))
        rep = mgr.last_restore
        assert rep is not None and (rep.tier, rep.step) == ("memory", 6)
    assert ucl.validate(disk).ok and ucl.validate(mem).ok
    # the durable copy has the memory copy's commit record (files, sizes, checksums), its own commit time
    a, b = ucl.Repository.open(disk).commit_record(6), ucl.Repository.open(mem).commit_record(6)
    assert (a.files, a.kind, a.parent) == (b.files, b.kind, b.parent)


def test_the_drain_interval_learns_what_a_drain_costs(tmp_path: Path) -> None:
    """MemoryTier(interval=): the drains' cost is measured at each save (one per step) as the excess of
    the steps a drain overlapped; without it the interval had no cost and drained every step."""
    import time

    from ucl.write.policy import AdaptiveInterval

    iv = AdaptiveInterval(mtbf=3600.0)
    disk, mem = tmp_path / "disk", tmp_path / "mem"
    with CheckpointManager(disk, keep_last=2, memory=MemoryTier(mem, keep_last=2, interval=iv)) as mgr:
        for s in range(12):
            time.sleep(0.02)  # a training step
            mgr.save(s, _state(s)).result()
        mgr.wait()
        drained = mgr.durable.steps() if mgr.durable is not None else []
    assert iv.step_time is not None and iv.step_time >= 0.02
    assert iv.saves >= 1 and iv.cost is not None  # a cost was measured ...
    assert drained and drained[0] >= 1  # ... from the first drain, once a step time was known
    assert ucl.validate(disk).ok


def test_a_training_state_drains(tmp_path: Path) -> None:
    """What a training loop saves drains too: an AdamW state (its 0-d ``step`` tensors: shard ``<key>/c``),
    and a name with a ``c`` segment (shards ``model/c/w/c/0/0``). bench/goodput.py found the drain
    reading such shards as documents (a checksum error on every drain of an optimizer's state)."""
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": {"c": {"w": model.weight.detach().clone()}}, "optim": opt.state_dict(),
             "scalar": torch.tensor(3.5)}
    disk, mem = tmp_path / "disk", tmp_path / "mem"
    with CheckpointManager(disk, memory=MemoryTier(mem, drain_every=1)) as mgr:
        mgr.save(0, state).result()
        mgr.wait()
        assert mgr.durable is not None and mgr.durable.steps() == [0]
    assert ucl.validate(disk).ok
    back = ucl.load(disk, 0)
    assert torch.equal(back["model"]["c"]["w"], state["model"]["c"]["w"])
    assert torch.equal(back["optim"]["state"][0]["step"], state["optim"]["state"][0]["step"])
    assert torch.equal(back["scalar"], state["scalar"])


def _save_steps(disk: Path, tier: MemoryTier, n: int) -> None:
    """Steps 0 .. n-1 saved through ``tier`` by a manager that is then closed (its drains done)."""
    with CheckpointManager(disk, memory=tier) as mgr:
        for s in range(n):
            mgr.save(s, _state(s)).result()


def test_damaged_memory_copy_falls_back_and_is_removed(tmp_path: Path) -> None:
    disk, mem = tmp_path / "disk", tmp_path / "mem"
    tier = MemoryTier(mem, keep_last=3, drain_every=3)
    _save_steps(disk, tier, 5)
    _flip(mem, 4)
    _flip(mem, 3)
    with CheckpointManager(disk, memory=tier) as mgr:
        out = mgr.restore()
        rep = mgr.last_restore
        assert rep is not None and (rep.step, rep.tier) == (3, "durable")
        assert _equal(out, _state(3))
        assert [r.split(" failed")[0] for r in rep.reasons] == [
            f"step 4 in the memory tier ({mem})", f"step 3 in the memory tier ({mem})"]
        assert "checksum_mismatch" in rep.reasons[0]
        assert mgr.repo.steps() == [2, 3]  # the damaged step 4 removed: it can be saved again
        mgr.save(4, _state(4)).result()
        assert _equal(mgr.restore(), _state(4))


def test_memory_tier_lost_restores_from_durable(tmp_path: Path) -> None:
    disk, mem = tmp_path / "disk", tmp_path / "mem"
    tier = MemoryTier(mem, keep_last=2, drain_every=2)
    _save_steps(disk, tier, 4)
    shutil.rmtree(mem)  # the machine rebooted
    with CheckpointManager(disk, memory=tier) as mgr:
        assert _equal(mgr.restore(), _state(2))
        assert mgr.last_restore is not None and mgr.last_restore.tier == "durable"


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="drain_every must be a positive int"):
        MemoryTier("/dev/shm/x", drain_every=0)
    with pytest.raises(InvalidArgumentError, match="keep_last must be a positive int"):
        MemoryTier("/dev/shm/x", keep_last=0)
    with pytest.raises(InvalidArgumentError, match="memory must be a ucl.write.tiers.MemoryTier"):
        CheckpointManager("/tmp/unused-ucl-tier-test", memory="/dev/shm/x")


CHILD = r"""
import os, signal, sys
import torch
from ucl import CheckpointManager
from ucl.write.tiers import MemoryTier
sys.path.insert(0, sys.argv[3])
from tests.write.test_tiers import _state

disk, mem = sys.argv[1], sys.argv[2]
mgr = CheckpointManager(disk, keep_last=2, memory=MemoryTier(mem, keep_last=2, drain_every=3))
for s in range(8):
    mgr.save(s, _state(s)).result()
mgr.wait()
print("saved", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close, no drain of what is left, no lock released
"""


def test_process_killed_restores_from_memory_then_disk(tmp_path: Path) -> None:
    disk, mem = tmp_path / "disk", tmp_path / "mem"
    root = str(Path(__file__).resolve().parents[2])
    p = subprocess.run([sys.executable, "-c", CHILD, str(disk), str(mem), root], capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert "saved" in p.stdout
    for repo in (disk, mem):
        assert ucl.validate(repo).ok
    tier = MemoryTier(mem, keep_last=2, drain_every=3)
    with CheckpointManager(disk, keep_last=2, memory=tier) as mgr:  # a new process: the memory tier survives
        assert _equal(mgr.restore(), _state(7))
        assert mgr.last_restore is not None and mgr.last_restore.tier == "memory"
        mgr.wait()  # the newest memory step, never drained, is drained on open
        assert mgr.durable is not None and mgr.durable.steps() == [6, 7]
    shutil.rmtree(mem)
    with CheckpointManager(disk, keep_last=2, memory=tier) as mgr:
        assert _equal(mgr.restore(), _state(7))
        assert mgr.last_restore is not None and mgr.last_restore.tier == "durable"
    assert ucl.validate(disk).ok


def test_two_ranks_agree_on_the_copy_they_restore(tmp_path: Path) -> None:
    from ucl.testing import dist

    disk, mem = str(tmp_path / "disk"), str(tmp_path / "mem")
    dist.run(2, "tests.write.tier_cases:save_tiered", {"disk": disk, "mem": mem, "steps": 5})
    assert ucl.validate(disk).ok and ucl.validate(mem).ok
    out = dist.run(2, "tests.write.tier_cases:restore_tiered", {"disk": disk, "mem": mem})
    assert out == [{"step": 4, "tier": "memory", "exact": True, "reasons": 0}] * 2
    # one rank's shard of the newest memory copy damaged: both ranks pass over it, to the same disk copy
    files = sorted((tmp_path / "mem" / "steps" / "4").rglob("*"))
    shard = next(p for p in files if p.is_file() and "/c/" in str(p))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 1
    shard.write_bytes(bytes(data))
    out = dist.run(2, "tests.write.tier_cases:restore_tiered", {"disk": disk, "mem": mem})
    assert out == [{"step": 4, "tier": "durable", "exact": True, "reasons": 1}] * 2
