"""The engine's log (ucl.write.events): logging.getLogger("ucl") and its children, at the stated levels;
the library attaches no handler but a NullHandler."""

from __future__ import annotations

import errno
import logging
import subprocess
import sys

import pytest
import torch

import ucl
from ucl import CheckpointManager
from ucl.errors import WriteError
from ucl.io import native as _native
from ucl.write.events import SaveEvents


def state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "n": seed}


def events(caplog, level: int, contains: str) -> list[logging.LogRecord]:
    """The records of ``level`` whose message has ``contains`` (not a word a test's tmp_path may hold)."""
    return [r for r in caplog.records if r.levelno == level and contains in r.getMessage()]


def test_only_a_null_handler_is_attached() -> None:
    code = ("import logging, ucl; "
            "hs = logging.getLogger('ucl').handlers + logging.getLogger('ucl.write').handlers; "
            "print(sorted(type(h).__name__ for h in hs))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['NullHandler']"


def test_save_commit_retention_and_restore_are_logged(tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="ucl")
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, state(1)).result()
        mgr.save(2, state(2)).result()
        mgr.restore()
    staged = events(caplog, logging.DEBUG, " staged: ")
    assert [r.name for r in staged] == ["ucl.write", "ucl.write"]
    assert staged[0].getMessage().startswith("step 1 staged: 0.0 MB; save blocked the caller ")  # 8.3 kB
    assert staged[0].getMessage().endswith(" ms")
    committed = events(caplog, logging.INFO, " committed (")
    assert [r.getMessage().split()[1] for r in committed] == ["1", "2"]
    assert all(r.name == "ucl.write" and "(full)" in r.getMessage() and "GB/s" in r.getMessage()
               for r in committed)
    assert all(" s (" in r.getMessage() and " MB in " in r.getMessage() for r in committed)
    retention = events(caplog, logging.INFO, "retention (keep_last")
    assert len(retention) == 1 and "deletes step(s) 1 of" in retention[0].getMessage()
    assert "keep_last=1" in retention[0].getMessage()
    restored = events(caplog, logging.INFO, "restored step")
    assert len(restored) == 1 and restored[0].getMessage().startswith("restored step 2 from ")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_delete_step_and_a_plain_save_are_logged(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="ucl")
    ucl.save(state(), tmp_path, step=5)
    (rec,) = events(caplog, logging.INFO, " committed (")
    assert rec.getMessage().startswith("step 5 committed (full) in ")
    with CheckpointManager(tmp_path) as mgr:
        mgr.delete_step(5)
    assert events(caplog, logging.INFO, "deleting step 5 of")
    assert not events(caplog, logging.DEBUG, " staged: ")  # INFO: no debug records


def test_a_failed_save_is_an_error_with_its_code(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="ucl")
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state()).result()
        _native.inject_fault("pwrite", nth=1, errno=errno.ENOSPC)
        try:
            h = mgr.save(2, state(2))
            with pytest.raises(WriteError):
                h.result()
        finally:
            _native.inject_fault(None)
        mgr.save(3, state(3)).result()
    (err,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert err.name == "ucl.write"
    assert err.getMessage().startswith(f"step 2 was not saved in {mgr.repo.url}: [write_failed] ")
    assert [r.getMessage().split()[1] for r in events(caplog, logging.INFO, " committed (")] == ["1", "3"]


class _Record:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_slow_commit_is_a_warning(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="ucl")
    clock = _Clock()
    ev = SaveEvents("file:///ckpt", clock=clock)

    def commit(step: int, seconds: float, nbytes: int = 10**9, kind: str = "full") -> None:
        ev.started(step)
        clock.t += seconds
        ev.committed(step, _Record(nbytes), kind)

    commit(1, 1.0)
    commit(2, 1.0)
    commit(3, 2.5)  # 2.5x: not yet slow
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    commit(4, 5.0)
    (w,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert w.name == "ucl.write"
    assert w.getMessage().startswith("step 4 was slow to commit: 5.00 s for 1000.0 MB (full), "
                                     "4.1x the 1.22 s expected")
    commit(5, 0.9, nbytes=10**6)  # a small step: under a second is never slow
    commit(6, 5.0, nbytes=10**6, kind="delta")  # another kind: no history yet
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    ev.started(7)
    ev.committed(7, None, "full")  # another rank: its part, at DEBUG
    assert events(caplog, logging.DEBUG, "step 7 committed in file:///ckpt (rank 0's shards")
