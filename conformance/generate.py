#!/usr/bin/env python3
"""Generate the conformance fixtures and case files, once. Both are committed; nothing regenerates them.

Usage::

    python conformance/generate.py            # refuses when conformance/fixtures exists
    python conformance/generate.py --force    # deliberate regeneration: review `git diff --stat` after
    python conformance/generate.py --check    # regenerate into a temporary folder and diff (no writes)

Valid fixtures are written by ucl's reference writer (``ucl.save``, ``StepWriter``). Invalid and hostile
fixtures are copies of small valid repositories, then damaged. Two kinds of damage:

- *integrity* damage (bit flips, truncations, deletions) leaves the commit record as it was, as a disk
  or a buggy copy would;
- *semantic* and *hostile* damage (lying metadata) is **resealed**: every size, crc32c and checksum that
  covers the damaged bytes is recomputed, so that only the lie itself is left for a reader to catch.

Generation is deterministic (fixed data seeds, a fixed commit time), so ``--check`` shows whether the
committed fixtures still are what this script and the current writer produce. A difference is not a
failure of the suite: committed fixtures are the compatibility record and are changed only on purpose.

Each fixture's cases are declared next to it, with expected data as the sha256 of the little-endian
bytes of the *original* tensors (never of what a reader returned).
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import hashlib
import json
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

import ucl
from ucl.format import metadata, names, structure
from ucl.format.metadata import ArrayMeta, StepMeta
from ucl.format.repository import Repository
from ucl.format.shardfile import file_digest
from ucl.io import native as _native
from ucl.plan.save import all_shards, array_for, shard_block
from ucl.write.step import StepWriter

HERE = Path(__file__).resolve().parent
FIXED_TIME = "2026-01-01T00:00:00.000000Z"
ZSTD = {"name": "zstd", "configuration": {"level": 1, "checksum": False}}
EMPTY64 = (1 << 64) - 1

# spec sections (spec/core.md)
S_LAYOUT = "core.md §3 Repository layout"
S_REPO_DOC = "core.md §3.1 Repository document"
S_DTYPES = "core.md §4 Data types"
S_STEP_DOC = "core.md §5.1 Step group document"
S_NAMES = "core.md §5.2 Tensor names"
S_TREE = "core.md §5.3 Structure tree"
S_ARRAYS = "core.md §6 Arrays"
S_SHARD = "core.md §6.1 Shard encoding"
S_COMMIT = "core.md §7 Commit protocol"
S_INTEGRITY = "core.md §8 Integrity"
S_LIMITS = "core.md §8.4 Integrity (limits)"
S_EXT = "core.md §9 Extensions and versioning"

# spec sections (spec/delta.md)
S_GRAD = "delta.md §8 Extension: gradient records"
S_GRAD_SEM = "delta.md §8.1 Semantics"
S_GRAD_VAL = "delta.md §8.3 Validation"

assert sys.byteorder == "little", "expected data is computed from host bytes"


# -- cases ------------------------------------------------------------------------------------------
class Suite:
    """Cases by feature, in declaration order."""

    def __init__(self) -> None:
        self.by_feature: dict[str, list[dict[str, Any]]] = {}

    def add(
        self,
        feature: str,
        description: str,
        section: str,
        fixture: str,
        operation: str,
        args: dict[str, Any] | None = None,
        **expected: Any,
    ) -> None:
        self.by_feature.setdefault(feature, []).append(
            {
                "description": description,
                "spec_section": section,
                "fixture": fixture,
                "operation": operation,
                "args": args or {},
                "expected": {k: v for k, v in expected.items() if v is not None},
            }
        )


def le_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()


def sha(t: torch.Tensor, box: list[list[int]] | None = None) -> str:
    if box is not None:
        t = t[tuple(slice(a, b) for a, b in box)]
    return hashlib.sha256(le_bytes(t)).hexdigest()


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


# -- a fixture repository ---------------------------------------------------------------------------
def crc(data: bytes) -> int:
    return _native.crc32c(data)


def seal_commit(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    doc = {**body, "checksum": crc(metadata.canonical(body))}
    return metadata.dumps(doc)


class Fx:
    """A fixture repository under fixtures/<rel>, built with ucl's writer and then edited by hand."""

    def __init__(self, root: Path, rel: str) -> None:
        self.rel = rel
        self.path = root / rel
        if self.path.exists() or self.path.is_symlink():
            raise SystemExit(f"fixture {rel} is declared twice")
        self.path.mkdir(parents=True)

    # -- writing ---------------------------------------------------------------------------------
    def save(self, state: dict[str, Any], step: int, compression: str | None = None) -> None:
        ucl.save(state, self.path, step=step, compression=compression)
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
        w = StepWriter(repo, step)
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
        return self.read_json(f"commits/{step}.json")  # type: ignore[no-any-return]

    def edit_commit(self, step: int, fn: Callable[[dict[str, Any]], Any]) -> None:
        """Change the commit record and recompute its checksum."""
        doc = self.commit_doc(step)
        fn(doc)
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
        if rel == "zarr.json" or rel.endswith("/zarr.json") or "/c/" not in f"/{rel}" and not rel.endswith("/c"):
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


# -- the fixtures -------------------------------------------------------------------------------------
DTYPES = [
    ("bool", torch.bool),
    ("int8", torch.int8),
    ("int16", torch.int16),
    ("int32", torch.int32),
    ("int64", torch.int64),
    ("uint8", torch.uint8),
    ("uint16", torch.uint16),
    ("uint32", torch.uint32),
    ("uint64", torch.uint64),
    ("float16", torch.float16),
    ("float32", torch.float32),
    ("float64", torch.float64),
    ("bfloat16", torch.bfloat16),
    ("float8_e4m3fn", torch.float8_e4m3fn),
    ("float8_e5m2", torch.float8_e5m2),
    ("complex64", torch.complex64),
    ("complex128", torch.complex128),
]


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


def dyadic(shape: tuple[int, ...], seed: int, scale: int) -> torch.Tensor:
    """float32 multiples of 1/scale from a seeded integer generator: the same bits on every machine (no
    platform-dependent random-normal or matmul kernels are involved)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-96, 97, shape, generator=g).to(torch.float32) / scale


def gradient_run(path: Path, steps: int = 3) -> dict[int, dict[str, torch.Tensor]]:
    """Train a 2-layer MLP with AdamW and save it with the engine's gradient records (spec/delta.md §8).

    Linear(4, 4), Tanh, Linear(4, 2, bias=False): 28 fp32 parameters on the CPU, AdamW with its for-loop
    kernels (``foreach=False``), two parameter groups and a scheduler that halves each learning rate right
    after every step (so a step ran with other hyperparameters than the tree's copy says, §8.1.5). Parameters
    and gradients are dyadic numbers from seeded integer generators, and the gradients are set rather
    than computed by backward, so the state is the same bits on every machine. Step 1 is full; steps 2
    and 3 are gradient records, 3 replayed on 2 replayed on 1; in step 3 ``model/0.bias`` has no
    gradient (AdamW leaves it and its state alone). ``seen`` is not an optimizer tensor: a state delta.
    Returns each step's tensors by name (what a replay must reproduce).
    """
    import copy

    from ucl.write.manager import CheckpointManager
    from ucl.write.policy import DeltaPolicy

    torch.manual_seed(1900)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(dyadic(tuple(p.shape), 1900 + i, 64))
    groups: list[dict[str, Any]] = [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "lr": 0.003, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(path, delta=DeltaPolicy(gradients=True)) as mgr:
        for t in range(1, steps + 1):
            for i, p in enumerate(model.parameters()):
                p.grad = None if (t, i) == (3, 1) else dyadic(tuple(p.shape), 1910 + 10 * t + i, 128)
            opt.step()
            sched.step()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "seen": torch.tensor([t, 8 * t])}
            ref[t] = structure.flatten(copy.deepcopy(state))[0]
            mgr.save(t, state, optimizer=opt)
        mgr.wait()
    (path / ".ucl-writer.lock").unlink(missing_ok=True)  # holds the writer's pid
    return ref


def build(root: Path) -> Suite:
    S = Suite()

    def valid(
        feature: str, desc: str, section: str, fx: str, op: str, args: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        S.add(feature, desc, section, fx, op, args, verdict="valid", **kw)

    def invalid(
        feature: str, desc: str, section: str, fx: str, code: str, args: dict[str, Any] | None = None
    ) -> None:
        S.add(feature, desc, section, fx, "validate", args, verdict="invalid", code=code)

    def error(
        feature: str,
        desc: str,
        section: str,
        fx: str,
        op: str,
        code: str,
        args: dict[str, Any] | None = None,
        may_fail_with: list[str] | None = None,
    ) -> None:
        S.add(feature, desc, section, fx, op, args, verdict="error", code=code, may_fail_with=may_fail_with)

    def reads(
        feature: str,
        section: str,
        fx: str,
        tensors: dict[str, torch.Tensor],
        step: int | None = None,
        boxes: dict[str, list[list[list[int]]]] | None = None,
        what: Callable[[str], str] | None = None,
        may_fail_with: list[str] | None = None,
    ) -> None:
        """One case per tensor (and per box); ``what(name)`` is appended to the descriptions."""
        for name, t in tensors.items():
            a = {"tensor": name} if step is None else {"tensor": name, "step": step}
            tail = "" if what is None else what(name)
            valid(
                feature,
                f"read {name!r} whole ({t.dtype}, shape {list(t.shape)}){tail}",
                section,
                fx,
                "read",
                a,
                data_sha256=sha(t),
                shape=list(t.shape),
                may_fail_with=may_fail_with,
            )
            for box in (boxes or {}).get(name, []):
                valid(
                    feature,
                    f"read {name!r}[{', '.join(f'{a}:{b}' for a, b in box)}]{tail}",
                    section,
                    fx,
                    "read",
                    {**a, "slice": box},
                    data_sha256=sha(t, box),
                    shape=[b - a for a, b in box],
                    may_fail_with=may_fail_with,
                )

    # == valid =====================================================================================
    # dtypes
    fx = "valid/dtypes"
    state = {"dtype": {n: random_tensor((3, 5), dt, 100 + i) for i, (n, dt) in enumerate(DTYPES)}}
    flat_dtypes = {f"dtype/{n}": t for n, t in state["dtype"].items()}
    Fx(root, fx).save(state, 1)
    valid("dtypes", "every data type of the spec's table validates", S_DTYPES, fx, "validate")
    valid(
        "dtypes",
        "the step opens with one tensor per data type",
        S_DTYPES,
        fx,
        "open",
        step=1,
        keys=sorted(flat_dtypes),
    )
    reads("dtypes", S_DTYPES, fx, flat_dtypes, boxes={k: [[[1, 3], [2, 5]]] for k in flat_dtypes})

    # shapes
    fx = "valid/shapes"
    state = {
        "scalar_f32": random_tensor((), torch.float32, 200),
        "scalar_bool": torch.tensor(True),
        "empty_1d": torch.zeros(0, dtype=torch.float32),
        "empty_3x0": torch.zeros(3, 0, dtype=torch.int64),
        "empty_0x2x0": torch.zeros(0, 2, 0, dtype=torch.bfloat16),
        "one": random_tensor((1,), torch.float16, 201),
        "odd_7x3x5": random_tensor((7, 3, 5), torch.float64, 202),
        "four_d": random_tensor((2, 3, 1, 4), torch.int8, 203),
        "long_1d": random_tensor((1001,), torch.uint8, 204),
    }
    Fx(root, fx).save(state, 3)
    valid("shapes", "0-d, empty and odd shapes validate", S_ARRAYS, fx, "validate")
    valid("shapes", "0-d, empty and odd shapes open", S_ARRAYS, fx, "open", step=3, keys=sorted(state))
    reads(
        "shapes",
        S_ARRAYS,
        fx,
        state,
        boxes={
            "scalar_f32": [[]],
            "odd_7x3x5": [[[2, 5], [0, 3], [1, 4]], [[6, 7], [2, 3], [4, 5]], [[3, 3], [0, 3], [0, 5]]],
            "four_d": [[[1, 2], [0, 3], [0, 1], [1, 3]]],
            "long_1d": [[[997, 1001]], [[0, 0]]],
            "empty_3x0": [[[1, 3], [0, 0]]],
        },
    )
    error(
        "shapes",
        "a slice beyond the shape is refused",
        S_ARRAYS,
        fx,
        "read",
        "invalid_argument",
        {"tensor": "odd_7x3x5", "slice": [[0, 8], [0, 3], [0, 5]]},
    )
    error(
        "shapes",
        "a slice of the wrong rank is refused",
        S_ARRAYS,
        fx,
        "read",
        "invalid_argument",
        {"tensor": "odd_7x3x5", "slice": [[0, 1]]},
    )
    error(
        "shapes",
        "a tensor that is not in the step",
        S_ARRAYS,
        fx,
        "read",
        "tensor_not_found",
        {"tensor": "nope"},
    )

    # names
    fx = "valid/names"
    t = lambda i, shape=(2, 2): random_tensor(shape, torch.float32, 300 + i)  # noqa: E731
    nested = {
        "a b": {"ü": {"..x": t(0)}},
        ".": t(1),
        "..": t(2),
        "__init__": t(3),
        "%41": t(4),
        "x.y-z_0": t(5),
        "emoji😀": t(6),
        "model": {"layers": [{"weight": t(7), "bias": t(8, (2,))}, {"weight": t(9)}]},
        "optim": {
            "state": {0: {"exp_avg": t(10), "step": t(11, ())}},
            "param_groups": [
                {
                    "lr": 0.001,
                    "betas": (0.9, 0.999),
                    "name": "adam",
                    "nesterov": False,
                    "foreach": None,
                    "eps": float("inf"),
                    "weird": float("nan"),
                }
            ],
        },
        "s" * 255: t(12, (1,)),
        "back\\slash": t(13),
        "sp ace": {" in": {"deep": t(14)}},
    }
    Fx(root, fx).save(nested, 5)
    flat, _ = structure.flatten(nested)
    valid(
        "names",
        "names with escapes (space, UTF-8, '.', '..', '__', '%', backslash) validate",
        S_NAMES,
        fx,
        "validate",
    )
    valid(
        "names", "every flattened name is listed, unescaped", S_NAMES, fx, "open", step=5, keys=sorted(flat)
    )
    reads("names", S_NAMES, fx, flat)

    # multi-shard arrays (chunk grid = one writer's block)
    fx = "valid/multi_shard"
    arrays = multi_shard_arrays(400)
    Fx(root, fx).write(2, arrays)
    tensors = {m.name: t for m, t in arrays}
    valid(
        "sharding",
        "multi-shard arrays with clipped edge shards and absent outside chunks validate",
        S_SHARD,
        fx,
        "validate",
    )
    valid("sharding", "multi-shard step opens", S_ARRAYS, fx, "open", step=2, keys=sorted(tensors))
    reads(
        "sharding",
        S_SHARD,
        fx,
        tensors,
        boxes={
            "w": [
                [[3, 9], [2, 5]],
                [[9, 10], [6, 7]],
                [[0, 10], [3, 4]],
                [[4, 4], [0, 7]],
                [[8, 10], [0, 7]],
            ],
            "v": [[[3, 9]], [[8, 9]]],
            "m": [[[1, 4], [1, 3], [1, 3]], [[4, 5], [0, 4], [2, 3]]],
            "i": [[[2, 4], [2, 4]]],
            "f8": [[[0, 7], [1, 4]], [[6, 7], [4, 5]]],
        },
    )

    # zstd
    fx = "valid/zstd"
    zstate = {
        "w": random_tensor((64, 16), torch.float32, 500),
        "b": random_tensor((33,), torch.bool, 501),
        "z": torch.zeros(40, 40, dtype=torch.bfloat16),
        "s": random_tensor((), torch.int16, 502),
    }
    f = Fx(root, fx)
    f.save(zstate, 1, compression="zstd")
    t = random_tensor((11, 6), torch.float16, 503)
    meta = dataclasses.replace(
        array_for("sharded", t, chunk_shape=(4, 6), compression=ZSTD), inner_chunk_shape=(2, 3)
    )
    f.write(2, [(meta, t)])
    valid("compression", "zstd-compressed inner chunks validate", S_ARRAYS, fx, "validate")
    reads("compression", S_ARRAYS, fx, zstate, step=1, boxes={"w": [[[10, 50], [3, 9]]], "b": [[[30, 33]]]})
    reads("compression", S_ARRAYS, fx, {"sharded": t}, step=2, boxes={"sharded": [[[3, 11], [2, 5]]]})

    # several steps, one uncommitted leftover
    fx = "valid/steps"
    f = Fx(root, fx)
    per_step = {}
    for k, step in enumerate([0, 7, 30]):
        per_step[step] = {"w": random_tensor((3, 4), torch.float32, 600 + k), "n": torch.tensor(step)}
        f.save(per_step[step], step)
    f.write(31, [(array_for("w", per_step[30]["w"]), per_step[30]["w"])], commit=False)
    f.put("commits/32.json.tmp-4242", b'{"ucl_commit": 1, "step": 3')  # an interrupted atomic write
    f.put("commits/README", b"not a commit record\n")
    f.put("commits/007.json", f.read("commits/7.json"))  # not S in decimal without leading zeros
    valid(
        "repository",
        "committed steps listed in order; uncommitted files, temporaries and odd names ignored",
        S_COMMIT,
        fx,
        "list_steps",
        steps=[0, 7, 30],
    )
    valid(
        "repository",
        "latest is the newest committed step, not the uncommitted leftover",
        S_COMMIT,
        fx,
        "open",
        step=30,
        keys=["n", "w"],
    )
    valid("repository", "step 0 opens", S_COMMIT, fx, "open", {"step": 0}, step=0, keys=["n", "w"])
    valid(
        "repository",
        "leftover files of an uncommitted step do not make the repository invalid",
        S_COMMIT,
        fx,
        "validate",
    )
    error(
        "repository", "an uncommitted step does not open", S_COMMIT, fx, "open", "not_committed", {"step": 31}
    )
    error("repository", "a step that was never written", S_COMMIT, fx, "open", "not_found", {"step": 8})
    invalid("repository", "validating an uncommitted step", S_COMMIT, fx, "not_committed", {"step": 31})
    for step, st in per_step.items():
        reads("repository", S_COMMIT, fx, st, step=step)

    fx = "valid/empty_repository"
    Repository.open(Fx(root, fx).path, create=True)
    valid("repository", "a repository without steps lists none", S_LAYOUT, fx, "list_steps", steps=[])
    valid("repository", "a repository without steps is valid", S_LAYOUT, fx, "validate")
    error("repository", "the latest step of an empty repository", S_COMMIT, fx, "open", "not_found")

    fx = "valid/largest_step"
    big = (1 << 63) - 1
    st = tiny_state(700)
    Fx(root, fx).save(st, big)
    valid("repository", "step 2^63-1 validates", S_COMMIT, fx, "validate")
    valid("repository", "step 2^63-1 is listed", S_COMMIT, fx, "list_steps", steps=[big])
    valid("repository", "step 2^63-1 opens", S_COMMIT, fx, "open", step=big, keys=["s", "w"])
    reads("repository", S_COMMIT, fx, st)

    fx = "valid/ignorable_extensions"
    f = Fx(root, fx)
    st = tiny_state(710)
    f.save(st, 1)
    ext = {"name": "example.future_feature", "configuration": {"x": 1}, "must_understand": False}
    f.edit_json("zarr.json", lambda d: d["attributes"]["ucl"].__setitem__("extensions", [ext]))
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].__setitem__("extensions", [ext]))
    f.edit_commit(1, lambda d: d.__setitem__("extensions", [ext]))
    f.edit_array(1, "w", lambda d: d.update(dimension_names=["rows", None], storage_transformers=[]))
    valid(
        "extensions",
        "unknown extensions with must_understand false are ignored (repository, step, commit)",
        S_EXT,
        fx,
        "validate",
    )
    valid("extensions", "a step with ignorable extensions opens", S_EXT, fx, "open", step=1, keys=["s", "w"])
    reads("extensions", S_EXT, fx, st)

    # == invalid: integrity (bytes damaged, commit record untouched) ================================
    def tiny(rel: str, seed: int = 800) -> tuple[Fx, dict[str, torch.Tensor]]:
        f = Fx(root, rel)
        st = tiny_state(seed)
        f.save(st, 1)
        return f, st

    def multi(rel: str, keep: str = "w", seed: int = 900) -> tuple[Fx, dict[str, torch.Tensor]]:
        f = Fx(root, rel)
        arrays = [(m, t) for m, t in multi_shard_arrays(seed) if m.name in keep.split(",")]
        f.write(1, arrays)
        return f, {m.name: t for m, t in arrays}

    def broken_read(
        feature: str,
        fx: str,
        tensor: str,
        code: str,
        what: str,
        section: str = S_INTEGRITY,
        box: list[list[int]] | None = None,
    ) -> None:
        args: dict[str, Any] = {"tensor": tensor}
        if box is not None:
            args["slice"] = box
        error(feature, f"reading {tensor!r} {what}", section, fx, "read", code, args)

    fx = "invalid/integrity/bit_flip_in_chunk"
    f, st = multi(fx, "w,i")
    f.flip("steps/1/w/c/1/1", 5)  # first inner chunk of shard (1, 1)
    invalid("integrity", "one flipped bit in an inner chunk", S_INTEGRITY, fx, "checksum_mismatch")
    broken_read("integrity", fx, "w", "checksum_mismatch", "through the damaged chunk")
    broken_read(
        "integrity", fx, "w", "checksum_mismatch", "(a slice inside the damaged chunk)", box=[[4, 5], [3, 4]]
    )
    valid(
        "integrity",
        "a slice that avoids the damaged shard still reads correctly",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "w", "slice": [[0, 4], [0, 7]]},
        data_sha256=sha(st["w"], [[0, 4], [0, 7]]),
        shape=[4, 7],
    )
    valid(
        "integrity",
        "other tensors of the step still read correctly",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "i"},
        data_sha256=sha(st["i"]),
        shape=[6, 6],
    )

    fx = "invalid/integrity/bit_flip_in_chunk_crc"
    f, st = multi(fx, "i")
    size = len(f.read("steps/1/i/c/0/1"))
    f.flip("steps/1/i/c/0/1", 3 * 3 * 8 + 2, 0x80)  # the crc32c after the only inner chunk
    invalid("integrity", "one flipped bit in an inner chunk's crc32c", S_INTEGRITY, fx, "checksum_mismatch")
    broken_read("integrity", fx, "i", "checksum_mismatch", "whose chunk crc32c is damaged")
    assert size == 3 * 3 * 8 + 4 + 20

    fx = "invalid/integrity/bit_flip_in_index"
    f, st = multi(fx, "v")
    data = f.read("steps/1/v/c/0")
    f.flip("steps/1/v/c/0", len(data) - 4 - 16 * 2 + 1)  # offset of the first inner chunk
    invalid("integrity", "one flipped bit in a shard index entry", S_SHARD, fx, "checksum_mismatch")
    broken_read("integrity", fx, "v", "checksum_mismatch", "whose shard index is damaged")

    fx = "invalid/integrity/bad_index_crc"
    f, st = tiny(fx)
    data = f.read("steps/1/w/c/0/0")
    f.flip("steps/1/w/c/0/0", len(data) - 1, 0x10)
    invalid("integrity", "the index crc32c does not match", S_SHARD, fx, "checksum_mismatch")
    broken_read("integrity", fx, "w", "checksum_mismatch", "whose index crc32c is damaged")

    fx = "invalid/integrity/truncated_shard"
    f, st = multi(fx)
    f.truncate("steps/1/w/c/2/0", len(f.read("steps/1/w/c/2/0")) - 7)
    invalid("integrity", "a shard shorter than the commit record says", S_INTEGRITY, fx, "size_mismatch")
    broken_read("integrity", fx, "w", "size_mismatch", "with a truncated shard")

    fx = "invalid/integrity/truncated_shard_to_zero"
    f, st = tiny(fx)
    f.truncate("steps/1/w/c/0/0", 0)
    invalid("integrity", "a shard truncated to 0 bytes", S_INTEGRITY, fx, "size_mismatch")
    broken_read("integrity", fx, "w", "size_mismatch", "from an empty shard file")

    fx = "invalid/integrity/truncated_shard_index_only"
    f, st = tiny(fx)
    data = f.read("steps/1/w/c/0/0")
    f.put("steps/1/w/c/0/0", data[-20:])  # the data part gone, the index kept
    invalid(
        "integrity", "a shard that lost its data part but kept its index", S_INTEGRITY, fx, "size_mismatch"
    )
    broken_read("integrity", fx, "w", "size_mismatch", "from a shard without its data part")

    fx = "invalid/integrity/missing_shard"
    f, st = multi(fx, "m")
    f.p("steps/1/m/c/1/0/1").unlink()
    invalid("integrity", "a shard listed in the commit record is absent", S_INTEGRITY, fx, "missing_shard")
    broken_read("integrity", fx, "m", "missing_shard", "with one shard deleted")
    valid(
        "integrity",
        "a slice outside the missing shard still reads",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "m", "slice": [[0, 2], [0, 4], [0, 3]]},
        data_sha256=sha(st["m"], [[0, 2], [0, 4], [0, 3]]),
        shape=[2, 4, 3],
    )

    fx = "invalid/integrity/missing_scalar_shard"
    f, st = tiny(fx)
    f.p("steps/1/s/c").unlink()
    invalid("integrity", "the only shard of a 0-d tensor is absent", S_INTEGRITY, fx, "missing_shard")
    broken_read("integrity", fx, "s", "missing_shard", "without its shard")

    fx = "invalid/integrity/extended_shard"
    f, st = tiny(fx)
    f.put("steps/1/w/c/0/0", f.read("steps/1/w/c/0/0") + b"\x00" * 16)
    invalid("integrity", "a shard longer than the commit record says", S_INTEGRITY, fx, "size_mismatch")
    S.add(
        "integrity",
        "reading an extended shard: readers need not notice trailing bytes, but must not return other data",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "w"},
        verdict="valid",
        data_sha256=sha(st["w"]),
        shape=[4, 3],
        may_fail_with=["size_mismatch", "checksum_mismatch", "corrupt_shard_index"],
    )

    fx = "invalid/integrity/zeroed_shard"
    f, st = tiny(fx)
    f.put("steps/1/w/c/0/0", bytes(len(f.read("steps/1/w/c/0/0"))))
    invalid("integrity", "a shard overwritten with zeros (same size)", S_INTEGRITY, fx, "checksum_mismatch")
    broken_read("integrity", fx, "w", "checksum_mismatch", "from a zeroed shard (never zeros)")

    fx = "invalid/integrity/bit_flip_in_zstd_chunk"
    f = Fx(root, fx)
    zt = {"w": random_tensor((32, 8), torch.float32, 1000)}
    f.save(zt, 1, compression="zstd")
    f.flip("steps/1/w/c/0/0", 9)
    invalid("integrity", "one flipped bit in a compressed inner chunk", S_INTEGRITY, fx, "checksum_mismatch")
    broken_read("integrity", fx, "w", "checksum_mismatch", "through a damaged compressed chunk")

    fx = "invalid/integrity/bit_flip_in_step_document"
    f, st = tiny(fx)
    f.flip("steps/1/zarr.json", 40, 0x02)
    invalid(
        "integrity",
        "the step document differs from its commit record's crc32c",
        S_INTEGRITY,
        fx,
        "checksum_mismatch",
    )
    error(
        "integrity",
        "a step whose document fails its crc32c does not open",
        S_INTEGRITY,
        fx,
        "open",
        "checksum_mismatch",
        {"step": 1},
    )

    fx = "invalid/integrity/missing_step_document"
    f, st = tiny(fx)
    f.p("steps/1/zarr.json").unlink()
    invalid("integrity", "the step document is absent", S_INTEGRITY, fx, "missing_shard")
    error(
        "integrity",
        "a step without its document does not open",
        S_INTEGRITY,
        fx,
        "open",
        "missing_shard",
        {"step": 1},
    )

    fx = "invalid/integrity/bit_flip_in_array_document"
    f, st = tiny(fx)
    f.flip("steps/1/w/zarr.json", 30, 0x04)
    invalid("integrity", "an array document fails its crc32c", S_INTEGRITY, fx, "checksum_mismatch")
    S.add(
        "integrity",
        "readers use the consolidated metadata, so the tensor may still read correctly",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "w"},
        verdict="valid",
        data_sha256=sha(st["w"]),
        shape=[4, 3],
        may_fail_with=["checksum_mismatch"],
    )

    fx = "invalid/integrity/missing_array_document"
    f, st = tiny(fx)
    f.p("steps/1/s/zarr.json").unlink()
    invalid("integrity", "an array document is absent", S_INTEGRITY, fx, "missing_shard")

    fx = "invalid/integrity/bit_flip_in_group_document"
    f = Fx(root, fx)
    gt = {"a": {"b": random_tensor((2, 2), torch.float32, 1500)}}
    f.save(gt, 1)
    f.flip("steps/1/a/zarr.json", 20, 0x01)
    invalid(
        "integrity", "an intermediate group document fails its crc32c", S_INTEGRITY, fx, "checksum_mismatch"
    )
    S.add(
        "integrity",
        "readers use the consolidated metadata, so the tensor below may still read",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "a/b"},
        verdict="valid",
        data_sha256=sha(gt["a"]["b"]),
        shape=[2, 2],
        may_fail_with=["checksum_mismatch"],
    )

    fx = "invalid/integrity/missing_group_document"
    f = Fx(root, fx)
    f.save(gt, 1)
    f.p("steps/1/a/zarr.json").unlink()
    invalid(
        "integrity",
        "an intermediate group document listed in the commit record is absent",
        S_INTEGRITY,
        fx,
        "missing_shard",
    )

    fx = "invalid/integrity/swapped_shards"
    f, st = multi(fx)
    a, b = f.read("steps/1/w/c/0/0"), f.read("steps/1/w/c/1/0")
    assert len(a) == len(b)
    f.put("steps/1/w/c/0/0", b)
    f.put("steps/1/w/c/1/0", a)
    invalid("integrity", "two equal-sized shards of a tensor swapped", S_INTEGRITY, fx, "checksum_mismatch")
    broken_read(
        "integrity", fx, "w", "checksum_mismatch", "whose shards are swapped (never the other shard's data)"
    )

    # == invalid: commit records =====================================================================
    fx = "invalid/commit/corrupt_commit_checksum"
    f, st = tiny(fx)
    doc = f.commit_doc(1)
    doc["checksum"] ^= 1
    f.put("commits/1.json", metadata.dumps(doc))
    invalid("commit", "a commit record whose checksum does not match", S_COMMIT, fx, "corrupt_commit_record")
    error(
        "commit",
        "a step whose commit record fails its checksum does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 1},
    )
    error(
        "commit",
        "the only step's record is corrupt: there is no latest step",
        S_COMMIT,
        fx,
        "open",
        "not_found",
    )
    valid(
        "commit", "a step whose record does not verify does not exist", S_COMMIT, fx, "list_steps", steps=[]
    )

    fx = "invalid/commit/bit_flip_in_commit_record"
    f, st = tiny(fx)
    raw = f.read("commits/1.json")
    f.flip("commits/1.json", raw.index(b'"time": "2026') + 12, 0x01)  # a digit of the commit time
    invalid("commit", "one flipped bit in a commit record", S_COMMIT, fx, "corrupt_commit_record")
    error(
        "commit",
        "a damaged commit record does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 1},
    )

    fx = "invalid/commit/step_mismatch"
    f, st = tiny(fx)
    f.put("commits/2.json", f.read("commits/1.json"))
    f.p("commits/1.json").unlink()
    invalid(
        "commit", "commits/2.json is the (sealed) record of step 1", S_COMMIT, fx, "corrupt_commit_record"
    )
    error(
        "commit",
        "a record naming another step does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 2},
    )

    fx = "invalid/commit/truncated_commit_record"
    f, st = tiny(fx)
    f.truncate("commits/1.json", 100)
    invalid("commit", "a truncated commit record", S_COMMIT, fx, "corrupt_commit_record")
    error(
        "commit",
        "a truncated commit record does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 1},
    )

    fx = "invalid/commit/empty_commit_record"
    f, st = tiny(fx)
    f.put("commits/1.json", b"")
    invalid("commit", "an empty commit record file", S_COMMIT, fx, "corrupt_commit_record")

    fx = "invalid/commit/schema_violation"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d.__setitem__("kind", "partial"))
    invalid(
        "commit",
        "a sealed commit record whose kind is not full or delta",
        S_COMMIT,
        fx,
        "corrupt_commit_record",
    )

    fx = "invalid/commit/unknown_field"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d.__setitem__("retention", "forever"))
    invalid(
        "commit",
        "a sealed commit record with an unknown field (fail closed)",
        S_COMMIT,
        fx,
        "corrupt_commit_record",
    )

    fx = "invalid/commit/unknown_must_understand_extension"
    f, st = tiny(fx)
    f.edit_commit(
        1, lambda d: d.__setitem__("extensions", [{"name": "example.encryption", "configuration": {}}])
    )
    invalid("commit", "a commit record requiring an unknown extension", S_EXT, fx, "unknown_extension")
    error(
        "commit",
        "a step whose record requires an unknown extension does not open",
        S_EXT,
        fx,
        "open",
        "unknown_extension",
        {"step": 1},
    )

    fx = "invalid/commit/unsupported_version"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d.__setitem__("ucl_commit", 2))
    invalid("commit", "a commit record of a newer format version", S_EXT, fx, "unsupported_version")
    error(
        "commit",
        "a step committed by a newer version does not open",
        S_EXT,
        fx,
        "open",
        "unsupported_version",
        {"step": 1},
    )

    fx = "invalid/commit/missing_file_entry"
    f, st = multi(fx, "i")
    f.edit_commit(1, lambda d: d["files"].pop("i/c/1/1"))
    invalid(
        "commit", "a shard of the grid is not listed in the commit record", S_INTEGRITY, fx, "missing_shard"
    )
    broken_read("commit", fx, "i", "missing_shard", "when one of its shards is not in the commit record")

    fx = "invalid/commit/missing_step_document_entry"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"].pop("zarr.json"))
    invalid(
        "commit", "the step document is not listed in the commit record", S_INTEGRITY, fx, "missing_shard"
    )
    error(
        "commit",
        "a step whose document is not in its commit record does not open",
        S_INTEGRITY,
        fx,
        "open",
        "missing_shard",
        {"step": 1},
    )

    fx = "invalid/commit/extra_file_entry"
    f, st = tiny(fx)
    f.put("steps/1/stray", b"stray bytes")
    f.reseal(1, "stray")
    invalid(
        "commit",
        "the commit record lists a file that no array owns",
        S_INTEGRITY,
        fx,
        "inconsistent_metadata",
    )
    reads("commit", S_INTEGRITY, fx, st)

    fx = "invalid/commit/wrong_shard_size"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(0, d["files"]["w/c/0/0"][0] + 1))
    invalid(
        "commit",
        "the commit record's size of a shard is one byte too large",
        S_INTEGRITY,
        fx,
        "size_mismatch",
    )
    broken_read("commit", fx, "w", "size_mismatch", "when the recorded size is one byte too large")

    fx = "invalid/commit/wrong_shard_crc"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(1, d["files"]["w/c/0/0"][1] ^ 1))
    invalid(
        "commit",
        "the commit record's crc32c of a shard does not match the file",
        S_INTEGRITY,
        fx,
        "checksum_mismatch",
    )
    S.add(
        "commit",
        "readers verify inner chunks, so the data may still be read",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "w"},
        verdict="valid",
        data_sha256=sha(st["w"]),
        shape=[4, 3],
        may_fail_with=["checksum_mismatch"],
    )

    fx = "invalid/commit/kind_mismatch"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d.update(kind="delta", parent=0))
    invalid(
        "commit",
        "the commit record says delta, the step document says full",
        S_COMMIT,
        fx,
        "inconsistent_metadata",
    )
    error(
        "commit",
        "a step whose documents disagree does not open",
        S_COMMIT,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )

    fx = "invalid/commit/newest_record_corrupt"
    f = Fx(root, fx)
    st1, st2 = tiny_state(1100), tiny_state(1110)
    f.save(st1, 1)
    f.save(st2, 2)
    f.truncate("commits/2.json", 50)
    invalid("commit", "the newest step's commit record is corrupt", S_COMMIT, fx, "corrupt_commit_record")
    valid(
        "commit",
        "the latest step falls back to the newest record that verifies",
        S_COMMIT,
        fx,
        "open",
        step=1,
        keys=["s", "w"],
    )
    valid("commit", "only steps whose records verify exist", S_COMMIT, fx, "list_steps", steps=[1])
    reads("commit", S_COMMIT, fx, st1)
    error(
        "commit",
        "the step with the corrupt record does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 2},
    )

    # == invalid: metadata ===========================================================================
    fx = "invalid/metadata/unknown_must_understand_extension"
    f, st = tiny(fx)
    f.edit_step_doc(
        1,
        lambda d: d["attributes"]["ucl"].__setitem__(
            "extensions", [{"name": "example.required_feature", "configuration": {}}]
        ),
    )
    invalid(
        "metadata",
        "a step requiring an unknown extension (must_understand absent)",
        S_EXT,
        fx,
        "unknown_extension",
    )
    error(
        "metadata",
        "a step requiring an unknown extension does not open",
        S_EXT,
        fx,
        "open",
        "unknown_extension",
        {"step": 1},
    )

    fx = "invalid/metadata/unknown_must_understand_true_extension"
    f, st = tiny(fx)
    f.edit_step_doc(
        1,
        lambda d: d["attributes"]["ucl"].__setitem__(
            "extensions", [{"name": "example.required_feature", "configuration": {}, "must_understand": True}]
        ),
    )
    invalid(
        "metadata",
        "a step requiring an unknown extension (must_understand true)",
        S_EXT,
        fx,
        "unknown_extension",
    )

    fx = "invalid/metadata/unknown_repository_extension"
    f, st = tiny(fx)
    f.edit_json(
        "zarr.json",
        lambda d: d["attributes"]["ucl"].__setitem__(
            "extensions", [{"name": "example.required_feature", "must_understand": True}]
        ),
    )
    invalid("metadata", "a repository requiring an unknown extension", S_EXT, fx, "unknown_extension")
    error(
        "metadata",
        "a repository requiring an unknown extension does not open",
        S_EXT,
        fx,
        "open",
        "unknown_extension",
    )
    error("metadata", "nor does it list its steps", S_EXT, fx, "list_steps", "unknown_extension")

    fx = "invalid/metadata/unknown_codec"
    f, st = tiny(fx)
    f.edit_array(
        1,
        "w",
        lambda d: d["codecs"][0]["configuration"]["codecs"].insert(
            1, {"name": "gzip", "configuration": {"level": 5}}
        ),
    )
    invalid("metadata", "an inner codec that is not part of UCL v1", S_EXT, fx, "unknown_extension")
    error(
        "metadata",
        "a step with an unknown codec does not open",
        S_EXT,
        fx,
        "open",
        "unknown_extension",
        {"step": 1},
    )

    fx = "invalid/metadata/unsupported_version"
    f, st = tiny(fx)
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].__setitem__("format_version", 2))
    invalid("metadata", "a step document of format version 2", S_EXT, fx, "unsupported_version")
    error(
        "metadata",
        "a step of a newer format version does not open",
        S_EXT,
        fx,
        "open",
        "unsupported_version",
        {"step": 1},
    )

    fx = "invalid/metadata/unsupported_repository_version"
    f, st = tiny(fx)
    f.edit_json("zarr.json", lambda d: d["attributes"]["ucl"].__setitem__("format_version", 99))
    invalid("metadata", "a repository of format version 99", S_REPO_DOC, fx, "unsupported_version")
    error(
        "metadata",
        "a repository of a newer format version does not open",
        S_REPO_DOC,
        fx,
        "open",
        "unsupported_version",
    )

    fx = "invalid/metadata/missing_repository_document"
    f, st = tiny(fx)
    f.p("zarr.json").unlink()
    invalid("metadata", "a directory without zarr.json is not a repository", S_REPO_DOC, fx, "not_found")
    error("metadata", "opening a directory that is not a repository", S_REPO_DOC, fx, "open", "not_found")

    fx = "invalid/metadata/repository_document_not_ucl"
    f, st = tiny(fx)
    f.put("zarr.json", metadata.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    invalid("metadata", "a plain Zarr group without attributes.ucl", S_REPO_DOC, fx, "schema_violation")
    error("metadata", "opening a plain Zarr group", S_REPO_DOC, fx, "open", "schema_violation")

    fx = "invalid/metadata/bad_dtype"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("data_type", "float128"))
    invalid("metadata", "a data type outside the spec's table", S_DTYPES, fx, "unsupported_dtype")
    error(
        "metadata",
        "a step with an unknown data type does not open",
        S_DTYPES,
        fx,
        "open",
        "unsupported_dtype",
        {"step": 1},
    )

    fx = "invalid/metadata/bad_dtype_zarr_v2_spelling"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("data_type", "<f4"))
    invalid("metadata", "a zarr v2 dtype string is not a UCL data type", S_DTYPES, fx, "unsupported_dtype")

    fx = "invalid/metadata/inner_chunk_not_dividing"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d["codecs"][0]["configuration"].__setitem__("chunk_shape", [3, 3]))
    invalid(
        "metadata",
        "an inner chunk shape that does not divide the chunk shape",
        S_ARRAYS,
        fx,
        "inconsistent_metadata",
    )
    error(
        "metadata",
        "a step whose inner chunks do not divide its chunks does not open",
        S_ARRAYS,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )

    fx = "invalid/metadata/rank_mismatch"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [4, 3, 1]))
    invalid("metadata", "a chunk shape of another rank than the shape", S_ARRAYS, fx, "inconsistent_metadata")

    fx = "invalid/metadata/array_doc_differs_from_consolidated"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [4, 2]), consolidated=False)
    invalid(
        "metadata",
        "an array document that differs from the step's consolidated copy",
        S_STEP_DOC,
        fx,
        "inconsistent_metadata",
    )
    S.add(
        "metadata",
        "readers use the consolidated copy: the tensor reads as committed, or fails",
        S_STEP_DOC,
        fx,
        "read",
        {"tensor": "w"},
        verdict="valid",
        data_sha256=sha(st["w"]),
        shape=[4, 3],
        may_fail_with=["inconsistent_metadata"],
    )

    fx = "invalid/metadata/array_not_in_consolidated"
    f, st = tiny(fx)
    f.edit_step_doc(1, lambda d: d["consolidated_metadata"]["metadata"].pop("s"))
    invalid(
        "metadata",
        "the tree names a tensor that consolidated metadata does not list",
        S_TREE,
        fx,
        "inconsistent_metadata",
    )
    error(
        "metadata",
        "a step whose tree names a missing array does not open",
        S_TREE,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )

    fx = "invalid/metadata/big_endian_bytes_codec"
    f, st = tiny(fx)
    f.edit_array(
        1,
        "w",
        lambda d: d["codecs"][0]["configuration"]["codecs"][0]["configuration"].__setitem__("endian", "big"),
    )
    invalid("metadata", "inner bytes codec big-endian", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/no_inner_crc32c"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d["codecs"][0]["configuration"]["codecs"].pop())
    invalid("metadata", "inner codecs without crc32c", S_ARRAYS, fx, "schema_violation")
    error(
        "metadata",
        "a step whose chunks carry no checksum does not open",
        S_ARRAYS,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "invalid/metadata/no_index_crc32c"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d["codecs"][0]["configuration"]["index_codecs"].pop())
    invalid("metadata", "index codecs without crc32c", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/index_at_start"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d["codecs"][0]["configuration"].__setitem__("index_location", "start"))
    invalid("metadata", "shard index at the start", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/storage_transformer"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("storage_transformers", [{"name": "x"}]))
    invalid("metadata", "a storage transformer", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/chunk_key_encoding_v2"
    f, st = tiny(fx)
    f.edit_array(
        1,
        "w",
        lambda d: d.__setitem__("chunk_key_encoding", {"name": "v2", "configuration": {"separator": "."}}),
    )
    invalid("metadata", "v2 chunk key encoding", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/zstd_bad_configuration"
    f = Fx(root, fx)
    f.save({"w": random_tensor((8, 8), torch.float32, 1200)}, 1, compression="zstd")
    f.edit_array(
        1,
        "w",
        lambda d: d["codecs"][0]["configuration"]["codecs"][1]["configuration"].__setitem__("level", "fast"),
    )
    invalid("metadata", "a zstd codec whose level is not an integer", S_ARRAYS, fx, "schema_violation")
    error(
        "metadata",
        "a step with a malformed zstd configuration does not open",
        S_ARRAYS,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "invalid/metadata/step_doc_not_json"
    f, st = tiny(fx)
    f.put("steps/1/zarr.json", b"{this is not json")
    f.reseal(1, "zarr.json")
    invalid("metadata", "a step document that is not JSON", S_STEP_DOC, fx, "schema_violation")
    error(
        "metadata",
        "a step whose document is not JSON does not open",
        S_STEP_DOC,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "invalid/metadata/step_doc_missing_tree"
    f, st = tiny(fx)
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].pop("tree"))
    invalid("metadata", "a step document without its structure tree", S_STEP_DOC, fx, "schema_violation")

    fx = "invalid/metadata/step_doc_wrong_step"
    f, st = tiny(fx)
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].__setitem__("step", 2))
    invalid("metadata", "steps/1/zarr.json says it is step 2", S_STEP_DOC, fx, "inconsistent_metadata")
    error(
        "metadata",
        "a step document of another step does not open",
        S_STEP_DOC,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )

    fx = "invalid/metadata/malformed_tree"
    f, st = tiny(fx)
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].__setitem__("tree", {"t": "dict", "items": 5}))
    invalid("metadata", "a structure tree whose dict items are not a list", S_TREE, fx, "schema_violation")
    error(
        "metadata",
        "a step with a malformed tree does not open",
        S_TREE,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "invalid/metadata/tree_too_deep"
    f, st = tiny(fx)

    def deep_tree(d: dict[str, Any]) -> None:
        node: dict[str, Any] = {"t": "tensor", "name": "w"}
        for _ in range(40):
            node = {"t": "list", "items": [node]}
        d["attributes"]["ucl"]["tree"] = node

    f.edit_step_doc(1, deep_tree)
    invalid("metadata", "a structure tree deeper than 32", S_TREE, fx, "limit_exceeded")
    error(
        "metadata",
        "a step with a too deep tree does not open",
        S_TREE,
        fx,
        "open",
        "limit_exceeded",
        {"step": 1},
    )

    # == invalid: names ==============================================================================
    def rename_key(f: Fx, old: str, new: str) -> None:
        """Move an array's consolidated entry (and its files) to another key; its name is unchanged."""

        def mv(d: dict[str, Any]) -> None:
            m = d["consolidated_metadata"]["metadata"]
            m[new] = m.pop(old)

        f.edit_step_doc(1, mv)

    fx = "invalid/names/non_canonical_escape"
    f = Fx(root, fx)
    f.save({"ü": random_tensor((2,), torch.float32, 1300)}, 1)
    rename_key(f, "%C3%BC", "%c3%bc")
    invalid("names", "a key escaped with lowercase hex", S_NAMES, fx, "invalid_name")
    error(
        "names",
        "a step with a non-canonical key does not open",
        S_NAMES,
        fx,
        "open",
        "invalid_name",
        {"step": 1},
    )

    fx = "invalid/names/needless_escape"
    f, st = tiny(fx)
    rename_key(f, "w", "%77")
    invalid("names", "a key that escapes a safe byte ('%77' for 'w')", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/unescaped_space"
    f, st = tiny(fx)
    rename_key(f, "w", "a b")
    invalid("names", "a key with an unescaped space", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/dot_segment"
    f, st = tiny(fx)
    rename_key(f, "w", "x/./w")
    invalid("names", "a key with a '.' segment", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/reserved_prefix"
    f, st = tiny(fx)
    rename_key(f, "w", "__w")
    invalid("names", "a key starting with '__' (reserved by Zarr v3)", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/empty_segment"
    f, st = tiny(fx)
    rename_key(f, "w", "a//w")
    invalid("names", "a key with an empty segment", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/invalid_utf8"
    f, st = tiny(fx)
    rename_key(f, "w", "%FF%FE")
    invalid("names", "a key whose escapes are not UTF-8", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/control_character"
    f, st = tiny(fx)
    rename_key(f, "w", "a%01b")
    invalid("names", "a key that decodes to a control character", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/too_many_segments"
    f, st = tiny(fx)
    rename_key(f, "w", "/".join(["d"] * 33))
    invalid("names", "a key of 33 segments", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/segment_too_long"
    f, st = tiny(fx)
    rename_key(f, "w", "x" * 256)
    invalid("names", "a segment of 256 bytes", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/name_key_mismatch"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("name", "v"))
    invalid("names", "an array at key 'w' whose name is 'v'", S_NAMES, fx, "inconsistent_metadata")
    error(
        "names",
        "a step whose array names disagree with their keys does not open",
        S_NAMES,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )

    # == hostile ===================================================================================
    H = "hostile"

    fx = "hostile/lying_size_huge"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(0, (1 << 63) - 1))
    invalid(H, "the commit record claims a shard of 2^63-1 bytes", S_LIMITS, fx, "size_mismatch")
    broken_read(H, fx, "w", "size_mismatch", "when the record claims 2^63-1 bytes (no allocation, no seek)")

    fx = "hostile/lying_size_small"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(0, 3))
    invalid(
        H, "the commit record claims a 3-byte shard (smaller than its index)", S_LIMITS, fx, "size_mismatch"
    )
    broken_read(H, fx, "w", "size_mismatch", "when the record claims fewer bytes than an index needs")

    fx = "hostile/lying_step_document_size"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"]["zarr.json"].__setitem__(0, 1 << 40))
    invalid(H, "the commit record claims a 1 TiB step document", S_LIMITS, fx, "size_mismatch")
    error(
        H,
        "a step whose document size is a lie does not open",
        S_LIMITS,
        fx,
        "open",
        "size_mismatch",
        {"step": 1},
    )

    fx = "hostile/shape_2_pow_63"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [1 << 63, 3]))
    invalid(H, "a dimension of 2^63", S_LIMITS, fx, "schema_violation")
    error(
        H, "a step with a 2^63 dimension does not open", S_LIMITS, fx, "open", "schema_violation", {"step": 1}
    )

    fx = "hostile/shape_product_overflow"
    f, st = tiny(fx)
    f.edit_array(
        1,
        "w",
        lambda d: (
            d.__setitem__("shape", [1 << 31, 1 << 31, 1 << 31]),
            d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [4, 3, 1]),
            d["codecs"][0]["configuration"].__setitem__("chunk_shape", [4, 3, 1]),
        ),
    )
    invalid(H, "dimensions each valid whose product exceeds 2^62 bytes", S_LIMITS, fx, "limit_exceeded")
    error(
        H,
        "a step whose tensor would exceed 2^62 bytes does not open",
        S_LIMITS,
        fx,
        "open",
        "limit_exceeded",
        {"step": 1},
    )

    fx = "hostile/negative_shape"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [-4, 3]))
    invalid(H, "a negative dimension", S_LIMITS, fx, "schema_violation")

    fx = "hostile/float_shape"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [4.0, 3]))
    invalid(H, "a dimension written as a float", S_LIMITS, fx, "schema_violation")

    fx = "hostile/float_sizes_in_commit"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(0, float(d["files"]["w/c/0/0"][0])))
    invalid(
        H, "a commit record whose sizes are written as floats (72.0)", S_COMMIT, fx, "corrupt_commit_record"
    )
    error(
        H,
        "a step whose record holds float sizes does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 1},
    )

    fx = "hostile/huge_shape_few_shards"
    f, st = tiny(fx)
    f.edit_array(
        1,
        "w",
        lambda d: (
            d.__setitem__("shape", [1 << 36, 3]),
            d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [1 << 34, 3]),
            d["codecs"][0]["configuration"].__setitem__("chunk_shape", [4, 3]),
        ),
    )
    invalid(
        H,
        "a 768 GiB tensor of 4 shards, 2^32 inner chunks each, with one small shard on disk",
        S_LIMITS,
        fx,
        "limit_exceeded",
    )

    fx = "hostile/huge_shape_many_shards"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [1 << 40, 3]))
    invalid(
        H,
        "a 12 TiB tensor of 2^38 shards with one shard on disk: no enumeration of the grid",
        S_LIMITS,
        fx,
        "missing_shard",
    )
    broken_read(
        H,
        fx,
        "w",
        "missing_shard",
        "the last row of a 2^40-row tensor whose shard is absent",
        box=[[(1 << 40) - 1, 1 << 40], [0, 3]],
    )
    S.add(
        H,
        "reading a whole 12 TiB tensor of which one shard exists",
        S_LIMITS,
        fx,
        "read",
        {"tensor": "w"},
        verdict="error",
        code="missing_shard",
        may_fail_with=["limit_exceeded"],
    )

    fx = "hostile/inner_chunks_2_pow_24"
    f, st = tiny(fx)
    f.edit_array(
        1,
        "w",
        lambda d: (
            d.__setitem__("shape", [1 << 25, 3]),
            d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [1 << 25, 3]),
            d["codecs"][0]["configuration"].__setitem__("chunk_shape", [1, 3]),
        ),
    )
    invalid(H, "a shard index claiming 2^25 inner chunks", S_LIMITS, fx, "limit_exceeded")
    error(
        H,
        "a step claiming 2^25 inner chunks per shard does not open",
        S_LIMITS,
        fx,
        "open",
        "limit_exceeded",
        {"step": 1},
    )

    fx = "hostile/inner_chunk_over_2_gib"
    f, st = tiny(fx)
    f.edit_array(
        1,
        "w",
        lambda d: (
            d.__setitem__("shape", [1 << 30, 3]),
            d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [1 << 30, 3]),
            d["codecs"][0]["configuration"].__setitem__("chunk_shape", [1 << 30, 3]),
        ),
    )
    invalid(H, "an inner chunk of 12 GiB", S_LIMITS, fx, "limit_exceeded")

    fx = "hostile/index_beyond_eof"
    f, st = multi(fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[1][0] = 1 << 40
    f.put_shard_index(1, "w/c/0/0", idx)
    invalid(
        H,
        "a (sealed) index entry pointing 1 TiB past the end of its shard",
        S_SHARD,
        fx,
        "corrupt_shard_index",
    )
    broken_read(H, fx, "w", "corrupt_shard_index", "through an index entry beyond the end of the file")

    fx = "hostile/index_offset_wraps"
    f, st = multi(fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[1] = [EMPTY64 - 8, 64]
    f.put_shard_index(1, "w/c/0/0", idx)
    invalid(H, "an index entry whose offset + nbytes wraps around 2^64", S_SHARD, fx, "corrupt_shard_index")
    broken_read(H, fx, "w", "corrupt_shard_index", "through an entry whose end wraps around")

    fx = "hostile/index_entries_overlap"
    f, st = multi(fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[1] = list(idx[0])
    f.put_shard_index(1, "w/c/0/0", idx)
    invalid(H, "two index entries pointing at the same bytes", S_SHARD, fx, "corrupt_shard_index")
    broken_read(H, fx, "w", "corrupt_shard_index", "through overlapping index entries")

    fx = "hostile/index_wrong_length"
    f, st = multi(fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[0][1] -= 8
    f.put_shard_index(1, "w/c/0/0", idx)
    invalid(
        H,
        "an uncompressed chunk's index length differs from its inner chunk size + 4",
        S_SHARD,
        fx,
        "corrupt_shard_index",
    )
    broken_read(H, fx, "w", "corrupt_shard_index", "through an entry of the wrong length")

    fx = "hostile/index_half_empty"
    f, st = multi(fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[1][1] = EMPTY64
    f.put_shard_index(1, "w/c/0/0", idx)
    invalid(H, "an index entry with an offset and an 'absent' length", S_SHARD, fx, "corrupt_shard_index")
    broken_read(H, fx, "w", "corrupt_shard_index", "through a half-empty entry")

    fx = "hostile/index_chunk_absent"
    f, st = multi(fx)
    idx = f.shard_index("steps/1/w/c/1/1", 2)
    idx[1] = [EMPTY64, EMPTY64]
    f.put_shard_index(1, "w/c/1/1", idx)
    invalid(
        H,
        "an in-bounds inner chunk marked absent (a hole: never zeros)",
        S_INTEGRITY,
        fx,
        "corrupt_shard_index",
    )
    broken_read(H, fx, "w", "corrupt_shard_index", "across a hole (never zeros)")

    fx = "hostile/index_outside_chunk_present"
    f, st = multi(fx)
    # shard (2, 0) of w holds rows 8..9: its second inner chunk (rows 10..11) lies outside the array
    assert f.shard_index("steps/1/w/c/2/0", 2)[1] == [EMPTY64, EMPTY64]
    first = f.read("steps/1/w/c/2/0")[:28]
    f.put_shard(1, "w/c/2/0", [first[:-4], first[:-4]])
    invalid(H, "an inner chunk wholly outside the array is present", S_SHARD, fx, "corrupt_shard_index")

    fx = "hostile/zstd_bomb"
    f = Fx(root, fx)
    f.save({"w": random_tensor((10, 10), torch.float32, 1400)}, 1, compression="zstd")
    # a zstd frame that declares, and really holds, 1 GiB of zeros in 8192 RLE blocks (32 KiB on disk)
    frame = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", 1 << 30))
    block = ((1 << 17) << 3) | (1 << 1)  # RLE block of 128 KiB
    for i in range(8192):
        frame += struct.pack("<I", block | (i == 8191))[:3] + b"\x00"
    f.put_shard(1, "w/c/0/0", [bytes(frame)])
    invalid(
        H,
        "a compressed chunk that expands to 1 GiB (its array holds 400 bytes)",
        S_LIMITS,
        fx,
        "integrity_error",
    )
    broken_read(H, fx, "w", "integrity_error", "through a decompression bomb (no 1 GiB allocation)")

    fx = "hostile/zstd_bomb_without_content_size"
    f = Fx(root, fx)
    f.save({"w": random_tensor((10, 10), torch.float32, 1430)}, 1, compression="zstd")
    # no declared size (a 128 KiB window), 8 RLE blocks of 128 KiB: 1 MiB for a 400-byte chunk
    frame = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0x00, 7 << 3]))
    for i in range(8):
        frame += struct.pack("<I", block | (i == 7))[:3] + b"\x00"
    f.put_shard(1, "w/c/0/0", [bytes(frame)])
    invalid(
        H,
        "a compressed chunk without a declared size that expands past its inner chunk",
        S_LIMITS,
        fx,
        "integrity_error",
    )
    broken_read(H, fx, "w", "integrity_error", "through a chunk that expands past its size")

    fx = "valid/zstd_without_content_size"
    f = Fx(root, fx)
    zt = {"w": random_tensor((10, 10), torch.float32, 1440)}
    f.save(zt, 1, compression="zstd")
    payload = le_bytes(zt["w"])  # one raw block in a frame that declares no content size (1 KiB window)
    f.put_shard(
        1, "w/c/0/0", [b"\x28\xb5\x2f\xfd\x00\x00" + struct.pack("<I", (len(payload) << 3) | 1)[:3] + payload]
    )
    valid(
        "compression",
        "a zstd frame that does not declare its content size (valid zstd) validates",
        S_ARRAYS,
        fx,
        "validate",
    )
    reads("compression", S_ARRAYS, fx, zt)

    fx = "hostile/zstd_not_a_frame"
    f = Fx(root, fx)
    f.save({"w": random_tensor((10, 10), torch.float32, 1410)}, 1, compression="zstd")
    f.put_shard(1, "w/c/0/0", [b"definitely not zstd"])
    invalid(
        H,
        "a compressed chunk (with a valid crc32c) that is not a zstd frame",
        S_INTEGRITY,
        fx,
        "integrity_error",
    )
    broken_read(H, fx, "w", "integrity_error", "through a chunk that does not decompress")

    fx = "hostile/zstd_short_frame"
    f = Fx(root, fx)
    f.save({"w": random_tensor((10, 10), torch.float32, 1420)}, 1, compression="zstd")
    import numcodecs

    f.put_shard(1, "w/c/0/0", [bytes(numcodecs.Zstd(level=1).encode(bytes(200)))])
    invalid(
        H, "a compressed chunk that expands to half its inner chunk size", S_INTEGRITY, fx, "integrity_error"
    )
    broken_read(H, fx, "w", "integrity_error", "through a short chunk (never padded with zeros)")

    # paths that leave the step or the repository
    fx = "hostile/path_escape_array_key"
    f, st = tiny(fx)
    rename_key(f, "w", "../../../../etc/passwd")
    invalid(
        H, "consolidated metadata names an array at '../../../../etc/passwd'", S_NAMES, fx, "invalid_name"
    )
    error(
        H,
        "a step with a path-escaping array key does not open",
        S_NAMES,
        fx,
        "open",
        "invalid_name",
        {"step": 1},
    )

    fx = "hostile/path_escape_escaped_slash"
    f, st = tiny(fx)
    rename_key(f, "w", "..%2F..%2Fetc")
    invalid(H, "a key hiding '../..' behind escaped slashes", S_NAMES, fx, "invalid_name")

    fx = "hostile/absolute_array_key"
    f, st = tiny(fx)
    rename_key(f, "w", "/etc/passwd")
    invalid(H, "consolidated metadata names an array at an absolute path", S_NAMES, fx, "invalid_name")

    fx = "hostile/absolute_path_in_commit"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"].__setitem__("/etc/passwd", [10, 0]))
    invalid(H, "a commit record listing /etc/passwd", S_LAYOUT, fx, "invalid_name")
    error(
        H,
        "a step whose record lists an absolute path does not open",
        S_LAYOUT,
        fx,
        "open",
        "invalid_name",
        {"step": 1},
    )

    fx = "hostile/parent_path_in_commit"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"].__setitem__("../../zarr.json", [10, 0]))
    invalid(H, "a commit record listing a file outside its step", S_LAYOUT, fx, "invalid_name")

    fx = "hostile/backslash_path_in_commit"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"].__setitem__("..\\..\\zarr.json", [10, 0]))
    invalid(H, "a commit record listing a path with backslashes", S_LAYOUT, fx, "invalid_name")

    fx = "hostile/nul_in_commit_path"
    f, st = tiny(fx)
    f.edit_commit(1, lambda d: d["files"].__setitem__("w/c/0/0\u0000.txt", [10, 0]))
    invalid(H, "a commit record listing a path with NUL", S_LAYOUT, fx, "invalid_name")

    fx = "hostile/nul_in_name"
    f, st = tiny(fx)
    rename_key(f, "w", "a%00b")
    invalid(H, "a key that decodes to a name with NUL", S_NAMES, fx, "invalid_name")

    fx = "hostile/nul_in_name_attribute"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("name", "w\u0000"))
    invalid(H, "attributes.ucl.name with a NUL", S_NAMES, fx, "invalid_name")

    fx = "hostile/escape_in_name_attribute"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("name", "\u001b[31mred"))
    invalid(H, "attributes.ucl.name with a terminal escape sequence", S_NAMES, fx, "invalid_name")

    fx = "hostile/lone_surrogate_in_name"
    f, st = tiny(fx)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("name", "w\ud800"))
    invalid(H, "attributes.ucl.name with a lone surrogate (\\ud800 in JSON)", S_NAMES, fx, "invalid_name")

    fx = "hostile/symlink_shard_outside"
    f, st = tiny(fx)
    f.p("steps/1/w/c/0/0").unlink()
    f.p("steps/1/w/c/0/0").symlink_to("/etc/passwd")
    invalid(H, "a shard that is a symbolic link to /etc/passwd", S_LAYOUT, fx, "invalid_name")
    broken_read(H, fx, "w", "invalid_name", "through a symbolic link out of the repository", section=S_LAYOUT)

    fx = "hostile/symlink_commit_outside"
    f, st = tiny(fx)
    f.p("commits/2.json").symlink_to("../../../valid/largest_step/commits/9223372036854775807.json")
    invalid(H, "commits/2.json is a symbolic link to another repository", S_LAYOUT, fx, "invalid_name")
    error(
        H,
        "a step whose commit record is a symbolic link out of the repository does not open",
        S_LAYOUT,
        fx,
        "open",
        "invalid_name",
        {"step": 2},
    )

    fx = "hostile/symlink_step_outside"
    f, st = tiny(fx, seed=700)  # the same data as valid/largest_step
    shutil.rmtree(f.p("steps/1"))
    f.p("steps/1").symlink_to("../../../valid/largest_step/steps/9223372036854775807")
    invalid(H, "steps/1 is a symbolic link to a step of another repository", S_LAYOUT, fx, "invalid_name")
    error(
        H,
        "a step whose folder is a symbolic link out of the repository does not open",
        S_LAYOUT,
        fx,
        "open",
        "invalid_name",
        {"step": 1},
    )

    # JSON that attacks the parser
    deep = b"[" * 100_000 + b"]" * 100_000
    fx = "hostile/deeply_nested_step_document"
    f, st = tiny(fx)
    f.put("steps/1/zarr.json", deep)
    f.reseal(1, "zarr.json")
    invalid(H, "a step document nested 100,000 levels deep", S_LIMITS, fx, "limit_exceeded")
    error(
        H,
        "a step with a 100,000-level document does not open (no stack overflow)",
        S_LIMITS,
        fx,
        "open",
        "limit_exceeded",
        {"step": 1},
    )

    fx = "hostile/deeply_nested_commit_record"
    f, st = tiny(fx)
    f.put("commits/1.json", b'{"a":' * 10_000 + b"1" + b"}" * 10_000)
    invalid(H, "a commit record nested 10,000 objects deep", S_LIMITS, fx, "corrupt_commit_record")

    fx = "hostile/deeply_nested_repository_document"
    f, st = tiny(fx)
    f.put("zarr.json", deep[:10_000] + deep[-10_000:])
    invalid(H, "a repository document nested 10,000 levels deep", S_LIMITS, fx, "limit_exceeded")

    fx = "hostile/deep_json_in_attribute"
    f, st = tiny(fx)

    def deep_attr(d: dict[str, Any]) -> None:
        node: Any = 0
        for _ in range(800):
            node = [node]
        d["attributes"]["user"] = {"deep": node}

    f.edit_array(1, "w", deep_attr)
    S.add(
        H,
        "a user attribute nested 800 levels deep: valid, or refused as too deep, never a crash",
        S_LIMITS,
        fx,
        "validate",
        verdict="valid",
        may_fail_with=["limit_exceeded"],
    )
    S.add(
        H,
        "reading next to an 800-level attribute",
        S_LIMITS,
        fx,
        "read",
        {"tensor": "w"},
        verdict="valid",
        data_sha256=sha(st["w"]),
        shape=[4, 3],
        may_fail_with=["limit_exceeded"],
    )

    fx = "hostile/huge_integer_literal"
    f, st = tiny(fx)
    raw = f.read("steps/1/zarr.json")
    f.put("steps/1/zarr.json", raw.replace(b'"step": 1,', b'"step": 1' + b"0" * 20_000 + b",", 1))
    f.reseal(1, "zarr.json")
    invalid(H, "a step number of 20,001 digits (quadratic integer parsing)", S_LIMITS, fx, "schema_violation")

    fx = "hostile/nan_in_json"
    f, st = tiny(fx)
    raw = f.read("steps/1/zarr.json")
    f.put("steps/1/zarr.json", raw.replace(b'"fill_value": 0.0', b'"fill_value": NaN', 1))
    f.reseal(1, "zarr.json")
    invalid(H, "NaN in a step document (not JSON)", S_LIMITS, fx, "schema_violation")
    error(
        H,
        "a step whose document contains NaN does not open",
        S_LIMITS,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "hostile/infinity_in_commit"
    f, st = tiny(fx)
    raw = f.read("commits/1.json")
    f.put("commits/1.json", raw.replace(b'"parent": null', b'"parent": Infinity', 1))
    invalid(H, "Infinity in a commit record (not JSON)", S_LIMITS, fx, "corrupt_commit_record")

    fx = "hostile/invalid_utf8_json"
    f, st = tiny(fx)
    raw = f.read("steps/1/zarr.json")
    f.put("steps/1/zarr.json", raw.replace(b'"kind": "full"', b'"kind": "f\xffull"', 1))
    f.reseal(1, "zarr.json")
    invalid(H, "a step document that is not UTF-8", S_LIMITS, fx, "schema_violation")

    fx = "hostile/json_not_an_object"
    f, st = tiny(fx)
    f.put("steps/1/zarr.json", b"[1, 2, 3]")
    f.reseal(1, "zarr.json")
    invalid(H, "a step document that is JSON but not an object", S_LIMITS, fx, "schema_violation")
    error(
        H,
        "a step whose document is not an object does not open",
        S_LIMITS,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "hostile/json_null_repository_document"
    f, st = tiny(fx)
    f.put("zarr.json", b"null")
    invalid(H, "a repository document that is JSON null", S_LIMITS, fx, "schema_violation")

    fx = "hostile/many_consolidated_entries"
    f, st = tiny(fx)

    def many(d: dict[str, Any]) -> None:
        m = d["consolidated_metadata"]["metadata"]
        for i in range(1000):
            m[f"g{i}"] = {"zarr_format": 3, "node_type": "group", "attributes": {}}

    f.edit_step_doc(1, many)
    valid(
        H, "1,000 group entries in consolidated metadata: harmless, still valid", S_STEP_DOC, fx, "validate"
    )

    fx = "hostile/step_number_overflow"
    f, st = tiny(fx)
    f.put("commits/9223372036854775808.json", f.read("commits/1.json"))
    f.put("commits/99999999999999999999999.json", f.read("commits/1.json"))
    f.put("commits/-1.json", f.read("commits/1.json"))
    valid(
        H, "commit files named beyond 2^63-1 or negative are not steps", S_COMMIT, fx, "list_steps", steps=[1]
    )
    valid(H, "and are not taken as the latest step", S_COMMIT, fx, "open", step=1, keys=["s", "w"])
    valid(H, "and do not make the repository invalid", S_COMMIT, fx, "validate")

    # == gradient records (spec/delta.md §8): steps that store one optimizer step's gradients ==========
    # Written by the engine (CheckpointManager with DeltaPolicy(gradients=True)); readers rebuild the
    # parameters and optimizer state by replaying AdamW on the parent. The fingerprint records this
    # generator's torch version: a reader whose optimizer differs, or that does not implement replay,
    # fails with unknown_extension (§8.2, §8.1.6), which the cases on gradient steps accept.
    G = "gradient_records"
    NO_REPLAY = ["unknown_extension"]
    fx = "valid/gradient_records"
    grad_fx = Fx(root, fx)
    ref = gradient_run(grad_fx.path)
    for step in ref:
        grad_fx.fix_time(step)
    keys = sorted(ref[1])
    assert set(ref[2]) == set(ref[3]) == set(keys) and "seen" in keys
    for step in (2, 3):  # stored as gradients, not as a fallback state delta
        ext = grad_fx.read_json(f"steps/{step}/zarr.json")["attributes"]["ucl"].get("extensions", [])
        assert [e["name"] for e in ext] == ["ucl.gradient_records"], (step, ext)
    no_grad = {n for n in keys if n == "model/0.bias" or n.startswith("optim/state/1/")}
    assert all(torch.equal(ref[3][n], ref[2][n]) == (n in no_grad) for n in keys if n != "seen")

    def replayed_what(step: int) -> Callable[[str], str]:
        def what(name: str) -> str:
            if name == "seen":
                return f", a state delta of step {step} (not replayed)"
            tail = f": replayed, AdamW on step {step - 1}" + (" (itself replayed)" if step == 3 else "")
            if step == 3 and name in no_grad:
                tail += "; no gradient in this step, so as in step 2"
            return tail

        return what

    valid(
        G,
        "a full step and two gradient-record steps validate (without replay: unknown_extension)",
        S_GRAD_VAL,
        fx,
        "validate",
        may_fail_with=NO_REPLAY,
    )
    valid(G, "the full step validates on its own", S_GRAD_VAL, fx, "validate", {"step": 1})
    valid(
        G,
        "a gradient-record step whose parent is a gradient-record step validates",
        S_GRAD_VAL,
        fx,
        "validate",
        {"step": 3},
        may_fail_with=NO_REPLAY,
    )
    valid(G, "gradient-record steps are steps", S_COMMIT, fx, "list_steps", steps=[1, 2, 3])
    valid(G, "the full step opens", S_GRAD_SEM, fx, "open", {"step": 1}, step=1, keys=keys)
    for step in (2, 3):
        valid(
            G,
            f"step {step} lists the replayed parameters and optimizer state, not its grad/ arrays",
            S_GRAD_SEM,
            fx,
            "open",
            {"step": step},
            step=step,
            keys=keys,
            may_fail_with=NO_REPLAY,
        )
    valid(
        G,
        "the latest step is the newest gradient-record step",
        S_GRAD_SEM,
        fx,
        "open",
        step=3,
        keys=keys,
        may_fail_with=NO_REPLAY,
    )
    reads(G, S_GRAD_SEM, fx, ref[1], step=1)
    for step in (2, 3):
        reads(
            G,
            S_GRAD_SEM,
            fx,
            ref[step],
            step=step,
            boxes={"model/0.weight": [[[1, 3], [2, 4]]], "optim/state/2/exp_avg_sq": [[[1, 2], [0, 4]]]},
            what=replayed_what(step),
            may_fail_with=NO_REPLAY,
        )
    for name in ("grad/model/0.weight", "grad/model/0.bias"):
        error(
            G,
            f"the gradient array {name!r} is not a tensor of the step's state",
            S_GRAD_SEM,
            fx,
            "read",
            "tensor_not_found",
            {"tensor": name, "step": 2},
            may_fail_with=NO_REPLAY,
        )

    def grad_copy(rel: str, steps: int = 2) -> Fx:
        """A copy of valid/gradient_records with its first ``steps`` steps (full step 1, then gradients)."""
        f = Fx(root, rel)
        shutil.copytree(grad_fx.path, f.path, dirs_exist_ok=True)
        for s in range(steps + 1, len(ref) + 1):
            shutil.rmtree(f.p(f"steps/{s}"))
            f.p(f"commits/{s}.json").unlink()
        return f

    def edit_records(f: Fx, step: int, fn: Callable[[dict[str, Any]], Any]) -> None:
        """Edit the ucl.gradient_records extension of a step (resealed)."""

        def upd(d: dict[str, Any]) -> None:
            (ext,) = [e for e in d["attributes"]["ucl"]["extensions"] if e["name"] == "ucl.gradient_records"]
            fn(ext)

        f.edit_step_doc(step, upd)

    def fails_to_open(fx: str, code: str, what: str, step: int = 2) -> None:
        error(G, f"a step whose {what} does not open", S_GRAD_SEM, fx, "open", code, {"step": step})

    fx = "invalid/metadata/gradient_replayed_tensor_stored"
    f = grad_copy(fx)
    full = f.read_json("steps/1/zarr.json")["consolidated_metadata"]["metadata"]
    for rel in ("model/zarr.json", "model/0.bias/zarr.json", "model/0.bias/c/0"):
        f.put(f"steps/2/{rel}", f.read(f"steps/1/{rel}"))
    f.edit_step_doc(
        2,
        lambda d: d["consolidated_metadata"]["metadata"].update(
            {k: full[k] for k in ("model", "model/0.bias")}
        ),
    )
    f.reseal(2, "model/zarr.json", "model/0.bias/zarr.json", "model/0.bias/c/0")
    invalid(
        G,
        "a replayed parameter is also stored as an array (step 1's, copied)",
        S_GRAD_SEM,
        fx,
        "inconsistent_metadata",
    )
    fails_to_open(fx, "inconsistent_metadata", "replayed parameter is also stored")

    fx = "invalid/metadata/gradient_base_step_not_parent"
    f = grad_copy(fx, steps=3)
    edit_records(f, 3, lambda e: e["configuration"].__setitem__("base_step", 1))
    invalid(
        G,
        "the extension's base_step (1, an ancestor) is not the step's parent (2)",
        S_GRAD_SEM,
        fx,
        "inconsistent_metadata",
    )
    fails_to_open(fx, "inconsistent_metadata", "base_step is not its parent", step=3)
    valid(
        G,
        "the step before it still opens",
        S_GRAD_SEM,
        fx,
        "open",
        {"step": 2},
        step=2,
        keys=keys,
        may_fail_with=NO_REPLAY,
    )

    fx = "invalid/metadata/gradient_parameter_not_in_tree"
    f = grad_copy(fx)
    edit_records(f, 2, lambda e: e["configuration"]["parameters"].append("model/4.weight"))
    invalid(
        G,
        "the extension names a parameter that the structure tree does not",
        S_GRAD_SEM,
        fx,
        "inconsistent_metadata",
    )
    fails_to_open(fx, "inconsistent_metadata", "gradient records name a parameter not in its tree")

    fx = "invalid/metadata/gradient_param_groups_missing"
    f = grad_copy(fx)
    edit_records(f, 2, lambda e: e["configuration"].pop("param_groups"))
    invalid(G, "the extension's configuration has no param_groups", S_GRAD, fx, "schema_violation")
    fails_to_open(fx, "schema_violation", "gradient records have no param_groups")

    fx = "invalid/metadata/gradient_param_group_with_params"
    f = grad_copy(fx)
    edit_records(f, 2, lambda e: e["configuration"]["param_groups"][1].__setitem__("params", [2]))
    invalid(G, "a group of the extension's param_groups has a params key", S_GRAD_SEM, fx, "schema_violation")

    fx = "invalid/metadata/gradient_must_understand_false"
    f = grad_copy(fx)
    edit_records(f, 2, lambda e: e.__setitem__("must_understand", False))
    invalid(G, "the extension says must_understand false", S_GRAD_SEM, fx, "schema_violation")
    fails_to_open(fx, "schema_violation", "gradient records say must_understand false")

    # stored gradients that do not fit their parameters: the documents agree with the data, the
    # replay chain does not (§8.3: broken_chain)
    fx = "invalid/metadata/gradient_shape_mismatch"
    f = grad_copy(fx)

    def transposed(d: dict[str, Any]) -> None:
        d["shape"] = [4, 2]  # the same eight elements in one inner chunk: the shard's bytes unchanged
        d["chunk_grid"]["configuration"]["chunk_shape"] = [4, 2]
        d["codecs"][0]["configuration"]["chunk_shape"] = [4, 2]

    f.edit_array(2, "grad/model/2.weight", transposed)
    invalid(
        G,
        "the gradient of 'model/2.weight' ([2, 4]) is stored with shape [4, 2]",
        S_GRAD_VAL,
        fx,
        "broken_chain",
    )
    valid(
        G,
        "its step opens (the documents agree with each other), or fails as its chain is broken",
        S_GRAD_SEM,
        fx,
        "open",
        {"step": 2},
        step=2,
        keys=keys,
        may_fail_with=["broken_chain", *NO_REPLAY],
    )
    error(
        G,
        "reading a tensor the replay would define fails: the replay cannot run",
        S_GRAD_VAL,
        fx,
        "read",
        "broken_chain",
        {"tensor": "model/2.weight", "step": 2},
        may_fail_with=["inconsistent_metadata", *NO_REPLAY],
    )

    fx = "invalid/metadata/gradient_dtype_mismatch"
    f = grad_copy(fx)
    f.edit_array(2, "grad/model/0.bias", lambda d: d.update(data_type="int32", fill_value=0))
    invalid(
        G,
        "the gradient of float32 'model/0.bias' is stored as int32 (same bytes)",
        S_GRAD_VAL,
        fx,
        "broken_chain",
    )
    error(
        G,
        "reading a tensor the replay would define fails: the replay cannot run",
        S_GRAD_VAL,
        fx,
        "read",
        "broken_chain",
        {"tensor": "optim/state/1/exp_avg", "step": 2},
        may_fail_with=["inconsistent_metadata", *NO_REPLAY],
    )

    fx = "invalid/integrity/gradient_parent_corrupt"
    f = grad_copy(fx, steps=3)
    f.flip("steps/1/optim/state/2/exp_avg_sq/c/0/0", 2)  # damage on disk: commit record untouched
    invalid(
        G,
        "one flipped bit in the full step's optimizer state",
        S_INTEGRITY,
        fx,
        "checksum_mismatch",
        {"step": 1},
    )
    for step in (2, 3):
        invalid(
            G,
            f"step {step} replays on the damaged state" + (" (through step 2)" if step == 3 else ""),
            S_GRAD_VAL,
            fx,
            "broken_chain",
            {"step": step},
        )
    error(
        G,
        "reading a replayed tensor that depends on the damaged one",
        S_GRAD_SEM,
        fx,
        "read",
        "checksum_mismatch",
        {"tensor": "optim/state/2/exp_avg_sq", "step": 2},
        may_fail_with=["broken_chain", *NO_REPLAY],
    )
    S.add(
        G,
        "reading a replayed tensor the damage does not reach: the replay loads the parent's whole state, "
        "so a reader fails, or returns the committed data",
        S_GRAD_SEM,
        fx,
        "read",
        {"tensor": "model/0.weight", "step": 3},
        verdict="valid",
        data_sha256=sha(ref[3]["model/0.weight"]),
        shape=[4, 4],
        may_fail_with=["checksum_mismatch", "broken_chain", *NO_REPLAY],
    )
    reads(
        G,
        S_GRAD_SEM,
        fx,
        {"seen": ref[2]["seen"]},
        step=2,
        what=lambda n: ", a state delta the damage does not reach",
        may_fail_with=NO_REPLAY,
    )

    return S


# -- main --------------------------------------------------------------------------------------------
def write(out: Path) -> Suite:
    fixtures = out / "fixtures"
    fixtures.mkdir(parents=True)
    suite = build(fixtures)
    cases = out / "cases"
    cases.mkdir(parents=True, exist_ok=True)
    for feature, items in suite.by_feature.items():
        (cases / f"{feature}.json").write_text(json.dumps(items, indent=2, ensure_ascii=False) + "\n")
    return suite


def _diff(a: Path, b: Path) -> list[str]:
    out = []
    cmp = filecmp.dircmp(a, b)
    out += [f"only in committed: {a / x}" for x in cmp.left_only]
    out += [f"only in regenerated: {b / x}" for x in cmp.right_only]
    out += [f"differs: {a / x}" for x in cmp.diff_files]
    for sub in cmp.common_dirs:
        out += _diff(a / sub, b / sub)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--force", action="store_true", help="delete and regenerate fixtures/ and cases/")
    ap.add_argument(
        "--check", action="store_true", help="regenerate into a temporary folder and list differences"
    )
    a = ap.parse_args(argv)
    if a.check:
        with tempfile.TemporaryDirectory() as tmp:
            write(Path(tmp))
            diffs = _diff(HERE / "fixtures", Path(tmp) / "fixtures") + _diff(
                HERE / "cases", Path(tmp) / "cases"
            )
        print("\n".join(diffs) or "fixtures and cases are what this script generates")
        return 1 if diffs else 0
    if (HERE / "fixtures").exists() and not a.force:
        print(
            "conformance/fixtures exists; committed fixtures are regenerated only on purpose (--force)",
            file=sys.stderr,
        )
        return 1
    for d in ("fixtures", "cases"):
        shutil.rmtree(HERE / d, ignore_errors=True)
    suite = write(HERE)
    n = sum(len(v) for v in suite.by_feature.values())
    print(
        f"wrote {n} cases in {len(suite.by_feature)} files; review with `git status conformance` and "
        "`git diff --stat conformance`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
