"""Opening a committed step and reading it lazily: ``ucl.open(path)[name][rows]``."""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ucl import dtypes, names
from ucl.boxread import Request, StepFiles, read
from ucl.errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    LimitExceededError,
    MissingShardError,
    TensorNotFoundError,
)
from ucl.metadata import ArrayMeta, CommitRecord, StepMeta
from ucl.repo import Repository
from ucl.storage import Store

READ_THREADS = 4


class LazyTensor:
    """A stored tensor; indexing reads only the inner chunks the index needs.

    ``t[...]`` or ``t.read()`` returns the whole tensor; ``t[a:b]``, ``t[:, 3]``, ``t[..., 1:5]`` return
    those elements as a new ``torch.Tensor`` (basic indexing: ints, slices of any step, Ellipsis).
    """

    def __init__(self, ckpt: Checkpoint, meta: ArrayMeta) -> None:
        self._ckpt = ckpt
        self.meta = meta

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.meta.shape)

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.meta.dtype)

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    def __len__(self) -> int:
        if not self.meta.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.meta.shape[0]

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={list(self.meta.shape)}, dtype={self.dtype})"

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor (into ``out`` when given: a contiguous CPU tensor of the same shape and dtype)."""
        return self.read_box((0,) * len(self.meta.shape), self.meta.shape, out)

    def read_box(self, start: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start + shape)`` as a tensor of ``shape``."""
        start, shape = tuple(start), tuple(shape)
        if len(start) != len(self.meta.shape) or len(shape) != len(start) or any(
                a < 0 or n < 0 or a + n > s for a, n, s in zip(start, shape, self.meta.shape, strict=True)):
            raise InvalidArgumentError(f"box start={list(start)} shape={list(shape)} is outside tensor {self.name!r} "
                                       f"of shape {list(self.meta.shape)}", tensor=self.name)
        self._ckpt._check_listed(self.meta, start, shape)
        if out is None:
            out = _empty(self.meta, shape)
        elif tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise InvalidArgumentError(f"out must be a contiguous CPU {self.dtype} tensor of shape {list(shape)}",
                                       tensor=self.name)
        self._ckpt._read([Request(self.meta, start, shape, out)])
        return out

    def __getitem__(self, key: Any) -> torch.Tensor:
        start, shape, post = _normalize_index(key, self.meta.shape, self.name)
        t = self.read_box(start, shape)
        return t[post] if post else t


def _normalize_index(key: Any, shape: tuple[int, ...], name: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
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


class Checkpoint:
    """One committed step, opened for reading. Use as a context manager (it owns a small thread pool).

    Attributes
    ----------
    step : int
    meta : StepMeta
        The step's metadata (arrays, structure, layout).
    record : CommitRecord
    """

    def __init__(self, repo: Repository, step: int, record: CommitRecord, meta: StepMeta) -> None:
        self.repo = repo
        self.step = step
        self.record = record
        self.meta = meta
        self._files = StepFiles(repo.store, step, record)
        self._pool: ThreadPoolExecutor | None = None
        self._chain_steps: dict[int, tuple[StepMeta, StepFiles]] = {step: (meta, self._files)}
        self._chain: Any = None
        self._lock = threading.Lock()

    # -- mapping-like ------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Tensor names, in the order they were saved."""
        return list(self.meta.arrays)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.meta.arrays)

    def __contains__(self, name: object) -> bool:
        return name in self.meta.arrays

    def __getitem__(self, name: str) -> LazyTensor:
        meta = self.meta.arrays.get(name)
        if meta is None:
            raise TensorNotFoundError(f"step {self.step} has no tensor {name!r}", tensor=name)
        return LazyTensor(self, meta)

    @property
    def kind(self) -> str:
        return self.meta.kind

    @property
    def bytes_read(self) -> int:
        """Bytes read from storage so far (indexes and chunks, in every step of a delta chain)."""
        return sum(f.bytes_read for _, f in self._chain_steps.values())

    def __repr__(self) -> str:
        return f"Checkpoint({self.repo.url!r}, step={self.step}, tensors={len(self)})"

    # -- reading -----------------------------------------------------------------------------------
    def _check_listed(self, meta: ArrayMeta, start: tuple[int, ...], shape: tuple[int, ...]) -> None:
        """Every shard a box needs is in the commit record: checked before anything is allocated (spec §8.4)."""
        if meta.delta is not None or not all(shape):
            return
        ranges = [range(a // c, -(-(a + n) // c)) for a, n, c in zip(start, shape, meta.chunk_shape, strict=True)]
        if math.prod(len(r) for r in ranges) > len(self.record.files):
            raise MissingShardError(f"tensor {meta.name!r} needs {math.prod(len(r) for r in ranges)} shards; the commit "
                                    f"record of step {self.step} lists {len(self.record.files)} files",
                                    tensor=meta.name, file=meta.key)
        for coords in itertools.product(*ranges):
            self._files.shard(meta, coords)

    def _read(self, requests: list[Request]) -> None:
        plain = [r for r in requests if r.meta.delta is None]
        chained = [r for r in requests if r.meta.delta is not None]
        if self._pool is None and sum(r.meta.nbytes for r in plain) > 8 << 20:
            with self._lock:  # zarr views read from several threads at once
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ucl-read")
        if plain:
            read(self._files, plain, self._pool)
        for r in chained:  # delta-encoded tensors: through the step's chain (spec/delta.md §6.3)
            self._chain_reader().read(r)

    def _chain_reader(self) -> Any:
        with self._lock:
            if self._chain is None:
                from ucl.delta.read import ChainReader

                self._chain = ChainReader(self.step, self._step_source)
            return self._chain

    def _step_source(self, step: int) -> tuple[StepMeta, StepFiles]:
        if step not in self._chain_steps:
            record = self.repo.commit_record(step)
            self._chain_steps[step] = (self.repo.step_meta(step, record), StepFiles(self.repo.store, step, record))
        return self._chain_steps[step]

    def load(self, *, flat: bool = False) -> Any:
        """Every tensor of the step, read concurrently.

        Returns the state dict as it was saved (nested dicts and lists rebuilt, JSON leaves restored), or
        a flat ``{name: tensor}`` dict with ``flat=True``.
        """
        for m in self.meta.arrays.values():
            self._check_listed(m, (0,) * len(m.shape), m.shape)
        out = {n: _empty(m, m.shape) for n, m in self.meta.arrays.items()}
        self.load_into(out)
        return out if flat else names.unflatten(self.meta.tree, out)

    def load_into(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill existing contiguous CPU tensors in place (no fresh allocations), by flat name."""
        reqs = []
        for n, t in tensors.items():
            lt = self[n]
            if tuple(t.shape) != lt.meta.shape or t.dtype != lt.dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise InvalidArgumentError(f"destination for {n!r} must be a contiguous CPU {lt.dtype} tensor of shape "
                                           f"{list(lt.meta.shape)}, got {t.dtype} {list(t.shape)}", tensor=n)
            reqs.append(Request(lt.meta, (0,) * len(lt.meta.shape), lt.meta.shape, t))
        self._read(reqs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


def _empty(meta: ArrayMeta, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtypes.to_torch(meta.dtype))
    except (RuntimeError, MemoryError):  # the shape was checked against the spec's limits, not this machine's
        raise LimitExceededError(f"cannot allocate {math.prod(shape) * meta.itemsize} bytes for tensor {meta.name!r}",
                                 tensor=meta.name) from None


def open(path: str | os.PathLike[str] | Store, step: int | None = None, *,  # noqa: A001
         storage_options: dict[str, Any] | None = None) -> Checkpoint:
    """Open a committed step (the latest when ``step`` is None) for lazy reading.

    Parameters
    ----------
    path
        A local directory or an fsspec URL.
    step
        The step to open; None opens the newest committed step.

    Raises
    ------
    CheckpointNotFoundError
        No repository there, no committed step, or not the step asked for.
    UCLError
        The step's commit record or metadata is invalid (the error's ``code`` says how).
    """
    repo = Repository.open(path, storage_options)
    if step is None:
        step = repo.latest()
        if step is None:
            raise CheckpointNotFoundError(f"{repo.url} has no committed step", file=repo.url)
    record = repo.commit_record(step)
    return Checkpoint(repo, step, record, repo.step_meta(step, record))


def load(path: str | os.PathLike[str] | Store, step: int | None = None, *,
         storage_options: dict[str, Any] | None = None, flat: bool = False) -> Any:
    """Read a whole step: the state dict as it was saved (see :meth:`Checkpoint.load`)."""
    with open(path, step, storage_options=storage_options) as ckpt:
        return ckpt.load(flat=flat)
