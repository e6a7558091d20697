"""A repository of steps: where documents live, which steps exist, and reading their metadata.

Layout (spec/core.md §3)::

    <repo>/zarr.json                 group; attributes.ucl.format_version
    <repo>/steps/zarr.json           group
    <repo>/steps/<step>/zarr.json    the step's group document (StepMeta), consolidated metadata
    <repo>/steps/<step>/<name>/...   one Zarr v3 array per tensor, shards at c/<i>/<j>...
    <repo>/commits/<step>.json       the commit record: the step exists iff this verifies

A step's files are written before its commit record; deleting a step removes the record first. So a
reader that lists ``commits/`` never sees a half-written or half-deleted step.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ucl.errors import (
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCommitRecordError,
    DeltaChainError,
    InconsistentMetadataError,
    InvalidArgumentError,
    LimitExceededError,
    MissingShardError,
    ShardSizeError,
    StepNotCommittedError,
)
from ucl.format import metadata
from ucl.format.metadata import CommitRecord, StepMeta
from ucl.format.shardfile import file_digest
from ucl.io import native as _native
from ucl.io.stores import open_store
from ucl.io.stores.base import Store

_COMMIT_NAME = re.compile(r"^(0|[1-9][0-9]{0,18})\.json$")
MAX_STEP = (1 << 63) - 1
#: The most step documents read to find a step's logical records (spec/layout.md §6.9; chains are
#: shorter: spec/delta.md §6.2 item 3).
MAX_RECORDS_CHAIN = 4096


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidArgumentError(f"step must be an integer in [0, 2^63), got {step!r}")
    return step


def step_prefix(step: int) -> str:
    return f"steps/{step}"


def compaction_prefix(step: int) -> str:
    """Where ``ucl compact`` stages the full version of step ``step`` (tools/compact.py)."""
    return f"compact/{step}"


def compaction_journal(step: int) -> str:
    """The journal of an unfinished compaction of step ``step``: the commit record it will write."""
    return f"compact/{step}.json"


def commit_key(step: int) -> str:
    return f"commits/{step}.json"


class Repository:
    """A checkpoint repository on any Store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # resolved logical records of the steps delta steps took them from: (step, its document's
        # (size, crc32c) in its commit record) -> array name -> record; a few, for the next open
        self._records_cache: dict[tuple[int, Any], dict[str, Any]] = {}

    @classmethod
    def open(cls, path: str | os.PathLike[str] | Store, storage_options: dict[str, Any] | None = None,
             create: bool = False) -> Repository:
        repo = cls(open_store(path, storage_options))
        try:
            raw = repo.read_document("zarr.json")
        except (FileNotFoundError, NotADirectoryError):
            if not create:
                raise CheckpointNotFoundError(f"no ucl repository at {repo.store.url} (zarr.json is missing)",
                                              file=repo.store.url) from None
            # the root document last: a repository exists once it does, with everything it needs
            repo.store.write_atomic("steps/zarr.json", metadata.dumps(
                {"zarr_format": 3, "node_type": "group", "attributes": {}}))
            repo.store.write_atomic("zarr.json", metadata.dumps(metadata.repo_doc()))
            if repo.store.is_local:
                repo.store.sync_dir("")
            return repo
        metadata.parse_repo(raw, f"{repo.store.url}/zarr.json")
        return repo

    @property
    def url(self) -> str:
        return self.store.url

    # -- which steps exist ------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with a commit record, ascending (records are verified when a step is opened)."""
        out = []
        for name in self.store.list_dir("commits"):
            m = _COMMIT_NAME.match(name)
            if m and int(m.group(1)) <= MAX_STEP:
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int | None:
        """The newest step whose commit record verifies, or None."""
        found = self.latest_record()
        return None if found is None else found[0]

    def latest_record(self) -> tuple[int, CommitRecord] | None:
        """The newest step whose commit record verifies, with that record (parsed once), or None."""
        for step in reversed(self.steps()):
            try:
                return step, self.commit_record(step)
            except CheckpointNotFoundError:
                continue
            except Exception:  # a corrupt newest record: fall back to the previous step
                continue
        return None

    def commit_record(self, step: int) -> CommitRecord:
        check_step(step)
        key = commit_key(step)
        try:
            raw = self.read_document(key)
        except LimitExceededError as e:
            raise CorruptCommitRecordError(f"commit record {self.url}/{key} is unreadable: {e.message}",
                                           file=key) from None
        except (FileNotFoundError, NotADirectoryError):
            if self.store.exists(f"{step_prefix(step)}/zarr.json"):
                raise StepNotCommittedError(f"step {step} in {self.url} has files but no commit record: it was never "
                                            "committed", file=key) from None
            raise CheckpointNotFoundError(f"step {step} does not exist in {self.url}", file=key) from None
        with metadata.acyclic():
            return CommitRecord.from_bytes(raw, f"{self.url}/{key}", step)

    def read_document(self, key: str) -> bytes:
        """A metadata document that no record sizes: refused unread when larger than the spec's limit
        (spec/core.md §8.4), never more than the limit read; NotAFileError when it is not a regular file."""
        return self.store.read_bounded(key, metadata.MAX_DOC_BYTES)

    def read_verified(self, step: int, rel: str, record: CommitRecord, *, n_inner: int | None = None) -> bytes:
        """A file of a committed step, checked against its commit record (:func:`read_listed`)."""
        return read_listed(self.store, step, rel, record, n_inner=n_inner)

    def step_meta(self, step: int, record: CommitRecord | None = None, *, lazy: bool = False) -> StepMeta:
        """The step's document, checked against its commit record. A delta step that takes its logical
        records from its parent (``logical: {"from": P}``, spec/layout.md §6.9) comes with them: the
        parents are read up to the step that holds them (resolved records are kept for the next call).
        ``lazy``: each array's entry is checked when first used (:class:`ucl.format.metadata.Arrays`)."""
        record = record or self.commit_record(step)
        with metadata.acyclic():
            meta = self._step_document(step, record, lazy=lazy)
            if meta.logical_from is None:
                return meta
            return meta.with_records(self._records_of(meta.logical_from, step))

    def _step_document(self, step: int, record: CommitRecord, *, lazy: bool = False) -> StepMeta:
        raw = self.read_verified(step, "zarr.json", record)
        what = f"{self.url}/{step_prefix(step)}/zarr.json"
        meta = StepMeta.from_dict(metadata.loads(raw, what), what, lazy=lazy)
        if meta.step != step or meta.kind != record.kind or meta.parent != record.parent:

            raise InconsistentMetadataError(f"{what} disagrees with the commit record of step {step} "
                                            "(step, kind or parent)", file=what)
        return meta

    def _records_of(self, step: int, child: int) -> dict[str, Any]:
        """The logical records (array name -> record) of committed step ``step``, whose child ``child``
        takes them: read from ``step``'s document, or from its parents' while it takes them from its
        parent too (at most MAX_RECORDS_CHAIN documents); ``broken_chain`` when one is not committed."""
        walk: list[tuple[tuple[int, Any], StepMeta]] = []  # (cache key, the document), child to ancestor
        records: dict[str, Any] | None = None
        cur, below = step, child
        while records is None:
            if len(walk) >= MAX_RECORDS_CHAIN:
                raise DeltaChainError(f"step {child} takes its logical records from a chain of more than "
                                      f"{MAX_RECORDS_CHAIN} steps", file=f"{step_prefix(child)}/zarr.json")
            try:
                record = self.commit_record(cur)
            except (CheckpointNotFoundError, CorruptCommitRecordError) as e:
                raise DeltaChainError(f"step {below} takes its logical records from step {cur}, which is not "
                                      f"committed: {e.message}",
                                      file=f"{step_prefix(below)}/zarr.json") from None
            key = (cur, record.files.get("zarr.json"))
            records = self._records_cache.get(key)
            if records is not None:
                break
            meta = self._step_document(cur, record)
            walk.append((key, meta))
            if meta.logical_from is None:
                records = {n: a.logical for n, a in meta.arrays.items() if a.logical}
            else:
                cur, below = meta.logical_from, cur
        for key, meta in reversed(walk):  # ancestor to child: each takes its parent's records
            if meta.logical_from is not None:
                records = {n: a.logical for n, a in meta.with_records(records).arrays.items() if a.logical}
            if len(self._records_cache) >= 8:
                self._records_cache.pop(next(iter(self._records_cache)))
            self._records_cache[key] = records
        return records


def read_listed(store: Store, step: int, rel: str, record: CommitRecord, *, n_inner: int | None = None) -> bytes:
    """A file of a committed step, checked against its commit record: size, and the crc32c of a
    document or (given the shard's number of inner chunks, ``n_inner``) a shard's digest."""
    key = f"{step_prefix(step)}/{rel}"
    if rel not in record.files:
        raise MissingShardError(f"{key} is not listed in the commit record of step {step}", file=key)
    size, crc = record.files[rel]
    try:
        # never more than the record says (+1, to know there is more): a file may be larger than its record
        # says, or grow (no size query first: on an object store it was a request of its own per file)
        data = store.read_bounded(key, size)
    except (FileNotFoundError, NotADirectoryError):
        raise MissingShardError(f"{key} is missing", file=key) from None
    except LimitExceededError:
        actual = store.size(key)  # to name it
        found = f"{actual} bytes" if actual is not None and actual > size else f"more than {size} bytes"
        raise ShardSizeError(f"{key} is {found}, the commit record says {size}", file=key) from None
    if len(data) != size:
        raise ShardSizeError(f"{key} is {len(data)} bytes, the commit record says {size}", file=key)
    if n_inner is not None:
        if file_digest(data, n_inner, verify=True, where=key) != crc:
            raise ChecksumError(f"{key} does not hold the chunks its commit record names (digest differs)",
                                file=key)
    elif _native.crc32c(data) != crc:
        raise ChecksumError(f"{key} fails its crc32c", file=key)
    return data
