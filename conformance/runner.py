#!/usr/bin/env python3
"""Run the UCL conformance cases against an implementation, through an adapter.

Usage::

    python conformance/runner.py                                  # the ucl adapter, in process
    python conformance/runner.py --adapter-command "CMD ARGS..."   # any implementation, JSON lines
    python conformance/runner.py --serve                          # serve the ucl adapter as JSON lines
    python conformance/runner.py -k integrity -v                  # only cases whose id contains 'integrity'

It prints one line per failure and a summary ``N passed, M failed`` and exits non-zero on any failure
(a missing fixture is a failure). The adapter contract is in :class:`Adapter`; the JSON-lines protocol
for implementations in other languages in :class:`SubprocessAdapter` and conformance/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CASES_DIR = HERE / "cases"
FIXTURES_DIR = HERE / "fixtures"
CASE_SCHEMA = HERE / "case.schema.json"
DEFAULT_TIMEOUT_S = 60.0


# -- the adapter contract ------------------------------------------------------------------------------
class CaseError(Exception):
    """An implementation's failure, carrying its stable code. Adapters may raise any exception that has a
    string ``code`` attribute (ucl's UCLError has one); an exception without a code is a crash."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ReadResult:
    """What ``read`` returns: the shape, the data type name (spec/core.md §4) and the elements' bytes,
    little-endian, C order, bool as one byte 0/1. An adapter may give ``sha256`` (hex) instead of ``data``."""

    shape: tuple[int, ...]
    dtype: str
    data: bytes | None = None
    sha256: str | None = None

    def digest(self) -> str:
        if self.sha256 is not None:
            return self.sha256
        assert self.data is not None, "ReadResult needs data or sha256"
        return hashlib.sha256(self.data).hexdigest()


class Adapter(ABC):
    """What the runner needs from an implementation. Four operations, each on a repository path.

    A failing operation raises an exception with a string ``code`` (spec/core.md §10), e.g.
    :class:`CaseError`. Anything else raised counts as a crash, and fails the case.

    ``expected_failures`` maps case ids (:func:`case_id`) to reasons: the implementation's own, known
    gaps. The runner reports them as expected failures, and fails a case in that list that passes, so the
    list never goes stale.
    """

    name = "adapter"
    expected_failures: dict[str, str] = {}
    level = 1  # 0: spec/core.md only; 1: also spec/layout.md and spec/delta.md (core.md §1)

    @abstractmethod
    def validate(self, path: str, step: int | None) -> tuple[bool, list[str]]:
        """Check the repository (every step, or ``step``): (valid, codes of every problem found)."""

    @abstractmethod
    def list_steps(self, path: str) -> list[int]:
        """The steps that exist (a commit record that verifies), ascending."""

    @abstractmethod
    def open(self, path: str, step: int | None) -> tuple[int, list[str]]:
        """Open ``step`` (the latest when None) and learn every tensor's shape and data type (so a reader
        that checks an array's entry at its first use, spec/core.md §10.2 item 5, checks them all):
        (the step opened, its tensor names)."""

    @abstractmethod
    def read(self, path: str, step: int | None, tensor: str, box: list[list[int]] | None) -> ReadResult:
        """Read a tensor of ``step`` (the latest when None): whole, or the box [[start, stop], ...]."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what the adapter holds (a subprocess, open files)."""


# -- the ucl adapter -----------------------------------------------------------------------------------
class UclAdapter(Adapter):
    """The reference implementation, ucl, in this process."""

    name = "ucl"
    expected_failures: dict[str, str] = {}

    def validate(self, path: str, step: int | None) -> tuple[bool, list[str]]:
        import ucl

        report = ucl.validate(path, step)
        return report.ok, [p.code for p in report.problems]

    def list_steps(self, path: str) -> list[int]:
        from ucl.errors import UCLError
        from ucl.format.repository import Repository

        repo = Repository.open(path)
        out = []
        for s in repo.steps():
            try:
                repo.commit_record(s)
            except UCLError:
                continue
            out.append(s)
        return out

    def open(self, path: str, step: int | None) -> tuple[int, list[str]]:
        import ucl

        with ucl.open(path, step) as ckpt:
            dict(ckpt.meta.arrays)  # every entry checked (ucl.open checks each at its first use)
            return ckpt.step, list(ckpt.keys())

    def read(self, path: str, step: int | None, tensor: str, box: list[list[int]] | None) -> ReadResult:
        import torch

        import ucl
        from ucl.errors import InvalidArgumentError
        from ucl.format import dtypes

        with ucl.open(path, step) as ckpt:
            lt = ckpt[tensor]
            if box is None:
                t = lt.read()
            else:
                if not all(isinstance(b, list) and len(b) == 2 for b in box):
                    raise InvalidArgumentError(f"a box is [[start, stop], ...], got {box!r}")
                t = lt.read_box(tuple(a for a, _ in box), tuple(b - a for a, b in box))
            # the tensor's, not meta.arrays': a replayed tensor has no array (spec/delta.md §8.1)
            dtype = dtypes.from_torch(lt.dtype)
        flat = t.contiguous().reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        return ReadResult(tuple(t.shape), dtype, flat.view(torch.uint8).numpy().tobytes())


# -- implementations in other languages: JSON lines over stdin/stdout -------------------------------------
class SubprocessAdapter(Adapter):
    """Talks to an implementation in a child process, one JSON object per line each way.

    The runner starts ``command`` once and writes requests to its stdin::

        {"id": 0, "op": "hello"}
        {"id": 1, "op": "validate", "path": "/abs/fixture", "step": null}
        {"id": 2, "op": "list_steps", "path": "..."}
        {"id": 3, "op": "open", "path": "...", "step": 5}
        {"id": 4, "op": "read", "path": "...", "step": null, "tensor": "w", "slice": [[0, 2], [1, 3]]}

    and reads one response line per request from its stdout (stderr is left alone, for logs)::

        {"id": 0, "result": {"name": "my-impl", "expected_failures": {"<case id>": "<reason>"}}}
        {"id": 1, "result": {"valid": false, "codes": ["checksum_mismatch"]}}
        {"id": 2, "result": {"steps": [0, 7, 30]}}
        {"id": 3, "result": {"step": 5, "keys": ["a", "b"]}}
        {"id": 4, "result": {"shape": [2, 2], "dtype": "float32", "sha256": "<hex of the LE bytes>"}}
        {"id": 4, "error": {"code": "missing_shard", "message": "..."}}      (a failed operation)

    ``"slice": null`` means the whole tensor. The child exits when its stdin closes.
    """

    def __init__(self, command: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.command = command
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8", bufsize=1
        )
        self._id = 0
        hello = self._call("hello")
        self.name = str(hello.get("name", command[0]))
        self.expected_failures = dict(hello.get("expected_failures", {}))
        self.level = int(hello.get("level", 1))

    def _call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"the implementation exited with status {self.proc.returncode}")
        self._id += 1
        self.proc.stdin.write(json.dumps({"id": self._id, "op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = _readline(self.proc, self.timeout_s)
        if not line:
            raise RuntimeError(f"the implementation closed its output (status {self.proc.poll()})")
        msg = json.loads(line)
        if msg.get("id") != self._id:
            raise RuntimeError(f"response id {msg.get('id')} for request {self._id}")
        if "error" in msg:
            err = msg["error"]
            raise CaseError(str(err.get("code")), str(err.get("message", "")))
        return msg["result"]  # type: ignore[no-any-return]

    def validate(self, path: str, step: int | None) -> tuple[bool, list[str]]:
        r = self._call("validate", path=path, step=step)
        return bool(r["valid"]), list(r["codes"])

    def list_steps(self, path: str) -> list[int]:
        return list(self._call("list_steps", path=path)["steps"])

    def open(self, path: str, step: int | None) -> tuple[int, list[str]]:
        r = self._call("open", path=path, step=step)
        return int(r["step"]), list(r["keys"])

    def read(self, path: str, step: int | None, tensor: str, box: list[list[int]] | None) -> ReadResult:
        r = self._call("read", path=path, step=step, tensor=tensor, slice=box)
        return ReadResult(tuple(r["shape"]), str(r["dtype"]), sha256=str(r["sha256"]))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        proc.kill()
        raise TimeoutError(f"no answer from the implementation within {timeout_s:.0f} s")
    return out[0]


def serve(adapter: Adapter, stdin: Any = None, stdout: Any = None) -> None:
    """Expose a Python adapter over the JSON-lines protocol of :class:`SubprocessAdapter`."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    for line in stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        rid, op = req.get("id"), req.get("op")
        try:
            if op == "hello":
                result: dict[str, Any] = {
                    "name": adapter.name,
                    "expected_failures": adapter.expected_failures,
                    "level": adapter.level,
                }
            elif op == "validate":
                ok, codes = adapter.validate(req["path"], req.get("step"))
                result = {"valid": ok, "codes": codes}
            elif op == "list_steps":
                result = {"steps": adapter.list_steps(req["path"])}
            elif op == "open":
                step, keys = adapter.open(req["path"], req.get("step"))
                result = {"step": step, "keys": keys}
            elif op == "read":
                r = adapter.read(req["path"], req.get("step"), req["tensor"], req.get("slice"))
                result = {"shape": list(r.shape), "dtype": r.dtype, "sha256": r.digest()}
            else:
                raise CaseError("invalid_argument", f"unknown op {op!r}")
            msg: dict[str, Any] = {"id": rid, "result": result}
        except Exception as e:  # the runner judges: a code, or a crash
            code = getattr(e, "code", None)
            msg = {
                "id": rid,
                "error": {
                    "code": code if isinstance(code, str) else f"crash:{type(e).__name__}",
                    "message": str(e)[:2000],
                },
            }
        stdout.write(json.dumps(msg) + "\n")
        stdout.flush()


# -- cases -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    feature: str
    index: int
    description: str
    spec: str
    fixture: str
    operation: str
    args: dict[str, Any]
    expected: dict[str, Any]
    level: int = 0

    @property
    def id(self) -> str:
        return case_id(self.fixture, self.operation, self.args)


def case_id(fixture: str, operation: str, args: dict[str, Any]) -> str:
    """A case's stable id: fixture, operation and arguments (not its position in a file)."""
    tail = f":{json.dumps(args, sort_keys=True, separators=(',', ':'), ensure_ascii=False)}" if args else ""
    return f"{fixture}:{operation}{tail}"


def load_cases(cases_dir: Path = CASES_DIR, check_schema: bool = True) -> list[Case]:
    files = sorted(cases_dir.glob("*.json"))
    if not files:
        raise SystemExit(f"no case files in {cases_dir}")
    validator = None
    if check_schema:
        import jsonschema

        validator = jsonschema.Draft202012Validator(json.loads(CASE_SCHEMA.read_text()))
    out = []
    for f in files:
        items = json.loads(f.read_text(encoding="utf-8"))
        if validator is not None:
            errors = sorted(validator.iter_errors(items), key=lambda e: list(e.absolute_path))
            if errors:
                raise SystemExit(
                    f"{f}: does not match case.schema.json at "
                    f"{'/'.join(map(str, errors[0].absolute_path))}: {errors[0].message}"
                )
        for i, c in enumerate(items):
            out.append(
                Case(
                    f.stem,
                    i,
                    c["description"],
                    c["spec"],
                    c["fixture"],
                    c["operation"],
                    c["args"],
                    c["expected"],
                    c.get("level", 0),
                )
            )
    return out


@dataclass
class Outcome:
    case: Case
    passed: bool
    detail: str = ""
    expected_failure: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Passed, or failed as the adapter said it would."""
        return self.passed != (self.expected_failure is not None)


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the main thread after ``seconds`` (a hang is a failure, not a stuck run)."""
    if (
        seconds <= 0
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "SIGALRM")
    ):
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no result within {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _code_of(e: BaseException) -> str | None:
    code = getattr(e, "code", None)
    return code if isinstance(code, str) and not code.startswith("crash:") else None


def judge(
    adapter: Adapter, case: Case, fixtures_dir: Path = FIXTURES_DIR, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[bool, str]:
    """Run one case; (passed, what differed)."""
    path = fixtures_dir / case.fixture
    if not path.is_dir():
        return False, (
            f"fixture {case.fixture} is missing: fixtures are committed, never regenerated on the fly "
            "(regenerate on purpose with `python -m conformance.generate --force`)"
        )
    exp = case.expected
    verdict, code = exp["verdict"], exp.get("code")
    allowed = set(exp.get("may_fail_with", []))
    # a Level-0 implementation refuses what it does not implement with unknown_extension (core.md §9 item 3)
    beyond = case.level > adapter.level
    if beyond:
        allowed.add("unknown_extension")
    a = case.args
    step = a.get("step")
    try:
        with _deadline(timeout_s):
            if case.operation == "validate":
                ok, codes = adapter.validate(str(path), step)
            elif case.operation == "list_steps":
                steps = adapter.list_steps(str(path))
            elif case.operation == "open":
                opened, keys = adapter.open(str(path), step)
            elif case.operation == "read":
                result = adapter.read(str(path), step, a["tensor"], a.get("slice"))
            else:
                return False, f"unknown operation {case.operation!r}"
    except Exception as e:
        got = _code_of(e)
        if got is None:
            return False, f"crashed: {type(e).__name__}: {e}"
        if verdict == "error" and got == code:
            return True, ""
        if got in allowed:
            return True, ""
        want = f"error {code}" if verdict == "error" else "success"
        return False, f"expected {want}, got error {got}: {e}"
    if case.operation == "validate":
        if verdict == "valid":
            if ok and not codes:
                return True, ""
            if not ok and codes and set(codes) <= allowed:
                return True, ""
            return False, f"expected valid, got invalid {sorted(set(codes))}"
        if ok:
            return False, f"expected invalid ({code}), got valid"
        if code in codes or (beyond and "unknown_extension" in codes):
            return True, ""
        return False, f"expected code {code}, got {sorted(set(codes))}"
    if verdict == "error":
        return False, f"expected error {code}, the operation succeeded"
    if case.operation == "list_steps":
        return (steps == exp["steps"], f"expected steps {exp['steps']}, got {steps}")
    if case.operation == "open":
        if "step" in exp and opened != exp["step"]:
            return False, f"expected step {exp['step']}, opened {opened}"
        if "keys" in exp and sorted(keys) != exp["keys"]:
            return False, f"expected keys {exp['keys']}, got {sorted(keys)}"
        return True, ""
    # read
    if "shape" in exp and list(result.shape) != exp["shape"]:
        return False, f"expected shape {exp['shape']}, got {list(result.shape)}"
    digest = result.digest()
    if digest != exp["data_sha256"]:
        return False, f"WRONG DATA: sha256 {digest}, expected {exp['data_sha256']}"
    return True, ""


def run(
    adapter: Adapter,
    cases: list[Case],
    fixtures_dir: Path = FIXTURES_DIR,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Outcome]:
    out = []
    for c in cases:
        t0 = time.perf_counter()
        passed, detail = judge(adapter, c, fixtures_dir, timeout_s)
        out.append(Outcome(c, passed, detail, adapter.expected_failures.get(c.id), time.perf_counter() - t0))
    return out


@dataclass
class Summary:
    passed: int = 0
    failed: int = 0
    expected_failures: int = 0
    lines: list[str] = field(default_factory=list)


# -- citations -------------------------------------------------------------------------------------------
SPEC_DIR = HERE.parent / "spec"
_CITATION = re.compile(r"^(?P<file>[a-z]+\.md) §(?P<section>[0-9]+(?:\.[0-9]+)*)(?: item (?P<item>[0-9]+))?")
_HEADING = re.compile(r"^#{2,4} (?P<section>[0-9]+(?:\.[0-9]+)*)\.? ")


def spec_sections(text: str) -> dict[str, str]:
    """The numbered sections of a spec file: number -> its text up to the next heading."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            m = _HEADING.match(line)
            current = out.setdefault(m["section"], []) if m else None
        elif current is not None:
            current.append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def check_citations(cases: list[Case], spec_dir: Path = SPEC_DIR) -> list[str]:
    """Every case's ``spec`` names a section that exists in spec/<file>, and the numbered item it names
    is in that section: the runner's self-test (``--self-test``), so that no citation can point nowhere."""
    sections: dict[str, dict[str, str]] = {}
    problems = []
    for c in cases:
        m = _CITATION.match(c.spec)
        if m is None:
            problems.append(f"{c.id}: citation {c.spec!r} is not '<file>.md §<section>[ item <n>]'")
            continue
        f = m["file"]
        if f not in sections:
            path = spec_dir / f
            sections[f] = spec_sections(path.read_text(encoding="utf-8")) if path.is_file() else {}
        body = sections[f].get(m["section"])
        if body is None:
            problems.append(f"{c.id}: {c.spec!r}: spec/{f} has no section {m['section']}")
        elif m["item"] and not re.search(rf"^\s*{m['item']}\. ", body, re.MULTILINE):
            problems.append(f"{c.id}: {c.spec!r}: section {m['section']} of spec/{f} has no item {m['item']}")
    return problems


def summarize(outcomes: list[Outcome], verbose: bool = False) -> Summary:
    s = Summary()
    for o in outcomes:
        c = o.case
        where = f"{c.feature}.json[{c.index}] {c.id}"
        if o.expected_failure is not None:
            if o.passed:
                s.failed += 1
                s.lines.append(
                    f"XPASS {where}: listed as an expected failure but passed; remove it from the list"
                )
            else:
                s.expected_failures += 1
                if verbose:
                    s.lines.append(f"xfail {where}: {o.detail} (known: {o.expected_failure})")
        elif o.passed:
            s.passed += 1
            if verbose:
                s.lines.append(f"ok    {where} ({o.seconds * 1e3:.0f} ms)")
        else:
            s.failed += 1
            s.lines.append(f"FAIL  {where}: {c.description}: {o.detail}")
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the UCL conformance suite against an implementation.")
    ap.add_argument(
        "--adapter-command", help="command line of a JSON-lines implementation (default: ucl in-process)"
    )
    ap.add_argument(
        "--serve", action="store_true", help="serve the ucl adapter over JSON lines on stdin/stdout"
    )
    ap.add_argument("--cases", type=Path, default=CASES_DIR)
    ap.add_argument("--fixtures", type=Path, default=FIXTURES_DIR)
    ap.add_argument("-k", dest="filter", help="only cases whose feature or id contains this")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per case")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument(
        "--self-test", action="store_true", help="check the suite itself: every case's spec citation exists"
    )
    a = ap.parse_args(argv)
    if a.serve:
        serve(UclAdapter())
        return 0
    cases = load_cases(a.cases)
    if a.self_test:
        problems = check_citations(cases)
        print("\n".join(problems) or f"{len(cases)} cases, every citation exists")
        return 1 if problems else 0
    if a.filter:
        cases = [c for c in cases if a.filter in c.id or a.filter in c.feature]
    adapter: Adapter = (
        SubprocessAdapter(shlex.split(a.adapter_command), a.timeout) if a.adapter_command else UclAdapter()
    )
    t0 = time.perf_counter()
    try:
        outcomes = run(adapter, cases, a.fixtures, a.timeout)
    finally:
        adapter.close()
    s = summarize(outcomes, a.verbose)
    for line in s.lines:
        print(line)
    xf = f", {s.expected_failures} expected failures" if s.expected_failures else ""
    print(
        f"{adapter.name}: {s.passed} passed, {s.failed} failed{xf} ({len(cases)} cases, "
        f"{time.perf_counter() - t0:.1f} s)"
    )
    return 1 if s.failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(HERE.parent))  # run from a checkout without installing
    sys.exit(main())
