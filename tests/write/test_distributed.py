"""Distributed save on real processes (gloo on localhost)."""

from __future__ import annotations

import pytest
import torch

import ucl
from ucl.testing import dist

from .dist_cases import replicated_state

pytestmark = pytest.mark.dist


# 2 ranks in CI; 4 ranks (~15 s here) in ./dev test-long
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_replicated_state_is_written_once_balanced(tmp_path, world) -> None:
    results = dist.run(world, "tests.write.dist_cases:save_replicated", {"path": str(tmp_path), "steps": 2})
    owners = [set(r["writes"]) for r in results]
    every = set().union(*owners)
    assert sum(len(o) for o in owners) == len(every) == 6  # each tensor written by exactly one rank
    assert all(owners)  # every rank takes a share
    sizes = [sum(replicated_state(0)["model"][n.split("/")[1]].numel() for n in o) for o in owners]
    assert max(sizes) <= 2 * min(sizes) + 64 * 6 * 32
    assert ucl.Repository.open(tmp_path).steps() == [0, 1]
    for step in (0, 1):
        got = ucl.load(tmp_path, step)
        want = replicated_state(step)
        assert got["step"] == step
        assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    assert ucl.validate(tmp_path).ok


def test_no_dist_saves_alone_under_an_initialised_world(tmp_path) -> None:
    """no_dist=True: rank 0 saves and prunes as a world of one while rank 1 waits at a barrier."""
    results = dist.run(2, "tests.write.dist_cases:save_alone", {"path": str(tmp_path), "steps": 3}, timeout=120)
    assert results[0]["manager"] == [0, 1] and results[1]["manager"] is None
    assert ucl.Repository.open(tmp_path).steps() == [1, 2]  # keep_last=2
    got = ucl.load(tmp_path, 2)
    assert all(torch.equal(got["model"][k], v) for k, v in replicated_state(2)["model"].items())
    assert ucl.validate(tmp_path).ok


def test_a_failing_rank_fails_every_handle_and_commits_nothing(tmp_path) -> None:
    results = dist.run(2, "tests.write.dist_cases:save_with_failing_rank", {"path": str(tmp_path), "bad_rank": 1})
    for r in results:
        assert r["outcome"] != "committed"
        assert "No space left on device" in r["outcome"]
        assert r["latest"] == 0
    assert ucl.Repository.open(tmp_path).steps() == [0]
    assert ucl.validate(tmp_path).ok


def test_data_parallel_gradient_records(tmp_path) -> None:
    """2 gloo ranks training data-parallel save with DeltaPolicy(gradients=True): the gradient steps each
    rank writes part of replay bit-exactly to the state every rank held."""
    import hashlib

    results = dist.run(2, "tests.write.dist_cases:save_gradient_records", {"path": str(tmp_path), "steps": 6})
    assert results[0]["digests"] == results[1]["digests"]  # data parallel: one state
    kinds = []
    for step, want in results[0]["digests"].items():
        with ucl.open(tmp_path, int(step)) as ck:
            kinds.append("grad" if ck.records is not None else ck.kind)
            got = ck.load(flat=True)
        assert {n: hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, t in got.items()} == want, f"step {step}"
    assert kinds == ["full", "grad", "grad", "grad", "full", "grad"]
    assert ucl.validate(tmp_path).ok


def test_a_repository_held_by_another_writer_fails_every_rank_at_once(tmp_path) -> None:
    """Rank 0 takes the writer lock; another process holds it. Rank 1 used to wait at the barrier after
    the lock for a rank that had raised (until gloo's timeout); now every rank raises rank 0's error."""
    from ucl.format.lock import WriterLock

    lock = WriterLock.acquire(ucl.Repository.open(tmp_path, create=True))
    try:
        results = dist.run(2, "tests.write.dist_cases:open_manager", {"paths": [str(tmp_path)] * 2}, timeout=120)
    finally:
        lock.release()
    for r in results:
        assert r["outcome"].startswith("WriterLockedError: ") and "another writer holds" in r["outcome"], r
        assert r["seconds"] < 60, r  # not the manager's timeout (120 s)
    assert "rank 0: " in results[1]["outcome"]
    assert ucl.Repository.open(tmp_path).steps() == []


def test_a_path_missing_on_one_rank_fails_every_rank(tmp_path) -> None:
    """A node-local path: rank 0 made the repository where rank 1 finds nothing. Every rank raises rank
    1's error, and nothing is committed."""
    (tmp_path / "other").mkdir()
    paths = [str(tmp_path / "repo"), str(tmp_path / "other" / "repo")]
    results = dist.run(2, "tests.write.dist_cases:open_manager", {"paths": paths}, timeout=120)
    for r in results:
        assert r["outcome"] != "opened" and str(tmp_path / "other" / "repo") in r["outcome"], r
        assert r["seconds"] < 60, r
    assert "rank 1: " in results[0]["outcome"]
    assert ucl.Repository.open(paths[0]).steps() == []


def test_a_memory_part_held_by_another_writer_fails_every_rank_at_once(tmp_path) -> None:
    """A memory tier spread over two nodes; node 1's part is still held by another process (say, one left
    from an earlier job). Node 1's leader fails to take its lock; the other rank, at the barrier after it,
    used to get gloo's "Connection closed by peer" instead. Now both raise the lock's error, and a manager
    opened once the part is free works (the durable repository's lock was given back)."""
    from ucl.format.lock import WriterLock
    from ucl.write.peers import PartStore

    kw = {"disk": str(tmp_path / "disk"), "mem": str(tmp_path / "n{node}")}
    part = ucl.Repository.open(PartStore(str(tmp_path / "n1")), create=True)
    lock = WriterLock.acquire(part)
    try:
        results = dist.run(2, "tests.write.dist_cases:open_spread_manager", kw, timeout=120)
    finally:
        lock.release()
    for r in results:
        assert r["outcome"].startswith("WriterLockedError: ") and "n1" in r["outcome"], r
        assert r["seconds"] < 60, r
    assert "rank 1: " in results[0]["outcome"]
    assert [r["outcome"] for r in dist.run(2, "tests.write.dist_cases:open_spread_manager", kw)] == ["opened"] * 2
