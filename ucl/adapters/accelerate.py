"""Hugging Face ``accelerate`` custom training loops checkpointing through ucl.

``accelerator.save_state(dir)`` writes ``model.safetensors``, pickled ``optimizer.bin`` /
``scheduler.bin`` / ``random_states_<rank>.pkl`` and ``custom_checkpoint_<i>.pkl`` into a folder, every
rank synchronously. :class:`UclAcceleratorState` keeps the same things as steps of one ucl repository,
through :class:`ucl.CheckpointManager`::

    accelerator = Accelerator()
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    ckpt = UclAcceleratorState(accelerator, "ckpt", keep_last=3)
    start = ckpt.load_state()          # the latest committed step (None: a fresh start)
    for step in range(0 if start is None else start + 1, steps):
        ...                            # train
        ckpt.save_state(step)          # returns once staged; written and committed in the background
    ckpt.close()

A step holds, like ``save_state``: every prepared model's ``state_dict`` (unwrapped, at the model's own
parameter names, so ``ucl export --tensors models/0/`` gives a Hugging Face file), every prepared
optimizer's, scheduler's and the grad scaler's state, ``accelerator.step``, the objects registered with
``accelerator.register_for_checkpointing`` (their ``state_dict()``), and per rank (``rank_state``,
spec/core.md §5.3 item 9) the Python, numpy and torch RNG states and each prepared dataloader's epoch
and, for a stateful one, its ``state_dict()``. A run resumes mid-epoch on exactly the batches it would
have seen with ``DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)``: the
position comes from the stateful loader and the epoch's permutation from the seed and the epoch
(accelerate's own ``save_state`` keeps no epoch; a plain shuffling sampler draws its permutation from the
torch RNG at the epoch's start, which a mid-epoch save no longer holds). Give the ``DataLoader`` its own
``generator=`` too: without one, each epoch's iterator draws its base seed from the global torch RNG, so
the resumed iterator takes one draw that the original run took before the save, and every later torch
random number differs.
No pickle: RNG states are typed JSON values (spec/core.md §5.3). ``load_state`` restores each into the
objects that are prepared now, in the order they were prepared, as ``accelerator.load_state`` does; a
count that differs from the step's is an error naming what differs.

Models sharded by FSDP or DeepSpeed are not handled here (accelerate saves those through their own
engines; for FSDP2/DTensor use :class:`ucl.CheckpointManager` directly, which reshards). accelerate is
imported when this module is (``import ucl`` never imports it).
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ucl.errors import InvalidArgumentError
from ucl.write.handle import SaveHandle
from ucl.write.manager import CheckpointManager

__all__ = ["UclAcceleratorState"]

_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


class UclAcceleratorState:
    """``save_state`` / ``load_state`` of an ``accelerate.Accelerator`` as steps of the ucl repository
    ``path`` (see the module docstring).

    Parameters
    ----------
    accelerator
        The accelerator whose prepared models, optimizers, schedulers, dataloaders and registered
        objects are saved and restored.
    path
        The repository (created on the first save).
    async_save
        True (default): ``save_state`` returns once the state is staged; False: once it is committed.
    manager_options
        More keyword arguments of :class:`ucl.CheckpointManager` (``keep_last``, ``delta``, ...).
    """

    def __init__(self, accelerator: Accelerator, path: str | os.PathLike[str], *, async_save: bool = True,
                 **manager_options: Any) -> None:
        if accelerator.distributed_type in _SHARDED:
            raise InvalidArgumentError(f"UclAcceleratorState saves replicated models; this accelerator uses "
                                       f"{accelerator.distributed_type.value}, whose sharded state accelerate "
                                       "saves through its own engine (for FSDP2/DTensor use "
                                       "ucl.CheckpointManager directly)")
        self.accelerator = accelerator
        self.path = os.fspath(path)
        self.async_save = async_save
        self.manager = CheckpointManager(self.path, **manager_options)

    # -- saving ---------------------------------------------------------------------------------------
    def save_state(self, step: int) -> SaveHandle:
        """Save everything ``accelerator.save_state`` saves as step ``step`` (every rank calls it)."""
        acc = self.accelerator
        state: dict[str, Any] = {
            "models": {str(i): acc.unwrap_model(m).state_dict() for i, m in enumerate(acc._models)},
            "optimizers": {str(i): o.state_dict() for i, o in enumerate(acc._optimizers)},
            "schedulers": {str(i): s.state_dict() for i, s in enumerate(acc._schedulers)},
            "custom": {str(i): o.state_dict() for i, o in enumerate(acc._custom_objects)},
            "accelerator_step": int(acc.step),
        }
        if acc.scaler is not None:
            state["scaler"] = acc.scaler.state_dict()
        handle = self.manager.save(step, state, rank_state=_rank_state(acc))
        if not self.async_save:
            handle.result()
        return handle

    # -- restoring ------------------------------------------------------------------------------------
    def load_state(self, step: int | None = None) -> int | None:
        """Restore step ``step`` (default: the latest committed) into the prepared objects; returns the
        step restored, or None when the repository has no committed step (a fresh start)."""
        self.manager.wait()
        if step is None and not self.manager.steps():
            return None
        state, mine = self.manager.restore(step, rank_state=True)
        report = self.manager.last_restore
        assert report is not None  # restore() sets it on every path that returns
        restored = report.step if step is None else step
        acc = self.accelerator
        _load_each("models", state["models"], [acc.unwrap_model(m) for m in acc._models])
        _load_each("optimizers", state["optimizers"], acc._optimizers)
        _load_each("schedulers", state["schedulers"], acc._schedulers)
        _load_each("registered objects", state["custom"], acc._custom_objects)
        if "scaler" in state and acc.scaler is not None:
            acc.scaler.load_state_dict(state["scaler"])
        acc.step = int(state["accelerator_step"])
        if mine is not None:
            _set_rank_state(acc, mine)
        return restored

    def wait(self) -> None:
        """Wait until every save so far is committed."""
        self.manager.wait()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> UclAcceleratorState:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _load_each(what: str, saved: dict[str, Any], targets: list[Any]) -> None:
    if len(saved) != len(targets):
        raise InvalidArgumentError(f"the step has {len(saved)} {what}, the accelerator has {len(targets)} "
                                   f"prepared: prepare (or register) the same {what} in the same order "
                                   "as the run that saved it")
    for i, target in enumerate(targets):
        target.load_state_dict(saved[str(i)])


def _rank_state(acc: Accelerator) -> dict[str, Any]:
    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "torch": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    loaders: dict[str, Any] = {}
    for i, dl in enumerate(acc._dataloaders):
        mine: dict[str, Any] = {"epoch": int(getattr(dl, "iteration", 0))}
        if getattr(dl, "use_stateful_dataloader", False):
            mine["state"] = dl.state_dict()  # the position in the epoch (accelerate's look-ahead excluded)
        loaders[str(i)] = mine
    if loaders:
        out["dataloaders"] = loaders
    return out


def _set_rank_state(acc: Accelerator, mine: dict[str, Any]) -> None:
    random.setstate(mine["python"])
    np.random.set_state(mine["numpy"])
    torch.random.set_rng_state(mine["torch"])
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(mine["cuda"])
    for i, dl in enumerate(acc._dataloaders):
        saved = mine.get("dataloaders", {}).get(str(i))
        if saved is None:
            continue
        if hasattr(dl, "set_epoch"):
            dl.set_epoch(saved["epoch"])  # a seedable sampler's permutation is a function of the epoch
        if "state" in saved:
            dl.load_state_dict(saved["state"])
