"""`ucl.open` checks each array's consolidated entry when the array is first used (spec/core.md §10.2
item 5), not all of them at open: an open of a step of hundreds of tensors parses and checks only what it
reads. No check is dropped: every defect an eager parse finds in an entry, a use of that array finds,
with the same code; the checks that span the step still fail the open; the validator checks every entry.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from ucl.errors import UCLError
from ucl.format.metadata import Arrays, CommitRecord, StepMeta
from ucl.io import native as _native

STATE = {"w": torch.arange(66, dtype=torch.float32).reshape(11, 6), "h": torch.arange(5, dtype=torch.float16),
         "b": torch.tensor([True, False, True])}


def _reseal(root: Path, rel: str, text: bytes) -> None:
    (root / "steps/1" / rel).write_bytes(text)
    rec_path = root / "commits/1.json"
    rec = CommitRecord.from_bytes(rec_path.read_bytes(), str(rec_path), 1)
    rec_path.write_bytes(replace(rec, files={**rec.files, rel: (len(text), _native.crc32c(text))}).to_bytes())


def _edit_doc(root: Path, edit: Any) -> dict[str, Any]:
    doc = json.loads((root / "steps/1/zarr.json").read_bytes())
    edit(doc)
    _reseal(root, "zarr.json", json.dumps(doc, separators=(",", ":")).encode())
    return doc


def _codec(n: dict[str, Any]) -> dict[str, Any]:
    return n["codecs"][0]["configuration"]


EDITS = {
    "unsupported dtype": lambda n: n.update(data_type="float128"),
    "inner chunk not dividing": lambda n: _codec(n).update(chunk_shape=[4, 6]),
    "unknown codec": lambda n: _codec(n)["codecs"].insert(1, {"name": "blosc"}),
    "schema": lambda n: n.update(shape="eleven"),
    "name against key": lambda n: n["attributes"]["ucl"].update(name="x"),
    "limit": lambda n: n.update(shape=[1 << 40, 1 << 40]),
    "stale outside a composite step": lambda n: n["attributes"]["ucl"].update(
        delta={"mode": "stale", "base_step": 0, "age": 1}),
}


@pytest.mark.parametrize("defect", sorted(EDITS))
def test_a_defective_entry_fails_its_first_use_with_the_eager_code(tmp_path: Path, defect: str) -> None:
    ucl.save(STATE, tmp_path, step=1)
    doc = _edit_doc(tmp_path, lambda d: EDITS[defect](d["consolidated_metadata"]["metadata"]["w"]))
    with pytest.raises(UCLError) as eager:
        StepMeta.from_dict(doc, "step 1")
    with ucl.open(tmp_path) as ckpt:  # the open checks what spans the step; "w" is not used yet
        assert isinstance(ckpt.meta.arrays, Arrays)
        assert sorted(ckpt.keys()) == ["b", "h", "w"]
        assert torch.equal(ckpt["h"][:], STATE["h"]) and torch.equal(ckpt["b"][:], STATE["b"])
        for use in (lambda: ckpt["w"], lambda: ckpt.load(), lambda: ckpt.meta.arrays["w"]):
            with pytest.raises(UCLError) as lazy:
                use()
            assert lazy.value.code == eager.value.code, (defect, lazy.value, eager.value)
    report = ucl.validate(tmp_path)
    assert not report.ok and eager.value.code in {p.code for p in report.problems}


def test_the_checks_that_span_the_step_still_fail_the_open(tmp_path: Path) -> None:
    ucl.save(STATE, tmp_path, step=1)

    def orphan(d: dict[str, Any]) -> None:  # the tree names "w"; its array is gone
        del d["consolidated_metadata"]["metadata"]["w"]

    _edit_doc(tmp_path, orphan)
    with pytest.raises(UCLError) as e:
        ucl.open(tmp_path)
    assert e.value.code == "inconsistent_metadata" and "'w'" in str(e.value)

    def bad_key(d: dict[str, Any]) -> None:  # a path that is no canonical escape of a name
        m = d["consolidated_metadata"]["metadata"]
        m["a/../h"] = m["h"]

    ucl.save(STATE, tmp_path / "k", step=1)
    _edit_doc(tmp_path / "k", bad_key)
    with pytest.raises(UCLError) as e:
        ucl.open(tmp_path / "k")
    assert e.value.code == "invalid_name"


def test_a_lazy_open_reads_what_an_eager_parse_reads(tmp_path: Path) -> None:
    """Every entry, checked at first use, equals the eager parse's array (layout records included)."""
    from ucl.format.repository import Repository

    ucl.save({**STATE, "nested": {"x": torch.ones(3, 2)}}, tmp_path, step=1)
    repo = Repository.open(str(tmp_path))
    eager, lazy = repo.step_meta(1), repo.step_meta(1, lazy=True)
    assert isinstance(lazy.arrays, Arrays) and not isinstance(eager.arrays, Arrays)
    assert list(lazy.arrays) == list(eager.arrays) and len(lazy.arrays) == len(eager.arrays)
    assert dict(lazy.arrays) == dict(eager.arrays) and lazy == eager
