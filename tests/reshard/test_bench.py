"""bench/reshard.py runs end to end at the tiny size (single-rank cases) and prints its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reshard_bench_prints_its_table(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "reshard.py"),
            "--size",
            "tiny",
            "--repeat",
            "1",
            "--no-dcp",
            "--cases",
            "rows tp=2 -> rows tp=4,columns tp=2 -> rows tp=4",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("`python bench/reshard.py --size tiny")
    for label in ["rows tp=2 -> rows tp=4", "columns tp=2 -> rows tp=4"]:
        assert f"| {label}" in out, out
    assert "**Targets**" in out
