"""An independent reader of layout steps written from spec/core.md §6 and spec/layout.md §6.4 alone (no ucl
code): it decodes the raw shards of the conformance fixtures valid/layout_* with numpy, places every
logical element from the records element by element, and checks the sha256 the cases expect."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "conformance" / "fixtures"
DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}


def stored_array(step: Path, key: str, doc: dict) -> np.ndarray:
    """core.md §6: a regular grid of shards, each inner chunks [bytes, crc32c] indexed at the end."""
    shape, chunk = doc["shape"], doc["chunk_grid"]["configuration"]["chunk_shape"]
    inner = doc["codecs"][0]["configuration"]["chunk_shape"]
    dt = np.dtype(DTYPES[doc["data_type"]])
    out = np.zeros(shape, dt)
    per = [c // i for c, i in zip(chunk, inner, strict=True)]
    n = math.prod(per)
    for g in itertools.product(*(range(-(-s // c)) for s, c in zip(shape, chunk, strict=True))):
        f = step / key / "c" / "/".join(map(str, g)) if g else step / key / "c"
        if not f.exists():
            continue  # a chunk that holds no data (layout.md §6.5)
        data = f.read_bytes()
        index = [struct.unpack_from("<QQ", data, len(data) - 4 - 16 * n + 16 * k) for k in range(n)]
        for k, ic in enumerate(itertools.product(*(range(p) for p in per))):
            off, nb = index[k]
            if off == (1 << 64) - 1:
                continue
            block = np.frombuffer(data[off : off + nb - 4], dt).reshape(inner)
            lo = [gi * c + ii * i for gi, c, ii, i in zip(g, chunk, ic, inner, strict=True)]
            sl = tuple(slice(a, min(a + i, s)) for a, i, s in zip(lo, inner, shape, strict=True))
            out[sl] = block[tuple(slice(0, x.stop - x.start) for x in sl)]
    return out


def logical_tensors(repo: Path) -> dict[str, np.ndarray]:
    step = repo / "steps" / "1"
    meta = json.loads((step / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    arrays = {k: d for k, d in meta.items() if d.get("node_type") == "array"}
    maps: dict[str, list] = {}
    tensors: dict[str, tuple] = {}
    stored = {}
    for key in sorted(arrays, key=lambda k: arrays[k]["attributes"]["ucl"]["name"]):
        doc = arrays[key]
        name, rec = doc["attributes"]["ucl"]["name"], doc["attributes"]["ucl"].get("logical") or {}
        stored[name] = stored_array(step, key, doc)
        if not rec:  # layout.md §6.2, §6.4: the array is the tensor, one map at the origin
            tensors[name] = (tuple(doc["shape"]), doc["data_type"])
            maps.setdefault(name, []).append(
                (name, [[0] * len(doc["shape"]), doc["shape"]], [0] * len(doc["shape"]), None, 0)
            )
            continue
        for t, info in rec["tensors"].items():
            tensors[t] = (tuple(info["shape"]), info["dtype"])
        for m in rec["maps"]:
            maps.setdefault(m["tensor"], []).append(
                (name, m["box"], m["at"], m.get("view"), rec.get("partial", {}).get("count", 0))
            )
    out = {}
    for t, (shape, dtype) in tensors.items():
        res = np.zeros(shape, DTYPES[dtype])  # bfloat16 as its bits (no partial sums of it here)
        seen, held = [], np.zeros(shape, np.int64)
        for array, box, at, view, k in maps[t]:
            if box in seen:  # a replica (layout.md §6.4)
                continue
            seen.append(box)
            a = stored[array]
            for x in itertools.product(*(range(s, s + n) for s, n in zip(*box, strict=True))):
                y = tuple(ai + xi - bi for ai, xi, bi in zip(at, x, box[0], strict=True))
                if view is not None:  # stored element offset + ravel(view, y)
                    y = (view["offset"] + (int(np.ravel_multi_index(y, view["shape"])) if y else 0),)
                vals = [a[(c, *y)] for c in range(k)] if k else [a[y]]
                assert dtype != "bfloat16" or k == 0
                v = vals[0]
                for vv in vals[1:]:
                    v = v + vv  # contributions in increasing k
                res[x] = v
                held[x] += 1
        assert (held == 1).all(), f"{t}: the maps do not tile the tensor"
        out[t] = res
    return out


CASES = [
    c
    for c in json.loads((ROOT / "conformance" / "cases" / "layouts.json").read_text())
    if c["fixture"].startswith("valid/") and c["operation"] == "read"
]


@pytest.mark.parametrize("fixture", sorted({c["fixture"] for c in CASES}))
def test_the_text_reads_what_the_cases_expect(fixture: str) -> None:
    tensors = logical_tensors(FIXTURES / fixture)
    for c in (c for c in CASES if c["fixture"] == fixture):
        t = tensors[c["args"]["tensor"]]
        if "slice" in c["args"]:
            t = t[tuple(slice(a, b) for a, b in c["args"]["slice"])]
        got = hashlib.sha256(np.ascontiguousarray(t).tobytes()).hexdigest()
        assert got == c["expected"]["data_sha256"], c["description"]
