"""An interrupted ``ucl compact`` (a real SIGKILL mid-protocol) and the writers that meet its journal.

Issue 13 item 2: compaction killed after it uncommitted step N makes N invisible; training then saved N
again, and re-running ``ucl compact`` replaced the new step with the old values (or left it
``checksum_mismatch``). Now whoever next holds the writer lock rolls the journal forward first
(a manager opening the repository, a writer of step N), and a journal whose replaced record is no longer
the committed one is discarded, never applied.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ucl
from ucl.errors import StepExistsError
from ucl.format.repository import Repository
from ucl.tools.compact import compact

PHASES = ["uncommitted", "removed", "moved"]  # the window where step N is invisible


def pending(path: Path) -> list[str]:
    """The compaction journals left in ``path``."""
    return sorted(n for n in os.listdir(path / "compact") if n.endswith(".json")) if (path / "compact").is_dir() else []


def state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(50257, generator=g).bfloat16(), "step": seed}


def delta_repo(path: Path) -> None:
    """Steps 0 (full) and 1 (a delta of 0), written by the manager."""
    with ucl.CheckpointManager(path, delta=ucl.DeltaPolicy(full_every=4)) as mgr:
        s = state(0)
        mgr.save(0, s)
        mgr.wait()
        s["w"][0, :4] += 1.0
        s["step"] = 1
        mgr.save(1, s)
    assert Repository.open(path).commit_record(1).kind == "delta"


def kill_compact_at(path: Path, step: int, phase: str) -> None:
    """Run ``compact`` in a child that SIGKILLs itself when the protocol reaches ``phase``."""
    code = textwrap.dedent(f"""
        import os, signal
        from ucl.tools.compact import compact
        def hook(p):
            if p == {phase!r}:
                os.kill(os.getpid(), signal.SIGKILL)
        compact({str(path)!r}, {step}, force=True, _hook=hook)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == -9, r.stderr.decode()
    assert step not in Repository.open(path).steps()  # invisible: the window this test is about
    assert pending(path) == [f"{step}.json"]


def equal(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("phase", PHASES)
def test_a_save_of_the_hidden_step_finishes_the_compaction_and_is_refused(tmp_path: Path, phase: str) -> None:
    p = tmp_path / "ckpt"
    delta_repo(p)
    want = ucl.load(p, 1, flat=True)
    kill_compact_at(p, 1, phase)
    with pytest.raises(StepExistsError, match="step 1 is already committed"):
        ucl.save(state(99), p, step=1)  # before the fix: committed over the journal, then clobbered by it
    assert Repository.open(p).steps() == [0, 1] and pending(p) == []
    assert equal(ucl.load(p, 1, flat=True), want)  # the compacted step: the values of step 1, bit-exact
    assert Repository.open(p).commit_record(1).kind == "full"
    assert ucl.validate(p).ok
    assert compact(p, 1).message == "step 1 is already a full step: nothing to do"


@pytest.mark.parametrize("phase", PHASES)
def test_a_restarted_manager_sees_the_hidden_step_again(tmp_path: Path, phase: str) -> None:
    p = tmp_path / "ckpt"
    delta_repo(p)
    want = ucl.load(p, 1, flat=True)
    kill_compact_at(p, 1, phase)
    with ucl.CheckpointManager(p) as mgr:  # the restart after the crash: recovery before any restore
        assert mgr.latest_step() == 1
        assert equal(ucl.load(p, 1, flat=True), want)
        s = state(2)
        mgr.save(2, s)
    assert Repository.open(p).steps() == [0, 1, 2] and ucl.validate(p).ok


def test_a_journal_whose_step_was_saved_anew_is_discarded_not_applied(tmp_path: Path) -> None:
    """A writer that did not know of the journal (an older ucl, a hand-made step) committed step 1 anew:
    re-running compact keeps that step, bit for bit, and drops the stale journal and its staging."""
    p = tmp_path / "ckpt"
    delta_repo(p)
    kill_compact_at(p, 1, "removed")
    other = tmp_path / "other"
    ucl.save(state(7), other, step=1)  # the new step 1, moved in as the unaware writer would have
    shutil.rmtree(p / "steps" / "1", ignore_errors=True)
    shutil.copytree(other / "steps" / "1", p / "steps" / "1")
    shutil.copy(other / "commits" / "1.json", p / "commits" / "1.json")
    new = (p / "commits" / "1.json").read_bytes()
    r = compact(p, 1)  # before the fix: the journal's record replaced the new one (checksum_mismatch)
    assert not r.changed and "discarded the journal" in r.message
    assert (p / "commits" / "1.json").read_bytes() == new
    assert equal(ucl.load(p, 1, flat=True), ucl.load(other, 1, flat=True))
    assert ucl.validate(p).ok and os.listdir(p / "compact") == []


def test_the_journal_names_the_record_it_replaces(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    delta_repo(p)
    old = (p / "commits" / "1.json").read_bytes()
    kill_compact_at(p, 1, "uncommitted")
    import json

    doc = json.loads((p / "compact" / "1.json").read_bytes())
    assert doc["ucl_compaction"] == 1 and doc["step"] == 1
    from ucl.io import native

    assert doc["replaces"] == native.crc32c(old)
