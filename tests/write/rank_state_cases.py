"""Bodies of the per-rank state tests (run on every rank by ucl.testing.dist)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ucl.write.manager import CheckpointManager
from ucl.write.rank_state import ConsumedSamplesSampler, default_handover

SIZE = 103


def keep_sampler_reseed_rng(old: list[Any], new_world: int) -> list[Any]:
    """A handover hook: samplers the built-in way, each new rank's RNG from an old rank's (reseeded)."""
    samplers = default_handover([s["sampler"] for s in old], new_world)
    return [{"sampler": samplers[r], "rng": np.random.default_rng([r, new_world]).bit_generator.state}
            for r in range(new_world)]


def save_dp(rank: int, world: int, path: str, consumed: list[int]) -> list[int]:
    sampler = ConsumedSamplesSampler(SIZE, rank=rank, world=world, seed=5)
    sampler.set_epoch(2)
    seen = []
    for i in sampler:
        seen.append(i)
        if len(seen) == consumed[rank]:
            break
    rng = np.random.default_rng(rank)
    with CheckpointManager(path) as mgr:
        mgr.save(7, {"w": torch.ones(4) * rank, "step": 7},
                 rank_state={"sampler": sampler.state_dict(), "rng": rng.bit_generator.state})
        mgr.wait()
    return seen


def restore_dp(rank: int, world: int, path: str) -> dict[str, Any]:
    with CheckpointManager(path) as mgr:
        state, mine = mgr.restore(rank_state=True, handover=keep_sampler_reseed_rng)
    sampler = ConsumedSamplesSampler(SIZE, rank=rank, world=world, seed=5)
    sampler.load_state_dict(mine["sampler"])
    rest = list(sampler)
    return {"step": state["step"], "epoch": sampler.epoch, "rest": rest}
