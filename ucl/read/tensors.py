"""Lazy tensors of an open step: indexing reads only the inner chunks the index needs.

:class:`LazyTensor` is a stored array; :class:`LogicalTensor` a logical tensor of a step saved under a
layout (rebuilt from the stored boxes that hold it); :class:`ReplayedTensor` a tensor a gradient-record
step defines by replaying its optimizer step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ucl.errors import InvalidArgumentError, LimitExceededError
from ucl.format import dtypes
from ucl.format.metadata import ArrayMeta
from ucl.plan.copies import BoxCopy
from ucl.read.chunks import Request

if TYPE_CHECKING:
    from ucl.read.checkpoint import Checkpoint


class LazyTensor:
    """A stored tensor; indexing reads only the inner chunks the index needs.

    ``t[...]`` or ``t.read()`` returns the whole tensor; ``t[a:b]``, ``t[:, 3]``, ``t[..., 1:5]`` return
    those elements as a new ``torch.Tensor`` (basic indexing: ints, slices of any step, Ellipsis).
    """

    def __init__(self, ckpt: Checkpoint, meta: ArrayMeta) -> None:
        self._ckpt = ckpt
        self.meta = meta  # the stored array
        self._name, self._shape, self._spec_dtype = meta.name, tuple(meta.shape), meta.dtype

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.to_torch(self._spec_dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self._shape) * dtypes.itemsize(self._spec_dtype)

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, shape={list(self._shape)}, dtype={self.dtype})"

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor (into ``out`` when given: a contiguous CPU tensor of the same shape and dtype)."""
        return self.read_box((0,) * len(self._shape), self._shape, out)

    def _check_bounds(self, start: tuple[int, ...], shape: tuple[int, ...]) -> None:
        if len(start) != len(self._shape) or len(shape) != len(start) or any(
                a < 0 or n < 0 or a + n > s for a, n, s in zip(start, shape, self._shape, strict=True)):
            raise InvalidArgumentError(f"box start={list(start)} shape={list(shape)} is outside tensor {self.name!r} "
                                       f"of shape {list(self._shape)}", tensor=self.name)

    def _out(self, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return alloc(self.name, self._spec_dtype, shape)
        if tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise InvalidArgumentError(f"out must be a contiguous CPU {self.dtype} tensor of shape {list(shape)}",
                                       tensor=self.name)
        return out

    def read_box(self, start: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start + shape)`` as a tensor of ``shape``."""
        start, shape = tuple(start), tuple(shape)
        self._check_bounds(start, shape)
        self._ckpt.check_listed(self.meta, start, shape)
        out = self._out(shape, out)
        self._ckpt.read_requests([Request(self.meta, start, shape, out)])
        return out

    def __getitem__(self, key: Any) -> torch.Tensor:
        start, shape, post = normalize_index(key, self._shape, self.name)
        t = self.read_box(start, shape)
        return t[post] if post else t


class LogicalTensor(LazyTensor):
    """A logical tensor of a step saved under a layout: indexing reads only the stored boxes (and, in them,
    the inner chunks) that hold the elements asked for (spec/layout.md §6.4). Partial tensors read as the
    sum of their contributions. ``meta`` is None: the elements may span several stored arrays."""

    def __init__(self, ckpt: Checkpoint, name: str, shape: tuple[int, ...], dtype: str) -> None:
        self._ckpt = ckpt
        self.meta = None  # type: ignore[assignment]  # no one stored array holds it
        self._name, self._shape, self._spec_dtype = name, tuple(shape), dtype

    def read_box(self, start: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start + shape)`` as a tensor of ``shape``."""
        start, shape = tuple(start), tuple(shape)
        self._check_bounds(start, shape)
        out = self._out(shape, out)
        if not all(shape):
            return out
        parts = self._ckpt.logical_index().read_parts(self.name, (start, shape), sum_partial=True)
        arrays = self._ckpt.meta.arrays
        self._ckpt.fill([BoxCopy(arrays[a], sbox, out, None, rbox, k > 0) for a, sbox, rbox, k in parts])
        return out


class ReplayedTensor(LazyTensor):
    """A tensor of a gradient-record step (spec/delta.md §8): defined by replaying the recorded optimizer step
    on the parent step. Its shape and dtype come from the parent; the first read replays the whole step
    (every parameter and optimizer state at once, as the optimizer ran) and keeps the result."""

    def __init__(self, ckpt: Checkpoint, name: str, shape: tuple[int, ...], dtype: str) -> None:
        self._ckpt = ckpt
        self.meta = None  # type: ignore[assignment]  # not stored in this step
        self._name, self._shape, self._spec_dtype = name, tuple(shape), dtype

    def read_box(self, start: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        start, shape = tuple(start), tuple(shape)
        self._check_bounds(start, shape)
        out = self._out(shape, out)
        src = self._ckpt.replayed()[self.name]
        out.copy_(src[tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))])
        return out


def normalize_index(key: Any, shape: tuple[int, ...], name: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
    """Basic indexing -> the covering box and the indexing to apply to it."""
    if not isinstance(key, tuple):
        key = (key,)
    if sum(k is Ellipsis for k in key) > 1:
        raise InvalidArgumentError("an index can have only one Ellipsis", tensor=name)
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (len(shape) - len(key) + 1) + key[i + 1 :]
    if len(key) > len(shape):
        raise InvalidArgumentError(f"too many indices ({len(key)}) for tensor {name!r} of {len(shape)} dimensions",
                                   tensor=name)
    key = key + (slice(None),) * (len(shape) - len(key))
    start, size, post = [], [], []
    for k, n in zip(key, shape, strict=True):
        if isinstance(k, bool) or not isinstance(k, int | slice) and not hasattr(k, "__index__"):
            raise InvalidArgumentError(f"unsupported index {k!r} for tensor {name!r}: use ints, slices, Ellipsis",
                                       tensor=name)
        if isinstance(k, slice):
            a, b, s = k.indices(n)
            if s <= 0:
                raise InvalidArgumentError(f"slice step must be positive, got {s}", tensor=name)
            if b <= a:
                start.append(0)
                size.append(0)
                post.append(slice(None))
            else:
                last = a + (b - a - 1) // s * s
                start.append(a)
                size.append(last - a + 1)
                post.append(slice(None, None, s))
        else:
            i = int(k)
            if not -n <= i < n:
                raise InvalidArgumentError(f"index {i} is out of bounds for dimension of size {n} in tensor {name!r}",
                                           tensor=name)
            i %= n
            start.append(i)
            size.append(1)
            post.append(0)
    trivial = all(p == slice(None) or p == slice(None, None, 1) for p in post)
    return tuple(start), tuple(size), (() if trivial else tuple(post))


def alloc(name: str, dtype: str, shape: tuple[int, ...], zero: bool = False) -> torch.Tensor:
    try:
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtypes.to_torch(dtype))
    except (RuntimeError, MemoryError):  # the shape was checked against the spec's limits, not this machine's
        n = math.prod(shape) * dtypes.itemsize(dtype)
        raise LimitExceededError(f"cannot allocate {n} bytes for tensor "
                                 f"{name!r}", tensor=name) from None
