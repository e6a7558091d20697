"""The conformance suite through the independent Level-0 implementation (conformance/independent/level0.py).

That implementation is written from spec/core.md and spec/schemas/*.json alone (no ucl import); it speaks
the runner's JSON-lines protocol and declares itself Level 0 (spec/core.md §1). Every case must pass with
no expected failure: the cases that need spec/layout.md or spec/delta.md carry ``"level": 1``, and a
Level-0 implementation passes them by refusing with ``unknown_extension`` as §9 item 3 requires. Gaps of
the spec text found on the way are in conformance/independent/SPEC_GAPS.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMPL = ROOT / "conformance" / "independent" / "level0.py"


def _runner():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("ucl_conformance_runner", ROOT / "conformance" / "runner.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


runner = _runner()
CASES = runner.load_cases()


@pytest.fixture(scope="module")
def adapter():  # type: ignore[no-untyped-def]
    a = runner.SubprocessAdapter([sys.executable, str(IMPL)], timeout_s=60.0)
    yield a
    a.close()


def test_independent_level0_suite(adapter) -> None:  # type: ignore[no-untyped-def]
    """One run of every case (one subprocess); the failures are listed together. Each failure is a gap
    in the spec text or a bug of level0.py (see conformance/independent/SPEC_GAPS.md)."""
    assert adapter.name == "ucl-independent-level0" and adapter.level == 0
    assert adapter.expected_failures == {}
    s = runner.summarize(runner.run(adapter, CASES, timeout_s=60.0))
    assert s.failed == 0, "\n".join([f"{s.passed} passed, {s.failed} failed", *s.lines])
    assert s.passed == len(CASES)


def test_level_one_cases_need_the_refusal_not_a_pass(adapter) -> None:  # type: ignore[no-untyped-def]
    """The runner's allowance for Level 0 is unknown_extension only: any other answer to a Level-1 case
    is judged as usual (a Level-0 reader may not return stored blocks as logical tensors)."""

    class Lenient(runner.UclAdapter):
        level = 0

        def read(self, path, step, tensor, box):  # type: ignore[no-untyped-def]
            r = super().read(path, step, tensor, box)
            return runner.ReadResult(r.shape, r.dtype, bytes(len(r.data or b"")))

    case = next(c for c in CASES if c.level == 1 and c.operation == "read" and c.expected["verdict"] == "valid")
    passed, detail = runner.judge(Lenient(), case)
    assert not passed and "WRONG DATA" in detail
    refusing = type("Refusing", (runner.UclAdapter,), {"level": 0, "read": lambda *a: (_ for _ in ()).throw(
        runner.CaseError("unknown_extension", "layouts and deltas are Level 1"))})
    assert runner.judge(refusing(), case)[0]
