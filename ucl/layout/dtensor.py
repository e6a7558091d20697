"""FSDP2 / DTensor: a layout derived from the tensors' placements (spec/layout.md §11.3).

Reads only DTensor metadata (mesh, placements, global shape); creates no process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucl.errors import InvalidLayoutError, MeshMismatchError
from ucl.format import structure
from ucl.layout.mesh import Mesh
from ucl.layout.model import Layout, Partial, Rule, Shard, Size, Transform
from ucl.layout.patterns import escape


def _root(device_mesh: Any) -> Any:
    get_root = getattr(device_mesh, "_get_root_mesh", None)
    return get_root() if get_root is not None else device_mesh


def _mesh_of(device_mesh: Any) -> Mesh:
    names_ = device_mesh.mesh_dim_names or tuple(f"d{i}" for i in range(device_mesh.ndim))
    return Mesh(tuple(zip(names_, (int(s) for s in device_mesh.mesh.shape), strict=True)))


def mesh_rank(device_mesh: Any) -> int:
    """This process's rank in the :class:`Mesh` of ``device_mesh`` (row-major over its coordinates),
    which is what the planner takes (the global rank may order the mesh differently)."""
    root = _root(device_mesh)
    coord = root.get_coordinate()
    if coord is None:
        raise MeshMismatchError("this process is not part of the device mesh")
    mesh = _mesh_of(root)
    return mesh.rank(dict(zip(mesh.names, coord, strict=True)))


def _transforms(
    name: str, placements: Any, dims: tuple[str, ...], mesh: Mesh, shape: tuple[int, ...]
) -> list[Transform]:
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - older torch
        _StridedShard = ()  # type: ignore[assignment,misc]
    per_dim: dict[int, list[tuple[str, int | None]]] = {}
    partial: list[str] = []
    for axis, p in zip(dims, placements, strict=True):
        if isinstance(p, _StridedShard):
            per_dim.setdefault(p.dim, []).append((axis, int(p.split_factor)))
        elif isinstance(p, DShard):
            per_dim.setdefault(p.dim, []).append((axis, None))
        elif isinstance(p, DPartial):
            if getattr(p, "reduce_op", "sum") != "sum":
                raise InvalidLayoutError(
                    f"tensor {name!r}: Partial({p.reduce_op!r}) is not supported (sum only)"
                )
            partial.append(axis)
        elif not isinstance(p, DReplicate):
            raise InvalidLayoutError(f"tensor {name!r}: placement {p!r} is not supported")
    out: list[Transform] = []
    for d in sorted(per_dim):
        entries = per_dim[d]
        order: list[str] = []
        i = 0
        while i < len(entries):
            axis, sf = entries[i]
            if sf is None:
                order.append(axis)
                i += 1
                continue
            # _StridedShard(d, sf) then plain Shard(d) over axes whose sizes multiply to sf: those split first
            later = [a for a, f in entries[i + 1 :] if f is None]
            prod = 1
            for a in later:
                prod *= mesh.axis_size(a)
            if not later or prod != sf or any(f is not None for _, f in entries[i + 1 :]):
                raise InvalidLayoutError(
                    f"tensor {name!r}: this _StridedShard arrangement on dim {d} is not supported"
                )
            if shape[d] % (sf * mesh.axis_size(axis)):
                # DTensor's strided shards of an uneven split are not contiguous blocks
                raise InvalidLayoutError(
                    f"tensor {name!r}: _StridedShard of dim {d} ({shape[d]} over {sf} * "
                    f"{mesh.axis_size(axis)}) is uneven; only even strided splits are supported"
                )
            order.extend(later)
            order.append(axis)
            i = len(entries)
        out.append(Size(d, int(shape[d])))
        out.extend(Shard(d, (a,)) for a in order)
    if partial:
        out.append(Partial(tuple(partial)))
    return out


def layout_from_dtensors(state_dict: Mapping[str, Any]) -> Layout:
    """The layout of a (nested) state dict of DTensors: one exact-name rule per DTensor, from its placements.

    ``Shard(d)`` on several mesh dims nests in mesh order (DTensor's left-to-right sharding);
    ``_StridedShard`` (FSDP2 with TP) nests the later mesh dims first; ``Partial("sum")`` is partial;
    the global sizes of split dims are declared (``size``), so no rank needs the others' shapes. Plain
    tensors are replicated. The layout declares the (root) device mesh; pass :func:`mesh_rank` as rank.
    """
    from torch.distributed.tensor import DTensor

    tensors, _ = structure.flatten(state_dict)
    mesh: Mesh | None = None
    rules: list[Rule] = []
    for name, t in tensors.items():
        if not isinstance(t, DTensor):
            continue
        dm = t.device_mesh
        root = _mesh_of(_root(dm))
        if mesh is None:
            mesh = root
        elif mesh != root:
            raise MeshMismatchError(
                f"tensor {name!r} lives on mesh {root.to_text()}; others on {mesh.to_text()}"
            )
        dims = tuple(dm.mesh_dim_names or root.names[: dm.ndim])
        ts = _transforms(name, t.placements, dims, root, tuple(t.shape))
        if ts:
            rules.append(Rule((escape(name),), tuple(ts)))
    return Layout(rules=tuple(rules), mesh=mesh)
