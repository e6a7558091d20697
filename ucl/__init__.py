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

# The engine (torch, zarr, the C extensions) loads on the first use of a name below, not at `import ucl`:
# `ucl --version` and `import ucl.errors` stay instant (docs/architecture.md: nothing happens at import).
_state = "lazy"  # -> "loading" -> "loaded"


def _load() -> None:
    global _state
    _state = "loading"
    try:
        from ucl.format.repository import Repository
        from ucl.io.stores import Store
        from ucl.read.checkpoint import Checkpoint, open
        from ucl.read.load import load, load_into
        from ucl.read.tensors import LazyTensor, LogicalTensor
        from ucl.tools.validate import Report, validate_repo
        from ucl.write.manager import CheckpointManager, SaveHandle
        from ucl.write.policy import AdaptiveInterval, DeltaPolicy
        from ucl.write.save import save, save_sharded

        globals().update(
            Repository=Repository, Store=Store, Checkpoint=Checkpoint, open=open, load=load, load_into=load_into,
            LazyTensor=LazyTensor, LogicalTensor=LogicalTensor, Report=Report, validate_repo=validate_repo,
            CheckpointManager=CheckpointManager, SaveHandle=SaveHandle, AdaptiveInterval=AdaptiveInterval,
            DeltaPolicy=DeltaPolicy, save=save, save_sharded=save_sharded)
    except BaseException:
        _state = "lazy"
        raise
    _state = "loaded"


def __getattr__(name: str) -> Any:
    """The public names (and, after them, the subpackages) load on first use."""
    if name.startswith("_") or _state == "loading":  # `from ucl import _engine`: the submodule
        raise AttributeError(f"module 'ucl' has no attribute {name!r}")
    if _state == "lazy":
        _load()
    try:
        return globals()[name]
    except KeyError:
        raise AttributeError(f"module 'ucl' has no attribute {name!r}") from None


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
               storage_options: dict[str, Any] | None = None) -> Any:
    """A read-only Zarr v3 store over a committed step, deltas resolved and logical tensors rebuilt
    (:class:`ucl.adapters.zarr_store.ZarrStore`; needs zarr-python, imported on first use)."""
    from ucl.adapters.zarr_store import ZarrStore

    if _state == "lazy":
        _load()  # zarr learns the ucl dtypes
    return ZarrStore(path, step, storage_options=storage_options)

