"""The device mesh: ordered named axes with sizes; ranks map to coordinates row-major (spec/layout.md §2)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucl.errors import InvalidLayoutError, MeshMismatchError

AXIS_NAME = re.compile(r"[a-z_][a-z0-9_]*")
MAX_AXES = 16


@dataclass(frozen=True)
class Mesh:
    """Ordered mesh axes ``((name, size), ...)``; the last axis varies fastest along the ranks.

    >>> m = Mesh((("pp", 2), ("dp", 2), ("tp", 4)))
    >>> m.size, m.coords(6)
    (16, {'pp': 0, 'dp': 1, 'tp': 2})
    """

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        axes = tuple((a[0], a[1]) if isinstance(a, list | tuple) and len(a) == 2 else a for a in self.axes)
        object.__setattr__(self, "axes", axes)
        if len(axes) > MAX_AXES:
            raise InvalidLayoutError(f"a mesh has at most {MAX_AXES} axes, got {len(axes)}")
        seen: set[str] = set()
        for a in axes:
            if not (isinstance(a, tuple) and len(a) == 2):
                raise InvalidLayoutError(f"a mesh axis is a (name, size) pair, got {a!r}")
            name, size = a
            if not isinstance(name, str) or not AXIS_NAME.fullmatch(name):
                raise InvalidLayoutError(f"mesh axis name {name!r} is not [a-z_][a-z0-9_]*")
            if name in seen:
                raise InvalidLayoutError(f"mesh axis {name!r} appears twice")
            seen.add(name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise InvalidLayoutError(f"mesh axis {name!r} has size {size!r}; sizes are integers >= 1")

    @classmethod
    def of(cls, **sizes: int) -> Mesh:
        """``Mesh.of(pp=2, dp=2, tp=4)``: axes in keyword order."""
        return cls(tuple(sizes.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        """The number of ranks (the product of the axis sizes; 1 for the empty mesh)."""
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        for n, s in self.axes:
            if n == name:
                return s
        raise MeshMismatchError(f"the mesh {self.to_text() or '(empty)'} has no axis {name!r}")

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank`` (row-major: the last axis varies fastest)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise MeshMismatchError(
                f"rank {rank!r} is outside the mesh {self.to_text() or '(empty)'} of {self.size} ranks"
            )
        out: dict[str, int] = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in self.names}

    def rank(self, coords: Mapping[str, int]) -> int:
        """Inverse of :meth:`coords`."""
        r = 0
        for name, size in self.axes:
            c = coords[name]
            if not 0 <= c < size:
                raise MeshMismatchError(f"coordinate {name}={c} is outside the axis of size {size}")
            r = r * size + c
        return r

    def check_world_size(self, world_size: int) -> None:
        """Raise MeshMismatchError unless the mesh has exactly ``world_size`` ranks."""
        if self.size != world_size:
            raise MeshMismatchError(
                f"the mesh {self.to_text() or '(empty)'} has {self.size} ranks; the world has {world_size}"
            )

    def to_text(self) -> str:
        return " ".join(f"{n}={s}" for n, s in self.axes)

    def to_dict(self) -> dict[str, Any]:
        return {"axes": [[n, s] for n, s in self.axes]}

    @classmethod
    def from_dict(cls, d: Any) -> Mesh:
        if not isinstance(d, dict) or set(d) != {"axes"} or not isinstance(d["axes"], list):
            raise InvalidLayoutError(f"a mesh is {{'axes': [[name, size], ...]}}, got {d!r}")
        return cls(tuple(tuple(a) if isinstance(a, list) else a for a in d["axes"]))


def parse_mesh(text: str) -> Mesh:
    """Parse ``"pp=2 dp=2 tp=4"`` (the empty string is the one-rank mesh)."""
    axes = []
    for item in text.split():
        name, eq, size = item.partition("=")
        if not eq or not size.isdigit():
            raise InvalidLayoutError(f"mesh item {item!r} is not <axis>=<size>")
        axes.append((name, int(size)))
    return Mesh(tuple(axes))
