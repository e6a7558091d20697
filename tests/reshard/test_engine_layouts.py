"""The engine under a layout on real processes: bad layouts fail on every rank before any byte is
written (and the manager still saves afterwards), DTensor states (layout derived from placements) save
one way and load another in place, and delta steps of a layout save read back logically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from ucl.format import metadata
from ucl.testing import dist

from .cases import perturbed

pytestmark = pytest.mark.dist


def _no_step_files(path: str) -> bool:
    if not os.path.exists(path):
        return True
    steps = os.path.join(path, "steps")
    listed = sorted(os.listdir(steps)) if os.path.isdir(steps) else []
    commits = os.path.join(path, "commits")
    return listed in ([], ["zarr.json"]) and (not os.path.isdir(commits) or not os.listdir(commits))


def test_bad_layouts_fail_on_every_rank_before_any_byte_is_written(
    tmp_path: Any, ref: dict[str, Any]
) -> None:
    results = dist.run(2, "tests.reshard.cases:bad_layouts", {"root": str(tmp_path), "ref": ref["path"]})
    expect = {
        "unmatched": "pattern_unmatched",
        "overlap": "rules_overlap",
        "fused_size": "layout_shape_mismatch",
        "rank_shape": "layout_shape_mismatch",
        "mesh_world": "mesh_mismatch",
        "mesh_axis": "mesh_mismatch",
    }
    for rank, r in enumerate(results):
        assert {case: out["error"] for case, out in r.items()} == expect, rank
    assert "**nonexistent.weight" in results[0]["unmatched"]["message"]
    assert "matches rule 2" in results[0]["overlap"]["message"]
    assert (
        "[64, 33]" in results[1]["rank_shape"]["message"]
    )  # rank 0's view of rank 1's tensor, on rank 1 too
    assert "world has 2" in results[0]["mesh_world"]["message"]
    for case in expect:
        if case == "rank_shape":
            continue
        assert _no_step_files(os.path.join(tmp_path, case)), case
    # the manager that refused a bad state still saves a good one (its collectives stayed in step)
    assert results[0]["rank_shape"]["then"] == [2]
    assert ucl.Repository.open(os.path.join(tmp_path, "rank_shape")).steps() == [2]


def test_dtensor_states_reshard_in_place(tmp_path: Any) -> None:
    results = dist.run(2, "tests.reshard.cases:dtensor_roundtrip", {"root": str(tmp_path)})
    for r in results:
        assert r == {"w": True, "v": True, "b": True, "n": True, "logical": True}
    assert ucl.validate(os.path.join(tmp_path, "dtensor")).ok


def test_delta_steps_under_a_layout(tmp_path: Any, ref: dict[str, Any]) -> None:
    results = dist.run(2, "tests.reshard.cases:delta_steps", {"root": str(tmp_path), "ref": ref["path"]})
    assert all(r["restored"] for r in results)
    path = os.path.join(tmp_path, "delta")
    want = perturbed(ref["state"])
    with ucl.open(path, 3) as ckpt:
        assert ckpt.kind == "delta"
        got = ckpt.load(flat=True)
        # unchanged tensors cost nothing
        assert sum(1 for a in ckpt.meta.arrays.values() if a.delta["mode"] == "unchanged") > 0
    assert all(torch.equal(got[n], t) for n, t in want.items())
    assert ucl.validate(path).ok
    from ucl.tools.compact import compact

    compact(path, 3)  # the delta step rewritten as a full one, through Checkpoint.array
    with ucl.open(path, 3) as ckpt:
        assert ckpt.kind == "full"
        got = ckpt.load(flat=True)
    assert all(torch.equal(got[n], t) for n, t in want.items())
    assert ucl.validate(path).ok


def test_delta_step_under_a_layout_refers_to_its_parents_records(tmp_path: Any, ref: dict[str, Any]) -> None:
    """A delta step whose arrays keep their layout writes ``logical: {"from": parent}``, not the records
    again (spec/layout.md §6.9): its step document is smaller than the parent's by the records' size,
    and it reads the same records."""

    dist.run(2, "tests.reshard.cases:delta_steps", {"root": str(tmp_path), "ref": ref["path"]})
    path = os.path.join(tmp_path, "delta")
    # version 3 packs both documents (spec/core.md §5.1): compared expanded, and by their packed size
    raw = {s: Path(path, "steps", str(s), "zarr.json").read_bytes() for s in (2, 3)}
    docs = {s: metadata.expand_packed(json.loads(raw[s]), str(s)) for s in (2, 3)}
    full, delta = (docs[s]["attributes"]["ucl"] for s in (2, 3))
    assert all(json.loads(raw[s])["attributes"]["ucl"]["format_version"] == 3 for s in (2, 3))
    assert delta["logical"] == {"from": 2} and full["logical"]["records"]
    size = {s: len(json.dumps(u, separators=(",", ":"))) for s, u in ((2, full), (3, delta))}
    records = len(json.dumps(full["logical"], separators=(",", ":")))
    assert records > 1000 and size[3] <= size[2] - records + len('{"from":2}') + len('"delta","parent":2')
    assert len(raw[3]) < len(raw[2])
    assert '"logical"' not in json.dumps(docs[3]["consolidated_metadata"])  # no array node carries one
    with ucl.open(path, 2) as a, ucl.open(path, 3) as b:
        records = [{n: m.logical for n, m in c.meta.arrays.items()} for c in (a, b)]
        assert records[0] == records[1]
