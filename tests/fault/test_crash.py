"""Crash consistency: SIGKILL a real writer at random moments, then check from a fresh process.

After every kill: the latest committed step loads bit-exactly and validates, no uncommitted step is
visible, and the next save succeeds. 10 kills in CI; `./dev test-long` runs 20 more and 200.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CHECK = r"""
import json, sys, torch, ucl
sys.path.insert(0, sys.argv[2])
from crash_writer import state_for, trained_state
path = sys.argv[1]
import os
if not os.path.exists(os.path.join(path, "zarr.json")):
    print(json.dumps({"latest": None}))
    sys.exit(0)
repo = ucl.Repository.open(path)
latest = repo.latest()
out = {"latest": latest, "steps": repo.steps()}
if latest is not None:
    got = ucl.load(path, latest, flat=True)
    want, _ = ucl.format.structure.flatten(trained_state(latest) if sys.argv[3] == "gradients" else state_for(latest))
    out["exact"] = all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items())
    out["valid"] = ucl.validate(path, latest).ok
    # steps whose directory exists but whose commit record does not must be invisible
    import os
    dirs = {int(d) for d in os.listdir(os.path.join(path, "steps")) if d.isdigit()}
    out["uncommitted_hidden"] = all(s not in repo.steps() for s in dirs - set(repo.steps()))
print(json.dumps(out))
"""


def kill_cycles(tmp_path: Path, kills: int, mode: str, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    repo = tmp_path / "repo"
    stats = {"kills": 0, "committed_seen": 0, "max_step": -1}
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(kills):
        p = subprocess.Popen([sys.executable, str(HERE / "crash_writer.py"), str(repo), mode], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # wait until it is past start-up (first line) half of the time, so kills hit saves, staging,
        # writes, fsyncs, commits and retention alike
        if rng.random() < 0.7:
            assert p.stdout is not None
            p.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.4))
        p.send_signal(signal.SIGKILL)
        p.communicate()
        stats["kills"] += 1
        r = subprocess.run([sys.executable, "-c", CHECK, str(repo), str(HERE), mode], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout)
        if out["latest"] is not None:
            assert out["exact"], out
            assert out["valid"], out
            assert out["uncommitted_hidden"], out
            stats["committed_seen"] += 1
            assert out["latest"] >= stats["max_step"]  # committed steps are never lost
            stats["max_step"] = out["latest"]
    # the next save succeeds
    sys.path.insert(0, str(HERE))
    from crash_writer import state_for

    import ucl

    if (repo / "zarr.json").exists() and mode != "gradients":
        nxt = (ucl.Repository.open(repo).latest() or 0) + 1
        ucl.save(state_for(nxt), repo, step=nxt)
        assert ucl.open(repo).step == nxt
    return stats


# Each cycle is two fresh processes (~4-6 s here). CI: 4 + 3 + 3 kills, every mode; `./dev test-long`
# runs the former CI series (8 + 6 + 6) and 200 engine kills.
@pytest.mark.parametrize(("mode", "kills"), [
    ("engine", 4), ("reference", 3), ("gradients", 3),
    pytest.param("engine", 8, marks=pytest.mark.slow),
    pytest.param("reference", 6, marks=pytest.mark.slow),
    pytest.param("gradients", 6, marks=pytest.mark.slow),
])
def test_random_kills_lose_nothing(tmp_path, mode, kills) -> None:
    stats = kill_cycles(tmp_path, kills=kills, mode=mode, seed=1234)
    assert stats["kills"] == kills and stats["committed_seen"] >= kills // 2


@pytest.mark.slow
def test_random_kills_lose_nothing_long(tmp_path) -> None:
    stats = kill_cycles(tmp_path, kills=200, mode="engine", seed=99)
    print(json.dumps(stats))
    assert stats["kills"] == 200
