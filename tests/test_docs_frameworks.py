"""The snippets of docs/frameworks.md run as pasted (in a child process: Lightning and transformers warn
about their own defaults, which this suite's filterwarnings=error would turn into failures), and leave
committed ucl steps where the page says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUN = """
import sys, torch
torch.manual_seed(0); torch.set_num_threads(1)
sys.path.insert(0, {tests!r})
from docs_pages import snippets
ns = {{"__name__": "__docs__"}}
for i, code in enumerate(snippets("frameworks.md"), 1):
    exec(compile(code, f"docs/frameworks.md (python block {{i}})", "exec"), ns)
"""


def test_frameworks_page(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", RUN.format(tests=str(ROOT / "tests"))], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    import ucl

    last = ucl.Repository.open(tmp_path / "ckpt" / "last.ckpt")
    assert last.latest() == 8  # max_steps=8: the last checkpoint is global step 8
    hf = ucl.Repository.open(tmp_path / "hf-run" / "ucl")
    # transformers' own Trainer, resumed at max_steps from its checkpoint-6, trains and saves one more
    # step (checkpoint-7, transformers 5.24); UclTrainer resumes the same way
    assert hf.steps() == [6, 7] and ucl.validate(tmp_path / "hf-run" / "ucl").ok
