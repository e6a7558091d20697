"""Old module paths kept for one release (0.1.x): each re-exports the public names it had and warns."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def alias(old: str, names: dict[str, str]) -> Any:
    """A module ``__getattr__`` for ``old`` resolving ``names`` ({name: "new.module:attr"}) with a
    DeprecationWarning naming the new place."""

    def __getattr__(name: str) -> Any:
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        mod, attr = target.split(":")
        warnings.warn(f"{old}.{name} is deprecated: use {mod}.{attr}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(mod), attr)

    return __getattr__
