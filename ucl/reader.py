"""Opening a committed step and reading it lazily: ``ucl.open(path)[name][rows]``.

A step saved under a layout (spec/layout.md) stores what the ranks held; its tensors as this module
presents them are the *logical* tensors (the whole parameter, optimizer state, ...), rebuilt on demand
from the stored boxes that hold them (:class:`LogicalTensor`). ``Checkpoint.array(name)`` reads a stored
array as it is.
"""

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
FILL_BUFFER_BYTES = 64 << 20  # temporaries + decode scratch of one batch of box reads (the memory bound)


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
            return _alloc(self.name, self._spec_dtype, shape)
        if tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise InvalidArgumentError(f"out must be a contiguous CPU {self.dtype} tensor of shape {list(shape)}",
                                       tensor=self.name)
        return out

    def read_box(self, start: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, start + shape)`` as a tensor of ``shape``."""
        start, shape = tuple(start), tuple(shape)
        self._check_bounds(start, shape)
        self._ckpt._check_listed(self.meta, start, shape)
        out = self._out(shape, out)
        self._ckpt._read([Request(self.meta, start, shape, out)])
        return out

    def __getitem__(self, key: Any) -> torch.Tensor:
        start, shape, post = _normalize_index(key, self._shape, self.name)
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
        parts = self._ckpt._logical().read_parts(self.name, (start, shape), sum_partial=True)
        arrays = self._ckpt.meta.arrays
        self._ckpt._fill([_Op(arrays[a], sbox, out, None, rbox, k > 0) for a, sbox, rbox, k in parts])
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
        src = self._ckpt._replayed()[self.name]
        out.copy_(src[tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))])
        return out


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

    def __init__(self, repo: Repository, step: int, record: CommitRecord, meta: StepMeta, *,
                 approximate: bool = False, _depth: int = 0) -> None:
        self.repo = repo
        self.step = step
        self.record = record
        self.meta = meta
        self._files = StepFiles(repo.store, step, record)
        self._pool: ThreadPoolExecutor | None = None
        self._chain_steps: dict[int, tuple[StepMeta, StepFiles]] = {step: (meta, self._files)}
        self._chain: Any = None
        self._lock = threading.Lock()
        self._index: Any = None
        self.layout_step = meta.layout is not None or any(a.logical for a in meta.arrays.values())
        self.approximate = approximate
        self.records = meta.gradient_records  # ucl.delta.GradientRecords of a gradient-record step, or None
        self._depth = _depth
        self._names: dict[str, bool] | None = None  # a gradient-record step's tensors: replayed?
        self._replay: tuple[dict[str, torch.Tensor], list[str]] | None = None
        self._parent: Checkpoint | None = None
        self._replay_lock = threading.Lock()

    # -- mapping-like ------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Tensor names: in the order they were saved; for a step saved under a layout, the logical
        tensors (sorted by name)."""
        if self.layout_step:
            return list(self._logical().tensors)
        if self.records is not None:
            return list(self._tree_names())
        return list(self.meta.arrays)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        if self.records is not None:
            return len(self._tree_names())
        return len(self._logical().tensors) if self.layout_step else len(self.meta.arrays)

    def __contains__(self, name: object) -> bool:
        if self.layout_step:
            return name in self._logical().tensors
        if self.records is not None:
            return name in self._tree_names()
        return name in self.meta.arrays

    def __getitem__(self, name: str) -> LazyTensor:
        """The tensor ``name``: a :class:`LazyTensor` of its stored array or, for a logical tensor of a
        layout step stored otherwise (blocks, fused parts, flat fragments, partial sums), a
        :class:`LogicalTensor`."""
        if self.layout_step:
            info = self._logical().tensors.get(name)
            if info is None:
                raise TensorNotFoundError(f"step {self.step} has no tensor {name!r}", tensor=name)
            meta = self.meta.arrays.get(name)
            if meta is not None and not meta.logical:
                return LazyTensor(self, meta)
            return LogicalTensor(self, name, info[0], info[1])
        if self.records is not None:
            if name not in self._tree_names():
                raise TensorNotFoundError(f"step {self.step} has no tensor {name!r}", tensor=name)
            if self._tree_names()[name]:
                base = self._parent_ckpt()[name]
                return ReplayedTensor(self, name, tuple(base.shape), base._spec_dtype)
        meta = self.meta.arrays.get(name)
        if meta is None:
            raise TensorNotFoundError(f"step {self.step} has no tensor {name!r}", tensor=name)
        return LazyTensor(self, meta)

    # -- gradient records (spec/delta.md §8) ---------------------------------------------------------
    def _tree_names(self) -> dict[str, bool]:
        """A gradient-record step's tensors in saved order, each with whether the replay defines it."""
        if self._names is None:
            order: list[str] = []

            class _Names(dict):  # type: ignore[type-arg]
                def __getitem__(self, k: str) -> None:
                    order.append(k)

            names.unflatten(self.meta.tree, _Names())
            assert self.records is not None
            replayed = self.records.replayed(order)
            self._names = {n: n in replayed for n in order}
        return self._names

    def _parent_ckpt(self) -> Checkpoint:
        from ucl.delta.chain import DEFAULT_MAX_CHAIN
        from ucl.errors import DeltaChainError

        assert self.records is not None
        with self._lock:
            if self._parent is None:
                if self._depth >= DEFAULT_MAX_CHAIN:
                    raise DeltaChainError(f"step {self.step}: more than {DEFAULT_MAX_CHAIN} gradient-record steps "
                                          "in a row to replay")
                base = self.records.base_step
                record = self.repo.commit_record(base)
                self._parent = Checkpoint(self.repo, base, record, self.repo.step_meta(base, record),
                                          approximate=self.approximate, _depth=self._depth + 1)
            return self._parent

    def _replayed(self) -> dict[str, torch.Tensor]:
        """Replay the recorded optimizer step once; the parameters and optimizer state it defines."""
        from ucl.delta.gradients import replay_records

        rec = self.records
        assert rec is not None
        if self._replay is None:
            parent = self._parent_ckpt()
            with self._replay_lock:  # not self._lock: reading the gradients may take that one
                if self._replay is None:
                    tensors = parent.load(flat=True)
                    state = names.unflatten(parent.meta.tree, tensors)
                    grads = {n: self.array(rec.gradient_name(n)).read() for n in rec.parameters
                             if rec.gradient_name(n) in self.meta.arrays}
                    out, mismatches = replay_records(rec, state, tensors, grads, approximate=self.approximate,
                                                     what=f"step {self.step}")
                    missing = sorted(n for n, r in self._tree_names().items() if r and n not in out)
                    if missing:
                        from ucl.errors import InconsistentMetadataError

                        raise InconsistentMetadataError(f"step {self.step}: the replay does not define tensor "
                                                        f"{missing[0]!r}", tensor=missing[0])
                    self._replay = (out, mismatches)
                    parent.close()
        return self._replay[0]

    @property
    def exact(self) -> bool:
        """False only for a gradient-record step replayed (with ``approximate=True``) under an optimizer
        fingerprint that differs from the recorded one, or whose parent is such a step."""
        if self.records is None:
            return True
        self._replayed()
        assert self._replay is not None and self._parent is not None
        return not self._replay[1] and self._parent.exact

    def array(self, name: str) -> LazyTensor:
        """The stored array ``name`` as it is (for a layout step: what the ranks wrote, e.g. the flat
        buffer ``optim/flat/exp_avg.pp0``, or a fused tensor's blocks in rank order)."""
        meta = self.meta.arrays.get(name)
        if meta is None:
            raise TensorNotFoundError(f"step {self.step} has no array {name!r}", tensor=name)
        return LazyTensor(self, meta)

    @property
    def layout(self) -> Any:
        """The source layout (a :class:`ucl.layout.Layout`) the step was saved under, or None."""
        if self.meta.layout is None:
            return None
        from ucl.layout import Layout

        return Layout.from_dict(self.meta.layout)

    @property
    def mesh(self) -> Any:
        """The source mesh (a :class:`ucl.layout.Mesh`), or None."""
        if self.meta.mesh is None:
            return None
        from ucl.layout import Mesh

        return Mesh.from_dict(self.meta.mesh)

    def _logical(self) -> Any:
        """The step's :class:`ucl.layout.LogicalIndex` (built once)."""
        if self._index is None:
            from ucl.layout import LogicalIndex
            from ucl.saveplan import spec_for_meta

            with self._lock:
                if self._index is None:
                    self._index = LogicalIndex({n: spec_for_meta(m) for n, m in self.meta.arrays.items()})
        return self._index

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
        if chained:  # delta-encoded tensors: through the step's chain (spec/delta.md §6.3), as one pipeline
            self._chain_reader().read_many(chained)

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
        a flat ``{name: tensor}`` dict with ``flat=True``. For a step saved under a layout: the logical
        state, i.e. every logical tensor whole at the place its name says ("model/layers.3.w" is
        ``state["model"]["layers.3.w"]``) beside the JSON values of the coordinator's (rank 0's) state;
        ranks' local tensors such as flat optimizer buffers do not appear (their members do).
        """
        if self.layout_step:
            info = self._logical().tensors
            out = {n: _alloc(n, d, s) for n, (s, d) in info.items()}
        elif self.records is not None:
            replayed = self._replayed()  # cached for later reads: the caller gets copies it may modify
            out = {n: (replayed[n].clone() if n in replayed else _empty(self.meta.arrays[n], self.meta.arrays[n].shape))
                   for n in self._tree_names()}
            self.load_into({n: t for n, t in out.items() if n not in replayed})
            return out if flat else names.unflatten(self.meta.tree, out)
        else:
            for m in self.meta.arrays.values():
                self._check_listed(m, (0,) * len(m.shape), m.shape)
            out = {n: _empty(m, m.shape) for n, m in self.meta.arrays.items()}
        self.load_into(out)
        if flat:
            return out
        if self.layout_step:  # its tree holds JSON values; tensors go where the "/" of their names say
            from ucl.saveplan import graft

            return names.unflatten(graft(self.meta.tree, list(out)), out)
        return names.unflatten(self.meta.tree, out)

    def load_into(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill existing contiguous CPU tensors in place (no fresh allocations), by flat (logical) name."""
        reqs = []
        ops: list[_Op] = []
        for n, t in tensors.items():
            lt = self[n]
            if tuple(t.shape) != tuple(lt.shape) or t.dtype != lt.dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise InvalidArgumentError(f"destination for {n!r} must be a contiguous CPU {lt.dtype} tensor of shape "
                                           f"{list(lt.shape)}, got {t.dtype} {list(t.shape)}", tensor=n)
            if isinstance(lt, ReplayedTensor):
                lt.read(t)
            elif lt.meta is not None:
                reqs.append(Request(lt.meta, (0,) * len(lt.meta.shape), lt.meta.shape, t))
            elif t.numel():
                full = ((0,) * t.dim(), tuple(t.shape))
                arrays = self.meta.arrays
                ops += [_Op(arrays[a], sbox, t, None, rbox, k > 0)
                        for a, sbox, rbox, k in self._logical().read_parts(n, full, sum_partial=True)]
        if reqs:
            self._read(reqs)
        if ops:
            self._fill(ops)

    def _fill(self, ops: list[_Op], buffer_bytes: int | None = None) -> None:
        """Copy stored boxes into destination boxes (spec/layout.md copy rule: row-major order to row-major
        order), read concurrently in batches. A box that is one contiguous run of its destination is read
        straight into it; others (and partial sums) go through a temporary. Each batch holds at most
        ``buffer_bytes`` (default FILL_BUFFER_BYTES) of temporaries and estimated decode scratch; larger
        boxes are split. Ops are applied in order (a partial sum's contribution 0 before the others)."""
        budget = FILL_BUFFER_BYTES if buffer_bytes is None else max(1, buffer_bytes)
        batch: list[Request] = []
        post: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        cost = 0

        def flush() -> None:
            nonlocal cost
            if batch:
                self._read(batch)
            with torch.no_grad():
                for dst, tmp, add in post:
                    src = tmp.view(dst.shape)
                    if add:
                        dst.add_(src.to(dst.device))
                    else:
                        dst.copy_(src)
            batch.clear()
            post.clear()
            cost = 0

        for op in ops:
            for sub in op.split(budget):
                dst = sub.destination()
                direct = sub.direct
                c = sub.cost()
                if batch and cost + c > budget:
                    flush()
                cost += c
                if direct:
                    batch.append(Request(sub.meta, sub.start, sub.shape, dst.view(sub.shape)))
                else:
                    tmp = _alloc(sub.meta.name, sub.meta.dtype, sub.shape)
                    batch.append(Request(sub.meta, sub.start, sub.shape, tmp))
                    post.append((dst, tmp, sub.add))
        flush()

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
    return _alloc(meta.name, meta.dtype, shape)


def _alloc(name: str, dtype: str, shape: tuple[int, ...], zero: bool = False) -> torch.Tensor:
    try:
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtypes.to_torch(dtype))
    except (RuntimeError, MemoryError):  # the shape was checked against the spec's limits, not this machine's
        n = math.prod(shape) * dtypes.itemsize(dtype)
        raise LimitExceededError(f"cannot allocate {n} bytes for tensor "
                                 f"{name!r}", tensor=name) from None


Box = tuple[tuple[int, ...], tuple[int, ...]]
View = tuple[int, tuple[int, ...]]  # (element offset, shape) of a row-major view of a flat tensor


class _Op:
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

    def split(self, budget: int) -> list[_Op]:
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
        out: list[_Op] = []
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
            sub = _Op(self.meta, (tuple(st), tuple(sh)), self.dest, self.view, box, self.add)
            out += sub.split(budget) if hi - lo > 1 and sub.cost() > budget else [sub]
        return out

    def _split_run(self, budget: int) -> list[_Op]:
        from ucl.layout.boxes import ravel

        out: list[_Op] = []
        per = max(1, budget // max(1, self.meta.itemsize * 2))
        for rel_start, shape in _row_major_pieces(self.box[1], per):
            first = ravel(self.box[1], rel_start)
            box = (tuple(a + b for a, b in zip(self.box[0], rel_start, strict=True)), shape)
            stored = ((self.start[0] + first,), (math.prod(shape),))
            out.append(_Op(self.meta, stored, self.dest, self.view, box, self.add))
        return out


def _row_major_pieces(shape: tuple[int, ...], limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
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
        for rs, rn in _row_major_pieces(shape[1:], limit):
            out.append(((a, *rs), (1, *rn)))
    return out


def open(path: str | os.PathLike[str] | Store, step: int | None = None, *,  # noqa: A001
         storage_options: dict[str, Any] | None = None, approximate: bool = False) -> Checkpoint:
    """Open a committed step (the latest when ``step`` is None) for lazy reading.

    Parameters
    ----------
    path
        A local directory or an fsspec URL.
    step
        The step to open; None opens the newest committed step.
    approximate
        For a gradient-record step (spec/delta.md §8) whose optimizer fingerprint differs from this
        environment: replay it anyway (a ``ReplayWarning``; ``Checkpoint.exact`` is False) instead of
        failing with ``unknown_extension``.

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
    return Checkpoint(repo, step, record, repo.step_meta(step, record), approximate=approximate)


def load(path: str | os.PathLike[str] | Store, step: int | None = None, *,
         storage_options: dict[str, Any] | None = None, flat: bool = False, approximate: bool = False) -> Any:
    """Read a whole step: the state dict as it was saved (see :meth:`Checkpoint.load`)."""
    with open(path, step, storage_options=storage_options, approximate=approximate) as ckpt:
        return ckpt.load(flat=flat)
