"""Reading: the logical tensors of a step's arrays, boxes of them, and loads for a target configuration
(spec/layout.md §6.4, §9). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ucl.errors import InconsistentMetadataError, LayoutError, LayoutShapeError, TensorNotFoundError, UCLError
from ucl.layout.boxes import Box, View, contiguous_runs, full, intersect, numel
from ucl.layout.mesh import Mesh
from ucl.layout.model import Layout, check_mesh
from ucl.layout.resolve import LocalTensor, Piece, expected_local
from ucl.plan.items import ArraySpec, LoadPlan, ReadItem


@dataclass(frozen=True)
class _Map:
    array: str
    box: Box  # in the logical tensor
    at: tuple[int, ...]  # where the box starts in the stored array (or in the view)
    view: View | None
    partial: int  # K contributions (0: not partial)


class LogicalIndex:
    """The logical tensors of a step's arrays and where their elements are stored (spec/layout.md §6)."""

    def __init__(self, arrays: Mapping[str, ArraySpec]) -> None:
        self.arrays = dict(arrays)
        self.tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        self.maps: dict[str, list[_Map]] = defaultdict(list)
        for name in sorted(arrays):
            spec = arrays[name]
            rec = spec.logical
            if not rec:
                self._tensor(name, spec.shape, spec.dtype, name)
                self.maps[name].append(_Map(name, full(spec.shape), tuple(0 for _ in spec.shape), None, 0))
                continue
            for t, info in rec["tensors"].items():
                self._tensor(t, tuple(info["shape"]), info["dtype"], name)
                if info["dtype"] != spec.dtype:
                    raise InconsistentMetadataError(
                        f"array {name!r} of {spec.dtype} records tensor {t!r} as {info['dtype']}", tensor=t
                    )
            k = rec.get("partial", {}).get("count", 0)
            for m in rec["maps"]:
                view = (m["view"]["offset"], tuple(m["view"]["shape"])) if "view" in m else None
                box = (tuple(m["box"][0]), tuple(m["box"][1]))
                at = tuple(m["at"])
                _check_map(spec, rec, m["tensor"], box, at, view, k)
                self.maps[m["tensor"]].append(_Map(name, box, at, view, k))
        for t, maps in self.maps.items():  # replicas: the first map of a box wins
            seen: set[Box] = set()
            self.maps[t] = [m for m in maps if not (m.box in seen or seen.add(m.box))]  # type: ignore[func-returns-value]
            _check_tiling(t, self.tensors[t][0], self.maps[t])

    def _tensor(self, name: str, shape: tuple[int, ...], dtype: str, array: str) -> None:
        old = self.tensors.setdefault(name, (shape, dtype))
        if old != (shape, dtype):  # records of one step disagree (spec/layout.md §6.3)
            raise InconsistentMetadataError(
                f"array {array!r} gives tensor {name!r} shape {list(shape)} {dtype}; another "
                f"array gives {list(old[0])} {old[1]}",
                tensor=name,
            )

    def partial(self, name: str) -> int:
        """The number of partial contributions stored for ``name`` (0 when it is not partial)."""
        return max((m.partial for m in self.maps.get(name, [])), default=0)

    def read(
        self, name: str, box: Box, *, contribution: int | None = None, sum_partial: bool = False
    ) -> list[tuple[str, Box, Box]]:
        return [
            (a, s, r)
            for a, s, r, _ in self.read_parts(name, box, contribution=contribution, sum_partial=sum_partial)
        ]

    def read_parts(
        self, name: str, box: Box, *, contribution: int | None = None, sum_partial: bool = False
    ) -> list[tuple[str, Box, Box, int]]:
        """(array, stored box, box within the requested result) that together give ``box`` of ``name``.

        For a partial tensor pass ``contribution`` (one rank's part) or ``sum_partial=True``: then the
        entries for the same result box are to be summed, in the order given.
        """
        if name not in self.tensors:
            raise TensorNotFoundError(f"no tensor {name!r} in the step", tensor=name)
        shape = self.tensors[name][0]
        if len(box[0]) != len(shape) or any(
            s < 0 or s + n > d for s, n, d in zip(box[0], box[1], shape, strict=True)
        ):
            raise LayoutShapeError(
                f"box {box} is outside tensor {name!r} of shape {list(shape)}", tensor=name
            )
        out: list[tuple[str, Box, Box, int]] = []
        for m in self.maps[name]:
            inter = intersect(box, m.box)
            if inter is None:
                continue
            at = tuple(a + i - s for a, i, s in zip(m.at, inter[0], m.box[0], strict=True))
            result = (tuple(i - b for i, b in zip(inter[0], box[0], strict=True)), inter[1])
            if m.view is None:
                pieces = [((at, inter[1]), result)]
            else:
                off, vshape = m.view
                pieces = []
                for flat, (rs, rn) in contiguous_runs(vshape, (at, inter[1])):
                    sub = (tuple(r - a + q for r, a, q in zip(rs, at, result[0], strict=True)), rn)
                    pieces.append((((off + flat,), (math.prod(rn),)), sub))
            if m.partial:
                if contribution is None and not sum_partial:
                    raise LayoutError(
                        f"tensor {name!r} is stored as {m.partial} partial contributions; read one "
                        "(contribution=) or their sum (sum_partial=True)",
                        tensor=name,
                    )
                ks = [contribution] if contribution is not None else list(range(m.partial))
                for k in ks:
                    out.extend((m.array, ((k, *sb[0]), (1, *sb[1])), rb, k) for sb, rb in pieces)
            else:
                out.extend((m.array, sb, rb, 0) for sb, rb in pieces)
        return out


def _check_tiling(name: str, shape: tuple[int, ...], maps: list[_Map]) -> None:
    """The maps of a tensor (replicas removed) tile it exactly (spec/layout.md §6.4): their boxes hold
    as many elements as the tensor and no two of them meet. Otherwise a read would return fill values
    for the elements no map holds, or two values for one element."""
    total = sum(numel(m.box) for m in maps)
    if total != math.prod(shape):
        raise InconsistentMetadataError(
            f"the maps of tensor {name!r} hold {total} elements; its shape {list(shape)} holds "
            f"{math.prod(shape)} (elements without a map, or held twice)",
            tensor=name,
        )
    if not shape:
        return
    boxes = sorted((m.box for m in maps if numel(m.box)), key=lambda b: b[0][0])
    active: list[Box] = []  # boxes whose dim-0 range reaches past the current start
    for b in boxes:
        active = [a for a in active if a[0][0] + a[1][0] > b[0][0]]
        for a in active:
            if intersect(a, b) is not None:
                raise InconsistentMetadataError(
                    f"two maps of tensor {name!r} hold the same elements: boxes "
                    f"{[list(a[0]), list(a[1])]} and {[list(b[0]), list(b[1])]}",
                    tensor=name,
                )
        active.append(b)


def _check_map(
    spec: ArraySpec,
    rec: Mapping[str, Any],
    tensor: str,
    box: Box,
    at: tuple[int, ...],
    view: View | None,
    k: int,
) -> None:
    """A map must name a tensor of its record, lie inside it, and point inside the stored array (a reader
    must never read outside what the array holds on the strength of a record)."""

    def bad(why: str) -> InconsistentMetadataError:
        return InconsistentMetadataError(
            f"array {spec.name!r}: a map of tensor {tensor!r} {why}", tensor=tensor
        )

    info = rec["tensors"].get(tensor)
    if info is None:
        raise bad("names a tensor the record does not list")
    shape = tuple(info["shape"])
    if len(box[0]) != len(shape) or len(box[1]) != len(shape):
        raise bad(f"has a box of another rank than the tensor's {list(shape)}")
    if any(s < 0 or n < 0 or s + n > d for s, n, d in zip(box[0], box[1], shape, strict=True)):
        raise bad(f"box {[list(box[0]), list(box[1])]} lies outside its shape {list(shape)}")
    stored = spec.shape[1:] if k else spec.shape
    if k and (spec.shape[0] != k or len(spec.shape) < 1):
        raise bad(f"is partial over {k} contributions; the array's leading dim is {spec.shape[:1]}")
    if view is None:
        if len(at) != len(stored) or len(box[1]) != len(stored):
            raise bad(f"is stored at {list(at)}, not an index of the array of shape {list(spec.shape)}")
        if any(n and a + n > d for a, n, d in zip(at, box[1], stored, strict=True)):
            raise bad(f"at {list(at)} runs past the array of shape {list(spec.shape)}")
        return
    off, vshape = view
    if len(stored) != 1 or len(vshape) != len(shape) or len(at) != len(vshape):
        raise bad("has a view, but the array is not 1-D or the view's rank differs from the tensor's")
    if off + math.prod(vshape) > stored[0]:
        raise bad(f"view [{off}, {off + math.prod(vshape)}) runs past the array of {stored[0]} elements")
    if any(n and a + n > d for a, n, d in zip(at, box[1], vshape, strict=True)):
        raise bad(f"at {list(at)} runs past its view {list(vshape)}")


def logical_tensors(arrays: Mapping[str, ArraySpec]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The logical tensors stored in ``arrays``: name -> (shape, dtype)."""
    return dict(sorted(LogicalIndex(arrays).tensors.items()))


def logical_read(
    arrays: Mapping[str, ArraySpec], name: str, box: Box, *, sum_partial: bool = False
) -> list[tuple[str, Box, Box]]:
    """(array, stored box, box within the requested result) that together give ``box`` of logical ``name``.

    Every element of the result is covered exactly once (for partial tensors with ``sum_partial``, once
    per contribution, to be summed in the order given). A stored box of a flat array is 1-D; it fills
    its result box in row-major order. Build a :class:`LogicalIndex` once to read many tensors.
    """
    return LogicalIndex(arrays).read(name, box, sum_partial=sum_partial)


def plan_load(
    arrays: Mapping[str, ArraySpec],
    layout: Layout,
    mesh: Mesh,
    rank: int,
    *,
    tensors: Iterable[str] | None = None,
) -> LoadPlan:
    """The tensors ``rank`` of the target configuration (layout, mesh) holds and the boxes to read.

    Parameters
    ----------
    arrays
        The step's arrays (all of them: a logical tensor may span several).
    layout, mesh, rank
        The target configuration and this rank in it.
    tensors
        Load only these logical tensors (default: all). With a selection, statements that match no
        selected tensor are not errors (a model-only load with a layout that also covers the optimizer).

    Returns
    -------
    LoadPlan
        ``local``: the local tensors to allocate (name -> (shape, dtype)); ``zero``: those to zero first;
        ``items``: the copies, each target element covered once (partial sums: a copy, then additions).

    Raises
    ------
    MeshMismatchError, UnmatchedPatternError, OverlappingRulesError, LayoutShapeError
        When the target layout does not fit the stored tensors.
    """
    index = LogicalIndex(arrays)
    logical = index.tensors
    if tensors is not None:
        wanted = set(tensors)
        missing = sorted(wanted - set(logical))
        if missing:
            raise TensorNotFoundError(f"no tensor {missing[0]!r} in the step", tensor=missing[0])
        logical = {n: v for n, v in logical.items() if n in wanted}
    local = expected_local(layout, mesh, rank, logical, complete=tensors is None)
    items: list[ReadItem] = []
    zero: set[str] = set()
    for name, lt in local.items():
        covered = 0
        for p in lt.pieces:
            got = _read_piece(index, lt, p)
            items.extend(got)
            covered += sum(numel(it.local_box) for it in got if it.reduce is None)
        if covered != math.prod(lt.shape):
            zero.add(name)
    return LoadPlan(items, {n: (lt.shape, lt.dtype) for n, lt in local.items()}, frozenset(zero))


def _read_piece(index: LogicalIndex, lt: LocalTensor, p: Piece) -> list[ReadItem]:
    k_src = index.partial(p.tensor)
    kwargs: dict[str, Any] = {}
    if lt.contribution is not None and k_src == lt.contribution[1]:
        kwargs["contribution"] = lt.contribution[0]  # the same split of the sum: each rank its own part
    elif lt.contribution is not None and lt.contribution[0] != 0:
        return []  # the whole sum goes to contribution 0; the others hold zero
    elif k_src:
        kwargs["sum_partial"] = True  # contribution 0 copied, then the others added, in order
    out = []
    for array, sbox, rbox, k in index.read_parts(p.tensor, p.box, **kwargs):
        lbox = (tuple(a + b for a, b in zip(p.local_box[0], rbox[0], strict=True)), rbox[1])
        reduce = "sum" if kwargs.get("sum_partial") and k > 0 else None
        out.append(ReadItem(array, sbox, lt.name, lbox, p.view, reduce))
    return out


def check_step(
    arrays: Mapping[str, ArraySpec], layout: Any = None, mesh: Any = None
) -> list[UCLError]:
    """The problems a validator reports for a layout step (spec/layout.md §6.6, §6.8), in that order:
    the first problem of its records (§6.6: each map against its record and array, the records'
    agreement, the tiling of every tensor), then its layout document (``invalid_layout``), its mesh
    (``invalid_layout``) and their fit (``mesh_mismatch``). A step without a layout, a mesh and records
    has none. ``arrays``: the step's arrays; ``layout``, ``mesh``: its ``attributes.ucl`` values."""
    out: list[UCLError] = []
    if any(spec.logical for spec in arrays.values()):
        try:
            LogicalIndex(arrays)
        except UCLError as e:
            out.append(e)
    if layout is None and mesh is None:
        return out
    if layout is None or mesh is None:
        out.append(InconsistentMetadataError(
            f"the step records a {'mesh' if layout is None else 'layout'} without a "
            f"{'layout' if layout is None else 'mesh'} (spec/layout.md §6.8)"))
        return out
    try:
        lay = Layout.from_dict(layout)
        msh = Mesh.from_dict(mesh)
    except UCLError as e:
        out.append(e)
        return out
    try:
        check_mesh(lay, msh)
    except UCLError as e:
        out.append(e)
    return out
