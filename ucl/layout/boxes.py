"""Boxes: ``(start, shape)`` pairs of element coordinates, and their row-major (flat) geometry."""

from __future__ import annotations

import itertools
import math

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape), in elements
View = tuple[int, tuple[int, ...]]  # (element offset, shape): a row-major tensor inside a flat buffer


def full(shape: tuple[int, ...]) -> Box:
    return (tuple(0 for _ in shape), tuple(shape))


def numel(box: Box) -> int:
    return math.prod(box[1])


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None when it is empty."""
    start, shape = [], []
    for s0, n0, s1, n1 in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(s0, s1), min(s0 + n0, s1 + n1)
        if hi <= lo:
            return None
        start.append(lo)
        shape.append(hi - lo)
    return tuple(start), tuple(shape)


def shift(box: Box, by: tuple[int, ...]) -> Box:
    return tuple(s + o for s, o in zip(box[0], by, strict=True)), box[1]


def relative(box: Box, origin: tuple[int, ...]) -> Box:
    return tuple(s - o for s, o in zip(box[0], origin, strict=True)), box[1]


def ravel(shape: tuple[int, ...], index: tuple[int, ...]) -> int:
    flat = 0
    for n, i in zip(shape, index, strict=True):
        flat = flat * n + i
    return flat


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes of a row-major tensor of ``shape`` that cover its flat range [start, stop) in order, each
    contiguous in flat order (at most 2 * ndim - 1 of them)."""
    if stop <= start:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    rest = tuple(shape[1:])
    zeros = tuple(0 for _ in rest)
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(stop, inner)

    def row(i: int, a: int, b: int) -> list[Box]:
        return [((i, *s), (1, *n)) for s, n in flat_range_boxes(rest, a, b)]

    if i0 == i1:
        return row(i0, r0, r1)
    out: list[Box] = []
    if r0:
        out += row(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0, *zeros), (i1 - i0, *rest)))
    if r1:
        out += row(i1, 0, r1)
    return out


def contiguous_runs(shape: tuple[int, ...], box: Box) -> list[tuple[int, Box]]:
    """Split ``box`` of a row-major tensor of ``shape`` into runs contiguous in flat order: a list of
    ``(flat start, run box)``, the run boxes tiling ``box`` in row-major order."""
    start, size = box
    if any(n == 0 for n in size):
        return []
    nd = len(shape)
    j = nd - 1
    while j > 0 and start[j] == 0 and size[j] == shape[j]:
        j -= 1
    if nd == 0:
        return [(0, box)]
    out = []
    for prefix in itertools.product(*(range(start[d], start[d] + size[d]) for d in range(j))):
        run_start = (*prefix, *start[j:])
        run_shape = (*(1 for _ in prefix), *size[j:])
        out.append((ravel(shape, run_start), (run_start, run_shape)))
    return out
