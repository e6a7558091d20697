"""The fixtures: small repositories under fixtures/<rel>, written by ucl's writer and then edited by hand.

``Fx`` writes a repository with ``ucl.save`` or shard by shard with ``StepWriter`` (chosen chunk grids), then
damages it: raw edits that leave the commit record as it was (integrity damage), or edits that are
*resealed*, every size, crc32c and checksum covering the edited bytes recomputed (semantic and hostile
damage), so only the lie is left for a reader to catch. Data comes from fixed seeds and commits carry a
fixed time, so generation is deterministic. Also the small states most invalid fixtures start from.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

import ucl
from ucl.format import metadata
from ucl.format.metadata import ArrayMeta, CommitRecord, StepMeta
from ucl.format.repository import Repository
from ucl.format.shardfile import file_digest
from ucl.io import native as _native
from ucl.options import WriteOptions
from ucl.plan.save import all_shards, array_for, shard_block
from ucl.write.step import StepWriter

FIXED_TIME = "2026-01-01T00:00:00.000000Z"
#: The fixtures are steps of format version 1 (spec/core.md §9 item 5): every reader of version 2 reads
#: them, and so does a Level-0 implementation of version 1 (conformance/independent)
V1 = WriteOptions(format_version=1)
ZSTD = {"name": "zstd", "configuration": {"level": 1, "checksum": False}}
EMPTY64 = (1 << 64) - 1


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaN payloads, subnormals, negative zeros included); bools are 0/1."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).view(torch.bool).reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).clone()


def crc(data: bytes) -> int:
    return _native.crc32c(data)


def sub_json(raw: bytes, old: bytes, new: bytes) -> bytes:
    """``raw`` with the first ``old`` replaced by ``new``, ``old`` matched as written with spaces after
    ``:`` and ``,`` (documents edited here) or without (documents as ucl writes them: compact); a
    pattern found in neither form stops the generator (a silent no-op would commit a wrong fixture)."""
    for form in (old, old.replace(b'": ', b'":').replace(b", ", b",")):
        if form in raw:
            return raw.replace(form, new, 1)
    raise SystemExit(f"the pattern {old!r} is not in the document")


def seal_commit(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    doc = {**body, "checksum": crc(metadata.canonical(body))}
    return metadata.dumps(doc)


class Fx:
    """A fixture repository under fixtures/<rel>, built with ucl's writer and then edited by hand."""

    def __init__(self, root: Path, rel: str, version: int = 1) -> None:
        self.rel = rel
        #: the format version its steps are written in (1, or 2 for cases/version2.json: then its commit
        #: records stay grouped, ``ucl_commit`` 2, through edits)
        self.version = version
        self.path = root / rel
        if self.path.exists() or self.path.is_symlink():
            raise SystemExit(f"fixture {rel} is declared twice")
        self.path.mkdir(parents=True)

    # -- writing ---------------------------------------------------------------------------------
    def save(self, state: dict[str, Any], step: int, compression: str | None = None) -> None:
        ucl.save(state, self.path, step=step, compression=compression,
                 options=WriteOptions(format_version=self.version))
        self.fix_time(step)

    def write(
        self,
        step: int,
        arrays: Iterable[tuple[ArrayMeta, torch.Tensor]],
        tree: dict[str, Any] | None = None,
        commit: bool = True,
    ) -> None:
        """A step of arrays with chosen chunk grids, written shard by shard as ranks would."""
        arrays = list(arrays)
        repo = Repository.open(self.path, create=True)
        w = StepWriter(repo, step, format_version=self.version)
        w.begin()
        files = {}
        for meta, t in arrays:
            for coords in all_shards(meta):
                rel, entry = w.write_shard(meta, coords, shard_block(meta, coords, t))
                files[rel] = entry
        if tree is None:
            tree = {"t": "dict", "items": [[m.name, {"t": "tensor", "name": m.name}] for m, _ in arrays]}
        w.commit(StepMeta(step=step, kind="full", tree=tree, arrays={m.name: m for m, _ in arrays}), files)
        if commit:
            self.fix_time(step)
        else:
            (self.path / f"commits/{step}.json").unlink()

    def fix_time(self, step: int) -> None:
        self.edit_commit(step, lambda d: d.__setitem__("time", FIXED_TIME))

    # -- raw edits ---------------------------------------------------------------------------------
    def p(self, rel: str) -> Path:
        return self.path / rel

    def read(self, rel: str) -> bytes:
        return self.p(rel).read_bytes()

    def put(self, rel: str, data: bytes) -> None:
        self.p(rel).parent.mkdir(parents=True, exist_ok=True)
        self.p(rel).write_bytes(data)

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read(rel))

    def commit_doc(self, step: int) -> dict[str, Any]:
        """The commit record in version 1 form (``files`` keyed by whole paths), which every reader of
        version 2 reads too: edits address files by path. A record written grouped (version 2,
        spec/core.md §7) is flattened; an edited record is written back in version 1 form."""
        doc: dict[str, Any] = self.read_json(f"commits/{step}.json")
        if doc.get("ucl_commit") == 2 and isinstance(doc.get("files"), dict):
            doc["ucl_commit"] = 1
            doc["files"] = {f"{p}/{r}" if p else r: v
                            for p, group in doc["files"].items() for r, v in group.items()}
        return doc

    def edit_commit(self, step: int, fn: Callable[[dict[str, Any]], Any]) -> None:
        """Change the commit record and recompute its checksum; in a fixture of version 2 the record is
        written back grouped (``ucl_commit`` 2) as ucl's writer groups it."""
        doc = self.commit_doc(step)
        fn(doc)
        if self.version == 2:
            body = {k: v for k, v in doc.items() if k != "checksum"}
            rec = CommitRecord(step=body.pop("step"), kind=body.pop("kind"), parent=body.pop("parent"),
                               time=body.pop("time"), files={k: tuple(v) for k, v in body.pop("files").items()})
            assert body == {"ucl_commit": 1}, f"{self.rel}: a grouped record cannot hold {sorted(body)}"
            self.put(f"commits/{step}.json", rec.to_bytes())
            return
        self.put(f"commits/{step}.json", seal_commit(doc))

    def reseal(self, step: int, *rels: str) -> None:
        """Record the current size and crc32c of files of the step (paths relative to steps/<step>/)."""

        def upd(doc: dict[str, Any]) -> None:
            for rel in rels:
                data = self.read(f"steps/{step}/{rel}")
                doc["files"][rel] = [len(data), self.checksum(step, rel, data)]

        self.edit_commit(step, upd)

    def checksum(self, step: int, rel: str, data: bytes) -> int:
        """The commit record's checksum of a file (spec/core.md §7): crc32c of a document, the digest
        of a shard (the crc32c of its chunk and index crc32c's)."""
        if (
            rel == "zarr.json"
            or rel.endswith("/zarr.json")
            or ("/c/" not in f"/{rel}" and not rel.endswith("/c"))
        ):
            return crc(data)
        array = rel[: rel.rindex("/c/")] if "/c/" in rel else rel[: -len("/c")]
        try:
            doc = self.read_json(f"steps/{step}/{array}/zarr.json")
            cfg = doc["codecs"][0]["configuration"]
            outer, inner = doc["chunk_grid"]["configuration"]["chunk_shape"], cfg["chunk_shape"]
            n = 1
            for o, i in zip(outer, inner, strict=True):
                n *= o // i
        except (KeyError, ValueError, TypeError, ZeroDivisionError, FileNotFoundError, IndexError):
            return crc(data)  # hostile documents: any checksum will do, another check fails first
        return file_digest(data, n)

    def edit_json(self, rel: str, fn: Callable[[Any], Any], reseal_step: int | None = None) -> None:
        doc = self.read_json(rel)
        fn(doc)  # edits in place; what it returns is ignored
        # one line: an edited document stays small even when it nests deeply
        self.put(rel, json.dumps(doc, allow_nan=False).encode())
        if reseal_step is not None:
            self.reseal(reseal_step, rel.split("/", 2)[2])

    def edit_step_doc(self, step: int, fn: Callable[[dict[str, Any]], Any]) -> None:
        self.edit_json(f"steps/{step}/zarr.json", fn, reseal_step=step)

    def edit_array(
        self,
        step: int,
        key: str,
        fn: Callable[[dict[str, Any]], Any],
        *,
        doc: bool = True,
        consolidated: bool = True,
    ) -> None:
        """Apply ``fn`` to an array's document and/or its consolidated copy, resealed."""
        if consolidated:
            self.edit_step_doc(step, lambda d: fn(d["consolidated_metadata"]["metadata"][key]))
        if doc:
            self.edit_json(f"steps/{step}/{key}/zarr.json", fn, reseal_step=step)

    def flip(self, rel: str, offset: int, mask: int = 0x01) -> None:
        data = bytearray(self.read(rel))
        data[offset] ^= mask
        self.put(rel, bytes(data))

    def truncate(self, rel: str, size: int) -> None:
        self.put(rel, self.read(rel)[:size])

    def shard_index(self, rel: str, n: int) -> list[list[int]]:
        data = self.read(rel)
        body = data[len(data) - 16 * n - 4 : len(data) - 4]
        return [list(struct.unpack_from("<QQ", body, 16 * i)) for i in range(n)]

    def put_shard(self, step: int, key: str, chunks: list[bytes | None]) -> None:
        """Write a shard from encoded inner chunks (None: absent) with valid crc32c's, resealed."""
        data, index = b"", b""
        for c in chunks:
            if c is None:
                index += struct.pack("<QQ", EMPTY64, EMPTY64)
            else:
                index += struct.pack("<QQ", len(data), len(c) + 4)
                data += c + struct.pack("<I", crc(c))
        self.put(f"steps/{step}/{key}", data + index + struct.pack("<I", crc(index)))
        self.reseal(step, key)

    def put_shard_index(self, step: int, key: str, entries: list[list[int]], reseal: bool = True) -> None:
        """Rewrite a shard's index (with a valid index crc32c) and reseal it in the commit record."""
        rel = f"steps/{step}/{key}"
        data = self.read(rel)
        n = len(entries)
        body = b"".join(struct.pack("<QQ", o, b) for o, b in entries)
        self.put(rel, data[: len(data) - 16 * n - 4] + body + struct.pack("<I", crc(body)))
        if reseal:
            self.reseal(step, key)


# -- the starting points of most invalid and hostile fixtures ----------------------------------------
def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The small state most invalid fixtures damage: one 2-D float32 tensor, one scalar."""
    return {"w": random_tensor((4, 3), torch.float32, seed), "s": random_tensor((), torch.int64, seed + 1)}


def multi_shard_arrays(seed: int) -> list[tuple[ArrayMeta, torch.Tensor]]:
    """Arrays whose chunk grid has several shards (one per writer) and several inner chunks per shard."""
    specs = [
        # name, shape, dtype, chunk (one writer's block), inner chunk
        ("w", (10, 7), torch.float32, (4, 3), (2, 3)),  # 3x3 shards, clipped edges, absent inner chunks
        ("v", (9,), torch.bfloat16, (4,), (2,)),  # last shard: 1 element, one padded, one absent chunk
        ("m", (5, 4, 3), torch.bool, (2, 4, 2), (1, 2, 2)),
        ("i", (6, 6), torch.int64, (3, 3), (3, 3)),
        ("f8", (7, 5), torch.float8_e5m2, (7, 2), (1, 2)),
    ]
    out = []
    for k, (name, shape, dt, chunk, inner) in enumerate(specs):
        t = random_tensor(shape, dt, seed + k)
        meta = dataclasses.replace(array_for(name, t, chunk_shape=chunk), inner_chunk_shape=inner)
        out.append((meta, t))
    return out


def tiny(root: Path, rel: str, seed: int = 800) -> tuple[Fx, dict[str, torch.Tensor]]:
    """A fixture of ``tiny_state(seed)`` saved as step 1."""
    f = Fx(root, rel)
    st = tiny_state(seed)
    f.save(st, 1)
    return f, st


def multi(root: Path, rel: str, keep: str = "w", seed: int = 900) -> tuple[Fx, dict[str, torch.Tensor]]:
    """A fixture of the multi-shard arrays named in ``keep`` (comma-separated) written as step 1."""
    f = Fx(root, rel)
    arrays = [(m, t) for m, t in multi_shard_arrays(seed) if m.name in keep.split(",")]
    f.write(1, arrays)
    return f, {m.name: t for m, t in arrays}


def rename_key(f: Fx, old: str, new: str) -> None:
    """Move an array's consolidated entry (and its files) to another key of step 1; its name is unchanged."""

    def mv(d: dict[str, Any]) -> None:
        m = d["consolidated_metadata"]["metadata"]
        m[new] = m.pop(old)

    f.edit_step_doc(1, mv)


def json_depth(v: Any) -> int:
    """The nesting depth of a JSON value (a scalar 0, each object or array one more)."""
    if isinstance(v, dict):
        return 1 + max((json_depth(x) for x in v.values()), default=0)
    if isinstance(v, list):
        return 1 + max((json_depth(x) for x in v), default=0)
    return 0
