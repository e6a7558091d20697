"""Hostile and invalid conformance fixtures cost ucl little: no large allocation on the strength of a lying
value (tracemalloc), no file opened outside the repository (an audit hook), no case slower than the time
bound."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFORMANCE = ROOT / "conformance"
FIXTURES = CONFORMANCE / "fixtures"
PEAK_LIMIT = 64 << 20  # every fixture holds a few KiB; a lie must not turn into this much memory
TIME_LIMIT_S = 10.0


def _load_runner() -> Any:
    spec = importlib.util.spec_from_file_location("ucl_conformance_runner_res", CONFORMANCE / "runner.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


runner = _load_runner()
ADAPTER = runner.UclAdapter()
CASES = [c for c in runner.load_cases() if c.fixture.startswith("hostile/") or c.feature == "integrity"]
FIXTURE_NAMES = sorted({c.fixture for c in CASES})

_opened: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # cannot be removed; records only while a test sets _opened


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_hostile_fixture_is_cheap_and_stays_inside(fixture: str) -> None:
    global _opened
    cases = [c for c in CASES if c.fixture == fixture]
    for c in cases:  # once, to import lazily imported modules outside the measurement
        runner.judge(ADAPTER, c, FIXTURES)
    _opened = []
    tracemalloc.start()
    try:
        for c in cases:
            t0 = time.perf_counter()
            passed, detail = runner.judge(ADAPTER, c, FIXTURES)
            assert time.perf_counter() - t0 < TIME_LIMIT_S, f"{c.id} took longer than {TIME_LIMIT_S} s"
            assert passed or c.id in ADAPTER.expected_failures, detail
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        opened, _opened = _opened, None
    assert peak < PEAK_LIMIT, f"{fixture}: {peak >> 20} MiB allocated at peak"
    inside = os.path.realpath(FIXTURES / fixture) + os.sep
    fixtures = os.path.realpath(FIXTURES) + os.sep
    for p in opened:
        real = os.path.realpath(p)
        assert not real.startswith("/etc/"), f"{fixture}: opened {p} -> {real}"
        if real.startswith(fixtures):
            assert real.startswith(inside), (
                f"{fixture}: opened {p}, which resolves to {real}, outside the repository"
            )


@pytest.mark.parametrize("rel", ["zarr.json", "commits/1.json", "steps/1/zarr.json", "steps/1/w/zarr.json"])
def test_huge_documents_are_refused_unread(tmp_path: Path, rel: str) -> None:
    """A 64 GiB (sparse) metadata document: refused from its size, not read into memory (was MemoryError)."""
    import torch

    import ucl
    from ucl.errors import UCLError

    repo = tmp_path / "r"
    ucl.save({"w": torch.zeros(3)}, repo, step=1)
    with open(repo / rel, "r+b") as f:
        f.truncate(64 << 30)
    tracemalloc.start()
    try:
        for op in (lambda: ucl.open(repo, 1).close(), lambda: ucl.validate(repo)):
            try:
                report = op()
            except UCLError:
                continue
            assert report is None or not report.ok
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT
