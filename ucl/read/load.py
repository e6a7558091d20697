"""``ucl.load`` and ``ucl.load_into``: a whole step, a selection of its tensors, or one rank's local state
under any target parallel configuration (spec/layout.md).

Without a layout, a load is the step's state dict as saved (:meth:`ucl.Checkpoint.load`). A step saved
under a layout stores what each rank held, as regular blocks of one Zarr array per tensor, with records
saying how those blocks map to the logical tensors. A load for a *target* configuration (layout, mesh,
rank) plans, without I/O, which stored boxes hold the elements of this rank's local tensors
(:func:`ucl.plan.plan_load`), then reads only those boxes (and, in them, only the inner chunks it needs)
concurrently, straight into the destination tensors where the box is one contiguous run of them, else
through a bounded temporary.

::

    # every rank of the new job (any tp/pp/dp), or one process for rank after rank:
    local = ucl.load("ckpt", layout=target_layout, mesh="pp=2 dp=1 tp=4", rank=rank)
    ucl.load_into("ckpt", model_and_optimizer_state, layout=target_layout, mesh=..., rank=rank)  # in place
    ucl.load_into("ckpt", dtensor_state, layout="dtensor")  # FSDP2/DTensor: placements give the target

Memory: the destination tensors, plus at most ``buffer_bytes`` (default 64 MiB) of temporaries and
decode scratch per batch of reads, plus the reader's small per-thread buffers.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ucl.errors import InvalidArgumentError, LayoutShapeError, MeshMismatchError, TensorNotFoundError
from ucl.format import dtypes, structure
from ucl.io import progress
from ucl.io.stores.base import Store
from ucl.layout import Layout, Mesh, as_layout, as_mesh, layout_from_dtensors, mesh_rank
from ucl.layout.views import VIEWS, as_view
from ucl.options import DEFAULT_READ, ReadOptions
from ucl.plan.copies import BoxCopy
from ucl.plan.layout_load import plan_load
from ucl.plan.save import spec_for_meta
from ucl.read.checkpoint import Checkpoint
from ucl.read.checkpoint import open as _open
from ucl.read.tensors import alloc

__all__ = ["load", "load_into", "load_plan", "load_view"]

PLAN_CACHE_SIZE = 32
_PLANS: dict[Any, Any] = {}
_PLANS_LOCK = threading.Lock()


# -- loading -----------------------------------------------------------------------------------------
def load(
    path: str | os.PathLike[str] | Store | Checkpoint,
    step: int | None = None,
    *,
    layout: Any = None,
    mesh: Any = None,
    rank: int | None = None,
    tensors: Iterable[str] | None = None,
    flat: bool = False,
    view: Any = None,
    approximate: bool = False,
    storage_options: dict[str, Any] | None = None,
    buffer_bytes: int | None = None,
    options: ReadOptions = DEFAULT_READ,
) -> Any:
    """Read a step: its state dict as saved, or this rank's local state for a target configuration.

    Parameters
    ----------
    path
        A repository (directory, URL, Store) or an open :class:`ucl.Checkpoint`.
    step
        The step (default: the newest committed).
    layout, mesh, rank
        The target configuration: a layout (:class:`ucl.layout.Layout`, its text or JSON form), its mesh
        (``"pp=2 tp=4"``, ``{"tp": 4}``, a Mesh; default: the layout's declared mesh, or one rank) and this
        rank in it (default: the torch.distributed rank, whose world size must be the mesh's; or 0 on a
        one-rank mesh). Without a layout: the step's logical state (:meth:`ucl.Checkpoint.load`).
    tensors
        Load only these logical tensors (e.g. the model without its optimizer state).
    flat
        Return ``{local name: tensor}`` instead of the nested state dict.
    view
        Another framework's names for the step's logical tensors (:mod:`ucl.layout.views`): ``"hf-llama"``
        gives a Megatron-core GPT/LLaMA step as the flat state dict of ``transformers``'
        ``LlamaForCausalLM`` (fused QKV and gate/up split, only the rows each tensor needs read); or a
        view object such as ``HFLlama(num_heads=..., num_kv_heads=...)``. ``tensors`` then selects
        target names. Not with a target layout; ``layout="hf-llama"`` means this view.
    approximate
        For a gradient-record step (spec/delta.md §8) whose optimizer fingerprint differs from this
        environment: replay it anyway (a ``ReplayWarning``) instead of failing with ``unknown_extension``.
    buffer_bytes
        Bound on temporaries and decode scratch per batch of reads (default: ``options.fill_buffer_bytes``).
    options
        How to read (:class:`ucl.options.ReadOptions`).

    Returns
    -------
    The rank's local state: its local tensors (local layer numbers, flat buffers, padding as zeros) nested
    by the "/" of their names, beside the JSON values of the step's structure (e.g. a step counter).

    Raises
    ------
    MeshMismatchError, UnmatchedPatternError, OverlappingRulesError, LayoutShapeError
        When the target layout does not fit the step's tensors (before anything is read).
    """
    if view is None and isinstance(layout, str) and layout in VIEWS:  # layout="hf-llama": the view of that name
        view, layout = layout, None
    if view is not None:
        if layout is not None or mesh is not None or rank is not None:
            raise InvalidArgumentError("view= names the tensors of another framework's whole model: it takes no "
                                       "layout=, mesh= or rank=")
        if isinstance(path, Checkpoint):
            return load_view(path, view, tensors)
        with _open(path, step, storage_options=storage_options, approximate=approximate,
                   options=options) as ckpt:
            return load_view(ckpt, view, tensors)
    if layout is None:
        if mesh is not None or rank is not None:
            raise InvalidArgumentError("mesh= and rank= describe a target layout: pass layout= too")
        if isinstance(path, Checkpoint):
            return _select(path, tensors, flat)
        with _open(path, step, storage_options=storage_options, approximate=approximate,
                   options=options) as ckpt:
            return _select(ckpt, tensors, flat)
    if isinstance(path, Checkpoint):
        return _load(path, layout, mesh, rank, tensors, flat, buffer_bytes)
    with _open(path, step, storage_options=storage_options, approximate=approximate, options=options) as ckpt:
        return _load(ckpt, layout, mesh, rank, tensors, flat, buffer_bytes)


def view_plan(ckpt: Checkpoint, view: Any) -> dict[str, Any]:
    """``{target name: Take}`` of ``view`` over the step's logical tensors (no I/O)."""
    shapes = {n: tuple(ckpt[n].shape) for n in ckpt}
    return as_view(view).plan(shapes, ckpt.layout)


def read_take(ckpt: Checkpoint, take: Any) -> torch.Tensor:
    """The rows of one logical tensor that a view's target takes (only those rows read)."""
    t = ckpt[take.source]
    if take.ranges is None:
        return t.read()
    parts = [t[a:b] for a, b in take.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def load_view(ckpt: Checkpoint, view: Any, tensors: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The step's model under another framework's names (``load(..., view=)``): ``{target: tensor}``."""
    plan = view_plan(ckpt, view)
    if tensors is not None:
        want = list(tensors)
        missing = [n for n in want if n not in plan]
        if missing:
            raise TensorNotFoundError(f"view {getattr(as_view(view), 'name', view)!r} of step {ckpt.step} has no "
                                      f"tensor {missing[0]!r}", tensor=missing[0])
        plan = {n: plan[n] for n in want}
    out: dict[str, torch.Tensor] = {}
    done: dict[Any, torch.Tensor] = {}
    for name, take in plan.items():
        if take not in done:  # a tied output layer is the embedding: read once
            done[take] = read_take(ckpt, take)
        out[name] = done[take]
    return out


def _select(ckpt: Checkpoint, tensors: Iterable[str] | None, flat: bool) -> Any:
    if tensors is None:
        return ckpt.load(flat=flat)
    want = list(tensors)
    for n in want:
        if n not in ckpt:
            raise TensorNotFoundError(f"step {ckpt.step} has no tensor {n!r}", tensor=n)
    out = {n: alloc(n, _spec_dtype(ckpt[n].dtype), tuple(ckpt[n].shape)) for n in want}
    ckpt.load_into(out)
    return out if flat else structure.unflatten(structure.graft(ckpt.meta.tree, want), out)


def _spec_dtype(dtype: torch.dtype) -> str:

    return dtypes.from_torch(dtype)


def _load(
    ckpt: Checkpoint,
    layout: Any,
    mesh: Any,
    rank: int | None,
    tensors: Iterable[str] | None,
    flat: bool,
    buffer_bytes: int | None,
) -> Any:
    plan = load_plan(ckpt, layout=layout, mesh=mesh, rank=rank, tensors=tensors)
    out = {n: alloc(n, d, s, zero=n in plan.zero) for n, (s, d) in plan.local.items()}
    _fill(ckpt, _ops(ckpt, plan, out), buffer_bytes)
    if flat:
        return out
    return structure.unflatten(structure.graft(ckpt.meta.tree, list(out)), out)


def load_into(
    path: str | os.PathLike[str] | Store | Checkpoint,
    state: Mapping[str, Any],
    *,
    layout: Any = None,
    mesh: Any = None,
    rank: int | None = None,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    buffer_bytes: int | None = None,
    approximate: bool = False,
    options: ReadOptions = DEFAULT_READ,
) -> None:
    """Fill the tensors of ``state`` (this rank's local state for the target configuration) in place.

    ``state`` is a (nested) state dict whose tensors are named like the rank's local tensors (as
    :func:`load` would return them); each must have the shape the target layout gives it. Tensors may be
    on any device and of another dtype (then read through a temporary and cast); a flat buffer must be
    contiguous. Local tensors the state does not have are skipped; a tensor of the state that is not a
    local tensor of this rank under the target layout is an error.

    ``layout="dtensor"``: the state holds DTensors (FSDP2, tensor parallel); the target layout is derived
    from their placements (:func:`ucl.layout.layout_from_dtensors`) and their local shards are filled;
    mesh and rank come from their device mesh. Plain tensors of such a state are filled whole.
    """
    if isinstance(path, Checkpoint):
        _load_into(path, state, layout, mesh, rank, buffer_bytes)
        return
    with _open(path, step, storage_options=storage_options, approximate=approximate, options=options) as ckpt:
        _load_into(ckpt, state, layout, mesh, rank, buffer_bytes)


def _load_into(
    ckpt: Checkpoint,
    state: Mapping[str, Any],
    layout: Any,
    mesh: Any,
    rank: int | None,
    buffer_bytes: int | None,
) -> None:
    tensors, _ = structure.flatten(state)
    selection: list[str] | None = None
    target = layout is not None  # a target layout is involved (shapes are this rank's, not the step's)
    if isinstance(layout, str) and layout == "dtensor":
        if mesh is not None or rank is not None:
            raise InvalidArgumentError("layout='dtensor' takes mesh and rank from the DTensors; pass neither")
        layout, mesh, rank, tensors = _from_dtensors(tensors)
        missing = [n for n in tensors if n not in ckpt]
        if missing:
            raise TensorNotFoundError(f"step {ckpt.step} has no tensor {missing[0]!r}", tensor=missing[0])
        selection = list(tensors)
    elif layout is None:
        if mesh is not None or rank is not None:
            raise InvalidArgumentError("mesh= and rank= describe a target layout: pass layout= too")

        layout, mesh, rank = Layout(), Mesh(()), 0  # the logical tensors, whole
        selection = [n for n in tensors if n in ckpt]
        missing = [n for n in tensors if n not in ckpt]
        if missing:
            raise TensorNotFoundError(f"step {ckpt.step} has no tensor {missing[0]!r}", tensor=missing[0])
    plan = load_plan(ckpt, layout=layout, mesh=mesh, rank=rank, tensors=selection)
    wrong: list[tuple[str, list[int], list[int]]] = []  # (name, destination shape, expected shape)
    for n, t in tensors.items():
        if n not in plan.local:
            raise TensorNotFoundError(
                f"{n!r} is not a tensor of rank {rank} under the target layout "
                f"(it holds {_some(plan.local)})",
                tensor=n,
            )
        if tuple(t.shape) != tuple(plan.local[n][0]):
            wrong.append((n, list(t.shape), list(plan.local[n][0])))
    if wrong:
        raise LayoutShapeError(_shape_message(ckpt.step, wrong, rank if target else None), tensor=wrong[0][0])
    with torch.no_grad():
        for n in plan.zero:
            if n in tensors:
                tensors[n].zero_()
    dest = dict(tensors)
    for it in plan.items:
        if it.local_view is not None and it.local_name in dest and not dest[it.local_name].is_contiguous():
            raise InvalidArgumentError(
                f"flat buffer {it.local_name!r} must be a contiguous tensor", tensor=it.local_name
            )
    _fill(ckpt, _ops(ckpt, plan, dest), buffer_bytes)


def _shape_message(step: int, wrong: list[tuple[str, list[int], list[int]]], rank: int | None) -> str:
    """Every destination tensor whose shape is not the one it is loaded with, in plain words; the layout
    is named only when one is involved (``rank`` not None)."""
    n = len(wrong)
    what = f"{n} destination tensor{'s' if n > 1 else ''} {'have' if n > 1 else 'has'} the wrong shape"
    if rank is None:
        head = f"load_into: {what} for step {step}:"
        lines = [f"  {name!r}: expected {want} (its shape in step {step}), found {got}" for name, got, want in wrong]
    else:
        head = f"load_into: {what} for rank {rank} under the target layout:"
        lines = [f"  {name!r}: expected {want} (rank {rank}'s part under the layout), found {got}"
                 for name, got, want in wrong]
    if len(lines) > 50:
        lines[50:] = [f"  ... and {len(lines) - 50} more"]
    return "\n".join([head, *lines])


def _fill(ckpt: Checkpoint, ops: list[BoxCopy], buffer_bytes: int | None) -> None:
    """``ckpt.fill``, with a bar of the bytes read on a terminal for large loads (:mod:`ucl.io.progress`:
    polled from the reader's counter, so the reads pay nothing)."""
    with progress.watch(sum(op.nbytes for op in ops), "load", lambda: ckpt.bytes_read):
        ckpt.fill(ops, buffer_bytes, direct=True)


def _some(local: Mapping[str, Any]) -> str:
    keys = sorted(local)
    return ", ".join(repr(k) for k in keys[:4]) + (f", ... ({len(keys)} tensors)" if len(keys) > 4 else "")


def _from_dtensors(tensors: Mapping[str, torch.Tensor]) -> tuple[Any, Any, int, dict[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor


    dts = {n: t for n, t in tensors.items() if isinstance(t, DTensor)}
    if not dts:
        return Layout(), Mesh(()), 0, dict(tensors)
    layout = layout_from_dtensors(dts)
    rank = mesh_rank(next(iter(dts.values())).device_mesh)
    local = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in tensors.items()}
    return layout, layout.mesh, rank, local


def _ops(ckpt: Checkpoint, plan: Any, dest: Mapping[str, torch.Tensor]) -> list[BoxCopy]:
    arrays = ckpt.meta.arrays
    return [
        BoxCopy(
            arrays[it.array],
            it.stored_box,
            dest[it.local_name],
            it.local_view,
            it.local_box,
            it.reduce == "sum",
        )
        for it in plan.items
        if it.local_name in dest
    ]


def load_plan(
    ckpt: Checkpoint | str | os.PathLike[str] | Store,
    *,
    layout: Any,
    mesh: Any = None,
    rank: int | None = None,
    tensors: Iterable[str] | None = None,
    step: int | None = None,
) -> Any:
    """The :class:`ucl.plan.LoadPlan` of a target rank (pure planning, cached per step and target):
    ``local`` (what the rank holds: name -> (shape, dtype)), ``zero`` and ``items`` (the stored boxes it
    reads, each with its destination box)."""
    if not isinstance(ckpt, Checkpoint):
        with _open(ckpt, step) as c:
            return load_plan(c, layout=layout, mesh=mesh, rank=rank, tensors=tensors)

    layout = as_layout(layout)
    mesh = as_mesh(mesh, layout)
    rank = _target_rank(mesh, rank)
    sel = None if tensors is None else tuple(sorted(set(tensors)))
    key = (_fingerprint(ckpt), json.dumps(layout.to_dict(), sort_keys=True), mesh, rank, sel)
    plan = _PLANS.get(key)
    if plan is None:
        specs = {n: spec_for_meta(m) for n, m in ckpt.meta.arrays.items()}
        plan = plan_load(specs, layout, mesh, rank, tensors=sel)
        with _PLANS_LOCK:
            while len(_PLANS) >= PLAN_CACHE_SIZE:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
    return plan


def _fingerprint(ckpt: Checkpoint) -> str:
    fp = getattr(ckpt, "_fingerprint", None)
    if fp is None:
        doc = [
            [n, list(m.shape), m.dtype, list(m.chunk_shape), m.logical or {}]
            for n, m in sorted(ckpt.meta.arrays.items())
        ]
        fp = hashlib.sha1(json.dumps(doc, sort_keys=True).encode()).hexdigest()
        ckpt._fingerprint = fp  # type: ignore[attr-defined]
    return fp


def _target_rank(mesh: Any, rank: int | None) -> int:
    if rank is not None:
        mesh.coords(rank)  # MeshMismatchError when outside the mesh
        return rank
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        mesh.check_world_size(dist.get_world_size())
        return int(dist.get_rank())
    if mesh.size == 1:
        return 0
    raise MeshMismatchError(
        f"the mesh {mesh.to_text()} has {mesh.size} ranks: pass rank= (or run under torch.distributed)"
    )
