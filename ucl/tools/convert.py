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
  a temporary name and renamed into place only once all are complete. It writes exactly what it is
  told: ``NAME.safetensors`` is one file; a directory is the export's own as far as its
  ``*.safetensors`` and index files go (a previous export's are removed). ``tensors=`` selects a
  subtree by name prefix and ``strip_prefix=`` turns ``model/...`` back into Hugging Face names.

Nothing is unpickled unsafely: ``torch.save`` files load with ``weights_only=True``; DCP's pickled
``.metadata`` is read with an unpickler that admits only DCP's metadata classes, torch sizes and dtypes;
DCP's non-tensor values load with ``weights_only=True`` and must be JSON-able to be stored.

A safetensors import records where each tensor came from (file names, each file's ``__metadata__``,
the index's ``metadata``) in the step as the extension ``ucl.source`` (``must_understand: false``),
so that an export reproduces the same files, index and weight map. A directory's other files
(``config.json``, tokenizer files, ...) are kept there too, as UTF-8 text or base64 (never as tensors,
so readers of the step see the weights only), and an export to a directory writes them back.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import re
import struct
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ucl.errors import CheckpointNotFoundError, InvalidArgumentError
from ucl.format import dtypes, names, structure
from ucl.format.metadata import CommitRecord, StepMeta
from ucl.format.repository import Repository, check_step
from ucl.format.shardfile import as_bytes
from ucl.layout.views import as_view
from ucl.options import DEFAULT_WRITE, WriteOptions
from ucl.plan.save import all_shards, array_for, shard_block
from ucl.read.checkpoint import open as open_step
from ucl.read.load import read_take, view_plan
from ucl.tools.progress import Progress
from ucl.write.step import FileEntry, StepWriter

__all__ = ["export_safetensors", "import_checkpoint", "parse_size", "source_kind"]

SOURCE_EXTENSION = "ucl.source"
INDEX_SUFFIX = ".safetensors.index.json"
FILES_KEY = "files"  # ucl.source: an imported directory's other files, {name: {"text": str} | {"base64": str}}
KEEP_FILES_BYTES = 64 << 20  # at most this much of them is kept (they live in the step document)
# files of a model directory that are weights (or pickles), never kept as its "other files"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".npz",
                    ".npy", ".pkl", ".pickle", ".tmp")

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
    kept_files: list[str] = field(default_factory=list)  # a directory's config/tokenizer files, kept in the step
    skipped_files: list[str] = field(default_factory=list)  # other files past KEEP_FILES_BYTES, not kept

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "source": self.source, "tensors": self.tensors, "bytes": self.bytes}
        if self.kept_files or self.skipped_files:
            d.update(kept_files=self.kept_files, skipped_files=self.skipped_files)
        return d


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
        config: dict[str, Any] = {
            "format": "safetensors", "weight_map": weight_map, "file_metadata": file_meta,
            "index": None if index_name is None else {"name": index_name, "metadata": index_meta}}
        kept, skipped = _other_files(folder) if os.path.isdir(src) else ({}, [])
        if kept:
            config[FILES_KEY] = kept
        ext = {"name": SOURCE_EXTENSION, "must_understand": False, "configuration": config}
        record = builder.commit(_flat_tree(list(weight_map)), (ext,))
        return ImportResult(builder.step, "safetensors", len(weight_map), nbytes, record, list(kept), skipped)


def _other_files(folder: str) -> tuple[dict[str, dict[str, str]], list[str]]:
    """An imported directory's files besides its weights (config.json, generation_config.json,
    tokenizer files, ...), as ``ucl.source`` records them: UTF-8 text as is, other bytes as base64.

    Only plain top-level files: no hidden files, no weights (``*.safetensors``, ``*.bin``, ...), no
    index. Files past :data:`KEEP_FILES_BYTES` in total (in name order) are returned as skipped.
    """
    kept: dict[str, dict[str, str]] = {}
    skipped: list[str] = []
    budget = KEEP_FILES_BYTES
    for fname in sorted(os.listdir(folder)):
        path = os.path.join(folder, fname)
        weights_index = fname.endswith(".index.json") and fname[: -len(".index.json")].endswith(_WEIGHT_SUFFIXES)
        if (not _plain_file_name(fname) or fname.endswith(_WEIGHT_SUFFIXES) or weights_index
                or not os.path.isfile(path)):
            continue
        if os.path.getsize(path) > budget:
            skipped.append(fname)
            continue
        with open(path, "rb") as fh:
            data = fh.read(budget + 1)
        if len(data) > budget:
            skipped.append(fname)
            continue
        budget -= len(data)
        try:
            kept[fname] = {"text": data.decode("utf-8")}
        except UnicodeDecodeError:
            kept[fname] = {"base64": base64.b64encode(data).decode("ascii")}
    return kept, skipped


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
    restored_files: list[str] = field(default_factory=list)  # an imported directory's other files, written back
    removed: list[str] = field(default_factory=list)  # a previous export's safetensors files and index

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "index": self.index, "tensors": self.tensors, "bytes": self.bytes,
                "skipped_values": self.skipped_values, "restored_files": self.restored_files,
                "removed": self.removed}


@dataclass(frozen=True)
class _Out:
    """One exported tensor: its name in the step, its spec dtype, shape and size."""

    stored: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    take: Any = None  # a view's rows of ``stored`` (ucl.layout.views.Take); None: the whole tensor


@dataclass
class _FilePlan:
    folder: str
    single: bool  # DST named one file: exactly that file is written
    files: dict[str, list[str]]  # file name -> exported tensor names
    index_name: str | None
    weight_map: dict[str, str]
    file_meta: dict[str, Any]  # file name -> its __metadata__
    index_meta: dict[str, Any] | None


_PT_METADATA = {"format": "pt"}  # what transformers' save_pretrained writes, and some loaders require


def _prefix_list(tensors: str | Sequence[str] | None) -> list[str] | None:
    if tensors is None:
        return None
    prefixes = [tensors] if isinstance(tensors, str) else list(tensors)
    if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        raise InvalidArgumentError(f"tensors (--tensors) must be non-empty name prefixes, got {tensors!r}")
    return prefixes


def _select(ckpt: Any, prefixes: list[str] | None, strip_prefix: str | None) -> dict[str, _Out]:
    """Exported name -> tensor: the step's tensors whose names begin with one of ``prefixes`` (all when
    None), each with ``strip_prefix`` removed from the front of its name."""
    names_all = list(ckpt.keys())
    chosen = names_all
    if prefixes is not None:
        for p in prefixes:
            if not any(n.startswith(p) for n in names_all):
                tops = sorted({n.split("/", 1)[0] + ("/" if "/" in n else "") for n in names_all})
                raise InvalidArgumentError(
                    f"tensors (--tensors) {p!r} selects no tensor of step {ckpt.step}; its names begin with "
                    + (", ".join(repr(t) for t in tops[:12]) + (" ..." if len(tops) > 12 else "") if tops else
                       "nothing (it holds no tensors)"))
        chosen = [n for n in names_all if any(n.startswith(p) for p in prefixes)]
    if strip_prefix is not None:
        if not isinstance(strip_prefix, str) or not strip_prefix:
            raise InvalidArgumentError("strip_prefix (--strip-prefix) must be a non-empty string, got "
                                       f"{strip_prefix!r}")
        bad = [n for n in chosen if not n.startswith(strip_prefix)]
        if bad:
            raise InvalidArgumentError(
                f"strip_prefix (--strip-prefix) {strip_prefix!r} does not begin tensor {bad[0]!r} "
                f"({len(bad)} of {len(chosen)} selected tensor(s)); select the subtree with tensors (--tensors) "
                f"{strip_prefix!r}", tensor=bad[0])
        empty = next((n for n in chosen if n == strip_prefix), None)
        if empty is not None:
            raise InvalidArgumentError(f"strip_prefix (--strip-prefix) {strip_prefix!r} is the whole name of tensor "
                                       f"{empty!r}: nothing would be left to name it", tensor=empty)
    out: dict[str, _Out] = {}
    for n in chosen:
        t = ckpt[n]
        stored = ckpt.meta.arrays.get(n)
        dtype = stored.dtype if stored is not None and not stored.logical else dtypes.from_torch(t.dtype, n)
        out[n[len(strip_prefix):] if strip_prefix else n] = _Out(n, dtype, tuple(t.shape), t.nbytes)
    return out


def _source(meta: StepMeta) -> dict[str, Any] | None:
    src = next((e.get("configuration", {}) for e in meta.extensions if e.get("name") == SOURCE_EXTENSION), None)
    return src if isinstance(src, dict) and src.get("format") == "safetensors" else None


def _is_file_target(dst: str) -> bool:
    return dst.endswith(".safetensors") and not os.path.isdir(dst)


def _plan_files(meta: StepMeta, outs: dict[str, _Out], dst: str, max_shard_size: int | None) -> _FilePlan:
    """Which tensors go to which file: one file when DST names one; in a directory the recorded source
    layout, else Hugging Face's greedy split."""
    single = _is_file_target(dst)
    folder, base = (os.path.dirname(dst) or ".", os.path.basename(dst)) if single else (dst, "model.safetensors")
    source = _source(meta)
    weight_map = source.get("weight_map") if source else None
    recorded = isinstance(weight_map, dict) and bool(weight_map) and set(weight_map) == set(outs)
    recorded_meta: dict[str, Any] = (source or {}).get("file_metadata") or {}
    limit = max_shard_size if max_shard_size is not None else 5 * 10**9
    groups: list[list[str]] = [[]]
    size = 0
    for name, o in outs.items():
        if groups[-1] and size + o.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += o.nbytes
    if single:
        if max_shard_size is not None and len(groups) > 1:
            total = sum(o.nbytes for o in outs.values())
            raise InvalidArgumentError(
                f"{dst} names one file, but the {len(outs)} tensor(s) exported are {total} bytes, more than "
                f"max_shard_size (--max-shard-size) {max_shard_size} allows in one file; export to a directory to "
                "write shards with an index, or drop the limit", file=dst)
        fmeta: Any = _PT_METADATA
        if recorded:
            assert isinstance(weight_map, dict)
            metas = [recorded_meta.get(f) for f in dict.fromkeys(weight_map.values())]
            if all(m == metas[0] for m in metas):
                fmeta = metas[0]  # the source's own metadata: a one-file source comes back byte for byte
        return _FilePlan(folder, True, {base: list(outs)}, None, {n: base for n in outs}, {base: fmeta}, None)
    if max_shard_size is None and recorded:
        assert source is not None and isinstance(weight_map, dict)
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        index = source.get("index")
        if index is None and len(files) == 1:
            only = next(iter(files))
            return _FilePlan(folder, False, {base: files[only]}, None, {n: base for n in files[only]},
                             {base: recorded_meta.get(only)}, None)
        index_name = index["name"] if index else f"{base}.index.json"
        return _FilePlan(folder, False, files, index_name, dict(weight_map),
                         {f: recorded_meta.get(f) for f in files}, (index or {}).get("metadata"))
    if len(groups) == 1:
        return _FilePlan(folder, False, {base: groups[0]}, None, {n: base for n in groups[0]}, {base: _PT_METADATA},
                         None)
    stem = base[: -len(".safetensors")]
    files = {f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}
    wm = {n: f for f, g in files.items() for n in g}
    return _FilePlan(folder, False, files, f"{base}.index.json", dict(sorted(wm.items())),
                     {f: _PT_METADATA for f in files}, None)


def _st_order(outs: dict[str, _Out], tensor_names: list[str]) -> list[str]:
    """The order safetensors' writer gives these tensors (so a round trip reproduces its files byte for byte)."""
    for name in tensor_names:
        if outs[name].dtype not in _ST_DTYPES:
            raise InvalidArgumentError(f"tensor {outs[name].stored!r} is {outs[name].dtype}, which safetensors cannot "
                                       "hold", tensor=outs[name].stored)
    return sorted(tensor_names, key=lambda n: (-_ST_RANK[_ST_DTYPES[outs[n].dtype]], n))


def _header(outs: dict[str, _Out], tensor_names: list[str], file_meta: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if file_meta:
        header["__metadata__"] = {str(k): str(v) for k, v in file_meta.items()}
    offset = 0
    for name in tensor_names:
        o = outs[name]
        header[name] = {"dtype": _ST_DTYPES[o.dtype], "shape": list(o.shape),
                        "data_offsets": [offset, offset + o.nbytes]}
        offset += o.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # as safetensors does: data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _restorable(meta: StepMeta) -> dict[str, bytes]:
    """The other files of an imported directory (config, tokenizer, ...) recorded in ``ucl.source``."""
    source = _source(meta)
    recorded = (source or {}).get(FILES_KEY) or {}
    out: dict[str, bytes] = {}
    for fname, entry in recorded.items() if isinstance(recorded, dict) else ():
        if (not isinstance(fname, str) or not _plain_file_name(fname) or _owned(fname)
                or not isinstance(entry, dict)):
            raise InvalidArgumentError(f"the step's {SOURCE_EXTENSION} extension records a file {fname!r} that is not "
                                       "a plain file name besides the weights")
        if isinstance(entry.get("text"), str):
            out[fname] = entry["text"].encode("utf-8")
        elif isinstance(entry.get("base64"), str):
            try:
                out[fname] = base64.b64decode(entry["base64"], validate=True)
            except ValueError:
                raise InvalidArgumentError(f"the recorded file {fname!r} is not valid base64") from None
        else:
            raise InvalidArgumentError(f"the recorded file {fname!r} has neither text nor base64 content")
    return out


def _plain_file_name(fname: str) -> bool:
    return (os.path.basename(fname) == fname and fname not in ("", ".", "..") and not fname.startswith(".")
            and "\\" not in fname and "\0" not in fname)


def _owned(fname: str) -> bool:
    """The files of a directory an export owns: it removes those it did not write."""
    return fname.endswith((".safetensors", INDEX_SUFFIX))


def _view_outs(ckpt: Any, view: Any) -> tuple[dict[str, _Out], Any]:
    """Exported name -> tensor under a view (ucl.layout.views), a tied output layer left out (Hugging Face
    writes it once, as the embedding, and ties it on load); and the view."""
    v = as_view(view)
    plan = view_plan(ckpt, v)
    if plan.get("lm_head.weight") == plan.get("model.embed_tokens.weight"):
        plan.pop("lm_head.weight", None)
    out: dict[str, _Out] = {}
    for name, take in plan.items():
        t = ckpt[take.source]
        rows = t.shape[0] if take.ranges is None else sum(b - a for a, b in take.ranges)
        shape = (rows, *tuple(t.shape)[1:])
        dtype = dtypes.from_torch(t.dtype, take.source)
        out[name] = _Out(take.source, dtype, shape, math.prod(shape) * dtypes.itemsize(dtype), take)
    return out, v


def _hf_config(ckpt: Any, v: Any, config: Any, dtype: str) -> bytes:
    """config.json: the one given (a path or a dict), else the view's, from the step's shapes (``dtype``:
    the model's, its embedding's)."""
    if config is None:
        doc = v.config({n: tuple(ckpt[n].shape) for n in ckpt}, ckpt.layout, dtype)
    elif isinstance(config, dict):
        doc = config
    else:
        with open(os.fspath(config)) as fh:
            doc = json.load(fh)
    return (json.dumps(doc, indent=2) + "\n").encode()


def export_safetensors(path: Any, dst: str | os.PathLike[str], step: int | None = None, *,
                       tensors: str | Sequence[str] | None = None, strip_prefix: str | None = None,
                       max_shard_size: int | None = None, storage_options: dict[str, Any] | None = None,
                       progress: bool | None = None, view: Any = None, config: Any = None) -> ExportResult:
    """Write a step's tensors (or a subtree of them) as safetensors, one tensor in memory at a time.

    Parameters
    ----------
    path
        Repository directory or fsspec URL.
    dst
        ``NAME.safetensors``: exactly that one file (nothing else is written or removed beside it). Any
        other path (or an existing directory): a directory holding ``model.safetensors``, or shards
        ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``; the directory's
        ``*.safetensors`` and ``*.safetensors.index.json`` files this export did not write (a previous
        export's) are removed once the new files are in place, other files (``config.json``, ...) are
        left alone, and an imported directory's config and tokenizer files are written back.
    step
        The step; None exports the newest committed step.
    tensors
        Export only the tensors whose names begin with this prefix (or one of these prefixes), e.g.
        ``"model/"`` for a step saved as ``{"model": model.state_dict(), "optim": opt.state_dict()}``.
    strip_prefix
        Remove this prefix from the front of every exported name (``"model/"`` gives Hugging Face names);
        every exported tensor must begin with it.
    max_shard_size
        Bytes per file of a directory export (default 5 GB, as Hugging Face); a tensor larger than this
        gets a file of its own. When None and the step was imported from safetensors, the source's files,
        index and weight map are reproduced. A one-file export (``NAME.safetensors``) larger than
        ``max_shard_size`` fails before anything is written.
    view, config
        Export the step under another framework's names (``ucl export --to hf`` is ``view="hf-llama"``,
        :mod:`ucl.layout.views`): a Megatron-core GPT/LLaMA step as a ``from_pretrained`` directory of
        ``LlamaForCausalLM``, with ``config`` (a dict or the path of a config.json; default: made from the
        step's shapes, :meth:`ucl.layout.views.HFLlama.config`). Not with ``tensors``/``strip_prefix``.

    Returns
    -------
    ExportResult
        Files written (paths), the index (or None), counts, the names of non-tensor values that
        safetensors cannot hold (left out), the config/tokenizer files restored and the stale files removed.

    Raises
    ------
    InvalidArgumentError
        A prefix that selects nothing, a ``strip_prefix`` that does not begin a selected name, a dtype
        safetensors cannot hold, a one-file export over ``max_shard_size``. Nothing is written then.
    """
    dst = os.fspath(dst)
    prefixes = _prefix_list(tensors)
    with open_step(path, step, storage_options=storage_options) as ckpt:
        meta = ckpt.meta
        if view is not None:
            if prefixes is not None or strip_prefix is not None:
                raise InvalidArgumentError("a view (--to) names the exported tensors itself: it takes no tensors "
                                           "(--tensors) or strip_prefix (--strip-prefix)")
            outs, v = _view_outs(ckpt, view)
            plan = _plan_files(meta, outs, dst, max_shard_size)
            if plan.single:
                raise InvalidArgumentError(f"a view (--to) writes a directory with its config.json; {dst} names one "
                                           "file", file=dst)
            extra = {"config.json": _hf_config(ckpt, v, config, outs["model.embed_tokens.weight"].dtype)}
        else:
            outs = _select(ckpt, prefixes, strip_prefix)
            plan = _plan_files(meta, outs, dst, max_shard_size)
            extra = {} if plan.single else _restorable(meta)
        orders = {fname: _st_order(outs, ns) for fname, ns in plan.files.items()}  # all checked before writing
        folder = plan.folder
        os.makedirs(folder, exist_ok=True)
        total = sum(o.nbytes for o in outs.values())
        staged: list[tuple[str, str]] = []  # (temporary, final): renamed into place only once all are written
        try:
            with Progress(total, "export", enabled=progress) as bar:
                for fname, tensor_names in orders.items():
                    target = os.path.join(folder, fname)
                    tmp = f"{target}.tmp-{os.getpid()}"
                    staged.append((tmp, target))
                    with open(tmp, "wb") as fh:
                        fh.write(_header(outs, tensor_names, plan.file_meta.get(fname)))
                        for name in tensor_names:
                            o = outs[name]  # one tensor in memory at a time
                            t = read_take(ckpt, o.take) if o.take is not None else ckpt[o.stored].read()
                            fh.write(as_bytes(t))
                            bar.update(t.numel() * t.element_size())
                            del t
            for fname, data in extra.items():
                target = os.path.join(folder, fname)
                staged.append((f"{target}.tmp-{os.getpid()}", target))
                with open(staged[-1][0], "wb") as fh:
                    fh.write(data)
            index_path = None
            if plan.index_name is not None:
                doc = {"metadata": {**(plan.index_meta or {}), "total_size": total}, "weight_map": plan.weight_map}
                index_path = os.path.join(folder, plan.index_name)
                staged.append((f"{index_path}.tmp-{os.getpid()}", index_path))  # last: it names the shards
                with open(staged[-1][0], "w") as fh:
                    json.dump(doc, fh, indent=2)
                    fh.write("\n")
            for tmp, target in staged:
                os.replace(tmp, target)
        except BaseException:
            for tmp, _ in staged:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            raise
        written = {os.path.basename(t) for _, t in staged}
        removed: list[str] = []
        if not plan.single:  # a previous export's shards and index: a loader would read them too
            for fname in sorted(os.listdir(folder)):
                p = os.path.join(folder, fname)
                if _owned(fname) and fname not in written and (os.path.isfile(p) or os.path.islink(p)):
                    os.unlink(p)
                    removed.append(p)
        n_files = len(orders)
        skipped = [".".join(map(str, p)) for p in _value_paths(meta.tree)
                   if prefixes is None or any("/".join(map(str, p)).startswith(x) for x in prefixes)]
        return ExportResult([t for _, t in staged[:n_files]], index_path, len(outs), total, skipped,
                            [os.path.join(folder, f) for f in extra], removed)


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
