"""Metadata documents (spec/core.md §3-§7) as frozen dataclasses <-> JSON, checked against spec/schemas.

Parsing is a straight sequence of checks (safetensors' read_metadata): size limit, JSON (no NaN, bounded
depth), the document's JSON Schema, then semantic checks that a schema cannot express. Nothing is
allocated or read on the strength of a value that has not been checked.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import re
import threading
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from ucl.errors import (
    CorruptCommitRecordError,
    InconsistentMetadataError,
    InvalidNameError,
    LimitExceededError,
    SchemaError,
    UnknownExtensionError,
    UnsupportedDTypeError,
    UnsupportedVersionError,
)
from ucl.format import dtypes, names, structure
from ucl.format.records import (
    COMPOSITE,
    Composite,
    DeltaRecord,
    GradientRecords,
    choose_encoding,
    parse_codec,
)
from ucl.io import native as _native

FORMAT_VERSION = 3  # the newest step document version written (spec/core.md §9 items 5, 6); 1 and 2 read
STEP_FORMAT_VERSIONS = (1, 2, 3)  # the step document versions this reader implements
#: The members of attributes.ucl a version 3 writer packs (spec/core.md §5.1); the others stay readable
#: without decompressing (which step, its kind and parent: what retention and chains look at).
PACKED_MEMBERS = ("tree", "layout", "mesh", "extensions", "logical")
REPO_FORMAT_VERSION = 1  # the repository document's: its form did not change in version 2
COMMIT_VERSION = 2  # a commit record's ucl_commit as written (files grouped by array); 1 still reads
MAX_DOC_BYTES = 256 << 20
MAX_JSON_DEPTH = 128  # spec/core.md §8.4: a step document's deepest legitimate value is at depth 100
MAX_ELEMENTS = 1 << 62
MAX_INNER_CHUNKS_PER_SHARD = 1 << 24
SCHEMA_DIR = Path(__file__).with_name("schemas")
KNOWN_EXTENSIONS: frozenset[str] = frozenset({"ucl.gradient_records", COMPOSITE})  # spec/delta.md §8, §9


# -- JSON ------------------------------------------------------------------------------------------
def _reject_constant(c: str) -> None:
    raise ValueError(f"{c} is not valid JSON")


def loads(data: bytes, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a metadata document: bounded size and depth, strict JSON (no NaN/Infinity)."""
    if len(data) > MAX_DOC_BYTES:
        raise LimitExceededError(f"{what} is {len(data)} bytes, more than the limit of {MAX_DOC_BYTES}", file=what)
    depth, wide = _native.json_lint(data)
    if depth > max_depth:
        raise LimitExceededError(f"{what} nests {depth} levels deep, more than the limit of {max_depth}",
                                 file=what)
    if wide:
        raise SchemaError(f"{what} holds an integer outside [-2^63, 2^64) (spec/core.md §8.4)", file=what)
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise LimitExceededError(f"{what} nests too deeply", file=what) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SchemaError(f"{what} is not valid JSON: {e}", file=what) from None


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


@contextmanager
def acyclic() -> Iterator[None]:
    """Pause the cycle collector while documents are parsed, or layout plans built, into objects that form
    no cycles (JSON trees, records, frozen dataclasses): it would only walk them
    (:meth:`ucl.write.planning.Planner.plan_layout` uses it too). Each parse allocates tens of
    thousands of containers, which trigger collections; in a fresh process after ``import torch`` the
    first of them is a full one over torch's objects (~100 ms here, most of a cold ``ucl.open``): a
    collection that the process owes its imports, not the parse, and that the next allocations of the
    program start wherever they are. Nested and threaded uses share one pause; the collector is
    re-enabled only if it was enabled before.

    On leaving, the young objects are moved to the oldest generation without a collection
    (``gc.freeze()`` then ``gc.unfreeze()``: two list splices, whatever their number). A collection of the
    youngest generation did the same by walking them all: ~20 ms of an 8-rank layout plan's ~130 ms
    (bench/scale.py). Cyclic garbage among them, which these objects do not form, waits for the next
    full collection. Where the program has frozen objects of its own (``gc.get_freeze_count()``), which
    ``unfreeze`` would release, the youngest generation is collected as before."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                if gc.get_freeze_count() == 0:
                    gc.freeze()
                    gc.unfreeze()
                else:
                    gc.collect(0)
                gc.enable()


def dumps(doc: Any) -> bytes:
    """A document as written: compact (no whitespace; spec/core.md §3.4 makes indentation no part of the
    format, and a large step's documents are half whitespace when indented)."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=False, allow_nan=False).encode()


def canonical(doc: Any) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, UTF-8 (what checksums are computed over)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


# -- schemas ---------------------------------------------------------------------------------------
@cache
def _validator(name: str) -> Any:
    import jsonschema
    from referencing import Registry, Resource

    resources = []
    for p in SCHEMA_DIR.glob("*.schema.json"):
        doc = json.loads(p.read_text())
        resources.append((doc["$id"], Resource.from_contents(doc)))
        resources.append((p.name, Resource.from_contents(doc)))
    registry = Registry().with_resources(resources)
    schema = json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())
    # JSON Schema counts 4.0 as an integer; UCL does not (a float size or shape would reach arithmetic).
    strict = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=(
        jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", lambda _, x: type(x) is int)))
    return strict(schema, registry=registry)


@cache
def _schema_compiler() -> Any:
    from ucl.format.schema_compile import Compiler

    return Compiler({p.name: json.loads(p.read_text()) for p in SCHEMA_DIR.glob("*.schema.json")})


#: the predicates shipped compiled (ucl/format/_schemas_compiled.py): every schema check of a read
SHIPPED_SCHEMAS = (("array", ""), ("step", ""), ("commit", ""), ("repository", ""),
                   ("layout", "/$defs/logical_record"))
COMPILED_MODULE = Path(__file__).with_name("_schemas_compiled.py")


def schemas_digest() -> str:
    """SHA-256 over the schema files' names and bytes: which schemas a compiled module was made from."""
    h = hashlib.sha256()
    for p in sorted(SCHEMA_DIR.glob("*.schema.json")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def compiled_module_source() -> str:
    """What ucl/format/_schemas_compiled.py holds for the schemas as they are."""
    from ucl.format.schema_compile import Compiler

    docs = {p.name: json.loads(p.read_text()) for p in sorted(SCHEMA_DIR.glob("*.schema.json"))}
    return Compiler(docs).module([(f"{n}.schema.json", ptr) for n, ptr in SHIPPED_SCHEMAS], schemas_digest())


@cache
def _shipped() -> dict[tuple[str, str], Any]:
    """The shipped predicates, when they were made from these schemas (else none: compiled here)."""
    try:
        from ucl.format import _schemas_compiled as shipped
    except ImportError:
        return {}
    return shipped.ENTRIES if schemas_digest() == shipped.DIGEST else {}


def load_checks() -> None:
    """Load the shipped schema predicates now (their module, the digest that admits them): the read path
    does at its import, so that a process's first ``ucl.open`` does not."""
    _shipped()


@cache
def _compiled(name: str, pointer: str = "") -> Any:
    """The fast predicate of a schema (ucl.format.schema_compile): shipped with the package, or built
    once per process."""
    check = _shipped().get((f"{name}.schema.json", pointer))
    return check if check is not None else _schema_compiler().compile(f"{name}.schema.json", pointer)


def check_schema(doc: Any, schema: str, what: str) -> None:
    """Raise SchemaError naming the first violation of ``schema`` in ``doc``. A valid document is
    accepted by the compiled predicate alone; jsonschema (the reference) names the violation."""
    if _compiled(schema)(doc):
        return
    err = next(iter(sorted(_validator(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))), None)
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        msg = err.message if len(err.message) < 300 else err.message[:300] + "..."
        raise SchemaError(f"{what} does not match {schema}.schema.json at {where}: {msg}", file=what)


@cache
def _logical_validator() -> Any:
    base = _validator("layout")
    return base.evolve(schema={"$ref": base.schema["$id"] + "#/$defs/logical_record"})


def check_logical(rec: Any, what: str, tensor: str | None = None) -> None:
    """Raise SchemaError unless ``rec`` is a logical record (spec/layout.md §6.3, layout.schema.json)."""
    if _compiled("layout", "/$defs/logical_record")(rec):
        return
    err = next(iter(sorted(_logical_validator().iter_errors(rec), key=lambda e: list(e.absolute_path))), None)
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        msg = err.message if len(err.message) < 300 else err.message[:300] + "..."
        raise SchemaError(f"{what}: the logical record does not match layout.schema.json at {where}: {msg}",
                          tensor=tensor, file=what)


def check_extensions(exts: list[dict[str, Any]], what: str) -> None:
    for ext in exts:
        if ext["name"] not in KNOWN_EXTENSIONS and ext.get("must_understand", True):
            raise UnknownExtensionError(f"{what} requires extension {ext['name']!r}, which this reader does not know",
                                        file=what)


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- the repository --------------------------------------------------------------------------------
def repo_doc() -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group",
            "attributes": {"ucl": {"format_version": REPO_FORMAT_VERSION}}}


def _format_version(doc: Any) -> Any:
    """attributes.ucl.format_version, or None, read before the schema check (a newer version may differ)."""
    for k in ("attributes", "ucl", "format_version"):
        if not isinstance(doc, dict):
            return None
        doc = doc.get(k)
    return doc


def expand_packed(doc: Any, what: str) -> Any:
    """A version 3 step document with its packed members in place (spec/core.md §5.1): every member of
    the packed ``ucl`` added to ``attributes.ucl`` and its ``consolidated_metadata`` to the document;
    ``packed`` removed. Any other document comes back as it is (the schema check judges it)."""
    attributes = doc.get("attributes") if isinstance(doc, dict) else None
    ucl = attributes.get("ucl") if isinstance(attributes, dict) else None
    if not isinstance(ucl, dict) or "packed" not in ucl or ucl.get("format_version") != 3:
        return doc
    assert isinstance(attributes, dict)  # it holds ucl
    from ucl.format import packed  # here: numcodecs is imported only when a document is packed

    inner = loads(packed.unpack(ucl["packed"], MAX_DOC_BYTES, what), f"{what} (attributes.ucl.packed)",
                  MAX_JSON_DEPTH - 1)  # its ucl members are one level deeper in the step document
    if not isinstance(inner, dict) or not set(inner) <= {"ucl", "consolidated_metadata"} \
            or not isinstance(inner.get("ucl", {}), dict):
        raise SchemaError(f"{what}: attributes.ucl.packed holds no object of members ucl (an object) and "
                          "consolidated_metadata", file=what)
    both = sorted(set(inner.get("ucl", {})) & set(ucl))
    if "consolidated_metadata" in inner and "consolidated_metadata" in doc:
        both.append("consolidated_metadata")
    if both:
        raise SchemaError(f"{what}: {both[0]!r} is both packed and in the document", file=what)
    out = {k: v for k, v in doc.items() if k != "attributes"}
    out["attributes"] = {**attributes, "ucl": {k: v for k, v in ucl.items() if k != "packed"} | inner.get("ucl", {})}
    if "consolidated_metadata" in inner:
        out["consolidated_metadata"] = inner["consolidated_metadata"]
    return out


def split_packed(doc: dict[str, Any], nodes: bytes = b"") -> tuple[dict[str, Any], bytes]:
    """A version 3 step document ``doc`` (``StepMeta.to_dict(3)``) split into the document as written,
    ``attributes.ucl.packed`` still to be set, and the JSON its packed members are (spec/core.md §5.1):
    ``PACKED_MEMBERS`` and the consolidated metadata. ``nodes``: the text of the consolidated nodes
    (``"key":{...},...``) when ``doc``'s consolidated metadata is empty, spliced in as they are."""
    ucl = dict(doc["attributes"]["ucl"])
    moved = {k: ucl.pop(k) for k in PACKED_MEMBERS if k in ucl}
    cm = dumps(doc["consolidated_metadata"])
    if nodes:
        assert cm.endswith(b'"metadata":{}}'), "the nodes come as text into an empty consolidated metadata"
        cm = cm[:-2] + nodes + b"}}"
    outer = {k: v for k, v in doc.items() if k != "consolidated_metadata"}
    outer["attributes"] = {**doc["attributes"], "ucl": ucl}
    return outer, b'{"ucl":' + dumps(moved) + b',"consolidated_metadata":' + cm + b"}"


def parse_repo(data: bytes, what: str = "zarr.json") -> dict[str, Any]:
    doc = loads(data, what)
    version = _format_version(doc)
    if isinstance(version, int) and not isinstance(version, bool) and version > REPO_FORMAT_VERSION:
        raise UnsupportedVersionError(f"{what}: format version {version}; this reader knows up to "
                                      f"{REPO_FORMAT_VERSION}", file=what)
    check_schema(doc, "repository", what)
    check_extensions(doc["attributes"]["ucl"].get("extensions", []), what)
    return doc


# -- arrays ----------------------------------------------------------------------------------------
_BYTES_LE = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}
_INDEX_CODECS = [_BYTES_LE, _CRC]


def dimension_names(name: str, ndim: int) -> list[str]:
    """The ``dimension_names`` written into an array document (spec/core.md §6 item 6): ``<name>/dim<i>``.

    xarray needs them to open a group of arrays, and takes a name shared by two arrays as one dimension
    (both arrays must then agree on its size); tensor names are unique in a step, so these never clash.
    Readers ignore them: documents without them (older steps) read the same. A delta array has none:
    no Zarr reader opens it (its ucl.delta codec), and ``ucl.zarr_store`` names the dimensions of the
    tensors it serves itself.
    """
    return [f"{name}/dim{i}" for i in range(ndim)]


@dataclass(frozen=True)
class ArrayMeta:
    """One stored tensor: a Zarr v3 array with one sharding_indexed codec (spec/core.md §6)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]  # outer chunk = one shard file = one writer's block
    inner_chunk_shape: tuple[int, ...]
    compression: dict[str, Any] | None = None  # {"name": "zstd", "configuration": {...}} or None
    delta: dict[str, Any] | None = None  # spec/delta.md record; when set, inner codecs are [ucl.delta, crc32c]
    logical: dict[str, Any] | None = None  # spec/layout.md record

    @property
    def key(self) -> str:
        return names.to_key(self.name)

    @property
    def grid(self) -> tuple[int, ...]:
        """Number of shards along each dimension."""
        return tuple(-(-s // c) if s else 0 for s, c in zip(self.shape, self.chunk_shape, strict=True))

    @property
    def inner_grid(self) -> tuple[int, ...]:
        """Number of inner chunks along each dimension of one shard."""
        return tuple(c // i for c, i in zip(self.chunk_shape, self.inner_chunk_shape, strict=True))

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def inner_nbytes(self) -> int:
        return math.prod(self.inner_chunk_shape) * self.itemsize

    @property
    def n_inner(self) -> int:
        return math.prod(self.inner_grid)

    def shard_key(self, coords: tuple[int, ...]) -> str:
        """Path of a shard, relative to the step (zarr's default chunk key, '/' separated)."""
        return "/".join([self.key, "c", *map(str, coords)]) if coords else f"{self.key}/c"

    def inner_codecs(self) -> list[dict[str, Any]]:
        if self.delta is not None:
            # the codec repeats the record's encoding and base step (spec/delta.md §3.3); an unchanged
            # array stores no data, its codec names the encoding a chunked one would have used

            enc = self.delta.get("encoding") or choose_encoding(self.name, self.dtype)
            return [{"name": "ucl.delta", "configuration": {"encoding": enc, "base_step": self.delta["base_step"]}},
                    _CRC]
        first = _BYTES_LE if self.itemsize > 1 else {"name": "bytes"}
        return [first, *([self.compression] if self.compression else []), _CRC]

    def to_dict(self, with_logical: bool = False) -> dict[str, Any]:
        """The array document. Its logical record is kept in the step document (format version 2,
        :func:`pack_logical`); ``with_logical`` writes it in the document, as version 1 did."""
        attrs: dict[str, Any] = {"name": self.name}
        if with_logical and self.logical is not None:
            attrs["logical"] = self.logical
        if self.delta is not None:
            attrs["delta"] = self.delta
        doc: dict[str, Any] = {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.chunk_shape)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": dtypes.fill_value_json(self.dtype),
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.inner_chunk_shape),
                        "codecs": self.inner_codecs(),
                        "index_codecs": [_BYTES_LE, _CRC],
                        "index_location": "end",
                    },
                }
            ],
            "attributes": {"ucl": attrs},
        }
        if self.delta is None:  # a delta array no Zarr reader opens (xarray included): no names
            doc["dimension_names"] = dimension_names(self.name, len(self.shape))
        return doc

    @classmethod
    def from_dict(cls, doc: Any, what: str) -> ArrayMeta:
        if isinstance(doc, dict) and "data_type" in doc and doc["data_type"] not in dtypes.SPEC_DTYPES:
            raise UnsupportedDTypeError(f"{what}: data type {str(doc['data_type'])[:64]!r} is not one of the spec's",
                                        file=what)
        check_schema(doc, "array", what)
        shape = tuple(doc["shape"])
        chunk = tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
        shard = doc["codecs"][0]["configuration"]
        inner = tuple(shard["chunk_shape"])
        dtype = doc["data_type"]
        name = names.check_name(doc["attributes"]["ucl"]["name"])
        if not (len(shape) == len(chunk) == len(inner)):
            raise InconsistentMetadataError(
                f"{what}: shape {list(shape)}, chunk shape {list(chunk)} and inner chunk shape {list(inner)} "
                "differ in rank", tensor=name, file=what)
        if any(c % i for c, i in zip(chunk, inner, strict=True)):
            raise InconsistentMetadataError(
                f"{what}: inner chunk shape {list(inner)} does not divide chunk shape {list(chunk)}", tensor=name,
                file=what)
        n = 1
        for s in shape:
            n *= s
            if n * dtypes.itemsize(dtype) > MAX_ELEMENTS:
                raise LimitExceededError(f"{what}: shape {list(shape)} holds more than 2^62 bytes", tensor=name,
                                         file=what)
        if math.prod(c // i for c, i in zip(chunk, inner, strict=True)) > MAX_INNER_CHUNKS_PER_SHARD:
            raise LimitExceededError(f"{what}: more than 2^24 inner chunks per shard", tensor=name, file=what)
        if math.prod(inner) * dtypes.itemsize(dtype) > 1 << 31:
            raise LimitExceededError(f"{what}: inner chunk larger than 2 GiB", tensor=name, file=what)
        attrs = doc["attributes"]["ucl"]
        delta = attrs.get("delta")
        codecs = shard["codecs"]
        compression = None
        expected_first = _BYTES_LE if dtypes.itemsize(dtype) > 1 else {"name": "bytes"}
        if delta is not None:

            if [c["name"] for c in codecs] != ["ucl.delta", "crc32c"]:
                raise InconsistentMetadataError(f"{what}: a delta array's inner codecs must be [ucl.delta, crc32c]",
                                                tensor=name, file=what)
            record = DeltaRecord.from_dict(delta, f"{what}: attributes.ucl.delta")
            if record.mode == "chunked":
                parse_codec(codecs[0], record, f"{what}: ucl.delta codec")
        else:
            names_ = [c["name"] for c in codecs]
            unknown = [c for c in codecs if c["name"] not in ("bytes", "zstd", "crc32c")]
            if unknown:
                raise UnknownExtensionError(f"{what}: codec {unknown[0]['name']!r} is not part of UCL v1", tensor=name,
                                            file=what)
            if names_ not in (["bytes", "crc32c"], ["bytes", "zstd", "crc32c"]):
                raise SchemaError(f"{what}: inner codecs must be [bytes, crc32c] or [bytes, zstd, crc32c], found "
                                  f"{names_}", tensor=name, file=what)
            if (codecs[0] != expected_first and _strip(codecs[0]) != _strip(expected_first)
                    and not (dtypes.itemsize(dtype) == 1 and codecs[0].get("configuration"))):
                raise SchemaError(f"{what}: inner bytes codec must be little-endian", tensor=name, file=what)
            if len(codecs) == 3:
                compression = codecs[1]
                conf = compression.get("configuration", {})
                level, checksum = conf.get("level", 1), conf.get("checksum", False)
                if type(level) is not int or not -131072 <= level <= 22 or not isinstance(checksum, bool):
                    raise SchemaError(f"{what}: zstd configuration {str(conf)[:200]} needs an integer level in "
                                      "[-131072, 22] and a boolean checksum", tensor=name, file=what)
        if shard["index_codecs"] != _INDEX_CODECS and [_strip(c) for c in shard["index_codecs"]] != _INDEX_CODECS:
            raise SchemaError(f"{what}: index codecs must be [bytes little-endian, crc32c]", tensor=name, file=what)
        logical = attrs.get("logical")
        if logical is not None:
            check_logical(logical, what, name)
            logical = logical or None  # {} is "no record" (spec/layout.md §6.2)
        return cls(name=name, shape=shape, dtype=dtype, chunk_shape=chunk, inner_chunk_shape=inner,
                   compression=compression, delta=delta, logical=logical)


# -- logical records, once per step (format version 2) --------------------------------------------
def array_document(arr: ArrayMeta, format_version: int) -> bytes:
    """The bytes a writer of ``format_version`` writes as ``arr``'s own document (compact JSON, the same
    text as its node in the step document): what a reader compares with the commit record's crc32c to
    confirm a consolidated entry without reading the document (spec/core.md §5.1)."""
    return dumps(arr.to_dict(with_logical=format_version == 1))


def check_array_document(raw: bytes, arr: ArrayMeta, format_version: int, what: str) -> None:
    """``raw``, an array's own document, says what its consolidated entry ``arr`` says (spec/core.md
    §5.1): ``inconsistent_metadata`` where it differs; ``schema`` where a version 2 document holds the
    logical record, which that version keeps in the step document (spec/layout.md §6.3)."""
    doc = loads(raw, what)
    on_disk = ArrayMeta.from_dict(doc, what)
    if format_version >= 2:
        if _holds_logical(doc):
            raise SchemaError(f"{what}: the array document of a version {format_version} step holds no "
                              "logical record (it is in the step document's attributes.ucl.logical)",
                              tensor=arr.name, file=what)
        arr = replace(arr, logical=None)
    if on_disk != arr:
        raise InconsistentMetadataError(f"{what} differs from the step's consolidated metadata", tensor=arr.name,
                                        file=what)


def pack_logical(arrays: Mapping[str, ArrayMeta]) -> dict[str, Any] | None:
    """The step document's ``attributes.ucl.logical`` (spec/layout.md §6.3): every logical tensor that a
    record maps once, ``[name, shape]`` (its dtype is that of the arrays holding it), and each array's
    record as a list of maps ``[t, start, shape, at]`` (``t`` the tensor's index), a view map
    ``[t, start, shape, offset]`` (``at`` zero, the view the box's shape; ``[t, start, shape]`` when the
    view starts where the previous map's ends: a flat buffer's members) or ``[t, start, shape, at,
    offset, view shape]``. None when no array has a record. The inverse of :func:`unpack_logical`."""
    index: dict[str, int] = {}
    table: list[list[Any]] = []
    records: dict[str, Any] = {}

    def tensor(name: str, shape: list[int], arr: ArrayMeta) -> int:
        t = index.get(name)
        if t is None:
            index[name] = t = len(table)
            table.append([name, list(shape)])
        elif table[t][1] != list(shape):
            raise InconsistentMetadataError(f"the records of step arrays disagree on the shape of tensor "
                                            f"{name!r}: {table[t][1]} and {list(shape)} (in {arr.name!r})",
                                            tensor=name)
        return t

    for a in arrays.values():
        rec = a.logical
        if not rec:
            continue
        tensors = rec["tensors"]
        for name, t in tensors.items():
            if t["dtype"] != a.dtype:
                raise InconsistentMetadataError(f"array {a.name!r} of data type {a.dtype} records tensor "
                                                f"{name!r} as {t['dtype']}", tensor=a.name)
        maps: list[list[Any]] = []
        mapped: set[str] = set()
        end = None  # where the previous map's view ends (None: it had none)
        for m in rec["maps"]:
            name = m["tensor"]
            mapped.add(name)
            t = tensor(name, tensors[name]["shape"], a)
            start, shape = m["box"]
            view = m.get("view")
            if view is None:
                maps.append([t, start, shape, m["at"]])
            elif view["shape"] == shape and not any(m["at"]):
                maps.append([t, start, shape] if view["offset"] == end else [t, start, shape, view["offset"]])
            else:
                maps.append([t, start, shape, m["at"], view["offset"], view["shape"]])
            end = None if view is None else view["offset"] + math.prod(view["shape"])
        out: dict[str, Any] = {"maps": maps}
        unmapped = [tensor(n, t["shape"], a) for n, t in tensors.items() if n not in mapped]
        if unmapped:
            out["unmapped"] = unmapped
        if "partial" in rec:
            out["partial"] = rec["partial"]
        records[a.name] = out
    return {"tensors": table, "records": records} if records else None


def unpack_logical(doc: dict[str, Any], arrays: dict[str, ArrayMeta], what: str) -> dict[str, ArrayMeta]:
    """``arrays`` with the records of a step document's ``attributes.ucl.logical`` (schema-checked), each
    in the form of an array's record (spec/layout.md §6.3, ``$defs/logical_record``)."""
    _check_logical_table(doc, arrays, what)
    out = dict(arrays)
    for aname, rec in doc["records"].items():
        arr = arrays[aname]
        logical = _unpack_record(doc["tensors"], aname, rec, arr.dtype, what)
        if logical is not None:
            out[aname] = replace(arr, logical=logical)
    return out


def _check_logical_table(doc: dict[str, Any], arrays: Collection[str], what: str) -> None:
    """The packed records' tensor table names each tensor once, and each record is of an array."""
    seen: set[str] = set()
    for name, _ in doc["tensors"]:
        if name in seen:
            raise InconsistentMetadataError(f"{what}: attributes.ucl.logical lists tensor {name!r} twice",
                                            tensor=name, file=what)
        seen.add(name)
    for aname in doc["records"]:
        if aname not in arrays:
            raise InconsistentMetadataError(f"{what}: attributes.ucl.logical has a record for {aname!r}, "
                                            "which is no array of the step", tensor=aname, file=what)


def _unpack_record(table: list[Any], aname: str, rec: dict[str, Any], dtype: str,
                   what: str) -> dict[str, Any] | None:
    """One array's packed record in the form of an array's record (None when it maps nothing)."""

    def entry(t: int) -> tuple[str, list[int]]:
        if t >= len(table):
            raise InconsistentMetadataError(f"{what}: the logical record of {aname!r} names tensor {t}; "
                                            f"the step lists {len(table)}", tensor=aname, file=what)
        return table[t][0], table[t][1]

    tensors: dict[str, Any] = {}
    maps: list[dict[str, Any]] = []
    end: int | None = None  # where the previous map's view ends
    for m in rec["maps"]:
        name, tshape = entry(m[0])
        if name not in tensors:
            tensors[name] = {"shape": tshape, "dtype": dtype}
        start, shape = m[1], m[2]
        if len(m) == 3 or type(m[3]) is int:  # a view of the box's shape, at zero
            if len(m) == 3 and end is None:
                raise InconsistentMetadataError(
                    f"{what}: map {len(maps)} of the logical record of {aname!r} continues the previous "
                    "map's view, and the previous map has none", tensor=aname, file=what)
            view = {"offset": end if len(m) == 3 else m[3], "shape": shape}
            maps.append({"tensor": name, "box": [start, shape], "at": [0] * len(shape), "view": view})
        elif len(m) == 4:
            view = None
            maps.append({"tensor": name, "box": [start, shape], "at": m[3]})
        else:
            view = {"offset": m[4], "shape": m[5]}
            maps.append({"tensor": name, "box": [start, shape], "at": m[3], "view": view})
        end = None if view is None else view["offset"] + math.prod(view["shape"])
    for t in rec.get("unmapped", ()):
        name, tshape = entry(t)
        tensors.setdefault(name, {"shape": tshape, "dtype": dtype})
    if not tensors:
        return None
    logical: dict[str, Any] = {"tensors": tensors, "maps": maps}
    if "partial" in rec:
        logical["partial"] = rec["partial"]
    return logical


def _strip(codec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in codec.items() if k != "must_understand" or v is not False}


# -- steps -----------------------------------------------------------------------------------------
class Arrays(Mapping[str, ArrayMeta]):
    """A step's arrays by tensor name, each entry of the consolidated metadata parsed and checked when it
    is first used (spec/core.md §10.2 item 5: a reader may defer an array's checks to its first use): an
    open of a step of hundreds of tensors checks only those it reads. An entry gets every check the
    eager parse gives it, with the same codes: its document (§10.2 item 4), its name against its key, no
    logical record in a version 2 array document, its packed logical record (spec/layout.md §6.3), and
    a stale array outside a composite step (spec/delta.md §9.2)."""

    __slots__ = ("_nodes", "_done", "_what", "_packed", "_records")

    def __init__(self, nodes: dict[str, tuple[str, Any]], what: str, packed: dict[str, Any] | None = None,
                 records: dict[str, Any] | None = None) -> None:
        self._nodes = nodes  # name -> (key, node)
        self._done: dict[str, ArrayMeta] = {}
        self._what = what
        self._packed = packed  # attributes.ucl.logical of a version 2 step (table checked)
        self._records = records  # the parent's records, for a step written with logical: {"from": P}

    def __getitem__(self, name: str) -> ArrayMeta:
        meta = self._done.get(name)
        if meta is None:
            key, node = self._nodes[name]  # KeyError: no such array
            meta = self._done[name] = self._check(name, key, node)
        return meta

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def _check(self, name: str, key: str, node: Any) -> ArrayMeta:
        meta = _entry(key, node, 2, self._what)
        if meta.delta is not None and meta.delta.get("mode") == "stale":
            raise InconsistentMetadataError(f"{self._what}: tensor {name!r} is stale, but the step has no "
                                            f"{COMPOSITE} extension marking it approximate", tensor=name,
                                            file=self._what)
        if self._packed is not None and name in self._packed["records"]:
            logical = _unpack_record(self._packed["tensors"], name, self._packed["records"][name], meta.dtype,
                                     self._what)
            if logical is not None:
                meta = replace(meta, logical=logical)
        elif self._records is not None and name in self._records:
            meta = replace(meta, logical=self._records[name])
        return meta

    @property
    def has_logical(self) -> bool:
        """Whether any array has a logical record, without checking the arrays."""
        if self._records is not None:
            return any(self._records[n] for n in self._records if n in self._nodes)
        if self._packed is None:
            return False
        return any(r.get("maps") or r.get("unmapped") for r in self._packed["records"].values())

    def with_records(self, records: dict[str, Any]) -> Arrays:
        """These arrays, each with the record of the same name in ``records`` (StepMeta.with_records)."""
        return Arrays(self._nodes, self._what, None, records)


def _holds_logical(doc: Any) -> bool:
    """Whether an array document (or consolidated entry) has the member ``attributes.ucl.logical``: any
    value, ``{}`` (no record, spec/layout.md §6.3) included, is refused in a step of version 2 or 3, which
    keeps the records in its step document (spec/core.md §6 item 5)."""
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    u = attrs.get("ucl") if isinstance(attrs, dict) else None
    return isinstance(u, dict) and "logical" in u


def _entry(key: str, node: Any, version: int, what: str) -> ArrayMeta:
    """An array's entry of a step's consolidated metadata, checked (spec/core.md §10.2 items 4-5): its
    document, its name against its key, and no logical record in the document of a version 2 step."""
    meta = ArrayMeta.from_dict(node, f"{what}: {key}")
    if meta.key != key:
        raise InconsistentMetadataError(f"{what}: array at {key!r} names itself {meta.name!r}", tensor=meta.name,
                                        file=what)
    if version >= 2 and _holds_logical(node):
        raise SchemaError(f"{what}: {key}: an array entry of a version {version} step holds no logical "
                          "record (it is in the step document's attributes.ucl.logical)",
                          tensor=meta.name, file=what)
    return meta


def has_logical(arrays: Mapping[str, ArrayMeta]) -> bool:
    """Whether any of a step's arrays has a logical record (for :class:`Arrays`, unchecked ones too)."""
    if isinstance(arrays, Arrays):
        return arrays.has_logical
    return any(a.logical for a in arrays.values())


@dataclass(frozen=True)
class StepMeta:
    """A step's group document: attributes.ucl and the consolidated metadata of its arrays."""

    step: int
    kind: str
    tree: dict[str, Any]
    arrays: Mapping[str, ArrayMeta]  # by tensor name (an :class:`Arrays` when opened lazily)
    parent: int | None = None
    layout: dict[str, Any] | None = None
    mesh: dict[str, Any] | None = None
    extensions: tuple[dict[str, Any], ...] = ()
    #: A delta step whose arrays have its parent's logical records (spec/layout.md §6.9): the parent,
    #: written as ``{"from": P}`` instead of the records. Read: resolved by
    #: :meth:`ucl.format.repository.Repository.step_meta` (``arrays`` then hold them).
    logical_from: int | None = None
    format_version: int = FORMAT_VERSION

    @property
    def gradient_records(self) -> Any:
        """The step's :class:`ucl.delta.GradientRecords` (spec/delta.md §8), or None."""
        for e in self.extensions:
            if e.get("name") == "ucl.gradient_records":

                return GradientRecords.from_extension(e)
        return None

    @property
    def composite(self) -> Composite | None:
        """The step's ``ucl.composite`` extension (spec/delta.md §9: the step is approximate), or None."""
        for e in self.extensions:
            if e.get("name") == COMPOSITE:
                return Composite.from_extension(e)
        return None

    def to_dict(self, format_version: int = 2) -> dict[str, Any]:
        """The step document, of ``format_version`` 2 (the logical records once, in ``attributes.ucl``)
        or 1 (each array's record in its document, for readers of version 1 only); 3 is 2's document
        with that number, whose large members a writer then packs (:func:`split_packed`)."""
        if format_version not in STEP_FORMAT_VERSIONS:
            raise ValueError(f"format version {format_version}: a writer writes one of "
                             f"{STEP_FORMAT_VERSIONS}")
        v1 = format_version == 1
        nodes: dict[str, Any] = {}
        for a in self.arrays.values():
            parts = a.key.split("/")
            for i in range(1, len(parts)):
                nodes.setdefault("/".join(parts[:i]), {"zarr_format": 3, "node_type": "group", "attributes": {}})
            nodes[a.key] = a.to_dict(with_logical=v1)
        ucl: dict[str, Any] = {"format_version": format_version, "step": self.step, "kind": self.kind,
                               "parent": self.parent, "tree": self.tree, "layout": self.layout, "mesh": self.mesh}
        if self.extensions:
            ucl["extensions"] = list(self.extensions)
        if not v1:
            if self.logical_from is not None:
                ucl["logical"] = {"from": self.logical_from}
            else:
                packed = pack_logical(self.arrays)
                if packed is not None:
                    ucl["logical"] = packed
        return {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {"ucl": ucl},
            "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": nodes},
        }

    @classmethod
    def from_dict(cls, doc: Any, what: str, *, lazy: bool = False) -> StepMeta:
        """A step document of version 1 or 2. A version 2 step whose records are another step's
        (``logical: {"from": P}``) comes back with ``logical_from`` set and no records in its arrays:
        :meth:`with_records` gives them (Repository.step_meta does). ``lazy``: each array's entry is
        checked when first used (:class:`Arrays`) in a version 2 step without the extensions whose
        checks span its arrays (gradient records, composite); everything else is checked here."""
        version = _format_version(doc)
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise UnsupportedVersionError(f"{what}: format version {version}; this reader knows up to {FORMAT_VERSION}",
                                          file=what)
        doc = expand_packed(doc, what)
        check_schema(doc, "step", what)
        ucl = doc["attributes"]["ucl"]
        version = ucl["format_version"]
        check_extensions(ucl.get("extensions", []), what)
        if version == 1 and "logical" in ucl:
            raise SchemaError(f"{what}: a version 1 step document has no attributes.ucl.logical (its records "
                              "are in the array documents)", file=what)
        spanning = any(e.get("name") in ("ucl.gradient_records", COMPOSITE) for e in ucl.get("extensions", ()))
        if lazy and version >= 2 and not spanning:
            return cls._lazy(doc, ucl, what)
        arrays: dict[str, ArrayMeta] = {}
        for key, node in doc["consolidated_metadata"]["metadata"].items():
            names.from_key(key)  # every path must be a canonical escape: nothing may leave the step
            if isinstance(node, dict) and node.get("node_type") == "array":
                meta = _entry(key, node, version, what)
                arrays[meta.name] = meta
        logical = ucl.get("logical")
        logical_from = None
        if logical is not None and "from" in logical:
            logical_from = _logical_from(ucl, what)
        elif logical is not None:
            arrays = unpack_logical(logical, arrays, what)
        referenced = set(structure.iter_tree_tensors(ucl["tree"], what))
        replayed = _replayed(ucl, referenced, arrays, what)
        if not referenced - replayed <= set(arrays):
            missing = sorted(referenced - replayed - set(arrays))[0]
            raise InconsistentMetadataError(f"{what}: the structure tree names tensor {missing!r}, which has no array",
                                            tensor=missing, file=what)
        if ucl["kind"] == "delta" and ucl.get("parent") is None:
            raise InconsistentMetadataError(f"{what}: a delta step must name its parent", file=what)
        _check_composite(ucl, arrays, what)
        return cls(step=ucl["step"], kind=ucl["kind"], tree=ucl["tree"], arrays=arrays, parent=ucl.get("parent"),
                   layout=ucl.get("layout"), mesh=ucl.get("mesh"),
                   extensions=tuple(ucl.get("extensions", ())), logical_from=logical_from,
                   format_version=version)

    @classmethod
    def _lazy(cls, doc: dict[str, Any], ucl: dict[str, Any], what: str) -> StepMeta:
        """:meth:`from_dict` with the arrays' entries left to their first use; the checks that span the
        step (its keys, the packed records' table, the tree, the parent) are made here."""
        nodes: dict[str, tuple[str, Any]] = {}
        for key, node in doc["consolidated_metadata"]["metadata"].items():
            name = names.from_key(key)  # every path must be a canonical escape: nothing may leave the step
            if isinstance(node, dict) and node.get("node_type") == "array":
                nodes[name] = (key, node)
        logical = ucl.get("logical")
        logical_from = None
        packed = None
        if logical is not None and "from" in logical:
            logical_from = _logical_from(ucl, what)
        elif logical is not None:
            _check_logical_table(logical, nodes, what)
            packed = logical
        missing = sorted(set(structure.iter_tree_tensors(ucl["tree"], what)) - set(nodes))
        if missing:
            raise InconsistentMetadataError(f"{what}: the structure tree names tensor {missing[0]!r}, which has "
                                            "no array", tensor=missing[0], file=what)
        if ucl["kind"] == "delta" and ucl.get("parent") is None:
            raise InconsistentMetadataError(f"{what}: a delta step must name its parent", file=what)
        return cls(step=ucl["step"], kind=ucl["kind"], tree=ucl["tree"], arrays=Arrays(nodes, what, packed),
                   parent=ucl.get("parent"), layout=ucl.get("layout"), mesh=ucl.get("mesh"),
                   extensions=tuple(ucl.get("extensions", ())), logical_from=logical_from,
                   format_version=ucl["format_version"])

    def with_records(self, records: dict[str, Any]) -> StepMeta:
        """This step with the logical records of the step its ``logical_from`` names (spec/layout.md
        §6.9), ``records`` (array name -> record): each array takes the record of the same name."""
        if isinstance(self.arrays, Arrays):
            return replace(self, arrays=self.arrays.with_records(records))
        arrays = {n: replace(a, logical=records[n]) if n in records else a for n, a in self.arrays.items()}
        return replace(self, arrays=arrays)


def _logical_from(ucl: dict[str, Any], what: str) -> int:
    """The step a delta step takes its logical records from (``logical: {"from": P}``): its parent."""
    logical_from: int = ucl["logical"]["from"]
    if ucl["kind"] != "delta" or logical_from != ucl.get("parent"):
        raise InconsistentMetadataError(
            f"{what}: takes its logical records from step {logical_from}: only a delta step takes "
            "them, from its parent", file=what)
    return logical_from


def _replayed(ucl: dict[str, Any], referenced: set[str], arrays: dict[str, ArrayMeta], what: str) -> set[str]:
    """Tensors a ``ucl.gradient_records`` step defines by replay (spec/delta.md §8.1): they have no array."""
    exts = [e for e in ucl.get("extensions", ()) if e.get("name") == "ucl.gradient_records"]
    if not exts:
        return set()

    if len(exts) > 1:
        raise InconsistentMetadataError(f"{what}: the ucl.gradient_records extension appears twice", file=what)
    rec = GradientRecords.from_extension(exts[0], f"{what}: ucl.gradient_records")
    if ucl["kind"] != "delta" or ucl.get("parent") != rec.base_step:
        raise InconsistentMetadataError(f"{what}: a gradient-record step must be a delta step whose parent is its "
                                        f"base_step {rec.base_step}", file=what)
    replayed = rec.replayed(referenced)
    stored = sorted(replayed & set(arrays))
    if stored:
        raise InconsistentMetadataError(f"{what}: tensor {stored[0]!r} is defined by the gradient replay and must "
                                        "not be stored", tensor=stored[0], file=what)
    unknown = sorted(set(rec.parameters) - referenced)
    if unknown:
        raise InconsistentMetadataError(f"{what}: gradient records name parameter {unknown[0]!r}, which the "
                                        "structure tree does not", tensor=unknown[0], file=what)
    for n in rec.parameters:
        g = arrays.get(rec.gradient_name(n))
        if g is not None and g.delta is not None:
            raise InconsistentMetadataError(f"{what}: gradient {g.name!r} must be stored full", tensor=g.name,
                                            file=what)
    return replayed


def _check_composite(ucl: dict[str, Any], arrays: dict[str, ArrayMeta], what: str) -> None:
    """A composite step's marker and its stale arrays agree (spec/delta.md §9.2): every ``stale`` array is
    listed in the ``ucl.composite`` extension with its base step and age, and every listed tensor is a
    ``stale`` array with those (or, in a step compacted to full, an array stored full)."""
    exts = [e for e in ucl.get("extensions", ()) if e.get("name") == COMPOSITE]
    if len(exts) > 1:
        raise InconsistentMetadataError(f"{what}: the {COMPOSITE} extension appears twice", file=what)
    stale_arrays = {n: a for n, a in arrays.items() if a.delta is not None and a.delta.get("mode") == "stale"}
    if not exts:
        if stale_arrays:
            n = sorted(stale_arrays)[0]
            raise InconsistentMetadataError(f"{what}: tensor {n!r} is stale, but the step has no {COMPOSITE} "
                                            "extension marking it approximate", tensor=n, file=what)
        return
    comp = Composite.from_extension(exts[0], f"{what}: {COMPOSITE}")
    listed = comp.tensors()
    for n, g in listed.items():
        a = arrays.get(n)
        if a is None:
            raise InconsistentMetadataError(f"{what}: {COMPOSITE} lists tensor {n!r} (group "
                                            f"{g.group!r}), which has "
                                            "no array", tensor=n, file=what)
        if g.base_step >= ucl["step"] or g.age != ucl["step"] - g.base_step:
            raise InconsistentMetadataError(
                f"{what}: stale group {g.group!r}: base_step {g.base_step} and age {g.age} disagree with "
                f"step {ucl['step']} (age = step - base_step, at least 1)", file=what)
        if a.delta is None and ucl["kind"] == "full":
            continue  # compacted: the array holds the referenced step's values itself
        if a.delta != {"mode": "stale", "base_step": g.base_step, "age": g.age}:
            raise InconsistentMetadataError(f"{what}: tensor {n!r} of stale group {g.group!r} must be a "
                                            f"stale "
                                            f"array with base_step {g.base_step} and age {g.age}, found "
                                            f"{a.delta}", tensor=n, file=what)
    unlisted = sorted(set(stale_arrays) - set(listed))
    if unlisted:
        raise InconsistentMetadataError(f"{what}: tensor {unlisted[0]!r} is stale, but no group of the "
                                        f"{COMPOSITE} "
                                        "extension lists it", tensor=unlisted[0], file=what)


# -- commit records --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommitRecord:
    """commits/<step>.json: the step exists iff this record exists and verifies (spec/core.md §7)."""

    step: int
    kind: str
    files: dict[str, tuple[int, int]]  # path relative to steps/<step>/ -> (size, crc32c)
    parent: int | None = None
    time: str = field(default_factory=now)
    #: 2 writes ``files`` grouped by directory prefix (spec/core.md §7); 1 (read) lists each path whole
    version: int = field(default=COMMIT_VERSION, compare=False)

    def _body(self) -> dict[str, Any]:
        files: Any
        if self.version == 1:
            files = {k: [s, c] for k, (s, c) in sorted(self.files.items())}
        else:
            files = {}
            for k, (s, c) in sorted(self.files.items()):
                prefix, rest = _split_path(k)
                files.setdefault(prefix, {})[rest] = [s, c]
        return {"ucl_commit": self.version, "step": self.step, "kind": self.kind, "parent": self.parent,
                "time": self.time, "files": files}

    def to_bytes(self) -> bytes:
        body = self._body()
        body["checksum"] = _native.crc32c(canonical(body))
        return dumps(body)

    @property
    def nbytes(self) -> int:
        return sum(s for s, _ in self.files.values())

    @classmethod
    def from_bytes(cls, data: bytes, what: str, step: int | None = None) -> CommitRecord:
        try:
            doc = loads(data, what)
            version = doc.get("ucl_commit") if isinstance(doc, dict) else None
            if type(version) is int and version > COMMIT_VERSION:
                raise UnsupportedVersionError(f"commit record {what} has version {version}; this reader "
                                              f"knows up to {COMMIT_VERSION}", file=what)
            check_schema(doc, "commit", what)
        except (SchemaError, LimitExceededError) as e:
            raise CorruptCommitRecordError(f"commit record {what} is unreadable: {e.message}", file=what) from None
        body = {k: v for k, v in doc.items() if k != "checksum"}
        try:
            sealed = canonical(body)
        except UnicodeEncodeError:  # a lone surrogate (\ud800) has no UTF-8, so no canonical form (§3.4)
            raise CorruptCommitRecordError(f"commit record {what} holds a lone surrogate: it has no canonical "
                                           "form", file=what) from None
        if _native.crc32c(sealed) != doc["checksum"]:
            raise CorruptCommitRecordError(f"commit record {what} fails its checksum", file=what)
        check_extensions(doc.get("extensions", []), what)
        if step is not None and doc["step"] != step:
            raise CorruptCommitRecordError(f"commit record {what} is for step {doc['step']}, not {step}", file=what)
        files: dict[str, tuple[int, int]] = {}

        def outside(k: str) -> None:
            raise InvalidNameError(f"commit record {what} lists a file {k[:200]!r} outside its step", file=what)

        if doc["ucl_commit"] == 1:
            for k, (size, crc) in doc["files"].items():
                if _OUTSIDE.search(k):
                    outside(k)
                files[k] = (size, crc)
        else:
            # "p/r" has an empty, "." or ".." segment, a backslash or a NUL exactly when p or r has one (an
            # empty r is itself an empty segment; an empty p lists r as it is), so each group and each
            # distinct rest (a few: "zarr.json", "c/0", ...) is matched once, not every joined path
            fine: set[str] = set()
            for p, group in doc["files"].items():
                if p and group and _OUTSIDE.search(p):
                    outside(f"{p}/{next(iter(group))}")
                for r, (size, crc) in group.items():
                    k = f"{p}/{r}" if p else r
                    if r not in fine:
                        if _OUTSIDE.search(r):
                            outside(k)
                        fine.add(r)
                    if k in files:
                        raise CorruptCommitRecordError(f"commit record {what} lists {k[:200]!r} twice", file=what)
                    files[k] = (size, crc)
        return cls(step=doc["step"], kind=doc["kind"], files=files, parent=doc.get("parent"),
                   time=doc["time"], version=doc["ucl_commit"])


#: A path with an empty, "." or ".." segment, a backslash or a NUL: not a file inside its step.
_OUTSIDE = re.compile(r"(?:^|/)\.{0,2}(?:/|$)|[\\\x00]")


def _split_path(rel: str) -> tuple[str, str]:
    """(group, rest) of a step's file as a version 2 commit record lists it: an array's files under its
    key (the part before ``/c/``, ``/c`` or ``/zarr.json``), the step document under ""."""
    for sep in ("/c/", "/zarr.json"):
        i = rel.find(sep)
        if i > 0:
            return rel[:i], rel[i + 1:]
    if rel.endswith("/c"):
        return rel[:-2], "c"
    return "", rel


if __name__ == "__main__":  # python -m ucl.format.metadata: regenerate the shipped schema predicates
    COMPILED_MODULE.write_text(compiled_module_source())
    print(f"wrote {COMPILED_MODULE}")
