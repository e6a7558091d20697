"""The layout model: frozen dataclasses with ``to_dict``/``from_dict`` (spec/layout.md §3, §5-§8).

A :class:`Layout` is checked on construction for what can be checked without a mesh or tensors
(:class:`~ucl.errors.InvalidLayoutError`); :func:`check_mesh` checks it against a mesh.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ucl.errors import InvalidLayoutError, MeshMismatchError
from ucl.layout import patterns
from ucl.layout.mesh import AXIS_NAME, Mesh

VERSION = 3  # the newest layout version; a layout is written at the lowest version that expresses it
VERSIONS = (1, 2, 3)  # version 2 added `grouped` (spec/layout.md §7.10), 3 a flat statement's `pad` (§7.6)
Factor = int | str  # an integer or a mesh axis name (its size)


def _fail(msg: str) -> InvalidLayoutError:
    return InvalidLayoutError(msg)


def _int(v: Any, what: str, minimum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(f"{what} must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        raise _fail(f"{what} must be >= {minimum}, got {v}")
    return v


def _axes(v: Any, what: str) -> tuple[str, ...]:
    if not isinstance(v, list | tuple) or not v:
        raise _fail(f"{what} must be a non-empty list of axis names, got {v!r}")
    for a in v:
        if not isinstance(a, str) or not AXIS_NAME.fullmatch(a):
            raise _fail(f"{what}: {a!r} is not an axis name")
    if len(set(v)) != len(v):
        raise _fail(f"{what} names an axis twice: {list(v)}")
    return tuple(v)


def _keys(d: Any, what: str, required: set[str], optional: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    if not isinstance(d, dict):
        raise _fail(f"{what} must be an object, got {d!r}")
    missing = required - set(d)
    unknown = set(d) - required - optional
    if missing:
        raise _fail(f"{what} lacks {sorted(missing)}")
    if unknown:
        raise _fail(f"{what} has unknown fields {sorted(unknown)}")
    return d


# -- transforms ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Replicate:
    """Every holder holds the whole tensor (the default for a tensor no rule matches)."""

    op: ClassVar[str] = "replicate"

    def to_dict(self) -> dict[str, Any]:
        return {"op": "replicate"}


@dataclass(frozen=True)
class Shard:
    """Split ``dim`` with torch.chunk semantics over the combined axes (row-major in the order given)."""

    dim: int
    axes: tuple[str, ...]
    op: ClassVar[str] = "shard"

    def __post_init__(self) -> None:
        _int(self.dim, "shard dim")
        object.__setattr__(self, "axes", _axes(self.axes, "shard axes"))

    def to_dict(self) -> dict[str, Any]:
        return {"op": "shard", "dim": self.dim, "axes": list(self.axes)}


@dataclass(frozen=True)
class Part:
    """One sub-parameter of a fused dim: ``count`` units of ``unit`` elements (heads of head_dim rows)."""

    name: str
    count: int
    unit: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not AXIS_NAME.fullmatch(self.name):
            raise _fail(f"fused part name {self.name!r} is not [a-z_][a-z0-9_]*")
        _int(self.count, f"fused part {self.name!r} count", 1)
        _int(self.unit, f"fused part {self.name!r} unit", 1)

    @property
    def size(self) -> int:
        return self.count * self.unit

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "count": self.count, "unit": self.unit}


@dataclass(frozen=True)
class Fused:
    """``dim`` is the concatenation of ``parts``; a shard of that dim splits each part on its own."""

    dim: int
    parts: tuple[Part, ...]
    op: ClassVar[str] = "fused"

    def __post_init__(self) -> None:
        _int(self.dim, "fused dim")
        if not self.parts:
            raise _fail("fused needs at least one part")
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            raise _fail(f"fused parts repeat a name: {names}")

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {"op": "fused", "dim": self.dim, "parts": [p.to_dict() for p in self.parts]}


@dataclass(frozen=True)
class Grouped:
    """``dim`` is held in ``groups`` groups, each the next 1/groups of every part's units in part order
    (Megatron-core's fused QKV: per query group its query heads, key, value); the logical tensor is the
    parts concatenated. A shard of that dim splits the grouped order into contiguous pieces."""

    dim: int
    groups: int
    parts: tuple[Part, ...]
    op: ClassVar[str] = "grouped"

    def __post_init__(self) -> None:
        _int(self.dim, "grouped dim")
        _int(self.groups, "grouped groups", 1)
        if not self.parts:
            raise _fail("grouped needs at least one part")
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            raise _fail(f"grouped parts repeat a name: {names}")
        for p in self.parts:
            if p.count % self.groups:
                raise _fail(f"grouped part {p.name!r} has {p.count} units, not a multiple of its "
                            f"{self.groups} groups")

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {"op": "grouped", "dim": self.dim, "groups": self.groups, "parts": [p.to_dict() for p in self.parts]}


@dataclass(frozen=True)
class Pad:
    """``dim`` is padded at its end to a multiple of the product of ``multiple`` (integers, axis sizes)."""

    dim: int
    multiple: tuple[Factor, ...]
    op: ClassVar[str] = "pad"

    def __post_init__(self) -> None:
        _int(self.dim, "pad dim")
        if not self.multiple:
            raise _fail("pad needs a multiple")
        for f in self.multiple:
            if isinstance(f, str):
                if not AXIS_NAME.fullmatch(f):
                    raise _fail(f"pad factor {f!r} is not an axis name")
            else:
                _int(f, "pad factor", 1)

    def value(self, mesh: Mesh) -> int:
        m = 1
        for f in self.multiple:
            m *= mesh.axis_size(f) if isinstance(f, str) else f
        return m

    def to_dict(self) -> dict[str, Any]:
        return {"op": "pad", "dim": self.dim, "multiple": list(self.multiple)}


@dataclass(frozen=True)
class Size:
    """Declares the logical size of ``dim`` (needed where a local shape does not tell it)."""

    dim: int
    size: int
    op: ClassVar[str] = "size"

    def __post_init__(self) -> None:
        _int(self.dim, "size dim")
        _int(self.size, "size", 0)

    def to_dict(self) -> dict[str, Any]:
        return {"op": "size", "dim": self.dim, "size": self.size}


@dataclass(frozen=True)
class Partial:
    """Each rank holds a partial value; the logical tensor is their sum over ``axes``."""

    axes: tuple[str, ...]
    reduce: str = "sum"
    op: ClassVar[str] = "partial"

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", _axes(self.axes, "partial axes"))
        if self.reduce != "sum":
            raise _fail(f"partial reduces by 'sum' only, got {self.reduce!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"op": "partial", "axes": list(self.axes), "reduce": self.reduce}


Transform = Replicate | Shard | Fused | Grouped | Pad | Size | Partial


def transform_from_dict(d: Any) -> Transform:
    op = d.get("op") if isinstance(d, dict) else None
    if op == "replicate":
        _keys(d, "replicate", {"op"})
        return Replicate()
    if op == "shard":
        _keys(d, "shard", {"op", "dim", "axes"})
        return Shard(d["dim"], _axes(d["axes"], "shard axes"))
    if op in ("fused", "grouped"):
        _keys(d, op, {"op", "dim", "parts"} | ({"groups"} if op == "grouped" else set()))
        if not isinstance(d["parts"], list):
            raise _fail(f"{op} parts must be a list, got {d['parts']!r}")
        parts = []
        for p in d["parts"]:
            _keys(p, f"{op} part", {"name", "count"}, {"unit"})
            parts.append(Part(p["name"], p["count"], p.get("unit", 1)))
        if op == "grouped":
            return Grouped(d["dim"], d["groups"], tuple(parts))
        return Fused(d["dim"], tuple(parts))
    if op == "pad":
        _keys(d, "pad", {"op", "dim", "multiple"})
        if not isinstance(d["multiple"], list):
            raise _fail(f"pad multiple must be a list of integers and axis names, got {d['multiple']!r}")
        return Pad(d["dim"], tuple(d["multiple"]))
    if op == "size":
        _keys(d, "size", {"op", "dim", "size"})
        return Size(d["dim"], d["size"])
    if op == "partial":
        _keys(d, "partial", {"op", "axes"}, {"reduce"})
        return Partial(_axes(d["axes"], "partial axes"), d.get("reduce", "sum"))
    raise _fail(f"unknown transform {op!r} (known: replicate, shard, fused, grouped, pad, size, partial)")


# -- placement -------------------------------------------------------------------------------------
Placement = tuple[tuple[str, tuple[int, ...]], ...]  # ((axis, (index, ...)), ...); negative from the end


def _placement(v: Any, what: str) -> Placement:
    if isinstance(v, dict):
        v = tuple((k, tuple(x)) if isinstance(x, list | tuple) else (k, x) for k, x in v.items())
    out = []
    for item in v:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise _fail(f"{what}: placement items are (axis, indices), got {item!r}")
        axis, idx = item
        _axes([axis], what)
        if not isinstance(idx, tuple | list) or not idx:
            raise _fail(f"{what}: placement on {axis!r} needs at least one index")
        out.append((axis, tuple(_int(i, f"{what}: placement index") for i in idx)))
    if len({a for a, _ in out}) != len(out):
        raise _fail(f"{what}: placement names an axis twice")
    return tuple(out)


def _placement_dict(p: Placement) -> dict[str, list[int]]:
    return {a: list(i) for a, i in p}


def placement_allows(p: Placement, mesh: Mesh, coords: Mapping[str, int]) -> bool:
    for axis, idx in p:
        size = mesh.axis_size(axis)
        if coords[axis] not in {i % size for i in idx if -size <= i < size}:
            return False
    return True


def placement_values(p: Placement, mesh: Mesh, axis: str) -> tuple[int, ...]:
    """The coordinates of ``axis`` the placement allows (all of them when it does not name the axis)."""
    size = mesh.axis_size(axis)
    for a, idx in p:
        if a == axis:
            return tuple(sorted({i % size for i in idx if -size <= i < size}))
    return tuple(range(size))


# -- statements ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """Tensors whose logical names match any of ``patterns`` are stored by ``transforms``."""

    patterns: tuple[str, ...]
    transforms: tuple[Transform, ...]
    on: Placement = ()

    def __post_init__(self) -> None:
        if not self.patterns:
            raise _fail("a rule needs at least one pattern")
        for p in self.patterns:
            patterns.compile_pattern(p)
        if not self.transforms:
            raise _fail(f"rule {self.patterns[0]!r} needs at least one transform (or replicate)")
        object.__setattr__(self, "on", _placement(self.on, f"rule {self.patterns[0]!r}"))
        _check_transforms(self)

    def axes(self) -> set[str]:
        """The axes whose coordinates select what a rank holds (split and partial axes)."""
        out: set[str] = set()
        for t in self.transforms:
            if isinstance(t, Shard | Partial):
                out.update(t.axes)
        return out

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "patterns": list(self.patterns),
            "transforms": [t.to_dict() for t in self.transforms],
        }
        if self.on:
            d["on"] = _placement_dict(self.on)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Rule:
        _keys(d, "rule", {"patterns", "transforms"}, {"on"})
        if not isinstance(d["patterns"], list) or not isinstance(d["transforms"], list):
            raise _fail("rule patterns and transforms must be lists")
        return cls(
            tuple(d["patterns"]),
            tuple(transform_from_dict(t) for t in d["transforms"]),
            _placement(d.get("on", {}), "rule"),
        )


def _check_transforms(rule: Rule) -> None:
    what = f"rule {rule.patterns[0]!r}"
    ts = rule.transforms
    if any(isinstance(t, Replicate) for t in ts) and len(ts) > 1:
        raise _fail(f"{what}: replicate stands alone")
    used: list[str] = []
    state: dict[int, dict[str, int]] = {}
    for t in ts:
        if isinstance(t, Shard | Partial):
            used.extend(t.axes)
        if isinstance(t, Partial) and sum(isinstance(x, Partial) for x in ts) > 1:
            raise _fail(f"{what}: at most one partial")
        if isinstance(t, Shard | Fused | Grouped | Pad | Size):
            s = state.setdefault(t.dim, {})
            if isinstance(t, Size):
                if "size" in s:
                    raise _fail(f"{what}: size({t.dim}, ...) given twice")
                s["size"] = 1
            elif isinstance(t, Pad):
                if "pad" in s or "fused" in s:
                    raise _fail(f"{what}: dim {t.dim} is padded twice or padded and fused")
                if "shard" in s:
                    raise _fail(f"{what}: pad({t.dim}, ...) must come before shard({t.dim}, ...)")
                s["pad"] = 1
            elif isinstance(t, Fused | Grouped):
                if "fused" in s or "pad" in s:
                    raise _fail(f"{what}: dim {t.dim} is fused twice or fused and padded")
                if "shard" in s:
                    raise _fail(f"{what}: {t.op}({t.dim}, ...) must come before shard({t.dim}, ...)")
                s["fused"] = 1
            else:
                if "fused" in s and "shard" in s:
                    raise _fail(f"{what}: a fused dim is sharded once (combine axes with '*')")
                s["shard"] = s.get("shard", 0) + 1
    dup = sorted({a for a in used if used.count(a) > 1})
    if dup:
        raise _fail(f"{what}: axis {dup[0]!r} is used twice; each axis splits or reduces at most once")
    for axis, _ in rule.on:
        if axis in used:
            raise _fail(f"{what}: axis {axis!r} both places and splits the tensor")


@dataclass(frozen=True)
class Renumber:
    """Names matching ``patterns`` carry a local index on a rank of ``axis``: stage s holds [b_s, b_s+1)."""

    patterns: tuple[str, ...]
    axis: str
    count: int | None = None  # split count indices over the axis with torch.chunk semantics
    bounds: tuple[int, ...] | None = None  # or explicit boundaries b_0 = 0 <= b_1 <= ... <= b_k

    def __post_init__(self) -> None:
        if not self.patterns:
            raise _fail("renumber needs at least one pattern")
        for p in self.patterns:
            caps = patterns.captures(p)
            patterns.compile_pattern(p, True)
            if len(caps) != 1:
                raise _fail(f"renumber pattern {p!r} must capture exactly one index, like layers.{{i}}.**")
        _axes([self.axis], "renumber axis")
        if (self.count is None) == (self.bounds is None):
            raise _fail(f"renumber {self.patterns[0]!r}: give either a count or bounds")
        if self.count is not None:
            _int(self.count, "renumber count", 0)
        if self.bounds is not None:
            b = tuple(_int(x, "renumber bound", 0) for x in self.bounds)
            object.__setattr__(self, "bounds", b)
            if len(b) < 2 or b[0] != 0 or any(x > y for x, y in zip(b, b[1:], strict=False)):
                raise _fail(f"renumber bounds must start at 0 and not decrease, got {list(b)}")

    def stage_bounds(self, mesh: Mesh) -> tuple[int, ...]:
        k = mesh.axis_size(self.axis)
        if self.bounds is not None:
            if len(self.bounds) != k + 1:
                raise MeshMismatchError(
                    f"renumber {self.patterns[0]!r} gives {len(self.bounds) - 1} stages; "
                    f"axis {self.axis!r} has size {k}"
                )
            return self.bounds
        n = self.count or 0
        c = -(-n // k)
        return tuple(min(s * c, n) for s in range(k + 1))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"patterns": list(self.patterns), "axis": self.axis}
        if self.bounds is not None:
            d["bounds"] = list(self.bounds)
        else:
            d["count"] = self.count
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Renumber:
        _keys(d, "renumber", {"patterns", "axis"}, {"count", "bounds"})
        if not isinstance(d["patterns"], list):
            raise _fail("renumber patterns must be a list")
        b = d.get("bounds")
        return cls(tuple(d["patterns"]), d["axis"], d.get("count"), tuple(b) if isinstance(b, list) else b)


@dataclass(frozen=True)
class Flat:
    """Flat fragments: local buffers ``buffer`` (one per state) hold the members' local pieces, flattened
    and concatenated (each start aligned to ``align`` elements), split over ``axes``.

    Without ``pad`` the whole buffer is a multiple of ``K * align`` elements (``K`` ranks of ``axes``);
    with ``pad`` (version 3) a multiple of ``lcm(K, product of pad)``, as Megatron pads a bucket's end to
    ``lcm(dp, 128)`` while aligning its parameters to 64, and DeepSpeed pads to ``2 * dp`` aligning none.
    """

    buffer: str  # pattern of the local buffer names; may capture {state}
    logical: str  # template of a member's logical name: {member} and {state}
    axes: tuple[str, ...]
    members: tuple[tuple[str, tuple[int, ...]], ...]  # (member, logical shape), in buffer order
    align: int = 1
    on: Placement = ()
    pad: tuple[Factor, ...] = ()  # () : the version 1 rule (a multiple of K * align)

    def __post_init__(self) -> None:
        caps = patterns.captures(self.buffer)
        if set(caps) - {"state"}:
            raise _fail(f"flat buffer {self.buffer!r} may capture only {{state}}")
        tcaps = set(patterns.captures(self.logical))
        want = {"member"} | ({"state"} if caps else set())
        if tcaps != want:
            raise _fail(f"flat template {self.logical!r} must name exactly {sorted(want)}")
        object.__setattr__(self, "axes", _axes(self.axes, "flat axes"))
        _int(self.align, "flat align", 1)
        if not self.members:
            raise _fail(f"flat {self.buffer!r} needs at least one member")
        members = []
        for m in self.members:
            if not (isinstance(m, tuple | list) and len(m) == 2 and isinstance(m[0], str) and m[0]):
                raise _fail(f"flat member must be (name, shape), got {m!r}")
            if not isinstance(m[1], tuple | list):
                raise _fail(f"flat member {m[0]!r}: shape must be a list, got {m[1]!r}")
            members.append((m[0], tuple(_int(x, f"flat member {m[0]!r} shape", 0) for x in m[1])))
        names = [m for m, _ in members]
        if len(set(names)) != len(names):
            raise _fail(f"flat {self.buffer!r} lists a member twice")
        object.__setattr__(self, "members", tuple(members))
        object.__setattr__(self, "on", _placement(self.on, f"flat {self.buffer!r}"))
        for axis, _ in self.on:
            if axis in self.axes:
                raise _fail(f"flat {self.buffer!r}: axis {axis!r} both places and splits the buffer")
        object.__setattr__(self, "pad", tuple(self.pad))
        for f in self.pad:
            if isinstance(f, str):
                if not AXIS_NAME.fullmatch(f):
                    raise _fail(f"flat {self.buffer!r}: pad factor {f!r} is not an axis name")
            else:
                _int(f, f"flat {self.buffer!r} pad factor", 1)

    def length(self, total: int, mesh: Mesh) -> int:
        """Elements of the whole buffer whose members end at ``total``: gaps and end padding included."""
        k = math.prod(mesh.axis_size(a) for a in self.axes)
        if not self.pad:
            unit = k * self.align
        else:
            unit = math.lcm(k, math.prod(mesh.axis_size(f) if isinstance(f, str) else f for f in self.pad))
        return max(1, -(-total // unit)) * unit

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "buffer": self.buffer,
            "logical": self.logical,
            "axes": list(self.axes),
            "align": self.align,
            "members": [[m, list(s)] for m, s in self.members],
        }
        if self.on:
            d["on"] = _placement_dict(self.on)
        if self.pad:
            d["pad"] = list(self.pad)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Flat:
        _keys(d, "flat", {"buffer", "logical", "axes", "members"}, {"align", "on", "pad"})
        if not isinstance(d.get("pad", []), list):
            raise _fail("flat pad must be a list of integers and axis names")
        if not isinstance(d["members"], list):
            raise _fail("flat members must be a list")
        return cls(
            d["buffer"],
            d["logical"],
            _axes(d["axes"], "flat axes"),
            tuple(tuple(m) if isinstance(m, list) else m for m in d["members"]),
            d.get("align", 1),
            _placement(d.get("on", {}), "flat"),
            tuple(d.get("pad", [])),
        )


@dataclass(frozen=True)
class Layout:
    """A UCL layout: optional mesh, renumber statements, rules and flat statements (spec/layout.md §3)."""

    rules: tuple[Rule, ...] = ()
    renumbers: tuple[Renumber, ...] = ()
    flats: tuple[Flat, ...] = ()
    mesh: Mesh | None = None
    version: int | None = None  # None: the lowest version that expresses the layout

    def __post_init__(self) -> None:
        needs, what = 1, ""
        if any(isinstance(t, Grouped) for r in self.rules for t in r.transforms):
            needs, what = 2, "grouped (spec/layout.md §7.10)"
        if any(f.pad for f in self.flats):
            needs, what = 3, "a flat statement's pad (spec/layout.md §7.6)"
        if self.version is None:
            object.__setattr__(self, "version", needs)
        if self.version not in VERSIONS:
            raise _fail(f"layout version {self.version!r}; this implementation reads versions "
                        f"{', '.join(map(str, VERSIONS))}")
        if self.version < needs:
            raise _fail(f"{what} needs layout version {needs}; this layout declares version {self.version}")
        for name, typ in (("rules", Rule), ("renumbers", Renumber), ("flats", Flat)):
            v = tuple(getattr(self, name))
            object.__setattr__(self, name, v)
            if not all(isinstance(x, typ) for x in v):
                raise _fail(f"layout {name} must all be {typ.__name__}")
        if self.mesh is not None:
            check_mesh(self, self.mesh)

    def axes(self) -> set[str]:
        """Every axis the layout names."""
        out: set[str] = set()
        for r in self.rules:
            out |= r.axes() | {a for a, _ in r.on}
            for t in r.transforms:
                if isinstance(t, Pad):
                    out |= {f for f in t.multiple if isinstance(f, str)}
        for n in self.renumbers:
            out.add(n.axis)
        for f in self.flats:
            out |= set(f.axes) | {a for a, _ in f.on} | {x for x in f.pad if isinstance(x, str)}
        return out

    def patterns(self) -> Iterator[tuple[str, str]]:
        """(where, pattern) for every rule and renumber pattern."""
        for i, r in enumerate(self.rules):
            for p in r.patterns:
                yield f"rule {i + 1}", p
        for i, n in enumerate(self.renumbers):
            for p in n.patterns:
                yield f"renumber {i + 1}", p

    def merged(self, *others: Layout) -> Layout:
        """This layout followed by the statements of ``others`` (one mesh at most)."""
        meshes = {x.mesh for x in (self, *others) if x.mesh is not None}
        if len(meshes) > 1:
            raise MeshMismatchError("merged layouts declare different meshes")
        return Layout(
            rules=self.rules + tuple(r for o in others for r in o.rules),
            renumbers=self.renumbers + tuple(r for o in others for r in o.renumbers),
            flats=self.flats + tuple(f for o in others for f in o.flats),
            mesh=next(iter(meshes), None),
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"ucl_layout": self.version}
        if self.mesh is not None:
            d["mesh"] = self.mesh.to_dict()
        d["renumber"] = [r.to_dict() for r in self.renumbers]
        d["rules"] = [r.to_dict() for r in self.rules]
        d["flat"] = [f.to_dict() for f in self.flats]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Layout:
        _keys(d, "layout", {"ucl_layout"}, {"mesh", "renumber", "rules", "flat"})
        v = d["ucl_layout"]
        if type(v) is not int or v not in VERSIONS:
            raise _fail(f"layout version {v!r}; this implementation reads versions {', '.join(map(str, VERSIONS))}")
        for k in ("renumber", "rules", "flat"):
            if not isinstance(d.get(k, []), list):
                raise _fail(f"layout {k} must be a list")
        return cls(
            rules=tuple(Rule.from_dict(r) for r in d.get("rules", [])),
            renumbers=tuple(Renumber.from_dict(r) for r in d.get("renumber", [])),
            flats=tuple(Flat.from_dict(f) for f in d.get("flat", [])),
            mesh=Mesh.from_dict(d["mesh"]) if "mesh" in d else None,
            version=v,
        )


def check_mesh(layout: Layout, mesh: Mesh, world_size: int | None = None) -> None:
    """Raise MeshMismatchError unless ``mesh`` fits ``layout`` (and has ``world_size`` ranks)."""
    if layout.mesh is not None and layout.mesh != mesh:
        raise MeshMismatchError(
            f"the layout declares mesh {layout.mesh.to_text()}; got {mesh.to_text() or '(empty)'}"
        )
    missing = sorted(layout.axes() - set(mesh.names))
    if missing:
        raise MeshMismatchError(
            f"the layout names axis {missing[0]!r}, which the mesh {mesh.to_text() or '(empty)'} lacks"
        )
    for r in layout.renumbers:
        r.stage_bounds(mesh)
    if world_size is not None:
        mesh.check_world_size(world_size)
