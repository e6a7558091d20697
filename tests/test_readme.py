"""The README's quickstart runs as pasted: killed with SIGKILL mid-training, run again, it resumes from
the latest committed step and finishes."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quickstart() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL)[1]  # type: ignore[index]


def test_quickstart_survives_a_kill_and_resumes(tmp_path: Path) -> None:
    code = _quickstart()
    assert "range(start, 1000)" in code
    script = tmp_path / "quickstart.py"
    script.write_text("import torch; torch.set_num_threads(1)\n"
                      + code.replace("range(start, 1000)", "range(start, 20)"))
    p = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    commits = tmp_path / "ckpt" / "commits"
    deadline = time.monotonic() + 120
    while not (commits.is_dir() and len(list(commits.glob("*.json"))) >= 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    import ucl

    before = ucl.Repository.open(tmp_path / "ckpt").latest()
    assert before is not None and before < 19, "the kill came too late to test a resume"
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    repo = ucl.Repository.open(tmp_path / "ckpt")
    assert repo.steps() == [17, 18, 19]
    state = ucl.open(tmp_path / "ckpt").load()
    assert state["step"] == 19 and set(state) == {"model", "optim", "step"}
