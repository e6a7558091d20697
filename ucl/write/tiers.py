"""Tiers: a fast repository in front of the durable one, and the drain that copies committed steps down.

A tier is an ordinary ucl repository (nothing new on disk, spec/core.md §12). With
``CheckpointManager(path, memory=MemoryTier("/dev/shm/job"))`` every save commits to the memory tier;
the coordinator's drain thread then copies the committed steps the policy names down to ``path``:
each file read back from the memory tier and checked against the step's commit record (size, crc32c of
documents, every inner chunk's crc32c and the digest of shards), written, made durable, and committed
with the same record through :class:`~ucl.write.step.StepWriter` (the record last, atomically). A step
is therefore visible in a tier only once complete there, and the memory tier's retention keeps every
step that is due to drain and not drained yet (``Retention(protected=)``): draining never deletes the
only copy.

Call sequence (who calls each): ``Drain.submit(step)`` the coordinator's persister, after each commit
to the memory tier; the drain thread copies; ``Drain.wait()`` / ``Drain.close()`` the manager.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from ucl.errors import CheckpointNotFoundError, InvalidArgumentError, StepExistsError, WriteError
from ucl.format.lock import WriterLock
from ucl.format.repository import Repository, step_prefix
from ucl.io.stores.local import HAS_SYNCFS
from ucl.write.events import log
from ucl.write.policy import AdaptiveInterval
from ucl.write.retention import Retention
from ucl.write.step import StepWriter

__all__ = ["ArchiveTier", "Drain", "MemoryTier", "RestoreReport", "copy_step"]


@dataclass(frozen=True)
class MemoryTier:
    """Where saves commit first: a repository in memory that survives the process (e.g. /dev/shm).

    Parameters
    ----------
    path
        The memory tier's repository directory (created if needed). Every rank of the job must see the
        same directory (one node, or a shared mount).
    keep_last
        Committed steps the memory tier keeps (its own retention; steps not drained yet are kept too).
    drain_every
        Drain every step divisible by ``drain_every`` to the durable repository (1: every step).
    interval
        Instead of ``drain_every``: drain when the Young/Daly interval of this
        :class:`~ucl.write.policy.AdaptiveInterval` has passed since the last drained step. The
        manager measures a drain's cost at each ``save``/``save_if_due`` call (one per training step):
        how much longer than usual the steps it overlapped took (AdaptiveInterval.step).
    ranks_per_node
        Ranks of the job per node (default: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else every rank on
        one node). With several nodes the tier is spread over them (ucl.write.peers): each node's
        ``path`` holds a *part* (its ranks' files, copies of its peers', every step's documents), and a
        ``{node}`` in ``path`` is replaced by the node's number (nodes sharing one filesystem).
    peers
        With several nodes: how many other nodes hold a copy of each node's files (sent rank to rank
        over torch.distributed), i.e. how many nodes may be lost at once without losing a step.
    """

    path: Any
    keep_last: int = 2
    drain_every: int | None = 1
    interval: AdaptiveInterval | None = None
    ranks_per_node: int | None = None
    peers: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or isinstance(self.keep_last, bool) or self.keep_last < 1:
            raise InvalidArgumentError(f"MemoryTier keep_last must be a positive int, got {self.keep_last!r}")
        if self.interval is not None:
            if not isinstance(self.interval, AdaptiveInterval):
                raise InvalidArgumentError("MemoryTier interval must be a ucl.write.policy.AdaptiveInterval, "
                                           f"got {self.interval!r}")
            if self.drain_every not in (None, 1):
                raise InvalidArgumentError("MemoryTier takes drain_every= or interval=, not both")
        elif (not isinstance(self.drain_every, int) or isinstance(self.drain_every, bool)
              or self.drain_every < 1):
            raise InvalidArgumentError(f"MemoryTier drain_every must be a positive int, "
                                       f"got {self.drain_every!r}")
        rpn = self.ranks_per_node
        if rpn is not None and (not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1):
            raise InvalidArgumentError(f"MemoryTier ranks_per_node must be a positive int, got {rpn!r}")
        if not isinstance(self.peers, int) or isinstance(self.peers, bool) or self.peers < 0:
            raise InvalidArgumentError(f"MemoryTier peers must be an int >= 0, got {self.peers!r}")

    def node_layout(self, world: int) -> tuple[int, int]:
        """``(ranks_per_node, nodes)`` for a job of ``world`` ranks."""
        rpn = self.ranks_per_node
        if rpn is None:
            env = os.environ.get("LOCAL_WORLD_SIZE", "")
            rpn = int(env) if env.isdigit() and int(env) > 0 else world
        rpn = min(rpn, world)
        if world % rpn:
            raise InvalidArgumentError(f"MemoryTier ranks_per_node={rpn} does not divide the {world} ranks "
                                       "of the job")
        nodes = world // rpn
        if nodes > 1 and self.peers > nodes - 1:
            raise InvalidArgumentError(f"MemoryTier peers={self.peers}: a job of {nodes} nodes has "
                                       f"{nodes - 1} other node(s) to hold copies")
        return rpn, nodes

    def part_path(self, node: int) -> str:
        """The directory of node ``node``'s part (``{node}`` in ``path`` replaced)."""
        return os.fspath(self.path).replace("{node}", str(node))

    def due(self, step: int, now: float) -> bool:
        """Whether committed ``step`` is to be drained (the interval, when given, is told it was)."""
        if self.interval is not None:
            return self.interval.should_save(step, now)
        assert self.drain_every is not None
        return step % self.drain_every == 0


@dataclass(frozen=True)
class ArchiveTier:
    """A slower tier after the manager's repository (an object store, another filesystem): the steps
    the policy names are copied there from ``path``, verified, by the coordinator's ``ucl-archive``
    thread, each with the same commit record; it has its own retention, and restore reads it last.

    Parameters
    ----------
    url
        The archive repository (a directory or an fsspec URL such as ``s3://bucket/job``; created if
        needed).
    every
        Copy every committed step of ``path`` divisible by ``every``.
    keep_last, keep_every
        The archive's retention (None keeps every step copied there).
    storage_options
        fsspec options of ``url``.
    """

    url: Any
    every: int = 1
    keep_last: int | None = None
    keep_every: int | None = None
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("every", "keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidArgumentError(f"ArchiveTier {name} must be a positive int or None, got {v!r}")

    def due(self, step: int) -> bool:
        """Whether ``step``, committed in the manager's repository, is to be copied here."""
        return step % self.every == 0


@dataclass
class RestoreReport:
    """What :meth:`CheckpointManager.restore` read: the step, the tier and its url, and why (every
    candidate tried before it and the error that ruled it out)."""

    step: int | None
    tier: str | None
    url: str | None
    reasons: list[str] = field(default_factory=list)


def copy_step(src: Repository, dst: Repository, step: int, lock: WriterLock, _depth: int = 0) -> bool:
    """Copy committed ``step`` from ``src`` to ``dst`` verified, and commit it there with the same record.

    A delta step's chain is copied first (parents missing in ``dst``). Returns False when ``dst`` already
    holds the step. Raises the integrity error of a damaged source file; ``dst`` is then left without
    the step (its files of the attempt are removed by the next attempt or ``ucl gc``)."""
    if _depth > 1024:
        raise InvalidArgumentError(f"step {step} of {src.url}: delta chain longer than 1024 steps")
    try:
        dst.commit_record(step)
        return False
    except CheckpointNotFoundError:
        pass
    record = src.commit_record(step)
    meta = src.step_meta(step, record)
    if record.parent is not None:
        copy_step(src, dst, record.parent, lock, _depth + 1)
    writer = StepWriter(dst, step, lock=lock)
    writer.begin()
    inner = {a.key: a.n_inner for a in meta.arrays.values()}
    prefix = step_prefix(step)
    for rel in record.files:
        n_inner = _shard_of(rel, inner)
        data = src.read_verified(step, rel, record, n_inner=n_inner)
        # with syncfs one call below makes every file durable; without it, each file is made durable here
        size, crc = dst.store.write(f"{prefix}/{rel}", [data], durable=not HAS_SYNCFS)
        if size != record.files[rel][0] or (n_inner is None and crc != record.files[rel][1]):
            raise WriteError(f"{dst.url}/{prefix}/{rel}: {size} bytes written differ from the source's",
                             file=f"{prefix}/{rel}")
    if not dst.store.sync_all():  # the directory entries durable before the record
        dirs = {prefix, "steps"} | {f"{prefix}/{os.path.dirname(r)}" for r in record.files if "/" in r}
        for d in sorted(dirs):
            dst.store.sync_dir(d)
    writer.commit(meta, {}, documents=dict(record.files))
    return True


def _shard_of(rel: str, inner: dict[str, int]) -> int | None:
    """The inner chunk count of the array whose shard ``rel`` is (``<key>/c`` for a 0-d array,
    ``<key>/c/<i>/...`` otherwise), None for a document. A key may itself hold a ``c`` segment
    (``model/c/w``), so every ``/c`` boundary is tried against the step's arrays, the last first."""
    if rel.endswith("/c") and rel[:-2] in inner:
        return inner[rel[:-2]]
    i = rel.rfind("/c/")
    while i > 0:
        if rel[:i] in inner:
            return inner[rel[:i]]
        i = rel.rfind("/c/", 0, i)
    return None


class Drain:
    """The coordinator's drain thread: copies committed steps of the memory tier to the durable tier.

    ``pending()`` (the steps submitted and not drained yet) is what the memory tier's retention keeps.
    A failed drain is logged and remembered (``errors``); the step stays in the memory tier until a
    later step is drained (retention then treats it as any older step).
    """

    def __init__(self, src: Repository, dst: Repository, lock: WriterLock, retention: Retention, *,
                 then: Any = None, name: str = "ucl-drain") -> None:
        self.src, self.dst, self.lock, self.retention = src, dst, lock, retention
        self.then = then  # called with each step drained (the next tier's drain may take it on)
        self._queue: queue.Queue[tuple[int, bool] | None] = queue.Queue()
        self._pending: set[int] = set()
        self._guard = threading.Lock()
        self._idle = threading.Condition(self._guard)
        self.errors: dict[int, BaseException] = {}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, step: int, *, report: bool = True) -> None:
        """Drain ``step``; ``report=False`` (a step found undrained when the manager opened, which may
        be the damaged copy a restore is about to pass over): a failure is logged, not raised by wait()."""
        with self._guard:
            self._pending.add(step)
        self._queue.put((step, report))

    def pending(self) -> set[int]:
        with self._guard:
            return set(self._pending)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, report = item
            try:
                if copy_step(self.src, self.dst, step, self.lock):
                    self.lock.renew()
                    self.retention.retain(step)  # the destination's own keep_last / keep_every
                log.info("step %d drained from %s to %s", step, self.src.url, self.dst.url)
                if self.then is not None:
                    self.then(step)
            except StepExistsError:  # committed there by an earlier drain of the same step
                pass
            except BaseException as e:  # noqa: BLE001 - reported by wait(); the memory copy stays
                if report:
                    self.errors[step] = e
                log.error("draining step %d from %s to %s failed: %s", step, self.src.url, self.dst.url, e)
            finally:
                with self._guard:
                    self._pending.discard(step)
                    self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Until every submitted step is drained (or failed)."""
        with self._guard:
            self._idle.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float | None = None) -> None:
        self.wait(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
