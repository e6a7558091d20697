"""The engine API: ``CheckpointManager``, asynchronous saves through double-buffered staging memory.

Data flow of ``mgr.save(step, state)``::

    caller thread:  plan (cached per set of shapes) -> wait for a free staging slot -> copy the tensors
                    this rank writes into it (GIL released; non-blocking D2H on a side stream for CUDA)
                    -> hand the slot to the persister -> return a SaveHandle
    persister:      encode shards from the slot (no copies; crc32c per inner chunk) -> C thread pool
                    writes them (O_DIRECT, several in flight, fdatasync) -> ranks report their files to
                    the coordinator (small metadata over a gloo group) -> the coordinator commits
                    (documents, directory fsyncs, commit record) -> retention -> slot released

Training may change its tensors as soon as ``save`` returns. Two slots: step t is staged while step t-1
persists; with both busy, ``save`` waits (``when_busy="wait"``) or returns a skipped handle ("skip").

The manager wires these parts together (each its own module of ucl.write):

- ``planning``: which shards this rank writes (:class:`~ucl.write.planning.Planner`)
- ``staging``: the slots and the copy into them (:class:`~ucl.write.staging.Staging`)
- ``kinds``: full, delta or gradient records, and the base of the next delta
  (:class:`~ucl.write.kinds.StepKinds`)
- ``shards``: encoding and writing a job's shards (:class:`~ucl.write.shards.ShardWriter`)
- ``commit``: the commit protocol across ranks (:class:`~ucl.write.commit.StepCommit`)
- ``retention``: keep_last / keep_every (:class:`~ucl.write.retention.Retention`)
- ``collectives``: the private gloo groups (:class:`~ucl.write.collectives.Collectives`)
- ``handle`` and ``job``: the :class:`SaveHandle` a save returns and the job it queues
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from ucl.errors import (
    CheckpointNotFoundError,
    FormatError,
    IntegrityError,
    InvalidArgumentError,
    StepExistsError,
)
from ucl.format import structure
from ucl.format.lock import WriterLock
from ucl.format.metadata import CommitRecord
from ucl.format.repository import Repository, check_step, commit_key, step_prefix
from ucl.layout import as_layout, as_mesh
from ucl.options import DEFAULT_WRITE, WriteOptions
from ucl.plan import save as saveplan
from ucl.read.checkpoint import open as open_step
from ucl.read.load import load, load_plan
from ucl.write import compaction
from ucl.write import rank_state as _rank_state
from ucl.write.collectives import Collectives
from ucl.write.commit import StepCommit
from ucl.write.events import SaveEvents, log
from ucl.write.handle import SaveHandle
from ucl.write.job import Job
from ucl.write.kinds import StepKinds
from ucl.write.peers import SpreadTier, is_document, needed_files
from ucl.write.planning import Planner
from ucl.write.policy import AdaptiveInterval, DeltaPolicy
from ucl.write.retention import Retention
from ucl.write.shards import ShardWriter
from ucl.write.staging import Staging, StagingSlot, footprint
from ucl.write.tiers import ArchiveTier, Drain, MemoryTier, RestoreReport

__all__ = ["CheckpointManager", "SaveHandle"]


class CheckpointManager:
    """Write checkpoints through the engine; list, restore and retain them.

    Parameters
    ----------
    path
        Repository directory or fsspec URL (created if needed).
    keep_last
        Keep the newest ``keep_last`` committed steps (None keeps all).
    keep_every
        Also keep every step divisible by ``keep_every``.
    when_busy
        ``"wait"`` (default): ``save`` blocks until a staging slot is free (backpressure).
        ``"skip"``: ``save`` returns at once with a handle whose ``skipped`` is True.
    staging_bytes
        Upper bound on staging memory (both slots together). Default: two copies of what this rank
        writes. A smaller budget streams the state through the slots: ``save`` then returns once the
        last piece is staged. Each slot must hold the largest single tensor.
    prepare
        When the staging memory is allocated and its pages touched (fresh pages cost several times the
        copy into them; docs/staging.md). ``None`` (default): with ``staging_bytes``, the budget now;
        without, the first save allocates its own slot (and pays for it) and the other slots of that size
        are prepared right after it, unless :meth:`save_if_due` prepared them first (at its first call
        that saves nothing). A state dict (the one ``save`` will be given, its tensors real,
        optimizer state included): slots for it now, as :meth:`prepare`. ``True``: the budget now
        (needs ``staging_bytes``). ``False``: every slot when a save first needs it, paid by that save.
        Whatever is prepared now is touched on a background thread while training runs, never twice.
    writer_threads, direct
        C write pool size and O_DIRECT choice (see ucl.io.native.FileWriter).
    process_group
        A ``torch.distributed`` group for a distributed save (default: the world when initialised);
        the manager makes its own gloo group for coordination so it never interleaves with training's
        collectives.
    no_dist
        True: this process saves alone, as in a world of one, even with torch.distributed initialised
        (as DCP's ``no_dist``): for a state only one rank holds and saves, e.g. what Lightning hands
        its rank 0's CheckpointIO. No collective is ever issued.
    compression
        None (default) or ``"zstd"`` (level 1) for the arrays' shards.
    options
        How steps are laid out and committed (:class:`ucl.options.WriteOptions`: inner chunk size, commit
        concurrency); never the values.
    delta
        None (every step full), True (default :class:`ucl.write.policy.DeltaPolicy`) or a DeltaPolicy:
        steps are then stored as bit-exact deltas against a staged copy of their base (spec/delta.md; the
        last full step by default, the previous step with ``DeltaPolicy(base="previous")``),
        unchanged tensors and inner chunks costing nothing. Uses a third staging slot (the base).
        With ``DeltaPolicy(gradients=True)`` and ``save(..., optimizer=opt)``, a save taken exactly one
        optimizer step after the previous one stores that step's gradients instead of the parameters and
        optimizer state (spec/delta.md §8; readers replay the step, exact when the optimizer fingerprint
        matches); other saves fall back to state deltas. Saves without a layout (one process, or
        data-parallel ranks holding the same state: every rank must agree, else the state is stored).
    interval
        A :class:`ucl.write.policy.AdaptiveInterval` for :meth:`save_if_due`: checkpoint every
        Young/Daly interval, re-estimated from what saves measurably cost training (their blocking time).
    memory
        A :class:`ucl.write.tiers.MemoryTier`: every save commits to that repository (in memory that
        survives the process, e.g. under /dev/shm), and the coordinator drains the steps its policy names
        to ``path`` in the background, verified, committed there with the same commit record. ``keep_last``
        and ``keep_every`` are then ``path``'s retention; the memory tier has its own. :meth:`restore`
        reads the newest step that verifies in either, the memory tier first (docs/tiers.md).
    storage_options
        fsspec options for URLs.
    timeout
        Seconds the manager's collectives wait for the other ranks.
    layout, mesh
        Save under a source layout (spec/layout.md): ``layout`` is a :class:`ucl.layout.Layout`, its text
        or JSON form, or ``"dtensor"`` (derived at each save from the state's DTensor placements with
        :func:`ucl.layout.layout_from_dtensors`; the state's DTensors are saved from their local shards);
        ``mesh`` a :class:`ucl.layout.Mesh`, ``"pp=2 dp=2 tp=4"`` or ``{"tp": 4, ...}`` (default: the
        mesh the layout declares). The mesh must have as many ranks as the process group; this process
        is its rank in the group. Each rank passes its own local state (local layer numbers, flat
        buffers); the ranks' plans are checked together before any byte of the step is written, and the
        step records the layout and mesh. Read it back with ``ucl.open`` (logical tensors) or
        ``ucl.load(path, layout=, mesh=, rank=)`` (any other configuration); :meth:`restore` gives this
        rank's state.

    Notes
    -----
    Usage (every rank)::

        with CheckpointManager(path, keep_last=3) as mgr:
            for step in ...:
                train_step()
                mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
            mgr.wait()                      # optional: close() drains too

    The protocol of one step, and who runs each part. Steps 1-3 run in ``save`` on the caller's thread
    (their collectives, and ``save_if_due``'s broadcast, on the ``_ctl`` group), steps 4-7 on the
    persister thread (its collectives on the ``_dist`` group): one group is never used from two threads,
    so every rank issues each group's collectives in the same order::

        1. plan        every rank       Planner.plan: the shards this rank writes; with a layout the
                                        ranks' plans are allgathered, merged and checked by the
                                        coordinator, the verdict broadcast
        2. agree       every rank       StepKinds.agree (gradient mode): may this save be gradient
                                        records, and is only the gradients' part staged (allgather)
        3. stage       every rank       Staging.acquire + Staging.stage, then the Job is queued;
                                        save returns its SaveHandle
        4. decide      every rank       StepKinds.decide: full, delta or gradients, from committed
                                        history only (the same on every rank)
        5. write       every rank       ShardWriter.write: the shards (and on the coordinator, a full
                                        step's documents), durable before the rank reports them
        6. commit      every rank       StepCommit.run: reports gathered; the coordinator writes the
                                        commit record, renews the lock, applies retention; verdict
                                        broadcast (details: ucl.write.commit)
        7. advance     every rank       StepKinds.advance: the step may become the next delta's base;
                                        the slot is released (or kept as the base), the handle resolved
    """

    def __init__(self, path: Any, *, keep_last: int | None = None, keep_every: int | None = None,
                 when_busy: str = "wait", staging_bytes: int | None = None, writer_threads: int = 4,
                 direct: bool | None = None, process_group: Any = None, no_dist: bool = False,
                 compression: str | None = None, delta: Any = None, interval: AdaptiveInterval | None = None,
                 storage_options: dict[str, Any] | None = None, timeout: float = 600.0,
                 layout: Any = None, mesh: Any = None, options: WriteOptions = DEFAULT_WRITE,
                 prepare: Any = None, memory: MemoryTier | None = None,
                 archive: ArchiveTier | None = None) -> None:
        if memory is not None and not isinstance(memory, MemoryTier):
            raise InvalidArgumentError(f"memory must be a ucl.write.tiers.MemoryTier, got {memory!r}")
        if archive is not None and not isinstance(archive, ArchiveTier):
            raise InvalidArgumentError(f"archive must be a ucl.write.tiers.ArchiveTier, got {archive!r}")
        if when_busy not in ("wait", "skip"):
            raise InvalidArgumentError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        for n, v in (("keep_last", keep_last), ("keep_every", keep_every)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InvalidArgumentError(f"{n} must be a positive int or None, got {v!r}")
        if compression not in (None, "zstd"):
            raise InvalidArgumentError(f"compression must be None or 'zstd', got {compression!r}")
        if delta is True:
            delta = DeltaPolicy()
        if delta is not None and not isinstance(delta, DeltaPolicy):
            raise InvalidArgumentError(f"delta must be None, True or a ucl.write.policy.DeltaPolicy, "
                                       f"got {delta!r}")
        if prepare is True and staging_bytes is None:
            raise InvalidArgumentError("prepare=True prepares the staging_bytes budget: pass staging_bytes=, "
                                       "or prepare=<an example state>")
        if not (prepare is None or isinstance(prepare, (bool, Mapping))):
            raise InvalidArgumentError(f"prepare must be None, a bool or a state dict, "
                                       f"got {type(prepare).__name__}")
        if delta is not None and staging_bytes is not None:
            raise InvalidArgumentError("delta steps need the previous step staged whole: staging_bytes "
                                       "cannot be combined with delta")
        self.delta = delta
        if delta is not None and delta.gradients and layout is not None:
            raise InvalidArgumentError("gradient records (DeltaPolicy(gradients=True)) are written by saves "
                                       "without a layout (one process, or data-parallel ranks holding the "
                                       "same state)")
        if delta is not None and delta.prune is not None and layout is not None:
            raise InvalidArgumentError("composite steps (DeltaPolicy(prune=...)) are written by saves "
                                       "without a "
                                       "layout, in one process")
        if interval is not None and not isinstance(interval, AdaptiveInterval):
            raise InvalidArgumentError(f"interval must be a ucl.write.policy.AdaptiveInterval, "
                                       f"got {interval!r}")
        self.interval = interval
        self.when_busy = when_busy
        self.timeout = timeout
        dtensor = isinstance(layout, str) and layout == "dtensor"
        self.layout: Any = None  # the source layout (ucl.layout.Layout), None without one
        self.mesh: Any = None
        if layout is not None and not dtensor:
            self.layout = as_layout(layout)
        elif layout is None and mesh is not None:
            raise InvalidArgumentError("mesh= needs a layout= to go with it")
        elif dtensor and mesh is not None:
            raise InvalidArgumentError("layout='dtensor' takes its mesh from the DTensors; pass no mesh=")
        if no_dist and process_group is not None:
            raise InvalidArgumentError("no_dist=True saves without any process group: pass no process_group")
        # what every rank refuses alike is checked before any group is made: there, no rank tears down a
        # new group while a peer is still connecting to it (that peer then failed with gloo's
        # "connectFullMesh failed" instead of the error)
        world = 1 if no_dist else Collectives.size(process_group)
        if self.layout is not None:
            self.mesh = as_mesh(mesh, self.layout, world)
        if memory is not None:
            rpn, nodes = memory.node_layout(world)
            if nodes > 1 and delta is not None:
                raise InvalidArgumentError("a memory tier spread over nodes holds full steps: delta= cannot be "
                                           "combined with it (the durable tier's chains would need every "
                                           "node's parts)")
        self._dist = Collectives(None, 0, 1) if no_dist else Collectives.make(process_group, timeout)
        self.rank, self.world = self._dist.rank, self._dist.world
        # a second group for the collectives of the caller's thread (save_if_due, layout plans, gradient
        # records): the persister's commit collectives run concurrently on the first, and two threads must
        # never issue collectives on one group (their order could differ between ranks)
        self._ctl = Collectives.make(process_group, timeout) if self._dist.group is not None else self._dist
        # with a memory tier, saves commit there (self.repo); the drain copies them to `path` (self.durable)
        self.memory = memory
        self.durable: Repository | None = None
        self._durable_lock: WriterLock | None = None
        # with several nodes, each holds a part of the memory tier (ucl.write.peers)
        self._spread: SpreadTier | None = None
        if memory is not None:
            self.durable, self._durable_lock = self._open_repo(path, storage_options)
            try:
                if nodes > 1:
                    self._spread = SpreadTier(memory.part_path(self.rank // rpn), self.rank, self.world, rpn,
                                              memory.peers, self._dist, self._ctl, memory.keep_last)
                    self.repo, self._lock = self._spread.repo, self._spread.lock if self.rank == 0 else None
                else:
                    self.repo, self._lock = self._open_repo(memory.path, None)
            except BaseException:
                if self._durable_lock is not None:
                    self._durable_lock.release()
                self._close_groups()
                raise
        else:
            self.repo, self._lock = self._open_repo(path, storage_options)
        # the archive: due steps of the durable tier copied on, verified, by the coordinator's ucl-archive
        self.archive = archive
        self._archive_repo: Repository | None = None
        self._archive_lock: WriterLock | None = None
        if archive is not None:
            try:
                self._archive_repo, self._archive_lock = self._open_repo(archive.url, archive.storage_options)
            except BaseException:
                for lock in (self._lock, self._durable_lock):
                    if lock is not None:
                        lock.release()
                if self._spread is not None:
                    self._spread.release()
                self._close_groups()
                raise
        self.last_restore: RestoreReport | None = None  # what the last restore() read, and why
        self._events = SaveEvents(self.repo.url, self.rank)  # the log (ucl.write.events)
        codec = {"name": "zstd", "configuration": {"level": 1, "checksum": False}} if compression else None
        self._planner = Planner(self._ctl, self.rank, self.world, codec, self.layout, self.mesh, dtensor,
                                options.inner_chunk_bytes)
        self._staging = Staging(staging_bytes, 3 if delta is not None else 2, eager=prepare is not False,
                                threads=options.staging_threads)
        self._stream_bytes = options.stream_bytes or None
        self._kinds = StepKinds(delta, self._staging, self._ctl, self.rank, self.world, options.inner_chunk_bytes)
        self._shards = ShardWriter(self.repo, self.rank, writer_threads, direct, options.format_version,
                                   gate=self._staging.gate)
        self._drain: Drain | None = None
        self._archiver: Drain | None = None
        if memory is None:
            self._retention = Retention(self.repo, keep_last, keep_every)
        else:
            assert self.durable is not None
            self._retention = Retention(self.durable, keep_last, keep_every)  # the drain applies it
        if archive is not None and self.rank == 0:
            assert self._archive_repo is not None and self._archive_lock is not None
            self._archiver = Drain(self.durable or self.repo, self._archive_repo, self._archive_lock,
                                   Retention(self._archive_repo, archive.keep_last, archive.keep_every),
                                   name="ucl-archive")
            self._retention.protected = self._archiver.pending  # kept on disk until archived
        if memory is not None:
            assert self.durable is not None
            if self.rank == 0 and self._spread is None:
                assert self._durable_lock is not None
                self._drain = Drain(self.repo, self.durable, self._durable_lock, self._retention,
                                    then=self._archive_due)
                newest, durable = self.repo.latest(), self.durable.latest()
                if newest is not None and (durable is None or newest > durable):
                    self._drain.submit(newest, report=False)  # committed before a crash, not drained yet
        drain = self._drain
        # drains the persister started since the loop's last step (under _drain_guard)
        self._drains_started = 0
        self._drain_guard = threading.Lock()
        self._draining = threading.Event()  # spread over nodes: the persister is draining a step
        self._drain_errors: dict[int, BaseException] = {}  # spread over nodes: drains that failed
        fast = None  # the memory tier's retention: never a step still to drain
        if memory is not None:
            fast = Retention(self.repo, memory.keep_last, None, drain.pending if drain is not None else None)
        self._committer = StepCommit(self.repo, self._dist, self._lock, fast or self._retention,
                                     options.commit_threads, options.format_version)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._pending: list[SaveHandle] = []
        self._last_step: int | None = None  # the step of this manager's previous save (steps only increase)
        self._closed = False
        self._thread = threading.Thread(target=self._persist_loop, name="ucl-persist", daemon=True)
        self._thread.start()
        if isinstance(prepare, Mapping) or (prepare is not False and staging_bytes is not None):
            try:
                self.prepare(prepare if isinstance(prepare, Mapping) else None)
            except BaseException:
                self.close()
                raise

    def _open_repo(self, path: Any, storage_options: dict[str, Any] | None) -> tuple[Repository, WriterLock | None]:
        """The repository and (rank 0) its writer lock. Rank 0 also finishes the compactions a crash
        interrupted, before any rank looks at the steps: a step hidden by one is visible again.

        When a rank fails (rank 0: another writer holds the lock, a path it cannot create; another rank:
        no repository where rank 0 made one, e.g. a node-local path), every rank raises that error: the
        others would otherwise wait in a collective for a rank that is gone. On failure the manager's
        groups are closed."""
        lock, failed = None, None
        try:
            if self.rank == 0:
                try:
                    repo = Repository.open(path, storage_options, create=True)
                    lock = WriterLock.acquire(repo)
                    compaction.finish_pending(repo)
                except Exception as e:
                    if lock is not None:
                        lock.release()
                        lock = None
                    failed = e
            self._dist.agree(failed)  # rank 0's failure reaches every rank (a barrier would wait for it)
            if self.rank != 0:
                try:
                    repo = Repository.open(path, storage_options)
                except Exception as e:  # e.g. a node-local path: rank 0 made it on another machine
                    failed = e
            self._dist.agree(failed)
        except BaseException:
            if lock is not None:  # another rank failed
                lock.release()
            self._close_groups()
            raise
        return repo, lock

    # the constructor's settings, read by the parts that use them
    @property
    def keep_last(self) -> int | None:
        """Keep the newest ``keep_last`` committed steps (None keeps all)."""
        return self._retention.keep_last

    @keep_last.setter
    def keep_last(self, value: int | None) -> None:
        self._retention.keep_last = value

    @property
    def keep_every(self) -> int | None:
        """Also keep every step divisible by ``keep_every``."""
        return self._retention.keep_every

    @keep_every.setter
    def keep_every(self, value: int | None) -> None:
        self._retention.keep_every = value

    @property
    def staging_bytes(self) -> int | None:
        """Upper bound on staging memory (None: two copies of what this rank writes)."""
        return self._staging.budget

    @staging_bytes.setter
    def staging_bytes(self, value: int | None) -> None:
        self._staging.budget = value

    @property
    def _slots(self) -> list[StagingSlot]:
        return self._staging.slots

    @property
    def _plans(self) -> dict[Any, saveplan.SavePlan]:
        return self._planner.plans

    # -- saving (the caller's thread) --------------------------------------------------------------
    def prepare(self, state: Mapping[str, Any] | None = None, *, optimizer: Any = None,
                wait: bool = False) -> None:
        """Allocate the staging memory for saves of ``state`` now and touch its pages on a background
        thread, so that no save, the first included, pays for fresh memory (docs/staging.md).

        ``state``: what ``save`` will be given (real tensors; only their shapes and dtypes matter; the
        optimizer's state exists only after its first step: prepare after it). None: the
        ``staging_bytes`` budget. ``optimizer``, with ``DeltaPolicy(gradients=True)``: the optimizer
        ``save`` will be given; its parameters' gradients are staged too. ``wait``: return once every
        page is touched (else at once).

        Every slot (2; 3 with deltas) gets this size. A save that comes before the pages are all
        touched takes its slot as it is: its copy touches the rest itself (the background threads pause
        meanwhile and go on after it), nothing touched twice. A later save of a larger state grows the
        slots (that save allocates its own; the others are replaced in the background); a smaller one
        uses them. Every rank calls it (a layout plans the state together, as ``save`` does).
        """
        if self._closed:
            raise InvalidArgumentError("CheckpointManager is closed")
        if state is None:
            if self._staging.budget is None:
                raise InvalidArgumentError("prepare() without a state prepares the staging_bytes budget: "
                                           "construct the manager with staging_bytes=, or pass a state")
            need = self._staging.slot_bytes(0)
        else:
            tensors, _ = structure.flatten(state)
            if self._planner.dtensor:
                tensors = self._planner.dtensor_locals(tensors)
            plan = self._planner.plan(tensors)  # also the first save's plan, cached
            pieces = self._staging.pieces(plan, tensors)  # a tensor larger than a slot is refused here
            grads = 0
            if optimizer is not None and self.delta is not None and self.delta.gradients:
                grads = footprint({str(i): p for i, p in enumerate(
                    p for g in optimizer.param_groups for p in g["params"])})
            largest = max(footprint({s: tensors[s] for s in p}) for p in pieces)
            need = self._staging.slot_bytes(largest + grads)
        self._staging.prepare(need)
        if wait:
            self._staging.wait_prepared()

    def save(self, step: int, state: Mapping[str, Any], *, optimizer: Any = None,
             rank_state: Any = None) -> SaveHandle:
        """Stage ``state`` and return a handle; the step is written and committed in the background.

        ``optimizer`` (with ``DeltaPolicy(gradients=True)``): the ``torch.optim.Optimizer`` whose
        ``state_dict()`` and parameters (through the model's ``state_dict()``) are in ``state``. When this
        save is exactly one ``optimizer.step()`` after the previous one, with the gradients that step used
        still in ``.grad``, the step stores those gradients instead of the parameters and optimizer state.

        ``rank_state``: this data-parallel rank's own small state (a sampler's or dataloader's
        ``state_dict()``, per-rank RNG states; values of at most 64 KiB each, no large tensors), stored per
        rank in the step (spec/core.md §5.3 item 9) and given back by ``restore(rank_state=True)``. Every
        rank passes one or none does (it is allgathered). docs/state.md.

        Raises
        ------
        InvalidArgumentError
            For a state ucl cannot store (checked before anything is staged), a closed manager, or a
            step not after the previous one.
        """
        if self._closed:
            raise InvalidArgumentError("CheckpointManager is closed")
        self._tick_drains(time.monotonic())  # a save call ends a step of the loop
        return self._save(step, state, optimizer, rank_state)

    def _save(self, step: int, state: Mapping[str, Any], optimizer: Any, rank_state: Any) -> SaveHandle:
        if optimizer is not None and (self.delta is None or not (self.delta.gradients or self.delta.prune)):
            raise InvalidArgumentError("save(optimizer=...) is for gradient records or composite steps: "
                                       "construct the manager with delta=DeltaPolicy(gradients=True) or "
                                       "DeltaPolicy(prune=...)")
        t0 = time.perf_counter()
        check_step(step)
        if step in self._committed_or_pending(step):
            raise StepExistsError(f"step {step} is already committed or being saved in {self.repo.url}; "
                                  "committed steps never change", file=commit_key(step))
        if self._last_step is not None and step < self._last_step:  # the same step again: a retry of a failure
            raise InvalidArgumentError(f"step {step} is not after step {self._last_step}, which this manager saved "
                                       "last: steps only increase (save a later step, or open a new manager)")
        tensors, tree = structure.flatten(state)
        if rank_state is not None:
            tree = _rank_state.attach(tree, rank_state, self._ctl, self.mesh)
        if self._planner.dtensor:
            tensors = self._planner.dtensor_locals(tensors)
        plan = self._planner.plan(tensors)
        grads = None
        if optimizer is not None and self.delta is not None and self.delta.gradients:
            grads = self._kinds.gradients(tensors, optimizer)
        groups = self._kinds.groups(tensors, optimizer)  # composite steps: each tensor's group
        grads, only = self._kinds.agree(grads)
        if self.world == 1:  # files of an earlier attempt that never committed (ranks > 1: `ucl gc`)
            self.repo.store.delete_prefix(step_prefix(step))
        future: Future[CommitRecord | None] = Future()
        handle = SaveHandle(step, future=future)
        pieces = self._staging.pieces(plan, tensors)
        if self.when_busy == "skip" and not self._staging.free_now(len(pieces)):
            return SaveHandle(step, skipped=True)
        self._pending.append(handle)
        grad_job = None
        staged_bytes = 0  # for the log
        # a full step's state goes to the persister in batches as it is copied, so its writes overlap the
        # copy (a delta's base, gradients and composite groups need the whole state staged first)
        batch = self._stream_bytes if self.delta is None and grads is None and groups is None else None
        queued = False  # a piece of this step is on the queue
        for i, piece in enumerate(pieces):
            stage = {s: tensors[s] for s in piece}
            if grads is not None:  # one piece (delta mode stages whole states): the gradients go with it
                if only:
                    replayed = grads[0].replayed
                    stage = {s: t for s, t in stage.items() if s not in replayed}
                stage.update(grads[1])
            slot = None
            in_slot = False  # a batch in this slot is queued: the persister releases it
            try:
                # (inside the try: waiting for a slot can be interrupted, and making one can fail)
                slot = self._staging.acquire(footprint(stage))
                for staged, last in self._staging.stage_batches(slot, stage, batch, whole=len(pieces) == 1):
                    staged_bytes += sum(t.nbytes for t in staged.values())
                    if grads is not None:
                        grad_job = replace(grads[0], staged={n: staged.pop(n) for n in grads[1]}, only=only)
                    # whole: every write of the piece (gradient records leave some sources unstaged)
                    pset = set(piece) if batch is None else set(staged)
                    sub = replace(plan, writes=[w for w in plan.writes if w.source in pset])
                    # the slot goes with the slot's last batch: released after every batch in it is written
                    self._queue.put(Job(step, sub, tree, staged, slot if last else None, future,
                                        last_piece=last and i == len(pieces) - 1, plan_key=id(plan),
                                        grad=grad_job, groups=groups))
                    queued = in_slot = True
            except BaseException as e:
                if not queued:  # nothing queued yet: this save simply fails
                    if slot is not None:
                        self._staging.release(slot)
                    self._pending.remove(handle)
                    raise
                # earlier pieces are queued: fail the step through its last piece, which releases the
                # slot once the batches queued in it are written (they read from it); the caller sees the
                # error raised here, so wait() and close() do not raise it again
                handle.observed = True
                self._queue.put(Job(step, replace(plan, writes=[]), tree, {}, slot if in_slot else None,
                                    future, error=e))
                if not in_slot and slot is not None:
                    self._staging.release(slot)
                raise
        self._kinds.saved(step, optimizer)
        self._last_step = step
        handle.staged_s = time.perf_counter() - t0
        self._events.staged(step, staged_bytes, handle.staged_s)
        return handle

    def save_if_due(self, step: int, state: Mapping[str, Any], now: float | None = None) -> SaveHandle | None:
        """Save when the adaptive interval says so (every rank gets the coordinator's decision).

        Returns the handle, or None when no save is due. Call it once per training step: what each
        save costs training, its blocked time plus how much longer than usual the steps it overlapped
        took (:meth:`ucl.write.policy.AdaptiveInterval.step`), is fed back to the interval once the save
        is done. The first call that saves nothing prepares the staging memory for ``state`` (as
        :meth:`prepare`), unless it is prepared already or the manager was made with ``prepare=False``.
        """
        if self.interval is None:
            raise InvalidArgumentError("save_if_due needs CheckpointManager(interval=AdaptiveInterval(...))")
        due = False
        t = time.monotonic() if now is None else now
        self._tick_drains(t)
        if self.rank == 0:
            # the step that just ended: with a save in flight, its excess over the loop's step time is
            # charged to that save (the writer competes with training for the host)
            self.interval.step(t, busy=any(not h.done() for h in self._pending))
            due = self.interval.should_save(step, t)
        if self._ctl.group is not None:
            due = bool(self._ctl.broadcast(due))
        if not due:
            st = self._staging
            if not self._closed and st.eager and st.target == 0 and not st.slots:
                # nothing prepared or saved yet (no prepare=, no staging_bytes): the state is known now,
                # so its slots are made and touched while training goes on, as prepare(state) would,
                # and the first save does not pay for fresh memory (the same on every rank: the plan
                # may be collective, and `due` is the coordinator's)
                self.prepare(state)
            return None
        if self._closed:
            raise InvalidArgumentError("CheckpointManager is closed")
        handle = self._save(step, state, None, None)  # this step is reported above
        if not handle.skipped and self.rank == 0:
            self.interval.saved(handle.staged_s)
        return handle

    def _tick_drains(self, now: float) -> None:
        """A step of the loop ended (a save or save_if_due call): the memory tier's Young/Daly interval
        learns what its drains cost training, as the save interval does (AdaptiveInterval.step); a drain
        blocks nothing, so its cost is the excess of the steps it overlapped."""
        tier, drain = self.memory, self._drain
        if tier is None or tier.interval is None or self.rank != 0:
            return
        if drain is None and self._spread is None:
            return
        with self._drain_guard:
            started, self._drains_started = self._drains_started, 0
        if started:
            tier.interval.saved(0.0)
        tier.interval.step(now, busy=bool(drain.pending()) if drain is not None else self._draining.is_set())

    def _committed_or_pending(self, step: int) -> set[int]:
        out = {h.step for h in self._pending if not h.done()}
        exists = self.repo.store.exists(commit_key(step))
        if self._spread is not None:  # the nodes' parts may differ (a replaced node's is new): all agree
            exists = self._ctl.any_of([exists])[0]
        if exists:
            out.add(step)
        return out

    # -- persisting (the persister thread) ---------------------------------------------------------
    def _persist_loop(self) -> None:
        collected: dict[int, dict[str, tuple[int, int]]] = {}
        failed: dict[int, BaseException] = {}
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._events.started(job.step)
            keep = False  # in delta mode a committed step's slot becomes the next base
            try:
                if job.error is not None:
                    failed.setdefault(job.step, job.error)
                elif job.step not in failed:
                    self._kinds.decide(job)
                    # to a local disk the staging preparers wait: faulting fresh pages beside the O_DIRECT
                    # writes slowed a process's first save 1.5-2x (docs/staging.md); uploads to an object
                    # store take long enough that the next save would find its slot untouched
                    with self._staging.paused() if self.repo.store.is_local else contextlib.nullcontext():
                        files = self._shards.write(job, self._kinds.base_of(job))
                    collected.setdefault(job.step, {}).update(files)
            except BaseException as e:  # noqa: BLE001 - any failure fails this save's handle
                failed[job.step] = e
                self._kinds.failed()
            finally:
                if job.slot is not None and self.delta is None:
                    self._staging.release(job.slot)
            if not job.last_piece:
                continue
            err = failed.pop(job.step, None)
            files = collected.pop(job.step, {})
            if self._spread is not None:  # the peers' copies, before the step can commit
                try:
                    self._spread.exchange(job.step, files if err is None else {})
                except BaseException as e:  # noqa: BLE001 - the step fails on every rank
                    err = err or e
            try:
                record = self._committer.run(job, files, err, self._kinds.base_of(job))
                tier = self.memory
                if self._drain is not None and tier is not None and tier.due(job.step, time.monotonic()):
                    self._drain.submit(job.step)
                    with self._drain_guard:
                        self._drains_started += 1
                if self._spread is not None:
                    self._spread_commit(job, record, files)
                elif self.memory is None and record is not None:
                    self._archive_due(job.step)
                keep = self._kinds.advance(job)
                self._events.committed(job.step, record, job.kind)
                job.future.set_result(record)
            except BaseException as e:  # noqa: BLE001
                self._kinds.failed()
                self._events.failed(job.step, e)
                job.future.set_exception(e)
            finally:
                if job.slot is not None and self.delta is not None and not keep:
                    self._staging.release(job.slot)

    def _spread_commit(self, job: Job, record: CommitRecord | None, files: Mapping[str, Any]) -> None:
        """Spread over nodes (the persister, every rank): the committed step into every node's part, then
        the drain when due. A failed drain is raised by wait(); the step stays in the memory tier."""
        spread, tier = self._spread, self.memory
        assert spread is not None and tier is not None and self.durable is not None
        if not spread.replicate(job.step, record, lambda: tier.due(job.step, time.monotonic())):
            return
        if self.rank == 0:
            with self._drain_guard:
                self._drains_started += 1
        self._draining.set()
        try:
            inner = {a.key: a.n_inner for a in job.plan.arrays.values()}
            spread.drain(job.step, record, files, inner, self.durable, self._durable_lock, self._retention)
            self._archive_due(job.step)
        except BaseException as e:  # noqa: BLE001 - the memory copy stays; wait() raises it
            log.error("draining step %d to %s failed: %s", job.step, self.durable.url, e)
            self._drain_errors[job.step] = e
        finally:
            self._draining.clear()

    def _archive_due(self, step: int) -> None:
        """``step`` is committed in the durable tier (the coordinator): copy it to the archive if due."""
        if self._archiver is not None and self.archive is not None and self.archive.due(step):
            self._archiver.submit(step)

    # -- retention ---------------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        """Remove a step: its commit record first (the step disappears atomically), then its files."""
        self._retention.delete_step(step)

    # -- reading back ------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The committed steps, oldest first (with a memory tier: those of either tier; spread over
        nodes, every rank calls it: the steps the nodes' parts hold together, and the durable tier's)."""
        if self._spread is not None:
            return self._spread.steps(self._tiers()[1:])
        return sorted({s for _, repo in self._tiers() for s in repo.steps()})

    def latest_step(self) -> int | None:
        """The newest committed step, None when there is none (with a memory tier: of either tier; spread
        over nodes, every rank calls it)."""
        if self._spread is not None:
            steps = self.steps()
            return steps[-1] if steps else None
        found = [s for _, repo in self._tiers() if (s := repo.latest()) is not None]
        return max(found) if found else None

    def _tiers(self) -> list[tuple[str, Repository]]:
        """The tiers restore reads, fastest first."""
        tiers = [("memory", self.repo), ("durable", self.durable)] if self.durable is not None else \
            [("repository" if self._archive_repo is None else "durable", self.repo)]
        if self._archive_repo is not None:
            tiers.append(("archive", self._archive_repo))
        return tiers

    def restore(self, step: int | None = None, *, rank_state: bool = False, handover: Any = None,
                approximate: bool = False) -> Any:
        """The state dict of ``step`` (default: the latest committed), as it was saved.

        With a layout: this rank's local state under the manager's layout and mesh (from a step saved
        under any layout), its tensors at their local names and the step's JSON values kept.

        With a memory tier: the newest step (or ``step``) whose copy loads with every checksum verified,
        the memory tier tried before the durable one; a damaged or missing copy falls back to the next
        (every rank agrees on the copy). ``last_restore`` (a :class:`ucl.write.tiers.RestoreReport`)
        says which tier was read and why. A memory-tier copy newer than the restored step that failed
        verification is removed from the memory tier (the coordinator), so that the step can be saved
        again.

        ``rank_state=True`` returns ``(state, this rank's rank_state)`` (None for a step saved without one),
        handed over by ``handover(old_states, new_world) -> new_states`` (default
        :func:`ucl.write.rank_state.default_handover`) when the data-parallel size changed. docs/state.md.

        ``approximate=True`` also restores a composite step (``DeltaPolicy(prune=...)``, spec/delta.md §9),
        with an ``ApproximateWarning`` naming its stale groups; without it such a step is refused
        (``ApproximateStepError``).
        """
        t0 = time.perf_counter()
        if self.durable is None and self._archive_repo is None:
            repo = self.repo
            step = repo.latest() if step is None else step  # the step the log names (load reads the same)
            out = self._load(repo, step, approximate)
            self.last_restore = RestoreReport(step, "repository", repo.url)
        elif self._spread is not None:
            out, step, repo, self.last_restore = self._spread.restore(
                step, self._tiers()[1:], lambda r, s: self._load(r, s, approximate), self._needed)
        else:
            out, step, repo = self._restore_tiered(step, approximate)
        self._events.restored(step, time.perf_counter() - t0, self.layout)
        if rank_state or handover is not None:
            assert step is not None  # load found no step otherwise
            tree = repo.step_meta(step).tree
            return out, _rank_state.restored(tree, self.rank, self.world, self.mesh, handover)
        return out

    def _load(self, repo: Repository, step: int | None, approximate: bool = False) -> Any:
        if self.layout is not None:
            return load(repo.store, step, layout=self.layout, mesh=self.mesh, rank=self.rank,
                        approximate=approximate)
        return load(repo.store, step, approximate=approximate)

    def _needed(self, step: int) -> set[str]:
        """The files of ``step`` this rank's restore reads: under a layout, the shards its load plan
        touches and the documents; otherwise every file (each rank loads the whole state)."""
        record = self.repo.commit_record(step)
        if self.layout is None:
            return set(record.files)
        with open_step(self.repo.store, step) as ckpt:
            if any(a.delta is not None for a in ckpt.meta.arrays.values()):
                return set(record.files)
            plan = load_plan(ckpt, layout=self.layout, mesh=self.mesh, rank=self.rank)
            return needed_files(ckpt.meta, plan.items) | {r for r in record.files if is_document(r)}

    def _restore_tiered(self, step: int | None, approximate: bool = False) -> tuple[Any, int, Repository]:
        """Try (step, tier) candidates newest first, fastest tier first, until every rank loaded one."""
        tiers = self._tiers()
        candidates: list[tuple[int, int]] = []  # (step, index in tiers)
        if self.rank == 0:
            held = [set(repo.steps()) for _, repo in tiers]
            steps = [step] if step is not None else sorted(set().union(*held), reverse=True)
            candidates = [(s, i) for s in steps for i in range(len(tiers)) if s in held[i]]
        candidates = self._ctl.broadcast(candidates)
        reasons: list[str] = []
        damaged: list[int] = []  # memory-tier steps that failed verification
        for s, i in candidates:
            name, repo = tiers[i]
            out, why, bad = None, None, False
            try:
                out = self._load(repo, s, approximate)
            except (IntegrityError, FormatError, CheckpointNotFoundError) as e:
                why, bad = f"{e.code}: {e}", not isinstance(e, CheckpointNotFoundError)
            verdicts = self._ctl.allgather(why)
            failed = [(r, w) for r, w in enumerate(verdicts) if w is not None]
            if not failed:
                if self.rank == 0:
                    for d in damaged:
                        if d > s:
                            self._delete_damaged(d)
                self.last_restore = RestoreReport(s, name, repo.url, reasons)
                if reasons:
                    log.warning("restored step %d from the %s tier (%s) after: %s", s, name,
                                             repo.url, "; ".join(reasons))
                return out, s, repo
            del out
            reasons.append(f"step {s} in the {name} tier ({repo.url}) failed on rank {failed[0][0]}: "
                           f"{failed[0][1]}")
            if i == 0 and bad and name == "memory":
                damaged.append(s)
        what = f"step {step}" if step is not None else "a committed step"
        raise CheckpointNotFoundError(f"no tier holds {what} that verifies: "
                                      + ("; ".join(reasons) or "every tier is empty"),
                                      file=self.durable.url if self.durable is not None else self.repo.url)

    def _delete_damaged(self, step: int) -> None:
        """Remove a memory-tier copy that failed verification (the coordinator, holding its lock)."""
        log.warning("removing step %d from the memory tier %s: its copy fails verification",
                                 step, self.repo.url)
        Retention(self.repo, None, None).delete_step(step)

    # -- lifecycle ---------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed (with a memory tier: and drained where due); raise the
        first failure the caller has not seen yet (a failure already raised by its handle's ``result()``, or
        by an earlier ``wait``, is handled)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first: BaseException | None = None
        for h in list(self._pending):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            seen = h.observed
            try:
                h.result(left)
            except TimeoutError:
                raise
            except BaseException as e:  # noqa: BLE001
                if not seen:
                    first = first or e
        self._pending = [h for h in self._pending if not h.done()]
        if first is None and self._drain_errors:
            first = self._drain_errors.pop(min(self._drain_errors))
        for drain in (self._drain, self._archiver):  # then the drains those saves started, in order
            if first is None and drain is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                drain.wait(left)
                if drain.errors:
                    first = drain.errors.pop(min(drain.errors))
        if first is not None:
            raise first

    def close(self, timeout: float | None = 60.0) -> None:
        """Drain pending saves (bounded by ``timeout``), stop the threads, release the lock; raise the first
        failure the caller has not seen (as :meth:`wait`)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait(timeout)
        finally:
            self._staging.close(timeout)  # the preparer stops after its current chunk
            self._queue.put(None)
            self._thread.join(timeout)
            self._shards.close(timeout)
            for drain in (self._drain, self._archiver):  # the first may still hand the second a step
                if drain is not None:
                    drain.close(timeout)
            if self._spread is not None:
                self._spread.release()
            for lock in (self._lock, self._durable_lock, self._archive_lock):
                if lock is not None:
                    lock.release()
            self._close_groups()

    def _close_groups(self) -> None:
        if getattr(self, "_ctl", None) is not None and self._ctl is not self._dist:
            self._ctl.close()
        self._dist.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
