"""Layouts and meshes as callers give them: objects, text, JSON forms, ``{"tp": 2}`` mappings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucl.errors import InvalidLayoutError, MeshMismatchError
from ucl.layout.mesh import Mesh, parse_mesh
from ucl.layout.model import Layout, check_mesh
from ucl.layout.syntax import parse_layout


def as_layout(layout: Any) -> Layout:
    """A :class:`Layout` from a Layout, its text form (``"ucl-layout 1\\n..."``) or its JSON form (a dict)."""
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, str):

        return parse_layout(layout)
    if isinstance(layout, Mapping):
        return Layout.from_dict(dict(layout))
    raise InvalidLayoutError(
        f"a layout is a ucl.layout.Layout, its text or its JSON form, got {type(layout).__name__}"
    )


def as_mesh(mesh: Any, layout: Layout | None = None, world: int | None = None) -> Mesh:
    """A :class:`Mesh` from a Mesh, ``"pp=2 tp=4"``, ``{"pp": 2, "tp": 4}``, the JSON form
    ``{"axes": [["pp", 2], ...]}``, or None: the layout's declared mesh, else (one process) every axis
    the layout names with size 1. The mesh must fit ``layout`` (every axis it names, its declared mesh)
    and, with ``world``, have that many ranks (MeshMismatchError).
    """
    if mesh is None:
        if layout is not None and layout.mesh is not None:
            out = layout.mesh
        elif world in (None, 1):
            out = Mesh(tuple((a, 1) for a in sorted(layout.axes()))) if layout is not None else Mesh(())
        else:
            raise MeshMismatchError(
                f"a layout on {world} processes needs a mesh (mesh='dp=2 tp=4' or similar)"
            )
    elif isinstance(mesh, Mesh):
        out = mesh
    elif isinstance(mesh, str):
        out = parse_mesh(mesh)
    elif isinstance(mesh, Mapping):
        out = Mesh.from_dict(dict(mesh)) if set(mesh) == {"axes"} else Mesh(tuple(mesh.items()))
    else:
        raise InvalidLayoutError(f"a mesh is a ucl.layout.Mesh, 'pp=2 tp=4' or {{'tp': 4}}, got {mesh!r}")
    if layout is not None:

        check_mesh(layout, out)
    if world is not None:
        out.check_world_size(world)
    return out
