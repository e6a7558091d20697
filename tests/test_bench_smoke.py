"""bench/read.py runs end to end at a tiny size and prints every row of its tables."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "read.py"


def _bench_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_read", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| reader"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_read_bench_prints_every_row(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("tensorstore")
    bench = _bench_module()
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--size", "tiny", "--repeat", "1", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("`python bench/read.py --size tiny --repeat 1 --dir ")
    rows = _rows(out)
    for case in [*bench.FULL_CASES, *bench.SLICE_CASES]:
        assert case in rows, f"no row for {case!r} in:\n{out}"
    for case in bench.FULL_CASES:
        gbps, seconds, vs_peer, vs_dev = (float(x) for x in rows[case][:4])
        assert gbps > 0 and seconds > 0 and vs_peer > 0 and vs_dev > 0
    # ucl's slice reads the chunks it needs: at the tiny size one chunk holds the whole tensor
    assert rows[bench.SLICE_CASES[0]][2] != "-"
    assert "**Targets**" in out
    assert (tmp_path / "ucl").is_dir() and (tmp_path / "state.safetensors").is_file()
