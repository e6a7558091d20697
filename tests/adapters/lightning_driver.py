"""A tiny deterministic Lightning fit checkpointing through ucl (run as a child by test_lightning.py).

    python lightning_driver.py MODE ROOT OUT [--kill-at STEP] [--resume] [--devices N]

MODE: sync (UclCheckpointIO()), async (UclCheckpointIO(async_save=True)), wrapper
(Lightning's AsyncCheckpointIO(UclCheckpointIO())). With --kill-at the run writes ROOT/killme once
global_step reaches STEP and blocks, for the parent to SIGKILL it. With --resume it fits with
ckpt_path="last". With --devices 2 it fits under strategy="ddp" (two CPU processes over gloo, Lightning
launching the second). At the end it writes the final parameters and optimizer state to OUT (torch.save).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from ucl.adapters.lightning import UclCheckpointIO  # noqa: E402

MAX_STEPS = 12  # 3 epochs of 4 batches, a checkpoint at the end of each


class MLP(L.LightningModule):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5), "interval": "step"}}


class KillAt(L.Callback):
    def __init__(self, root: str, step: int) -> None:
        self.root, self.step = root, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            last = os.path.join(self.root, "ckpt", "last.ckpt")
            want = self.step - self.step % 4  # the end of the previous epoch
            while not _saved(last, want):
                time.sleep(0.05)  # "after some checkpoints": that one is committed
            with open(os.path.join(self.root, "killme"), "w") as f:
                f.write(str(trainer.global_step))
            time.sleep(120)  # the parent SIGKILLs us here


def _saved(path: str, step: int) -> bool:
    if os.path.isfile(path):  # TorchCheckpointIO: written atomically
        return torch.load(path, weights_only=False)["global_step"] >= step
    from ucl.format.repository import Repository

    try:
        return (Repository.open(path).latest() or -1) >= step
    except Exception:  # noqa: BLE001 - not created yet
        return False


def plugin(mode: str):
    if mode == "torch":
        return None
    if mode == "sync":
        return UclCheckpointIO()
    if mode == "async":
        return UclCheckpointIO(async_save=True)
    if mode == "wrapper":
        return AsyncCheckpointIO(UclCheckpointIO())
    raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("root")
    ap.add_argument("out")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--devices", type=int, default=1)
    a = ap.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g)
    y = torch.randn(16, 1, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)
    model = MLP()
    callbacks: list = [ModelCheckpoint(dirpath=os.path.join(a.root, "ckpt"), every_n_epochs=1,
                                       save_on_train_epoch_end=True, save_top_k=1, save_last=True)]
    if a.kill_at is not None:
        callbacks.append(KillAt(a.root, a.kill_at))
    ddp = {"devices": a.devices, "strategy": "ddp"} if a.devices > 1 else {"devices": 1}
    trainer = L.Trainer(max_steps=MAX_STEPS, accelerator="cpu", **ddp, logger=False, callbacks=callbacks,
                        plugins=[p for p in [plugin(a.mode)] if p is not None], enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, default_root_dir=a.root)
    trainer.fit(model, loader, ckpt_path="last" if a.resume else None)
    opt = trainer.optimizers[0]
    if trainer.global_rank != 0:
        return
    torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": opt.state_dict(), "global_step": trainer.global_step}, a.out)


if __name__ == "__main__":
    sys.exit(main())
