"""Pure planning (spec/layout.md §6, §8, §9): which chunks each rank writes, which boxes a rank of a
target configuration reads. No I/O, no torch.distributed.

The call sequence of a distributed save (the storage core drives it)::

    every rank   plan = plan_save(layout, mesh, rank, local_shapes)     # raises before any byte is written
    core         allreduce "all ranks planned without error"; if not, every rank fails the save
    core         allgather the plans' small metadata (arrays, writes' chunk indices, matched statements)
    coordinator  arrays = merge_plans(plans)       # every array, checked: each chunk written exactly once
    every rank   for w in plan.writes: write chunk w.chunk_index of w.array.name from local[w.local_name]
    coordinator  records arrays (ArraySpec.logical in each array's attributes) and layout_json, commits

and of a load for a target configuration::

    every rank   plan = plan_load(arrays, layout, mesh, rank)    # arrays: the step's ArraySpecs
    every rank   allocate plan.local (zeros for names in plan.zero), then apply plan.items

Copy semantics of a :class:`ShardWrite` or :class:`ReadItem`: the values of the source box, listed in
row-major order, equal those of the destination box in row-major order (the boxes have the same
number of elements; their shapes differ only for flat buffers).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ucl import dtypes as _dtypes
from ucl.errors import InvalidLayoutError, LayoutError, LayoutShapeError, MeshMismatchError
from ucl.layout.boxes import Box, View, contiguous_runs, full, intersect, numel, ravel
from ucl.layout.geometry import Tile, infer_shape, make_tile
from ucl.layout.mesh import Mesh
from ucl.layout.model import Layout
from ucl.layout.resolve import (
    FlatGeom,
    LocalTensor,
    Piece,
    Resolver,
    check_matched,
    expected_local,
    span,
    where,
)

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
class SavePlan:
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
            "writes": [[w.array.name, list(w.chunk_index)] for w in self.writes],
        }


@dataclass(frozen=True)
class ReadItem:
    """Copy ``stored_box`` of ``array`` into ``local_box`` of ``local_name``.

    When ``local_view`` = (offset, shape) is set, ``local_box`` is a box of the view
    ``local.flatten()[offset:offset + prod(shape)].reshape(shape)``. When ``reduce`` is "sum", add into
    the destination (which starts at zero) instead of copying; such items come in a fixed order.
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


# -- save --------------------------------------------------------------------------------------------
def _tile_record(tile: Tile, dtype: str) -> dict[str, Any]:
    if tile.plain:
        return {}
    rec: dict[str, Any] = {
        "tensors": {tile.name: {"shape": list(tile.shape), "dtype": dtype}},
        "maps": tile.maps(),
    }
    if tile.partial:
        rec["partial"] = {"reduce": "sum", "count": tile.contributions}
    return rec


def plan_save(
    layout: Layout,
    mesh: Mesh,
    rank: int,
    local: LocalShapes,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> SavePlan:
    """The chunks ``rank`` writes of its local state, and the arrays they belong to.

    Parameters
    ----------
    layout, mesh, rank
        The source configuration and this rank in it.
    local
        The rank's whole local state: local name -> (shape, dtype). Names are flattened state-dict
        keys ("/" between levels) with local layer numbers; flat buffers are 1-D.
    shapes
        Logical shapes (logical name -> shape) for tensors whose local shape does not tell their
        logical shape and whose rule declares no ``size``: an uneven split. Without it a split dim
        is assumed even, which a rank holding a shorter block detects (LayoutShapeError). Frameworks
        know these shapes (DTensor.shape, the model config); or allgather the local shapes and use
        :func:`infer_shapes`.

    Raises
    ------
    MeshMismatchError, LayoutShapeError, OverlappingRulesError
        Before anything is written. A rule that matches nothing is found by :func:`merge_plans`,
        which sees the tensors of all ranks.
    """
    res = Resolver(layout, mesh)
    coords = mesh.coords(rank)
    shapes = {k: tuple(v) for k, v in (shapes or {}).items()}
    norm = {n: (tuple(s), dtype_name(d)) for n, (s, d) in local.items()}
    arrays: dict[str, ArraySpec] = {}
    candidates: list[tuple[ShardWrite, tuple[Any, ...], int, int]] = []
    held: dict[str, str] = {}  # logical name -> local name

    def add_array(spec: ArraySpec, local_name: str) -> None:
        old = arrays.get(spec.name)
        if old is not None and old != spec:
            raise LayoutShapeError(
                f"local tensors {held.get(spec.name, '?')!r} and {local_name!r} map to array "
                f"{spec.name!r} differently",
                tensor=local_name,
            )
        arrays[spec.name] = spec

    flats: list[tuple[str, int, str | None]] = []
    for name in sorted(norm):
        lshape, dtype = norm[name]
        fb = res.flat_buffer(name, coords)
        if fb is not None:
            flats.append((name, *fb))
            continue
        logical = res.to_logical(name, coords)
        if logical in held:
            raise LayoutShapeError(
                f"local tensors {held[logical]!r} and {name!r} are both {logical!r}", tensor=name
            )
        held[logical] = name
        res.check_placed(name, logical, coords)
        i, rule = res.rule_for(logical)
        if logical in shapes:
            shape, assumed = shapes[logical], set()
        else:
            shape, assumed = infer_shape(rule, logical, lshape, mesh)
        if len(shape) != len(lshape):
            raise LayoutShapeError(
                f"tensor {logical!r}: local shape {list(lshape)} and logical shape {list(shape)} "
                "differ in rank",
                tensor=logical,
            )
        tile = make_tile(rule, logical, shape, mesh)
        expect = tile.local_shape(mesh, coords)
        if expect != lshape:
            raise LayoutShapeError(
                _shape_message(name, logical, lshape, expect, shape, assumed, mesh, coords), tensor=logical
            )
        spec = ArraySpec(logical, tile.stored_shape, dtype, tile.chunk_shape, _tile_record(tile, dtype))
        add_array(spec, name)
        w = tile.write(mesh, coords)
        if w is not None:
            fixed = tile.content_axes() | set(res.to_local(logical)[1])
            key, size, pos = res.group(fixed, rule.on if rule else (), coords)
            candidates.append((ShardWrite(spec, w[0], name, w[1], w[2]), key, size, pos))
    for name, fi, state in flats:
        f = layout.flats[fi]
        if not _allows(f.on, mesh, coords):
            raise LayoutShapeError(
                f"rank at {where(mesh, coords)} holds flat buffer {name!r}, which flat "
                f"{f.buffer!r} places elsewhere",
                tensor=name,
            )
        geom = res.flat_geom(fi, state, coords)
        res.matched_flats.add(fi)
        lshape, dtype = norm[name]
        if lshape != (geom.partition,):
            raise LayoutShapeError(
                f"flat buffer {name!r} on {where(mesh, coords)} has shape {list(lshape)}; the layout gives "
                f"[{geom.partition}] (members total {geom.total} elements over {geom.parts} ranks, align "
                f"{f.align})",
                tensor=name,
            )
        for m in geom.members:
            if m.name in held:
                raise LayoutShapeError(
                    f"tensor {m.name!r} is both local tensor {held[m.name]!r} and a member of "
                    f"flat buffer {name!r}",
                    tensor=m.name,
                )
            held[m.name] = name
        spec = ArraySpec(
            geom.array, (geom.partition * geom.parts,), dtype, (geom.partition,), geom.record(dtype)
        )
        add_array(spec, name)
        if geom.writes():
            key, size, pos = res.group(set(geom.fixed) | set(f.axes), (), coords)
            box = ((geom.index * geom.partition,), (geom.partition,))
            candidates.append((ShardWrite(spec, (geom.index,), name, full(lshape), box), key, size, pos))
    matched = {
        "rules": sorted(res.matched_rules),
        "renumbers": sorted(res.matched_renumbers),
        "flats": sorted(res.matched_flats),
    }
    return SavePlan(
        _choose_writers(candidates),
        dict(sorted(arrays.items())),
        layout.to_dict(),
        mesh.to_dict(),
        rank,
        matched,
    )


def _allows(on: Any, mesh: Mesh, coords: Mapping[str, int]) -> bool:
    from ucl.layout.model import placement_allows

    return placement_allows(on, mesh, coords)


def _shape_message(
    name: str,
    logical: str,
    lshape: tuple[int, ...],
    expect: tuple[int, ...],
    shape: tuple[int, ...],
    assumed: set[int],
    mesh: Mesh,
    coords: Mapping[str, int],
) -> str:
    d = next(i for i, (a, b) in enumerate(zip(lshape, expect, strict=True)) if a != b)
    head = f"tensor {name!r} on {where(mesh, coords)} has local shape {list(lshape)}; "
    if d in assumed:
        return (
            head + f"assuming dim {d} splits evenly (logical {list(shape)}) the layout gives {list(expect)}: "
            f"for an uneven split declare size({d}, N) or pass shapes="
        )
    return head + f"the layout gives {list(expect)} for logical shape {list(shape)}"


def _choose_writers(candidates: list[tuple[ShardWrite, tuple[Any, ...], int, int]]) -> list[ShardWrite]:
    """Of chunks held by several ranks, keep those this rank writes: within each group of holders, the
    largest chunk first, each to the least-loaded holder (all holders compute the same assignment)."""
    mine: list[ShardWrite] = []
    groups: dict[tuple[Any, ...], list[tuple[ShardWrite, int, int]]] = defaultdict(list)
    for w, key, size, pos in candidates:
        if size == 1:
            mine.append(w)
        else:
            groups[key].append((w, size, pos))
    for items in groups.values():
        size, pos = items[0][1], items[0][2]
        load = [0] * size
        for w, _, _ in sorted(items, key=lambda x: (-x[0].nbytes, x[0].array.name, x[0].chunk_index)):
            who = min(range(size), key=lambda r: (load[r], r))
            load[who] += max(1, w.nbytes)
            if who == pos:
                mine.append(w)
    return sorted(mine, key=lambda w: (w.array.name, w.chunk_index))


def infer_shapes(
    layout: Layout, mesh: Mesh, local_by_rank: Sequence[LocalShapes]
) -> dict[str, tuple[int, ...]]:
    """Logical shapes from the local shapes of all ranks (after an allgather), for :func:`plan_save`'s
    ``shapes``: along a split dim, the sum of the blocks of the ranks that differ only on its axes."""
    res = Resolver(layout, mesh)
    sizes: dict[str, dict[int, dict[int, int]]] = defaultdict(lambda: defaultdict(dict))
    base: dict[str, tuple[int, ...]] = {}
    for rank, local in enumerate(local_by_rank):
        coords = mesh.coords(rank)
        for name, (lshape, _) in local.items():
            if res.flat_buffer(name, coords) is not None:
                continue
            logical = res.to_logical(name, coords)
            _, rule = res.rule_for(logical)
            shape, assumed = infer_shape(rule, logical, tuple(lshape), mesh)
            base.setdefault(logical, shape)
            tile = make_tile(rule, logical, shape, mesh)
            for d in assumed:
                sizes[logical][d][tile.dims[d].index(mesh, coords)] = lshape[d]
    out = dict(base)
    for logical, per_dim in sizes.items():
        shape = list(base[logical])
        for d, blocks in per_dim.items():
            shape[d] = sum(blocks.values())
        out[logical] = tuple(shape)
    return out


def merge_plans(plans: Sequence[SavePlan]) -> dict[str, ArraySpec]:
    """Every array of the step from the plans of all ranks (run by the coordinator after an allgather).

    Checks that the plans come from one layout and mesh, one per rank; that ranks agree on each array;
    that every chunk holding data is written by exactly one rank; and that every rule, renumber and
    flat statement matched some tensor on some rank (UnmatchedPatternError otherwise).
    """
    if not plans:
        raise LayoutError("merge_plans needs the plans of all ranks, got none")
    layout_json, mesh_json = plans[0].layout_json, plans[0].mesh_json
    mesh = Mesh.from_dict(mesh_json)
    ranks = sorted(p.rank for p in plans)
    if ranks != list(range(mesh.size)):
        raise MeshMismatchError(
            f"merge_plans got plans of ranks {ranks}; the mesh {mesh.to_text()} has {mesh.size}"
        )
    arrays: dict[str, ArraySpec] = {}
    owner: dict[str, int] = {}
    writers: dict[tuple[str, tuple[int, ...]], int] = {}
    matched: dict[str, set[int]] = defaultdict(set)
    for p in plans:
        if p.layout_json != layout_json or p.mesh_json != mesh_json:
            raise InvalidLayoutError(
                f"rank {p.rank} planned with another layout or mesh than rank {plans[0].rank}"
            )
        for name, spec in p.arrays.items():
            old = arrays.setdefault(name, spec)
            if old != spec:
                raise LayoutShapeError(
                    f"ranks {owner[name]} and {p.rank} disagree on array {name!r}: shape "
                    f"{list(old.shape)} chunks {list(old.chunk_shape)} vs shape {list(spec.shape)} chunks "
                    f"{list(spec.chunk_shape)} (an uneven split without a declared size?)",
                    tensor=name,
                )
            owner.setdefault(name, p.rank)
        for w in p.writes:
            key = (w.array.name, w.chunk_index)
            if key in writers:
                raise LayoutShapeError(
                    f"chunk {list(w.chunk_index)} of {w.array.name!r} is written by ranks "
                    f"{writers[key]} and {p.rank}",
                    tensor=w.array.name,
                )
            writers[key] = p.rank
        for kind, idx in p.matched.items():
            matched[kind].update(idx)
    for name, spec in arrays.items():
        for chunk in sorted(stored_chunks(spec)):
            if (name, chunk) not in writers:
                raise LayoutShapeError(
                    f"chunk {list(chunk)} of {name!r} holds data but no rank writes it "
                    "(a rank did not pass the tensor?)",
                    tensor=name,
                )
    for (name, chunk), rank in writers.items():
        if chunk not in stored_chunks(arrays[name]):
            raise LayoutShapeError(
                f"rank {rank} writes chunk {list(chunk)} of {name!r}, which holds no data", tensor=name
            )
    layout = Layout.from_dict(layout_json)
    res = Resolver(layout, mesh)
    res.matched_rules, res.matched_renumbers, res.matched_flats = (
        matched["rules"],
        matched["renumbers"],
        matched["flats"],
    )
    check_matched(layout, res, flats=True)
    return dict(sorted(arrays.items()))


def stored_chunks(spec: ArraySpec) -> set[tuple[int, ...]]:
    """The chunks of an array that hold data (those some rank writes)."""
    grid = spec.grid
    if not spec.logical:
        if any(g == 0 for g in grid):
            return set()
        return {tuple(i) for i in _product(grid)}
    out: set[tuple[int, ...]] = set()
    lead = spec.logical.get("partial", {}).get("count")
    for m in spec.logical["maps"]:
        if "view" in m:
            lo, hi = span(
                (m["view"]["offset"], tuple(m["view"]["shape"])), (tuple(m["at"]), tuple(m["box"][1]))
            )
            if hi > lo:
                out.update(
                    (i,) for i in range(lo // spec.chunk_shape[0], (hi - 1) // spec.chunk_shape[0] + 1)
                )
            continue
        shape = m["box"][1]
        if any(n == 0 for n in shape):
            continue
        ranges = [
            range(a // c, (a + n - 1) // c + 1)
            for a, n, c in zip(m["at"], shape, spec.chunk_shape[1 if lead else 0 :], strict=True)
        ]
        for idx in _product_ranges(ranges):
            out.update(((k, *idx) for k in range(lead)) if lead else [idx])
    return out


def _product(grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    return _product_ranges([range(g) for g in grid])


def _product_ranges(ranges: Sequence[range]) -> list[tuple[int, ...]]:
    import itertools

    return [tuple(x) for x in itertools.product(*ranges)]


# -- load ----------------------------------------------------------------------------------------------
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
            k = rec.get("partial", {}).get("count", 0)
            for m in rec["maps"]:
                view = (m["view"]["offset"], tuple(m["view"]["shape"])) if "view" in m else None
                box = (tuple(m["box"][0]), tuple(m["box"][1]))
                self.maps[m["tensor"]].append(_Map(name, box, tuple(m["at"]), view, k))
        for t, maps in self.maps.items():  # replicas: the first map of a box wins
            seen: set[Box] = set()
            self.maps[t] = [m for m in maps if not (m.box in seen or seen.add(m.box))]  # type: ignore[func-returns-value]

    def _tensor(self, name: str, shape: tuple[int, ...], dtype: str, array: str) -> None:
        old = self.tensors.setdefault(name, (shape, dtype))
        if old != (shape, dtype):
            raise LayoutShapeError(
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
            from ucl.errors import TensorNotFoundError

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


def plan_load(arrays: Mapping[str, ArraySpec], layout: Layout, mesh: Mesh, rank: int) -> LoadPlan:
    """The tensors ``rank`` of the target configuration (layout, mesh) holds and the boxes to read.

    Raises
    ------
    MeshMismatchError, UnmatchedPatternError, OverlappingRulesError, LayoutShapeError
        When the target layout does not fit the stored tensors.
    """
    index = LogicalIndex(arrays)
    local = expected_local(layout, mesh, rank, index.tensors)
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


__all__ = [
    "ArraySpec",
    "Box",
    "FlatGeom",
    "LoadPlan",
    "LogicalIndex",
    "ReadItem",
    "SavePlan",
    "ShardWrite",
    "dtype_name",
    "infer_shapes",
    "logical_read",
    "logical_tensors",
    "merge_plans",
    "plan_load",
    "plan_save",
    "ravel",
    "stored_chunks",
]
