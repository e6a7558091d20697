"""A reader confirms each consolidated entry it uses against the array's own document (spec/core.md §5.1).

Found by the corruption fuzzer (tests/fuzz/test_corruption_fuzz.py, fixture valid/zstd): a step document
whose consolidated entry says shape [10, 6] where the array document (and the data) say [11, 6], resealed
in the commit record, was read as a [10, 6] tensor; the validator already said inconsistent_metadata.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from ucl.errors import InconsistentMetadataError
from ucl.format.metadata import CommitRecord
from ucl.io import native as _native
from ucl.options import WriteOptions

STATE = {"w": torch.arange(66, dtype=torch.float32).reshape(11, 6), "h": torch.arange(5, dtype=torch.float16),
         "empty": torch.zeros(0, 6)}


def _save(root: Path, version: int = 2) -> None:
    ucl.save(STATE, root, step=1, options=WriteOptions(format_version=version))


def _rewrite(root: Path, rel: str, text: bytes) -> None:
    """Replace step 1's file ``rel`` and reseal the commit record with its size and crc32c."""
    (root / "steps/1" / rel).write_bytes(text)
    rec_path = root / "commits/1.json"
    rec = CommitRecord.from_bytes(rec_path.read_bytes(), str(rec_path), 1)
    rec_path.write_bytes(replace(rec, files={**rec.files, rel: (len(text), _native.crc32c(text))}).to_bytes())


def _lie(root: Path, name: str, edit: Any) -> None:
    """Edit the consolidated entry of ``name`` in step 1's document; its own document is left as it is."""
    doc = json.loads((root / "steps/1/zarr.json").read_bytes())
    edit(doc["consolidated_metadata"]["metadata"][name])
    _rewrite(root, "zarr.json", json.dumps(doc, separators=(",", ":")).encode())


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(("name", "edit"), [
    ("w", lambda n: n.update(shape=[10, 6])),  # the fuzzer's case
    ("h", lambda n: n.update(data_type="bfloat16")),  # the same bytes as other values
    ("empty", lambda n: n.update(shape=[0, 5])),  # nothing to read: still confirmed
])
def test_a_lying_consolidated_entry_is_inconsistent_metadata(tmp_path: Path, version: int, name: str,
                                                              edit: Any) -> None:
    _save(tmp_path, version)
    try:
        _lie(tmp_path, name, edit)
    except (KeyError, IndexError, TypeError):
        pytest.fail(f"the step document of version {version} does not have the entry this test edits")
    with ucl.open(tmp_path) as ckpt:
        lazy = ckpt[name]
        with pytest.raises(InconsistentMetadataError, match="differs from the step's consolidated metadata") as e:
            lazy[:]
        assert e.value.tensor == name and e.value.file == f"steps/1/{name}/zarr.json"
        with pytest.raises(InconsistentMetadataError):
            ckpt.load()
        others = [n for n in STATE if n != name]
        ckpt.load_into({n: torch.empty_like(STATE[n]) for n in others})  # the other tensors still read
    report = ucl.validate(tmp_path)
    assert report.problems and {p.code for p in report.problems} == {"inconsistent_metadata"}


@pytest.mark.parametrize("version", [1, 2])
def test_a_step_ucl_wrote_is_confirmed_without_reading_array_documents(tmp_path: Path, version: int) -> None:
    _save(tmp_path, version)
    with ucl.open(tmp_path) as ckpt:
        got = ckpt.load(flat=True)
        assert ckpt._files.documents_read == 0
    assert all(torch.equal(got[n], t) for n, t in STATE.items())


def test_an_entry_written_otherwise_is_read_and_compared(tmp_path: Path) -> None:
    """Another writer's serialization (spaces, key order) of the same entry: confirmed by reading the
    array document, once per array."""
    _save(tmp_path)
    doc = json.loads((tmp_path / "steps/1/zarr.json").read_bytes())
    _rewrite(tmp_path, "zarr.json", json.dumps(doc, indent=2, sort_keys=True).encode())
    for n in STATE:
        _rewrite(tmp_path, f"{n}/zarr.json", json.dumps(json.loads((tmp_path / f"steps/1/{n}/zarr.json").read_bytes()),
                                                        indent=1).encode())
    with ucl.open(tmp_path) as ckpt:
        for _ in range(2):
            assert torch.equal(ckpt["w"][3:5], STATE["w"][3:5])
        got = ckpt.load(flat=True)
        assert ckpt._files.documents_read == len(STATE)
    assert all(torch.equal(got[n], t) for n, t in STATE.items())
    assert ucl.validate(tmp_path).ok
