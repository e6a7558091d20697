"""A memory tier spread over nodes (ucl.write.peers): each "node" (a group of real gloo processes) has
its own part directory; its files are also held by the next node. Kill tests: the whole job SIGKILLed
(restore from memory), a node lost (its processes killed and its part deleted: restore from the peer), two
adjacent nodes lost or every copy damaged (restore from the durable tier); bit-exact on every rank, under
a Megatron-style layout so that ranks hold different shards."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ucl
from ucl.errors import CheckpointNotFoundError, InvalidArgumentError
from ucl.testing import dist
from ucl.tools.gc import gc
from ucl.write.peers import PartStore, _bitmap, _members, is_document, needed_files
from ucl.write.tiers import MemoryTier

SAVE, RESTORE = "tests.write.peer_cases:save", "tests.write.peer_cases:restore"


def _flip_everywhere(mem: Path, step: int) -> int:
    """Flip a byte of one shard file in every part holding it; the number of copies damaged."""
    rel = None
    n = 0
    for part in sorted(mem.iterdir()):
        base = part / "steps" / str(step)
        if rel is None:
            rel = next(p.relative_to(base) for p in sorted(base.rglob("*")) if p.is_file() and "/c/" in str(p)
                       and "model" in str(p))
        p = base / rel
        if p.exists():
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 1
            p.write_bytes(bytes(data))
            n += 1
    return n


def test_two_nodes_kill_node_loss_and_damage(tmp_path: Path) -> None:
    disk, mem = tmp_path / "disk", tmp_path / "mem"
    kw = {"disk": str(disk), "mem": str(mem / "node{node}"), "rpn": 2, "tp": 2, "dp": 2}
    # the whole job killed (SIGKILL) once steps 0..3 committed: drained steps 0, 2; parts hold 2, 3
    out = dist.run(4, SAVE, dict(kw, steps=4, kill=True), expect_killed=True)
    assert out == [None] * 4
    assert ucl.validate(disk).ok and ucl.Repository.open(disk).steps() == [0, 2]
    for n in (0, 1):
        part = mem / f"node{n}"
        assert not (part / "commits").exists() and sorted(p.name for p in (part / "parts").iterdir()) == \
            ["2.json", "3.json"]
        with pytest.raises(CheckpointNotFoundError):  # a part alone is not a repository: no step in it
            ucl.open(part)
        with pytest.raises(InvalidArgumentError, match="part of a memory tier"):
            gc(part)
        report = ucl.validate(part)  # not "valid, 0 steps": a part alone is not a repository
        assert not report.ok and "part of a memory tier" in report.problems[0].message
    # a fresh job: every rank restores step 3 from its own node's part
    got = dist.run(4, RESTORE, kw)
    assert [(r["step"], r["tier"], r["exact"], r["latest"]) for r in got] == [(3, "memory", True, 3)] * 4
    # node 0's record of step 3 damaged: its part is taken not to hold the step; node 1's copies of node
    # 0's files cover it, so the restore moves them to node 0 (and rewrites node 0's record)
    rec = mem / "node0" / "parts" / "3.json"
    rec.write_bytes(rec.read_bytes()[:-9])
    got = dist.run(4, RESTORE, kw)
    assert [(r["step"], r["tier"], r["exact"]) for r in got] == [(3, "peer", True)] * 4
    # node 1 lost: its processes killed (above) and its memory gone; its replacement reads from node 0
    shutil.rmtree(mem / "node1")
    got = dist.run(4, RESTORE, dict(kw, then_save=4))
    assert [(r["step"], r["tier"], r["exact"], r["reasons"]) for r in got] == [(3, "peer", True, [])] * 4
    assert all(r["steps"] == [0, 2, 3, 4] for r in got)  # training went on: step 4 saved and drained
    assert ucl.validate(disk).ok and ucl.Repository.open(disk).steps() == [0, 2, 4]
    # step 4's copies in both parts damaged: the restore passes over them to the durable copy of step 4
    assert _flip_everywhere(mem, 4) == 2
    got = dist.run(4, RESTORE, kw)
    assert [(r["step"], r["tier"], r["exact"]) for r in got] == [(4, "durable", True)] * 4
    assert "integrity" in got[0]["reasons"][0] or "checksum" in got[0]["reasons"][0]


def test_three_nodes_one_lost_then_two(tmp_path: Path) -> None:
    disk, mem = tmp_path / "disk", tmp_path / "mem"
    arc = tmp_path / "archive"
    kw = {"disk": str(disk), "mem": str(mem / "n{node}"), "rpn": 1, "tp": 1, "dp": 3, "archive": str(arc)}
    dist.run(3, SAVE, dict(kw, steps=4, kill=True), expect_killed=True)
    shutil.rmtree(mem / "n1")  # node 1's files survive on node 2
    got = dist.run(3, RESTORE, kw)
    assert [(r["step"], r["tier"], r["exact"]) for r in got] == [(3, "peer", True)] * 3
    # node 1 replaced again, then an older step restored on purpose: step 3 stays (it is committed), and
    # saving step 3 again is refused on every rank, although node 1's new part does not hold it
    shutil.rmtree(mem / "n1")
    got = dist.run(3, "tests.write.peer_cases:restore_step_then_save", dict(kw, step=2, save=3))
    assert got == [{"tier": "peer", "step": 2, "refused": True, "steps": [0, 2, 3]}] * 3
    # nodes 1 and 2 lost together: node 1's files were only there (peers=1); the durable step 2 is read
    shutil.rmtree(mem / "n1")
    shutil.rmtree(mem / "n2")
    got = dist.run(3, RESTORE, kw)
    assert [(r["step"], r["tier"], r["exact"]) for r in got] == [(2, "durable", True)] * 3
    assert any("lack some of its files" in why for why in got[0]["reasons"])
    # the disk lost as well: the archive (every 2nd durable step, copied by the coordinator) has step 2
    assert ucl.validate(arc).ok and ucl.Repository.open(arc).steps() == [0, 2]
    shutil.rmtree(disk)
    got = dist.run(3, RESTORE, kw)
    assert [(r["step"], r["tier"], r["exact"]) for r in got] == [(2, "archive", True)] * 3


def test_node_layout_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MemoryTier("/m").node_layout(8) == (8, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert MemoryTier("/m").node_layout(8) == (4, 2)
    assert MemoryTier("/m", ranks_per_node=2, peers=3).node_layout(8) == (2, 4)
    assert MemoryTier("/m/{node}").part_path(3) == "/m/3"
    with pytest.raises(InvalidArgumentError, match="does not divide"):
        MemoryTier("/m", ranks_per_node=3).node_layout(8)
    with pytest.raises(InvalidArgumentError, match="other node"):
        MemoryTier("/m", ranks_per_node=4, peers=2).node_layout(8)
    for bad in ({"ranks_per_node": 0}, {"peers": -1}, {"peers": True}):
        with pytest.raises(InvalidArgumentError):
            MemoryTier("/m", **bad)  # type: ignore[arg-type]


def test_part_store_keeps_records_under_parts(tmp_path: Path) -> None:
    store = PartStore(str(tmp_path))
    store.write_atomic("commits/5.json", b"{}")
    assert (tmp_path / "parts" / "5.json").read_bytes() == b"{}" and not (tmp_path / "commits").exists()
    assert store.list_dir("commits") == ["5.json"]
    assert is_document("zarr.json") and is_document("model/w/zarr.json")
    assert not is_document("model/zarr.json/c/0") and not is_document("model/w/c")


def test_needed_files_are_the_shards_a_box_touches() -> None:
    from types import SimpleNamespace

    from ucl.format.metadata import ArrayMeta

    a = ArrayMeta("model/w", (20, 8), "float32", (10, 4), (5, 4))
    meta = SimpleNamespace(arrays={"w": a})
    item = SimpleNamespace(array="w", stored_box=((9, 4), (2, 1)))  # rows 9-10, column 4
    assert needed_files(meta, [item]) == {"model/w/c/0/1", "model/w/c/1/1"}
    empty = SimpleNamespace(array="w", stored_box=((0, 0), (0, 4)))
    assert needed_files(meta, [empty]) == set()


def test_bitmaps_of_files() -> None:
    """What the ranks allgather at restore: a bit per file of the record (small at thousands of ranks)."""
    universe = [f"f{i:03d}" for i in range(19)]
    for names in (set(), {"f000"}, {"f018", "f007", "f008"}, set(universe)):
        bits = _bitmap(names, universe)
        assert len(bits) == 3 and _members(bits, universe) == names
    assert _members(_bitmap({"not listed"}, universe), universe) == set()


def test_tree_send_reaches_the_receivers_only() -> None:
    out = dist.run(7, "tests.write.peer_cases:tree", {})
    assert out == [[100_000, 7], [100_000, 7], [100_000, 7], None, [100_000, 7], [100_000, 7], [100_000, 7]]
