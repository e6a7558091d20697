"""Import into ucl from safetensors, ``torch.save`` files and DCP checkpoints; export to safetensors.

Both directions stream, tensor by tensor:

- **Import** holds at most one tensor in memory besides the shard file being written from it:
  safetensors tensors are read one at a time through ``safe_open`` (memory-mapped), ``torch.save`` files
  are opened with ``mmap=True`` (the legacy non-zip format cannot be mapped and is read whole), DCP
  checkpoints are read one tensor per ``dcp.load`` call (DCP reads the stored item that holds it). Each
  tensor becomes one array of one shard, written with :class:`ucl.write.step.StepWriter`; the commit
  record is written last, so an interrupted import commits nothing.
- **Export** writes each safetensors file's header from the step's metadata (no data read), then each
  tensor's bytes as it is read from the step: one tensor in memory at a time. Files are written under
  a temporary name and renamed when complete.

Nothing is unpickled unsafely: ``torch.save`` files load with ``weights_only=True``; DCP's pickled
``.metadata`` is read with an unpickler that admits only DCP's metadata classes, torch sizes and dtypes;
DCP's non-tensor values load with ``weights_only=True`` and must be JSON-able to be stored.

A safetensors import records where each tensor came from (file names, each file's ``__metadata__``,
the index's ``metadata``) in the step as the extension ``ucl.source`` (``must_understand: false``),
so that an export reproduces the same files, index and weight map.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ucl.errors import CheckpointNotFoundError, InvalidArgumentError
from ucl.format import names, structure
from ucl.format.metadata import CommitRecord, StepMeta
from ucl.format.repository import Repository, check_step
from ucl.format.shardfile import as_bytes
from ucl.options import DEFAULT_WRITE, WriteOptions
from ucl.plan.save import all_shards, array_for, shard_block
from ucl.read.checkpoint import open as open_step
from ucl.tools.progress import Progress
from ucl.write.step import FileEntry, StepWriter

__all__ = ["export_safetensors", "import_checkpoint", "parse_size", "source_kind"]

SOURCE_EXTENSION = "ucl.source"
INDEX_SUFFIX = ".safetensors.index.json"

# spec dtype name <-> safetensors dtype tag
_ST_DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
              "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
              "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
              "complex64": "C64"}
# safetensors' own writer orders a file's tensors by this rank of their dtype, descending, then by name
_ST_RANK = {tag: i for i, tag in enumerate(["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
                                             "I32", "U32", "F32", "C64", "F64", "I64", "U64"])}


# -- sizes -----------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"123"`` -> 123 (bytes).

    Raises ValueError naming the accepted forms.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) * _UNITS[m.group(2).lower()] < 1:
        raise ValueError(f"invalid size {text!r} (use e.g. 500MB, 5GB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# -- the step being written ------------------------------------------------------------------------
class _StepBuilder:
    """Writes one tensor at a time into a new step; ``commit`` writes the documents and the record."""

    def __init__(self, dst: Any, step: int | None, storage_options: dict[str, Any] | None,
                 compression: str | None, options: WriteOptions = DEFAULT_WRITE) -> None:
        if compression not in (None, "zstd"):
            raise InvalidArgumentError(f"compression must be None or 'zstd', got {compression!r}")
        self.comp = {"name": "zstd", "configuration": {"level": 1, "checksum": False}} if compression else None
        repo = Repository.open(dst, storage_options, create=True)
        if step is None:
            latest = repo.latest()
            step = 0 if latest is None else latest + 1
        self.writer = StepWriter(repo, check_step(step), commit_threads=options.commit_threads)
        self.inner_bytes = options.inner_chunk_bytes
        self.writer.begin()  # takes the writer lock: release it with `with _StepBuilder(...)` or commit
        self.arrays: dict[str, Any] = {}
        self.files: dict[str, FileEntry] = {}

    @property
    def step(self) -> int:
        return self.writer.step

    def add(self, name: str, t: torch.Tensor) -> int:
        meta = array_for(name, t, compression=self.comp, inner_bytes=self.inner_bytes)
        t = t.detach().to("cpu")
        for coords in all_shards(meta):
            rel, entry = self.writer.write_shard(meta, coords, shard_block(meta, coords, t))
            self.files[rel] = entry
        self.arrays[name] = meta
        return meta.nbytes

    def commit(self, tree: dict[str, Any], extensions: tuple[dict[str, Any], ...] = ()) -> CommitRecord:
        meta = StepMeta(step=self.step, kind="full", tree=tree, arrays=self.arrays, extensions=extensions)
        return self.writer.commit(meta, self.files)

    def __enter__(self) -> _StepBuilder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.writer.release()  # the writer lock begin() took (commit released it already)


def _flat_tree(keys: list[str]) -> dict[str, Any]:
    return {"t": "dict", "items": [[k, {"t": "tensor", "name": k}] for k in keys]}


@dataclass
class ImportResult:
    """What :func:`import_checkpoint` wrote."""

    step: int
    source: str  # "safetensors", "torch", "dcp"
    tensors: int
    bytes: int
    record: CommitRecord = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "source": self.source, "tensors": self.tensors, "bytes": self.bytes}


# -- import ----------------------------------------------------------------------------------------
def source_kind(src: str | os.PathLike[str]) -> str:
    """``"safetensors"`` (a file, a directory of files, or a sharded checkpoint with an index),
    ``"dcp"`` (a directory with DCP's ``.metadata``) or ``"torch"`` (any other file, read as torch.save).

    Raises CheckpointNotFoundError when ``src`` does not exist or holds nothing importable.
    """
    src = os.fspath(src)
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, ".metadata")):
            return "dcp"
        if any(f.endswith((".safetensors", INDEX_SUFFIX)) for f in os.listdir(src)):
            return "safetensors"
        raise CheckpointNotFoundError(f"{src} holds no safetensors files, no index and no DCP .metadata", file=src)
    if os.path.isfile(src):
        return "safetensors" if src.endswith(".safetensors") else "torch"
    raise CheckpointNotFoundError(f"{src} does not exist", file=src)


def import_checkpoint(src: str | os.PathLike[str], dst: Any, step: int | None = None, *,
                      storage_options: dict[str, Any] | None = None, compression: str | None = None,
                      progress: bool | None = None, options: WriteOptions = DEFAULT_WRITE) -> ImportResult:
    """Write the checkpoint at ``src`` as a new committed full step of the repository ``dst``.

    Parameters
    ----------
    src
        A ``.safetensors`` file; a directory of them, with or without a Hugging Face index
        (``*.safetensors.index.json``); a ``torch.save`` file (nested dicts welcome); or a DCP checkpoint
        directory. See :func:`source_kind`.
    dst
        Repository directory or fsspec URL (created if needed).
    step
        The step to write; None writes the step after the newest (0 in a new repository).
    compression
        None or ``"zstd"``.
    progress
        Draw a progress bar on stderr: None (default) when stderr is a terminal.

    Returns
    -------
    ImportResult

    Raises
    ------
    CheckpointNotFoundError
        ``src`` is missing or holds nothing importable.
    InvalidArgumentError
        ``src`` cannot be read safely (a pickle with arbitrary objects, a value that is not JSON-able).
    StepExistsError
        ``step`` is already committed.
    """
    kind = source_kind(src)
    src = os.fspath(src)
    if kind == "safetensors":
        return _import_safetensors(src, dst, step, storage_options, compression, progress, options)
    if kind == "dcp":
        return _import_dcp(src, dst, step, storage_options, compression, progress, options)
    return _import_torch(src, dst, step, storage_options, compression, progress, options)


# safetensors ---------------------------------------------------------------------------------------
def _safetensors_files(src: str) -> tuple[str, dict[str, str], dict[str, Any] | None, str | None]:
    """(directory, weight_map name -> file, index metadata, index file name) of a safetensors source."""
    from safetensors import safe_open

    if os.path.isfile(src):
        with safe_open(src, framework="pt") as f:
            return os.path.dirname(src) or ".", {k: os.path.basename(src) for k in f.keys()}, None, None  # noqa: SIM118
    indexes = sorted(f for f in os.listdir(src) if f.endswith(INDEX_SUFFIX))
    if len(indexes) > 1:
        raise InvalidArgumentError(f"{src} holds several indexes ({', '.join(indexes)}); import one file or index",
                                   file=src)
    if indexes:
        path = os.path.join(src, indexes[0])
        try:
            with open(path, "rb") as fh:
                doc = json.loads(fh.read())
            weight_map = doc["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise TypeError("weight_map must map names to file names")
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgumentError(f"{path} is not a safetensors index: {e}", file=path) from None
        for f in set(weight_map.values()):
            if os.path.basename(f) != f or f in (".", ".."):
                raise InvalidArgumentError(f"{path} names a file {f!r} outside its directory", file=path)
        meta = doc.get("metadata")
        return src, dict(weight_map), meta if isinstance(meta, dict) else None, indexes[0]
    found: dict[str, str] = {}
    for fname in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
        with safe_open(os.path.join(src, fname), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                if k in found:
                    raise InvalidArgumentError(f"tensor {k!r} is in both {found[k]} and {fname}", tensor=k)
                found[k] = fname
    return src, found, None, None


def _import_safetensors(src: str, dst: Any, step: int | None, so: dict[str, Any] | None, comp: str | None,
                        progress: bool | None, options: WriteOptions) -> ImportResult:
    from safetensors import safe_open

    folder, weight_map, index_meta, index_name = _safetensors_files(src)
    for name in weight_map:
        names.check_name(name)
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in by_file if os.path.isfile(os.path.join(folder, f)))
    with _StepBuilder(dst, step, so, comp, options) as builder:
        file_meta: dict[str, Any] = {}
        nbytes = 0
        with Progress(total, "import", enabled=progress) as bar:
            for fname, keys in by_file.items():
                path = os.path.join(folder, fname)
                if not os.path.isfile(path):
                    raise CheckpointNotFoundError(f"the index names {fname}, which is not in {folder}", file=path)
                with safe_open(path, framework="pt") as f:
                    present = set(f.keys())
                    file_meta[fname] = f.metadata()
                    for k in keys:
                        if k not in present:
                            raise InvalidArgumentError(f"the index puts {k!r} in {fname}, which does not hold it",
                                                       tensor=k, file=path)
                        n = builder.add(k, f.get_tensor(k))  # one tensor in memory at a time
                        nbytes += n
                        bar.update(n)
        ext = {"name": SOURCE_EXTENSION, "must_understand": False, "configuration": {
            "format": "safetensors", "weight_map": weight_map, "file_metadata": file_meta,
            "index": None if index_name is None else {"name": index_name, "metadata": index_meta}}}
        record = builder.commit(_flat_tree(list(weight_map)), (ext,))
        return ImportResult(builder.step, "safetensors", len(weight_map), nbytes, record)


# torch.save ----------------------------------------------------------------------------------------
def _import_torch(src: str, dst: Any, step: int | None, so: dict[str, Any] | None, comp: str | None,
                  progress: bool | None, options: WriteOptions) -> ImportResult:
    try:
        try:
            obj = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            obj = torch.load(src, map_location="cpu", weights_only=True)  # legacy format: read whole
    except pickle.UnpicklingError as e:
        m = re.search(r"WeightsUnpickler error:\s*(.+?)(?: was not an allowed global|\s*Please|\n\n|$)", str(e), re.S)
        reason = m.group(1).strip() if m else str(e).strip().splitlines()[0]
        if "Unsupported global" in reason:
            raise InvalidArgumentError(f"{src} cannot be loaded with weights_only=True: it holds objects other than "
                                       f"tensors and plain values ({reason})", file=src) from None
        raise InvalidArgumentError(f"{src} is not a torch.save file ({reason})", file=src) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise InvalidArgumentError(f"{src} is not a torch.save file: {e}", file=src) from None
    tensors, tree = structure.flatten(obj)
    with _StepBuilder(dst, step, so, comp, options) as builder:
        nbytes = 0
        with Progress(sum(t.numel() * t.element_size() for t in tensors.values()), "import", enabled=progress) as bar:
            for name in list(tensors):
                n = builder.add(name, tensors.pop(name))  # the mapping pages in one tensor at a time
                nbytes += n
                bar.update(n)
        record = builder.commit(tree)
        return ImportResult(builder.step, "torch", len(builder.arrays), nbytes, record)


# DCP -----------------------------------------------------------------------------------------------
_DCP_MD = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    (_DCP_MD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                           "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only its own classes, torch sizes, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which ucl does not unpickle")


def read_dcp_metadata(src: str) -> Any:
    """DCP's ``Metadata`` of the checkpoint directory ``src``, unpickled with the restricted unpickler."""
    path = os.path.join(src, ".metadata")
    try:
        with open(path, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{path} is not DCP metadata ucl can read safely: {e}", file=path) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata):
        raise InvalidArgumentError(f"{path} holds a {type(md).__name__}, not DCP Metadata", file=path)
    return md


def _dcp_classes() -> tuple[type, type]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class SafeReader(FileSystemReader):
        """FileSystemReader whose metadata is read once, with the restricted unpickler."""

        def __init__(self, path: str, md: Any) -> None:
            super().__init__(path)
            self._md = md

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self._md

    class SafePlanner(DefaultLoadPlanner):
        """Loads non-tensor values with weights_only=True into ``values`` instead of the state."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, allow_partial_load=True)
            self.values: dict[str, Any] = {}

        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.values[fqn] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise InvalidArgumentError(f"DCP value {fqn!r} is not a plain value: "
                                           f"{str(e).strip().splitlines()[0]}", tensor=fqn) from None

    return SafeReader, SafePlanner


def _import_dcp(src: str, dst: Any, step: int | None, so: dict[str, Any] | None, comp: str | None,
                progress: bool | None, options: WriteOptions) -> ImportResult:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from ucl.adapters.dcp import json_node, tree_from_paths

    md = read_dcp_metadata(src)
    reader_cls, planner_cls = _dcp_classes()
    reader = reader_cls(src, md)
    mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
    paths = {fqn: tuple(mappings.get(fqn, (fqn,))) for fqn in md.state_dict_metadata}
    tensors = {f: m for f, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    leaves: dict[tuple[str | int, ...], dict[str, Any]] = {}
    for fqn in tensors:
        leaves[paths[fqn]] = {"t": "tensor", "name": names.check_name("/".join(map(str, paths[fqn])))}

    def load(state: dict[str, Any]) -> Any:
        planner = planner_cls()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(state, storage_reader=reader, planner=planner, no_dist=True)
        return planner

    values = [f for f in md.state_dict_metadata if f not in tensors]
    if values:
        got = load({f: None for f in values}).values
        for f in values:
            leaves[paths[f]] = json_node(f, got[f])
    with _StepBuilder(dst, step, so, comp, options) as builder:
        nbytes = 0
        total = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in tensors.values())
        with Progress(total, "import", enabled=progress) as bar:
            for fqn, m in tensors.items():
                t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
                load({fqn: t})  # one tensor per call: bounded memory
                n = builder.add(leaves[paths[fqn]]["name"], t)
                del t
                nbytes += n
                bar.update(n)
        order = list(paths.values())
        tree = tree_from_paths({p: leaves[p] for p in order})
        record = builder.commit(tree)
        return ImportResult(builder.step, "dcp", len(tensors), nbytes, record)


# -- export ----------------------------------------------------------------------------------------
@dataclass
class ExportResult:
    """What :func:`export_safetensors` wrote."""

    files: list[str]
    index: str | None
    tensors: int
    bytes: int
    skipped_values: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "index": self.index, "tensors": self.tensors, "bytes": self.bytes,
                "skipped_values": self.skipped_values}


@dataclass
class _FilePlan:
    folder: str
    files: dict[str, list[str]]  # file name -> tensor names, in write order
    index_name: str | None
    weight_map: dict[str, str]
    file_meta: dict[str, Any]  # file name -> its __metadata__
    index_meta: dict[str, Any] | None


def _plan_files(meta: StepMeta, dst: str, max_shard_size: int | None) -> _FilePlan:
    """Which tensors go to which file: the recorded source layout, else Hugging Face's greedy split."""
    if dst.endswith(".safetensors"):
        folder, base = os.path.dirname(dst) or ".", os.path.basename(dst)
    else:
        folder, base = dst, "model.safetensors"
    source = next((e.get("configuration", {}) for e in meta.extensions if e.get("name") == SOURCE_EXTENSION), None)
    weight_map = source.get("weight_map") if source and source.get("format") == "safetensors" else None
    if max_shard_size is None and isinstance(weight_map, dict) and weight_map and set(weight_map) == set(meta.arrays):
        assert source is not None
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        recorded_meta = source.get("file_metadata") or {}
        index = source.get("index")
        if index is None and len(files) == 1:
            only = next(iter(files))
            return _FilePlan(folder, {base: files[only]}, None, {n: base for n in files[only]},
                             {base: recorded_meta.get(only)}, None)
        index_name = f"{base}.index.json" if dst.endswith(".safetensors") or not index else index["name"]
        return _FilePlan(folder, files, index_name, dict(weight_map), dict(recorded_meta),
                         (index or {}).get("metadata"))
    limit = max_shard_size if max_shard_size is not None else 5 * 10**9
    groups: list[list[str]] = [[]]
    size = 0
    for name, a in meta.arrays.items():
        if groups[-1] and size + a.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += a.nbytes
    if len(groups) == 1:
        return _FilePlan(folder, {base: groups[0]}, None, {n: base for n in groups[0]}, {}, None)
    stem = base[: -len(".safetensors")]
    files = {f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}
    wm = {n: f for f, g in files.items() for n in g}
    return _FilePlan(folder, files, f"{base}.index.json", dict(sorted(wm.items())), {}, None)


def _st_order(meta: StepMeta, tensor_names: list[str]) -> list[str]:
    """The order safetensors' writer gives these tensors (so a round trip reproduces its files byte for byte)."""
    for name in tensor_names:
        if meta.arrays[name].dtype not in _ST_DTYPES:
            raise InvalidArgumentError(f"tensor {name!r} is {meta.arrays[name].dtype}, which safetensors cannot hold",
                                       tensor=name)
    return sorted(tensor_names, key=lambda n: (-_ST_RANK[_ST_DTYPES[meta.arrays[n].dtype]], n))


def _header(meta: StepMeta, tensor_names: list[str], file_meta: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if file_meta:
        header["__metadata__"] = {str(k): str(v) for k, v in file_meta.items()}
    offset = 0
    for name in tensor_names:
        a = meta.arrays[name]
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # as safetensors does: data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def export_safetensors(path: Any, dst: str | os.PathLike[str], step: int | None = None, *,
                       max_shard_size: int | None = None, storage_options: dict[str, Any] | None = None,
                       progress: bool | None = None) -> ExportResult:
    """Write a step's tensors as safetensors, one tensor in memory at a time.

    Parameters
    ----------
    path
        Repository directory or fsspec URL.
    dst
        ``NAME.safetensors`` (a file; sharded files go beside it as ``NAME-00001-of-0000N.safetensors``
        with ``NAME.safetensors.index.json``) or a directory (``model.safetensors`` in it).
    step
        The step; None exports the newest committed step.
    max_shard_size
        Bytes per file (default 5 GB, as Hugging Face); a tensor larger than this gets a file of its own.
        When None and the step was imported from safetensors, the source's files, index and weight map
        are reproduced.

    Returns
    -------
    ExportResult
        Files written (paths), the index (or None), counts, and the names of non-tensor values that
        safetensors cannot hold (left out).
    """
    dst = os.fspath(dst)
    with open_step(path, step, storage_options=storage_options) as ckpt:
        meta = ckpt.meta
        plan = _plan_files(meta, dst, max_shard_size)
        orders = {fname: _st_order(meta, ns) for fname, ns in plan.files.items()}  # all checked before writing
        folder = plan.folder
        os.makedirs(folder, exist_ok=True)
        written: list[str] = []
        total = sum(a.nbytes for a in meta.arrays.values())
        with Progress(total, "export", enabled=progress) as bar:
            for fname, tensor_names in orders.items():
                target = os.path.join(folder, fname)
                tmp = f"{target}.tmp-{os.getpid()}"
                try:
                    with open(tmp, "wb") as fh:
                        fh.write(_header(meta, tensor_names, plan.file_meta.get(fname)))
                        for name in tensor_names:
                            t = ckpt.array(name).read()  # one stored array in memory at a time
                            fh.write(as_bytes(t))
                            bar.update(t.numel() * t.element_size())
                            del t
                    os.replace(tmp, target)
                except BaseException:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    raise
                written.append(target)
        index_path = None
        if plan.index_name is not None:
            doc = {"metadata": {**(plan.index_meta or {}), "total_size": total}, "weight_map": plan.weight_map}
            index_path = os.path.join(folder, plan.index_name)
            with open(index_path, "w") as fh:
                json.dump(doc, fh, indent=2)
                fh.write("\n")
        skipped = [".".join(map(str, p)) for p in _value_paths(meta.tree)]
        return ExportResult(written, index_path, len(meta.arrays), total, skipped)


def _value_paths(tree: dict[str, Any], path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    t = tree.get("t")
    if t == "dict":
        for k, v in tree["items"]:
            yield from _value_paths(v, (*path, k))
    elif t in ("list", "tuple"):
        for i, v in enumerate(tree["items"]):
            yield from _value_paths(v, (*path, i))
    elif t in ("value", "float"):
        yield path
