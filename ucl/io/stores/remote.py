"""fsspec backend: s3://, gs://, memory://, ... Object stores have atomic PUTs, so no rename is needed.

Configuration is the client's, passed through: ``storage_options`` go to the fsspec filesystem
unchanged, and s3fs (through botocore) reads the standard AWS_* environment variables itself,
AWS_ENDPOINT_URL included. Retries are the client's too (botocore's retry modes, s3fs's own).

Consistency: every listing and size query asks the server (``refresh=True``), never fsspec's listings
cache, so a reader polling for new steps sees a commit record as soon as the store does.

Large objects on S3 are uploaded as multipart uploads with several parts in flight (PART_BYTES each,
MULTIPART_CONCURRENCY at once), built from the caller's buffers one part at a time: memory beyond the
caller's buffers stays at concurrency x part size, whatever the object's size. A failed upload is
aborted, so no parts linger, and raises WriteError naming the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import fsspec.asyn

from ucl.errors import LimitExceededError, UCLError, WriteError
from ucl.io import native as _native
from ucl.io.stores.base import Buffer, FileInfo, Store, check_key

MULTIPART_MIN_BYTES = 64 << 20  # objects at least this large go up in parts, concurrently
PART_BYTES = 16 << 20  # S3 needs >= 5 MiB for every part but the last, and at most 10,000 parts
MULTIPART_CONCURRENCY = 8
_MIN_PART = 5 << 20
_MAX_PARTS = 10_000


class FsspecStore(Store):
    """A repository at an fsspec URL.

    Parameters
    ----------
    url
        ``s3://bucket/prefix``, ``memory://...``, or any fsspec URL.
    storage_options
        Passed to the filesystem unchanged (for s3fs: ``endpoint_url``, ``key``, ``secret``,
        ``client_kwargs``, ...). Without them, s3fs reads the AWS_* environment variables.
    multipart_min_bytes, part_bytes, concurrency
        Objects of at least ``multipart_min_bytes`` are uploaded in parts of ``part_bytes`` (raised when
        needed to stay within 10,000 parts), ``concurrency`` parts at a time; None: the module's
        MULTIPART_MIN_BYTES, PART_BYTES, MULTIPART_CONCURRENCY. S3 only; other filesystems get one
        ``pipe_file``.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        multipart_min_bytes: int | None = None,
        part_bytes: int | None = None,
        concurrency: int | None = None,
    ) -> None:
        self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.url = url
        self.multipart_min_bytes = max(
            MULTIPART_MIN_BYTES if multipart_min_bytes is None else multipart_min_bytes, _MIN_PART
        )
        self.part_bytes = max(PART_BYTES if part_bytes is None else part_bytes, _MIN_PART)
        self.concurrency = max(1, MULTIPART_CONCURRENCY if concurrency is None else concurrency)
        self._s3 = callable(getattr(self.fs, "_call_s3", None)) and getattr(self.fs, "async_impl", False)
        self._refresh = _accepts(self.fs.ls, "refresh")

    def path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    # -- reading -----------------------------------------------------------------------------------
    def read(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(key)))

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        path = self.path(key)
        try:
            return bytes(self.fs.cat_file(path, start=offset, end=offset + length))
        except FileNotFoundError:
            raise
        except OSError as e:
            # S3 answers a range that starts at or past the end with 416 (EINVAL here): that is a short read
            if e.errno == errno.EINVAL and (size := self.size(key)) is not None and offset >= size:
                return b""
            raise

    def read_bounded(self, key: str, limit: int) -> bytes:
        """The whole object, refused (LimitExceededError) when larger than ``limit``: one ranged GET of
        ``limit + 1`` bytes, which bounds the read and tells whether there is more (a HEAD first doubled
        the requests of every document an open reads)."""
        data = self.read_range(key, 0, limit + 1)
        if len(data) > limit:
            raise LimitExceededError(f"{key} is more than the limit of {limit} bytes", file=key)
        return data

    def size(self, key: str) -> int | None:
        path = self.path(key)
        try:
            info = self.fs.info(path, **({"refresh": True} if self._refresh else {}))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type", "file") == "file" else None

    def list_dir(self, prefix: str) -> list[str]:
        p = self.path(prefix) if prefix else self.root
        try:
            entries = self.fs.ls(p, detail=False, **({"refresh": True} if self._refresh else {}))
        except FileNotFoundError:
            return []
        base = p.rstrip("/") + "/"
        out = set()
        for e in entries:
            e = e.rstrip("/")
            # memory:// returns absolute names with a leading '/'; s3 returns bucket-relative names
            for cand in (e, "/" + e, e.lstrip("/")):
                if cand.startswith(base):
                    out.add(cand[len(base) :].split("/")[0])
                    break
        return sorted(x for x in out if x)

    # -- writing -----------------------------------------------------------------------------------
    def write(self, key: str, buffers: Sequence[Buffer], *, durable: bool = True) -> tuple[int, int]:
        path = self.path(key)
        views = [memoryview(b).cast("B") for b in buffers]
        crc = 0
        for mv in views:
            crc = _native.crc32c(mv, crc)
        size = sum(mv.nbytes for mv in views)
        try:
            if self._s3 and size >= self.multipart_min_bytes:
                fsspec.asyn.sync(
                    self.fs.loop,
                    _multipart_upload,
                    self.fs,
                    path,
                    views,
                    size,
                    self._part_size(size),
                    self.concurrency,
                )
            else:
                self.fs.pipe_file(path, b"".join(views))
        except UCLError:
            raise
        except Exception as e:  # noqa: BLE001 - any client failure is this key's WriteError
            raise _write_error(self.url, key, e) from e
        return size, crc

    def _part_size(self, size: int) -> int:
        return max(self.part_bytes, -(-size // _MAX_PARTS))

    def write_atomic(self, key: str, data: bytes) -> None:
        # One PUT is atomic on object stores (a reader sees the old object, or none, or all of the new
        # one) and in memory://. Commit records are small, so this is never a multipart upload.
        try:
            self.fs.pipe_file(self.path(key), bytes(data))
        except Exception as e:  # noqa: BLE001
            raise _write_error(self.url, key, e) from e

    def delete_prefix(self, prefix: str) -> None:
        p = self.path(prefix)
        self.fs.invalidate_cache(p)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(p, recursive=True)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(key))

    def walk(self, prefix: str) -> Iterator[FileInfo]:
        try:
            found = self.fs.find(self.path(prefix), detail=True)
        except FileNotFoundError:
            return
        root = self.root.lstrip("/") + "/"
        for name, info in found.items():
            rel = name[name.find(root) + len(root):] if root in name else name
            yield FileInfo(rel.lstrip("/"), int(info.get("size") or 0), _mtime_of(info))


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _write_error(url: str, key: str, e: BaseException) -> WriteError:
    return WriteError(f"writing {key} to {url} failed: {type(e).__name__}: {e}", file=key)


def _part(views: list[memoryview], lo: int, hi: int) -> bytes:
    """Bytes [lo, hi) of the concatenation of ``views``."""
    out = bytearray(hi - lo)
    pos = 0  # offset of the current view in the concatenation
    at = 0  # bytes of out filled
    for mv in views:
        end = pos + mv.nbytes
        if end > lo and pos < hi:
            a, b = max(lo, pos) - pos, min(hi, end) - pos
            out[at : at + b - a] = mv[a:b]
            at += b - a
        if end >= hi:
            break
        pos = end
    return bytes(out)


async def _multipart_upload(
    fs: Any, path: str, views: list[memoryview], size: int, part: int, concurrency: int
) -> None:
    """One S3 multipart upload of ``views``' concatenation, ``concurrency`` parts in flight, built one
    part at a time; aborted on any failure."""
    bucket, key, _ = fs.split_path(path)
    mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    upload_id = mpu["UploadId"]
    gate = asyncio.Semaphore(concurrency)

    async def one(number: int, lo: int) -> dict[str, Any]:
        async with gate:
            body = await asyncio.to_thread(_part, views, lo, min(lo + part, size))
            out = await fs._call_s3(
                "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )
            return {"PartNumber": number, "ETag": out["ETag"]}

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(i + 1, lo)) for i, lo in enumerate(range(0, size, part))]
        await fs._call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [t.result() for t in tasks]},
        )
    except BaseException as e:
        with contextlib.suppress(Exception):  # report the upload's error, not the abort's
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
            raise e.exceptions[0] from None
        raise
    finally:
        fs.invalidate_cache(path)


def _mtime_of(info: dict[str, Any]) -> float | None:
    for k in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if isinstance(v, int | float):
            return float(v)
        stamp = getattr(v, "timestamp", None)
        if callable(stamp):
            return float(stamp())
    return None
