"""Byte access to a repository: local directories and fsspec URLs."""

from __future__ import annotations

import os
from typing import Any

from ucl.io.stores.base import Store, check_key
from ucl.io.stores.local import LocalStore

__all__ = ["Store", "LocalStore", "open_store", "check_key"]


def open_store(path: str | os.PathLike[str] | Store, storage_options: dict[str, Any] | None = None) -> Store:
    """A Store for a local path, a ``file://`` URL, or any fsspec URL (``s3://``, ``memory://``, ...)."""
    if isinstance(path, Store):
        return path
    path = os.fspath(path)
    if "://" not in path:
        return LocalStore(path)
    if path.startswith("file://"):
        return LocalStore(path[len("file://"):])
    from ucl.io.stores.remote import FsspecStore

    return FsspecStore(path, storage_options)
