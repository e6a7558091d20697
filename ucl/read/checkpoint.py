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
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ucl.delta.chain import DEFAULT_MAX_CHAIN
from ucl.delta.gradients import replay_records
from ucl.errors import (
    ApproximateStepError,
    ApproximateWarning,
    CheckpointNotFoundError,
    DeltaChainError,
    InconsistentMetadataError,
    IntegrityError,
    InvalidArgumentError,
    MissingShardError,
    StepRemovedError,
    TensorNotFoundError,
    UCLError,
)
from ucl.format import metadata, structure
from ucl.format.metadata import ArrayMeta, CommitRecord, StepMeta, has_logical
from ucl.format.records import Composite
from ucl.format.repository import Repository
from ucl.format.structure import graft
from ucl.io import progress
from ucl.io.stores.base import Store
from ucl.layout import Layout, Mesh
from ucl.options import DEFAULT_READ, ReadOptions
from ucl.plan.copies import BoxCopy
from ucl.plan.layout_load import LogicalIndex
from ucl.plan.save import spec_for_meta
from ucl.read import mapped
from ucl.read.boxes import read
from ucl.read.chain import ChainReader
from ucl.read.chunks import Request
from ucl.read.files import StepFiles, step_files
from ucl.read.tensors import LazyTensor, LogicalTensor, ReplayedTensor, alloc

metadata.load_checks()  # the schema predicates with the read path's code, not in the first open


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
                 approximate: bool = False, options: ReadOptions = DEFAULT_READ, _depth: int = 0) -> None:
        self.repo = repo
        self.step = step
        self.record = record
        self.meta = meta
        self.options = options
        self._files = step_files(repo.store, step, record, options, format_version=meta.format_version)
        self._pool: ThreadPoolExecutor | None = None
        self._checks: ThreadPoolExecutor | None = None  # a bulk read's check threads (ucl.read.boxes.Handoff)
        self._chain_steps: dict[int, tuple[StepMeta, StepFiles]] = {step: (meta, self._files)}
        self._chain: Any = None
        self._lock = threading.Lock()
        self._index: Any = None
        self.layout_step = meta.layout is not None or has_logical(meta.arrays)
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
            return list(self.logical_index().tensors)
        if self.records is not None:
            return list(self._tree_names())
        return list(self.meta.arrays)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        if self.records is not None:
            return len(self._tree_names())
        return len(self.logical_index().tensors) if self.layout_step else len(self.meta.arrays)

    def __contains__(self, name: object) -> bool:
        if self.layout_step:
            return name in self.logical_index().tensors
        if self.records is not None:
            return name in self._tree_names()
        return name in self.meta.arrays

    def __getitem__(self, name: str) -> LazyTensor:
        """The tensor ``name``: a :class:`LazyTensor` of its stored array or, for a logical tensor of a
        layout step stored otherwise (blocks, fused parts, flat fragments, partial sums), a
        :class:`LogicalTensor`."""
        if self.layout_step:
            info = self.logical_index().tensors.get(name)
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

            structure.unflatten(self.meta.tree, _Names())
            assert self.records is not None
            replayed = self.records.replayed(order)
            self._names = {n: n in replayed for n in order}
        return self._names

    def _parent_ckpt(self) -> Checkpoint:

        assert self.records is not None
        with self._lock:
            if self._parent is None:
                if self._depth >= DEFAULT_MAX_CHAIN:
                    raise DeltaChainError(f"step {self.step}: more than {DEFAULT_MAX_CHAIN} gradient-record steps "
                                          "in a row to replay")
                base = self.records.base_step
                record = self.repo.commit_record(base)
                self._parent = Checkpoint(self.repo, base, record, self.repo.step_meta(base, record),
                                          approximate=self.approximate, options=self.options,
                                          _depth=self._depth + 1)
            return self._parent

    def replayed(self) -> dict[str, torch.Tensor]:
        """Replay the recorded optimizer step once; the parameters and optimizer state it defines."""

        rec = self.records
        assert rec is not None
        if self._replay is None:
            parent = self._parent_ckpt()
            with self._replay_lock:  # not self._lock: reading the gradients may take that one
                if self._replay is None:
                    tensors = parent.load(flat=True)
                    state = structure.unflatten(parent.meta.tree, tensors)
                    grads = {n: self.array(rec.gradient_name(n)).read() for n in rec.parameters
                             if rec.gradient_name(n) in self.meta.arrays}
                    out, mismatches = replay_records(rec, state, tensors, grads, approximate=self.approximate,
                                                     what=f"step {self.step}")
                    missing = sorted(n for n, r in self._tree_names().items() if r and n not in out)
                    if missing:

                        raise InconsistentMetadataError(f"step {self.step}: the replay does not define tensor "
                                                        f"{missing[0]!r}", tensor=missing[0])
                    self._replay = (out, mismatches)
                    parent.close()
        return self._replay[0]

    @property
    def composite(self) -> Composite | None:
        """A composite step's marker (spec/delta.md §9): its stale groups, each with the step its values
        come from and their age; None for a step that stores every tensor."""
        return self.meta.composite

    @property
    def exact(self) -> bool:
        """False for a composite step (some groups hold an older step's values, spec/delta.md §9), and
        for a gradient-record step replayed (with ``approximate=True``) under an optimizer fingerprint
        that differs from the recorded one, or whose parent is such a step."""
        if self.meta.composite is not None:
            return False
        if self.records is None:
            return True
        self.replayed()
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

        return Layout.from_dict(self.meta.layout)

    @property
    def mesh(self) -> Any:
        """The source mesh (a :class:`ucl.layout.Mesh`), or None."""
        if self.meta.mesh is None:
            return None

        return Mesh.from_dict(self.meta.mesh)

    def logical_index(self) -> Any:
        """The step's :class:`ucl.plan.LogicalIndex` (built once)."""
        if self._index is None:

            with self._lock:
                if self._index is None:
                    self._index = LogicalIndex({n: spec_for_meta(m) for n, m in self.meta.arrays.items()})
        return self._index

    @property
    def kind(self) -> str:
        return self.meta.kind

    @property
    def files(self) -> StepFiles:
        """The step's files as the readers see them (index cache, byte reader, bytes read)."""
        return self._files

    @property
    def bytes_read(self) -> int:
        """Bytes read from storage so far (indexes and chunks, in every step of a delta chain)."""
        return sum(f.bytes_read for _, f in self._chain_steps.values())

    def __repr__(self) -> str:
        return f"Checkpoint({self.repo.url!r}, step={self.step}, tensors={len(self)})"

    # -- reading -----------------------------------------------------------------------------------
    def check_listed(self, meta: ArrayMeta, start: tuple[int, ...], shape: tuple[int, ...]) -> None:
        """Every shard a box needs is in the commit record, and the array's entry says what its document
        says: checked before anything is allocated (spec §8.4, §5.1)."""
        self._files.confirm(meta)
        if meta.delta is not None or not all(shape):
            return
        ranges = [range(a // c, -(-(a + n) // c)) for a, n, c in zip(start, shape, meta.chunk_shape, strict=True)]
        if math.prod(len(r) for r in ranges) > len(self.record.files):
            raise MissingShardError(f"tensor {meta.name!r} needs {math.prod(len(r) for r in ranges)} shards; the "
                                    f"commit record of step {self.step} lists {len(self.record.files)} files",
                                    tensor=meta.name, file=meta.key)
        for coords in itertools.product(*ranges):
            self._files.shard(meta, coords)

    def _unless_removed(self, e: UCLError) -> None:
        """Raise ``step_removed`` instead of ``e`` (a missing or corrupt file, a chain that no longer
        resolves) when a step this read uses was deleted or rewritten since it was opened."""
        if isinstance(e, StepRemovedError) or not isinstance(e, IntegrityError | DeltaChainError |
                                                                CheckpointNotFoundError):
            return
        for files in [f for _, f in list(self._chain_steps.values())]:
            gone = files.removed(f"[{e.code}] {e.message}")
            if gone is not None:
                gone.tensor = e.tensor
                raise gone from e

    def mapped_rows(self, meta: ArrayMeta, start: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor | None:
        """A box of whole rows as mapped, checked page-cache pages (:mod:`ucl.read.mapped`), or None:
        read it with :meth:`read_requests`."""
        if not self.options.map_slices:
            return None
        try:
            return mapped.rows(self._files, meta, start, shape)
        except UCLError as e:
            self._unless_removed(e)
            raise

    def read_requests(self, requests: list[Request], *, direct: bool = False) -> None:
        """Fill each request's ``out`` (a box of a stored array) from the step: plain arrays through
        :func:`ucl.read.boxes.read`, delta-encoded ones through the step's chain, as one pipeline.
        ``direct``: a bulk read (load, load_into), whose cold ranges may bypass the page cache; a lazy
        read (the default) goes through it."""
        try:
            self._read_requests(requests, direct)
        except UCLError as e:
            self._unless_removed(e)
            raise

    def _read_requests(self, requests: list[Request], direct: bool) -> None:
        plain = [r for r in requests if r.meta.delta is None]
        chained = [r for r in requests if r.meta.delta is not None]
        if self._pool is None and sum(_covered_bytes(r) for r in plain) > 8 << 20:
            with self._lock:  # zarr views read from several threads at once
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.options.threads, thread_name_prefix="ucl-read")
                if self._checks is None and self.options.check_threads > 0:  # a bulk read's (boxes.Handoff)
                    self._checks = ThreadPoolExecutor(self.options.check_threads, thread_name_prefix="ucl-check")
        if plain:
            read(self._files, plain, self._pool, self.options, direct=direct,
                 checks=self._checks if direct else None)
        if chained:  # delta-encoded tensors: through the step's chain (spec/delta.md §6.3), as one pipeline
            self._chain_reader().read_many(chained)

    def _chain_reader(self) -> Any:
        with self._lock:
            if self._chain is None:

                self._chain = ChainReader(self.step, self._step_source, options=self.options)
            return self._chain

    def _step_source(self, step: int) -> tuple[StepMeta, StepFiles]:
        if step not in self._chain_steps:
            record = self.repo.commit_record(step)
            meta = self.repo.step_meta(step, record)
            files = step_files(self.repo.store, step, record, self.options, format_version=meta.format_version)
            self._chain_steps[step] = (meta, files)
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
            info = self.logical_index().tensors
            out = {n: alloc(n, d, s) for n, (s, d) in info.items()}
        elif self.records is not None:
            replayed = self.replayed()  # cached for later reads: the caller gets copies it may modify
            out = {n: (replayed[n].clone() if n in replayed
                       else alloc(n, self.meta.arrays[n].dtype, self.meta.arrays[n].shape))
                   for n in self._tree_names()}
            self.load_into({n: t for n, t in out.items() if n not in replayed})
            return out if flat else structure.unflatten(self.meta.tree, out)
        else:
            for m in self.meta.arrays.values():
                self.check_listed(m, (0,) * len(m.shape), m.shape)
            out = {n: alloc(n, m.dtype, m.shape) for n, m in self.meta.arrays.items()}
        self.load_into(out)
        if flat:
            return out
        if self.layout_step:  # its tree holds JSON values; tensors go where the "/" of their names say

            return structure.unflatten(graft(self.meta.tree, list(out)), out)
        return structure.unflatten(self.meta.tree, out)

    def load_into(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill existing contiguous CPU tensors in place (no fresh allocations), by flat (logical) name."""
        reqs = []
        ops: list[BoxCopy] = []
        for n, t in tensors.items():
            lt = self[n]
            if (tuple(t.shape) != tuple(lt.shape) or t.dtype != lt.dtype or not t.is_contiguous()
                    or t.device.type != "cpu"):
                raise InvalidArgumentError(f"destination for {n!r} must be a contiguous CPU {lt.dtype} tensor of shape "
                                           f"{list(lt.shape)}, got {t.dtype} {list(t.shape)}", tensor=n)
            if isinstance(lt, ReplayedTensor):
                lt.read(t)
            elif lt.meta is not None:
                reqs.append(Request(lt.meta, (0,) * len(lt.meta.shape), lt.meta.shape, t))
            elif t.numel():
                full = ((0,) * t.dim(), tuple(t.shape))
                arrays = self.meta.arrays
                ops += [BoxCopy(arrays[a], sbox, t, None, rbox, k > 0)
                        for a, sbox, rbox, k in self.logical_index().read_parts(n, full, sum_partial=True)]
        # a bar of the bytes read for a large load on a terminal (ucl.io.progress polls bytes_read)
        with progress.watch(sum(t.nbytes for t in tensors.values()), "load", lambda: self.bytes_read):
            if reqs:
                self.read_requests(reqs, direct=True)
            if ops:
                self.fill(ops, direct=True)

    def fill(self, ops: list[BoxCopy], buffer_bytes: int | None = None, *, direct: bool = False) -> None:
        """Copy stored boxes into destination boxes (spec/layout.md copy rule: row-major order to row-major
        order), read concurrently in batches. A box that is one contiguous run of its destination is read
        straight into it; others (and partial sums) go through a temporary. Each batch holds at most
        ``buffer_bytes`` (default ``options.fill_buffer_bytes``) of temporaries and estimated decode scratch; larger
        boxes are split. Ops are applied in order (a partial sum's contribution 0 before the others)."""
        try:
            self._fill(ops, buffer_bytes, direct)
        except UCLError as e:
            self._unless_removed(e)
            raise

    def _fill(self, ops: list[BoxCopy], buffer_bytes: int | None, direct: bool) -> None:
        budget = self.options.fill_buffer_bytes if buffer_bytes is None else max(1, buffer_bytes)
        batch: list[Request] = []
        post: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        cost = 0
        # inner chunks of 1-D stored boxes (flat buffers) already in the batch: a chunk that several ops
        # need is read once (read/boxes.py), so its scratch counts once, and such ops share a batch
        shared: set[tuple[str, int]] = set()

        def flush() -> None:
            nonlocal cost
            if batch:
                self.read_requests(batch, direct=direct)
            with torch.no_grad():
                for dst, tmp, add in post:
                    src = tmp.view(dst.shape)
                    if add:
                        dst.add_(src.to(dst.device))
                    else:
                        dst.copy_(src)
            batch.clear()
            post.clear()
            shared.clear()
            cost = 0

        for op in ops:
            for sub in op.split(budget):
                dst = sub.destination()
                direct = sub.direct
                c = sub.cost()
                chunks = sub.touched() if c else None
                if chunks is not None:
                    new = [k for k in chunks if (sub.meta.name, k) not in shared]
                    c = (0 if direct else sub.nbytes) + (sub.scratch_bytes() * len(new) // len(chunks))
                if batch and cost + c > budget:
                    flush()
                    if chunks is not None:  # a new batch: every chunk of this op is its own again
                        c = sub.cost()
                if chunks is not None:
                    shared.update((sub.meta.name, k) for k in chunks)
                cost += c
                if direct:
                    batch.append(Request(sub.meta, sub.start, sub.shape, dst.view(sub.shape)))
                else:
                    tmp = alloc(sub.meta.name, sub.meta.dtype, sub.shape)
                    batch.append(Request(sub.meta, sub.start, sub.shape, tmp))
                    post.append((dst, tmp, sub.add))
        flush()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._checks is not None:
            self._checks.shutdown(wait=True)
            self._checks = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        for name in ("_pool", "_checks"):
            pool = getattr(self, name, None)
            if pool is not None:
                pool.shutdown(wait=False)


def open(path: str | os.PathLike[str] | Store, step: int | None = None, *,  # noqa: A001
         storage_options: dict[str, Any] | None = None, approximate: bool = False,
         options: ReadOptions = DEFAULT_READ) -> Checkpoint:
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
        failing with ``unknown_extension``. For a composite step (spec/delta.md §9, some groups hold an
        older step's values): open it (an ``ApproximateWarning`` naming the stale groups and their ages;
        ``Checkpoint.exact`` is False, ``Checkpoint.composite`` lists them) instead of failing with
        ``ApproximateStepError`` (``unknown_extension``).
    options
        How to read (:class:`ucl.options.ReadOptions`: threads, O_DIRECT, buffer bounds); never what.

    Raises
    ------
    CheckpointNotFoundError
        No repository there, no committed step, or not the step asked for.
    UCLError
        The step's commit record or metadata is invalid (the error's ``code`` says how).
    """
    repo = Repository.open(path, storage_options)
    if step is None:
        found = repo.latest_record()
        if found is None:
            raise CheckpointNotFoundError(f"{repo.url} has no committed step", file=repo.url)
        step, record = found
    else:
        record = repo.commit_record(step)
    meta = repo.step_meta(step, record, lazy=True)
    composite_gate(meta, approximate, repo.url)
    return Checkpoint(repo, step, record, meta, approximate=approximate, options=options)


def composite_gate(meta: StepMeta, approximate: bool, where: str) -> None:
    """Refuse a composite step unless ``approximate``; with it, warn naming what is stale
    (spec/delta.md §9.3: a reader MUST NOT present a composite step as the state at its step)."""
    comp = meta.composite
    if comp is None:
        return
    n, total = len(comp.stale), comp.groups
    plural = "s" if total != 1 else ""
    what = (f"step {meta.step} of {where} is a composite step: {n} of {total} group{plural} "
            f"hold older steps' values ({comp.describe()})")
    if not approximate:
        raise ApproximateStepError(f"{what}; it is not the state at step {meta.step} (open with "
                                   f"approximate=True "
                                   "to load it anyway)", file=where)
    warnings.warn(f"{what}: loaded approximately", ApproximateWarning, stacklevel=3)


def _covered_bytes(r: Request) -> int:
    """The bytes of the inner chunks a request's box touches: at most what it reads. A few rows of a large
    tensor touch one or two chunks and are read on the caller's thread (starting the read threads costs
    a fresh process ~2 ms each); a column of it touches every chunk."""
    n = r.meta.itemsize
    for a, k, i in zip(r.start, r.shape, r.meta.inner_chunk_shape, strict=True):
        n *= (-(-(a + k) // i) - a // i) * i
    return n
