"""Run a driver until it asks to be killed, SIGKILL it, then run it again resuming (for the adapter tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def run(cmd: list[str], timeout: float = 240) -> None:
    r = subprocess.run([sys.executable, *cmd], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]


def kill_then_resume(cmd: list[str], root: Path, out: Path, kill_at: int, timeout: float = 240,
                     extra: list[str] = ()) -> None:
    """``cmd`` (a driver and its positional arguments; then ``extra``) killed with SIGKILL at ``kill_at``,
    with every process it started (a session of its own: a multi-process strategy's other ranks die
    with it, as on a lost node), then resumed."""
    p = subprocess.Popen([sys.executable, *cmd, "--kill-at", str(kill_at), *extra], env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not (root / "killme").exists():
        assert p.poll() is None, p.stderr.read().decode()[-4000:] if p.stderr else "driver exited"
        assert time.monotonic() < deadline, "driver never reached the kill point"
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    if p.stderr is not None:
        p.stderr.close()
    assert p.returncode == -signal.SIGKILL
    run([*cmd[:-1], str(out), "--resume", *extra], timeout)


def assert_identical(a_path: Path, b_path: Path) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a["global_step"] == b["global_step"]
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
