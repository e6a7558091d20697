"""Box copies: the plan of a load into existing tensors (pure, no I/O).

A :class:`BoxCopy` says: copy the stored box of an array into a box of a destination tensor (or add it,
for partial sums). The reader executes copies in batches of bounded memory; :meth:`BoxCopy.split`
cuts a copy that would need more temporary or decode scratch than a batch holds.
"""

from __future__ import annotations

import math

import torch

from ucl.format import dtypes
from ucl.format.metadata import ArrayMeta
from ucl.layout.boxes import ravel

Box = tuple[tuple[int, ...], tuple[int, ...]]
View = tuple[int, tuple[int, ...]]  # (element offset, shape) of a row-major view of a flat tensor


class BoxCopy:
    """Copy stored box (``start``, ``shape``) of array ``meta`` into ``box`` of ``dest`` (of the view
    (offset, shape) of its flat elements when ``view`` is set); add instead of copying when ``add``.
    The box and the stored box have the same number of elements; shapes differ only by a flat run
    (a 1-D stored box) or leading 1s."""

    __slots__ = ("meta", "start", "shape", "dest", "view", "box", "add", "_dst")

    def __init__(self, meta: ArrayMeta, stored: Box, dest: torch.Tensor, view: View | None,
                 box: Box, add: bool = False) -> None:
        self.meta = meta
        self.start, self.shape = tuple(stored[0]), tuple(stored[1])
        self.dest, self.view = dest, view
        self.box = (tuple(box[0]), tuple(box[1]))
        self.add = add
        self._dst: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.meta.itemsize

    def destination(self) -> torch.Tensor:
        if self._dst is None:
            t = self.dest
            if self.view is not None:
                off, vshape = self.view
                t = t.reshape(-1)[off : off + math.prod(vshape)].view(vshape)
            self._dst = t[tuple(slice(a, a + n) for a, n in zip(self.box[0], self.box[1], strict=True))]
        return self._dst

    @property
    def direct(self) -> bool:
        """Read straight into the destination (one contiguous CPU run of the stored dtype), no temporary."""
        dst = self.destination()
        return (not self.add and dst.device.type == "cpu" and dst.is_contiguous()
                and dst.dtype == dtypes.to_torch(self.meta.dtype))

    def cost(self) -> int:
        """Bytes this op holds beside its destination while read: its temporary and decode scratch."""
        return (0 if self.direct else self.nbytes) + self.scratch_bytes()

    def scratch_bytes(self) -> int:
        """An upper bound on the decode scratch of the read: inner chunks that are read whole into the
        request only when they are whole, unclipped, uncompressed and one contiguous run of it."""
        meta = self.meta
        if not self.shape or not all(self.shape):
            return 0
        inner = meta.inner_chunk_shape
        touched = whole = 1
        for a, n, i, s in zip(self.start, self.shape, inner, meta.shape, strict=True):
            lo, hi = a // i, -(-(a + n) // i)
            touched *= hi - lo
            first, last = -(-a // i), (a + n) // i  # chunks wholly inside [a, a + n)
            if last * i > s - s % i and s % i:
                last = min(last, s // i)  # a clipped last chunk is not whole
            whole *= max(0, last - first)
        if meta.compression is not None or meta.delta is not None:
            whole = 0
        k = max((d for d, (i, n) in enumerate(zip(inner, self.shape, strict=True)) if i < n), default=-1)
        runs = all(i == 1 for i in inner[:max(k, 0)]) and all(
            i == n for i, n in zip(inner[k + 1:], self.shape[k + 1:], strict=True))
        return (touched - (whole if runs else 0)) * meta.inner_nbytes

    def touched(self, limit: int = 4096) -> range | None:
        """The inner chunks (ordinals in the array's inner grid) a 1-D stored box touches, or None (an
        N-d box, or more than ``limit``): what a batch of reads shares, so its scratch is counted once."""
        if len(self.shape) != 1 or not self.shape[0]:
            return None
        i = self.meta.inner_chunk_shape[0]
        c = self.meta.chunk_shape[0]
        a, n = self.start[0], self.shape[0]
        lo, hi = a // i, -(-(a + n) // i)
        if hi - lo > limit or c % i:
            return None
        return range(lo, hi)

    def split(self, budget: int) -> list[BoxCopy]:
        """This op as ops each within ``budget`` bytes (temporary + scratch), split along the first
        dimension of the stored box longer than 1, at inner-chunk boundaries, in row-major order."""
        if math.prod(self.shape) <= 1 or self.cost() <= budget:
            return [self]
        if len(self.shape) == 1 and len(self.box[1]) != 1:  # a flat run into a box: split in row-major order
            return self._split_run(budget)
        d = next(i for i, n in enumerate(self.shape) if n > 1)
        a0, n = self.start[d], self.shape[d]
        inner = self.meta.inner_chunk_shape[d]
        per = max(1, n * budget // max(self.cost(), 1))
        per = max(inner, per // inner * inner) if per >= inner else per
        cuts = [a0, *range((a0 // per + 1) * per, a0 + n, per), a0 + n]
        out: list[BoxCopy] = []
        lead = len(self.box[1]) - len(self.shape)  # the box may have more (or fewer) leading 1s
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            st, sh = list(self.start), list(self.shape)
            st[d], sh[d] = lo, hi - lo
            bs, bn = list(self.box[0]), list(self.box[1])
            bd = d + lead
            if not (0 <= bd < len(bn) and bn[bd] == n):
                bd = next(j for j, m in enumerate(bn) if m > 1)
            bs[bd] += lo - a0
            bn[bd] = hi - lo
            box = (tuple(bs), tuple(bn))
            sub = BoxCopy(self.meta, (tuple(st), tuple(sh)), self.dest, self.view, box, self.add)
            out += sub.split(budget) if hi - lo > 1 and sub.cost() > budget else [sub]
        return out

    def _split_run(self, budget: int) -> list[BoxCopy]:
        out: list[BoxCopy] = []
        per = max(1, budget // max(1, self.meta.itemsize * 2))
        for rel_start, shape in row_major_pieces(self.box[1], per):
            first = ravel(self.box[1], rel_start)
            box = (tuple(a + b for a, b in zip(self.box[0], rel_start, strict=True)), shape)
            stored = ((self.start[0] + first,), (math.prod(shape),))
            out.append(BoxCopy(self.meta, stored, self.dest, self.view, box, self.add))
        return out


def row_major_pieces(shape: tuple[int, ...], limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Sub-boxes (relative start, shape) of a box of ``shape`` that tile it in row-major order, each a
    contiguous run of at most ``limit`` elements where possible (at least one row of the last dim)."""
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner <= limit or len(shape) == 1:
        per = max(1, limit // max(1, inner))
        return [((a, *(0,) * (len(shape) - 1)), (min(per, shape[0] - a), *shape[1:]))
                for a in range(0, shape[0], per)]
    out = []
    for a in range(shape[0]):
        for rs, rn in row_major_pieces(shape[1:], limit):
            out.append(((a, *rs), (1, *rn)))
    return out
