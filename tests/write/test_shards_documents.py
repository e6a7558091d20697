"""A step's documents as the persister writes them (ucl.write.step.step_documents, ucl.write.shards): the
same bytes as metadata.dumps of each node, written on the C threads beside the shards, entered in the commit
record with their true size and crc32c; the paths made ahead of the encoding; the phases logged."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

import ucl
from ucl import CheckpointManager
from ucl.errors import WriteError
from ucl.format import metadata
from ucl.format.metadata import ArrayMeta, StepMeta
from ucl.format.structure import flatten
from ucl.io import native
from ucl.plan import save as saveplan
from ucl.write import shards
from ucl.write.kinds import delta_array
from ucl.write.step import DocumentCache, step_documents


def slow_documents(meta: StepMeta) -> dict[str, bytes]:
    """What StepWriter wrote before the cache: metadata.dumps of each node (but a delta array's: it has
    no document, spec/delta.md §3.2), then of the step document."""
    doc = meta.to_dict()
    nodes = doc["consolidated_metadata"]["metadata"]
    out = {f"{rel}/zarr.json": metadata.dumps(node) for rel, node in nodes.items()
           if "delta" not in node["attributes"].get("ucl", {})}
    out["zarr.json"] = metadata.dumps(doc)
    return out


def a_state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed": torch.randn(50, 8, generator=g),
            "layers": [{"w": torch.randn(4, 4, generator=g), "b": torch.zeros(4)}],
        },
        "optim": {'état/ünïcode "quoted" %2F': torch.ones(3, dtype=torch.bfloat16), "step": 7, "lr": 0.5},
        "scalar": torch.tensor(3.0),
        "flag": torch.tensor([True, False]),
        "notes": ["a\nb", {"nested": None, "metadata": {}}],
    }


def step_meta(state: dict[str, object], **kw: object) -> StepMeta:
    tensors, tree = flatten(state)
    plan = saveplan.single(tensors, **kw)  # type: ignore[arg-type]
    return StepMeta(step=12, kind="full", parent=None, tree=tree, arrays=plan.arrays)


@pytest.mark.parametrize("variant", ["plain", "zstd", "delta", "extensions", "empty"])
def test_step_documents_are_the_bytes_of_metadata_dumps(variant: str) -> None:
    meta = step_meta(
        a_state(),
        **(
            {"compression": {"name": "zstd", "configuration": {"level": 1, "checksum": False}}}
            if variant == "zstd"
            else {}
        ),
    )
    if variant == "delta":
        arrays = {n: delta_array(a, i % 2 == 0, 3) for i, (n, a) in enumerate(meta.arrays.items())}
        meta = StepMeta(step=13, kind="delta", parent=3, tree=meta.tree, arrays=arrays)
    elif variant == "extensions":
        meta = StepMeta(
            step=12,
            kind="full",
            parent=None,
            tree=meta.tree,
            arrays=meta.arrays,
            layout={"rules": []},
            mesh={"shape": [1]},
            extensions=({"name": "x.y", "v": [1, 2]},),
        )
    elif variant == "empty":
        meta = StepMeta(step=12, kind="full", parent=None, tree={"a": 1}, arrays={})
    want = slow_documents(meta)
    cache = DocumentCache()
    for _ in range(2):  # serialized, then from the cache
        got = step_documents(meta, cache, format_version=2)
        assert list(got) == list(want)
        assert got == want
    json.loads(got["zarr.json"])
    # version 3 (the default) packs a step with a layout (spec/core.md §5.1): the same array documents,
    # and a step document that expands to version 2's with its number; any other step is version 2's
    v3 = step_documents(meta, DocumentCache())
    assert {k: v for k, v in v3.items() if k != "zarr.json"} == {k: v for k, v in want.items() if k != "zarr.json"}
    if meta.layout is None:
        assert v3 == want
    else:
        doc = json.loads(v3["zarr.json"])
        assert set(doc["attributes"]["ucl"]) == {"format_version", "step", "kind", "parent", "packed"}
        assert "consolidated_metadata" not in doc
        assert metadata.expand_packed(doc, "v3") == meta.to_dict(3)


def test_the_cache_keys_by_the_object_and_is_bounded() -> None:
    meta = step_meta(a_state())
    a, b = list(meta.arrays.values())[:2]
    cache = DocumentCache(limit=1)
    assert cache.array(a) == metadata.dumps(a.to_dict())
    assert cache.array(b) == metadata.dumps(b.to_dict())  # a different object: its own document
    same_value = ArrayMeta(**a.__dict__)
    assert cache.array(same_value) == metadata.dumps(a.to_dict())
    assert len(cache._arrays) == 1  # the limit cleared it


def test_documents_go_through_the_engine_with_true_entries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="ucl.write")
    state = a_state()
    with CheckpointManager(tmp_path / "r") as mgr:
        for step in (1, 2):
            mgr.save(step, state).result()
    for step in (1, 2):
        record = ucl.Repository.open(str(tmp_path / "r")).commit_record(step)
        docs = {rel: e for rel, e in record.files.items() if rel.endswith("zarr.json")}
        assert "zarr.json" in docs and len(docs) > 3
        for rel, (size, crc) in docs.items():
            data = (tmp_path / "r" / "steps" / str(step) / rel).read_bytes()
            assert (size, crc) == (len(data), native.crc32c(data)), rel
    assert ucl.validate(str(tmp_path / "r")).ok
    got = ucl.load(str(tmp_path / "r"), 2)
    assert torch.equal(got["model"]["embed"], state["model"]["embed"])  # type: ignore[index]
    phases = [r.ucl_phases for r in caplog.records if hasattr(r, "ucl_phases")]
    assert len(phases) == 2
    assert set(shards.SHARD_PHASES) | {"gather", "commit", "retention", "verdict"} <= set(phases[-1])
    assert all(v >= 0 for v in phases[-1].values())


def test_a_failing_document_write_fails_the_step(tmp_path: Path) -> None:
    state = a_state()
    with CheckpointManager(tmp_path / "r") as mgr:
        mgr.save(1, state).result()
        (tmp_path / "r" / "steps" / "2" / "zarr.json").mkdir(
            parents=True
        )  # the step document cannot be a file
        real = mgr.repo.store.delete_prefix
        mgr.repo.store.delete_prefix = lambda prefix: None  # keep it (the manager clears the step first)
        try:
            with pytest.raises(ucl.UCLError, match="zarr.json"):
                mgr.save(2, state).result()  # raised while the shards' writes are in flight: all reaped
        finally:
            mgr.repo.store.delete_prefix = real
        mgr.save(3, state).result()
    assert ucl.Repository.open(str(tmp_path / "r")).steps() == [1, 3]
    assert ucl.validate(str(tmp_path / "r")).ok


def test_an_engine_write_error_fails_the_step(tmp_path: Path) -> None:
    state = a_state()
    with CheckpointManager(tmp_path / "r") as mgr:
        mgr.save(1, state).result()
        native.inject_fault("pwrite", nth=0, errno=errno.ENOSPC)  # every write: shards and documents
        try:
            with pytest.raises(WriteError):
                mgr.save(2, state).result()
        finally:
            native.inject_fault(None)
        mgr.save(3, state).result()
    assert ucl.Repository.open(str(tmp_path / "r")).steps() == [1, 3]


def test_a_refused_path_fails_the_step_and_leaves_no_helper_working(tmp_path: Path) -> None:
    state = a_state()
    with CheckpointManager(tmp_path / "r") as mgr:
        mgr.save(1, state).result()
        outside = tmp_path / "outside"
        outside.mkdir()
        step2 = tmp_path / "r" / "steps" / "2"
        # a symlink planted where a later array's directory goes: it resolves outside the repository
        key = sorted(
            ucl.Repository.open(str(tmp_path / "r")).step_meta(1).arrays.values(), key=lambda a: a.key
        )[-1].key
        target = step2 / key
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(outside, target)
        real = mgr.repo.store.delete_prefix
        mgr.repo.store.delete_prefix = lambda prefix: (
            None
        )  # keep the planted link (the manager clears the step)
        try:
            with pytest.raises(ucl.UCLError):
                mgr.save(2, state).result()
        finally:
            mgr.repo.store.delete_prefix = real
        assert not list(outside.iterdir())
        assert not [t for t in threading.enumerate() if t.name.startswith("ucl-paths") and _busy(t)]
        os.unlink(target)
        mgr.save(3, state).result()
    assert ucl.Repository.open(str(tmp_path / "r")).steps() == [1, 3]


def _busy(t: threading.Thread) -> bool:
    """A pool thread idles in its queue's get: its frame is the executor's worker loop, nothing deeper."""
    import sys

    frame = sys._current_frames().get(t.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "write_path":
            return True
        frame = frame.f_back
    return False
