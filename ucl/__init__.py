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

import os
from typing import Any

from ucl.errors import UCLError
from ucl.format.dtypes import register_zarr_dtypes as _register_zarr_dtypes
from ucl.format.repository import Repository
from ucl.io.stores import Store
from ucl.options import DEFAULT_READ, ReadOptions
from ucl.read.checkpoint import Checkpoint, open
from ucl.read.load import load, load_into
from ucl.read.tensors import LazyTensor, LogicalTensor
from ucl.tools.validate import Report, validate_repo
from ucl.write.manager import CheckpointManager, SaveHandle
from ucl.write.policy import AdaptiveInterval, DeltaPolicy
from ucl.write.save import save, save_sharded

__all__ = ["AdaptiveInterval", "Checkpoint", "CheckpointManager", "DeltaPolicy", "LazyTensor", "LogicalTensor",
           "Repository", "SaveHandle", "UCLError", "load", "load_into", "open", "save", "save_sharded", "validate",
           "zarr_store"]
__version__ = "0.1.0"


def validate(path: str | os.PathLike[str] | Store, step: int | None = None, *,
             storage_options: dict[str, Any] | None = None, checksums: bool = True,
             options: ReadOptions = DEFAULT_READ) -> Report:
    """Validate a repository (every committed step, or one) against the spec.

    Returns a report whose ``ok`` is the verdict and whose ``problems`` carry stable error codes; see
    :func:`ucl.tools.validate.validate_repo`.
    """
    return validate_repo(path, step, storage_options=storage_options, checksums=checksums, options=options)


def zarr_store(path: str | os.PathLike[str] | Store, step: int | None = None, *,
               storage_options: dict[str, Any] | None = None) -> Any:
    """A read-only Zarr v3 store over a committed step, deltas resolved and logical tensors rebuilt
    (:class:`ucl.adapters.zarr_store.ZarrStore`; needs zarr-python, imported on first use)."""
    from ucl.adapters.zarr_store import ZarrStore

    return ZarrStore(path, step, storage_options=storage_options)


# zarr-python learns bfloat16/float8 (also declared as entry points, for processes that never import ucl)
try:
    _register_zarr_dtypes()
except ImportError:  # zarr is a dependency; tolerate a broken install only for the registration
    pass
