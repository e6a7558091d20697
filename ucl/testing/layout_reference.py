"""Reference helpers: the local state a rank of a configuration holds (a test oracle), its inverse, and
the copy semantics of plans applied to an in-memory store (numpy arrays of the stored shapes).

These are the executable definition that the storage core's byte paths must agree with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ucl.format import dtypes as _dtypes
from ucl.layout.boxes import Box, View
from ucl.layout.mesh import Mesh
from ucl.layout.model import Layout
from ucl.layout.resolve import expected_local
from ucl.plan.items import ArraySpec, LoadPlan, RankPlan, dtype_name
from ucl.plan.layout_load import LogicalIndex
from ucl.plan.layout_save import infer_shapes, merge_plans, plan_save


def _sl(box: Box) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(box[0], box[1], strict=True))


def _region(t: Any, view: View | None) -> Any:
    """``t``, or the view (offset, shape) of its flattened elements."""
    if view is None:
        return t
    off, shape = view
    n = int(np.prod(shape, dtype=np.int64))
    return t.reshape(-1)[off : off + n].reshape(shape)


def shard_local_state(
    full_state: Mapping[str, torch.Tensor], layout: Layout, mesh: Mesh, rank: int
) -> dict[str, torch.Tensor]:
    """The local state ``rank`` of (layout, mesh) holds, made from the whole logical state.

    Padding and flat-buffer gaps are zero; of a partial tensor, contribution 0 holds the value and the
    others zero.
    """
    logical = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in full_state.items()}
    out: dict[str, torch.Tensor] = {}
    for name, lt in expected_local(layout, mesh, rank, logical).items():
        t = torch.zeros(lt.shape, dtype=_dtypes.to_torch(lt.dtype))
        if lt.contribution is None or lt.contribution[0] == 0:
            for p in lt.pieces:
                _region(t, p.view)[_sl(p.local_box)] = full_state[p.tensor][_sl(p.box)]
        out[name] = t
    return out


def unshard(
    locals_by_rank: Sequence[Mapping[str, torch.Tensor]],
    layout: Layout,
    mesh: Mesh,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """The logical state from the local states of all ranks (the inverse of :func:`shard_local_state`).

    Partial tensors are summed in contribution order.
    """
    shapes_by_rank = [{n: (tuple(t.shape), t.dtype) for n, t in loc.items()} for loc in locals_by_rank]
    if shapes is None:
        shapes = infer_shapes(layout, mesh, shapes_by_rank)
    plans = [plan_save(layout, mesh, r, s, shapes=shapes) for r, s in enumerate(shapes_by_rank)]
    index = LogicalIndex(merge_plans(plans))
    out = {n: torch.zeros(s, dtype=_dtypes.to_torch(d)) for n, (s, d) in index.tensors.items()}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for rank, loc in enumerate(locals_by_rank):
        for name, lt in expected_local(layout, mesh, rank, index.tensors).items():
            for p in lt.pieces:
                src = _region(loc[name], p.view)[_sl(p.local_box)]
                if lt.contribution is None:
                    out[p.tensor][_sl(p.box)] = src
                else:
                    k = lt.contribution[0]
                    acc = parts.setdefault(p.tensor, {}).setdefault(k, torch.zeros_like(out[p.tensor]))
                    acc[_sl(p.box)] = src
    for name, by_k in parts.items():
        total = by_k[0].clone() if 0 in by_k else torch.zeros_like(out[name])
        for k in sorted(by_k):
            if k:
                total += by_k[k]
        out[name] = total
    return out


# -- plans against an in-memory store --------------------------------------------------------------------
def empty_store(arrays: Mapping[str, ArraySpec]) -> dict[str, np.ndarray]:
    """Zero-filled numpy arrays of the stored shapes (a missing chunk reads as zero, as in zarr)."""
    return {n: np.zeros(a.shape, dtype=_dtypes.to_numpy(a.dtype)) for n, a in arrays.items()}


def apply_writes(store: Mapping[str, np.ndarray], plan: RankPlan, local: Mapping[str, Any]) -> int:
    """Write this rank's chunks into ``store``; returns the number of elements written."""
    written = 0
    for w in plan.writes:
        src = np.asarray(local[w.local_name])[_sl(w.local_box)]
        store[w.array.name][_sl(w.stored_box)] = src.reshape(w.stored_box[1])
        written += src.size
    return written


def apply_reads(store: Mapping[str, np.ndarray], plan: LoadPlan) -> dict[str, np.ndarray]:
    """Allocate this rank's local tensors and fill them from ``store`` by ``plan``."""
    out = {n: np.zeros(s, dtype=_dtypes.to_numpy(d)) for n, (s, d) in plan.local.items()}
    for it in plan.items:
        src = store[it.array][_sl(it.stored_box)].reshape(it.local_box[1])
        dst = _region(out[it.local_name], it.local_view)
        if it.reduce == "sum":
            dst[_sl(it.local_box)] += src
        else:
            dst[_sl(it.local_box)] = src
    return out


def read_logical(
    store: Mapping[str, np.ndarray], arrays: Mapping[str, ArraySpec], name: str, box: Box | None = None
) -> np.ndarray:
    """A box (default: all) of a logical tensor, read from ``store`` by :func:`logical_read`."""
    index = LogicalIndex(arrays)
    shape, dtype = index.tensors[name]
    box = box or (tuple(0 for _ in shape), shape)
    out = np.zeros(box[1], dtype=_dtypes.to_numpy(dtype))
    for array, sbox, rbox, k in index.read_parts(name, box, sum_partial=True):
        src = store[array][_sl(sbox)].reshape(rbox[1])
        if k:
            out[_sl(rbox)] += src
        else:
            out[_sl(rbox)] = src
    return out
