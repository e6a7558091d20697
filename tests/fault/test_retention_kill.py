"""Retention killed between two of its deletions: every step still listed must stay readable.

A real writer process (CheckpointManager, keep_last, delta steps) is SIGKILLed by its own store right
after retention's first deletion of a commit record: the step it deleted is gone, the others are not.
Deleting oldest first left delta children listed whose parent was gone (broken_chain); retention now
removes the doomed commit records newest first (children before their bases), then their files.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

import ucl

CHILD = r"""
import os, signal, sys
import torch
from ucl import CheckpointManager, DeltaPolicy
from ucl.io.stores.local import LocalStore

path, kill_at = sys.argv[1], int(sys.argv[2])
orig = LocalStore.delete

def delete(self, key):
    orig(self, key)
    if key.startswith("commits/") and os.environ.get("UCL_ARMED") == "1":
        os.kill(os.getpid(), signal.SIGKILL)  # after retention's first deletion, before its next

LocalStore.delete = delete
g = torch.Generator().manual_seed(0)
state = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}
with CheckpointManager(path, keep_last=2, delta=DeltaPolicy(base="previous", full_every=3)) as mgr:
    for step in range(8):
        if step == kill_at:
            os.environ["UCL_ARMED"] = "1"
        mgr.save(step, state).result()
        print(step, flush=True)
        state["w"][step] += 1
        state["b"] *= 1.5
"""


def _states() -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}
    out = {}
    for step in range(8):
        out[step] = {k: v.clone() for k, v in state.items()}
        state["w"][step] += 1
        state["b"] *= 1.5
    return out


def test_retention_killed_mid_chain_leaves_every_listed_step_readable(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    # no kill: learn which save's retention deletes a chain of several steps (0 <- 1 <- 2)
    probe = tmp_path / "probe"
    subprocess.run([sys.executable, "-c", CHILD, str(probe), "-1"], check=True, timeout=120)
    kinds = {s: ucl.Repository.open(probe).commit_record(s) for s in ucl.Repository.open(probe).steps()}
    assert all(r.parent is None or r.parent == s - 1 for s, r in kinds.items())  # base="previous"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(repo), "4"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    r = ucl.Repository.open(repo)
    steps = r.steps()
    assert 4 not in steps or r.commit_record(4) is not None
    assert len(steps) < 5  # retention deleted a step before the kill
    want = _states()
    for s in steps:  # every listed step opens, resolves its chain and reads bit-exactly
        got = ucl.load(repo, s, flat=True)
        assert all(torch.equal(got[k], want[s][k]) for k in want[s]), s
    report = ucl.validate(repo)
    assert report.ok, report.problems
