"""Format version 3: a step document's packed members (spec/core.md §5.1 "Packed members", §9 item 6).

A layout step's document is written packed and reads, validates and compacts as before; every defect of
§5.1 items 1-4 gets its code, and a frame's declared size is judged before anything is decompressed."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numcodecs import Zstd

import ucl
from ucl.errors import LimitExceededError, SchemaError
from ucl.format import metadata, packed
from ucl.format.metadata import StepMeta
from ucl.options import WriteOptions

LAYOUT = 'ucl-layout 1\nmesh tp=2\n"w": shard(0, tp)\n"b": shard(1, tp)\n"emb": replicate\n'
W = torch.arange(40, dtype=torch.float32).reshape(8, 5)
B = torch.arange(12, dtype=torch.bfloat16).reshape(2, 6)
EMB = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))


def _save(path: Path, step: int = 1, **kw: Any) -> None:
    ucl.save_sharded([{"w": W[:4], "b": B[:, :3], "emb": EMB}, {"w": W[4:], "b": B[:, 3:], "emb": EMB}],
                     path, step, layout=LAYOUT, **kw)


def _doc(path: Path, step: int = 1) -> dict[str, Any]:
    return json.loads((path / f"steps/{step}/zarr.json").read_bytes())


def test_a_layout_step_is_written_packed_and_reads_as_before(tmp_path: Path) -> None:
    _save(tmp_path / "v3")
    _save(tmp_path / "v2", options=WriteOptions(format_version=2))
    v3, v2 = _doc(tmp_path / "v3"), _doc(tmp_path / "v2")
    assert set(v3["attributes"]["ucl"]) == {"format_version", "step", "kind", "parent", "packed"}
    assert v3["attributes"]["ucl"]["format_version"] == 3 and "consolidated_metadata" not in v3
    assert v2["attributes"]["ucl"]["format_version"] == 2 and "packed" not in v2["attributes"]["ucl"]
    expanded = metadata.expand_packed(v3, "v3")
    expanded["attributes"]["ucl"]["format_version"] = 2
    assert expanded == v2  # the same document, packed
    # the array documents are unchanged: a plain Zarr reader lists the step and reads them
    assert sorted(p.relative_to(tmp_path / "v3") for p in (tmp_path / "v3").rglob("*/zarr.json")) == \
        sorted(p.relative_to(tmp_path / "v2") for p in (tmp_path / "v2").rglob("*/zarr.json"))
    for root in (tmp_path / "v3", tmp_path / "v2"):
        with ucl.open(root) as ckpt:
            assert torch.equal(ckpt["w"][:], W) and torch.equal(ckpt["b"][:], B) and torch.equal(ckpt["emb"][:], EMB)
            assert torch.equal(ckpt["w"][3:6], W[3:6])
        assert ucl.validate(root).ok


def test_a_step_without_a_layout_stays_version_2(tmp_path: Path) -> None:
    ucl.save({"x": torch.arange(6.0)}, tmp_path, step=1)
    doc = _doc(tmp_path)
    assert doc["attributes"]["ucl"]["format_version"] == 2 and "consolidated_metadata" in doc


def test_the_writer_compresses_once_per_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager's steps of one plan pack the same members (the step number stays outside): a writer's
    document cache compresses them once, and compresses again when they change."""
    from ucl.write.step import DocumentCache, step_documents

    _save(tmp_path, 1)
    meta = ucl.open(tmp_path).meta
    calls: list[bytes] = []
    real = packed.pack
    monkeypatch.setattr(packed, "pack", lambda inner: calls.append(inner) or real(inner))
    cache = DocumentCache()
    docs = [step_documents(dataclasses.replace(meta, step=s), cache)["zarr.json"] for s in (1, 2, 3)]
    assert len(calls) == 1
    texts = [json.loads(d)["attributes"]["ucl"] for d in docs]
    assert len({t["packed"] for t in texts}) == 1 and [t["step"] for t in texts] == [1, 2, 3]
    other_tree = {"t": "dict", "items": [["k", {"t": "value", "v": 1}]]}
    step_documents(dataclasses.replace(meta, step=4, tree=other_tree), cache)
    assert len(calls) == 2  # other members: packed anew
    assert docs[0] == (tmp_path / "steps/1/zarr.json").read_bytes()  # what the save wrote


def test_compaction_writes_a_packed_step(tmp_path: Path) -> None:
    from ucl.tools.compact import compact

    _save(tmp_path, 1)
    compact(tmp_path, 1, force=True)
    assert _doc(tmp_path)["attributes"]["ucl"]["format_version"] == 3
    assert torch.equal(ucl.load(tmp_path, flat=True)["w"], W) and ucl.validate(tmp_path).ok


# -- §5.1 items 1-4: every defect, its code ------------------------------------------------------------
def _packed_doc(inner: bytes | None = None, text: str | None = None, **ucl_extra: Any) -> dict[str, Any]:
    if text is None:
        assert inner is not None
        text = packed.pack(inner)
    return {"zarr_format": 3, "node_type": "group",
            "attributes": {"ucl": {"format_version": 3, "step": 1, "kind": "full", "parent": None, "packed": text,
                                   **ucl_extra}}}


GOOD_INNER = (b'{"ucl":{"tree":{"t":"dict","items":[]},"layout":null,"mesh":null},'
              b'"consolidated_metadata":{"kind":"inline","must_understand":false,"metadata":{}}}')


def _frame_header(size: int, width: int) -> bytes:
    """A Zstandard frame header, single segment, declaring ``size`` in a field of ``width`` bytes."""
    flag = {1: 0, 2: 1, 4: 2, 8: 3}[width]
    value = size - 256 if width == 2 else size
    return b"\x28\xb5\x2f\xfd" + bytes([flag << 6 | 1 << 5]) + value.to_bytes(width, "little")


def _flipped(frame: bytes) -> bytes:
    """``frame`` with one byte of its first block's content inverted (its headers intact)."""
    at = len(frame) // 2
    return frame[:at] + bytes([frame[at] ^ 0xFF]) + frame[at + 1:]


def test_a_well_formed_packed_document_expands() -> None:
    meta = StepMeta.from_dict(_packed_doc(GOOD_INNER), "doc")
    assert meta.format_version == 3 and meta.tree == {"t": "dict", "items": []} and not meta.arrays


@pytest.mark.parametrize(("doc", "err", "words"), [
    pytest.param(_packed_doc(text="not base64!"), SchemaError, "not base64", id="not-base64"),
    pytest.param(_packed_doc(text="QUJD"), SchemaError, "not a Zstandard frame", id="not-a-frame"),
    pytest.param(_packed_doc(text=5), SchemaError, "not a string", id="not-a-string"),  # type: ignore[arg-type]
    pytest.param(_packed_doc(text=base64.b64encode(b"\x28\xb5\x2f\xfd\x00\x40" + b"x" * 20).decode()), SchemaError,
                 "does not declare its content size", id="no-content-size"),
    pytest.param(_packed_doc(text=base64.b64encode(b"\x28\xb5\x2f\xfd\x21\x07" + b"x" * 20).decode()), SchemaError,
                 "dictionary", id="dictionary"),
    pytest.param(_packed_doc(text=base64.b64encode(_frame_header(1, 1) + b"x").decode()), SchemaError,
                 "too few", id="declares-under-2"),
    pytest.param(_packed_doc(text=base64.b64encode(_frame_header(1 << 40, 8) + b"x" * 16).decode()),
                 LimitExceededError, "declares 1099511627776 bytes", id="declares-a-terabyte"),
    pytest.param(_packed_doc(text=base64.b64encode(_frame_header(257 << 20, 4) + b"x" * 16).decode()),
                 LimitExceededError, "more than the limit", id="declares-257-MiB"),
    pytest.param(_packed_doc(text=base64.b64encode(_frame_header(100, 1) + b"garbage").decode()), SchemaError,
                 "reserved block type", id="garbage-blocks"),
    pytest.param(_packed_doc(text=base64.b64encode(_frame_header(100, 1) + b"\x01\x01\x00").decode()),
                 SchemaError, "truncated", id="truncated-block"),
    pytest.param(_packed_doc(text=base64.b64encode(_flipped(Zstd(9).encode(GOOD_INNER * 3))).decode()), SchemaError,
                 "does not decompress|decompresses to|not valid JSON", id="corrupt-frame"),
    pytest.param(_packed_doc(text=base64.b64encode(Zstd(3).encode(GOOD_INNER) + b"tail").decode()), SchemaError,
                 "4 bytes after its Zstandard frame", id="data-after-the-frame"),
    pytest.param(_packed_doc(b"[1, 2]"), SchemaError, "holds no object", id="not-an-object"),
    pytest.param(_packed_doc(b'{"ucl": 3}'), SchemaError, "holds no object", id="ucl-not-an-object"),
    pytest.param(_packed_doc(b'{"ucl": {}, "other": 1}'), SchemaError, "holds no object", id="another-member"),
    pytest.param(_packed_doc(GOOD_INNER, tree={"t": "dict", "items": []}), SchemaError, "'tree' is both packed",
                 id="member-twice"),
    pytest.param({**_packed_doc(GOOD_INNER), "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                                                       "metadata": {}}},
                 SchemaError, "'consolidated_metadata' is both", id="consolidated-twice"),
    pytest.param(_packed_doc(b'{"ucl":{"tree":' + b"[" * 126 + b"]" * 126 + b"}}"), LimitExceededError,
                 "128 levels deep, more than the limit of 127", id="packed-depth-128"),
    pytest.param(_packed_doc(b"{\"ucl\":{\"tree\":NaN}}"), SchemaError, "not valid JSON", id="not-json"),
])
def test_each_defect_of_a_packed_document_has_its_code(doc: dict[str, Any], err: type, words: str) -> None:
    with pytest.raises(err, match=words):
        StepMeta.from_dict(doc, "doc")


def test_packed_depth_127_is_within_the_limit() -> None:
    """The same at depth 127 passes §3.4 and fails only the schema (a tree of lists is no tree)."""
    with pytest.raises(SchemaError, match="tree|schema"):
        StepMeta.from_dict(_packed_doc(b'{"ucl":{"tree":' + b"[" * 125 + b"]" * 125 + b"}}"), "doc")


def test_packed_in_a_version_2_document_is_a_schema_violation() -> None:
    doc = metadata.expand_packed(_packed_doc(GOOD_INNER), "doc")
    doc["attributes"]["ucl"].update(format_version=2, packed="QUJD")
    with pytest.raises(SchemaError):
        StepMeta.from_dict(doc, "doc")


def test_the_declared_size_is_judged_before_decompressing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame declaring more than the limit is refused from its header: the decoder is never called."""

    def boom(*a: Any, **k: Any) -> bytes:
        raise AssertionError("decompressed")

    monkeypatch.setattr(packed.Zstd, "decode", boom)
    doc = _packed_doc(text=base64.b64encode(_frame_header(300 << 20, 4) + b"\x00" * 32).decode())
    with pytest.raises(LimitExceededError):
        StepMeta.from_dict(doc, "doc")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_as_packed_give_a_format_error_or_expand(data: bytes) -> None:
    """Never another exception (a decoder's own, a KeyError): a format error with its code, or a document."""
    try:
        out = metadata.expand_packed(_packed_doc(text=base64.b64encode(data).decode()), "doc")
    except (SchemaError, LimitExceededError) as e:
        assert e.code in ("schema_violation", "limit_exceeded")
        return
    assert "packed" not in out["attributes"]["ucl"] and isinstance(out["attributes"]["ucl"], dict)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["tree", "layout", "mesh", "logical", "extensions"]),
                       st.recursive(st.none() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=5),
                                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                                        max_size=3),
                                    max_leaves=10), max_size=5),
       st.dictionaries(st.text(max_size=4), st.just({"zarr_format": 3, "node_type": "group", "attributes": {}}),
                       max_size=3))
def test_split_then_expand_is_the_identity(members: dict[str, Any], nodes: dict[str, Any]) -> None:
    doc = {"zarr_format": 3, "node_type": "group",
           "attributes": {"ucl": {"format_version": 3, "step": 4, "kind": "full", "parent": None, **members}},
           "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": nodes}}
    outer, inner = metadata.split_packed(doc)
    outer["attributes"]["ucl"]["packed"] = packed.pack(inner)
    assert metadata.expand_packed(json.loads(metadata.dumps(outer)), "doc") == doc


def test_plain_zarr_readers_list_a_packed_step(tmp_path: Path) -> None:
    """zarr-python finds no consolidated metadata in a packed step's group and lists its arrays instead;
    it and tensorstore read the plain arrays (a shard(0, tp) tensor and a replicated one) as before."""
    import numpy as np
    import tensorstore as ts
    import zarr

    from ucl.format import zarr_dtypes

    zarr_dtypes.register()  # bfloat16 for zarr 3.1, which does not load the entry point
    _save(tmp_path)
    group = zarr.open_group(tmp_path / "steps/1", mode="r")
    assert sorted(group.array_keys()) == ["b", "emb", "w"]
    assert np.array_equal(group["w"][:], W.numpy()) and np.array_equal(group["emb"][:], EMB.numpy())
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "steps/1/w")}}
    assert np.array_equal(ts.open(spec).result().read().result(), W.numpy())
