"""A writer that checkpoints forever (until killed): step s holds state_for(s).

Mode "gradients" trains a small model with AdamW instead and saves every step with gradient records
(spec/delta.md §8); after a kill it resumes from the latest committed step (replayed when it is a
gradient step), so step s holds trained_state(s), the state of an uninterrupted run.
"""

from __future__ import annotations

import sys

import torch


def state_for(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(1024, 512, generator=g), "b": torch.randn(512, generator=g).bfloat16()},
            "optim": {"m": torch.randn(700, 300, generator=g)}, "step": step}


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def trained_state(step: int) -> dict[str, object]:
    """The state after training steps 0..step without interruption (on one thread, as the writer trains)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt = _model_and_optimizer()
        for s in range(step + 1):
            _train(model, opt, s)
        return {"model": model.state_dict(), "optim": opt.state_dict()}
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    from ucl.write.manager import CheckpointManager

    path, mode = sys.argv[1], sys.argv[2]
    # training must be bit-reproducible across processes (the checker recomputes it): one BLAS thread, so
    # that no reduction is split differently when the machine is loaded
    torch.set_num_threads(1)
    import ucl

    start = (ucl.Repository.open(path).latest() if _exists(path) else None)
    step = 0 if start is None else start + 1
    if mode == "gradients":
        from ucl.write.policy import DeltaPolicy

        model, opt = _model_and_optimizer()
        if start is not None:  # resume: the latest committed step, replayed if it is gradient records
            saved = ucl.load(path, start)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        with CheckpointManager(path, keep_last=3, delta=DeltaPolicy(full_every=4, gradients=True)) as mgr:
            while True:
                _train(model, opt, step)
                mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, optimizer=opt)
                print(step, flush=True)
                step += 1
    elif mode == "engine":
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
