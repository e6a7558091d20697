"""`./dev lint` in CI: ruff over every Python tree and mypy over the package, with the versions pinned in
pyproject.toml's dev extra (installed by ./dev). Both had drifted to hundreds of findings while only
`./dev lint` ran them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    r = _run("ruff", "check", "--no-cache", "ucl", "tests", "bench", "conformance", "examples")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_mypy_finds_nothing() -> None:
    # no cache: a clean clone stays clean, and a stale cache cannot hide an error
    r = _run("mypy", "--cache-dir", "/dev/null", "ucl")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
