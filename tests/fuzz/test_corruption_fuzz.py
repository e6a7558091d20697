"""Fuzzing the reader and the validator with damaged and lying repositories (copies of conformance fixtures).

For every input: ``ucl.validate`` returns a report and every read either returns exactly the committed
data or raises a UCLError (never another exception, never other data, within a time bound). Damage that
a disk or a bad copy causes (bit flips, truncations, insertions, deletions; the commit record left as it
was) is always detected by the validator, except where the spec makes it meaningless: deleting a commit
record deletes a step, and a commit record or an unchecksummed group document whose parsed JSON is
unchanged says the same thing.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ucl
from tests.fuzz.strategies import (
    CI,
    LONG,
    Snapshot,
    bounded,
    byte_mutations,
    mutated_docs,
    reseal_file,
    seal_commit,
    ucl_outcome,
)
from ucl.errors import UCLError

BASES = ["valid/multi_shard", "valid/zstd", "valid/shapes", "valid/names"]


@cache
def snapshot(fixture: str) -> Snapshot:
    return Snapshot.of(fixture)


@cache
def committed(fixture: str) -> dict[tuple[int, str], tuple[tuple[int, ...], bytes]]:
    """Every tensor of every step of the pristine fixture: (step, name) -> (shape, little-endian bytes)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = snapshot(fixture).write(Path(tmp) / "r")
        report = ucl.validate(root)
        assert report.ok, report.problems
        for step in report.steps:
            with ucl.open(root, step) as ckpt:
                for name in ckpt:
                    out[(step, name)] = (tuple(ckpt[name].shape), _bytes(ckpt[name].read()))
    return out


def _bytes(t: Any) -> bytes:
    import torch

    flat = t.contiguous().reshape(-1)
    return (flat.view(torch.uint8) if flat.dtype != torch.bool else flat.view(torch.uint8)).numpy().tobytes()


def check_repository(fixture: str, root: Path) -> bool:
    """Validate and read everything; returns the verdict. Fails on a crash, a hang or other data."""
    expected = committed(fixture)
    with bounded("validate"):
        report = ucl.validate(root)
    assert all(isinstance(p.code, str) for p in report.problems)
    for (step, name), (shape, data), ok, got in _read_all(root, expected):
        if ok:
            assert got == (shape, data), (
                f"WRONG DATA for {name!r} of step {step} (validator said ok={report.ok})"
            )
        elif got.code in ("not_found", "not_committed"):
            assert step not in report.steps, f"step {step} was validated but does not open: {got}"
        else:
            assert not report.ok, (
                f"the validator found no problem, but reading {name!r} of step {step} fails: [{got.code}]"
            )
    if report.ok:  # what validates opens, latest included
        with bounded("open latest"):
            ok, got = ucl_outcome(lambda: _open_latest(root))
        assert ok or got.code == "not_found", f"valid, but the latest step does not open: [{got.code}] {got}"
    return report.ok


def _read_all(root: Path, expected: dict[tuple[int, str], Any]) -> Iterator[tuple[Any, Any, bool, Any]]:
    """(key, expected, ok, (shape, bytes) or the UCLError) for every committed tensor; one open per step."""
    for step in sorted({s for s, _ in expected}):
        with bounded(f"open step {step}"):
            opened, ckpt = ucl_outcome(lambda step=step: ucl.open(root, step))
        for (s, name), want in expected.items():
            if s != step:
                continue
            if not opened:
                yield (s, name), want, False, ckpt
                continue
            with bounded(f"read {name!r} of step {step}"):
                ok, got = ucl_outcome(lambda name=name, ckpt=ckpt: ckpt[name].read())
            yield (s, name), want, ok, ((tuple(got.shape), _bytes(got)) if ok else got)
        if opened:
            ckpt.close()


def _open_latest(root: Path) -> int:
    with ucl.open(root) as ckpt:
        return ckpt.step


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return ValueError  # a sentinel no parsed document equals


def must_detect(rel: str, old: bytes, new: bytes | None) -> bool:
    """Whether the spec requires a validator to notice this damage (see the module docstring)."""
    if new == old:
        return False
    if rel.startswith("commits/"):
        return new is not None and _json(new) != _json(old)
    if rel == "steps/zarr.json" or (
        rel.startswith("steps/")
        and rel.endswith("zarr.json")
        and rel.count("/") > 2
        and new is not None
        and _json(new) == _json(old)
    ):
        return False
    if rel == "zarr.json":
        return new is None or _json(new) != _json(old)
    return True


Changes = dict[str, "bytes | None"]  # file -> new content (None: deleted); printed small when a case fails


@st.composite
def damaged(draw: st.DrawFn, bases: list[str] = BASES) -> tuple[str, Changes]:
    """A fixture with 1-2 files damaged as a disk would: (fixture, {file: new bytes or None})."""
    fixture = draw(st.sampled_from(bases))
    files = snapshot(fixture).files
    changes: Changes = {}
    for _ in range(draw(st.integers(1, 2))):
        rel = draw(st.sampled_from(sorted(files)))
        old = files[rel] if changes.get(rel, b"") is not None else b""
        changes[rel] = None if draw(st.integers(0, 9)) == 0 else draw(byte_mutations(changes.get(rel) or old))
    return fixture, changes


@st.composite
def lying(draw: st.DrawFn, bases: list[str] = BASES) -> tuple[str, Changes]:
    """A fixture whose JSON documents lie, resealed (sizes, crc32c's, checksums recomputed) so that the lie
    itself reaches the checks behind the checksums: (fixture, {file: new bytes})."""
    fixture = draw(st.sampled_from(bases))
    files = dict(snapshot(fixture).files)
    before = dict(files)
    docs = sorted(k for k in files if k.endswith(".json") and k != "steps/zarr.json")
    for _ in range(draw(st.integers(1, 2))):
        rel = draw(st.sampled_from(docs))
        doc = draw(mutated_docs(json.loads(files[rel]), max_edits=3))
        if rel.startswith("commits/"):
            files[rel] = seal_commit(doc)
        else:
            files[rel] = json.dumps(doc).encode()
            reseal_file(files, rel)
    return fixture, {k: v for k, v in files.items() if before[k] != v}


def _apply(fixture: str, changes: Changes) -> dict[str, bytes]:
    files = dict(snapshot(fixture).files)
    for rel, new in changes.items():
        if new is None:
            files.pop(rel, None)
        else:
            files[rel] = new
    return files


def run_damaged(item: tuple[str, Changes]) -> None:
    fixture, changes = item
    base = snapshot(fixture).files
    with tempfile.TemporaryDirectory() as tmp:
        valid = check_repository(fixture, snapshot(fixture).write(Path(tmp) / "r", _apply(fixture, changes)))
    gone = {
        rel[len("commits/") : -len(".json")]
        for rel, new in changes.items()
        if rel.startswith("commits/") and (new is None or _json(new) is ValueError)
    }  # a step whose record is gone has no files to damage
    undetected = [
        rel
        for rel, new in changes.items()
        if must_detect(rel, base[rel], new) and not (rel.startswith("steps/") and rel.split("/")[1] in gone)
    ]
    assert not (valid and undetected), f"damage to {undetected} in {fixture} was not detected"


def run_lying(item: tuple[str, Changes]) -> None:
    fixture, changes = item
    with tempfile.TemporaryDirectory() as tmp:
        check_repository(fixture, snapshot(fixture).write(Path(tmp) / "r", _apply(fixture, changes)))


# -- the cases -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", BASES)
def test_pristine_fixtures_read_back(fixture: str) -> None:
    assert committed(fixture)
    with tempfile.TemporaryDirectory() as tmp:
        assert check_repository(fixture, snapshot(fixture).write(Path(tmp) / "r"))


@CI
@given(damaged())
def test_damage_is_detected_and_never_returns_other_data(item: tuple[str, Changes]) -> None:
    run_damaged(item)


@CI
@given(lying())
def test_lying_metadata_never_crashes_or_returns_other_data(item: tuple[str, Changes]) -> None:
    run_lying(item)


def test_every_kind_of_damage_is_detected_in_every_shard() -> None:
    """Exhaustive over the shards of three tensors: a flipped bit at every 13th byte, truncation by one byte,
    one inserted byte, deletion. All detected; no read returns other data."""
    fixture = "valid/multi_shard"
    base = snapshot(fixture).files
    shards = [k for k in base if "/w/c/" in k or "/v/c/" in k or "/m/c/" in k]
    assert len(shards) > 10
    n = 0
    for rel in shards:
        old = base[rel]
        variants = [old[:i] + bytes([old[i] ^ 0x10]) + old[i + 1 :] for i in range(0, len(old), 13)]
        variants += [old[:-1], old[:3] + b"\x00" + old[3:], None]
        for new in variants:
            run_damaged((fixture, {rel: new}))
            n += 1
    assert n > 100


def test_outcome_rule_rejects_other_exceptions() -> None:
    with pytest.raises(KeyError):
        ucl_outcome(lambda: {}["x"])
    assert ucl_outcome(lambda: (_ for _ in ()).throw(UCLError("x")))[0] is False


# -- the long variant (./dev test-long): >= 10,000 damaged or lying repositories -----------------------------
@pytest.mark.slow
@LONG
@given(st.one_of(damaged().map(lambda x: ("damaged", x)), lying().map(lambda x: ("lying", x))))
def test_long_corruption(item: tuple[str, Any]) -> None:
    kind, x = item
    run_damaged(x) if kind == "damaged" else run_lying(x)
