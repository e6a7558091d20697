"""ucl.testing.dist.run: a failed or hung rank is reported at once, with what it printed."""

from __future__ import annotations

import time

import pytest

from ucl.testing import dist

CASES = "tests.testing.dist_cases"


def test_output_larger_than_a_pipe_does_not_block_the_ranks() -> None:
    assert dist.run(3, f"{CASES}:chatty", {}, timeout=120) == [0, 10, 20]


def test_a_failed_rank_ends_the_run_after_the_grace_period_naming_its_error() -> None:
    t = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        dist.run(3, f"{CASES}:fail_one", {}, timeout=200, grace=2.0)
    assert time.monotonic() - t < 100  # not the timeout: the others were killed after the grace period
    assert "rank 1 broke on purpose" in str(err.value)
    assert "--- rank 0 exited" in str(err.value) and "--- rank 2 exited" in str(err.value)


def test_a_hung_rank_prints_its_stack_before_it_is_killed() -> None:
    with pytest.raises(TimeoutError) as err:
        dist.run(2, f"{CASES}:hang_one", {}, timeout=15)
    msg = str(err.value)
    assert "rank(s) [0, 1] of tests.testing.dist_cases:hang_one did not finish in 15 s" in msg
    rank0, rank1 = msg.split("--- rank 0 (running)")[1].split("--- rank 1 (running)")
    assert "in barrier" in rank0  # faulthandler's stack: rank 0 waits for rank 1 in the runner's barrier
    assert "in hang_one" in rank1 and "x" * 1000 in rank1  # where rank 1 is, after what it printed


def test_a_rank_sees_its_callers_environment_and_directory_not_the_zygotes(tmp_path, monkeypatch) -> None:
    """Ranks fork from a process that imported torch once; what the caller set after it started reaches
    them all the same (checked twice: the second run forks from the same zygote after other changes)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # run() gives each rank OMP_NUM_THREADS=1 whatever this says
    for value in ("first", "second"):
        monkeypatch.setenv("UCL_DIST_PROBE", value)
        here = tmp_path / value
        here.mkdir()
        monkeypatch.chdir(here)
        got = dist.run(2, f"{CASES}:surroundings", {}, timeout=120)
        assert got == [[value, str(here), 1, "0"], [value, str(here), 1, "1"]]


def test_a_crash_is_every_rank_killed() -> None:
    assert dist.run(3, f"{CASES}:killed", {}, timeout=120, expect_killed=True) == [None] * 3


def test_a_crash_where_a_rank_failed_otherwise_names_it() -> None:
    """A test of a crash must not take a rank that failed before it was killed (a rendezvous that never
    formed, an error) for the crash it meant to make: that rank's end and its stderr are reported."""
    with pytest.raises(RuntimeError) as err:
        dist.run(3, f"{CASES}:killed", {"raise_on": 1}, timeout=120, expect_killed=True, grace=2.0)
    msg = str(err.value)
    assert "rank(s) [1] ended otherwise than killed by SIGKILL" in msg
    assert "--- rank 1 exited 1" in msg and "rank 1 raised instead" in msg
