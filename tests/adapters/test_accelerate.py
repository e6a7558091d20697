"""ucl.adapters.accelerate: an accelerate custom loop checkpointing through ucl, killed and resumed
bit-identically.

The loop (accelerate_driver.py: MLP, AdamW, LambdaLR, a shuffled stateful dataloader over several epochs,
a registered object, torch/numpy/python randomness every step) saves every 3 steps through
``UclAcceleratorState``; the child is SIGKILLed after step 10 (step 8 committed), a fresh process resumes
with ``load_state()`` and its final parameters, optimizer and scheduler state, registered object and the
loss of every step after the resume point equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

import ucl
from tests.adapters.killrun import assert_identical, kill_then_resume, run
from ucl.adapters.accelerate import UclAcceleratorState
from ucl.errors import InvalidArgumentError

DRIVER = str(Path(__file__).with_name("accelerate_driver.py"))


def test_kill_and_resume_identical(tmp_path: Path) -> None:
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    ref.mkdir()
    killed.mkdir()
    run([DRIVER, str(ref), str(tmp_path / "ref.pt")])
    kill_then_resume([DRIVER, str(killed), str(killed / "x.pt")], killed, killed / "final.pt", 10)
    assert_identical(killed / "final.pt", tmp_path / "ref.pt")
    a, b = torch.load(killed / "final.pt"), torch.load(tmp_path / "ref.pt")
    assert sorted(a["losses"]) == list(range(9, 20))  # resumed after step 8, the last committed save
    assert all(a["losses"][s] == b["losses"][s] for s in a["losses"])  # same batches, same noise
    assert a["seen"] == b["seen"] and a["sched"] == b["sched"]
    # the repository is a plain ucl one: the model at its own parameter names, validated
    assert ucl.validate(killed / "ckpt").ok
    with ucl.open(killed / "ckpt") as ck:
        assert "models/0/0.weight" in ck and "optimizers/0/state/0/exp_avg" in ck


def _prepared(acc: Accelerator, n_models: int) -> list[torch.nn.Module]:
    return [acc.prepare(torch.nn.Linear(2, 2)) for _ in range(n_models)]


def test_a_different_set_of_prepared_objects_is_named(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True)
    _prepared(acc, 1)
    with UclAcceleratorState(acc, tmp_path / "ckpt", async_save=False) as ckpt:
        assert ckpt.load_state() is None  # nothing committed: a fresh start
        ckpt.save_state(0)
    other = Accelerator(cpu=True)
    _prepared(other, 2)
    with UclAcceleratorState(other, tmp_path / "ckpt") as ckpt, \
            pytest.raises(InvalidArgumentError, match="the step has 1 models, the accelerator has 2"):
        ckpt.load_state()
