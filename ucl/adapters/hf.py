"""Hugging Face ``Trainer`` checkpoints through ucl.

``UclTrainer`` is a ``transformers.Trainer`` whose checkpoints are steps of one ucl repository
(``ucl_path``, default ``<output_dir>/ucl``) instead of ``checkpoint-N/`` folders of torch.save and
safetensors files. The Trainer calls, in transformers' own order, the methods this class overrides:

- ``_save_checkpoint`` (every ``save_steps``): the model's ``state_dict``, the optimizer's and the
  scheduler's (and the grad scaler's), the RNG states (python, numpy, torch, CUDA) and the
  ``TrainerState`` JSON (stateful callbacks updated first, as transformers does) become step
  ``global_step`` of the repository, through :class:`ucl.CheckpointManager`: the call returns once the
  state is staged and training goes on while it is written and committed (``ucl_async=False``: once
  committed). ``save_total_limit`` is the repository's ``keep_last``.
- ``train(resume_from_checkpoint=True)`` resumes from the latest *committed* ucl step (a save killed
  at any moment is simply not there): its ``trainer_state.json`` is put where transformers reads it (a
  temporary ``checkpoint-N`` folder holding only that file) and ``_load_from_checkpoint``,
  ``_load_optimizer_and_scheduler``, ``_load_scaler`` and ``_load_rng_state`` read the step's tensors.
  ``resume_from_checkpoint=<a ucl repository>`` (or ``"<repository>@<step>"``) picks one; any other path
  is a transformers checkpoint folder, loaded as transformers does.
- ``train`` waits for the last save to commit before it returns.

Values ucl does not store natively (numpy RNG arrays, tuples) go through :mod:`ucl.adapters.values`.
``load_best_model_at_end`` and ``push_to_hub`` need checkpoint folders and are not supported with ucl.
transformers is imported when this module is (``import ucl`` never imports it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tempfile
from typing import Any, cast

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState

from ucl.adapters import values
from ucl.format.repository import Repository
from ucl.read.load import load
from ucl.write.manager import CheckpointManager

__all__ = ["UclTrainer", "latest_step"]

TRAINER_STATE_NAME = "trainer_state.json"


def latest_step(path: str | os.PathLike[str]) -> int | None:
    """The newest committed step of the ucl repository at ``path`` (None when there is none)."""
    try:
        return Repository.open(path).latest()
    except Exception:  # noqa: BLE001 - no repository yet
        return None


class UclTrainer(Trainer):
    """``transformers.Trainer`` checkpointing through ucl (see the module docstring).

    Extra keyword arguments: ``ucl_path`` (the repository; default ``<output_dir>/ucl``), ``ucl_async``
    (default True), ``ucl_options`` (more keyword arguments of :class:`ucl.CheckpointManager`, e.g.
    ``{"delta": True}``).
    """

    def __init__(self, *args: Any, ucl_path: str | os.PathLike[str] | None = None, ucl_async: bool = True,
                 ucl_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # TrainingArguments types output_dir Optional; its __post_init__ has made it a str
        self.ucl_path = (os.fspath(ucl_path) if ucl_path is not None
                         else os.path.join(self.args.output_dir, "ucl"))  # type: ignore[arg-type]
        self.ucl_async = ucl_async
        self.ucl_options = dict(ucl_options or {})
        self._ucl_mgr: CheckpointManager | None = None
        self._ucl_resume: dict[str, Any] | None = None
        self._ucl_saved: set[int] = set()

    # -- saving ------------------------------------------------------------------------------------
    def _ucl_manager(self) -> CheckpointManager:
        if self._ucl_mgr is None:
            self._ucl_mgr = CheckpointManager(self.ucl_path, keep_last=self.args.save_total_limit,
                                              **self.ucl_options)
        return self._ucl_mgr

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        # TrainerState types stateful_callbacks as a list; its __post_init__ has made it a dict by name
        stateful = cast(dict[str, Any], self.state.stateful_callbacks)
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(stateful[name], list):
                stateful[name].append(cb_state)
            else:
                stateful[name] = cb_state
        state: dict[str, Any] = {
            "model": self.accelerator.unwrap_model(self.model).state_dict(),
            "trainer_state": json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n",
        }
        if not self.args.save_only_model:  # Trainer types these Optional; training has created them
            state["optimizer"] = self.optimizer.state_dict()  # type: ignore[union-attr]
            state["scheduler"] = self.lr_scheduler.state_dict()  # type: ignore[union-attr]
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
            state["rng"] = _rng_states()
        mgr = self._ucl_manager()
        step = self.state.global_step
        if step in self._ucl_saved or step in mgr.steps():
            return  # this step is saved already (committed steps never change)
        handle = mgr.save(step, values.encode(state))
        self._ucl_saved.add(step)
        if not self.ucl_async:
            handle.result()

    # -- resuming ----------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        tmp = None
        try:
            target = self._ucl_target(resume_from_checkpoint)
            if target is not None:
                path, step = target
                self._ucl_resume = values.decode(load(path, step))
                tmp = tempfile.mkdtemp(prefix="ucl-resume-")
                folder = os.path.join(tmp, f"checkpoint-{step}")
                os.makedirs(folder)
                with open(os.path.join(folder, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                    f.write(self._ucl_resume["trainer_state"])
                resume_from_checkpoint = folder
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._ucl_resume = None
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if self._ucl_mgr is not None:
                mgr, self._ucl_mgr = self._ucl_mgr, None
                mgr.close(None)

    def _ucl_target(self, resume: Any) -> tuple[str, int] | None:
        if resume is True:
            step = latest_step(self.ucl_path)
            if step is None:
                raise ValueError(f"No committed ucl step found in {self.ucl_path}")
            return self.ucl_path, step
        if isinstance(resume, str | os.PathLike):
            text = os.fspath(resume)
            base, at, num = text.rpartition("@")
            path, step = (base, int(num)) if at and num.isdigit() else (text, None)
            if os.path.isfile(os.path.join(path, "zarr.json")) and os.path.isdir(os.path.join(path, "commits")):
                found = latest_step(path) if step is None else step
                if found is None:
                    raise ValueError(f"No committed ucl step found in {path}")
                return path, found
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._ucl_resume is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # Trainer types model Optional; train() has set it (from model_init if need be) before loading
        (model if model is not None else self.model).load_state_dict(  # type: ignore[union-attr]
            self._ucl_resume["model"])
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._ucl_resume is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if "optimizer" in self._ucl_resume:  # Trainer types these Optional; train() creates them before this call
            self.optimizer.load_state_dict(self._ucl_resume["optimizer"])  # type: ignore[union-attr]
            self.lr_scheduler.load_state_dict(self._ucl_resume["scheduler"])  # type: ignore[union-attr]
        return None

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._ucl_resume is None or checkpoint is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and "scaler" in self._ucl_resume:
            scaler.load_state_dict(self._ucl_resume["scaler"])
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._ucl_resume is None or checkpoint is None:
            return super()._load_rng_state(checkpoint)
        rng = self._ucl_resume.get("rng")
        if rng is None:
            return None
        random.setstate(_as_tuple(rng["python"]))
        np.random.set_state(rng["numpy"])
        torch.random.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.random.set_rng_state_all(rng["cuda"])
        return None


def _rng_states() -> dict[str, Any]:
    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                           "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    return out


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list | tuple) else x
