"""ucl: the Universal Checkpoint Language and its I/O engine.

>>> import ucl
>>> ucl.save(model.state_dict(), "ckpt", step=100)
>>> ckpt = ucl.open("ckpt")            # latest committed step
>>> ckpt["layers.0.weight"][:128]      # reads only the chunks it needs
"""

from ucl.dtypes import register_zarr_dtypes as _register_zarr_dtypes
from ucl.errors import UCLError
from ucl.reader import Checkpoint, LazyTensor, LogicalTensor, open
from ucl.repo import Repository
from ucl.reshard import load, load_into
from ucl.writer import save

__all__ = ["Checkpoint", "LazyTensor", "LogicalTensor", "Repository", "UCLError", "load", "load_into", "open",
           "save", "validate", "zarr_store"]
__version__ = "0.1.0"


def validate(path, step=None, *, storage_options=None):  # type: ignore[no-untyped-def]
    """Validate a repository (every committed step, or one); see :func:`ucl.validate.validate_repo`."""
    from ucl.validator import validate_repo

    return validate_repo(path, step, storage_options=storage_options)


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """``ucl.zarr_store``, imported on first use: a callable module, ``ucl.zarr_store(path, step)``."""
    if name == "zarr_store":
        import importlib

        return importlib.import_module("ucl.zarr_store")
    raise AttributeError(f"module 'ucl' has no attribute {name!r}")


# zarr-python learns bfloat16/float8 (also declared as entry points, for processes that never import ucl)
try:
    _register_zarr_dtypes()
except ImportError:  # zarr is a dependency; tolerate a broken install only for the registration
    pass
