"""The interface between the planner and the storage core (spec/layout.md §6, §8): frozen requests.

Copy semantics of a :class:`ShardWrite` or :class:`ReadItem`: the values of the source box, listed in
row-major order, equal those of the destination box in row-major order (the boxes have the same
number of elements; their shapes differ only for flat buffers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ucl.format import dtypes as _dtypes
from ucl.layout.boxes import Box, View, numel

LocalShapes = Mapping[str, tuple[tuple[int, ...], Any]]  # name -> (shape, dtype name or torch.dtype)


def dtype_name(dtype: Any) -> str:
    """The spec name of a dtype given as a spec name, "torch.float32", or a torch.dtype."""
    name = str(dtype).removeprefix("torch.")
    return _dtypes.check(name)


# -- the interface with the storage core ------------------------------------------------------------
@dataclass(frozen=True)
class ArraySpec:
    """One stored array: a Zarr v3 array whose regular chunks are the blocks ranks hold.

    ``logical`` is the JSON record of spec/layout.md §6 saying how logical tensors map into the array;
    ``{}`` when the stored array is the logical tensor of the same name.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    logical: dict[str, Any] = field(default_factory=dict)

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunk_shape, strict=True))

    def chunk_box(self, index: tuple[int, ...]) -> Box:
        """The box of chunk ``index`` (clipped by the array bounds)."""
        start = tuple(i * c for i, c in zip(index, self.chunk_shape, strict=True))
        return start, tuple(
            min(c, s - o) for c, s, o in zip(self.chunk_shape, self.shape, start, strict=True)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunk_shape": list(self.chunk_shape),
            "logical": self.logical,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ArraySpec:
        return cls(
            d["name"], tuple(d["shape"]), d["dtype"], tuple(d["chunk_shape"]), dict(d.get("logical") or {})
        )


@dataclass(frozen=True)
class ShardWrite:
    """Chunk ``chunk_index`` of ``array``, written by this rank from ``local_box`` of ``local_name``.

    ``stored_box`` (inside the chunk) receives the values; the rest of the chunk, if any, is zero.
    """

    array: ArraySpec
    chunk_index: tuple[int, ...]
    local_name: str
    local_box: Box
    stored_box: Box

    @property
    def nbytes(self) -> int:
        return numel(self.stored_box) * _dtypes.itemsize(self.array.dtype)


@dataclass(frozen=True)
class RankPlan:
    """What one rank writes, and the arrays its tensors belong to.

    ``arrays`` holds every array a tensor of this rank belongs to; without pipeline stages or placed
    rules that is every array of the step, the same on every rank. :func:`merge_plans` joins the plans
    of all ranks into the step's arrays and checks them.
    """

    writes: list[ShardWrite]
    arrays: dict[str, ArraySpec]
    layout_json: dict[str, Any]
    mesh_json: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    matched: dict[str, list[int]] = field(default_factory=dict)  # statements (by kind) that matched a tensor

    def to_dict(self) -> dict[str, Any]:
        """The small metadata the coordinator needs (JSON-able), for an allgather."""
        return {
            "rank": self.rank,
            "layout": self.layout_json,
            "mesh": self.mesh_json,
            "matched": self.matched,
            "arrays": [a.to_dict() for a in self.arrays.values()],
            "writes": [
                [
                    w.array.name,
                    list(w.chunk_index),
                    w.local_name,
                    [list(w.local_box[0]), list(w.local_box[1])],
                    [list(w.stored_box[0]), list(w.stored_box[1])],
                ]
                for w in self.writes
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankPlan:
        """Inverse of :meth:`to_dict` (the coordinator rebuilds gathered plans for :func:`merge_plans`)."""
        arrays = {a["name"]: ArraySpec.from_dict(a) for a in d["arrays"]}
        writes = []
        for w in d["writes"]:
            name, idx = w[0], tuple(w[1])
            spec = arrays[name]
            if len(w) >= 5:
                local_name = w[2]
                local_box: Box = (tuple(w[3][0]), tuple(w[3][1]))
                stored_box: Box = (tuple(w[4][0]), tuple(w[4][1]))
            else:  # the short form: array and chunk only
                local_name, stored_box = "", spec.chunk_box(idx)
                local_box = stored_box
            writes.append(ShardWrite(spec, idx, local_name, local_box, stored_box))
        return cls(
            writes,
            arrays,
            dict(d["layout"]),
            dict(d.get("mesh") or {}),
            int(d.get("rank", 0)),
            {k: list(v) for k, v in (d.get("matched") or {}).items()},
        )


@dataclass(frozen=True)
class ReadItem:
    """Copy ``stored_box`` of ``array`` into ``local_box`` of ``local_name``.

    The stored box's values in row-major order fill the local box in row-major order (a stored box of a
    flat array is 1-D). When ``local_view`` = (offset, shape) is set, ``local_box`` is a box of the view
    ``local.flatten()[offset:offset + prod(shape)].reshape(shape)`` (a flat buffer). When ``reduce`` is
    "sum", add into the destination instead of copying: the contributions of a partial tensor, whose
    first contribution is copied by an earlier item; apply items in order.
    """

    array: str
    stored_box: Box
    local_name: str
    local_box: Box
    local_view: View | None = None
    reduce: str | None = None

    @property
    def numel(self) -> int:
        return numel(self.stored_box)


@dataclass(frozen=True)
class LoadPlan:
    """What one rank of a target configuration allocates and reads."""

    items: list[ReadItem]
    local: dict[str, tuple[tuple[int, ...], str]]  # local name -> (shape, dtype)
    zero: frozenset[str] = frozenset()  # local tensors to zero first: the copies do not cover them whole
