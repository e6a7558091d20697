"""Hypothesis strategies and helpers for fuzzing ucl's parsers, reader and validator on hostile input.

Fuzzing runs two profiles: ``ci`` (the default: a few hundred inputs per test, well under a minute in all)
and ``long`` (``UCL_FUZZ_EXAMPLES``, default 10,000 per test), used by the tests marked ``slow``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ucl.errors import UCLError
from ucl.format import metadata
from ucl.io import native as _native

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "conformance" / "fixtures"
TIME_BOUND_S = 10.0  # any single input: far above what a valid input takes (tens of ms)
LONG_EXAMPLES = int(os.environ.get("UCL_FUZZ_EXAMPLES", "10000"))

CI = settings(
    max_examples=int(os.environ.get("UCL_FUZZ_CI_EXAMPLES", "200")),
    deadline=timedelta(seconds=TIME_BOUND_S),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LONG = settings(CI, max_examples=LONG_EXAMPLES)

# -- JSON -------------------------------------------------------------------------------------------------
INTERESTING_INTS = [
    0,
    1,
    -1,
    2,
    3,
    4,
    255,
    256,
    2**16,
    2**24,
    2**24 + 1,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**62,
    2**62 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    10**30,
]
json_scalars = (
    st.none()
    | st.booleans()
    | st.sampled_from(INTERESTING_INTS)
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, -0.0, 4.0, 1e308])
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "",
            ".",
            "..",
            "../..",
            "/etc/passwd",
            "a/../b",
            "%2E%2E",
            "__x",
            "\x00",
            "float32",
            "bfloat16",
            "bool",
            "zstd",
            "gzip",
            "full",
            "delta",
            "regular",
            "sharding_indexed",
            "bytes",
            "crc32c",
            "little",
            "big",
            "inline",
            "array",
            "group",
            "tensor",
            "dict",
            "list",
            "nan",
            "w",
            "s",
            "c",
            "v",
        ]
    )
)
json_values = st.recursive(
    json_scalars,
    lambda ch: (
        st.lists(ch, max_size=4)
        | st.dictionaries(
            st.text(max_size=8) | st.sampled_from(["name", "configuration", "t", "items", "must_understand"]),
            ch,
            max_size=4,
        )
    ),
    max_leaves=16,
)


def _slots(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths to every node of a JSON document (the root is ())."""
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _slots(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _slots(v, (*path, i))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


@st.composite
def mutated_docs(draw: st.DrawFn, base: Any, max_edits: int = 3) -> Any:
    """``base`` with 1..max_edits edits: a node replaced by a random or interesting value, deleted, a key
    added, a number nudged, a list grown or shrunk."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, max_edits))):
        paths = list(_slots(doc))
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "delete", "add_key", "nudge", "grow", "shrink"]))
        if not path:
            if action == "replace":
                doc = draw(json_values)
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        node = parent[key]
        if action == "replace":
            parent[key] = draw(json_values)
        elif action == "delete":
            del parent[key]
        elif action == "add_key" and isinstance(node, dict):
            node[
                draw(
                    st.text(max_size=8)
                    | st.sampled_from(["extensions", "must_understand", "logical", "delta"])
                )
            ] = draw(json_values)
        elif action == "nudge" and type(node) is int:
            parent[key] = node + draw(st.sampled_from([-1, 1, 2**32, -(2**63), 2**63, 10**6]))
        elif action == "grow" and isinstance(node, list):
            node.append(draw(json_values) if not node or draw(st.booleans()) else copy.deepcopy(node[-1]))
        elif action == "shrink" and isinstance(node, list) and node:
            node.pop(draw(st.integers(0, len(node) - 1)))
    return doc


def seal_commit(doc: Any) -> bytes:
    """A commit record document with a correct checksum (so a mutation reaches the checks behind it)."""
    if isinstance(doc, dict):
        body = {k: v for k, v in doc.items() if k != "checksum"}
        with contextlib.suppress(ValueError, TypeError):
            doc = {**body, "checksum": _native.crc32c(metadata.canonical(body))}
    return json.dumps(doc).encode()


# -- the outcome rule ---------------------------------------------------------------------------------------
@contextmanager
def bounded(what: str, limit_s: float = TIME_BOUND_S) -> Iterator[None]:
    """Fail when the body takes longer than ``limit_s`` (on top of hypothesis' deadline)."""
    t0 = time.perf_counter()
    yield
    took = time.perf_counter() - t0
    assert took < limit_s, f"{what} took {took:.1f} s"


def ucl_outcome(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, result) or (False, the UCLError). Any other exception propagates and fails the test."""
    try:
        return True, fn()
    except UCLError as e:
        assert isinstance(e.code, str) and e.code
        return False, e


# -- repositories in memory ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """A fixture repository's files, read once; materialized into a fresh folder for each input."""

    name: str
    files: dict[str, bytes]

    @classmethod
    def of(cls, fixture: str) -> Snapshot:
        root = FIXTURES / fixture
        assert root.is_dir(), f"fixture {fixture} is missing (committed; never regenerated by tests)"
        files = {
            p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
        }
        return cls(fixture, files)

    def write(self, dest: Path, files: dict[str, bytes] | None = None) -> Path:
        if dest.exists():
            shutil.rmtree(dest)
        for rel, data in (self.files if files is None else files).items():
            p = dest / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        return dest

    def is_json(self, rel: str) -> bool:
        return rel.endswith(".json")


def reseal_file(files: dict[str, bytes], rel: str) -> None:
    """After changing a file of a step, record its new size and crc32c in that step's commit record."""
    parts = rel.split("/")
    if parts[0] != "steps" or len(parts) < 3:
        return
    key = f"commits/{parts[1]}.json"
    if key not in files:
        return
    try:
        doc = json.loads(files[key])
        doc["files"]["/".join(parts[2:])] = [len(files[rel]), _native.crc32c(files[rel])]
    except (ValueError, KeyError, TypeError):
        return
    files[key] = seal_commit(doc)


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """Damage as a disk or a bad copy does: bit flips, truncation, inserted, overwritten or appended bytes."""
    kind = draw(st.sampled_from(["flip", "flip", "truncate", "insert", "overwrite", "append", "zero"]))
    n = len(data)
    if kind == "flip" and n:
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, n - 1))
            out[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    if kind == "truncate" and n:
        return data[: draw(st.integers(0, n - 1))]
    if kind == "insert":
        i = draw(st.integers(0, n))
        return data[:i] + draw(st.binary(min_size=1, max_size=16)) + data[i:]
    if kind == "overwrite" and n:
        i = draw(st.integers(0, n - 1))
        chunk = draw(st.binary(min_size=1, max_size=min(16, n - i)))
        return data[:i] + chunk + data[i + len(chunk) :]
    if kind == "zero" and n:
        i = draw(st.integers(0, n - 1))
        j = draw(st.integers(i + 1, n))
        return data[:i] + bytes(j - i) + data[j:]
    return data + draw(st.binary(min_size=1, max_size=16))


def u64(x: int) -> bytes:
    return struct.pack("<Q", x)
