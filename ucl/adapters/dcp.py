"""torch.distributed.checkpoint (DCP) storage over ucl: ``dcp.save``/``dcp.load`` read and write ucl steps.

>>> import torch.distributed.checkpoint as dcp
>>> dcp.save(state, storage_writer=ucl.adapters.dcp.Writer("ckpt", step=100))
>>> dcp.load(state, storage_reader=ucl.adapters.dcp.Reader("ckpt"))          # latest step, any sharding

What is stored is an ordinary ucl step (``ucl validate`` passes, ``ucl.open`` and tensorstore read it),
and no pickle is written, ever:

- **Tensors.** Each DCP write item is one box (offsets, lengths) of a global tensor, written by the rank
  that holds it. The tensor becomes one Zarr v3 array of the global shape whose chunk grid is the
  *common refinement* of the boxes: along each dimension the chunk length is the gcd of every box
  boundary (the tensor's end excepted). For torch.chunk-style sharding (DTensor ``Shard``,
  ShardedTensor with ``ChunkShardingSpec``, replicated tensors) that is exactly one shard file per box;
  irregular boxes (say rows 0-3 and 3-10) are split into several shards, each still written by the
  rank that owns the data, so no rank ever sends tensor data to another. A refinement finer than
  :data:`MAX_SHARDS_PER_TENSOR` shards is refused with :class:`~ucl.errors.InvalidArgumentError`.
- **Other values** (DCP's ``BYTES`` items, which its own writer pickles): JSON-able values (numbers,
  strings, bools, None, lists, tuples, dicts of those) go into the step's structure tree; anything else
  is refused with :class:`~ucl.errors.InvalidArgumentError` before any tensor is written.
- **Names.** A value at DCP object path ``("model", "layers.0.w")`` is stored as the tensor
  ``model/layers.0.w`` and the structure tree rebuilds the nesting, exactly as :func:`ucl.save` stores
  ``{"model": {"layers.0.w": t}}``. So ``ucl.load`` of a DCP-written step returns the nested state, and
  ``dcp.load`` reads steps written by :func:`ucl.save` and by the engine as well.

On load, DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` is built from the step's JSON
metadata (one DCP chunk per shard of the grid) and every read item, whatever box the target sharding
asks for, is served by reading only the inner chunks it overlaps, straight into the destination tensor
when that is a contiguous CPU tensor of the stored dtype.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ucl.errors import InvalidArgumentError, InvalidNameError, UCLError, WriteError
from ucl.format import dtypes, names, structure
from ucl.format.metadata import ArrayMeta, CommitRecord, StepMeta
from ucl.format.repository import Repository, check_step
from ucl.format.shardfile import choose_chunks
from ucl.options import DEFAULT_WRITE, WriteOptions
from ucl.read.checkpoint import Checkpoint
from ucl.read.checkpoint import open as open_step
from ucl.read.chunks import Request
from ucl.write.step import StepWriter

__all__ = ["MAX_SHARDS_PER_TENSOR", "Reader", "Writer", "chunk_grid"]

MAX_SHARDS_PER_TENSOR = 1 << 16
READ_BATCH_BYTES = 256 << 20  # bounce buffers for destinations that cannot be read into directly

ObjPath = tuple[str | int, ...]
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


# -- pure planning ---------------------------------------------------------------------------------
def chunk_grid(name: str, shape: Sequence[int], boxes: Iterable[Box]) -> tuple[int, ...]:
    """The chunk shape of the regular grid whose cells tile every box (the boxes' common refinement).

    Along each dimension the chunk length is the gcd of all box boundaries except the tensor's end, so
    torch.chunk-style boxes give one chunk per box. Empty boxes are ignored.

    Raises
    ------
    InvalidArgumentError
        When the boxes overlap, leave holes, or need more than :data:`MAX_SHARDS_PER_TENSOR` shards.
    """
    shape = tuple(int(s) for s in shape)
    boxes = [(tuple(map(int, o)), tuple(map(int, s))) for o, s in boxes]
    boxes = [(o, s) for o, s in boxes if all(s)]
    for o, s in boxes:
        if len(o) != len(shape) or len(s) != len(shape) or any(
                a < 0 or a + n > m for a, n, m in zip(o, s, shape, strict=True)):
            raise InvalidArgumentError(f"DCP chunk offsets={list(o)} sizes={list(s)} of tensor {name!r} lie outside "
                                       f"its shape {list(shape)}", tensor=name)
    chunk = []
    for d, n in enumerate(shape):
        g = 0
        for o, s in boxes:
            for b in (o[d], o[d] + s[d]):
                if b != n:
                    g = math.gcd(g, b)
        chunk.append(g if g else max(1, n))
    grid = [-(-n // c) if n else 0 for n, c in zip(shape, chunk, strict=True)]
    n_cells = math.prod(grid)
    if n_cells > MAX_SHARDS_PER_TENSOR:
        raise InvalidArgumentError(
            f"tensor {name!r} of shape {list(shape)} is sharded irregularly ({len(boxes)} DCP chunks); storing it "
            f"as a regular grid of chunk shape {chunk} would take {n_cells} shard files, more than "
            f"{MAX_SHARDS_PER_TENSOR}: shard it evenly (torch.chunk-style) or gather it first", tensor=name)
    seen: set[tuple[int, ...]] = set()
    for o, s in boxes:
        for cell in _cells(tuple(chunk), o, s):
            if cell in seen:
                raise InvalidArgumentError(f"DCP chunks of tensor {name!r} overlap at grid cell {list(cell)}",
                                           tensor=name)
            seen.add(cell)
    if len(seen) != n_cells:
        raise InvalidArgumentError(f"DCP chunks of tensor {name!r} cover {len(seen)} of the {n_cells} cells of its "
                                   f"grid (chunk shape {chunk}): the saved state has holes", tensor=name)
    return tuple(chunk)


def _cells(chunk: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    """Grid cells of a box aligned to the grid (its start and its end, unless it is the tensor's end)."""
    ranges = []
    for c, o, s in zip(chunk, offsets, sizes, strict=True):
        ranges.append(range(o // c, -(-(o + s) // c)))
    return itertools.product(*ranges)


def _name_of(path: ObjPath) -> str:
    return names.check_name("/".join(str(p) for p in path))


def tree_from_paths(leaves: Mapping[ObjPath, dict[str, Any]]) -> dict[str, Any]:
    """The structure tree of a state whose leaves (tree nodes) sit at DCP object paths.

    A ``str`` path element is a dict key and an ``int`` one a list index, as in DCP's ``set_element``;
    list positions that no path reaches hold None, as DCP leaves them.
    """
    root: dict[str | int, Any] = {}

    def child(container: dict[str | int, Any], key: str | int) -> dict[str | int, Any]:
        node = container.setdefault(key, {})
        if isinstance(node, _Leaf):
            raise InvalidNameError(f"DCP path element {key!r} is both a value and a container")
        return node  # type: ignore[no-any-return]

    for path, node in leaves.items():
        cur = root
        for k in path[:-1]:
            cur = child(cur, k)
        if path[-1] in cur:
            raise InvalidNameError(f"DCP path {'.'.join(map(str, path))!r} is both a value and a container")
        cur[path[-1]] = _Leaf(node)

    def build(container: dict[str | int, Any]) -> dict[str, Any]:
        keys = list(container)
        ints = [k for k in keys if type(k) is int]
        if keys and len(ints) == len(keys):
            out: list[dict[str, Any]] = [{"t": "value", "v": None}] * (max(ints) + 1)
            for i in ints:
                out[i] = conv(container[i])
            return {"t": "list", "items": out}
        if any(type(k) is int for k in keys):
            raise InvalidNameError(f"DCP paths mix list indices and dict keys under one container: {keys[:8]}")
        return {"t": "dict", "items": [[k, conv(v)] for k, v in container.items()]}

    def conv(v: Any) -> dict[str, Any]:
        return v.node if isinstance(v, _Leaf) else build(v)

    return build(root)


@dataclass(frozen=True)
class _Leaf:
    node: dict[str, Any]


def json_node(fqn: str, obj: Any) -> dict[str, Any]:
    """The structure-tree node of a non-tensor value, or InvalidArgumentError when it is not JSON-able."""
    try:
        tensors, node = structure.flatten({"v": obj})
    except UCLError as e:
        raise InvalidArgumentError(f"DCP value {fqn!r} cannot be stored: {e.message}. Use a tensor or a JSON-able "
                                   "value (numbers, strings, bools, None, lists, tuples, dicts)", tensor=fqn) from None
    if tensors:
        raise InvalidArgumentError(f"DCP value {fqn!r} is a {type(obj).__name__} holding tensors, which DCP would "
                                   "pickle; put the tensors in a dict or a list instead", tensor=fqn)
    return node["items"][0][1]  # type: ignore[no-any-return]


# -- the writer ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank (SavePlan.storage_data): the step and its arrays."""

    step: int
    arrays: dict[str, ArrayMeta]  # by DCP fqn, only those this rank writes


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that writes one committed ucl step.

    Call sequence (DCP makes the calls; who makes each):

    1. ``reset(checkpoint_id)`` (all ranks): ``checkpoint_id``, when given, replaces ``path``.
    2. ``set_up_storage_writer(is_coordinator)`` (all ranks).
    3. ``prepare_local_plan(plan)`` (all ranks): unchanged.
    4. ``prepare_global_plan(plans)`` (coordinator): chooses the step number and every tensor's chunk
       grid (:func:`chunk_grid`), names the arrays from the planners' object paths, and starts the step
       (``StepWriter.begin``: takes the writer lock, refuses a committed step, clears an uncommitted
       attempt). The ranks write only after this returns, so they write under the coordinator's lock.
    5. ``write_data(plan, planner)`` (all ranks): checks every non-tensor value is JSON-able, then writes
       the shard files of its boxes; returns their sizes and checksums.
    6. ``finish(metadata, results)`` (coordinator): writes the array and step documents and then,
       last and atomically, the commit record, and releases the lock. A save that fails before this
       commits nothing; the lock is released when the coordinator's own ``write_data`` fails, else (another
       rank failed: DCP calls no hook) by the next ``reset``, or when the writer is dropped or its process exits.

    Parameters
    ----------
    path
        Repository directory or fsspec URL (created if needed).
    step
        The step to write; None writes the step after the newest committed one (0 in a new repository).
    storage_options
        Passed to fsspec for URLs.
    compression
        None (raw bytes + crc32c) or ``"zstd"``.
    """

    def __init__(self, path: str | os.PathLike[str], step: int | None = None, *,
                 storage_options: dict[str, Any] | None = None, compression: str | None = None,
                 options: WriteOptions = DEFAULT_WRITE) -> None:
        super().__init__()
        self.options = options
        if compression not in (None, "zstd"):
            raise InvalidArgumentError(f"compression must be None or 'zstd', got {compression!r}")
        self.path = os.fspath(path)
        self.step = None if step is None else check_step(step)
        self.storage_options = storage_options
        self.compression = ({"name": "zstd", "configuration": {"level": 1, "checksum": False}}
                            if compression == "zstd" else None)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.record: CommitRecord | None = None
        self._step_writer: StepWriter | None = None
        self._arrays: dict[str, ArrayMeta] = {}
        self._paths: dict[str, ObjPath] = {}

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.record = None
        if self._step_writer is not None:  # an earlier save that failed before finish: its lock
            self._step_writer.release()
        self._step_writer = None
        self._arrays, self._paths = {}, {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        repo = Repository.open(self.path, self.storage_options, create=True)
        if self.step is None:
            latest = repo.latest()
            step = 0 if latest is None else latest + 1
        else:
            step = self.step
        # object paths: the planners' flattening maps (DefaultSavePlanner), else the fqn itself
        paths: dict[str, ObjPath] = {}
        for p in plans:
            if isinstance(p.planner_data, Mapping):
                for fqn, path in p.planner_data.items():
                    paths.setdefault(fqn, tuple(path))
        boxes: dict[str, list[Box]] = {}
        first: dict[str, WriteItem] = {}
        for p in plans:
            for item in p.items:
                fqn = item.index.fqn
                paths.setdefault(fqn, (fqn,))
                if item.type == WriteItemType.BYTE_IO:
                    continue
                td = item.tensor_data
                if td is None or td.chunk is None:
                    raise InvalidArgumentError(f"DCP write item for {fqn!r} has no tensor chunk", tensor=fqn)
                first.setdefault(fqn, item)
                boxes.setdefault(fqn, []).append((tuple(td.chunk.offsets), tuple(td.chunk.sizes)))
        arrays: dict[str, ArrayMeta] = {}
        taken: dict[str, str] = {}
        for fqn, item in first.items():
            td = item.tensor_data
            assert td is not None
            name = _name_of(paths[fqn])
            if name in taken:
                raise InvalidNameError(f"DCP values {taken[name]!r} and {fqn!r} would both be stored as {name!r}",
                                       tensor=name)
            taken[name] = fqn
            shape = tuple(int(s) for s in td.size)
            chunk = chunk_grid(fqn, shape, boxes[fqn])
            dtype = dtypes.from_torch(td.properties.dtype)
            chunk, inner = choose_chunks(shape, chunk, dtypes.itemsize(dtype), self.options.inner_chunk_bytes)
            arrays[fqn] = ArrayMeta(name=name, shape=shape, dtype=dtype, chunk_shape=chunk,
                                    inner_chunk_shape=inner, compression=self.compression)
        writer = StepWriter(repo, step, commit_threads=self.options.commit_threads)
        writer.begin()  # the writer lock, held by the coordinator until finish (or the next reset)
        self._step_writer, self._arrays, self._paths = writer, arrays, paths
        out = []
        for p in plans:
            mine = {i.index.fqn: arrays[i.index.fqn] for i in p.items if i.index.fqn in arrays}
            out.append(dataclasses.replace(p, storage_data=_RankPlan(step, mine)))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return self._write_data(plan, planner)
        except BaseException:
            if self._step_writer is not None:  # the coordinator failed: DCP will not call finish
                self._step_writer.release()
            raise

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rp: _RankPlan = plan.storage_data
        results: list[WriteResult] = []
        for item in plan.items:  # every value checked before any byte is written
            if item.type == WriteItemType.BYTE_IO:
                node = json_node(item.index.fqn, _lookup_object(planner, item))
                results.append(WriteResult(index=item.index, size_in_bytes=len(json.dumps(node)),
                                           storage_data={"node": node}))
        tensor_items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        if tensor_items:
            writer = StepWriter(Repository.open(self.path, self.storage_options), rp.step)
            # every item's shards written several at once (StepWriter.write_shards), each item's data
            # resolved and checked as its turn comes
            rels: list[list[str]] = []  # each item's files, in the order the items are written

            def blocks() -> Iterator[tuple[ArrayMeta, tuple[int, ...], torch.Tensor]]:
                for item in tensor_items:
                    meta = rp.arrays[item.index.fqn]
                    mine = _item_blocks(meta, item, planner.resolve_data(item))
                    rels.append([meta.shard_key(coords) for _, coords, _ in mine])
                    yield from mine

            written = writer.write_shards(blocks())
            for item, item_rels in zip(tensor_items, rels, strict=True):
                files = {rel: written[rel] for rel in item_rels}
                results.append(WriteResult(index=item.index, size_in_bytes=sum(s for s, _ in files.values()),
                                           storage_data={"files": files}))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._step_writer is None:
            raise WriteError("ucl.adapters.dcp.Writer.finish called before prepare_global_plan on the coordinator")
        try:
            self._finish(metadata, results)
        finally:
            self._step_writer.release()  # no-op once committed

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self._step_writer is not None
        files: dict[str, tuple[int, int]] = {}
        leaves: dict[ObjPath, dict[str, Any]] = {}
        for rank_results in results:
            for wr in rank_results:
                sd = wr.storage_data
                if "node" in sd:
                    leaves[self._paths.get(wr.index.fqn, (wr.index.fqn,))] = sd["node"]
                else:
                    files.update(sd["files"])
        for fqn, meta in self._arrays.items():
            leaves[self._paths[fqn]] = {"t": "tensor", "name": meta.name}
            for coords in itertools.product(*(range(g) for g in meta.grid)):
                if meta.shard_key(coords) not in files:
                    raise WriteError(f"no rank wrote shard {meta.shard_key(coords)} of tensor {fqn!r}; step "
                                     f"{self._step_writer.step} is not committed", tensor=fqn)
        order = {p: i for i, p in enumerate(self._paths.values())}
        tree = tree_from_paths(dict(sorted(leaves.items(), key=lambda kv: order.get(kv[0], len(order)))))
        fqns = sorted(self._arrays, key=lambda f: order.get(self._paths[f], len(order)))
        arrays = {self._arrays[f].name: self._arrays[f] for f in fqns}
        step_meta = StepMeta(step=self._step_writer.step, kind="full", tree=tree, arrays=arrays)
        self.record = self._step_writer.commit(step_meta, files)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)


def _lookup_object(planner: SavePlanner, item: WriteItem) -> Any:
    """The value of a BYTES item without pickling it (DefaultSavePlanner), else safely unpickled."""
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        return lookup(item.index)
    data = planner.resolve_data(item)  # a custom planner's bytes: read back with the weights-only unpickler
    try:
        return torch.load(data, weights_only=True)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 - any unpickling failure means: not a plain value
        raise InvalidArgumentError(f"DCP value {item.index.fqn!r} is not a plain value ({type(e).__name__}); ucl "
                                   "stores tensors and JSON-able values, never pickles",
                                   tensor=item.index.fqn) from None


def _item_blocks(meta: ArrayMeta, item: WriteItem, data: Any) -> list[tuple[ArrayMeta, tuple[int, ...], torch.Tensor]]:
    """The shards of one DCP box (array, shard coordinates, block): each grid cell of the box from the
    rank's own piece."""
    if not isinstance(data, torch.Tensor):
        raise InvalidArgumentError(f"the planner resolved DCP item {item.index.fqn!r} to a {type(data).__name__}, "
                                   "not a tensor", tensor=item.index.fqn)
    td = item.tensor_data
    assert td is not None
    offsets, sizes = tuple(td.chunk.offsets), tuple(td.chunk.sizes)
    t = data.detach()
    if tuple(t.shape) != sizes:
        raise InvalidArgumentError(f"DCP item {item.index.fqn!r}: data of shape {list(t.shape)} for a chunk of sizes "
                                   f"{list(sizes)}", tensor=item.index.fqn)
    if not all(sizes):
        return []
    if t.device.type != "cpu":
        t = t.to("cpu")
    out = []
    for coords in _cells(meta.chunk_shape, offsets, sizes):
        idx = tuple(slice(c * k - o, min((c + 1) * k, n) - o)
                    for c, k, n, o in zip(coords, meta.chunk_shape, meta.shape, offsets, strict=True))
        out.append((meta, coords, t[idx]))
    return out


# -- the reader ------------------------------------------------------------------------------------
class Reader(StorageReader):
    """A DCP ``StorageReader`` over a committed ucl step (written by this plugin, ``ucl.save`` or the engine).

    Call sequence (DCP makes the calls; who makes each):

    1. ``reset(checkpoint_id)`` (all ranks): ``checkpoint_id``, when given, replaces ``path``.
    2. ``read_metadata()`` (all ranks): opens the step and builds DCP's ``Metadata`` from its JSON
       metadata: one ``TensorStorageMetadata`` per tensor with one chunk per shard of its grid, one
       ``BytesStorageMetadata`` per non-tensor value; the keys are DCP's flattened names of the state
       that the step's structure tree rebuilds.
    3. ``set_up_storage_reader(metadata, is_coordinator)`` (all ranks).
    4. ``prepare_local_plan`` (all ranks) / ``prepare_global_plan`` (coordinator): unchanged.
    5. ``read_data(plan, planner)`` (all ranks): reads each item's box, only the inner chunks it
       overlaps, checksummed, into the destination in place where it can; then closes the step.

    Parameters
    ----------
    path
        Repository directory or fsspec URL.
    step
        The step to read; None reads the newest committed step.
    storage_options
        Passed to fsspec for URLs.
    """

    def __init__(self, path: str | os.PathLike[str], step: int | None = None, *,
                 storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.step = None if step is None else check_step(step)
        self.storage_options = storage_options
        self.load_id = uuid.uuid4().hex
        self._ckpt: Checkpoint | None = None
        self._names: dict[str, str] = {}  # fqn -> tensor name
        self._values: dict[str, Any] = {}  # fqn -> non-tensor value (may hold placeholder tensors)
        self._placeholders: dict[int, str] = {}

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.close()

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata: ucl has one step document
            raise InvalidArgumentError("ucl steps have no per-rank DCP metadata")
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        self.close()
        self._ckpt = ckpt = open_step(self.path, self.step, storage_options=self.storage_options)
        placeholders = {n: torch.empty(0, device="meta") for n in ckpt.meta.arrays}
        self._placeholders = {id(t): n for n, t in placeholders.items()}
        state = structure.unflatten(ckpt.meta.tree, placeholders)
        if not isinstance(state, dict):
            raise InvalidArgumentError(f"step {ckpt.step} holds a {type(state).__name__}, not a state dict")
        flat, mappings = flatten_state_dict(state)
        md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self._names, self._values = {}, {}
        for fqn, v in flat.items():
            name = self._placeholders.get(id(v)) if isinstance(v, torch.Tensor) else None
            if name is None:
                md[fqn] = BytesStorageMetadata()
                self._values[fqn] = v
                continue
            a = ckpt.meta.arrays[name]
            self._names[fqn] = name
            chunks = []
            for coords in itertools.product(*(range(g) for g in a.grid)):
                start = [c * k for c, k in zip(coords, a.chunk_shape, strict=True)]
                size = [min(k, n - s) for k, n, s in zip(a.chunk_shape, a.shape, start, strict=True)]
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(start), sizes=torch.Size(size)))
            md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=dtypes.to_torch(a.dtype)),
                                            size=torch.Size(a.shape), chunks=chunks)
        return Metadata(state_dict_metadata=md, planner_data=mappings, storage_data=dict(self._names),
                        storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._ckpt is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._ckpt is None:
            self.read_metadata()
        ckpt = self._ckpt
        assert ckpt is not None
        try:
            batch: list[tuple[ReadItem, Request, torch.Tensor | None]] = []
            bounce = 0
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, self._value_bytes(ckpt, item.storage_index.fqn))
                    continue
                req, dest = self._request(ckpt, item, planner)
                batch.append((item, req, dest))
                bounce += req.out.nbytes if dest is not None else 0
                if bounce >= READ_BATCH_BYTES:
                    _flush(ckpt, batch, planner)
                    batch, bounce = [], 0
            _flush(ckpt, batch, planner)
        finally:
            self.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _request(self, ckpt: Checkpoint, item: ReadItem, planner: LoadPlanner
                 ) -> tuple[Request, torch.Tensor | None]:
        """A read request for the item's box, and the destination to copy into when not read in place."""
        fqn = item.storage_index.fqn
        name = self._names.get(fqn)
        if name is None:
            raise InvalidArgumentError(f"DCP asks for tensor {fqn!r}, which step {ckpt.step} does not hold", tensor=fqn)
        meta = ckpt.meta.arrays[name]
        base = item.storage_index.offset or torch.Size([0] * len(meta.shape))
        start = tuple(int(b) + int(o) for b, o in zip(base, item.storage_offsets, strict=True))
        shape = tuple(int(n) for n in item.lengths)
        lt = ckpt[name]
        if any(a < 0 or a + n > s for a, n, s in zip(start, shape, meta.shape, strict=True)):
            raise InvalidArgumentError(f"DCP asks for box start={list(start)} shape={list(shape)} outside tensor "
                                       f"{fqn!r} of shape {list(meta.shape)}", tensor=fqn)
        ckpt.check_listed(meta, start, shape)
        dest = planner.resolve_tensor(item).detach()
        if tuple(dest.shape) != shape:
            raise InvalidArgumentError(f"DCP destination for {fqn!r} has shape {list(dest.shape)}, the read item "
                                       f"{list(shape)}", tensor=fqn)
        if dest.device.type == "cpu" and dest.dtype == lt.dtype and dest.is_contiguous():
            return Request(meta, start, shape, dest), None
        return Request(meta, start, shape, torch.empty(shape, dtype=lt.dtype)), dest

    def _value_bytes(self, ckpt: Checkpoint, fqn: str) -> io.BytesIO:
        """DCP's LoadPlanner takes non-tensor values as torch.save bytes: made here, in memory only."""
        if fqn not in self._values:
            raise InvalidArgumentError(f"DCP asks for value {fqn!r}, which step {ckpt.step} does not hold", tensor=fqn)

        def real(v: Any) -> Any:  # a tuple of tensors is a single DCP value: read its tensors
            if isinstance(v, torch.Tensor):
                return ckpt[self._placeholders[id(v)]].read()
            if isinstance(v, dict):
                return {k: real(x) for k, x in v.items()}
            if isinstance(v, list | tuple):
                return type(v)(real(x) for x in v)
            return v

        buf = io.BytesIO()
        torch.save(real(self._values[fqn]), buf)
        buf.seek(0)
        return buf

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            Repository.open(checkpoint_id)
        except (UCLError, OSError, TypeError):
            return False
        return True


def _flush(ckpt: Checkpoint, batch: list[tuple[ReadItem, Request, torch.Tensor | None]], planner: LoadPlanner) -> None:
    if not batch:
        return
    ckpt.read_requests([req for _, req, _ in batch], direct=True)  # DCP loads whole states
    for item, req, dest in batch:
        if dest is not None:
            dest.copy_(req.out)
            planner.commit_tensor(item, dest)
        else:
            planner.commit_tensor(item, req.out)
