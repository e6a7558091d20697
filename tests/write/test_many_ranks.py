"""A layout save with many real gloo ranks (24: tp=4 x dp=6) through the CheckpointManager: the compact
coordination protocol (ucl/plan/summary.py, issue 18) on real collectives, bit-exact, and its fallback
to the full protocol for an uneven split (the ranks' even assumption disagrees)."""

from __future__ import annotations

from typing import Any

import pytest

from ucl.testing import dist

WORLD = 24


@pytest.mark.dist
@pytest.mark.parametrize("uneven", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["compact", "uneven-full"])
def test_many_ranks_save_and_load_bit_exact(tmp_path: Any, uneven: bool) -> None:
    out = dist.run(WORLD, "tests.write.scale_cases:save_many", {"path": str(tmp_path / "ckpt"), "uneven": uneven},
                   timeout=600)
    # the first save plans (compact, or full after the summaries did not verify); the second reuses it
    want = "full" if uneven else "compact"
    assert [r["protocols"][0] for r in out] == [want] * WORLD
    assert all(r["exact"] for r in out), [i for i, r in enumerate(out) if not r["exact"]]
    assert out[0]["logical"]
