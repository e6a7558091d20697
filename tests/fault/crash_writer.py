"""A writer that checkpoints forever (until killed): step s holds state_for(s)."""

from __future__ import annotations

import sys

import torch


def state_for(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(1024, 512, generator=g), "b": torch.randn(512, generator=g).bfloat16()},
            "optim": {"m": torch.randn(700, 300, generator=g)}, "step": step}


def main() -> None:
    from ucl.engine import CheckpointManager

    path, mode = sys.argv[1], sys.argv[2]
    import ucl

    start = (ucl.Repository.open(path).latest() if _exists(path) else None)
    step = 0 if start is None else start + 1
    if mode == "engine":
        with CheckpointManager(path, keep_last=2) as mgr:
            while True:
                mgr.save(step, state_for(step))
                print(step, flush=True)
                step += 1
    else:
        while True:
            ucl.save(state_for(step), path, step=step)
            print(step, flush=True)
            step += 1


def _exists(path: str) -> bool:
    import os

    return os.path.exists(os.path.join(path, "zarr.json"))


if __name__ == "__main__":
    main()
