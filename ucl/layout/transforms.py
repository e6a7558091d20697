"""The index mapping of a rule (spec/layout.md §5): per dimension, which logical elements each block
holds, and how the blocks form the stored array. Pure integer arithmetic.

A *block* is what one rank holds along one dimension; the rank's local tensor is the product of its
blocks. Along a dim the blocks are numbered ``beta`` row-major over the dim's splits (the first split
outermost; a split over several axes ``a*b`` numbers its ranks row-major in that order).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucl.errors import LayoutShapeError
from ucl.layout.boxes import Box
from ucl.layout.mesh import Mesh
from ucl.layout.model import Fused, Grouped, Pad, Partial, Rule, Shard, Size


def chunk_range(length: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk semantics: piece ``i`` of ``k`` of a length: (start, size), pieces of ceil(length/k)."""
    c = -(-length // k) if length else 0
    start = min(i * c, length)
    return start, min(c, length - start)


@dataclass(frozen=True)
class Seg:
    """``length`` elements at ``local`` in the block hold logical elements from ``logical``."""

    local: int
    logical: int
    length: int


@dataclass(frozen=True)
class Block:
    length: int  # the local size along the dim (padding included)
    segs: tuple[Seg, ...]  # cover [0, stored) of the block, in order

    @property
    def stored(self) -> int:
        """Leading elements of the block that are stored (the rest is padding)."""
        return sum(s.length for s in self.segs)


@dataclass(frozen=True)
class DimPlan:
    n: int  # logical size
    splits: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]  # number of ranks of each split
    blocks: tuple[Block, ...]  # by beta
    chunk: int  # the stored chunk size along the dim (>= 1)
    regular: bool  # blocks are the regular chunks of the logical dim: stored == logical along it

    def index(self, mesh: Mesh, coords: Mapping[str, int]) -> int:
        beta = 0
        for axes, k in zip(self.splits, self.sizes, strict=True):
            i = 0
            for a in axes:
                i = i * mesh.axis_size(a) + coords[a]
            beta = beta * k + i
        return beta

    @property
    def stored_size(self) -> int:
        return self.n if self.regular else len(self.blocks) * self.chunk

    def stored_segs(self) -> list[Seg]:
        """Segments of the stored dim (``local`` = stored coordinate), in stored order. Replicated
        units (GQA) appear once per block that holds them; readers use the first."""
        if self.regular:
            return [Seg(0, 0, self.n)] if self.n else []
        return [
            Seg(beta * self.chunk + s.local, s.logical, s.length)
            for beta, b in enumerate(self.blocks)
            for s in b.segs
            if s.length
        ]


def _blocks_plain(n: int, padded: int, sizes: tuple[int, ...]) -> list[Block]:
    out = []
    for beta in range(math.prod(sizes)):
        idx, rest = [], beta
        for k in reversed(sizes):
            idx.append(rest % k)
            rest //= k
        off, length = 0, padded
        for k, i in zip(sizes, reversed(idx), strict=True):
            s, length = chunk_range(length, k, i)
            off += s
        keep = max(0, min(length, n - off))
        out.append(Block(length, (Seg(0, off, keep),) if keep else ()))
    return out


def _blocks_fused(fused: Fused, k: int) -> list[Block]:
    out = []
    for i in range(k):
        segs, cursor, base = [], 0, 0
        for p in fused.parts:
            if p.count < k and k % p.count == 0:  # fewer units than ranks: each unit replicated (GQA)
                u0, nu = i // (k // p.count), 1
            else:
                u0, nu = chunk_range(p.count, k, i)
            if nu:
                segs.append(Seg(cursor, base + u0 * p.unit, nu * p.unit))
            cursor += nu * p.unit
            base += p.size
        out.append(Block(cursor, tuple(segs)))
    return out


def grouped_order(g: Grouped) -> list[Seg]:
    """The grouped order of a dim (spec/layout.md §7.10) as segments: ``local`` the position in that
    order, ``logical`` in the parts' concatenation; one per (group, part), in that order."""
    out, cursor = [], 0
    bases = [sum(q.size for q in g.parts[:j]) for j in range(len(g.parts))]
    for grp in range(g.groups):
        for p, base in zip(g.parts, bases, strict=True):
            per = p.count // g.groups * p.unit
            out.append(Seg(cursor, base + grp * per, per))
            cursor += per
    return out


def _blocks_grouped(g: Grouped, k: int) -> list[Block]:
    """Rank ``i`` of ``k`` holds the contiguous piece ``chunk(n, k, i)`` of the grouped order: whole groups
    when ``k`` divides the groups, else part of one group (Megatron-core with more TP ranks than query
    groups)."""
    order, n = grouped_order(g), g.size
    out = []
    for i in range(k):
        start, length = chunk_range(n, k, i)
        segs: list[Seg] = []
        for s in order:
            lo, hi = max(start, s.local), min(start + length, s.local + s.length)
            if lo >= hi:
                continue
            local, logical = lo - start, s.logical + (lo - s.local)
            if segs and segs[-1].local + segs[-1].length == local and segs[-1].logical + segs[-1].length == logical:
                prev = segs.pop()
                segs.append(Seg(prev.local, prev.logical, prev.length + hi - lo))
            else:
                segs.append(Seg(local, logical, hi - lo))
        out.append(Block(length, tuple(segs)))
    return out


def dim_plan(rule: Rule | None, dim: int, n: int, mesh: Mesh, name: str) -> DimPlan:
    """The blocks of dim ``dim`` (logical size ``n``) of tensor ``name`` under ``rule`` (dims resolved)."""
    for t in rule.transforms if rule else ():
        if isinstance(t, Size) and t.dim == dim and t.size != n:
            raise LayoutShapeError(
                f"tensor {name!r}: dim {dim} has {n} elements; the rule declares size({dim}, {t.size})",
                tensor=name,
            )
        if isinstance(t, Fused | Grouped) and t.dim == dim and t.size != n:
            raise LayoutShapeError(
                f"tensor {name!r}: dim {dim} has {n} elements; the {t.op} parts "
                f"({', '.join(f'{p.name}={p.size}' for p in t.parts)}) sum to {t.size}",
                tensor=name,
            )
    return _dim_plan(rule, dim, n, mesh)


@functools.lru_cache(maxsize=1 << 16)
def _dim_plan(rule: Rule | None, dim: int, n: int, mesh: Mesh) -> DimPlan:
    splits: list[tuple[str, ...]] = []
    padded = n
    fused: Fused | Grouped | None = None
    for t in rule.transforms if rule else ():
        if not isinstance(t, Shard | Fused | Grouped | Pad) or t.dim != dim:
            continue
        if isinstance(t, Pad):
            m = t.value(mesh)
            padded = -(-n // m) * m
        elif isinstance(t, Fused | Grouped):
            fused = t
        else:
            splits.append(t.axes)
    sizes = tuple(math.prod(mesh.axis_size(a) for a in axes) for axes in splits)
    if isinstance(fused, Grouped):
        blocks = _blocks_grouped(fused, sizes[0] if sizes else 1)
    elif fused is not None:
        blocks = _blocks_fused(fused, sizes[0] if sizes else 1)
    else:
        blocks = _blocks_plain(n, padded, sizes)
    chunk = max([1, *(b.length for b in blocks)])
    regular = fused is None and all(
        b.stored == max(0, min(chunk, n - beta * chunk)) and (not b.segs or b.segs[0].logical == beta * chunk)
        for beta, b in enumerate(blocks)
    )
    return DimPlan(n, tuple(splits), sizes, tuple(blocks), chunk, regular)


def resolve_dims(rule: Rule | None, ndim: int, name: str) -> Rule | None:
    """``rule`` with negative dims resolved for a tensor of ``ndim`` dims; checks every dim exists."""
    if rule is None:
        return None
    for t in rule.transforms:
        if isinstance(t, Shard | Fused | Grouped | Pad | Size) and not -ndim <= t.dim < ndim:
            raise LayoutShapeError(
                f"tensor {name!r} has {ndim} dims; its rule ({rule.patterns[0]!r}) names dim {t.dim}",
                tensor=name,
            )
    return _resolved(rule, ndim)


@functools.lru_cache(maxsize=4096)
def _resolved(rule: Rule, ndim: int) -> Rule:
    if all(t.dim >= 0 for t in rule.transforms if isinstance(t, Shard | Fused | Grouped | Pad | Size)):
        return rule
    ts = [
        dataclasses.replace(t, dim=t.dim + ndim)
        if isinstance(t, Shard | Fused | Grouped | Pad | Size) and t.dim < 0
        else t
        for t in rule.transforms
    ]
    return Rule(rule.patterns, tuple(ts), rule.on)


@dataclass(frozen=True)
class Tile:
    """The geometry of one tensor under one rule on one mesh (spec/layout.md §5)."""

    name: str
    shape: tuple[int, ...]  # logical
    dims: tuple[DimPlan, ...]
    partial: tuple[str, ...]  # partial axes
    contributions: int  # K: number of partial contributions (1 when not partial)

    @property
    def plain(self) -> bool:
        """The stored array is the logical tensor."""
        return not self.partial and all(d.regular for d in self.dims)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        lead = (self.contributions,) if self.partial else ()
        return (*lead, *(d.stored_size for d in self.dims))

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        lead = (1,) if self.partial else ()
        return (*lead, *(d.chunk for d in self.dims))

    def content_axes(self) -> set[str]:
        out = set(self.partial)
        for d in self.dims:
            for axes in d.splits:
                out.update(axes)
        return out

    def contribution(self, mesh: Mesh, coords: Mapping[str, int]) -> int:
        k = 0
        for a in self.partial:
            k = k * mesh.axis_size(a) + coords[a]
        return k

    def blocks(self, mesh: Mesh, coords: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[Block, ...]]:
        betas = tuple(d.index(mesh, coords) for d in self.dims)
        return betas, tuple(d.blocks[b] for d, b in zip(self.dims, betas, strict=True))

    def local_shape(self, mesh: Mesh, coords: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(b.length for b in self.blocks(mesh, coords)[1])

    def pieces(self, mesh: Mesh, coords: Mapping[str, int]) -> list[tuple[Box, Box]]:
        """(local box, logical box) pairs that tile the stored part of the rank's local tensor."""
        _, blocks = self.blocks(mesh, coords)
        acc: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = [((), (), ())]
        for b in blocks:
            acc = [((*ls, s.local), (*gs, s.logical), (*n, s.length)) for ls, gs, n in acc for s in b.segs]
        return [((ls, n), (gs, n)) for ls, gs, n in acc]

    def write(self, mesh: Mesh, coords: Mapping[str, int]) -> tuple[tuple[int, ...], Box, Box] | None:
        """(chunk index, local box, stored box) of the rank's chunk, or None when it stores nothing."""
        betas, blocks = self.blocks(mesh, coords)
        sizes = tuple(b.stored for b in blocks)
        if any(s == 0 for s in sizes):
            return None
        start = tuple(beta * d.chunk for beta, d in zip(betas, self.dims, strict=True))
        local: Box = (tuple(0 for _ in sizes), sizes)
        if self.partial:
            k = self.contribution(mesh, coords)
            return (k, *betas), local, ((k, *start), (1, *sizes))
        return betas, local, (start, sizes)

    def maps(self) -> list[dict[str, Any]]:
        """The map entries of the stored array (spec/layout.md §6), each relative to one contribution."""
        out: list[dict[str, Any]] = [{"tensor": self.name, "box": [[], []], "at": []}]
        for d in self.dims:
            out = [
                {
                    "tensor": self.name,
                    "box": [[*m["box"][0], s.logical], [*m["box"][1], s.length]],
                    "at": [*m["at"], s.local],
                }
                for m in out
                for s in d.stored_segs()
            ]
        return out


def make_tile(rule: Rule | None, name: str, shape: tuple[int, ...], mesh: Mesh) -> Tile:
    """The tile of tensor ``name`` of logical ``shape`` under ``rule`` (None: replicated)."""
    rule = resolve_dims(rule, len(shape), name)
    dims = tuple(dim_plan(rule, d, n, mesh, name) for d, n in enumerate(shape))
    partial: tuple[str, ...] = ()
    for t in rule.transforms if rule else ():
        if isinstance(t, Partial):
            partial = t.axes
    k = math.prod(mesh.axis_size(a) for a in partial)
    return Tile(name, tuple(shape), dims, partial, k)


def infer_shape(
    rule: Rule | None, name: str, local: tuple[int, ...], mesh: Mesh
) -> tuple[tuple[int, ...], set[int]]:
    """The logical shape a local shape implies, assuming even splits where the layout declares no size.

    Returns the shape and the dims that were assumed to split evenly.
    """
    rule = resolve_dims(rule, len(local), name)
    shape = list(local)
    assumed: set[int] = set()
    for d in range(len(local)):
        size = fused = pad = None
        k = 1
        for t in rule.transforms if rule else ():
            if isinstance(t, Size) and t.dim == d:
                size = t.size
            elif isinstance(t, Fused | Grouped) and t.dim == d:
                fused = t.size
            elif isinstance(t, Pad) and t.dim == d:
                pad = t
            elif isinstance(t, Shard) and t.dim == d:
                k *= math.prod(mesh.axis_size(a) for a in t.axes)
        if size is not None:
            shape[d] = size
        elif fused is not None:
            shape[d] = fused
        elif pad is not None:
            raise LayoutShapeError(
                f"tensor {name!r}: dim {d} is padded, so its local shape does not tell its logical size; "
                f"declare size({d}, N) in the rule or pass shapes=",
                tensor=name,
            )
        elif k > 1:
            shape[d] = local[d] * k
            assumed.add(d)
    return tuple(shape), assumed
