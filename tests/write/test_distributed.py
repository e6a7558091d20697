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
