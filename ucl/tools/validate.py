"""The validator: a straight sequence of checks over a repository, each failure reported as a Problem.

Order (spec/core.md §9): repository document -> commit records -> step documents -> array documents
-> for every shard: listed, present, size, whole-file crc32c, index (crc, bounds, overlaps), every
in-bounds inner chunk present with a matching crc32c -> delta chains (spec/delta.md). Problems name
the step, tensor and file; a failing tensor does not stop the others from being checked.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

from ucl.delta import codec as delta_codec
from ucl.delta.chain import DEFAULT_MAX_CHAIN
from ucl.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    CorruptShardIndexError,
    DeltaChainError,
    InconsistentMetadataError,
    MissingShardError,
    SchemaError,
    ShardSizeError,
    UCLError,
)
from ucl.format import metadata
from ucl.format.metadata import ArrayMeta, CommitRecord, StepMeta
from ucl.format.repository import Repository, step_prefix
from ucl.format.shardfile import EMPTY, decode_chunk, index_nbytes, inner_chunks
from ucl.io import native as _native
from ucl.io.ranges import Lease
from ucl.options import DEFAULT_READ, ReadOptions
from ucl.plan.layout_load import check_step as check_layout_step
from ucl.plan.layout_save import stored_chunks
from ucl.plan.save import spec_for_meta
from ucl.read.files import StepFiles, step_files, truncated
from ucl.tools import progress as _progress
from ucl.tools.validate_chain import validate_chain

log = logging.getLogger("ucl.tools.validate")

_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class Problem:
    code: str
    message: str
    step: int | None = None
    tensor: str | None = None
    file: str | None = None


@dataclass
class Report:
    """What :func:`validate_repo` found. ``ok`` is True when there are no problems."""

    path: str
    steps: list[int] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    _deps: dict[int, list[Any]] = field(default_factory=dict, repr=False)  # problems of steps others replay on
    _bar: Any = field(default=None, repr=False, compare=False)  # the progress bar of this run (bytes checked)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "valid": self.ok, "steps": self.steps, "files_checked": self.files_checked,
                "bytes_checked": self.bytes_checked, "problems": [asdict(p) for p in self.problems]}

    def add(self, e: UCLError, step: int | None = None) -> None:
        self.problems.append(Problem(e.code, e.message, step, e.tensor, e.file))


def validate_repo(path: Any, step: int | None = None, *, storage_options: dict[str, Any] | None = None,
                  checksums: bool = True, options: ReadOptions = DEFAULT_READ,
                  progress: bool | None = None) -> Report:
    """Check a repository (every committed step, or only ``step``) against the spec.

    Parameters
    ----------
    path
        Local directory or fsspec URL.
    step
        Only this step (plus the steps its delta chain needs).
    checksums
        Verify every file's and every inner chunk's crc32c (reads all data); False checks structure,
        presence and sizes only.
    options
        How shards are read (:class:`ucl.options.ReadOptions`: O_DIRECT, kept buffers).
    progress
        A bar of the bytes checked on stderr: None (default) when stderr is a terminal and the steps
        hold at least 256 MiB (``UCL_PROGRESS=0/1`` forces it off / on; :mod:`ucl.io.progress`); True
        always, False never.

    Returns
    -------
    Report
        ``report.ok`` is the verdict; ``report.problems`` lists each problem with its stable code.
    """
    report = Report(str(path))
    try:
        repo = Repository.open(path, storage_options)
    except UCLError as e:
        report.add(e)
        return report
    _check_steps_group(repo, report)
    if not repo.store.list_dir("commits") and repo.store.list_dir("parts"):
        report.add(CheckpointNotFoundError(
            f"{repo.url} is a node's part of a memory tier spread over nodes (its commit records are under "
            "parts/, spec/core.md §12.1): a part alone is not a repository; validate the durable repository, "
            "or restore through the CheckpointManager that wrote it", file="parts"))
        return report
    try:
        steps = repo.steps() if step is None else [step]
    except UCLError as e:  # commits/ that is not a directory, or resolves outside the repository
        report.add(e)
        return report
    if progress or (progress is None and _progress.enabled()):
        report._bar = _progress.bar(_recorded_bytes(repo, steps), "validate", enabled=progress,
                                    min_total=_progress.min_bytes())
    try:
        for s in steps:
            report.steps.append(s)
            _validate_step(repo, s, report, checksums, options)
        if report._bar is not None:
            report._bar.update(max(0, report._bar.total - report._bar.done))  # documents, indexes: all seen
    finally:
        if report._bar is not None:
            report._bar.close()
            report._bar = None
    log.info("validated %s: %d step(s), %d shard(s), %.1f MB checked: %s", report.path, len(report.steps),
             report.files_checked, report.bytes_checked / 1e6,
             "valid" if report.ok else f"invalid ({len(report.problems)} problem(s))")
    return report


def _recorded_bytes(repo: Repository, steps: list[int]) -> int:
    """The bytes the commit records of ``steps`` list (the bar's total); unreadable records count 0."""
    total = 0
    for s in steps:
        with contextlib.suppress(UCLError):
            total += repo.commit_record(s).nbytes
    return total


def _check_steps_group(repo: Repository, report: Report) -> None:
    """steps/zarr.json: the group document that makes the steps a zarr hierarchy (spec/core.md §3)."""

    what = f"{repo.url}/steps/zarr.json"
    try:
        doc = metadata.loads(repo.read_document("steps/zarr.json"), what)
    except (FileNotFoundError, NotADirectoryError):
        report.add(SchemaError(f"{what} is missing", file=what))
        return
    except UCLError as e:
        report.add(e)
        return
    if not (isinstance(doc, dict) and set(doc) == {"zarr_format", "node_type", "attributes"}
            and doc["zarr_format"] == 3 and doc["node_type"] == "group" and isinstance(doc["attributes"], dict)):
        report.add(SchemaError(f"{what} is not a Zarr v3 group document", file=what))


def _validate_step(repo: Repository, step: int, report: Report, checksums: bool, options: ReadOptions) -> None:
    try:
        record = repo.commit_record(step)
        meta = repo.step_meta(step, record)
    except UCLError as e:
        report.add(e, step)
        return
    files = step_files(repo.store, step, record, options, format_version=meta.format_version)
    # the logical records and the step's layout and mesh (spec/layout.md §6.6, §6.8); none for plain steps
    for problem in check_layout_step({n: spec_for_meta(a) for n, a in meta.arrays.items()}, meta.layout, meta.mesh):
        report.add(problem, step)
    expected_files = {"zarr.json"}
    for name, arr in meta.arrays.items():
        if arr.delta is None or meta.format_version < 2:  # a version 2 delta array has no document
            expected_files.add(f"{arr.key}/zarr.json")
            try:
                _check_array_doc(repo, step, record, meta, arr)
            except UCLError as e:
                report.add(e, step)
                continue
        holding = _holding(arr)  # a layout array: only the chunks that hold data are written (spec/layout.md §6.5)
        n_shards = math.prod(arr.grid) if holding is None else len(holding)
        if arr.delta is None and n_shards > len(record.files):  # never enumerate a grid the record cannot hold
            report.add(MissingShardError(f"tensor {name!r} has {n_shards} shards; the commit record of step {step} "
                                         f"lists {len(record.files)} files", tensor=name,
                                         file=f"{step_prefix(step)}/{arr.key}"), step)
            continue
        for coords in itertools.product(*(range(g) for g in arr.grid)):
            rel = arr.shard_key(coords)
            expected_files.add(rel)
            if rel in record.files and arr.delta is not None and arr.delta.get("mode") == "stale":
                report.add(InconsistentMetadataError(
                    f"the commit record of step {step} lists shard {rel} of stale tensor {name!r}, which "
                    "stores no data (spec/delta.md §9)", tensor=name,
                    file=f"{step_prefix(step)}/{rel}"), step)
                continue
            if rel not in record.files:
                if arr.delta is None and (holding is None or coords in holding):
                    report.add(MissingShardError(f"shard {rel} of tensor {name!r} is not in the commit record of step "
                                                 f"{step}", tensor=name, file=f"{step_prefix(step)}/{rel}"), step)
                continue
            try:
                _check_shard(repo, files, record, arr, coords, report, checksums, options)
            except UCLError as e:
                if e.tensor is None:
                    e.tensor = name
                report.add(e, step)
    files.ranges.pool.trim(options.keep_buffer_bytes)  # one shard at a time is held; keep a few warm
    for p in sorted(_group_docs(meta) & set(record.files)):  # intermediate group documents: listed, so checked
        try:
            repo.read_verified(step, p, record)
        except UCLError as e:
            report.add(e, step)
    for p in sorted(set(record.files) - expected_files - _group_docs(meta)):
        report.add(InconsistentMetadataError(f"the commit record of step {step} lists {p}, which no array of the "
                                             "step owns", file=f"{step_prefix(step)}/{p}"), step)
    if meta.kind == "delta":
        _check_chain(repo, step, meta, report)
    if meta.gradient_records is not None:
        _check_replay(repo, step, meta, report)


def _holding(arr: ArrayMeta) -> set[tuple[int, ...]] | None:
    """The chunks of a layout array that hold data, or None for a plain array (every chunk)."""
    if not arr.logical:
        return None

    return stored_chunks(spec_for_meta(arr))


def _group_docs(meta: StepMeta) -> set[str]:
    out = set()
    for arr in meta.arrays.values():
        parts = arr.key.split("/")
        for i in range(1, len(parts)):
            out.add("/".join(parts[:i]) + "/zarr.json")
    return out


def _check_array_doc(repo: Repository, step: int, record: CommitRecord, meta: StepMeta, arr: ArrayMeta) -> None:
    rel = f"{arr.key}/zarr.json"
    raw = repo.read_verified(step, rel, record)
    metadata.check_array_document(raw, arr, meta.format_version, f"{repo.url}/{step_prefix(step)}/{rel}")


def _check_shard(repo: Repository, files: StepFiles, record: CommitRecord, arr: ArrayMeta, coords: tuple[int, ...],
                 report: Report, checksums: bool, options: ReadOptions) -> None:
    step = files.step
    rel = arr.shard_key(coords)
    key = f"{step_prefix(step)}/{rel}"
    size, crc = record.files[rel]
    actual = repo.store.size(key)
    if actual is None:
        raise files.missing(key, arr.name)  # step_removed when the step was deleted while validated
    if actual != size:
        raise ShardSizeError(f"shard {key} of tensor {arr.name!r} is {actual} bytes, the commit record says {size}",
                             tensor=arr.name, file=key)
    n = index_nbytes(arr.n_inner)
    if size < n:
        raise ShardSizeError(f"shard {key}: {size} bytes cannot hold its {n}-byte index", tensor=arr.name, file=key)
    report.files_checked += 1
    bar = report._bar
    if not checksums:
        _check_presence(arr, coords, files.index(arr, coords), key)
        if bar is not None:
            bar.update(size)
        return
    # the one range reader (O_DIRECT when cold): a shard up to whole_max_bytes in one read, a larger one
    # chunk by chunk after its index, so that validating holds at most one inner chunk of it
    got: Lease | memoryview | None = None
    if size <= options.chain.whole_max_bytes:
        index, got = files.whole(arr, coords)
    else:
        index = files.index(arr, coords)
    data = got.view if isinstance(got, Lease) else got
    # a delta payload is decoded as the reader decodes it (frames, sizes), into scratch words: its values
    # need the base, its decodability does not
    encoding = arr.inner_codecs()[0]["configuration"]["encoding"] if arr.delta is not None else None
    try:
        _check_presence(arr, coords, index, key)
        crcs = []
        for ordinal, (off, nb) in enumerate(index):
            if off == EMPTY:
                continue
            off, nb = int(off), int(nb)
            piece = files.read(key, off, nb) if data is None else data[off : off + nb]
            view = piece.view if isinstance(piece, Lease) else piece
            if bar is not None:
                bar.update(nb)
            try:
                if view.nbytes < nb:
                    raise truncated(key, arr.name, view.nbytes, nb, off)
                stored = bytes(view[nb - 4 : nb])
                if _native.crc32c(view[: nb - 4]) != _CRC.unpack(stored)[0]:
                    raise ChecksumError(f"shard {key}: an inner chunk at offset {off} of tensor {arr.name!r} fails "
                                        "its crc32c", tensor=arr.name, file=key)
                crcs.append(stored)
                if encoding is not None:  # validate vouches only for what load decodes (spec/delta.md §7, check 6)
                    try:
                        delta_codec.check_payload(view[: nb - 4], arr.itemsize, arr.inner_nbytes, encoding)
                    except delta_codec.PayloadError as e:
                        raise delta_codec.PayloadError(f"shard {key}: the delta payload of inner chunk {ordinal} of "
                                                       f"tensor {arr.name!r} does not decode: {e.message}",
                                                       tensor=arr.name, file=key) from None
                elif arr.compression is not None:  # a chunk that does not decode is as unreadable as a bad crc
                    decode_chunk(arr, view[: nb - 4], key, (ordinal,))
            finally:
                if isinstance(piece, Lease):
                    piece.release()
        crcs.append(_CRC.pack(_native.crc32c(index.tobytes())))  # the index's crc32c (parse_index checked it)
        if _native.crc32c(b"".join(crcs)) != crc:  # binds the chunks to this file (spec/core.md §7)
            raise ChecksumError(f"shard {key} of tensor {arr.name!r} does not hold the chunks its commit record "
                                "names (its digest differs: a swapped or replaced shard)", tensor=arr.name, file=key)
        report.bytes_checked += size
    finally:
        if isinstance(got, Lease):
            got.release()


def _check_presence(arr: ArrayMeta, coords: tuple[int, ...], index: Any, key: str) -> None:
    if arr.delta is not None:
        return  # absent inner chunks of a delta array mean "unchanged" (spec/delta.md)
    for c in inner_chunks(arr, coords):
        present = int(index[c.ordinal][0]) != EMPTY
        if present == c.empty:
            what = "absent" if not present else "present though outside the array"
            raise CorruptShardIndexError(f"shard {key}: inner chunk {list(c.coords)} of tensor {arr.name!r} is {what}",
                                         tensor=arr.name, file=key)




def _check_replay(repo: Repository, step: int, meta: StepMeta, report: Report) -> None:
    """Gradient-record steps (spec/delta.md §8): the replay reads the parent's whole state, so the parent
    (and, while it is itself a gradient-record step, its parent) must be sound; each stored gradient must
    have its parameter's shape and dtype. Problems are ``broken_chain`` on this step, naming the parent."""

    rec = meta.gradient_records
    grads = {n: meta.arrays[rec.gradient_name(n)] for n in rec.parameters if rec.gradient_name(n) in meta.arrays}
    cur = meta
    for _ in range(DEFAULT_MAX_CHAIN + 1):
        r = cur.gradient_records
        if r is None:
            break
        parent = r.base_step
        try:
            prec = repo.commit_record(parent)
            pmeta = repo.step_meta(parent, prec)
        except UCLError as e:
            report.add(DeltaChainError(f"step {step} replays its optimizer step on step {parent}, which is not "
                                       f"readable: [{e.code}] {e.message}", file=e.file), step)
            return
        for name in sorted(grads):
            a = pmeta.arrays.get(name)
            if a is not None:
                g = grads.pop(name)
                if tuple(a.shape) != tuple(g.shape) or a.dtype != g.dtype:
                    report.add(DeltaChainError(f"step {step}: gradient {g.name!r} is {list(g.shape)} {g.dtype}, "
                                               f"parameter {name!r} of step {parent} is {list(a.shape)} {a.dtype}",
                                               tensor=g.name), step)
        via = "" if parent == rec.base_step else f" (whose replay reads step {parent})"
        for problem in _parent_problems(repo, parent, prec, pmeta, report):
            report.add(DeltaChainError(f"step {step} replays its optimizer step on step {rec.base_step}{via}; step "
                                       f"{parent} is invalid: [{problem.code}] {problem.message}",
                                       tensor=problem.tensor, file=problem.file), step)
        cur = pmeta
    else:
        report.add(DeltaChainError(f"step {step}: more than {DEFAULT_MAX_CHAIN} gradient-record steps in a row"), step)
        return
    for name in sorted(grads):
        report.add(DeltaChainError(f"step {step}: gradient records name parameter {name!r}, which no step of its "
                                   "replay chain stores", tensor=name), step)


def _parent_problems(repo: Repository, step: int, record: CommitRecord, meta: StepMeta,
                     report: Report) -> list[Any]:
    """Problems of every array of ``step`` and of its delta chain (anything with code, message, tensor,
    file). A step this run has validated already (steps go oldest first) is not read again."""
    cache = report._deps
    if step not in cache and step in report.steps[:-1]:
        cache[step] = [p for p in report.problems if p.step == step]
    if step not in cache:

        found: list[UCLError] = []
        for arr in meta.arrays.values():
            prefix = f"{arr.key}/c"
            for rel in sorted(r for r in record.files if r == prefix or r.startswith(prefix + "/")):
                try:
                    repo.read_verified(step, rel, record, n_inner=arr.n_inner)
                except UCLError as e:
                    found.append(e)
        if meta.kind == "delta":
            found += list(validate_chain(repo, step, meta))
        cache[step] = found
    return cache[step]


def _check_chain(repo: Repository, step: int, meta: StepMeta, report: Report) -> None:
    """Delta steps: the chain must resolve and every base must be sound (spec/delta.md §7)."""

    for e in validate_chain(repo, step, meta):
        report.add(e, step)
