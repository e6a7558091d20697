"""The commit protocol of a manager's step, run on every rank once its shards are durable.

Call sequence for one step (the persister thread of every rank; who does each)::

    1. report      every rank       what it wrote: files (path -> size, crc32c), its error, and for a
                                    delta the arrays it wrote data for           (:meth:`StepCommit.report`)
    2. gather      every rank       the reports reach the coordinator (the persister's gloo group)
    3. commit      the coordinator  a verdict from the reports; if every rank succeeded: the step's
                                    StepMeta (full, delta or gradient records), StepWriter.commit
                                    (documents, directory syncs, then the commit record), the writer
                                    lock renewed, retention                     (:meth:`StepCommit.commit`)
    4. broadcast   every rank       the coordinator's verdict
    5. conclude    every rank       raise the step's error, or return (the record on the coordinator)

:meth:`StepCommit.run` does all five; a rank never leaves the protocol early, so the collectives of
every step stay matched across ranks even when some rank failed to write.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from time import perf_counter as clock
from typing import Any

from ucl.errors import WriteError
from ucl.format import metadata, structure
from ucl.format.lock import WriterLock
from ucl.format.metadata import CommitRecord, StepMeta
from ucl.format.repository import Repository
from ucl.write import events
from ucl.write.collectives import Collectives, describe
from ucl.write.job import Job
from ucl.write.kinds import DeltaBase, composite_array, delta_array
from ucl.write.retention import Retention
from ucl.write.step import DocumentCache, FileEntry, StepWriter


def full_meta(job: Job) -> StepMeta:
    """The StepMeta of ``job``'s step stored full (known before its shards are written)."""
    tree = structure.graft(job.tree, []) if job.plan.layout is not None else job.tree
    return StepMeta(step=job.step, kind="full", parent=None, tree=tree, arrays=job.plan.arrays,
                    layout=job.plan.layout, mesh=job.plan.mesh)


class StepCommit:
    """The commit protocol of one manager (its persister thread only).

    Parameters
    ----------
    repo
        The repository.
    dist
        The persister's collectives (never used by another thread).
    lock
        The writer lock (the coordinator's; None on other ranks), renewed on each commit.
    retention
        Run by the coordinator after each commit.
    """

    def __init__(self, repo: Repository, dist: Collectives, lock: WriterLock | None,
                 retention: Retention, commit_threads: int, format_version: int = metadata.FORMAT_VERSION) -> None:
        self.repo, self.dist, self.lock, self.retention = repo, dist, lock, retention
        self.commit_threads = commit_threads
        self.format_version = format_version  # of the steps it commits (WriteOptions.format_version)
        self._documents = DocumentCache()  # arrays' documents serialized before (same plan, same objects)
        # the logical records of the last steps committed (step -> array name -> record): a delta step
        # whose records are its parent's writes {"from": parent} instead (spec/layout.md §6.9)
        self._records: dict[int, dict[str, Any]] = {}

    def run(self, job: Job, files: dict[str, FileEntry], err: BaseException | None,
            base: DeltaBase | None) -> CommitRecord | None:
        """Commit ``job``'s step on every rank (the sequence in the module docstring).

        ``files`` are this rank's durable shards, ``err`` its failure (the step then fails on every rank),
        ``base`` the staged base its state was encoded against (None: stored whole). Returns the commit
        record on the coordinator, None elsewhere; raises this rank's error, the coordinator's, or a
        WriteError naming the first rank's failure.

        Adds its phases to ``job.phases`` (``gather``, and on the coordinator ``commit``: documents not
        written yet, directory syncs, the commit record; ``retention``; ``verdict``: the broadcast), then
        logs them all at DEBUG with the step (``extra={"ucl_phases": ...}`` on the record).
        """
        t = clock()
        reports = self.dist.gather(self.report(job, files, err))
        job.phases["gather"] = clock() - t
        verdict: dict[str, Any] = {"ok": True}
        record = None
        if self.dist.rank == 0:
            verdict, record, failure = self.commit(job, reports, base)
            err = err or failure
        t = clock()
        verdict = self.dist.broadcast(verdict)
        job.phases["verdict"] = clock() - t
        if events.log.isEnabledFor(logging.DEBUG):
            events.log.debug("step %d phases (s): %s", job.step,
                             ", ".join(f"{k} {v:.3f}" for k, v in job.phases.items()),
                             extra={"ucl_phases": dict(job.phases), "ucl_step": job.step})
        if not verdict["ok"]:
            if err is not None:
                raise err
            raise WriteError(f"step {job.step} was not committed: {verdict['error']}")
        return record

    def report(self, job: Job, files: dict[str, FileEntry], err: BaseException | None) -> dict[str, Any]:
        """This rank's report to the coordinator (every rank)."""
        return {"rank": self.dist.rank, "files": files, "error": None if err is None else describe(err),
                "changed": sorted(job.changed or ())}

    def commit(self, job: Job, reports: list[dict[str, Any]], base: DeltaBase | None
               ) -> tuple[dict[str, Any], CommitRecord | None, BaseException | None]:
        """The coordinator's part: ``(verdict, record, its own failure)`` from every rank's report."""
        errors = [r["error"] for r in reports if r["error"]]
        if errors:
            return {"ok": False, "error": errors[0]}, None, None
        try:
            merged: dict[str, FileEntry] = {}
            for r in reports:
                merged.update({k: tuple(v) for k, v in r["files"].items()})  # type: ignore[misc]
            t = clock()
            writer = StepWriter(self.repo, job.step, lock=self.lock, commit_threads=self.commit_threads,
                                documents=self._documents, format_version=self.format_version)
            meta = self.step_meta(job, reports, base)
            record = writer.commit(meta, merged, documents=job.documents)
            self._remember(meta)
            if self.lock is not None:
                self.lock.renew()
            t1 = clock()
            job.phases["commit"] = t1 - t
            self.retention.retain(job.step)
            job.phases["retention"] = clock() - t1
        except BaseException as e:  # noqa: BLE001 - every rank learns the verdict
            return {"ok": False, "error": describe(e)}, None, e
        return {"ok": True}, record, None

    def step_meta(self, job: Job, reports: list[dict[str, Any]], base: DeltaBase | None) -> StepMeta:
        """The StepMeta of ``job``'s step, of the kind the persister decided."""
        arrays, parent = job.plan.arrays, None
        extensions: tuple[dict[str, Any], ...] = ()
        if base is not None:
            parent = base.step
            changed = {n for r in reports for n in r["changed"]}
            if job.composite is not None:  # stale groups refer to older steps (spec/delta.md §9)
                arrays = {n: composite_array(a, n in changed, job.composite) for n, a in arrays.items()}
                if job.composite.marker is not None:
                    extensions = (job.composite.marker.to_extension(),)
            else:
                arrays = {n: delta_array(a, n in changed, base.step) for n, a in arrays.items()}
        if job.kind == "gradients":  # the parameters and optimizer state come from the replay
            assert job.grad is not None
            parent = job.grad.parent
            replayed = job.grad.replayed
            arrays = {n: a for n, a in arrays.items() if n not in replayed} | job.grad.plan.arrays
            extensions = (job.grad.records.to_extension(),)
        tree = job.tree
        if job.plan.layout is not None:  # the coordinator's JSON values; tensors go by name
            tree = structure.graft(job.tree, [])
        records = _records(arrays)
        same = parent is not None and records and self._records.get(parent) == records
        return StepMeta(step=job.step, kind="full" if job.kind == "full" else "delta", parent=parent,
                        tree=tree, arrays=arrays, layout=job.plan.layout, mesh=job.plan.mesh,
                        extensions=extensions, logical_from=parent if same else None)

    def _remember(self, meta: StepMeta) -> None:
        """Keep a committed step's records (the last few) for its children to refer to."""
        records = _records(meta.arrays)
        if records:
            while len(self._records) >= 4:
                self._records.pop(next(iter(self._records)))
            self._records[meta.step] = records


def _records(arrays: Mapping[str, Any]) -> dict[str, Any]:
    return {n: a.logical for n, a in arrays.items() if a.logical}
