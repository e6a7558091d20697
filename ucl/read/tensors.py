"""Lazy tensors of an open step: indexing reads only the inner chunks the index needs.

:class:`LazyTensor` is a stored array; :class:`LogicalTensor` a logical tensor of a step saved under a
layout (rebuilt from the stored boxes that hold it); :class:`ReplayedTensor` a tensor a gradient-record
step defines by replaying its optimizer step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ucl.errors import InvalidArgumentError, LimitExceededError
from ucl.format import dtypes
from ucl.format.metadata import ArrayMeta
from ucl.plan.copies import BoxCopy
from ucl.read.chunks import Request

if TYPE_CHECKING:
    from ucl.read.checkpoint import Checkpoint


class IndexOutOfRangeError(InvalidArgumentError, IndexError):
    """An index numpy would refuse with IndexError (out of range, too many indices, not an index): both an
    ``invalid_argument`` error and an IndexError, so ``except IndexError`` (numpy's contract) catches it."""


class LazyTensor:
    """A stored tensor; indexing reads only the inner chunks the index needs.

    ``t[...]`` or ``t.read()`` returns the whole tensor; ``t[a:b]``, ``t[:, 3]``, ``t[..., 1:5]``,
    ``t[::-1]``, ``t[None, 2]`` return those elements as a new ``torch.Tensor`` (basic indexing as numpy
    does it: ints, slices of any step, Ellipsis, None; IndexError where numpy raises one).
    ``np.asarray(t)`` and ``torch.as_tensor(t)`` read the whole tensor (``__array__``, ``__dlpack__``).
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
        if out is None:
            mapped = self._ckpt.mapped_rows(self.meta, start, shape)
            if mapped is not None:
                return mapped
        out = self._out(shape, out)
        self._ckpt.read_requests([Request(self.meta, start, shape, out)])
        return out

    def __getitem__(self, key: Any) -> torch.Tensor:
        start, shape, post = normalize_index(key, self._shape, self.name)
        return apply_post(self.read_box(start, shape), post)

    # -- numpy and torch interop ---------------------------------------------------------------------
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> Any:
        """The whole tensor as a numpy array (numpy 2's protocol: ``np.asarray(t)``, ``np.array(t)``).

        Every call reads the tensor into a new array, so ``copy`` only matters with a ``dtype`` that
        differs from the tensor's: ``copy=False`` then raises ValueError, as numpy does. bfloat16 and
        float8 have no numpy dtype: they raise TypeError unless a ``dtype`` is asked for explicitly
        (``np.asarray(t, dtype=np.float32)``); ``t.read()`` returns them as a torch tensor.
        """
        t = self.read()
        try:
            native: Any = t.numpy()
        except TypeError:
            if dtype is None:
                raise TypeError(f"tensor {self.name!r} is {self.dtype}, which numpy has no dtype for: use "
                                f"{type(self).__name__}.read() for a torch tensor, or ask for a numpy dtype "
                                "explicitly, np.asarray(t, dtype=np.float32)") from None
            if copy is False:
                raise ValueError(f"tensor {self.name!r} is {self.dtype}: converting it to {np.dtype(dtype)} "
                                 "needs a copy, and copy=False was asked for") from None
            return t.float().numpy().astype(dtype, copy=False)
        if dtype is None or np.dtype(dtype) == native.dtype:
            return native
        if copy is False:
            raise ValueError(f"tensor {self.name!r} is {native.dtype}: converting it to {np.dtype(dtype)} "
                             "needs a copy, and copy=False was asked for")
        return native.astype(dtype)

    def __dlpack__(self, **kwargs: Any) -> Any:
        """DLPack (``torch.as_tensor(t)``, ``torch.from_dlpack(t)``, ``np.from_dlpack(t)``): the whole
        tensor, read into a new CPU tensor; every dtype, bfloat16 included."""
        return self.read().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: reads land in CPU memory


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


def normalize_index(key: Any, shape: tuple[int, ...],
                    name: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
    """Basic indexing -> the covering box and the indexing to apply to it (:func:`apply_post`).

    numpy's rules: ints (negative from the end), slices of any nonzero step, one Ellipsis, None (a new
    axis). Where numpy raises IndexError (an int out of range, more indices than dimensions, two
    Ellipses, something that is not an index) this raises :class:`IndexOutOfRangeError`, an IndexError;
    a zero step is numpy's ValueError. Advanced indexes (arrays, lists, booleans) are not supported.
    """
    if not isinstance(key, tuple):
        key = (key,)
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexOutOfRangeError(f"an index can only have a single ellipsis ('...'), for tensor {name!r}",
                                   tensor=name)
    for k in key:
        if k is None or k is Ellipsis or isinstance(k, slice):
            continue
        if isinstance(k, bool) or _is_advanced(k):
            raise InvalidArgumentError(f"unsupported index {_show(k)} for tensor {name!r}: advanced indexing "
                                       "(arrays, lists, booleans) is not supported; use ints, slices, Ellipsis, "
                                       "None, or read() the tensor and index that", tensor=name)
        if not hasattr(k, "__index__"):
            raise IndexOutOfRangeError(f"index {_show(k)} for tensor {name!r} is not an index: only integers, "
                                       "slices (`:`), ellipsis (`...`) and None are valid", tensor=name)
    n_dims = sum(k is not None and k is not Ellipsis for k in key)
    if n_dims > len(shape):
        raise IndexOutOfRangeError(f"too many indices for tensor {name!r}: it is {len(shape)}-dimensional, but "
                                   f"{n_dims} were indexed", tensor=name)
    i = next((j for j, k in enumerate(key) if k is Ellipsis), None)  # by identity: no __eq__ of an index
    if i is not None:
        key = key[:i] + (slice(None),) * (len(shape) - n_dims) + key[i + 1 :]
    else:
        key = key + (slice(None),) * (len(shape) - n_dims)
    start: list[int] = []
    size: list[int] = []
    post: list[Any] = []
    d = 0
    for k in key:
        if k is None:
            post.append(None)
            continue
        n = shape[d]
        if isinstance(k, slice):
            a, b, s = k.indices(n)  # a zero step: ValueError, as numpy
            count = len(range(a, b, s))
            if count == 0:
                start.append(0)
                size.append(0)
                post.append(slice(None))
            elif s > 0:
                start.append(a)
                size.append((count - 1) * s + 1)
                post.append(slice(None, None, s))
            else:  # read [last, first] and reverse it
                last = a + (count - 1) * s
                start.append(last)
                size.append(a - last + 1)
                post.append(slice(None, None, s))
        else:
            i = k.__index__()
            if not -n <= i < n:
                raise IndexOutOfRangeError(f"index {i} is out of bounds for axis {d} with size {n} of tensor "
                                           f"{name!r}", tensor=name)
            start.append(i % n)
            size.append(1)
            post.append(0)
        d += 1
    trivial = all(p == slice(None) or p == slice(None, None, 1) for p in post)
    return tuple(start), tuple(size), (() if trivial else tuple(post))


def apply_post(t: torch.Tensor, post: tuple[Any, ...]) -> torch.Tensor:
    """Apply :func:`normalize_index`'s indexing to the box it read (torch has no negative steps: those
    dimensions are flipped, then stepped)."""
    if not post:
        return t
    flip = []
    d = 0
    steps: list[Any] = []
    for p in post:
        if isinstance(p, slice) and p.step is not None and p.step < 0:
            flip.append(d)
            p = slice(None, None, -p.step)
        steps.append(p)
        if p is not None:
            d += 1
    if flip:
        t = t.flip(flip)
    return t[tuple(steps)]


def _is_advanced(k: Any) -> bool:
    """An array, list or boolean index (numpy's advanced indexing); a 0-d integer array is an int."""
    if isinstance(k, list | tuple):
        return True
    if isinstance(k, torch.Tensor):
        return k.ndim != 0 or k.dtype == torch.bool
    return hasattr(k, "__array__") and (getattr(k, "ndim", 0) != 0 or getattr(k.dtype, "kind", None) == "b")


def _show(k: Any) -> str:
    r = repr(k)
    return r if len(r) <= 60 else r[:57] + "..."


def alloc(name: str, dtype: str, shape: tuple[int, ...], zero: bool = False) -> torch.Tensor:
    try:
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtypes.to_torch(dtype))
    except (RuntimeError, MemoryError):  # the shape was checked against the spec's limits, not this machine's
        n = math.prod(shape) * dtypes.itemsize(dtype)
        raise LimitExceededError(f"cannot allocate {n} bytes for tensor "
                                 f"{name!r}", tensor=name) from None
