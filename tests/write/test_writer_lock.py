"""Every writer takes the repository's writer lock (issue 13 item 3).

Before, ``ucl.save``, ``ucl.save_sharded``, ``ucl import`` and the DCP writer took none: a ``ucl.save``
of a step the manager was persisting reported success on both sides and one of them was lost. Now each
fails with ``writer_locked`` while another writer (in this process or another) holds the repository,
commits nothing, and gives the lock back when it is done, whether it succeeded or failed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ucl
from ucl.errors import StepExistsError, WriterLockedError
from ucl.format.repository import Repository
from ucl.tools.convert import import_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")


def state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 64, generator=g), "emb": torch.randn(32001, 8, generator=g), "step": seed}


def committed(path: Path) -> list[int]:
    return Repository.open(path).steps()


WRITERS = ["save", "save_sharded", "import_torch", "import_safetensors", "dcp"]


def write_with(kind: str, path: Path, step: int, tmp: Path) -> None:
    """One step written by the writer ``kind``."""
    s = state(step)
    if kind == "save":
        ucl.save(s, path, step=step)
    elif kind == "save_sharded":
        halves = [{"w": s["w"][:64], "emb": s["emb"]}, {"w": s["w"][64:], "emb": s["emb"]}]
        ucl.save_sharded(halves, path, step, layout='ucl-layout 1\nmesh tp=2\n"w": shard(0, tp)\n"emb": replicate\n')
    elif kind == "import_torch":
        src = tmp / f"src{step}.pt"
        torch.save({"w": s["w"], "emb": s["emb"]}, src)
        import_checkpoint(src, path, step=step)
    elif kind == "import_safetensors":
        from safetensors.torch import save_file

        src = tmp / f"src{step}.safetensors"
        save_file({"w": s["w"], "emb": s["emb"]}, src)
        import_checkpoint(src, path, step=step)
    elif kind == "dcp":
        import torch.distributed.checkpoint as dcp

        from ucl.adapters.dcp import Writer

        dcp.save({"w": s["w"], "emb": s["emb"]}, storage_writer=Writer(path, step=step))
    else:
        raise AssertionError(kind)


def refused(kind: str, error: type[Exception], match: str) -> pytest.RaisesContext:  # type: ignore[type-arg]
    """``pytest.raises`` for the writer ``kind``: DCP wraps a rank's error in its CheckpointException."""
    if kind == "dcp":
        from torch.distributed.checkpoint.api import CheckpointException

        return pytest.raises(CheckpointException, match=f"{error.__module__}.{error.__name__}: {match}")
    return pytest.raises(error, match=match)


@pytest.mark.parametrize("kind", WRITERS)
def test_a_writer_is_refused_while_the_manager_holds_the_repository(tmp_path: Path, kind: str) -> None:
    p = tmp_path / "ckpt"
    with ucl.CheckpointManager(p) as mgr:
        mgr.save(1, state(1))
        with refused(kind, WriterLockedError, "another writer holds .*ucl-writer.lock"):
            write_with(kind, p, 2, tmp_path)  # before the fix: committed beside the manager's steps
        mgr.save(2, state(2))  # the step the refused writer wanted: the manager's, unharmed
    assert committed(p) == [1, 2]
    got = ucl.load(p, 2, flat=True)
    assert torch.equal(got["w"], state(2)["w"]) and ucl.validate(p).ok
    write_with(kind, p, 3, tmp_path)  # released on close: the writer works now
    assert committed(p) == [1, 2, 3]
    with ucl.CheckpointManager(p) as mgr:  # and gave the lock back after its commit
        mgr.save(4, state(4))
    assert committed(p) == [1, 2, 3, 4] and ucl.validate(p).ok


@pytest.mark.parametrize("kind", ["save", "import_torch", "dcp"])
def test_a_failed_writer_gives_the_lock_back(tmp_path: Path, kind: str) -> None:
    p = tmp_path / "ckpt"
    ucl.save(state(1), p, step=1)
    with refused(kind, StepExistsError, "step 1 is already committed"):
        write_with(kind, p, 1, tmp_path)
    with ucl.CheckpointManager(p) as mgr:  # the failed writer's lock is not in the way
        mgr.save(2, state(2))
    assert committed(p) == [1, 2]


def test_a_save_while_another_process_persists_is_refused(tmp_path: Path) -> None:
    """A real second process: its manager holds the lock (flock on the lock file) while it saves."""
    p = tmp_path / "ckpt"
    code = textwrap.dedent(f"""
        import sys, time, torch, ucl
        with ucl.CheckpointManager({str(p)!r}) as mgr:
            for step in range(1, 1000):
                mgr.save(step, {{"w": torch.full((256, 256), float(step))}})
                if step == 1:
                    mgr.wait()
                    print("ready", flush=True)
                if sys.stdin.readline().strip() == "stop":
                    break
    """)
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "ready"
            proc.stdin.write("go\n")
            proc.stdin.flush()
            with pytest.raises(WriterLockedError, match=r"\(pid \d+\)"):
                ucl.save({"w": torch.zeros(256, 256)}, p, step=2)
            proc.stdin.write("stop\n")
            proc.stdin.flush()
            assert proc.wait(60) == 0
        finally:
            proc.kill()
    steps = committed(p)
    assert steps == [1, 2]
    assert torch.equal(ucl.load(p, 2)["w"], torch.full((256, 256), 2.0))  # the manager's step 2
