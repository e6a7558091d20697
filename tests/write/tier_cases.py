"""Cases run on real gloo processes by tests/write/test_tiers.py (ucl.testing.dist.run)."""

from __future__ import annotations

from typing import Any

import torch

from ucl import CheckpointManager
from ucl.write.tiers import MemoryTier


def state(step: int) -> dict[str, torch.Tensor]:
    """What every (data-parallel) rank holds at ``step``."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 130, generator=g), "b": torch.randn(77, generator=g)}


def save_tiered(rank: int, world: int, disk: str, mem: str, steps: int) -> Any:
    with CheckpointManager(disk, memory=MemoryTier(mem, keep_last=2, drain_every=2)) as mgr:
        for s in range(steps):
            mgr.save(s, state(s)).result()
        mgr.wait()
    return True


def restore_tiered(rank: int, world: int, disk: str, mem: str) -> Any:
    with CheckpointManager(disk, memory=MemoryTier(mem, keep_last=2, drain_every=2)) as mgr:
        out = mgr.restore()
        rep = mgr.last_restore
        assert rep is not None and rep.step is not None
        exact = all(torch.equal(out[k], v) for k, v in state(rep.step).items())
        return {"step": rep.step, "tier": rep.tier, "exact": exact, "reasons": len(rep.reasons)}
