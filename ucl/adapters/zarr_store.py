"""A committed step as a plain Zarr v3 hierarchy of logical tensors (DESIGN.md §3, "Level 1").

``ucl.zarr_store(path, step)`` returns a read-only :class:`zarr.abc.store.Store` whose keys are those of
an ordinary Zarr v3 hierarchy, generated from the step's metadata::

    zarr.json                       root group: attributes step, kind, parent; consolidated metadata
    <group>/zarr.json               one group per "/"-separated prefix of tensor names
    <tensor>/zarr.json              one array per tensor: its logical shape and dtype, codecs [bytes],
                                    dimension_names <name>/dim<i> (so xarray.open_zarr opens a group)
    <tensor>/c/<i>/<j>...           one chunk: its raw little-endian bytes, edge chunks zero-padded

Nothing is stored twice: chunk bytes are produced on demand by :meth:`ucl.LazyTensor.read_box`, which
reads only the inner chunks it needs and verifies their checksums (and resolves whatever the reader
resolves: delta chains, layout transforms). The chunk grid is the stored array's inner chunk grid when
that is a sensible chunk size, so one zarr chunk costs one stored inner chunk. A damaged or missing
shard raises the reader's error; it never reads as fill values.

``serve_http(path, step)`` serves the same keys over HTTP on loopback, so that tensorstore (or any
Zarr v3 reader with an HTTP store) can open the logical tensors too::

    with ucl.adapters.zarr_store.serve_http("ckpt") as srv:
        ts.open({"driver": "zarr3", "kvstore": {"driver": "http", "base_url": srv.url, "path": "w/"}})

This module is callable: ``ucl.adapters.zarr_store(path, step)`` is ``ucl.adapters.zarr_store.ZarrStore(path, step)``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import re
import threading
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from ucl.errors import InconsistentMetadataError, InvalidArgumentError
from ucl.format import dtypes, names
from ucl.format.metadata import dimension_names
from ucl.format.shardfile import choose_inner_chunk
from ucl.io.stores.base import Store as UCLStore
from ucl.read.checkpoint import Checkpoint
from ucl.read.checkpoint import open as open_checkpoint
from ucl.read.tensors import LazyTensor

__all__ = ["ZarrStore", "ZarrHTTPServer", "serve_http"]

# zarr-python learns bfloat16/float8 here too, not only from the entry points: a source tree run without
# installing ucl has none (ucl.open itself never imports zarr, which costs ~0.2 s)
dtypes.register_zarr_dtypes()

MIN_CHUNK_BYTES = 256 << 10  # an inner chunk smaller than this is not used as the zarr chunk
CHUNK_TARGET_BYTES = 4 << 20  # the chunk size chosen otherwise
_CHUNK_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class _ArrayView:
    """One tensor as a zarr array: its key, logical shape, dtype and chunk grid."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunks, strict=True))

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * self.itemsize

    def chunk_key(self, coords: tuple[int, ...]) -> str:
        return "/".join([self.key, "c", *map(str, coords)])

    def parse_chunk(self, rest: str) -> tuple[int, ...] | None:
        """Chunk coordinates of ``rest`` (the key after ``<tensor>/``), or None when it is not a chunk."""
        parts = rest.split("/")
        if parts[0] != "c" or len(parts) != len(self.shape) + 1:
            return None
        if not all(_CHUNK_INDEX.match(p) for p in parts[1:]):
            return None
        coords = tuple(int(p) for p in parts[1:])
        if any(i >= g for i, g in zip(coords, self.grid, strict=True)):
            return None
        return coords

    def document(self) -> dict[str, Any]:
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.chunks)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": dtypes.fill_value_json(self.dtype),
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}}
                if self.itemsize > 1
                else {"name": "bytes"}
            ],
            "attributes": {"ucl": {"name": self.name}},
            "dimension_names": dimension_names(self.name, len(self.shape)),
        }


def view_chunks(shape: tuple[int, ...], itemsize: int, inner: tuple[int, ...] | None) -> tuple[int, ...]:
    """The zarr chunk shape for a tensor of ``shape``.

    The stored inner chunk (``inner``) when it is at least MIN_CHUNK_BYTES, so that one zarr chunk is one
    stored chunk; a smaller one (a dimension with few divisors) is grown along its innermost split
    dimensions, by whole inner chunks, towards CHUNK_TARGET_BYTES. Without an inner chunk (a logical
    shape that differs from the stored one), ~CHUNK_TARGET_BYTES blocks of whole trailing dimensions.
    Chunks need not divide the shape: zarr pads edge chunks.
    """
    block = tuple(max(1, s) for s in shape)
    if inner is None or len(inner) != len(shape):
        inner = choose_inner_chunk(block, itemsize, CHUNK_TARGET_BYTES)
    chunks = [min(i, b) for i, b in zip(inner, block, strict=True)]
    for d in reversed(range(len(chunks))):
        cur = math.prod(chunks) * itemsize
        if cur >= MIN_CHUNK_BYTES:
            break
        if chunks[d] < block[d]:
            chunks[d] = min(block[d], chunks[d] * max(1, CHUNK_TARGET_BYTES // cur))
    return tuple(chunks)


class ZarrStore(Store):
    """A read-only Zarr v3 store over one committed step of a ucl repository.

    Parameters
    ----------
    path
        A repository (local directory, fsspec URL or ucl Store), or an open :class:`ucl.Checkpoint`
        (then ``step`` and ``storage_options`` must be None, and the checkpoint stays the caller's).
    step
        The step to present; None: the newest committed step at construction.
    storage_options
        fsspec options for URLs.
    read_only
        Must be True: a committed step never changes.
    approximate
        Present a composite step (spec/delta.md §9: some groups hold an older step's values), with an
        ``ApproximateWarning``, instead of refusing it (as :func:`ucl.open`).

    Raises
    ------
    CheckpointNotFoundError
        No such repository or step.
    InvalidArgumentError
        ``read_only=False``, or options given with a Checkpoint.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | UCLStore | Checkpoint,
        step: int | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        read_only: bool = True,
        approximate: bool = False,
    ) -> None:
        if not read_only:
            raise InvalidArgumentError("a ucl zarr store is read-only: a committed step never changes")
        super().__init__(read_only=True)
        if isinstance(path, Checkpoint):
            if step is not None or storage_options is not None:
                raise InvalidArgumentError("step and storage_options come from the Checkpoint; pass neither")
            self._ckpt, self._owns = path, False
        else:
            self._ckpt = open_checkpoint(path, step, storage_options=storage_options, approximate=approximate)
            self._owns = True
        self._location: Any = (
            self._ckpt.repo.store if not isinstance(path, str | os.PathLike) else os.fspath(path)
        )
        self._storage_options = storage_options
        self._docs: dict[str, bytes] = {}
        self._arrays: dict[str, _ArrayView] = {}
        self._groups: set[str] = {""}
        self._build()

    # -- the hierarchy -----------------------------------------------------------------------------
    def _build(self) -> None:
        consolidated: dict[str, Any] = {}
        for name in self._ckpt:
            lt = self._ckpt[name]
            view = _view_of(lt)
            parts = view.key.split("/")
            for i in range(1, len(parts)):
                g = "/".join(parts[:i])
                if g in self._arrays:
                    raise InconsistentMetadataError(
                        f"tensor {name!r} is inside tensor {self._arrays[g].name!r}", tensor=name
                    )
                if g not in self._groups:
                    self._groups.add(g)
                    consolidated[g] = {"zarr_format": 3, "node_type": "group", "attributes": {}}
            if view.key in self._groups:
                raise InconsistentMetadataError(
                    f"tensor {name!r} is also a group of other tensors", tensor=name
                )
            self._arrays[view.key] = view
            consolidated[view.key] = view.document()
        for key, doc in consolidated.items():
            self._docs[f"{key}/zarr.json"] = _dumps(doc)
        meta = self._ckpt.meta
        self._docs["zarr.json"] = _dumps(
            {
                "zarr_format": 3,
                "node_type": "group",
                "attributes": {"step": self._ckpt.step, "kind": meta.kind, "parent": meta.parent},
                "consolidated_metadata": {
                    "kind": "inline",
                    "must_understand": False,
                    "metadata": dict(sorted(consolidated.items())),
                },
            }
        )

    @property
    def checkpoint(self) -> Checkpoint:
        """The open step that chunks are read from (``checkpoint.bytes_read`` counts what they cost)."""
        return self._ckpt

    @property
    def step(self) -> int:
        return self._ckpt.step

    def _locate(self, key: str) -> tuple[_ArrayView, tuple[int, ...]] | None:
        """The array and chunk coordinates of a chunk key, or None."""
        i = key.find("/c")
        while i > 0:
            view = self._arrays.get(key[:i])
            if view is not None:
                coords = view.parse_chunk(key[i + 1 :])
                return None if coords is None else (view, coords)
            i = key.find("/c", i + 1)
        return None

    def _chunk(self, view: _ArrayView, coords: tuple[int, ...]) -> np.ndarray:
        """The bytes of one chunk (a uint8 array of the full chunk size), read through the checkpoint."""
        start = tuple(c * n for c, n in zip(coords, view.chunks, strict=True))
        shape = tuple(min(n, s - a) for n, s, a in zip(view.chunks, view.shape, start, strict=True))
        data = self._ckpt[view.name].read_box(start, shape)
        if shape != view.chunks:  # an edge chunk: zarr stores it full-size
            padded = torch.zeros(view.chunks, dtype=data.dtype)
            padded[tuple(slice(0, n) for n in shape)] = data
            data = padded
        return data.reshape(-1).view(torch.uint8).numpy()

    def _value(self, key: str) -> bytes | np.ndarray | None:
        doc = self._docs.get(key)
        if doc is not None:
            return doc
        loc = self._locate(key)
        return None if loc is None else self._chunk(*loc)

    # -- zarr.abc.store.Store: reading -------------------------------------------------------------
    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        _check_range(byte_range)
        doc = self._docs.get(key)
        if doc is not None:
            return _buffer(prototype, doc, byte_range)
        loc = self._locate(key)
        if loc is None:
            return None
        data = await asyncio.to_thread(self._chunk, *loc)
        return _buffer(prototype, data, byte_range)

    def get_sync(
        self, key: str, *, prototype: BufferPrototype | None = None, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """Synchronous :meth:`get` (zarr's SupportsGetSync)."""
        _check_range(byte_range)
        value = self._value(key)
        return None if value is None else _buffer(prototype or default_buffer_prototype(), value, byte_range)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        return key in self._docs or self._locate(key) is not None

    async def getsize(self, key: str) -> int:
        doc = self._docs.get(key)
        if doc is not None:
            return len(doc)
        loc = self._locate(key)
        if loc is None:
            raise FileNotFoundError(key)
        return loc[0].chunk_nbytes

    # -- listing -----------------------------------------------------------------------------------
    @property
    def supports_listing(self) -> bool:
        return True

    def _keys(self, prefix: str = "") -> Iterator[str]:
        for key in self._docs:
            if key.startswith(prefix):
                yield key
        for akey, view in self._arrays.items():
            base = f"{akey}/c"
            if base.startswith(prefix) or prefix.startswith(base):
                for coords in itertools.product(*(range(g) for g in view.grid)):
                    k = view.chunk_key(coords)
                    if k.startswith(prefix):
                        yield k

    async def list(self) -> AsyncIterator[str]:
        for key in self._keys():
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in self._keys(prefix):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        for child in self._children(prefix.rstrip("/")):
            yield child

    def _children(self, prefix: str) -> tuple[str, ...]:
        view = self._arrays.get(prefix)
        if view is not None:
            return ("c", "zarr.json") if all(view.grid) else ("zarr.json",)
        for akey, view in self._arrays.items():  # inside an array's chunk directory
            base = f"{akey}/c"
            if prefix == base or prefix.startswith(base + "/"):
                done = prefix[len(base) :].split("/")[1:]
                if len(done) >= len(view.shape) or not all(_CHUNK_INDEX.match(p) for p in done):
                    return ()
                coords = [int(p) for p in done]
                if any(i >= g for i, g in zip(coords, view.grid, strict=False)):
                    return ()
                return tuple(str(i) for i in range(view.grid[len(done)]))
        if prefix not in self._groups:
            return ()
        out = {"zarr.json"}
        start = f"{prefix}/" if prefix else ""
        for key in itertools.chain(self._groups, self._arrays):
            if key and key.startswith(start):
                out.add(key[len(start) :].split("/")[0])
        return tuple(sorted(out))

    # -- writing: refused --------------------------------------------------------------------------
    @property
    def supports_writes(self) -> bool:
        return False

    @property
    def supports_deletes(self) -> bool:
        return False

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        self._check_writable()

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        self._check_writable()

    async def delete(self, key: str) -> None:
        self._check_writable()

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()

    async def clear(self) -> None:
        self._check_writable()

    def with_read_only(self, read_only: bool = False) -> ZarrStore:
        """A new, unopened store over the same step; only ``read_only=True`` is possible."""
        if not read_only:
            return super().with_read_only(read_only)  # type: ignore[return-value]  # NotImplementedError
        if not self._owns:
            return ZarrStore(self._ckpt)
        return ZarrStore(self._location, self.step, storage_options=self._storage_options)

    # -- identity and lifecycle --------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ZarrStore)
            and self._ckpt.repo.url == other._ckpt.repo.url
            and self.step == other.step
        )

    def __hash__(self) -> int:
        return hash((self._ckpt.repo.url, self.step))

    def __repr__(self) -> str:
        return f"ZarrStore({self._ckpt.repo.url!r}, step={self.step})"

    def __getstate__(self) -> dict[str, Any]:
        return {
            "location": self._location,
            "step": self.step,
            "storage_options": self._storage_options,
            "is_open": self._is_open,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["location"], state["step"], storage_options=state["storage_options"])  # type: ignore[misc]
        self._is_open = state["is_open"]

    def close(self) -> None:
        super().close()
        if self._owns:
            self._ckpt.close()


def _view_of(lt: LazyTensor) -> _ArrayView:
    shape = tuple(lt.shape)
    dtype = dtypes.from_torch(lt.dtype)
    meta = lt.meta  # None for a logical tensor of a layout step: its elements span stored boxes
    inner = meta.inner_chunk_shape if meta is not None and tuple(meta.shape) == shape else None
    return _ArrayView(
        lt.name, names.to_key(lt.name), shape, dtype, view_chunks(shape, dtypes.itemsize(dtype), inner)
    )


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, indent=1, allow_nan=False).encode()


def _check_range(byte_range: object) -> None:
    if byte_range is not None and not isinstance(
        byte_range, RangeByteRequest | OffsetByteRequest | SuffixByteRequest
    ):
        raise TypeError(f"Unexpected byte_range, got {byte_range!r}.")


def _slice(n: int, byte_range: ByteRequest | None) -> slice:
    if byte_range is None:
        return slice(0, n)
    if isinstance(byte_range, RangeByteRequest):
        return slice(byte_range.start, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return slice(byte_range.offset, n)
    return slice(max(0, n - byte_range.suffix), n)


def _buffer(prototype: BufferPrototype, value: bytes | np.ndarray, byte_range: ByteRequest | None) -> Buffer:
    part = value[_slice(len(value), byte_range)]
    if isinstance(part, bytes):
        return prototype.buffer.from_bytes(part)
    return prototype.buffer.from_array_like(part)


# -- HTTP, for tensorstore and other readers --------------------------------------------------------
class ZarrHTTPServer:
    """A threaded HTTP server (stdlib) serving a :class:`ZarrStore`'s keys; GET and HEAD, with Range.

    Use as a context manager; ``url`` is the base URL. Bind to loopback unless you mean to share the
    checkpoint: there is no authentication.
    """

    def __init__(self, store: ZarrStore, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = store
        self._httpd = ThreadingHTTPServer((host, port), _handler(store))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = (str(x) for x in self._httpd.server_address[:2])
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def start(self) -> ZarrHTTPServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, name="ucl-zarr-http", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> ZarrHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_http(
    path: Any,
    step: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    storage_options: dict[str, Any] | None = None,
) -> ZarrHTTPServer:
    """Serve a step's zarr view over HTTP (started; close it, or use ``with``).

    Parameters
    ----------
    path
        What :class:`ZarrStore` accepts, or a ZarrStore.
    host, port
        Where to listen; port 0 picks a free port (see ``url``).
    """
    store = path if isinstance(path, ZarrStore) else ZarrStore(path, step, storage_options=storage_options)
    return ZarrHTTPServer(store, host, port).start()


_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _handler(store: ZarrStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet by default
            pass

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            key = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
            try:
                value = store._value(key) if key else None
            except Exception as e:  # noqa: BLE001 - a read error is the client's 500, never zeros
                self._reply(500, f"{type(e).__name__}: {e}".encode(), body)
                return
            if value is None:
                self._reply(404, b"not found", body)
                return
            data = value.data.cast("B") if isinstance(value, np.ndarray) else memoryview(value)
            n = len(data)
            rng = self.headers.get("Range")
            if rng is None:
                self._reply(200, data, body)
                return
            m = _RANGE.match(rng.strip())
            if m is None or m.group(1) == m.group(2) == "":
                self._reply(416, b"unsupported range", body, {"Content-Range": f"bytes */{n}"})
                return
            if m.group(1) == "":
                lo, hi = max(0, n - int(m.group(2))), n
            else:
                lo, hi = int(m.group(1)), min(n, int(m.group(2)) + 1 if m.group(2) else n)
            if lo >= n or hi <= lo:
                self._reply(416, b"range not satisfiable", body, {"Content-Range": f"bytes */{n}"})
                return
            self._reply(206, data[lo:hi], body, {"Content-Range": f"bytes {lo}-{hi - 1}/{n}"})

        def _reply(
            self, code: int, data: bytes | memoryview, body: bool, headers: dict[str, str] | None = None
        ) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.send_header(
                "Content-Type",
                "application/json" if self.path.endswith("zarr.json") else "application/octet-stream",
            )
            self.send_header("Accept-Ranges", "bytes")
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler
