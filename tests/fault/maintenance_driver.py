"""Everything a repository meets, at once, until SIGKILLed: the maintenance torture's victim.

One process, several actors sharing the repository as real deployments do:

- the main thread alternates, at random, manager sessions (delta saves with ``keep_last`` retention and
  a full step every 4), ``ucl compact`` of a random delta step and ``ucl gc --grace 0``;
- an intruder thread keeps trying ``ucl.save`` and ``ucl import`` of the next step number (refused with
  ``writer_locked`` while another writer holds the repository, committed otherwise).

Step s always holds :func:`state_for` (s), whoever wrote it, so any listed step can be checked bit for
bit. Every commit is printed (``committed <s>``) once it returned, for the checker's "never lost" rule.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import torch


def state_for(step: int) -> dict[str, torch.Tensor]:
    """Small per-step changes on a fixed base (so delta steps are deltas): real-model shapes."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 128, generator=g)
    emb = torch.randn(32001, 8, generator=g).bfloat16()
    w[step % 256] += float(step)
    emb[(step * 7919) % 32001] = float(step % 97)
    return {"w": w, "emb": emb}


def _latest(path: str) -> int | None:
    import ucl

    if not os.path.exists(os.path.join(path, "zarr.json")):
        return None
    return ucl.Repository.open(path).latest()


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def intruder(path: str, seed: int, tmp: str) -> None:
    import ucl
    from ucl.errors import UCLError
    from ucl.tools.convert import import_checkpoint

    rng = random.Random(seed)
    while True:
        try:
            latest = _latest(path)
            step = 0 if latest is None else latest + 1
            if rng.random() < 0.5:
                ucl.save(state_for(step), path, step=step)
            else:
                src = os.path.join(tmp, f"intruder-{step}.pt")
                torch.save(state_for(step), src)
                import_checkpoint(src, path, step=step)
            _say(f"committed {step}")
        except UCLError as e:
            if e.code not in ("writer_locked", "step_exists", "not_found"):
                _say(f"error {e.code} {e}")
                raise
        time.sleep(rng.uniform(0.01, 0.3))


def main() -> None:
    import ucl
    from ucl.errors import UCLError
    from ucl.tools.compact import compact
    from ucl.tools.gc import gc

    path, seed, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    threading.Thread(target=intruder, args=(path, seed + 1, tmp), daemon=True).start()
    _say("ready")
    while True:
        op = rng.choice(["manager", "manager", "manager", "compact", "gc"])
        try:
            if op == "manager":
                with ucl.CheckpointManager(path, keep_last=3, delta=ucl.DeltaPolicy(full_every=4)) as mgr:
                    start = (mgr.latest_step() or 0) + 1
                    for step in range(start, start + rng.randint(1, 4)):
                        mgr.save(step, state_for(step)).result()
                        _say(f"committed {step}")
            elif op == "compact" and _latest(path) is not None:
                repo = ucl.Repository.open(path)
                deltas = [s for s in repo.steps() if repo.commit_record(s).kind == "delta"]
                if deltas:
                    compact(path, rng.choice(deltas))
            elif op == "gc" and _latest(path) is not None:
                gc(path, grace=0)
        except UCLError as e:
            if e.code not in ("writer_locked", "step_exists", "not_found"):
                _say(f"error {e.code} {e}")
                raise
        time.sleep(rng.uniform(0.0, 0.1))


if __name__ == "__main__":
    main()
