#!/usr/bin/env python3
"""An independent Level-0 UCL reader and validator, written from spec/core.md and spec/schemas/*.json only.

Level 0 (core.md §1): full steps of plain arrays. Layout records (spec/layout.md), delta steps and
gradient records (spec/delta.md) are not implemented and are refused with ``unknown_extension``, as
core.md §9 item 3 says for a Level-0 reader. Step documents of format versions 1 to 3 (a version 3
document's packed members expanded first, core.md §5.1 "Packed members"); commit records of ``ucl_commit``
1 and 2 (files grouped by prefix, core.md §7); every other document of version 1.

It does not import ucl. It is served over the JSON-lines protocol of conformance/runner.py
(``python level0.py`` reads requests on stdin, one response line per request). Section numbers in the
comments are those of spec/core.md version 1.1; SPEC_GAPS.md next to this file lists what the text left
open (tags ``GAP-Rn``) and what this implementation assumed there.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
from numcodecs import zstd as _zstd

HERE = Path(__file__).resolve().parent
SPEC_SCHEMAS = HERE.parent.parent / "spec" / "schemas"

sys.setrecursionlimit(10000)

# -- limits ------------------------------------------------------------------------------------------------
MAX_DOC = 268_435_456  # §3.4 item 1
MAX_JSON_DEPTH = 128  # §3.4 item 2
MAX_PACKED_DEPTH = 127  # §5.1 "Packed members" item 3: the content's members are one level deeper
STEP_VERSIONS = 3  # step documents of format versions 1 to 3 (§9 items 5, 6)
COMMIT_VERSIONS = 2  # commit records of ucl_commit 1 and 2 (§7, §9 item 5); every other document 1
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # §3.4 item 3
TOTAL_BYTES_LIMIT = 2**62  # §6 item 1: below 2^62 bytes
MAX_INNER_PER_SHARD = 2**24  # §6 item 4
MAX_INNER_BYTES = 2**31  # §6 item 4
MAX_NAME_BYTES = 1024  # §5.2 item 1
MAX_SEGMENTS = 32
MAX_SEGMENT_BYTES = 255
MAX_TREE_DEPTH = 32  # §5.3 item 2 (root at depth 0)
MAX_STEP = 2**63 - 1  # §3 item 5
ABSENT = 2**64 - 1  # §6.1
MAX_RESULT_BYTES = 2**33  # this implementation's bound on one read's result (not a format limit)

DTYPES = {  # §4
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex64": 8,
    "complex128": 16,
}
KNOWN_EXTENSIONS: set[str] = set()  # Level 0 implements no extension
SPEC_CODECS = {"sharding_indexed", "bytes", "zstd", "crc32c", "ucl.delta"}  # §6 item 4


class UErr(Exception):
    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class Missing(Exception):
    """A file that is not there (the caller knows which code that is)."""


def crc32c(b: bytes) -> int:
    return google_crc32c.value(bytes(b))


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prod(xs: Any) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


# -- schemas -----------------------------------------------------------------------------------------------
_VALIDATORS: dict[str, Any] = {}


def _schema_validator(name: str) -> Any:
    if not _VALIDATORS:
        from jsonschema import Draft202012Validator, validators
        from referencing import Registry, Resource

        docs = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in SPEC_SCHEMAS.glob("*.json")}
        registry = Registry().with_resources([(d["$id"], Resource.from_contents(d)) for d in docs.values()])
        # §3.4 item 3: an integer is an integer token; JSON Schema's 4.0-is-an-integer does not apply.
        # Integer tokens parse to int, fractions and exponents to float (json's default), so "int" is it.
        checker = Draft202012Validator.TYPE_CHECKER.redefine("integer", lambda _c, x: is_int(x))
        strict = validators.extend(Draft202012Validator, type_checker=checker)
        for fname, d in docs.items():
            _VALIDATORS[fname] = strict(d, registry=registry)
    return _VALIDATORS[name]


def check_schema(name: str, doc: Any, what: str) -> None:
    err = next(iter(_schema_validator(name).iter_errors(doc)), None)
    if err is not None:
        where = "/".join(map(str, err.absolute_path))
        raise UErr("schema_violation", f"{what}: {where}: {err.message[:300]}")


# -- JSON: the profile of §3.4 -----------------------------------------------------------------------------
def _parse_int(s: str) -> int:
    # §3.4 item 3: every integer token within [-2^63, 2^64 - 1], checked before converting a long one
    if len(s) > 21:
        raise ValueError(f"an integer of {len(s)} characters is beyond 64 bits")
    v = int(s)
    if not INT_MIN <= v <= INT_MAX:
        raise ValueError(f"integer {v} is beyond 64 bits")
    return v


def _no_constant(s: str) -> Any:
    raise ValueError(f"{s} is not JSON")  # §3.4 item 4


def _last_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)  # §3.4 item 5: a reader MAY take the last occurrence


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str, limit: int) -> int:
    """§3.4 item 2: the number of arrays and objects enclosing the deepest value (stops above limit)."""
    depth = best = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            if depth > best:
                best = depth
                if best > limit:
                    break
        else:
            depth -= 1
    return best


def load_json(data: bytes, what: str, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A document under §3.4: size and depth (limit_exceeded), then the rest (schema_violation)."""
    if len(data) > MAX_DOC:
        raise UErr("limit_exceeded", f"{what}: larger than 256 MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        text = None
        err = f"not UTF-8: {e}"
    if text is not None and json_depth(text, max_depth) > max_depth:
        raise UErr("limit_exceeded", f"{what}: nested deeper than {max_depth}")
    if text is None:
        raise UErr("schema_violation", f"{what}: {err}")
    try:
        doc = json.loads(
            text, parse_constant=_no_constant, parse_int=_parse_int, object_pairs_hook=_last_wins
        )
    except RecursionError:
        raise UErr("limit_exceeded", f"{what}: nested too deep") from None
    except ValueError as e:
        raise UErr("schema_violation", f"{what}: {e}") from None
    if not isinstance(doc, dict):
        raise UErr("schema_violation", f"{what}: the top level is not an object")
    return doc


def json_equal(a: Any, b: Any) -> bool:
    """§3.4 item 6: same type, same keys, equal values; numbers of the same value and kind."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=False))
    return bool(a == b)


def canonical_json(obj: Any) -> bytes:
    """§3.4 item 7. json.dumps with sort_keys sorts by code point and escapes exactly as item 7 says
    (\\" \\\\ \\b \\t \\n \\f \\r, other controls as lowercase \\u00xx, non-ASCII as itself)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


# -- names (§5.2) ------------------------------------------------------------------------------------------
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_HEX = frozenset("0123456789abcdefABCDEF")


def check_name(name: Any) -> None:
    """§5.2 item 1 (invalid_name)."""
    if not isinstance(name, str) or not name:
        raise UErr("invalid_name", "a tensor name is a non-empty string")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise UErr("invalid_name", f"{name!r}: a lone surrogate") from None
    segs = name.split("/")
    if len(raw) > MAX_NAME_BYTES:
        raise UErr("invalid_name", f"a name of {len(raw)} bytes")
    if len(segs) > MAX_SEGMENTS:
        raise UErr("invalid_name", f"a name of {len(segs)} segments")
    for s in segs:
        if not s:
            raise UErr("invalid_name", f"{name!r}: an empty segment")
        if len(s.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise UErr("invalid_name", f"{name!r}: a segment over {MAX_SEGMENT_BYTES} bytes")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in s):
            raise UErr("invalid_name", f"{name!r}: a control character")


def escape_segment(seg: str) -> str:
    """§5.2 item 2."""
    if seg == ".":
        return "%2E"
    if seg == "..":
        return "%2E%2E"
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in seg.encode("utf-8"))
    if out.startswith("__"):
        out = "%5F" + out[1:]
    return out


def escape(name: str) -> str:
    return "/".join(escape_segment(s) for s in name.split("/"))


def check_key_segments(key: Any) -> None:
    """§3 item 2: no empty, '.' or '..' segment, no backslash, no NUL, not absolute (invalid_name)."""
    if not isinstance(key, str) or not key:
        raise UErr("invalid_name", f"key {key!r}")
    if "\\" in key or "\x00" in key:
        raise UErr("invalid_name", f"key {key!r}: a backslash or NUL")
    for s in key.split("/"):  # a leading '/' gives an empty first segment
        if s in ("", ".", ".."):
            raise UErr("invalid_name", f"key {key!r}: an empty, '.' or '..' segment")


def unescape_key(key: Any) -> str:
    """The name a key decodes to; invalid_name unless the key is its canonical escape (§5.2 item 3)."""
    check_key_segments(key)
    segs = []
    for seg in key.split("/"):
        out = bytearray()
        i = 0
        while i < len(seg):
            if seg[i] == "%":
                h = seg[i + 1 : i + 3]
                if len(h) != 2 or not set(h) <= _HEX:
                    raise UErr("invalid_name", f"key {key!r}: a bad escape")
                out.append(int(h, 16))
                i += 3
            else:
                out += seg[i].encode("utf-8", "surrogatepass")
                i += 1
        try:
            segs.append(out.decode("utf-8"))
        except UnicodeDecodeError:
            raise UErr("invalid_name", f"key {key!r}: escapes that are not UTF-8") from None
    name = "/".join(segs)
    check_name(name)
    if escape(name) != key:
        raise UErr("invalid_name", f"key {key!r} is not the canonical escape of {name!r}")
    return name


# -- the filesystem (§3 items 2-3, §8 item 4) ---------------------------------------------------------------
class Store:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        try:
            self.real_root = os.path.realpath(self.root, strict=True)
        except OSError:
            raise UErr("not_found", f"no repository at {root}") from None
        if not os.path.isdir(self.real_root):
            raise UErr("not_found", f"{root} is not a directory")

    def _inside(self, rp: str) -> bool:
        return rp == self.real_root or rp.startswith(self.real_root + os.sep)

    def resolve(self, key: str) -> str:
        """The real path of key: invalid_name outside the root or unresolvable; Missing if absent."""
        check_key_segments(key)
        parts = key.split("/")
        # each directory on the way: inside the root, and a directory (§3 item 3, last sentence)
        for i in range(1, len(parts) + 1):
            p = os.path.join(self.root, *parts[:i])
            try:
                rp = os.path.realpath(p, strict=True)
            except FileNotFoundError:
                raise Missing(key) from None
            except OSError as e:  # a symbolic link loop
                raise UErr(
                    "invalid_name", f"{'/'.join(parts[:i])}: does not resolve ({e.strerror})"
                ) from None
            if not self._inside(rp):
                raise UErr("invalid_name", f"{'/'.join(parts[:i])}: resolves outside the repository")
            if i < len(parts) and not os.path.isdir(rp):
                raise UErr("not_a_file", f"{'/'.join(parts[:i])}: not a directory")
        return rp

    def exists(self, key: str) -> bool:
        try:
            self.resolve(key)
            return True
        except (Missing, UErr):
            return False

    def open_regular(self, key: str) -> tuple[int, int]:
        """(fd, size) of a regular file, opened without blocking (§3 item 3)."""
        rp = self.resolve(key)
        if not stat.S_ISREG(os.stat(rp).st_mode):
            raise UErr("not_a_file", f"{key}: not a regular file")
        fd = os.open(rp, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UErr("not_a_file", f"{key}: not a regular file")
        return fd, st.st_size

    def read_unlisted(self, key: str) -> bytes:
        """A document no record covers: at most 256 MiB, and no more than that is read (§3.4 item 1)."""
        fd, size = self.open_regular(key)
        try:
            if size > MAX_DOC:
                raise UErr("limit_exceeded", f"{key}: {size} bytes, over 256 MiB")
            data = pread_all(fd, 0, MAX_DOC + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_DOC:
            raise UErr("limit_exceeded", f"{key}: grew over 256 MiB")
        return data

    def listdir(self, key: str) -> list[str]:
        try:
            rp = self.resolve(key)
        except Missing:
            return []
        if not os.path.isdir(rp):
            raise UErr("not_a_file", f"{key}: not a directory")
        return os.listdir(rp)


def pread_all(fd: int, offset: int, n: int) -> bytes:
    parts = []
    while n > 0:
        b = os.pread(fd, min(n, 1 << 26), offset)
        if not b:
            break
        parts.append(b)
        offset += len(b)
        n -= len(b)
    return b"".join(parts)


# -- versions and extensions (§9) ----------------------------------------------------------------------------
def check_extensions(exts: Any, what: str) -> None:
    for e in exts or []:
        if e.get("name") not in KNOWN_EXTENSIONS and e.get("must_understand", True) is not False:
            raise UErr("unknown_extension", f"{what}: extension {e.get('name')!r} must be understood")


def check_version(obj: Any, field: str, what: str, newest: int = 1) -> None:
    """§9 item 1, §10.2 item 1: checked before the schema (whose const would also refuse it)."""
    if isinstance(obj, dict) and is_int(obj.get(field)) and obj[field] > newest:
        raise UErr("unsupported_version", f"{what}: {field} {obj[field]}")


# -- the repository document (§3.1) and the steps group document (§3.2) --------------------------------------
def open_repository(path: str) -> Store:
    store = Store(path)
    try:
        data = store.read_unlisted("zarr.json")
    except Missing:
        raise UErr("not_found", f"no zarr.json at {path}: not a repository") from None
    doc = load_json(data, "zarr.json")
    attrs = doc.get("attributes")
    ucl = attrs.get("ucl") if isinstance(attrs, dict) else None
    check_version(ucl, "format_version", "zarr.json")
    check_schema("repository.schema.json", doc, "zarr.json")
    check_extensions(doc["attributes"]["ucl"].get("extensions"), "zarr.json")
    return store


def check_steps_group(store: Store) -> None:
    """§3.2: exactly zarr_format 3, node_type group, any object as attributes; anything else (missing
    included) is schema_violation."""
    try:
        doc = load_json(store.read_unlisted("steps/zarr.json"), "steps/zarr.json")
    except Missing:
        raise UErr("schema_violation", "steps/zarr.json is missing") from None
    except UErr as e:
        raise UErr("schema_violation", f"steps/zarr.json: {e.message}") from None  # GAP-R3
    if not (
        set(doc) == {"zarr_format", "node_type", "attributes"}
        and is_int(doc["zarr_format"])
        and doc["zarr_format"] == 3
        and doc["node_type"] == "group"
        and isinstance(doc["attributes"], dict)
    ):
        raise UErr("schema_violation", "steps/zarr.json is not the steps group document")


# -- commit records (§7) -------------------------------------------------------------------------------------
_CANONICAL_STEP = re.compile(r"^(0|[1-9][0-9]{0,18})$")


def canonical_step(s: str) -> int | None:
    """§3 item 5: a decimal in [0, 2^63 - 1] without sign or leading zeros."""
    if _CANONICAL_STEP.match(s) and int(s) <= MAX_STEP:
        return int(s)
    return None


def commit_steps(store: Store) -> list[int]:
    out = []
    for n in store.listdir("commits"):
        if n.endswith(".json"):
            s = canonical_step(n[: -len(".json")])
            if s is not None:
                try:
                    if os.path.isdir(store.resolve(f"commits/{n}")):
                        continue  # §3 item 5: directories under commits/ are ignored
                except (Missing, UErr):
                    pass
                out.append(s)
    return sorted(out)


def load_commit(store: Store, step: int) -> dict[str, Any]:
    """§7 item 5 in its order: §3.4 and parsing (corrupt), ucl_commit, checksum, step, schema (corrupt),
    then extensions (unknown_extension) and paths (invalid_name)."""
    key = f"commits/{step}.json"
    try:
        data = store.read_unlisted(key)
    except UErr as e:
        if e.code == "limit_exceeded":
            raise UErr("corrupt_commit_record", e.message) from None  # §7 item 5: §3.4 size, GAP-R2
        raise
    try:
        rec = load_json(data, key)
    except UErr as e:
        raise UErr("corrupt_commit_record", e.message) from None
    check_version(rec, "ucl_commit", key, COMMIT_VERSIONS)
    cs = rec.get("checksum")
    if not is_int(cs):
        raise UErr("corrupt_commit_record", f"{key}: no integer checksum")
    try:
        want = crc32c(canonical_json({k: v for k, v in rec.items() if k != "checksum"}))
    except (TypeError, ValueError, UnicodeEncodeError) as e:
        raise UErr("corrupt_commit_record", f"{key}: has no canonical JSON: {e}") from None
    if want != cs:
        raise UErr("corrupt_commit_record", f"{key}: checksum {cs}, computed {want}")
    if not is_int(rec.get("step")) or rec["step"] != step:
        raise UErr("corrupt_commit_record", f"{key}: is the record of step {rec.get('step')!r}")
    try:
        check_schema("commit.schema.json", rec, key)
    except UErr as e:
        raise UErr("corrupt_commit_record", e.message) from None
    if rec["ucl_commit"] == 2:  # §7: {prefix: {rest: entry}} lists prefix/rest (rest under "")
        flat: dict[str, Any] = {}
        for prefix, group in rec["files"].items():
            for rest, entry in group.items():
                path = f"{prefix}/{rest}" if prefix else rest
                if path in flat:
                    raise UErr("corrupt_commit_record", f"{key}: {path!r} is listed twice")
                flat[path] = entry
        rec = {**rec, "files": flat}
    check_extensions(rec.get("extensions"), key)
    for f in rec["files"]:
        check_key_segments(f)
    return rec


def unlisted_step_code(store: Store, step: int) -> UErr:
    """§7 item 6: not_committed when steps/<S>/zarr.json exists, else not_found."""
    if store.exists(f"steps/{step}/zarr.json"):
        return UErr("not_committed", f"step {step} has a step document but no commit record")
    return UErr("not_found", f"no step {step}")


def read_listed(store: Store, step: int, rel: str, files: dict[str, Any], what: str) -> bytes:
    """A document the step needs, against its commit entry (§10.2 item 3: listed and present, a regular
    file inside the repository, its size, its crc32c)."""
    if rel not in files:
        raise UErr("missing_shard", f"{what}: {rel} is not in the commit record")  # §8 item 5
    size, crc = files[rel]
    key = f"steps/{step}/{rel}"
    try:
        fd, actual = store.open_regular(key)
    except Missing:
        raise UErr("missing_shard", f"{what}: {key} is absent") from None
    try:
        if actual != size:
            raise UErr("size_mismatch", f"{key}: {actual} bytes, recorded {size}")
        data = pread_all(fd, 0, min(size, MAX_DOC + 1))
    finally:
        os.close(fd)
    if len(data) > MAX_DOC:
        raise UErr("limit_exceeded", f"{key}: over 256 MiB")
    if len(data) != size:
        raise UErr("size_mismatch", f"{key}: read {len(data)} bytes, recorded {size}")
    if crc32c(data) != crc:
        raise UErr("checksum_mismatch", f"{key}: its crc32c differs from the commit record")
    return data


# -- arrays (§6) ---------------------------------------------------------------------------------------------
class ArrayMeta:
    def __init__(self, key: str, name: str, doc: dict[str, Any]) -> None:
        self.key = key
        self.name = name
        self.doc = doc
        self.shape: tuple[int, ...] = tuple(doc["shape"])
        self.dtype: str = doc["data_type"]
        self.itemsize = DTYPES[self.dtype]
        self.chunk: tuple[int, ...] = tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
        cfg = doc["codecs"][0]["configuration"]
        self.inner: tuple[int, ...] = tuple(cfg["chunk_shape"])
        self.zstd = any(c["name"] == "zstd" for c in cfg["codecs"])
        self.per_shard = tuple(c // i for c, i in zip(self.chunk, self.inner, strict=False))
        self.n_inner = _prod(self.per_shard)
        self.inner_bytes = _prod(self.inner) * self.itemsize
        self.grid = tuple(-(-s // c) for s, c in zip(self.shape, self.chunk, strict=False))
        self.empty = any(s == 0 for s in self.shape)

    def shard_key(self, coords: tuple[int, ...]) -> str:
        return f"{self.key}/c" + "".join(f"/{i}" for i in coords)

    def n_shards(self) -> int:
        return 0 if self.empty else _prod(self.grid)


def _is_bytes_le(c: dict[str, Any], itemsize: int) -> bool:
    if c.get("name") != "bytes":
        return False
    cfg = c.get("configuration", {})
    if not isinstance(cfg, dict) or set(cfg) - {"endian"}:
        return False
    e = cfg.get("endian")
    return e == "little" or (e is None and itemsize == 1)


def _is_crc(c: dict[str, Any]) -> bool:
    cfg = c.get("configuration")
    return c.get("name") == "crc32c" and (cfg is None or cfg == {})


def _is_zstd(c: dict[str, Any]) -> bool:
    """§6.2: level an integer in [-131072, 22], checksum a boolean, either absent."""
    if c.get("name") != "zstd":
        return False
    cfg = c.get("configuration", {})
    if not isinstance(cfg, dict) or set(cfg) - {"level", "checksum"}:
        return False
    if "level" in cfg and not (is_int(cfg["level"]) and -131072 <= cfg["level"] <= 22):
        return False
    return "checksum" not in cfg or isinstance(cfg["checksum"], bool)


def check_array(key: str, doc: Any, version: int) -> ArrayMeta:
    """One array document of a step of format ``version``, in the order of §10.2 items 3-4 (after §3.4,
    which its step document passed): data type, schema, name, ranks and division, limits, codecs, layout or
    delta record. The name against the key is the caller's (§10.2 item 5)."""
    what = f"array {key!r}"
    if not isinstance(doc, dict):
        raise UErr("schema_violation", f"{what}: not an object")
    dt = doc.get("data_type")
    if isinstance(dt, str) and dt not in DTYPES:
        raise UErr("unsupported_dtype", f"{what}: data type {dt!r}")  # §6 item 7
    check_schema("array.schema.json", doc, what)
    ucl = doc["attributes"]["ucl"]
    if version >= 2 and "logical" in ucl:  # §6 item 5: version 2 keeps the records in the step document
        raise UErr("schema_violation", f"{what}: attributes.ucl.logical in a step of version {version}")
    try:
        check_name(ucl["name"])  # §5.2 item 3
    except UErr as e:
        raise UErr("invalid_name", f"{what}: attributes.ucl.name: {e.message}") from None
    shape = doc["shape"]
    chunk = doc["chunk_grid"]["configuration"]["chunk_shape"]
    cfg = doc["codecs"][0]["configuration"]
    inner = cfg["chunk_shape"]
    if not len(shape) == len(chunk) == len(inner):  # §6 item 1
        raise UErr(
            "inconsistent_metadata", f"{what}: shape, chunk shape and inner chunk shape differ in rank"
        )
    if any(c % i for c, i in zip(chunk, inner, strict=False)):  # §6 item 4
        raise UErr("inconsistent_metadata", f"{what}: the inner chunk shape does not divide the chunk shape")
    itemsize = DTYPES[doc["data_type"]]
    if _prod(shape) * itemsize >= TOTAL_BYTES_LIMIT:  # §6 item 1
        raise UErr("limit_exceeded", f"{what}: {_prod(shape) * itemsize} bytes, not below 2^62")
    if _prod(c // i for c, i in zip(chunk, inner, strict=False)) > MAX_INNER_PER_SHARD:  # §6 item 4
        raise UErr("limit_exceeded", f"{what}: more than 2^24 inner chunks per shard")
    if _prod(inner) * itemsize > MAX_INNER_BYTES:
        raise UErr("limit_exceeded", f"{what}: an inner chunk above 2^31 bytes")
    # codecs (§6 item 4): unknown names first, then a Level-0 refusal of ucl.delta (§9 item 3), then chains
    for c in [doc["codecs"][0], *cfg["codecs"], *cfg["index_codecs"]]:
        if c.get("name") not in SPEC_CODECS:
            raise UErr("unknown_extension", f"{what}: unknown codec {c.get('name')!r}")
    for c in cfg["codecs"]:
        if c.get("name") == "ucl.delta":
            raise UErr(
                "unknown_extension",
                f"{what}: the ucl.delta codec (delta steps) is not implemented at Level 0",
            )
    ic = cfg["index_codecs"]
    if not (len(ic) == 2 and _is_bytes_le(ic[0], 8) and _is_crc(ic[1])):
        raise UErr("schema_violation", f"{what}: index codecs are not [bytes(little), crc32c]")
    if cfg.get("index_location", "end") != "end":
        raise UErr("schema_violation", f"{what}: index_location is not end")
    cc = cfg["codecs"]
    two = len(cc) == 2 and _is_bytes_le(cc[0], itemsize) and _is_crc(cc[1])
    three = len(cc) == 3 and _is_bytes_le(cc[0], itemsize) and cc[1].get("name") == "zstd" and _is_crc(cc[2])
    if not (two or three):
        raise UErr("schema_violation", f"{what}: inner codecs are not [bytes(little), (zstd), crc32c]")
    if three and not _is_zstd(cc[1]):
        raise UErr("schema_violation", f"{what}: a zstd configuration outside §6.2")
    sep = doc["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
    if sep != "/":
        raise UErr("schema_violation", f"{what}: chunk key separator {sep!r}")
    # layout and delta records (§9 item 3): GAP-R4, an empty logical record is no record
    if ucl.get("logical"):
        raise UErr(
            "unknown_extension", f"{what}: a layout record (spec/layout.md) is not implemented at Level 0"
        )
    if "delta" in ucl:
        raise UErr(
            "unknown_extension", f"{what}: a delta record (spec/delta.md) is not implemented at Level 0"
        )
    return ArrayMeta(key, ucl["name"], doc)


# -- step documents (§5) -------------------------------------------------------------------------------------
def tree_form(node: Any) -> None:
    """§5.3: every node of one of the five forms (schema_violation)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, dict):
            raise UErr("schema_violation", "a tree node is not an object")
        t = n.get("t")
        if t == "dict":
            items = n.get("items")
            if not isinstance(items, list):
                raise UErr("schema_violation", "a dict node's items is not a list")
            for it in items:
                if not (isinstance(it, list) and len(it) == 2 and (isinstance(it[0], str) or is_int(it[0]))):
                    raise UErr("schema_violation", "a dict item is not [key, node]")
                stack.append(it[1])
        elif t in ("list", "tuple"):
            if not isinstance(n.get("items"), list):
                raise UErr("schema_violation", f"a {t} node's items is not a list")
            stack.extend(n["items"])
        elif t == "tensor":
            if not isinstance(n.get("name"), str):
                raise UErr("schema_violation", "a tensor node without a name")
        elif t == "value":
            if "v" not in n or isinstance(n["v"], (dict, list)):
                raise UErr("schema_violation", "a value node whose v is not a JSON scalar")
        elif t == "float":
            if n.get("v") not in ("nan", "inf", "-inf"):
                raise UErr("schema_violation", "a float node that is not nan, inf or -inf")
        else:
            raise UErr("schema_violation", f"a tree node of type {t!r}")


def tree_depth_and_names(node: dict[str, Any]) -> set[str]:
    """§5.3 item 2 (root at depth 0, at most 32: limit_exceeded); the tensor names of the tree."""
    names: set[str] = set()
    stack = [(node, 0)]
    while stack:
        n, d = stack.pop()
        if d > MAX_TREE_DEPTH:
            raise UErr("limit_exceeded", f"a tree node at depth {d}, above {MAX_TREE_DEPTH}")
        t = n["t"]
        if t == "dict":
            stack.extend((it[1], d + 1) for it in n["items"])
        elif t in ("list", "tuple"):
            stack.extend((it, d + 1) for it in n["items"])
        elif t == "tensor":
            names.add(n["name"])
    return names


class StepMeta:
    def __init__(self, step: int, record: dict[str, Any], doc: dict[str, Any]) -> None:
        self.step = step
        self.record = record
        self.files: dict[str, list[int]] = record["files"]
        self.doc = doc
        self.metadata: dict[str, Any] = doc["consolidated_metadata"]["metadata"]
        self.arrays: dict[str, ArrayMeta] = {}  # tensor name -> array
        self.array_keys: list[str] = []  # every key whose node is (or claims to be) an array
        self.groups: list[str] = []


def open_step_doc(
    store: Store, step: int, rec: dict[str, Any], errors: list[tuple[str, UErr]] | None = None
) -> StepMeta:
    """The step document in the order of §10.2 items 3 and 5. Without ``errors`` (an operation) the
    first failure raises; with it (a validator, §8 item 3) per-tensor failures are appended to it and
    the checks go on, while a failure of the step document itself still raises."""
    data = read_listed(store, step, "zarr.json", rec["files"], f"step {step}")
    what = f"steps/{step}/zarr.json"
    doc = load_json(data, what)
    attrs = doc.get("attributes")
    ucl = attrs.get("ucl") if isinstance(attrs, dict) else None
    check_version(ucl, "format_version", what, STEP_VERSIONS)
    if isinstance(ucl, dict) and ucl.get("format_version") == 3 and "packed" in ucl:
        doc = expand_packed(doc, what)  # §10.2 item 3: after the version, before everything else
    check_schema("step.schema.json", doc, what)  # packed in a version 1 or 2 document: the schema's false
    ucl = doc["attributes"]["ucl"]
    check_extensions(ucl.get("extensions"), what)
    meta = StepMeta(step, rec, doc)

    def fail(key: str, e: UErr) -> None:
        if errors is None:
            raise e
        errors.append((key, e))

    # the keys of the consolidated metadata (invalid_name)
    good: list[tuple[str, Any]] = []
    for key in sorted(meta.metadata):
        node = meta.metadata[key]
        is_group = isinstance(node, dict) and node.get("node_type") == "group"
        if not is_group:
            meta.array_keys.append(key)
        try:
            unescape_key(key)
        except UErr as e:
            fail(key, e)
            continue
        if is_group:
            meta.groups.append(key)
        else:
            good.append((key, node))
    # each array document (§10.2 item 4)
    checked: list[ArrayMeta] = []
    for key, node in good:
        try:
            checked.append(check_array(key, node, ucl["format_version"]))
        except UErr as e:
            fail(key, e)
    # each array's name against its key (§5.2 item 3)
    for a in checked:
        if escape(a.name) != a.key:
            fail(
                a.key,
                UErr(
                    "inconsistent_metadata",
                    f"array {a.key!r}: its name {a.name!r} does not escape to its key",
                ),
            )
        else:
            meta.arrays[a.name] = a
    # the tree: form, depth, the tensors it names (§5.3)
    tree_form(ucl["tree"])
    names = tree_depth_and_names(ucl["tree"])
    # GAP-R6: in a validator, a tensor whose array already failed is not reported a second time
    failed = {k for k, _ in errors or []}
    missing = sorted(n for n in names if n not in meta.arrays and escape(n) not in failed)
    if missing:
        raise UErr(
            "inconsistent_metadata", f"the tree names tensors that are not arrays of the step: {missing[:5]}"
        )
    # the step number, kind and parent against the commit record (§5.1)
    if ucl["step"] != step:
        raise UErr("inconsistent_metadata", f"{what}: says step {ucl['step']}")
    if ucl["kind"] != rec["kind"]:
        raise UErr(
            "inconsistent_metadata", f"{what}: kind {ucl['kind']!r}, the commit record's {rec['kind']!r}"
        )
    if ucl.get("parent") != rec.get("parent"):
        raise UErr("inconsistent_metadata", f"{what}: parent differs from the commit record's")
    # a Level-0 reader on a layout or delta step, or one with logical records (version 2 and 3: in the step
    # document) (§9 item 3); GAP-R1: its place in the order
    if ucl["kind"] == "delta" or ucl.get("layout") is not None or "logical" in ucl:
        raise UErr("unknown_extension", f"{what}: layout and delta steps are not implemented at Level 0")
    return meta


def check_step_arg(step: Any) -> None:
    if step is not None and not (is_int(step) and 0 <= step <= MAX_STEP):
        raise UErr("invalid_argument", f"step {step!r} is not an integer in [0, 2^63 - 1]")


def open_step(store: Store, step: int | None) -> StepMeta:
    check_step_arg(step)
    if step is None:
        # §7 item 6: the latest step is the greatest listed one
        for s in reversed(commit_steps(store)):
            try:
                rec = load_commit(store, s)
            except (UErr, Missing):
                continue
            break
        else:
            raise UErr("not_found", "the repository lists no step")
    else:
        s = step
        if s not in commit_steps(store):
            raise unlisted_step_code(store, s)
        try:
            rec = load_commit(store, s)
        except Missing:
            raise unlisted_step_code(store, s) from None
    return open_step_doc(store, s, rec)


# -- shards (§6.1, §6.2, §8) ---------------------------------------------------------------------------------
def lazy_product(ranges: list[range]) -> Any:
    """itertools.product without materializing its inputs (a range of 2^38 shards stays a range)."""
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in lazy_product(ranges[1:]):
            yield (i, *rest)


class Shard:
    """One shard, checked in the order of §10.2 item 7 up to its index rules before any entry is used."""

    def __init__(self, store: Store, meta: StepMeta, a: ArrayMeta, coords: tuple[int, ...]) -> None:
        self.a = a
        self.coords = coords
        rel = a.shard_key(coords)
        self.rel = rel
        if rel not in meta.files:  # §8 items 2 and 5
            raise UErr("missing_shard", f"shard {rel} of {a.name!r} is not in the commit record")
        size, digest = meta.files[rel]
        try:
            fd, actual = store.open_regular(f"steps/{meta.step}/{rel}")
        except Missing:
            raise UErr("missing_shard", f"shard {rel} of {a.name!r} is absent") from None
        self.fd = fd
        try:
            if actual != size:
                raise UErr("size_mismatch", f"shard {rel}: {actual} bytes, recorded {size}")
            n = a.n_inner
            index_len = 16 * n + 4
            if size < index_len:
                raise UErr("size_mismatch", f"shard {rel}: {size} bytes, shorter than its index")
            idx = pread_all(fd, size - index_len, index_len)
            if len(idx) != index_len:
                raise UErr("size_mismatch", f"shard {rel}: shorter than recorded")
            if crc32c(idx[:-4]) != int.from_bytes(idx[-4:], "little"):
                raise UErr("checksum_mismatch", f"shard {rel}: the index fails its crc32c")
            self.index_crc = idx[-4:]
            ent = np.frombuffer(idx[:-4], dtype="<u8").reshape(n, 2)
            off, nb = ent[:, 0], ent[:, 1]
            absent = (off == ABSENT) & (nb == ABSENT)
            if ((off == ABSENT) ^ (nb == ABSENT)).any():
                raise UErr("corrupt_shard_index", f"shard {rel}: an entry is half absent")
            data_len = size - index_len
            present = [(int(o), int(b)) for o, b in zip(off[~absent], nb[~absent], strict=False)]
            for o, b in present:
                if b < 4 or o + b > data_len:
                    raise UErr("corrupt_shard_index", f"shard {rel}: entry ({o}, {b}) outside the data part")
                if not a.zstd and b != a.inner_bytes + 4:
                    raise UErr(
                        "corrupt_shard_index", f"shard {rel}: an entry of {b} bytes, not {a.inner_bytes + 4}"
                    )
            order = sorted(present)
            for (o1, b1), (o2, _) in zip(order, order[1:], strict=False):
                if o1 + b1 > o2:
                    raise UErr("corrupt_shard_index", f"shard {rel}: entries overlap")
            inb = self._in_bounds()
            if (absent & inb).any():
                raise UErr("corrupt_shard_index", f"shard {rel}: an in-bounds inner chunk is absent")
            if (~absent & ~inb).any():
                raise UErr(
                    "corrupt_shard_index", f"shard {rel}: an inner chunk wholly outside the array is present"
                )
            self.off, self.nb, self.absent, self.digest = off, nb, absent, digest
        except BaseException:
            os.close(fd)
            raise

    def _in_bounds(self) -> np.ndarray:
        a = self.a
        if not a.shape:
            return np.ones(1, dtype=bool)
        mask = np.ones((), dtype=bool)
        for d, (m, c, i, s) in enumerate(zip(a.per_shard, a.chunk, a.inner, a.shape, strict=False)):
            md = np.array([self.coords[d] * c + k * i < s for k in range(m)], dtype=bool)
            mask = np.logical_and.outer(mask, md)
        return mask.reshape(-1)

    def close(self) -> None:
        os.close(self.fd)

    def present(self) -> list[int]:
        return [int(j) for j in np.nonzero(~self.absent)[0]]

    def check_digest(self) -> None:
        """§7: crc32c of the stored crc32c's of the present chunks in index order, then the index's."""
        parts = [pread_all(self.fd, int(self.off[j]) + int(self.nb[j]) - 4, 4) for j in self.present()]
        parts.append(self.index_crc)
        if crc32c(b"".join(parts)) != self.digest:
            raise UErr("checksum_mismatch", f"shard {self.rel}: its digest differs from the commit record")

    def chunk(self, j: int) -> np.ndarray:
        """Inner chunk j (C order in the shard), verified and decoded: uint8, inner shape + [itemsize]."""
        a = self.a
        o, b = int(self.off[j]), int(self.nb[j])
        raw = pread_all(self.fd, o, b)
        payload = raw[:-4]
        if crc32c(payload) != int.from_bytes(raw[-4:], "little"):
            raise UErr("checksum_mismatch", f"shard {self.rel}: inner chunk {j} fails its crc32c")
        if a.zstd:
            payload = zstd_decode(payload, a.inner_bytes, f"shard {self.rel}, inner chunk {j}")
        return np.frombuffer(payload, dtype=np.uint8).reshape(a.inner + (a.itemsize,))


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def zstd_frame(payload: bytes, what: str, code: str = "integrity_error") -> int | None:
    """Walk one zstd frame (RFC 8878 §3.1.1): §6.2 item 1 says an inner chunk is exactly one frame, so
    anything else (another magic, a dictionary, bytes after the frame, a frame cut short) is
    integrity_error (``code``: schema_violation for packed members, §5.1 items 1-2). Returns the declared
    Frame_Content_Size, or None when the header has none."""

    def bad(why: str) -> UErr:
        return UErr(code, f"{what}: not exactly one zstd frame: {why}")

    if len(payload) < 6 or payload[:4] != ZSTD_MAGIC:
        raise bad("no zstd magic")
    fhd = payload[4]
    fcs_flag, single, checksum, reserved, dict_flag = (
        fhd >> 6,
        (fhd >> 5) & 1,
        (fhd >> 2) & 1,
        (fhd >> 3) & 1,
        fhd & 3,
    )
    if reserved:
        raise bad("a reserved header bit is set")
    pos = 5 + (0 if single else 1)
    nd = (0, 1, 2, 4)[dict_flag]
    if nd and int.from_bytes(payload[pos : pos + nd], "little") != 0:
        raise bad("the frame needs a dictionary")
    pos += nd
    nf = (1 if single else 0, 2, 4, 8)[fcs_flag]
    declared = None
    if nf:
        if len(payload) < pos + nf:
            raise bad("a header cut short")
        declared = int.from_bytes(payload[pos : pos + nf], "little") + (256 if nf == 2 else 0)
    pos += nf
    while True:
        if len(payload) < pos + 3:
            raise bad("a block header cut short")
        bh = int.from_bytes(payload[pos : pos + 3], "little")
        last, btype, bsize = bh & 1, (bh >> 1) & 3, bh >> 3
        if btype == 3:
            raise bad("a reserved block type")
        pos += 3 + (1 if btype == 1 else bsize)
        if pos > len(payload):
            raise bad("a block cut short")
        if last:
            break
    pos += 4 if checksum else 0
    if pos != len(payload):
        raise bad(
            f"{len(payload) - pos} bytes after the frame" if pos < len(payload) else "a checksum cut short"
        )
    return declared


def zstd_decode(payload: bytes, size: int, what: str) -> bytes:
    """§6.2 items 2-3: exactly ``size`` bytes, never an allocation beyond that (integrity_error)."""
    declared = zstd_frame(payload, what)
    if declared is not None and declared != size:
        raise UErr("integrity_error", f"{what}: declares {declared} bytes, its inner chunk has {size}")
    dest = bytearray(size)
    try:
        # decodes into dest, and fails when the frame decodes to more or fewer bytes than dest holds
        # (or fails its content checksum)
        _zstd.decompress(payload, dest)
    except (ValueError, RuntimeError) as e:
        raise UErr("integrity_error", f"{what}: does not decode to exactly {size} bytes: {e}") from None
    return bytes(dest)


# -- packed members of a version 3 step document (§5.1 "Packed members") ----------------------------------
_PADDED_B64 = re.compile(r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$")


def packed_declared_size(frame: bytes, what: str) -> int:
    """§5.1 item 1, from the frame's header alone (RFC 8878 §3.1.1.1): the magic number, no
    Dictionary_ID field (GAP-P1), a Frame_Content_Size present, at least 2 and at most
    256 MiB. Nothing is decompressed before this passes."""

    def bad(why: str) -> UErr:
        return UErr("schema_violation", f"{what}: attributes.ucl.packed: {why}")

    if len(frame) < 5 or frame[:4] != ZSTD_MAGIC:
        raise bad("not a Zstandard frame (no magic number)")
    fhd = frame[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1)  # the Window_Descriptor, absent in a single-segment frame
    nd = (0, 1, 2, 4)[dict_flag]
    nf = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if len(frame) < pos + nd + nf:
        raise bad("the frame header is cut short")
    if nd:  # even a Dictionary_ID of 0: the field itself is refused (§5.1 item 1, GAP-P1 as answered)
        raise bad("the frame has a Dictionary_ID field")
    pos += nd
    if not nf:
        raise bad("the frame header does not declare its content size")
    declared = int.from_bytes(frame[pos : pos + nf], "little") + (256 if nf == 2 else 0)
    if declared < 2:
        raise bad(f"the frame declares {declared} bytes, fewer than any JSON object")
    if declared > MAX_DOC:
        raise UErr("limit_exceeded", f"{what}: attributes.ucl.packed declares {declared} bytes, over 256 MiB")
    return declared


def expand_packed(doc: dict[str, Any], what: str) -> dict[str, Any]:
    """§5.1 "Packed members", items 1-4 in their order: the version 3 document ``doc`` (attributes.ucl a
    dict holding ``packed``) with its packed members in place and ``packed`` removed."""
    ucl = doc["attributes"]["ucl"]
    text = ucl["packed"]
    # item 1: a string of padded base64 (RFC 4648 §4, no line breaks) of a Zstandard frame, its header sound
    if not isinstance(text, str):
        raise UErr("schema_violation", f"{what}: attributes.ucl.packed is not a string")
    if not _PADDED_B64.match(text):
        raise UErr("schema_violation", f"{what}: attributes.ucl.packed is not padded base64")
    try:
        frame = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise UErr("schema_violation", f"{what}: attributes.ucl.packed is not base64: {e}") from None
    size = packed_declared_size(frame, what)
    # item 2: exactly one frame, nothing after it, decompressing to exactly its declared size (never more)
    zstd_frame(frame, f"{what}: attributes.ucl.packed", code="schema_violation")
    dest = bytearray(size)
    try:
        _zstd.decompress(frame, dest)
    except (ValueError, RuntimeError) as e:
        raise UErr("schema_violation", f"{what}: attributes.ucl.packed does not decompress to exactly its "
                   f"declared {size} bytes: {e}") from None
    # item 3: a document of its own for §3.4, 127 levels deep at most (not an object: item 4's code)
    inner = load_json(bytes(dest), f"{what}: attributes.ucl.packed's content", MAX_PACKED_DEPTH)
    # item 4: at most ucl (an object) and consolidated_metadata, no member given twice
    other = sorted(set(inner) - {"ucl", "consolidated_metadata"})
    if other:
        raise UErr("schema_violation", f"{what}: attributes.ucl.packed holds the member {other[0]!r}")
    members = inner.get("ucl", {})
    if not isinstance(members, dict):
        raise UErr("schema_violation", f"{what}: attributes.ucl.packed's ucl is not an object")
    twice = sorted(set(members) & set(ucl))
    if twice:
        raise UErr("schema_violation", f"{what}: {twice[0]!r} is both packed and in attributes.ucl")
    if "consolidated_metadata" in inner and "consolidated_metadata" in doc:
        raise UErr("schema_violation", f"{what}: consolidated_metadata is both packed and in the document")
    out = dict(doc)
    out["attributes"] = {**doc["attributes"], "ucl": {**{k: v for k, v in ucl.items() if k != "packed"},
                                                      **members}}
    if "consolidated_metadata" in inner:
        out["consolidated_metadata"] = inner["consolidated_metadata"]
    return out


def read_box(store: Store, meta: StepMeta, a: ArrayMeta, box: list[tuple[int, int]]) -> bytes:
    out_shape = tuple(hi - lo for lo, hi in box)
    if any(n == 0 for n in out_shape):
        return b""
    ranges = [range(lo // c, (hi - 1) // c + 1) for (lo, hi), c in zip(box, a.chunk, strict=False)]
    # every shard the box needs is listed, before anything is allocated (lazy: stops at the first gap)
    for coords in lazy_product(ranges):
        if a.shard_key(coords) not in meta.files:
            raise UErr(
                "missing_shard", f"shard {a.shard_key(coords)} of {a.name!r} is not in the commit record"
            )
    nbytes = _prod(out_shape) * a.itemsize
    if nbytes > MAX_RESULT_BYTES:
        raise UErr("limit_exceeded", f"a result of {nbytes} bytes is beyond this implementation's bound")
    out = np.zeros(out_shape + (a.itemsize,), dtype=np.uint8)
    for coords in lazy_product(ranges):
        sh = Shard(store, meta, a, coords)
        try:
            origin = [c * s for c, s in zip(coords, a.chunk, strict=False)]
            iranges = []
            for d, (lo, hi) in enumerate(box):
                s0, s1 = max(lo, origin[d]), min(hi, origin[d] + a.chunk[d])
                iranges.append(range((s0 - origin[d]) // a.inner[d], (s1 - 1 - origin[d]) // a.inner[d] + 1))
            for ic in lazy_product(iranges):
                j = 0
                for d, k in enumerate(ic):
                    j = j * a.per_shard[d] + k
                ch = sh.chunk(j)
                src, dst = [], []
                for d, k in enumerate(ic):
                    g0 = origin[d] + k * a.inner[d]
                    lo, hi = max(box[d][0], g0), min(box[d][1], g0 + a.inner[d])
                    src.append(slice(lo - g0, hi - g0))
                    dst.append(slice(lo - box[d][0], hi - box[d][0]))
                out[tuple(dst)] = ch[tuple(src)]
            # §8 item 1: MUST when every present chunk was read, MAY otherwise; we always check it (4 bytes
            # per chunk), after the chunks (§10.2 item 7)
            sh.check_digest()
        finally:
            sh.close()
    return out.tobytes()


# -- validation (§8 item 3) ----------------------------------------------------------------------------------
class Problems:
    def __init__(self) -> None:
        self.items: list[tuple[str, Any, Any, Any, str]] = []

    def add(self, e: UErr, step: Any = None, tensor: Any = None, file: Any = None) -> None:
        self.items.append((e.code, step, tensor, file, e.message))


def _shard_coords(a: ArrayMeta, rel: str) -> tuple[int, ...] | None:
    """The grid coordinates of a listed path of a's grid, or None."""
    prefix = f"{a.key}/c"
    if a.empty:
        return None
    if rel == prefix:
        return () if not a.shape else None
    if not rel.startswith(prefix + "/"):
        return None
    parts = rel[len(prefix) + 1 :].split("/")
    if len(parts) != len(a.shape) or not all(canonical_step(p) is not None for p in parts):
        return None
    coords = tuple(int(p) for p in parts)
    return coords if all(c < g for c, g in zip(coords, a.grid, strict=False)) else None


def validate_shards(store: Store, meta: StepMeta, a: ArrayMeta, probs: Problems, owned: set[str]) -> None:
    listed = []
    for f in meta.files:
        c = _shard_coords(a, f)
        if c is not None:
            listed.append(c)
            owned.add(f)
    need = a.n_shards()
    if len(listed) < need:
        # §8 items 2 and 5: an unlisted shard of the grid, found without enumerating a grid that is larger
        # than the record (every listed shard is in the grid, so a count suffices)
        have = set(listed)
        first = None
        if need <= 4 * len(meta.files) + 16:
            first = next((c for c in lazy_product([range(g) for g in a.grid]) if c not in have), None)
        where = f" (first: {a.shard_key(first)})" if first is not None else ""
        probs.add(
            UErr(
                "missing_shard",
                f"{need - len(listed)} shard(s) of {a.name!r} are not in the commit record{where}",
            ),
            meta.step,
            a.name,
        )
    for coords in sorted(listed):
        rel = a.shard_key(coords)
        try:
            sh = Shard(store, meta, a, coords)
        except UErr as e:
            probs.add(e, meta.step, a.name, rel)
            continue
        try:
            for j in sh.present():
                sh.chunk(j)
            sh.check_digest()
        except UErr as e:
            probs.add(e, meta.step, a.name, rel)
        finally:
            sh.close()


def validate_step(store: Store, step: int, probs: Problems) -> None:
    try:
        rec = load_commit(store, step)
    except Missing:
        probs.add(unlisted_step_code(store, step), step)
        return
    except UErr as e:
        probs.add(e, step, file=f"commits/{step}.json")
        return
    errors: list[tuple[str, UErr]] = []
    try:
        meta = open_step_doc(store, step, rec, errors)
    except UErr as e:
        for key, te in errors:
            probs.add(te, step, tensor=key)
        probs.add(e, step, file="zarr.json")
        return
    for key, te in errors:
        probs.add(te, step, tensor=key)
    owned = {"zarr.json"}
    for key in meta.array_keys:
        owned.add(f"{key}/zarr.json")
        if not isinstance(key, str):
            continue
        prefix = f"{key}/c"
        for f in meta.files:  # shards of arrays whose document failed: owned, not checked again
            if f == prefix or f.startswith(prefix + "/"):
                owned.add(f)
    # each array document against the record, its schema and the consolidated metadata; its shards
    for name, a in sorted(meta.arrays.items()):
        rel = f"{a.key}/zarr.json"
        try:
            doc = load_json(read_listed(store, step, rel, meta.files, f"array {name!r}"), rel)
            # GAP-R5: §10.2 items 3-4, then equality with the consolidated copy
            check_array(a.key, doc, meta.doc["attributes"]["ucl"]["format_version"])
            if not json_equal(doc, a.doc):
                raise UErr("inconsistent_metadata", f"{rel} differs from the consolidated metadata")  # §5.1
        except UErr as e:
            probs.add(e, step, name, rel)
        validate_shards(store, meta, a, probs, owned)
    # the intermediate group documents the record lists (§3.3): groups of the consolidated metadata and
    # every proper prefix of an array key (GAP-R11)
    groups = set(meta.groups)
    for key in meta.array_keys:
        parts = key.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    for g in sorted(groups):
        rel = f"{g}/zarr.json"
        owned.add(rel)
        if rel in meta.files:
            try:
                read_listed(store, step, rel, meta.files, f"group {g!r}")
            except UErr as e:
                probs.add(e, step, file=rel)
    for f in sorted(meta.files):
        if f not in owned:  # §8 item 3
            probs.add(
                UErr("inconsistent_metadata", f"{f} is listed but no array or group owns it"), step, file=f
            )


def validate(path: str, step: int | None) -> tuple[bool, list[str]]:
    check_step_arg(step)
    probs = Problems()
    try:
        store = open_repository(path)
    except UErr as e:
        return False, [e.code]
    try:
        check_steps_group(store)
    except UErr as e:
        probs.add(e, file="steps/zarr.json")
    try:
        listed = commit_steps(store)
        if step is not None and step not in listed:
            probs.add(unlisted_step_code(store, step), step)  # §7 item 6
        for s in listed if step is None else [s for s in listed if s == step]:
            validate_step(store, s, probs)
    except UErr as e:
        probs.add(e)
    if os.environ.get("LEVEL0_LOG"):
        for p in probs.items:
            print(f"level0: {path}: problem {p}", file=sys.stderr)
    codes = [p[0] for p in probs.items]
    return (not codes), codes


# -- the operations ------------------------------------------------------------------------------------------
def list_steps(path: str) -> list[int]:
    store = open_repository(path)
    out = []
    for s in commit_steps(store):
        try:
            load_commit(store, s)  # §7 item 6: parses, verifies, of a version and extensions we implement
        except (UErr, Missing):
            continue
        out.append(s)
    return out


def open_(path: str, step: int | None) -> tuple[int, list[str]]:
    store = open_repository(path)
    meta = open_step(store, step)
    return meta.step, sorted(meta.arrays)  # §5.3 item 3: the tensors of a Level-0 step are its arrays


def read(path: str, step: int | None, tensor: str, box: Any) -> dict[str, Any]:
    store = open_repository(path)
    meta = open_step(store, step)
    a = meta.arrays.get(tensor)
    if a is None:
        raise UErr("tensor_not_found", f"step {meta.step} has no tensor {tensor!r}")  # §5.3 item 3
    if box is None:
        b = [(0, n) for n in a.shape]
    else:  # §10.1 invalid_argument
        if not isinstance(box, list) or len(box) != len(a.shape):
            raise UErr("invalid_argument", f"a slice of rank {len(a.shape)} is needed")
        b = []
        for pr, n in zip(box, a.shape, strict=False):
            if not (isinstance(pr, list) and len(pr) == 2 and all(is_int(x) for x in pr)):
                raise UErr("invalid_argument", "a slice is [[start, stop], ...]")
            lo, hi = pr
            if not 0 <= lo <= hi <= n:
                raise UErr("invalid_argument", f"[{lo}, {hi}) is not within [0, {n}]")
            b.append((lo, hi))
    data = read_box(store, meta, a, b)
    return {"shape": [hi - lo for lo, hi in b], "dtype": a.dtype, "sha256": hashlib.sha256(data).hexdigest()}


# -- no expected failures: cases outside Level 0 carry "level": 1, and this implementation refuses them with
# unknown_extension as spec/core.md §9 item 3 requires, which the runner accepts from a Level-0 implementation
EXPECTED_FAILURES: dict[str, str] = {}


# -- the JSON-lines protocol of conformance/runner.py --------------------------------------------------------
def serve() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        rid, op = req.get("id"), req.get("op")
        try:
            if op == "hello":
                result: dict[str, Any] = {
                    "name": "ucl-independent-level0",
                    "expected_failures": EXPECTED_FAILURES,
                    "level": 0,
                }
            elif op == "validate":
                ok, codes = validate(req["path"], req.get("step"))
                result = {"valid": ok, "codes": codes}
            elif op == "list_steps":
                result = {"steps": list_steps(req["path"])}
            elif op == "open":
                s, keys = open_(req["path"], req.get("step"))
                result = {"step": s, "keys": keys}
            elif op == "read":
                result = read(req["path"], req.get("step"), req["tensor"], req.get("slice"))
            else:
                raise UErr("invalid_argument", f"unknown op {op!r}")
            msg: dict[str, Any] = {"id": rid, "result": result}
        except UErr as e:
            msg = {"id": rid, "error": {"code": e.code, "message": e.message[:2000]}}
        except Exception as e:  # a bug: a crash, never a code
            import traceback

            traceback.print_exc(file=sys.stderr)
            msg = {"id": rid, "error": {"code": f"crash:{type(e).__name__}", "message": str(e)[:2000]}}
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
