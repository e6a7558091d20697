"""Bodies of the multi-process tests (run on every rank by ucl.testing.dist)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ucl.format import structure
from ucl.io import native as _native
from ucl.write.manager import CheckpointManager


def replicated_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"layer{i}.w": torch.randn(64 * (i + 1), 32, generator=g) for i in range(6)},
            "step": step}


def save_replicated(rank: int, world: int, path: str, steps: int) -> dict[str, Any]:
    written: dict[int, list[str]] = {}
    with CheckpointManager(path) as mgr:
        for step in range(steps):
            mgr.save(step, replicated_state(step))
            written[step] = sorted({w.array.name for w in mgr._plans[next(iter(mgr._plans))].writes})
        mgr.wait()
    return {"rank": rank, "writes": written[0]}


def save_alone(rank: int, world: int, path: str, steps: int) -> dict[str, Any]:
    """Only rank 0 saves (no_dist=True) while the world is initialised; the other rank issues no
    collective until both meet at a barrier after rank 0's manager is closed. A manager that issued
    any collective would leave rank 0 waiting for rank 1 forever."""
    import torch.distributed as dist

    ranks = None
    if rank == 0:
        with CheckpointManager(path, no_dist=True, keep_last=2) as mgr:
            for step in range(steps):
                mgr.save(step, replicated_state(step))
            mgr.wait()
            ranks = (mgr.rank, mgr.world)
    dist.barrier()
    return {"rank": rank, "manager": ranks}


def save_with_failing_rank(rank: int, world: int, path: str, bad_rank: int) -> dict[str, Any]:
    with CheckpointManager(path) as mgr:
        mgr.save(0, replicated_state(0)).result()
        if rank == bad_rank:
            _native.inject_fault("pwrite", nth=1, errno=28)  # ENOSPC on this rank only
        h = mgr.save(1, replicated_state(1))
        try:
            h.result()
            outcome = "committed"
        except Exception as e:  # noqa: BLE001
            outcome = f"{type(e).__name__}: {e}"
        finally:
            _native.inject_fault(None)
        with contextlib.suppress(Exception):  # already reported through the handle
            mgr.wait()
        latest = mgr.latest_step()
    return {"rank": rank, "outcome": outcome, "latest": latest}


def save_gradient_records(rank: int, world: int, path: str, steps: int) -> dict[str, Any]:
    """Data-parallel training (gradients all-reduced, every rank the same state), saved with gradient
    records; returns what each step held (as digests) so the test can compare with what it reads."""
    import hashlib

    import torch.distributed as dist

    from ucl.write.policy import DeltaPolicy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    digests: dict[int, dict[str, str]] = {}
    with CheckpointManager(path, delta=DeltaPolicy(full_every=4, gradients=True)) as mgr:
        for step in range(1, steps + 1):
            g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():  # DDP's all-reduce, by hand
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            st = {"model": model.state_dict(), "optim": opt.state_dict()}
            flat, _ = structure.flatten(st)
            digests[step] = {
                n: hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, t in flat.items()}
            mgr.save(step, st, optimizer=opt)
        mgr.wait()
    return {"rank": rank, "digests": digests}


def open_manager(rank: int, world: int, paths: list[str]) -> dict[str, Any]:
    """A manager opened on ``paths[rank]`` (the same path on every rank but for a test of a node-local
    path): what each rank raised, or 'opened', and how long it took."""
    import time

    t0 = time.monotonic()
    try:
        with CheckpointManager(paths[rank], timeout=120) as mgr:
            mgr.save(0, replicated_state(0)).result()
        outcome = "opened"
    except Exception as e:  # noqa: BLE001
        outcome = f"{type(e).__name__}: {e}"
    return {"rank": rank, "outcome": outcome, "seconds": time.monotonic() - t0}


def open_spread_manager(rank: int, world: int, disk: str, mem: str) -> dict[str, Any]:
    """A manager whose memory tier is spread over ``world`` nodes of one rank each: what each rank raised,
    or 'opened', and how long it took."""
    import time

    from ucl.write.tiers import MemoryTier

    t0 = time.monotonic()
    try:
        with CheckpointManager(disk, memory=MemoryTier(mem, ranks_per_node=1, peers=1), timeout=120):
            pass
        outcome = "opened"
    except Exception as e:  # noqa: BLE001
        outcome = f"{type(e).__name__}: {e}"
    return {"rank": rank, "outcome": outcome, "seconds": time.monotonic() - t0}
