"""fsspec backend: s3://, memory://, gs://, ... Object stores have atomic PUTs, so no rename is needed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import fsspec

from ucl import _native
from ucl.errors import WriteError
from ucl.storage.base import Buffer, Store, check_key


class FsspecStore(Store):
    """A repository at an fsspec URL; ``storage_options`` go to the filesystem unchanged."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.url = url

    def path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def read(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(key)))

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        return bytes(self.fs.cat_file(self.path(key), start=offset, end=offset + length))

    def write(self, key: str, buffers: Sequence[Buffer]) -> tuple[int, int]:
        crc = 0
        parts = []
        for b in buffers:
            mv = memoryview(b).cast("B")
            crc = _native.crc32c(mv, crc)
            parts.append(mv)
        data = b"".join(parts)
        try:
            self.fs.pipe_file(self.path(key), data)
        except OSError as e:
            raise WriteError(f"writing {self.url}/{key} failed: {e}", file=key) from e
        return len(data), crc

    def write_atomic(self, key: str, data: bytes) -> None:
        # A single PUT is atomic on object stores and in memory://.
        self.write(key, [data])

    def size(self, key: str) -> int | None:
        try:
            info = self.fs.info(self.path(key))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type", "file") == "file" else None

    def list_dir(self, prefix: str) -> list[str]:
        p = self.path(prefix) if prefix else self.root
        try:
            entries = self.fs.ls(p, detail=False)
        except FileNotFoundError:
            return []
        base = p.rstrip("/") + "/"
        out = set()
        for e in entries:
            e = e.rstrip("/")
            # memory:// returns absolute names with a leading '/'; s3 returns bucket-relative names
            for cand in (e, "/" + e, e.lstrip("/")):
                if cand.startswith(base):
                    out.add(cand[len(base):].split("/")[0])
                    break
        return sorted(x for x in out if x)

    def delete_prefix(self, prefix: str) -> None:
        p = self.path(prefix)
        try:
            self.fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass
