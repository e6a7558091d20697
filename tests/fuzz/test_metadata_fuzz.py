"""Fuzzing the metadata parsers: every input parses, or fails with a UCLError; never another exception,
never a hang, and what parses is within the spec's limits and round-trips."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.strategies import (
    CI,
    FIXTURES,
    LONG,
    bounded,
    json_values,
    mutated_docs,
    seal_commit,
    ucl_outcome,
)
from ucl.errors import SchemaError
from ucl.format import metadata, names
from ucl.format.metadata import MAX_ELEMENTS, MAX_INNER_CHUNKS_PER_SHARD, ArrayMeta, CommitRecord, StepMeta


def _doc(rel: str) -> Any:
    return json.loads((FIXTURES / rel).read_bytes())


STEP_DOC = _doc("valid/multi_shard/steps/2/zarr.json")
NAMES_STEP_DOC = _doc("valid/names/steps/5/zarr.json")
ARRAY_DOCS = [
    _doc("valid/multi_shard/steps/2/w/zarr.json"),
    _doc("valid/zstd/steps/2/sharded/zarr.json"),
    _doc("valid/shapes/steps/3/scalar_bool/zarr.json"),
]
COMMIT_RAW = (FIXTURES / "valid/multi_shard/commits/2.json").read_bytes()
COMMIT_DOC = json.loads(COMMIT_RAW)
REPO_RAW = (FIXTURES / "valid/multi_shard/zarr.json").read_bytes()


def check_array(meta: ArrayMeta) -> None:
    """What a parsed array promises the reader: limits held, a safe key, a faithful round trip."""
    assert meta.nbytes <= MAX_ELEMENTS and meta.n_inner <= MAX_INNER_CHUNKS_PER_SHARD
    assert meta.inner_nbytes <= 1 << 31
    assert all(type(x) is int and x >= 0 for x in meta.shape)
    assert all(type(x) is int and x > 0 for x in (*meta.chunk_shape, *meta.inner_chunk_shape))
    assert names.from_key(meta.key) == meta.name
    assert ArrayMeta.from_dict(meta.to_dict(with_logical=True), "round trip") == meta


def parse_array(doc: Any) -> None:
    with bounded("ArrayMeta.from_dict"):
        ok, meta = ucl_outcome(lambda: ArrayMeta.from_dict(doc, "fuzz"))
    if ok:
        check_array(meta)


def parse_step(doc: Any) -> None:
    with bounded("StepMeta.from_dict"):
        ok, meta = ucl_outcome(lambda: StepMeta.from_dict(doc, "fuzz"))
    if ok:
        for m in meta.arrays.values():
            check_array(m)
        # the document's own version, and the current one (a version 1 step rewritten as version 2)
        assert StepMeta.from_dict(meta.to_dict(format_version=meta.format_version), "round trip") == meta
        again = StepMeta.from_dict(meta.to_dict(), "round trip")
        assert dataclasses.replace(again, format_version=meta.format_version) == meta


def parse_commit(raw: bytes, step: int | None = 2) -> None:
    with bounded("CommitRecord.from_bytes"):
        ok, rec = ucl_outcome(lambda: CommitRecord.from_bytes(raw, "fuzz", step))
    if ok:
        for path, (size, crc) in rec.files.items():
            segs = path.split("/")
            assert (
                path and not path.startswith("/") and ".." not in segs and "." not in segs and "" not in segs
            )
            assert "\\" not in path and "\x00" not in path
            assert type(size) is int and 0 <= size < 2**63 and type(crc) is int and 0 <= crc < 2**32
        assert type(rec.step) is int and (step is None or rec.step == step)
        assert CommitRecord.from_bytes(rec.to_bytes(), "round trip", rec.step).files == rec.files


# -- the cases -----------------------------------------------------------------------------------------------
def test_valid_documents_parse() -> None:
    for d in ARRAY_DOCS:
        check_array(ArrayMeta.from_dict(d, "fixture"))
    parse_step(STEP_DOC)
    parse_step(NAMES_STEP_DOC)
    parse_commit(COMMIT_RAW)


def _with_logical(logical: Any) -> Any:
    doc = json.loads(json.dumps(ARRAY_DOCS[0]))
    doc["attributes"]["ucl"]["logical"] = logical
    return doc


def test_an_empty_logical_record_is_no_record() -> None:
    # CI's fuzzing found {"logical": {}} kept as a record that to_dict then dropped (spec/layout.md §6.2:
    # a writer omits the record or writes {})
    check_array(meta := ArrayMeta.from_dict(_with_logical({}), "fixture"))
    assert meta.logical is None


@pytest.mark.parametrize("logical", [[], 0, "", False, {"tensors": []}])
def test_a_falsy_or_malformed_logical_record_is_refused(logical: Any) -> None:
    with pytest.raises(SchemaError, match="logical"):
        ArrayMeta.from_dict(_with_logical(logical), "fixture")


@CI
@given(
    st.binary(max_size=512)
    | st.sampled_from(
        [
            b"[" * 5000,
            b"{" * 5000,
            b'{"a":' * 3000,
            b"1" * 6000,
            b"NaN",
            b"Infinity",
            b"-Infinity",
            b"\xff\xfe",
            b"\xef\xbb\xbf{}",
        ]
    )
)
def test_loads_any_bytes(raw: bytes) -> None:
    with bounded("metadata.loads"):
        ucl_outcome(lambda: metadata.loads(raw, "fuzz"))
    ucl_outcome(lambda: metadata.parse_repo(raw))
    parse_commit(raw)


@CI
@given(json_values)
def test_array_from_any_json(doc: Any) -> None:
    parse_array(doc)


@CI
@given(st.sampled_from(ARRAY_DOCS).flatmap(lambda d: mutated_docs(d)))
def test_array_from_mutated_documents(doc: Any) -> None:
    parse_array(doc)


@CI
@given(json_values)
def test_step_from_any_json(doc: Any) -> None:
    parse_step(doc)


@CI
@given(st.sampled_from([STEP_DOC, NAMES_STEP_DOC]).flatmap(lambda d: mutated_docs(d, max_edits=4)))
def test_step_from_mutated_documents(doc: Any) -> None:
    parse_step(doc)


@CI
@given(mutated_docs(COMMIT_DOC, max_edits=3), st.booleans())
def test_commit_from_mutated_documents(doc: Any, reseal: bool) -> None:
    parse_commit(seal_commit(doc) if reseal else json.dumps(doc).encode())


@CI
@given(st.binary(min_size=1, max_size=8), st.integers(0, len(COMMIT_RAW)))
def test_commit_with_bytes_changed(patch: bytes, at: int) -> None:
    raw = COMMIT_RAW[:at] + patch + COMMIT_RAW[at + len(patch) :]
    if raw != COMMIT_RAW:
        ok, _ = ucl_outcome(lambda: CommitRecord.from_bytes(raw, "fuzz", 2))
        if ok:  # whitespace only: the record must still say exactly the same
            assert json.loads(raw) == COMMIT_DOC


@CI
@given(mutated_docs(json.loads(REPO_RAW)))
def test_repository_document(doc: Any) -> None:
    ucl_outcome(lambda: metadata.parse_repo(json.dumps(doc).encode()))


# -- names: keys are data, never paths -----------------------------------------------------------------------
key_text = st.text(
    alphabet=st.sampled_from(list("%0123456789ABCDEFabcdef./_-xü \x00\\")), max_size=40
) | st.text(max_size=30)


@CI
@given(key_text)
def test_from_key_any_text(key: str) -> None:
    ok, name = ucl_outcome(lambda: names.from_key(key))
    if ok:
        assert names.to_key(name) == key  # only canonical escapes decode
        segs = key.split("/")
        assert (
            "" not in segs
            and "." not in segs
            and ".." not in segs
            and not any(s.startswith("__") for s in segs)
        )
        assert "\x00" not in key and "\\" not in key


@CI
@given(st.lists(st.text(min_size=1, max_size=20).filter(lambda s: "/" not in s), min_size=1, max_size=4))
def test_names_round_trip(segments: list[str]) -> None:
    name = "/".join(segments)
    ok, key = ucl_outcome(lambda: names.to_key(name))
    if ok:
        assert names.from_key(key) == name
        assert all(c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-%/" for c in key)


# -- the long variant (./dev test-long): >= 10,000 inputs per parser -----------------------------------------
@pytest.mark.slow
@LONG
@given(
    st.one_of(
        st.sampled_from(ARRAY_DOCS).flatmap(lambda d: mutated_docs(d)).map(lambda d: ("array", d)),
        st.sampled_from([STEP_DOC, NAMES_STEP_DOC])
        .flatmap(lambda d: mutated_docs(d, max_edits=4))
        .map(lambda d: ("step", d)),
        mutated_docs(COMMIT_DOC).map(lambda d: ("commit", d)),
        json_values.map(lambda d: ("any", d)),
        key_text.map(lambda k: ("key", k)),
    )
)
def test_long_metadata(item: tuple[str, Any]) -> None:
    kind, x = item
    if kind == "array":
        parse_array(x)
    elif kind == "step":
        parse_step(x)
    elif kind == "commit":
        parse_commit(seal_commit(x))
    elif kind == "any":
        parse_array(x)
        parse_step(x)
        parse_commit(seal_commit(x), None)
    else:
        test_from_key_any_text.hypothesis.inner_test(x)  # type: ignore[attr-defined]
