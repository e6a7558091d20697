"""ucl.adapters.hf: a transformers Trainer checkpointing through ucl, killed and resumed bit-identically.

A tiny Llama (built from its config) trains in a child process, checkpointing every 3 steps through
ucl (async); the child is SIGKILLed at step 8 (step 6 committed), a fresh process resumes with
``train(resume_from_checkpoint=True)`` from the latest committed ucl step, and its final parameters and
optimizer state equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import transformers  # noqa: E402,F401  (a test dependency: pyproject.toml [test])

from tests.adapters.killrun import assert_identical, kill_then_resume, run  # noqa: E402

DRIVER = str(Path(__file__).with_name("hf_driver.py"))


def test_kill_and_resume_identical(tmp_path) -> None:
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    killed.mkdir()
    run([DRIVER, str(ref), str(tmp_path / "ref.pt")])
    kill_then_resume([DRIVER, str(killed), str(killed / "x.pt")], killed, killed / "final.pt", 8)
    assert not any(p.name.startswith("checkpoint-") for p in killed.iterdir())  # no torch.save folders
    assert_identical(killed / "final.pt", tmp_path / "ref.pt")


def test_import_ucl_does_not_import_frameworks() -> None:
    import subprocess
    import sys

    code = "import sys, ucl, ucl.adapters; print('transformers' in sys.modules, 'lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
