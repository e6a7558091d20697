"""Hypothesis strategies for layouts (spec/layout.md): meshes, rules, and whole configurations.

A *scenario* is a set of logical tensors (:func:`logical_specs`) and configurations (mesh + layout,
:func:`configs`) that fit them, so that a state saved under one configuration can be loaded under
another. Shapes are small: these drive property tests of the pure planner.

>>> from hypothesis import given
>>> @given(spec=logical_specs(), data=st.data())
... def test(spec, data):
...     mesh, layout = data.draw(configs(spec))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from ucl.layout.mesh import Mesh
from ucl.layout.model import Flat, Fused, Grouped, Layout, Pad, Part, Partial, Renumber, Rule, Shard, Size, Transform
from ucl.layout.patterns import escape

AXES = ("pp", "dp", "fsdp", "cp", "ep", "tp")
DTYPES = ("float32", "float64", "int32", "int16")
STATES = ("a", "b")


@st.composite
def meshes(draw: Any, max_axes: int = 3, max_size: int = 4, max_ranks: int = 8) -> Mesh:
    """A mesh of up to ``max_axes`` axes (names from AXES, in random order), at most ``max_ranks`` ranks."""
    names = draw(st.lists(st.sampled_from(AXES), unique=True, min_size=0, max_size=max_axes))
    axes = []
    total = 1
    for n in names:
        size = draw(st.integers(1, max(1, min(max_size, max_ranks // total))))
        total *= size
        axes.append((n, size))
    return Mesh(tuple(axes))


def shapes(max_ndim: int = 3, max_dim: int = 7) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, max_dim), min_size=0, max_size=max_ndim).map(tuple)


@dataclass(frozen=True)
class LogicalSpec:
    """Logical tensors of a scenario, in groups that configurations treat alike."""

    plain: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)
    layers: int  # tensors "blk.<i>.w" for i < layers, all of shape layer_shape
    layer_shape: tuple[int, ...]
    members: dict[str, tuple[int, ...]]  # flat-able: tensors "opt/<member>/<state>" for each state
    dtype: str  # of the layer and member tensors

    def tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out = dict(self.plain)
        out.update({f"blk.{i}.w": (self.layer_shape, self.dtype) for i in range(self.layers)})
        out.update({f"opt/{m}/{s}": (shape, self.dtype) for m, shape in self.members.items() for s in STATES})
        return out


@st.composite
def logical_specs(draw: Any, max_plain: int = 3, max_layers: int = 4, max_members: int = 3) -> LogicalSpec:
    n = draw(st.integers(0, max_plain))
    plain = {f"t{i}": (draw(shapes()), draw(st.sampled_from(DTYPES))) for i in range(n)}
    layers = draw(st.integers(0, max_layers))
    layer_shape = draw(shapes(max_ndim=2))
    members = {f"m{j}": draw(shapes()) for j in range(draw(st.integers(0, max_members)))}
    if not (plain or layers or members):
        plain = {"t0": ((3, 2), "float32")}
    return LogicalSpec(plain, layers, layer_shape, members, draw(st.sampled_from(DTYPES)))


@st.composite
def _parts(draw: Any, n: int) -> tuple[Part, ...]:
    """Fused parts whose sizes sum to n (n >= 1)."""
    k = draw(st.integers(1, min(3, n)))
    cuts = (
        sorted(draw(st.lists(st.integers(1, n - 1), unique=True, min_size=k - 1, max_size=k - 1)))
        if k > 1
        else []
    )
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    parts = []
    for i, size in enumerate(sizes):
        unit = draw(st.sampled_from([u for u in range(1, size + 1) if size % u == 0]))
        parts.append(Part(f"p{i}", size // unit, unit))
    return tuple(parts)


@st.composite
def tile_transforms(
    draw: Any, mesh: Mesh, shape: tuple[int, ...], axes: list[str] | None = None, partial: bool = True
) -> tuple[Transform, ...]:
    """Transforms for a tensor of ``shape``: per dim none, shard (combined axes), nested shards, pad, fused,
    grouped;
    maybe partial. Each axis of ``axes`` (default: the mesh's) is used at most once."""
    free = list(draw(st.permutations(list(mesh.names if axes is None else axes))))
    out: list[Transform] = []

    def take(k: int) -> tuple[str, ...]:
        got = tuple(free[:k])
        del free[:k]
        return got

    for d, n in enumerate(shape):
        kind = draw(st.sampled_from(["none", "shard", "shard", "nested", "pad", "fused", "grouped"]))
        dim = d - len(shape) if draw(st.booleans()) else d
        if kind == "shard" and free:
            out.append(Shard(dim, take(draw(st.integers(1, min(2, len(free)))))))
        elif kind == "nested" and len(free) >= 2:
            out.extend([Shard(dim, take(1)), Shard(dim, take(1))])
        elif kind == "pad":
            factors: list[int | str] = [draw(st.integers(1, 4))]
            if mesh.names and draw(st.booleans()):
                factors.append(draw(st.sampled_from(mesh.names)))
            out.extend([Size(dim, n), Pad(dim, tuple(factors))])
            if free and draw(st.booleans()):
                out.append(Shard(dim, take(1)))
        elif kind == "fused" and n >= 1:
            out.append(Fused(dim, draw(_parts(n))))
            if free:
                out.append(Shard(dim, take(draw(st.integers(1, min(2, len(free)))))))
        elif kind == "grouped" and n >= 1:
            groups = draw(st.sampled_from([g for g in range(1, 5) if n % g == 0]))
            per_group = draw(_parts(n // groups))  # one group's parts; every group alike
            out.append(Grouped(dim, groups, tuple(Part(p.name, p.count * groups, p.unit) for p in per_group)))
            if free:
                out.append(Shard(dim, take(draw(st.integers(1, min(2, len(free)))))))
    if partial and free and draw(st.integers(0, 4)) == 0:
        out.append(Partial(take(1)))
    return tuple(out)


def _placement(draw: Any, mesh: Mesh, used: set[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    cands = [a for a in mesh.names if a not in used]
    if not cands or draw(st.integers(0, 3)):
        return ()
    axis = draw(st.sampled_from(cands))
    size = mesh.axis_size(axis)
    values = draw(st.lists(st.integers(0, size - 1), unique=True, min_size=1, max_size=size))
    return ((axis, tuple(v - size if draw(st.booleans()) else v for v in values)),)


@st.composite
def configs(draw: Any, spec: LogicalSpec, mesh: Mesh | None = None) -> tuple[Mesh, Layout]:
    """A (mesh, layout) pair under which ``spec``'s tensors can be saved and loaded."""
    mesh = mesh if mesh is not None else draw(meshes())
    rules: list[Rule] = []
    renumbers: list[Renumber] = []
    flats: list[Flat] = []
    for name, (shape, _) in spec.plain.items():
        ts = draw(tile_transforms(mesh, shape))
        if ts:
            used = {a for t in ts if isinstance(t, Shard | Partial) for a in t.axes}
            rules.append(Rule((escape(name),), ts, _placement(draw, mesh, used)))
    if spec.layers:
        ts = draw(tile_transforms(mesh, spec.layer_shape))
        used = {a for t in ts if isinstance(t, Shard | Partial) for a in t.axes}
        if ts:
            rules.append(Rule(("blk.*.w",), ts))
        cands = [a for a in mesh.names if a not in used]
        if cands and draw(st.booleans()):
            axis = draw(st.sampled_from(cands))
            k = mesh.axis_size(axis)
            if draw(st.booleans()):
                renumbers.append(Renumber(("blk.{i}.w",), axis, count=spec.layers))
            else:
                cuts = sorted(draw(st.lists(st.integers(0, spec.layers), min_size=k - 1, max_size=k - 1)))
                renumbers.append(Renumber(("blk.{i}.w",), axis, bounds=(0, *cuts, spec.layers)))
    flat_axes: tuple[str, ...] = ()
    if spec.members and mesh.names and draw(st.booleans()):
        flat_axes = tuple(draw(st.lists(st.sampled_from(mesh.names), unique=True, min_size=1, max_size=2)))
    rest = [a for a in mesh.names if a not in flat_axes]
    for m, shape in spec.members.items():
        ts = draw(tile_transforms(mesh, shape, rest if flat_axes else None, partial=not flat_axes))
        if ts:
            rules.append(Rule((f"opt/{m}/*",), ts))
    if flat_axes:
        flats.append(
            Flat(
                "flatbuf/{state}",
                "opt/{member}/{state}",
                flat_axes,
                tuple(spec.members.items()),
                draw(st.integers(1, 4)),
            )
        )
    return mesh, Layout(tuple(rules), tuple(renumbers), tuple(flats))


@st.composite
def layouts(draw: Any) -> Layout:
    """A random valid layout (for syntax and JSON round trips), sometimes declaring its mesh."""
    spec = draw(logical_specs())
    mesh, layout = draw(configs(spec))
    out: Layout = layout
    if draw(st.booleans()):
        out = Layout(layout.rules, layout.renumbers, layout.flats, mesh)
    return out
