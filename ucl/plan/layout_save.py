"""Planning a save (spec/layout.md §6, §8, §9): which chunks each rank writes, and the step's arrays.
No I/O, no torch.distributed. Loads are planned in :mod:`ucl.plan.layout_load`.

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

The copy semantics of writes and reads are in :mod:`ucl.plan.items`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from ucl.errors import InvalidLayoutError, LayoutError, LayoutShapeError, MeshMismatchError
from ucl.layout.boxes import full
from ucl.layout.mesh import Mesh
from ucl.layout.model import Layout, placement_allows
from ucl.layout.resolve import Resolver, check_matched, span, where
from ucl.layout.transforms import Tile, infer_shape, make_tile
from ucl.plan.items import ArraySpec, LocalShapes, RankPlan, ShardWrite, dtype_name


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
) -> RankPlan:
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
    given = {k: tuple(v) for k, v in (shapes or {}).items()}
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
        assumed: set[int] = set()
        if logical in given:
            shape = given[logical]
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
        if not placement_allows(f.on, mesh, coords):
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
    return RankPlan(
        _choose_writers(candidates),
        dict(sorted(arrays.items())),
        layout.to_dict(),
        mesh.to_dict(),
        rank,
        matched,
    )


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
        # the holders by (load, index): a heap, so that a chunk costs log(holders), not one pass over them
        # (thousands of data-parallel replicas hold each chunk of a large job)
        heap = [(0, r) for r in range(size)]
        for w, _, _ in sorted(items, key=lambda x: (-x[0].nbytes, x[0].array.name, x[0].chunk_index)):
            load, who = heapq.heappop(heap)
            heapq.heappush(heap, (load + max(1, w.nbytes), who))
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
        dims = list(base[logical])
        for d, blocks in per_dim.items():
            dims[d] = sum(blocks.values())
        out[logical] = tuple(dims)
    return out


def merge_plans(plans: Sequence[RankPlan]) -> dict[str, ArraySpec]:
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
    holding = {name: stored_chunks(spec) for name, spec in arrays.items()}
    for name in arrays:
        for chunk in sorted(holding[name]):
            if (name, chunk) not in writers:
                raise LayoutShapeError(
                    f"chunk {list(chunk)} of {name!r} holds data but no rank writes it "
                    "(a rank did not pass the tensor?)",
                    tensor=name,
                )
    for (name, chunk), rank in writers.items():
        if chunk not in holding[name]:
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
    """The chunks of an array that hold data (spec/layout.md §6.5: those some rank writes).

    Never fails and never looks past the chunk grid: a map that does not fit the array (another rank,
    a box past its end) adds only the chunks of the grid it meets; the record checks
    (:func:`ucl.plan.layout_load.check_step`, spec/layout.md §6.6) report it."""
    grid = spec.grid
    if not spec.logical:
        if any(g == 0 for g in grid):
            return set()
        return {tuple(i) for i in _product(grid)}
    out: set[tuple[int, ...]] = set()
    lead = spec.logical.get("partial", {}).get("count")
    inner_grid = grid[1:] if lead else grid
    chunks = spec.chunk_shape[1:] if lead else spec.chunk_shape
    leads = range(min(lead, grid[0])) if lead and grid else range(0)
    # every chunk of the grid found (a flat buffer's one chunk: after its first of hundreds of maps):
    # the other maps cannot add any, unless a map lies before the grid's start (then all are walked)
    total = math.prod(grid)
    for m in spec.logical.get("maps", []):
        if len(out) == total:
            break
        at, shape = tuple(m["at"]), tuple(m["box"][1])
        if "view" in m:
            vshape = tuple(m["view"]["shape"])
            if len(grid) != 1 or len(vshape) != len(at) or len(at) != len(shape):
                continue
            lo, hi = span((m["view"]["offset"], vshape), (at, shape))
            if hi > lo:
                c = spec.chunk_shape[0]
                out.update((i,) for i in range(lo // c, min(grid[0], (hi - 1) // c + 1)))
                if lo < 0:
                    total = -1
            continue
        if len(at) != len(inner_grid) or len(shape) != len(inner_grid) or any(n == 0 for n in shape):
            continue
        if any(a < 0 for a in at):
            total = -1
        ranges = [
            range(a // c, min(g, (a + n - 1) // c + 1))
            for a, n, c, g in zip(at, shape, chunks, inner_grid, strict=True)
        ]
        for idx in _product_ranges(ranges):
            out.update(((k, *idx) for k in leads) if lead else [idx])
    return out


def _product(grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    return _product_ranges([range(g) for g in grid])


def _product_ranges(ranges: Sequence[range]) -> list[tuple[int, ...]]:
    return [tuple(x) for x in itertools.product(*ranges)]
