"""The cases: what each case file says an implementation must do with a fixture.

``Suite`` collects the cases of every case file (``cases/<feature>.json``) in declaration order; ``Cases``
declares those of one file, with the shorthands the feature modules use (a valid result, an invalid
verdict, an error, one read case per tensor). Expected data is the sha256 of the little-endian bytes of
the *original* tensors, never of what a reader returned. The spec sections cases cite are named here.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from typing import Any

import torch

# spec sections (spec/core.md)
S_LAYOUT = "core.md §3 Repository layout"
S_REPO_DOC = "core.md §3.1 Repository document"
S_DTYPES = "core.md §4 Data types"
S_STEP_DOC = "core.md §5.1 Step group document"
S_NAMES = "core.md §5.2 Tensor names"
S_TREE = "core.md §5.3 Structure tree"
S_ARRAYS = "core.md §6 Arrays"
S_SHARD = "core.md §6.1 Shard encoding"
S_COMMIT = "core.md §7 Commit protocol"
S_INTEGRITY = "core.md §8 Integrity"
S_LIMITS = "core.md §8.4 Integrity (limits)"
S_EXT = "core.md §9 Extensions and versioning"

# spec sections (spec/delta.md)
S_GRAD = "delta.md §8 Extension: gradient records"
S_GRAD_SEM = "delta.md §8.1 Semantics"
S_GRAD_VAL = "delta.md §8.3 Validation"

assert sys.byteorder == "little", "expected data is computed from host bytes"


def le_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()


def sha(t: torch.Tensor, box: list[list[int]] | None = None) -> str:
    if box is not None:
        t = t[tuple(slice(a, b) for a, b in box)]
    return hashlib.sha256(le_bytes(t)).hexdigest()


class Suite:
    """Cases by feature, in declaration order."""

    def __init__(self) -> None:
        self.by_feature: dict[str, list[dict[str, Any]]] = {}

    def add(
        self,
        feature: str,
        description: str,
        section: str,
        fixture: str,
        operation: str,
        args: dict[str, Any] | None = None,
        **expected: Any,
    ) -> None:
        self.by_feature.setdefault(feature, []).append(
            {
                "description": description,
                "spec_section": section,
                "fixture": fixture,
                "operation": operation,
                "args": args or {},
                "expected": {k: v for k, v in expected.items() if v is not None},
            }
        )

    def cases(self, feature: str) -> Cases:
        return Cases(self, feature)


class Cases:
    """The cases of one feature (one case file); a file exists once its first case is added."""

    def __init__(self, suite: Suite, feature: str) -> None:
        self.suite = suite
        self.feature = feature

    def add(
        self,
        description: str,
        section: str,
        fixture: str,
        operation: str,
        args: dict[str, Any] | None = None,
        **expected: Any,
    ) -> None:
        self.suite.add(self.feature, description, section, fixture, operation, args, **expected)

    def valid(
        self, desc: str, section: str, fx: str, op: str, args: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        self.add(desc, section, fx, op, args, verdict="valid", **kw)

    def invalid(
        self, desc: str, section: str, fx: str, code: str, args: dict[str, Any] | None = None
    ) -> None:
        self.add(desc, section, fx, "validate", args, verdict="invalid", code=code)

    def error(
        self,
        desc: str,
        section: str,
        fx: str,
        op: str,
        code: str,
        args: dict[str, Any] | None = None,
        may_fail_with: list[str] | None = None,
    ) -> None:
        self.add(desc, section, fx, op, args, verdict="error", code=code, may_fail_with=may_fail_with)

    def reads(
        self,
        section: str,
        fx: str,
        tensors: dict[str, torch.Tensor],
        step: int | None = None,
        boxes: dict[str, list[list[list[int]]]] | None = None,
        what: Callable[[str], str] | None = None,
        may_fail_with: list[str] | None = None,
    ) -> None:
        """One case per tensor (and per box); ``what(name)`` is appended to the descriptions."""
        for name, t in tensors.items():
            a = {"tensor": name} if step is None else {"tensor": name, "step": step}
            tail = "" if what is None else what(name)
            self.valid(
                f"read {name!r} whole ({t.dtype}, shape {list(t.shape)}){tail}",
                section,
                fx,
                "read",
                a,
                data_sha256=sha(t),
                shape=list(t.shape),
                may_fail_with=may_fail_with,
            )
            for box in (boxes or {}).get(name, []):
                self.valid(
                    f"read {name!r}[{', '.join(f'{a}:{b}' for a, b in box)}]{tail}",
                    section,
                    fx,
                    "read",
                    {**a, "slice": box},
                    data_sha256=sha(t, box),
                    shape=[b - a for a, b in box],
                    may_fail_with=may_fail_with,
                )

    def broken_read(
        self,
        fx: str,
        tensor: str,
        code: str,
        what: str,
        section: str = S_INTEGRITY,
        box: list[list[int]] | None = None,
    ) -> None:
        """Reading ``tensor`` (or a box of it) fails with ``code``; ``what`` ends the description."""
        args: dict[str, Any] = {"tensor": tensor}
        if box is not None:
            args["slice"] = box
        self.error(f"reading {tensor!r} {what}", section, fx, "read", code, args)
