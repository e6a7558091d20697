"""ucl: the Universal Checkpoint Language and its I/O engine.

>>> import ucl
>>> ucl.save(model.state_dict(), "ckpt", step=100)
>>> ckpt = ucl.open("ckpt")            # latest committed step
>>> ckpt["layers.0.weight"][:128]      # reads only the chunks it needs
>>> with ucl.CheckpointManager("ckpt", keep_last=3) as mgr:
...     mgr.save(101, {"model": model.state_dict()})   # returns once staged; persists in the background

The public API is this module's ``__all__``; everything else is an implementation module (the map of
the package: docs/architecture.md).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING, Any

from ucl.errors import UCLError
from ucl.options import DEFAULT_READ, ReadOptions

if TYPE_CHECKING:
    from ucl.format.repository import Repository
    from ucl.io.stores import Store
    from ucl.read.checkpoint import Checkpoint, open
    from ucl.read.load import load, load_into
    from ucl.read.tensors import LazyTensor, LogicalTensor
    from ucl.tools.validate import Report
    from ucl.write.manager import CheckpointManager, SaveHandle
    from ucl.write.policy import AdaptiveInterval, DeltaPolicy
    from ucl.write.save import save, save_sharded

# The engine (torch, the C extensions) loads on the first use of a name below, not at `import ucl`, and only
# the module that defines that name: `ucl --version` and `import ucl.errors` stay instant, and `ucl.open`
# does not import the writer (docs/architecture.md: nothing happens at import).
_HOME = {
    "Repository": "ucl.format.repository", "Store": "ucl.io.stores",
    "Checkpoint": "ucl.read.checkpoint", "open": "ucl.read.checkpoint",
    "load": "ucl.read.load", "load_into": "ucl.read.load",
    "LazyTensor": "ucl.read.tensors", "LogicalTensor": "ucl.read.tensors",
    "Report": "ucl.tools.validate", "validate_repo": "ucl.tools.validate",
    "CheckpointManager": "ucl.write.manager", "SaveHandle": "ucl.write.manager",
    "AdaptiveInterval": "ucl.write.policy", "DeltaPolicy": "ucl.write.policy",
    "save": "ucl.write.save", "save_sharded": "ucl.write.save",
}
_SUBPACKAGES = frozenset({"adapters", "delta", "format", "io", "layout", "plan", "read", "testing", "tools", "write"})


def __getattr__(name: str) -> Any:
    """A public name loads its module on first use; a subpackage (``ucl.format``) is imported."""
    home = _HOME.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"ucl.{name}")
    else:
        raise AttributeError(f"module 'ucl' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["AdaptiveInterval", "Checkpoint", "CheckpointManager", "DeltaPolicy", "LazyTensor", "LogicalTensor",
           "Repository", "SaveHandle", "UCLError", "load", "load_into", "open", "save", "save_sharded", "validate",
           "zarr_store"]
__version__ = "0.1.0"

# the engine logs to logging.getLogger("ucl") and its children (ucl.write.events); where the records go is
# the application's choice: the library attaches no handler but this one, which drops them
logging.getLogger("ucl").addHandler(logging.NullHandler())


def validate(path: str | os.PathLike[str] | Store, step: int | None = None, *,
             storage_options: dict[str, Any] | None = None, checksums: bool = True,
             options: ReadOptions = DEFAULT_READ) -> Report:
    """Validate a repository (every committed step, or one) against the spec.

    Returns a report whose ``ok`` is the verdict and whose ``problems`` carry stable error codes; see
    :func:`ucl.tools.validate.validate_repo`.
    """
    from ucl.tools.validate import validate_repo

    return validate_repo(path, step, storage_options=storage_options, checksums=checksums, options=options)


def zarr_store(path: str | os.PathLike[str] | Store, step: int | None = None, *,
               storage_options: dict[str, Any] | None = None, approximate: bool = False) -> Any:
    """A read-only Zarr v3 store over a committed step, deltas resolved and logical tensors rebuilt
    (:class:`ucl.adapters.zarr_store.ZarrStore`; needs zarr-python, imported on first use).
    ``approximate``: as for :func:`ucl.open` (a composite step is refused without it)."""
    from ucl.adapters.zarr_store import ZarrStore  # (registers the ucl dtypes with zarr)

    return ZarrStore(path, step, storage_options=storage_options, approximate=approximate)

