"""Resume after a SIGKILL from the latest composite step (spec/delta.md §9), knowing what one gets.

A real training process (the demo's GPT, AdamW, ``DeltaPolicy(prune=...)``, a save every step) is
SIGKILLed in the middle of a save, after its shards are written and before its commit record. A fresh
process then finds the latest committed step, a composite one: ``restore()`` refuses it and says why;
``restore(approximate=True)`` loads it with a warning naming every stale group, the step its values
come from and their age; the loaded state is exactly that (stored groups: the step's own values, stale
groups: their base step's), and training resumes and saves on.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ucl
from ucl.errors import ApproximateStepError, ApproximateWarning
from ucl.format import structure
from ucl.testing.gpt import SyntheticData, full_state, load_full_state, make_model_and_optimizer, train_step
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy
from ucl.write.prune import Prune

KILL_AT = 6  # the save of this step is killed before its commit record
POLICY = "DeltaPolicy(base='previous', full_every=100, prune=Prune(threshold=0.05, max_age=3))"

CHILD = rf"""
import os, signal, sys
import torch
torch.set_num_threads(1)
from ucl.testing.gpt import SyntheticData, full_state, make_model_and_optimizer, train_step
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy
from ucl.write.prune import Prune
from ucl.write import step as stepmod

orig = stepmod.StepWriter.commit

def commit(self, *a, **k):
    if self.step == {KILL_AT}:
        os.kill(os.getpid(), signal.SIGKILL)  # shards durable, no commit record: mid-save
    return orig(self, *a, **k)

stepmod.StepWriter.commit = commit
model, opt = make_model_and_optimizer("tiny", seed=0)
data = SyntheticData(model.config, seed=0)
mgr = CheckpointManager(sys.argv[1], delta={POLICY})
for step in range(1, {KILL_AT} + 1):
    train_step(model, opt, data.batch(step))
    mgr.save(step, full_state(model, opt), optimizer=opt).result()
    print("committed", step, flush=True)
"""


def uninterrupted(steps: int) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, float]]:
    """The state after each step and each step's loss, in this process (deterministic: one thread)."""
    model, opt = make_model_and_optimizer("tiny", seed=0)
    data = SyntheticData(model.config, seed=0)
    states, losses = {}, {}
    for step in range(1, steps + 1):
        losses[step] = train_step(model, opt, data.batch(step))
        flat, _ = structure.flatten(full_state(model, opt))
        states[step] = {k: v.clone() for k, v in flat.items()}
    return states, losses


def test_resume_from_the_latest_composite_step_after_sigkill(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _run(tmp_path: Path) -> None:
    repo = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(repo)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert f"committed {KILL_AT - 1}" in proc.stdout and f"committed {KILL_AT}" not in proc.stdout
    latest = KILL_AT - 1
    assert ucl.Repository.open(repo).latest() == latest  # the half-written step is invisible
    assert ucl.validate(repo).ok

    policy = eval(POLICY, {"DeltaPolicy": DeltaPolicy, "Prune": Prune})  # noqa: S307 - the child's policy
    with CheckpointManager(repo, delta=policy) as mgr:
        with pytest.raises(ApproximateStepError) as refused:
            mgr.restore()
        assert refused.value.code == "unknown_extension"
        assert re.search(rf"step {latest} of .* is a composite step: \d+ of 5 groups hold older steps' "
                         rf"values \(.+\); it is not the state at step {latest} \(open with approximate=True "
                         r"to load it anyway\)", str(refused.value)), str(refused.value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = mgr.restore(approximate=True)
        msgs = [str(w.message) for w in caught if issubclass(w.category, ApproximateWarning)]
        assert len(msgs) == 1, [str(w.message) for w in caught]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ApproximateWarning)
            with ucl.open(repo, approximate=True) as ckpt:
                comp = ckpt.composite
                assert comp is not None and not ckpt.exact and ckpt.step == latest
        for g in comp.stale:  # the warning names every stale group with its step and age
            plural = "s" if g.age != 1 else ""
            assert f"{g.group} (from step {g.base_step}, {g.age} step{plural} old)" in msgs[0]
            assert g.age == latest - g.base_step and 1 <= g.age < 3
        assert msgs[0].endswith("loaded approximately")

        want, losses = uninterrupted(latest + 4)
        flat, _ = structure.flatten(state)
        stale = comp.tensors()
        assert stale and set(stale) < set(flat)
        for n, t in flat.items():  # exactly what the metadata says: the step's values or the base step's
            src = stale[n].base_step if n in stale else latest
            assert torch.equal(t, want[src][n]), n
        assert any(not torch.equal(flat[n], want[latest][n]) for n in stale)  # stale is really stale

        # resume: train on from the restored state and keep saving into the same repository
        model, opt = make_model_and_optimizer("tiny", seed=0)
        load_full_state(model, opt, state)
        data = SyntheticData(model.config, seed=0)
        resumed = {}
        for step in range(latest + 1, latest + 5):
            resumed[step] = train_step(model, opt, data.batch(step))
            mgr.save(step, full_state(model, opt), optimizer=opt).result()
    assert ucl.Repository.open(repo).commit_record(latest + 1).kind == "full"  # a new manager starts full
    assert ucl.validate(repo).ok
    for step, loss in resumed.items():  # approximate, not exact; close to the uninterrupted run
        assert loss == loss and abs(loss - losses[step]) < 0.05 * losses[step], (step, loss, losses[step])
