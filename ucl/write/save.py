"""Saving from one process: :func:`save` (one state) and :func:`save_sharded` (every rank's state).

Both plan every shard before writing a byte, then write through :class:`ucl.write.step.StepWriter`; the
step is the one a :class:`ucl.CheckpointManager` save of the same state writes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ucl.errors import InvalidArgumentError, MeshMismatchError
from ucl.format import structure
from ucl.format.metadata import CommitRecord, StepMeta
from ucl.format.repository import Repository
from ucl.io.stores import Store
from ucl.layout import as_layout, as_mesh
from ucl.options import DEFAULT_WRITE, WriteOptions
from ucl.plan import save as saveplan
from ucl.plan.layout_save import merge_plans
from ucl.plan.save import all_shards, array_for, shard_block
from ucl.write.step import StepWriter

__all__ = ["save", "save_sharded"]


def save(state: Mapping[str, Any], path: str | os.PathLike[str] | Store, step: int, *,
         storage_options: dict[str, Any] | None = None, compression: str | None = None,
         layout: Any = None, mesh: Any = None, rank: int = 0, options: WriteOptions = DEFAULT_WRITE) -> CommitRecord:
    """Write ``state`` as a committed full step (the synchronous reference writer).

    Parameters
    ----------
    state
        A state dict: tensors, possibly nested in dicts and lists (model and optimizer state together),
        with JSON-able leaves (numbers, strings) kept in the step's structure tree.
    path
        A local directory or an fsspec URL (``file://``, ``memory://``, ``s3://``); created if needed.
    step
        The step number; a committed step is never overwritten.
    storage_options
        Passed to fsspec for URLs.
    compression
        ``None`` (default: raw bytes + crc32c, fastest) or ``"zstd"``.
    layout, mesh, rank
        Save ``state`` as the local state of rank ``rank`` of a one-rank mesh under a layout
        (spec/layout.md): the step records the layout and its logical
        tensors (e.g. a padded vocabulary stored without its padding). For many ranks use
        :class:`ucl.CheckpointManager` on each, or :func:`save_sharded`.
    options
        How the step is laid out and committed (:class:`ucl.options.WriteOptions`: inner chunk size,
        commit concurrency); never the values.

    Returns
    -------
    CommitRecord
        The record of the committed step.

    Raises
    ------
    StepExistsError
        When ``step`` is already committed.
    WriterLockedError
        When another writer (a CheckpointManager, ``ucl gc``, ...) holds the repository.
    InvalidArgumentError, InvalidNameError, UnsupportedDTypeError
        When the state holds something ucl cannot store; nothing is written then.
    """
    if layout is not None:  # the local state of the one rank of a mesh
        lay = as_layout(layout)
        m = as_mesh(mesh, lay)
        if m.size != 1 or rank != 0:
            raise MeshMismatchError(
                f"ucl.save writes a step from one process: the mesh {m.to_text()} has {m.size} "
                "ranks (save from every rank with CheckpointManager, or pass every rank's state to "
                "ucl.save_sharded)"
            )
        return save_sharded([state], path, step, layout=lay, mesh=m, storage_options=storage_options,
                            compression=compression, options=options)
    if mesh is not None:
        raise InvalidArgumentError("mesh= needs a layout= to go with it")
    tensors, tree = structure.flatten(state)
    zstd = compression == "zstd"
    comp = {"name": "zstd", "configuration": {"level": 1, "checksum": False}} if zstd else None
    if compression not in (None, "zstd"):
        raise InvalidArgumentError(f"compression must be None or 'zstd', got {compression!r}")
    arrays = {n: array_for(n, t, compression=comp, inner_bytes=options.inner_chunk_bytes)  # all checks before any write
              for n, t in tensors.items()}
    repo = Repository.open(path, storage_options, create=True)
    with StepWriter(repo, step, commit_threads=options.commit_threads,
                    format_version=options.format_version) as w:
        w.begin()  # the writer lock, held until the commit
        blocks = ((arrays[name], coords, shard_block(arrays[name], coords, cpu))
                  for name, cpu in ((n, t.detach().to("cpu")) for n, t in tensors.items())
                  for coords in all_shards(arrays[name]))
        files = w.write_shards(blocks)
        return w.commit(StepMeta(step=step, kind="full", tree=tree, arrays=arrays), files)


# -- saving from one process ---------------------------------------------------------------------------
def save_sharded(
    states: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str] | Store,
    step: int,
    *,
    layout: Any,
    mesh: Any = None,
    storage_options: dict[str, Any] | None = None,
    compression: str | None = None,
    options: WriteOptions = DEFAULT_WRITE,
) -> CommitRecord:
    """Write one step from the local states of every rank of (layout, mesh), in one process (states[r] is
    rank r's): e.g. to convert per-rank checkpoints of a parallel job. The same step a distributed
    :class:`ucl.write.manager.CheckpointManager` save writes. Every check runs before any byte is written."""
    layout = as_layout(layout)
    mesh = as_mesh(mesh, layout, len(states))
    if compression not in (None, "zstd"):
        raise InvalidArgumentError(f"compression must be None or 'zstd', got {compression!r}")
    comp = {"name": "zstd", "configuration": {"level": 1, "checksum": False}} if compression else None
    flat = [structure.flatten(s) for s in states]
    local = [saveplan.local_shapes(t) for t, _ in flat]
    rank_plans = [saveplan.plan_rank(layout, mesh, r, local[r], local) for r in range(mesh.size)]
    merged = merge_plans(rank_plans)
    plans = [saveplan.from_layout(p, merged, comp, options.inner_chunk_bytes) for p in rank_plans]
    repo = Repository.open(path, storage_options, create=True)
    with StepWriter(repo, step, commit_threads=options.commit_threads,
                    format_version=options.format_version) as w:
        w.begin()  # the writer lock, held until the commit
        files = w.write_shards(((lw.array, lw.coords, saveplan.block_of(lw, tensors[lw.source].detach().to("cpu")))
                                  for (tensors, _), plan in zip(flat, plans, strict=True) for lw in plan.writes))
        tree = structure.graft(flat[0][1], [])  # the JSON values; readers place tensors by their names
        meta = StepMeta(step=step, kind="full", tree=tree, arrays=plans[0].arrays, layout=plans[0].layout,
                        mesh=plans[0].mesh)
        return w.commit(meta, files)
