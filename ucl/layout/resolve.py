"""Names against a layout on a mesh: renumbering, rule matching, holders, flat buffers, and the local
state a rank of a configuration holds (spec/layout.md §4, §7, §8). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ucl.errors import LayoutShapeError, OverlappingRulesError, UnmatchedPatternError
from ucl.layout import patterns
from ucl.layout.boxes import Box, View, flat_range_boxes, intersect, ravel
from ucl.layout.mesh import Mesh
from ucl.layout.model import Layout, Rule, check_mesh, placement_allows, placement_values
from ucl.layout.transforms import Tile, make_tile

Shapes = Mapping[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)


def where(mesh: Mesh, coords: Mapping[str, int]) -> str:
    return " ".join(f"{a}={coords[a]}" for a in mesh.names) or "the only rank"


def span(view: View, box: Box) -> tuple[int, int]:
    """The flat range [lo, hi) of a buffer from the first to the last element of ``box`` of ``view``."""
    offset, shape = view
    if any(n == 0 for n in box[1]):
        return offset, offset
    last = tuple(s + n - 1 for s, n in zip(box[0], box[1], strict=True))
    return offset + ravel(shape, box[0]), offset + ravel(shape, last) + 1


@dataclass(frozen=True)
class Piece:
    """Elements ``local_box`` of a local tensor (of its ``view`` if set) are ``box`` of logical ``tensor``."""

    local_box: Box
    tensor: str
    box: Box
    view: View | None = None


@dataclass(frozen=True)
class FlatMember:
    name: str  # logical name
    shape: tuple[int, ...]  # logical shape
    view: tuple[int, ...]  # the member's local shape on this rank
    offset: int  # element offset of the view in the whole buffer
    pieces: tuple[tuple[Box, Box], ...]  # (box in the view, logical box)


@dataclass(frozen=True)
class FlatGeom:
    """One flat buffer on one rank: its stored array and its members (spec/layout.md §7.6)."""

    array: str
    buffer: str  # the local name
    state: str | None
    members: tuple[FlatMember, ...]
    total: int  # elements of the whole buffer, alignment gaps included
    partition: int  # elements each rank of the flat axes holds
    parts: int  # ranks of the flat axes
    index: int  # this rank's partition
    fixed: tuple[str, ...]  # axes that select the buffer's content (its array), besides the flat axes

    def record(self, dtype: str) -> dict[str, Any]:
        return {
            "tensors": {m.name: {"shape": list(m.shape), "dtype": dtype} for m in self.members},
            "maps": [
                {
                    "tensor": m.name,
                    "box": [list(gb[0]), list(gb[1])],
                    "at": list(lb[0]),
                    "view": {"offset": m.offset, "shape": list(m.view)},
                }
                for m in self.members
                for lb, gb in m.pieces
            ],
        }

    def pieces(self) -> list[Piece]:
        """Pieces of this rank's partition, each in a view that is contiguous in the buffer."""
        lo, hi = self.index * self.partition, (self.index + 1) * self.partition
        out: list[Piece] = []
        for m in self.members:
            n = math.prod(m.view)
            a, b = max(lo, m.offset), min(hi, m.offset + n)
            for cbox in flat_range_boxes(m.view, a - m.offset, b - m.offset):
                view: View = (m.offset + ravel(m.view, cbox[0]) - lo, cbox[1])
                for lb, gb in m.pieces:
                    inter = intersect(cbox, lb)
                    if inter is None:
                        continue
                    box = (tuple(g + i - s for g, i, s in zip(gb[0], inter[0], lb[0], strict=True)), inter[1])
                    local = (tuple(i - c for i, c in zip(inter[0], cbox[0], strict=True)), inter[1])
                    out.append(Piece(local, m.name, box, view))
        return out

    def writes(self) -> bool:
        """Whether this rank's partition meets the flat range spanned by a map (stored data)."""
        lo, hi = self.index * self.partition, (self.index + 1) * self.partition
        return any(
            a < hi and lo < b
            for m in self.members
            for lb, _ in m.pieces
            for a, b in [span((m.offset, m.view), lb)]
            if b > a
        )


@dataclass(frozen=True)
class LocalTensor:
    """A tensor a rank holds: its local name, shape and dtype, and what it holds of the logical tensors."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    logical: str | None = None  # the logical name of a tile tensor (None for a flat buffer)
    tile: Tile | None = None
    flat: FlatGeom | None = None
    contribution: tuple[int, int] | None = None  # (k, K) for a partial tensor


@dataclass
class Resolver:
    """Resolves names of one layout on one mesh and records which statements matched."""

    layout: Layout
    mesh: Mesh
    matched_rules: set[int] = field(default_factory=set)
    matched_renumbers: set[int] = field(default_factory=set)
    matched_flats: set[int] = field(default_factory=set)
    _rules: dict[str, tuple[int | None, Rule | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_mesh(self.layout, self.mesh)
        self.bounds = [r.stage_bounds(self.mesh) for r in self.layout.renumbers]
        self.members = [frozenset(m for m, _ in f.members) for f in self.layout.flats]
        # literal patterns (exact names, as layouts derived from DTensors have) by name; the rest scanned
        self._literal: dict[str, list[tuple[int, str]]] = {}
        self._globs: list[tuple[int, str, str, str]] = []  # (rule, pattern, its literal head and tail)
        for i, r in enumerate(self.layout.rules):
            for p in r.patterns:
                name = patterns.literal(p)
                if name is None:
                    self._globs.append((i, p, *patterns.ends(p)))
                else:
                    self._literal.setdefault(name, []).append((i, p))

    # -- renumbering (§7.5)
    def to_logical(self, local: str, coords: Mapping[str, int]) -> str:
        name = local
        for ri, (r, b) in enumerate(zip(self.layout.renumbers, self.bounds, strict=True)):
            for p in r.patterns:
                m = patterns.compile_pattern(p, True).fullmatch(name)
                if m is None:
                    continue
                self.matched_renumbers.add(ri)
                j, s = int(m.group(1)), coords[r.axis]
                if j >= b[s + 1] - b[s]:
                    raise LayoutShapeError(
                        f"local tensor {local!r} on {r.axis}={s} has index {j}; stage {s} holds "
                        f"{b[s + 1] - b[s]} (global {b[s]}..{b[s + 1] - 1}) by renumber {ri + 1}",
                        tensor=local,
                    )
                name = name[: m.start(1)] + str(b[s] + j) + name[m.end(1) :]
                break
        return name

    def to_local(self, logical: str) -> tuple[str, dict[str, int]]:
        """The local name of a logical tensor and the coordinates its renumbering requires."""
        name, need = logical, {}
        for ri in reversed(range(len(self.layout.renumbers))):
            r, b = self.layout.renumbers[ri], self.bounds[ri]
            for p in r.patterns:
                m = patterns.compile_pattern(p, True).fullmatch(name)
                if m is None:
                    continue
                self.matched_renumbers.add(ri)
                g = int(m.group(1))
                stage = next((s for s in range(len(b) - 1) if b[s] <= g < b[s + 1]), None)
                if stage is None:
                    raise LayoutShapeError(
                        f"tensor {logical!r} has index {g}; renumber {ri + 1} over {r.axis} places "
                        f"indices 0..{b[-1] - 1}",
                        tensor=logical,
                    )
                need[r.axis] = stage
                name = name[: m.start(1)] + str(g - b[stage]) + name[m.end(1) :]
                break
        return name, need

    # -- rules (§4)
    def rule_for(self, logical: str) -> tuple[int | None, Rule | None]:
        hit = self._rules.get(logical)
        if hit is not None:
            return hit
        found: list[tuple[int, str]] = list(self._literal.get(logical, ()))
        for i, p, head, tail in self._globs:
            if (not found or found[-1][0] != i) and logical.endswith(tail) and logical.startswith(head) \
                    and patterns.match(p, logical) is not None:
                found.append((i, p))
        found = sorted({i: (i, p) for i, p in reversed(found)}.values())
        if len(found) > 1:
            (i, p), (j, q) = found[0], found[1]
            raise OverlappingRulesError(
                f"tensor {logical!r} matches rule {i + 1} ({p!r}) and rule {j + 1} ({q!r}); "
                "rules must not overlap",
                tensor=logical,
            )
        hit = (found[0][0], self.layout.rules[found[0][0]]) if found else (None, None)
        if found:
            self.matched_rules.add(found[0][0])
        self._rules[logical] = hit
        return hit

    def holds(self, logical: str, coords: Mapping[str, int]) -> str | None:
        """The local name under which ``coords`` hold a (non-flat) logical tensor, or None."""
        local, need = self.to_local(logical)
        if any(coords[a] != s for a, s in need.items()):
            return None
        _, rule = self.rule_for(logical)
        if rule is not None and not placement_allows(rule.on, self.mesh, coords):
            return None
        return local

    def check_placed(self, local: str, logical: str, coords: Mapping[str, int]) -> None:
        i, rule = self.rule_for(logical)
        if rule is not None and not placement_allows(rule.on, self.mesh, coords):
            on = " ".join(f"{a}=" + ",".join(map(str, v)) for a, v in rule.on)
            raise LayoutShapeError(
                f"rank at {where(self.mesh, coords)} holds {local!r}, "
                f"which rule {(i or 0) + 1} places on {on}",
                tensor=local,
            )

    # -- holders (§8): the ranks holding the same chunk, one of which writes it
    def group(self, fixed: set[str], on: Any, coords: Mapping[str, int]) -> tuple[tuple[Any, ...], int, int]:
        """(group key, group size, position of ``coords`` in it)."""
        key: list[Any] = []
        size, pos = 1, 0
        for a in self.mesh.names:
            if a in fixed:
                key.append((a, coords[a]))
                continue
            values = placement_values(on, self.mesh, a)
            key.append((a, values))
            size *= len(values)
            pos = pos * len(values) + values.index(coords[a])
        return tuple(key), size, pos

    # -- flat buffers (§7.6)
    def flat_buffer(self, name: str, coords: Mapping[str, int]) -> tuple[int, str | None] | None:
        """(flat index, state) of the flat statement whose buffer ``name`` is at ``coords``, or None."""
        hits = []
        for fi, f in enumerate(self.layout.flats):
            m = patterns.match(f.buffer, name)
            if m is not None:
                hits.append((placement_allows(f.on, self.mesh, coords), fi, m.get("state")))
        here = [h for h in hits if h[0]]
        if len(here) > 1:
            raise OverlappingRulesError(
                f"buffer {name!r} on {where(self.mesh, coords)} matches flat statements "
                f"{here[0][1] + 1} and {here[1][1] + 1}",
                tensor=name,
            )
        best = here or hits
        return (best[0][1], best[0][2]) if best else None

    def flat_member_of(self, logical: str) -> list[tuple[int, str, str | None, dict[str, int]]]:
        """The flat statements ``logical`` is a member of: (flat index, member, state, required coords),
        keeping those whose placement allows the coordinates its renumbering requires."""
        local, need = self.to_local(logical)
        out = []
        for fi, f in enumerate(self.layout.flats):
            m = patterns.template_regex(f.logical).fullmatch(local)
            if m is None or m.group("member") not in self.members[fi]:
                continue
            if all(placement_allows(((a, v),), self.mesh, {a: need[a]}) for a, v in f.on if a in need):
                out.append((fi, m.group("member"), m.groupdict().get("state"), need))
        return out

    def flat_geom(self, fi: int, state: str | None, coords: Mapping[str, int]) -> FlatGeom:
        f = self.layout.flats[fi]
        values = {"state": state} if state is not None else {}
        buffer = patterns.substitute(f.buffer, values)
        fixed = {a for a, _ in f.on}
        members = []
        offset = 0
        # a member's geometry depends on its rule and shape only (a 70B model's 723 members have a
        # few dozen of them): each computed and checked once
        Geom = tuple[set[str], tuple[int, ...], tuple[Any, ...]]  # content axes, local shape, pieces
        geoms: dict[tuple[int | None, tuple[int, ...]], Geom] = {}
        for member, shape in f.members:
            logical = self.to_logical(patterns.substitute(f.logical, {**values, "member": member}), coords)
            fixed |= set(self.to_local(logical)[1])
            i, rule = self.rule_for(logical)
            geom = geoms.get((i, tuple(shape)))
            if geom is None:
                tile = make_tile(rule, logical, shape, self.mesh)
                bad = tile.content_axes() & set(f.axes)
                placed = rule is None or placement_allows(rule.on, self.mesh, coords)
                if tile.partial or bad or not placed:
                    why = (
                        "is partial"
                        if tile.partial
                        else f"splits over flat axis {sorted(bad)[0]!r}"
                        if bad
                        else f"is not placed on {where(self.mesh, coords)}"
                    )
                    raise LayoutShapeError(
                        f"flat {f.buffer!r}: member {logical!r} {why} (rule {(i or 0) + 1})", tensor=logical
                    )
                geom = geoms[(i, tuple(shape))] = (tile.content_axes(), tile.local_shape(self.mesh, coords),
                                                   tuple(tile.pieces(self.mesh, coords)))
            axes, view, pieces = geom
            fixed |= axes
            offset = -(-offset // f.align) * f.align
            members.append(FlatMember(logical, tuple(shape), view, offset, pieces))
            offset += math.prod(view)
        k = math.prod(self.mesh.axis_size(a) for a in f.axes)
        partition = f.length(offset, self.mesh) // k
        index = 0
        for a in f.axes:
            index = index * self.mesh.axis_size(a) + coords[a]
        fixed -= set(f.axes)
        order = tuple(a for a in self.mesh.names if a in fixed)
        array = buffer + "".join(f".{a}{coords[a]}" for a in order)
        return FlatGeom(array, buffer, state, tuple(members), offset, partition, k, index, order)


def expected_local(
    layout: Layout,
    mesh: Mesh,
    rank: int,
    logical: Shapes,
    *,
    complete: bool = True,
    resolver: Resolver | None = None,
) -> dict[str, LocalTensor]:
    """The local tensors ``rank`` of (layout, mesh) holds, given the logical tensors (name -> (shape, dtype)).

    With ``complete`` (``logical`` lists every tensor of the checkpoint), every rule and renumber
    statement must match some tensor and every flat member must exist.
    """
    res = resolver or Resolver(layout, mesh)
    coords = mesh.coords(rank)
    out: dict[str, LocalTensor] = {}
    found: dict[tuple[int, str | None], dict[str, str]] = {}
    for name in sorted(logical):
        res.rule_for(name)
        member = res.flat_member_of(name)
        if member:
            here = [
                (fi, mname, state)
                for fi, mname, state, need in member
                if all(coords[a] == s for a, s in need.items())
                and placement_allows(layout.flats[fi].on, mesh, coords)
            ]
            if len(here) > 1:
                raise OverlappingRulesError(
                    f"tensor {name!r} on {where(mesh, coords)} is a member of flat statements "
                    f"{here[0][0] + 1} and {here[1][0] + 1}",
                    tensor=name,
                )
            for fi, mname, state in here:
                found.setdefault((fi, state), {})[mname] = name
            continue
        local = res.holds(name, coords)
        if local is None:
            continue
        if local in out:
            raise LayoutShapeError(
                f"tensors {out[local].logical!r} and {name!r} both have local name {local!r}", tensor=name
            )
        _, rule = res.rule_for(name)
        shape, dtype = logical[name]
        tile = make_tile(rule, name, tuple(shape), mesh)
        pieces = tuple(Piece(lb, name, gb) for lb, gb in tile.pieces(mesh, coords))
        contrib = (tile.contribution(mesh, coords), tile.contributions) if tile.partial else None
        out[local] = LocalTensor(
            local, tile.local_shape(mesh, coords), dtype, pieces, name, tile, None, contrib
        )
    for fi, f in enumerate(layout.flats):
        if not placement_allows(f.on, mesh, coords):
            continue
        states = sorted((s for i, s in found if i == fi), key=lambda s: s or "")
        if not states and complete:
            raise UnmatchedPatternError(f"flat {f.buffer!r} matches no tensor on {where(mesh, coords)}")
        for state in states:
            geom = res.flat_geom(fi, state, coords)
            dtypes = set()
            for m in geom.members:
                if m.name not in logical:
                    raise UnmatchedPatternError(
                        f"flat {f.buffer!r}: member {m.name!r} matches no tensor", tensor=m.name
                    )
                shape, dtype = logical[m.name]
                dtypes.add(dtype)
                if tuple(shape) != m.shape:
                    raise LayoutShapeError(
                        f"flat {f.buffer!r}: member {m.name!r} has shape {list(shape)}; "
                        f"the layout lists {list(m.shape)}",
                        tensor=m.name,
                    )
            if len(dtypes) != 1:
                raise LayoutShapeError(
                    f"flat buffer {geom.buffer!r}: members have different dtypes {sorted(dtypes)}"
                )
            if geom.buffer in out:
                raise LayoutShapeError(f"flat buffer {geom.buffer!r} has the local name of another tensor")
            out[geom.buffer] = LocalTensor(
                geom.buffer, (geom.partition,), dtypes.pop(), tuple(geom.pieces()), flat=geom
            )
            res.matched_flats.add(fi)
    if complete:
        check_matched(layout, res)
    return out


def check_matched(layout: Layout, res: Resolver, flats: bool = False) -> None:
    """Raise UnmatchedPatternError for the first rule, renumber (or flat) statement that matched nothing."""
    for i, r in enumerate(layout.rules):
        if i not in res.matched_rules:
            pats = ", ".join(repr(p) for p in r.patterns)
            raise UnmatchedPatternError(f"rule {i + 1} ({pats}) matches no tensor")
    for i, n in enumerate(layout.renumbers):
        if i not in res.matched_renumbers:
            pats = ", ".join(repr(p) for p in n.patterns)
            raise UnmatchedPatternError(f"renumber {i + 1} ({pats}) matches no tensor")
    if flats:
        for i, f in enumerate(layout.flats):
            if i not in res.matched_flats:
                raise UnmatchedPatternError(f"flat {f.buffer!r} matches no tensor")
