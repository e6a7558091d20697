"""Format version 2 (spec/core.md §9 item 5): compact documents, the logical records once per step in the
step document, a delta step taking its parent's records (spec/layout.md §6.9); version 1 still reads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ucl
from ucl.errors import DeltaChainError, InconsistentMetadataError, SchemaError, UCLError
from ucl.format import metadata
from ucl.format.metadata import ArrayMeta, StepMeta
from ucl.format.repository import Repository
from ucl.write.kinds import delta_array
from ucl.write.step import StepWriter, step_documents

TREE = {"t": "dict", "items": [["w", {"t": "tensor", "name": "w"}]]}
# spec/layout.md §6.3's example: w (10 elements) in 4 blocks of at most 3, stored [12] in chunks of 3
W = {"tensors": {"w": {"shape": [10], "dtype": "float32"}},
     "maps": [{"tensor": "w", "box": [[0], [3]], "at": [0]}, {"tensor": "w", "box": [[3], [2]], "at": [3]},
              {"tensor": "w", "box": [[5], [3]], "at": [6]}, {"tensor": "w", "box": [[8], [2]], "at": [9]}]}
BLOCKED = ArrayMeta(name="w", shape=(12,), dtype="float32", chunk_shape=(3,), inner_chunk_shape=(3,),
                    logical=W)


# -- records: packed and unpacked -------------------------------------------------------------------
idx = st.lists(st.integers(0, 2**40), min_size=1, max_size=3)


@st.composite
def record(draw: Any, dtype: str) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(["a", "b", "c/d", "e"]), min_size=1, max_size=4, unique=True))
    shapes = {n: [7] * (1 + sum(map(ord, n)) % 3) for n in names}  # one shape per name, whatever the array
    maps = []
    for _ in range(draw(st.integers(0, 6))):
        n = draw(st.sampled_from(names))
        r = len(shapes[n])
        box = [draw(st.lists(st.integers(0, 9), min_size=r, max_size=r)) for _ in range(2)]
        m: dict[str, Any] = {"tensor": n, "box": box}
        form = draw(st.sampled_from(["plain", "view", "short"]))
        if form == "plain":
            m["at"] = draw(idx)
        elif form == "view":
            m["at"] = draw(st.lists(st.integers(0, 9), min_size=r, max_size=r))
            m["view"] = {"offset": draw(st.integers(0, 2**40)), "shape": draw(idx)}
        else:  # what the packed form writes as [t, start, shape, offset]
            m["at"] = [0] * r
            m["view"] = {"offset": draw(st.integers(0, 2**40)), "shape": list(box[1])}
        maps.append(m)
    rec: dict[str, Any] = {"tensors": {n: {"shape": shapes[n], "dtype": dtype} for n in names}, "maps": maps}
    if draw(st.booleans()):
        rec["partial"] = {"reduce": "sum", "count": draw(st.integers(1, 4))}
    return rec


@st.composite
def steps(draw: Any) -> StepMeta:
    arrays = {}
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(["float32", "bfloat16"]))
        rec = draw(st.one_of(st.none(), record(dtype)))
        name = f"x/a{i}"
        arrays[name] = ArrayMeta(name=name, shape=(64,), dtype=dtype, chunk_shape=(8,),
                                 inner_chunk_shape=(8,), logical=rec)
    return StepMeta(step=5, kind="full", tree={"t": "dict", "items": []}, arrays=arrays)


@settings(max_examples=150, deadline=None)
@given(steps())
def test_records_round_trip_through_the_step_document(meta: StepMeta) -> None:
    """Every record comes back equal (dicts compare without order) from a version 2 document, its bytes
    those of step_documents, and from a version 1 document."""
    docs = step_documents(meta)
    assert docs["zarr.json"] == metadata.dumps(meta.to_dict())
    back = StepMeta.from_dict(metadata.loads(docs["zarr.json"], "v2"), "v2")
    want = {n: a.logical or None for n, a in meta.arrays.items()}
    assert {n: a.logical for n, a in back.arrays.items()} == {
        n: r if r and r["tensors"] else None for n, r in want.items()}
    for n, a in meta.arrays.items():
        node = json.loads(docs[f"{a.key}/zarr.json"])
        assert "logical" not in node["attributes"]["ucl"]  # the record is in the step document only
        assert ArrayMeta.from_dict(node, n) == ArrayMeta.from_dict(
            json.loads(metadata.dumps(a.to_dict())), n)
    v1 = StepMeta.from_dict(json.loads(metadata.dumps(meta.to_dict(format_version=1))), "v1")
    assert v1.format_version == 1
    assert {n: a.logical or None for n, a in v1.arrays.items()} == want


def test_documents_are_compact() -> None:
    meta = StepMeta(step=1, kind="full", tree=TREE, arrays={"w": BLOCKED})
    for data in step_documents(meta).values():
        assert b"\n" not in data and b": " not in data and b", " not in data


def test_tensors_are_listed_once_and_views_are_short() -> None:
    kw: dict[str, Any] = {"shape": (100,), "dtype": "float32", "chunk_shape": (50,),
                          "inner_chunk_shape": (50,)}
    flat = ArrayMeta(name="f", **kw, logical={
        "tensors": {"w": {"shape": [10], "dtype": "float32"}, "u": {"shape": [4, 2], "dtype": "float32"}},
        "maps": [{"tensor": "w", "box": [[0], [10]], "at": [0], "view": {"offset": 0, "shape": [10]}},
                 {"tensor": "u", "box": [[0, 0], [4, 2]], "at": [0, 0],
                  "view": {"offset": 10, "shape": [4, 2]}}]})
    other = ArrayMeta(name="g", **kw, logical={
        "tensors": {"w": {"shape": [10], "dtype": "float32"}},
        "maps": [{"tensor": "w", "box": [[0], [10]], "at": [0], "view": {"offset": 50, "shape": [10]}}]})
    packed = metadata.pack_logical({"f": flat, "g": other})
    bare = {"f": replace(flat, logical=None), "g": replace(other, logical=None)}
    back = metadata.unpack_logical(packed, bare, "x")
    assert back["f"].logical == flat.logical and back["g"].logical == other.logical
    assert packed == {"tensors": [["w", [10]], ["u", [4, 2]]],
                      "records": {"f": {"maps": [[0, [0], [10], 0], [1, [0, 0], [4, 2]]]},  # u follows w
                                  "g": {"maps": [[0, [0], [10], 50]]}}}


def _doc(logical: Any, **ucl_attrs: Any) -> dict[str, Any]:
    meta = StepMeta(step=2, kind="full", tree=TREE, arrays={"w": BLOCKED})
    doc = meta.to_dict()
    doc["attributes"]["ucl"]["logical"] = logical
    doc["attributes"]["ucl"].update(ucl_attrs)
    return doc


@pytest.mark.parametrize(("logical", "attrs", "error", "words"), [
    ({"tensors": [["w", [10]]], "records": {"w": {"maps": [[1, [0], [3], [0]]]}}}, {},
     InconsistentMetadataError, "names tensor 1; the step lists 1"),
    ({"tensors": [["w", [10]], ["w", [10]]], "records": {"w": {"maps": []}}}, {},
     InconsistentMetadataError, "lists tensor 'w' twice"),
    ({"tensors": [["w", [10]]], "records": {"v": {"maps": [[0, [0], [3], [0]]]}}}, {},
     InconsistentMetadataError, "no array of the step"),
    ({"tensors": [["w", [10]]], "records": {"w": {"maps": [[0, [0], [3], [0], 5]]}}}, {},
     SchemaError, "step.schema.json"),
    ({"tensors": [["w", [10]]], "records": {"w": {"maps": [[0, [0], [3], 4, 5, [3]]]}}}, {},
     SchemaError, "step.schema.json"),
    ({"tensors": [["w", [10]]], "records": {"w": {"maps": [[0, [0], [3]]]}}}, {},
     InconsistentMetadataError, "continues the previous map's view, and the previous map has none"),
    ({"tensors": [["w", [10]]], "records": {"w": {"maps": [[0, [0], [3], [0]], [0, [3], [2]]]}}}, {},
     InconsistentMetadataError, "continues the previous map's view"),
    ({"from": 1}, {}, InconsistentMetadataError, "only a delta step takes them, from its parent"),
    ({"from": 0}, {"kind": "delta", "parent": 1}, InconsistentMetadataError, "from its parent"),
    ({"tensors": [["w", [10]]], "records": {}}, {"format_version": 1}, SchemaError,
     "a version 1 step document has no attributes.ucl.logical"),
])
def test_bad_records_are_named(logical: Any, attrs: dict[str, Any], error: type[UCLError],
                               words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        StepMeta.from_dict(_doc(logical, **attrs), "doc")


@pytest.mark.parametrize("rec", [W, {}], ids=["record", "empty"])
def test_a_version_2_array_document_holds_no_record(rec: dict[str, Any]) -> None:
    """Not even ``{}`` (no record): the member itself is refused (spec/core.md §6 item 5), in the entry
    and in the array's own document."""
    doc = StepMeta(step=2, kind="full", tree=TREE, arrays={"w": BLOCKED}).to_dict()
    doc["consolidated_metadata"]["metadata"]["w"]["attributes"]["ucl"]["logical"] = rec
    with pytest.raises(SchemaError, match="holds no logical record"):
        StepMeta.from_dict(doc, "doc")
    plain = replace(BLOCKED, logical=None)
    own = plain.to_dict()
    own["attributes"]["ucl"]["logical"] = rec
    with pytest.raises(SchemaError, match="holds no logical record"):
        metadata.check_array_document(metadata.dumps(own), plain, 2, "w/zarr.json")
    metadata.check_array_document(metadata.dumps(plain.to_dict()), plain, 2, "w/zarr.json")


# -- a delta step taking its parent's records, through the writer and the readers -----------------
W_DATA = torch.arange(10, dtype=torch.float32) * 1.5


def _blocks() -> dict[tuple[int, ...], torch.Tensor]:
    out = {}
    for b, (start, n) in enumerate(((0, 3), (3, 2), (5, 3), (8, 2))):
        block = torch.zeros(3)
        block[:n] = W_DATA[start:start + n]
        out[(b,)] = block
    return out


def _commit(path: Path, meta: StepMeta, data: dict[tuple[int, ...], torch.Tensor], version: int = 2) -> None:
    repo = Repository.open(path, create=True)
    with StepWriter(repo, meta.step, format_version=version) as w:
        w.begin()
        files = dict(w.write_shard(meta.arrays["w"], c, t) for c, t in data.items())
        w.commit(meta, files)


def _chain(path: Path, deltas: int, version: int = 2) -> None:
    _commit(path, StepMeta(step=1, kind="full", tree=TREE, arrays={"w": BLOCKED}), _blocks(), version)
    for s in range(2, 2 + deltas):
        arrays = {"w": delta_array(BLOCKED, False, s - 1)}
        meta = StepMeta(step=s, kind="delta", parent=s - 1, tree=TREE, arrays=arrays, logical_from=s - 1)
        _commit(path, meta, {}, version)


def test_delta_steps_take_their_parents_records(tmp_path: Path) -> None:
    _chain(tmp_path, 3)
    docs = {s: (tmp_path / f"steps/{s}/zarr.json").read_bytes() for s in (1, 2, 3, 4)}
    assert json.loads(docs[3])["attributes"]["ucl"]["logical"] == {"from": 2}
    records = len(metadata.dumps(json.loads(docs[1])["attributes"]["ucl"]["logical"]))
    # the delta step's document: the full one's, less its records, plus the delta record and codec
    extra = (len(b',"delta":{"mode":"unchanged","base_step":1}')
             + len(b'"ucl.delta","configuration":{"encoding":"xor","base_step":1}'))
    assert len(docs[2]) <= len(docs[1]) - records + len(b'"from":1') + len(b'"delta","parent":1') + extra
    # a delta array has no document of its own (no Zarr reader can read it); the record lists the step's
    assert not (tmp_path / "steps/2/w/zarr.json").exists()
    assert set(Repository.open(tmp_path).commit_record(2).files) == {"zarr.json"}
    assert (tmp_path / "steps/1/w/zarr.json").exists()
    for s in (1, 2, 3, 4):
        with ucl.open(tmp_path, s) as ckpt:
            assert ckpt.meta.arrays["w"].logical == W
            assert torch.equal(ckpt["w"][:], W_DATA)
            assert torch.equal(ckpt["w"][4:9], W_DATA[4:9])
    assert ucl.validate(tmp_path).ok
    fresh = Repository.open(tmp_path)  # no cached records: the walk up to step 1
    assert fresh.step_meta(4).arrays["w"].logical == W


def test_a_missing_referent_is_broken_chain(tmp_path: Path) -> None:
    """A reader resolving the records of step 3 (from 2, from 1) finds step 1 gone: broken_chain, naming
    the step whose records could not be found, for open and for the validator."""
    _chain(tmp_path, 2)
    (tmp_path / "commits/1.json").unlink()
    with pytest.raises(DeltaChainError,
                       match="step 2 takes its logical records from step 1, which is not committed"):
        Repository.open(tmp_path).step_meta(3)
    report = ucl.validate(tmp_path)
    assert not report.ok
    assert {(p.step, p.code) for p in report.problems} >= {(2, "broken_chain"), (3, "broken_chain")}


# -- commit records: version 2 groups files by array, version 1 still reads ---------------------------
FILES = {"zarr.json": (900, 1), "w/zarr.json": (600, 2), "w/c/0": (40, 3), "w/c/1": (40, 4), "s/c": (8, 5),
         "a/c/b/zarr.json": (500, 6), "a/c/b/c/0/0": (64, 7), "optim/zarr.json": (60, 8)}


def test_commit_records_group_files_by_array() -> None:
    rec = metadata.CommitRecord(step=3, kind="full", files=FILES)
    doc = json.loads(rec.to_bytes())
    assert doc["ucl_commit"] == 2
    assert doc["files"][""] == {"zarr.json": [900, 1]}
    assert doc["files"]["w"] == {"c/0": [40, 3], "c/1": [40, 4], "zarr.json": [600, 2]}
    assert doc["files"]["s"] == {"c": [8, 5]}
    back = metadata.CommitRecord.from_bytes(rec.to_bytes(), "rec", 3)
    assert back == rec and back.files == FILES and back.version == 2
    v1 = metadata.CommitRecord(step=3, kind="full", files=FILES, time=rec.time, version=1)
    assert json.loads(v1.to_bytes())["files"]["w/c/0"] == [40, 3]
    assert metadata.CommitRecord.from_bytes(v1.to_bytes(), "rec", 3).files == FILES


def test_a_path_listed_twice_is_a_corrupt_record() -> None:
    from ucl.errors import CorruptCommitRecordError
    from ucl.io import native

    body = {"ucl_commit": 2, "step": 3, "kind": "full", "parent": None, "time": "2026-01-01T00:00:00.000000Z",
            "files": {"w": {"c/0": [40, 3]}, "": {"w/c/0": [40, 3]}}}
    body["checksum"] = native.crc32c(metadata.canonical(body))
    with pytest.raises(CorruptCommitRecordError, match="lists 'w/c/0' twice"):
        metadata.CommitRecord.from_bytes(metadata.dumps(body), "rec", 3)


_PART = st.text(st.sampled_from(["a", ".", "/", "\\", "\x00"]), max_size=5)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_PART, st.dictionaries(_PART, st.just([40, 3]), max_size=3), max_size=3))
def test_a_file_outside_its_step_is_refused_as_its_whole_path_says(files: dict[str, Any]) -> None:
    """The reader matches each group and each distinct rest once (not every joined path): the verdict is
    the one the joined paths give, file by file in the record's order."""
    from ucl.errors import CorruptCommitRecordError, InvalidNameError
    from ucl.io import native

    body = {"ucl_commit": 2, "step": 3, "kind": "full", "parent": None, "time": "2026-01-01T00:00:00.000000Z",
            "files": files}
    body["checksum"] = native.crc32c(metadata.canonical(body))
    want: type[Exception] | None = None
    seen: set[str] = set()
    for p, group in files.items():
        for r in group:
            k = f"{p}/{r}" if p else r
            if want is None and metadata._OUTSIDE.search(k):
                want = InvalidNameError
            if want is None and k in seen:
                want = CorruptCommitRecordError
            seen.add(k)
    if want is None:
        got = metadata.CommitRecord.from_bytes(metadata.dumps(body), "rec", 3)
        assert set(got.files) == seen
    else:
        with pytest.raises(want) as e:
            metadata.CommitRecord.from_bytes(metadata.dumps(body), "rec", 3)
        assert type(e.value) is want


def test_compacting_a_step_of_the_chain_keeps_its_children_readable(tmp_path: Path) -> None:
    """Step 2 (records from 1) rewritten full writes its records inline; step 3 (records from 2) reads
    them there, and retention keeping only step 3 keeps its chain (step 2), drops step 1, and the
    repository is still valid."""
    from ucl.tools.compact import compact
    from ucl.write.retention import Retention

    _chain(tmp_path, 2)
    compact(tmp_path, 2)
    doc = json.loads((tmp_path / "steps/2/zarr.json").read_bytes())["attributes"]["ucl"]
    assert doc["kind"] == "full" and doc["logical"]["records"]
    Retention(Repository.open(tmp_path), keep_last=1, keep_every=None).retain(3)  # keeps 3 and its chain
    assert Repository.open(tmp_path).steps() == [2, 3]
    with ucl.open(tmp_path, 3) as ckpt:
        assert ckpt.meta.arrays["w"].logical == W and torch.equal(ckpt["w"][:], W_DATA)
    assert ucl.validate(tmp_path).ok


def test_a_writer_of_version_1_writes_what_version_1_readers_read(tmp_path: Path) -> None:
    """format_version=1 (WriteOptions, StepWriter): records in the array documents, a document for the
    delta array, whole paths in the commit record; read and validated the same."""
    from ucl.options import WriteOptions

    _chain(tmp_path, 1, version=1)
    step1, step2 = (json.loads((tmp_path / f"steps/{s}/zarr.json").read_bytes()) for s in (1, 2))
    assert step1["attributes"]["ucl"]["format_version"] == 1 and "logical" not in step1["attributes"]["ucl"]
    assert json.loads((tmp_path / "steps/1/w/zarr.json").read_bytes())["attributes"]["ucl"]["logical"] == W
    assert (tmp_path / "steps/2/w/zarr.json").exists()
    record = json.loads((tmp_path / "commits/1.json").read_bytes())
    assert record["ucl_commit"] == 1 and "w/c/0" in record["files"]
    for s in (1, 2):
        with ucl.open(tmp_path, s) as ckpt:
            assert ckpt.meta.format_version == 1 and torch.equal(ckpt["w"][:], W_DATA)
    assert ucl.validate(tmp_path).ok
    ucl.save({"x": torch.arange(6.0)}, tmp_path / "plain", step=1, options=WriteOptions(format_version=1))
    assert json.loads((tmp_path / "plain/commits/1.json").read_bytes())["ucl_commit"] == 1
    assert torch.equal(ucl.load(tmp_path / "plain")["x"], torch.arange(6.0))
    with pytest.raises(ValueError, match="format_version must be 1, 2 or 3"):
        WriteOptions(format_version=4)
