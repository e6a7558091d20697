"""Shared helpers of the layout tests: logical states, and saving them into an in-memory store."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from ucl.layout import Layout, Mesh
from ucl.plan.layout_save import infer_shapes, merge_plans, plan_save
from ucl.testing.layout_reference import apply_writes, empty_store, shard_local_state
from ucl.testing.layout_strategies import LogicalSpec


def examples(n: int) -> int:
    """Hypothesis example counts: ``n`` in CI (2 cores, < 60 s for the layout tests), times
    UCL_LAYOUT_EXAMPLES_SCALE for a long fuzzing run."""
    return n * int(os.environ.get("UCL_LAYOUT_EXAMPLES_SCALE", "1"))


def make_full(spec: LogicalSpec | dict[str, tuple[tuple[int, ...], str]]) -> dict[str, torch.Tensor]:
    """Logical tensors with distinct non-zero values (a missing or misplaced element shows)."""
    tensors = spec.tensors() if isinstance(spec, LogicalSpec) else spec
    out = {}
    for i, (name, (shape, dtype)) in enumerate(sorted(tensors.items())):
        n = math.prod(shape)
        out[name] = (torch.arange(n, dtype=torch.int64) + 1 + 7 * i).reshape(shape).to(getattr(torch, dtype))
    return out


def local_shapes(local: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], Any]]:
    return {n: (tuple(t.shape), t.dtype) for n, t in local.items()}


def save(
    full: dict[str, torch.Tensor], mesh: Mesh, layout: Layout, *, shapes: bool = True
) -> tuple[Any, ...]:
    """Save ``full`` as every rank of (mesh, layout) would: (locals, plans, arrays, store).

    The logical shapes come from ``full`` (``shapes``) or from all ranks' local shapes (infer_shapes).
    """
    locs = [shard_local_state(full, layout, mesh, r) for r in range(mesh.size)]
    if shapes:
        logical = {n: tuple(t.shape) for n, t in full.items()}
    else:  # what the core does for uneven splits: allgather the local shapes
        logical = infer_shapes(layout, mesh, [local_shapes(loc) for loc in locs])
    plans = [plan_save(layout, mesh, r, local_shapes(loc), shapes=logical) for r, loc in enumerate(locs)]
    arrays = merge_plans(plans)
    store = empty_store(arrays)
    for plan, loc in zip(plans, locs, strict=True):
        apply_writes(store, plan, {n: t.numpy() for n, t in loc.items()})
    return locs, plans, arrays, store


def sl(box: Any) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(box[0], box[1], strict=True))


def assert_same(got: dict[str, np.ndarray], want: dict[str, torch.Tensor], what: str = "") -> None:
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for n in want:
        assert got[n].shape == tuple(want[n].shape), (
            f"{what}: {n}: shape {got[n].shape} vs {tuple(want[n].shape)}"
        )
        assert np.array_equal(got[n], want[n].numpy()), f"{what}: {n} differs"
