"""A deterministic accelerate custom loop checkpointing through ucl (a child of test_accelerate.py).

    python accelerate_driver.py ROOT OUT [--kill-at STEP] [--resume]

An MLP with AdamW, a LambdaLR schedule, a shuffled stateful dataloader (several epochs), a registered
custom object and torch/numpy/python randomness in every step; a save every 3 steps. With --kill-at it
writes ROOT/killme once step STEP is done and the save before it committed, and blocks for the
parent's SIGKILL; with --resume it starts from the latest committed ucl step. At the end it writes the
parameters, optimizer state, the losses of each step and the counter to OUT (torch.save).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings

import numpy as np
import torch

torch.set_num_threads(1)
warnings.filterwarnings("ignore")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, set_seed  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ucl.adapters.accelerate import UclAcceleratorState  # noqa: E402

STEPS, EVERY = 20, 3


class Counter:
    """A registered custom object (accelerator.register_for_checkpointing)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict) -> None:
        self.seen = sd["seen"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("out")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    set_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                           use_seedable_sampler=True))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(28, 8, generator=g), torch.randn(28, 1, generator=g))
    # 7 batches an epoch: saves fall mid-epoch. The loader's own generator: without one, each epoch's
    # iterator draws its base seed from the global torch RNG (ucl.adapters.accelerate's docstring)
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
    counter = Counter()
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    acc.register_for_checkpointing(counter)
    ckpt = UclAcceleratorState(acc, os.path.join(a.root, "ckpt"), keep_last=2)
    start = ckpt.load_state() if a.resume else None
    step = 0 if start is None else start + 1
    losses: dict[int, float] = {}
    while step < STEPS:
        for x, y in loader:
            # randomness from every generator the state covers
            noise = 1e-3 * torch.randn_like(x) + 1e-3 * float(np.random.rand()) + 1e-3 * random.random()
            loss = torch.nn.functional.mse_loss(model(x + noise), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.seen += len(x)
            losses[step] = loss.item()
            if step % EVERY == EVERY - 1:
                ckpt.save_state(step)
            if step == a.kill_at:
                last = step - (step + 1) % EVERY
                while (max(ckpt.manager.steps(), default=-1)) < last:
                    time.sleep(0.05)
                with open(os.path.join(a.root, "killme"), "w") as f:
                    f.write(str(step))
                time.sleep(120)  # the parent SIGKILLs us here
            step += 1
            if step == STEPS:
                break
    ckpt.close()
    torch.save({"params": {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()},
                "optim": opt.state_dict(), "global_step": step, "losses": losses, "seen": counter.seen,
                "sched": sched.state_dict()}, a.out)


if __name__ == "__main__":
    sys.exit(main())
