"""Bodies for tests/testing/test_dist.py (run on every rank by ucl.testing.dist)."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch.distributed as dist


def fail_one(rank: int, world: int) -> Any:
    """Rank 1 raises; the others wait for it in a collective it never joins."""
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()
    return rank


def hang_one(rank: int, world: int) -> Any:
    """Rank 1 sleeps past the runner's timeout; it writes more than a pipe holds first."""
    if rank == 1:
        sys.stderr.write("x" * 200_000 + "\n")
        sys.stderr.flush()
        time.sleep(600)
    return rank


def chatty(rank: int, world: int) -> Any:
    """Every rank writes far more than a pipe's 64 KiB to stdout and stderr before its collective."""
    print("o" * 300_000, flush=True)
    sys.stderr.write("e" * 300_000 + "\n")
    dist.barrier()
    return rank * 10


def surroundings(rank: int, world: int) -> Any:
    """What a rank sees of its caller: an environment variable, the working directory, torch's threads."""
    import os

    import torch

    return [os.environ.get("UCL_DIST_PROBE"), os.getcwd(), torch.get_num_threads(), os.environ["RANK"]]


def killed(rank: int, world: int, raise_on: int = -1) -> Any:
    """Every rank kills its own process once all have met (a crash), except ``raise_on``, which raises."""
    import os
    import signal

    dist.barrier()
    if rank == raise_on:
        raise ValueError(f"rank {rank} raised instead")
    os.kill(os.getpid(), signal.SIGKILL)
