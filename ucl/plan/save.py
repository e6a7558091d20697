"""Which shards this rank writes, and the arrays of the step: pure, no I/O.

Three sources of a plan, one shape of result (:class:`SavePlan`):

- one process: every tensor whole, one shard each;
- data-parallel replicas (every rank holds the same tensors): each tensor written by exactly one rank,
  assigned greedily by size so that the bytes are balanced across ranks;
- a layout (spec/layout.md): ``ucl.plan.plan_save`` says which blocks this rank holds
  (:func:`plan_rank`, then :func:`from_layout` once the coordinator has merged the plans of all ranks).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucl.errors import InvalidArgumentError
from ucl.format import dtypes, names
from ucl.format.metadata import ArrayMeta
from ucl.format.shardfile import INNER_CHUNK_BYTES, choose_chunks, choose_inner_chunk
from ucl.layout import Layout, Mesh
from ucl.layout.resolve import Resolver
from ucl.layout.transforms import make_tile
from ucl.plan.items import ArraySpec
from ucl.plan.layout_save import infer_shapes, plan_save

Box = tuple[tuple[int, ...], tuple[int, ...]]

# Inner chunks of a layout array are split along its first dimension and, for a tensor its rule shards
# (over any axis, even of size 1), along every dimension, into up to SPLIT pieces each (of at least
# MIN_INNER_BYTES, with runs of at least MIN_RUN_BYTES along trailing dimensions), so that a reader with
# another split (2x, 4x, 8x finer or coarser, rows <-> columns) reads whole inner chunks only: bytes read
# ~ bytes needed (bench/reshard.py). Splitting the first dimension keeps inner chunks contiguous in the
# writer's block; splitting a trailing one costs the writer a copy of each inner chunk when it encodes
# the shard (~3-4 GB/s for chunks <= 1 MiB here); an O_DIRECT reader copies out of its pooled buffer anyway.
SPLIT = 8
MIN_INNER_BYTES = 32 << 10
MIN_RUN_BYTES = 256


@dataclass(frozen=True)
class LocalWrite:
    """One shard this rank writes: the array, the shard's grid coordinates, and its source tensor.

    ``box`` is the part of the local tensor written (None: the whole of it, or the shard's part of a
    whole logical tensor). ``stored_box`` is where those values go inside the shard's region, relative to
    its origin (None: the whole region); the rest of the region is zero. The values of ``box`` in
    row-major order fill ``stored_box`` in row-major order (their shapes differ only by leading 1s).
    """

    array: ArrayMeta
    coords: tuple[int, ...]
    source: str  # flat name of the rank's local tensor
    box: Box | None = None
    stored_box: Box | None = None


@dataclass(frozen=True)
class SavePlan:
    arrays: dict[str, ArrayMeta]  # every array of the step (the coordinator's; a layout rank: its own)
    writes: list[LocalWrite]  # what this rank writes
    layout: dict[str, Any] | None = None  # canonical JSON of the source layout
    mesh: dict[str, Any] | None = None

    @property
    def sources(self) -> set[str]:
        return {w.source for w in self.writes}


def single(tensors: dict[str, torch.Tensor], compression: dict[str, Any] | None = None,
           inner_bytes: int = INNER_CHUNK_BYTES) -> SavePlan:
    arrays = {n: array_for(n, t, compression=compression, inner_bytes=inner_bytes) for n, t in tensors.items()}
    return SavePlan(arrays, [LocalWrite(a, c, n) for n, a in arrays.items() for c in all_shards(a)])


def replicated(
    tensors: dict[str, torch.Tensor], rank: int, world: int, compression: dict[str, Any] | None = None,
    inner_bytes: int = INNER_CHUNK_BYTES,
) -> SavePlan:
    """Every rank holds the same tensors: each is written by one rank, bytes balanced (largest first)."""
    arrays = {n: array_for(n, t, compression=compression, inner_bytes=inner_bytes) for n, t in tensors.items()}
    load = [0] * world
    owner: dict[str, int] = {}
    for n in sorted(arrays, key=lambda n: (-arrays[n].nbytes, n)):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[n] = r
        load[r] += max(arrays[n].nbytes, 1)
    writes = [LocalWrite(a, c, n) for n, a in arrays.items() if owner[n] == rank for c in all_shards(a)]
    return SavePlan(arrays, writes)


# -- layouts ---------------------------------------------------------------------------------------
def local_shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """What the planner needs of a rank's state (small, JSON-able: it is allgathered). Checks every tensor
    (:func:`check_tensor`)."""
    out = {}
    for n, t in tensors.items():
        dtype = check_tensor(n, t)  # first: a nested tensor has no t.shape
        out[n] = (tuple(t.shape), dtype)
    return out


def plan_rank(
    layout: Any,
    mesh: Any,
    rank: int,
    local: Mapping[str, tuple[tuple[int, ...], str]],
    all_local: Sequence[Mapping[str, tuple[tuple[int, ...], str]]] | None = None,
) -> Any:
    """``ucl.plan.plan_save`` for one rank, the logical shapes of uneven splits inferred from the local
    shapes of every rank (``all_local``, by rank) when given. Raises the layout's errors (nothing written)."""

    shapes = infer_shapes(layout, mesh, list(all_local)) if all_local is not None else None
    return plan_save(layout, mesh, rank, local, shapes=shapes)


def inner_chunk_for(spec: Any, split: Sequence[int] = (), inner_bytes: int = INNER_CHUNK_BYTES) -> tuple[int, ...]:
    """The inner chunk of a layout array (:func:`chunks_for`)."""
    return chunks_for(spec, split, inner_bytes)[1]


def chunks_for(spec: Any, split: Sequence[int] = (),
               inner_bytes: int = INNER_CHUNK_BYTES) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(grid chunk shape, inner chunk shape) of a layout array: :func:`ucl.format.shardfile.choose_chunks`
    of its chunk (the rank's block), after splitting its first dimension and the dimensions ``split``:
    each halved in turn (the last dimension first), while it stays within SPLIT pieces, the inner chunk
    at least MIN_INNER_BYTES and rows along it at least MIN_RUN_BYTES. A block split so keeps its pieces'
    leading-divisor inner chunks (the granularity of a reshard, spec/layout.md §9.2); an unsplit one gets
    choose_chunks' 1-8 MiB chunks, its grid chunk rounded up along a dimension it holds whole
    (spec/core.md §6)."""
    block = tuple(max(1, c) for c in spec.chunk_shape)
    itemsize = dtypes.itemsize(spec.dtype)
    pre = list(block)
    lead = 1 if spec.logical and spec.logical.get("partial") else 0
    dims = sorted({lead, *split} & set(range(len(block))), reverse=True)
    parts = dict.fromkeys(dims, 1)
    grown = True
    while grown:
        grown = False
        for d in dims:
            k = parts[d] * 2
            if k > SPLIT or block[d] % k:
                continue
            cand = [*pre[:d], block[d] // k, *pre[d + 1 :]]
            if math.prod(cand) * itemsize < MIN_INNER_BYTES:
                continue
            if d > lead and math.prod(cand[d:]) * itemsize < MIN_RUN_BYTES:
                continue
            pre, parts[d], grown = cand, k, True
    if pre != list(block):
        # split for resharding: the pieces are the granularity other configurations read at (spec/layout.md
        # §9.2); choose_chunks would merge small pieces into 1-8 MiB chunks and a reader of another split
        # would read far past its box (measured: 13.8x its shard's bytes for columns tp=2 -> rows tp=4)
        return block, choose_inner_chunk(tuple(pre), itemsize, inner_bytes)
    shape = tuple(spec.shape)
    free = [d for d in range(len(block)) if pre[d] == block[d] >= shape[d] and d >= lead]
    chunk, inner = choose_chunks(shape, tuple(pre), itemsize, inner_bytes, free=free)
    return tuple(chunk[d] if d in free else block[d] for d in range(len(block))), inner


def split_dims(
    layout_json: Mapping[str, Any], mesh_json: Mapping[str, Any], specs: Mapping[str, Any]
) -> dict[str, tuple[int, ...]]:
    """For each tile array (a tensor stored under its own name) whose rule shards it: its dimensions."""

    layout, mesh = Layout.from_dict(dict(layout_json)), Mesh.from_dict(dict(mesh_json))
    res = Resolver(layout, mesh)
    out: dict[str, tuple[int, ...]] = {}
    for name, spec in specs.items():
        info = (
            (spec.logical or {}).get("tensors", {}).get(name) if spec.logical else {"shape": list(spec.shape)}
        )
        if info is None:
            continue  # a flat buffer
        try:
            _, rule = res.rule_for(name)
            tile = make_tile(rule, name, tuple(info["shape"]), mesh)
        except Exception:  # noqa: BLE001 - a hint only
            continue
        lead = 1 if tile.partial else 0
        if any(plan.splits for plan in tile.dims):
            out[name] = tuple(d + lead for d in range(len(tile.dims)))
    return out


def meta_for_spec(
    spec: Any, compression: dict[str, Any] | None = None, split: Sequence[int] = (),
    inner_bytes: int = INNER_CHUNK_BYTES,
) -> ArrayMeta:
    """The stored-array metadata of a layout array (``ucl.plan.ArraySpec``)."""
    chunk, inner = chunks_for(spec, split, inner_bytes)
    return ArrayMeta(
        name=names.check_name(spec.name),
        shape=tuple(spec.shape),
        dtype=spec.dtype,
        chunk_shape=chunk,
        inner_chunk_shape=inner,
        compression=compression,
        logical=dict(spec.logical) if spec.logical else None,
    )


def spec_for_meta(meta: ArrayMeta) -> Any:
    """The ``ucl.plan.ArraySpec`` of a stored array (its logical record; ``{}`` for a plain array)."""

    return ArraySpec(
        meta.name, tuple(meta.shape), meta.dtype, tuple(meta.chunk_shape), dict(meta.logical or {})
    )


def from_layout(
    rank_plan: Any, arrays: Mapping[str, Any] | None = None, compression: dict[str, Any] | None = None,
    inner_bytes: int = INNER_CHUNK_BYTES,
) -> SavePlan:
    """The engine's plan from a rank's ``ucl.plan.RankPlan``.

    ``arrays``: the merged arrays of every rank (``ucl.plan.merge_plans``; the coordinator records
    them); None keeps the rank's own arrays (enough to write its chunks).
    """

    specs = dict(arrays if arrays is not None else rank_plan.arrays)
    split = split_dims(rank_plan.layout_json, rank_plan.mesh_json, specs)
    metas = {n: meta_for_spec(s, compression, split.get(n, ()), inner_bytes) for n, s in specs.items()}
    writes = []
    for w in rank_plan.writes:
        meta = metas[w.array.name]
        origin = tuple(i * c for i, c in zip(w.chunk_index, meta.chunk_shape, strict=True))
        region = tuple(min(c, n - o) for c, n, o in zip(meta.chunk_shape, meta.shape, origin, strict=True))
        rel: Box = (
            tuple(s - o for s, o in zip(w.stored_box[0], origin, strict=True)),
            tuple(w.stored_box[1]),
        )
        whole = rel == (tuple(0 for _ in region), region) and tuple(w.local_box[1]) == region
        writes.append(
            LocalWrite(
                meta,
                tuple(w.chunk_index),
                w.local_name,
                (tuple(w.local_box[0]), tuple(w.local_box[1])),
                None if whole else rel,
            )
        )
    return SavePlan(metas, writes, dict(rank_plan.layout_json), dict(rank_plan.mesh_json))


def block_of(w: LocalWrite, local: torch.Tensor) -> torch.Tensor:
    """The block of shard ``w`` built from the rank's (staged) local tensor: the shard's region, clipped to
    the array, with the local box at ``stored_box`` and zeros elsewhere (spec/layout.md §6.5)."""
    src = local
    if w.box is not None:
        src = local[tuple(slice(a, a + n) for a, n in zip(w.box[0], w.box[1], strict=True))]
    if w.stored_box is None:
        return values_of(src)
    meta = w.array
    origin = tuple(i * c for i, c in zip(w.coords, meta.chunk_shape, strict=True))
    region = tuple(min(c, n - o) for c, n, o in zip(meta.chunk_shape, meta.shape, origin, strict=True))
    out = torch.zeros(region, dtype=local.dtype)
    start, shape = w.stored_box
    out[tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))] = src.reshape(shape)  # the values
    return out


# -- what a writer stores of a tensor ----------------------------------------------------------------
def check_tensor(name: str, t: Any) -> str:
    """Check that a writer can store the values of tensor ``name``; returns its spec data type.

    The one check of a tensor's kind, run on every tensor of a state before any byte of the step is
    written, by every writer (``ucl.save`` and ``save_sharded`` through :func:`array_for` and
    :func:`local_shapes`, the manager's planner on every save). Refused, with InvalidArgumentError: what is
    not a tensor, nested, sparse and other non-strided tensors (mkldnn), quantized tensors, and tensors
    without values (the meta device, fake tensors); with UnsupportedDTypeError, data types outside
    spec/core.md §4. Accepted and stored by their values: any strided tensor with values, whatever its
    strides (views, expanded), autograd state, subclass (``nn.Parameter``) or conjugate / negative bit
    (the bytes written are those of :func:`values_of`).
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor", tensor=name)
    if t.is_nested:  # before t.layout and t.shape, which a nested tensor may not have
        raise InvalidArgumentError(
            f"tensor {name!r} is a nested tensor (torch.nested); ucl stores rectangular tensors: save its "
            "components (list(t.unbind())) or t.to_padded_tensor(0.0)", tensor=name)
    if t.layout != torch.strided:
        what = "sparse" if t.layout in _SPARSE else "non-strided"
        raise InvalidArgumentError(f"tensor {name!r} is a {what} tensor (layout {t.layout}); ucl stores "
                                   "dense values: save t.to_dense()", tensor=name)
    if t.is_quantized:
        raise InvalidArgumentError(f"tensor {name!r} is quantized ({t.dtype}, {t.qscheme()}); ucl stores "
                                   "plain data types: save t.dequantize(), or t.int_repr() with its scales "
                                   "and zero points", tensor=name)
    if t.is_meta:
        raise InvalidArgumentError(f"tensor {name!r} is on the meta device: a meta tensor has no values to "
                                   "save (materialize it first, e.g. module.to_empty(device='cpu'), then "
                                   "initialize or load it)", tensor=name)
    if _is_fake(t):
        raise InvalidArgumentError(f"tensor {name!r} is a FakeTensor: a fake tensor has no values to save "
                                   "(save real tensors, made outside FakeTensorMode)", tensor=name)
    return dtypes.from_torch(t.dtype, tensor=name)


def check_tensors(tensors: Mapping[str, Any]) -> None:
    """:func:`check_tensor` of every tensor of a (flat) state."""
    for n, t in tensors.items():
        check_tensor(n, t)


def values_of(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` as a tensor whose bytes are them: a conjugate or negative view (``t.conj()`` of a
    complex tensor, ``torch._neg_view``) resolved into a copy, any other tensor returned as it is."""
    return t.resolve_conj().resolve_neg()


_SPARSE = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                     torch.sparse_bsc})


def _is_fake(t: torch.Tensor) -> bool:
    fake = sys.modules.get("torch._subclasses.fake_tensor")  # loaded with torch; never imported here
    return fake is not None and isinstance(t, getattr(fake, "FakeTensor", ()))


def array_for(name: str, t: torch.Tensor, chunk_shape: tuple[int, ...] | None = None,
              compression: dict[str, Any] | None = None, inner_bytes: int = INNER_CHUNK_BYTES) -> ArrayMeta:
    """The stored-array metadata for a tensor written whole by one writer (or with a given block); checks
    the tensor first (:func:`check_tensor`: it must have values a writer can store)."""
    dtype = check_tensor(name, t)
    return array_for_shape(name, tuple(t.shape), dtype, chunk_shape, compression, inner_bytes)


def array_for_shape(name: str, shape: tuple[int, ...], dtype: str | torch.dtype,
                    chunk_shape: tuple[int, ...] | None = None, compression: dict[str, Any] | None = None,
                    inner_bytes: int = INNER_CHUNK_BYTES) -> ArrayMeta:
    """:func:`array_for` from a shape and a data type (a spec name or a torch dtype) alone: for a writer
    whose values come from elsewhere (compaction reads them from the step it rewrites). The grid chunk is
    the block (default: the whole tensor), rounded up past the array's end along a dimension it holds
    whole when that gives better inner chunks (:func:`ucl.format.shardfile.choose_chunks`)."""
    dtype = dtypes.check(dtype) if isinstance(dtype, str) else dtypes.from_torch(dtype, tensor=name)
    shape = tuple(shape)
    block = tuple(max(1, s) for s in (chunk_shape or shape))
    block, inner = choose_chunks(shape, block, dtypes.itemsize(dtype), inner_bytes)
    return ArrayMeta(name=names.check_name(name), shape=shape, dtype=dtype, chunk_shape=block,
                     inner_chunk_shape=inner, compression=compression)


def shard_block(meta: ArrayMeta, coords: tuple[int, ...], t: torch.Tensor) -> torch.Tensor:
    """The values of the part of a whole (logical) tensor that shard ``coords`` holds, clipped to the array
    (a conjugate or negative view resolved: :func:`values_of`)."""
    idx = tuple(slice(c * s, min((c + 1) * s, n)) for c, s, n in zip(coords, meta.chunk_shape, meta.shape, strict=True))
    return values_of(t[idx])


def all_shards(meta: ArrayMeta) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(g) for g in meta.grid)))
