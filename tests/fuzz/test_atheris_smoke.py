"""The atheris target (run by hand, see conformance/README.md) still starts and survives a short run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TARGET = Path(__file__).with_name("atheris_metadata.py")


def test_atheris_target_runs(tmp_path: Path) -> None:
    pytest.importorskip("atheris")  # not a dependency: `pip install atheris` to fuzz by hand
    r = subprocess.run(
        [sys.executable, str(TARGET), "-runs=2000", "-rss_limit_mb=2048"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Done 2000 runs" in r.stderr
    assert any((tmp_path / "ucl-atheris-corpus").iterdir())
