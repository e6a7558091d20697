"""A memory tier spread over nodes: each node holds a part of it, and its peers hold copies of its files.

When a job's ranks span several nodes, no one directory is seen by all of them: each node's memory tier
(``MemoryTier(path, ranks_per_node=...)``) is a **part** (spec/core.md §12 items 7-10), a directory
holding for each step the step's documents, the shard files its own ranks wrote, copies of the files of
the ``peers`` nodes before it (sent rank to rank over torch.distributed, never through the coordinator),
and the step's commit record under ``parts/`` instead of ``commits/`` (:class:`PartStore`): a part alone
is not a repository, and a reader that knows nothing of tiers sees no step in it. The tier's copy of a
step is the union of the parts holding its record; it exists while that union holds every file the
record lists, so a step survives the loss of any ``peers`` nodes.

Call sequence (the persister thread of every rank, on the manager's persister group, for each step):

1. ``exchange(step, files)`` after the rank's shards are written, before the commit's report: its files
   to the same local rank of the next ``peers`` nodes; theirs written into this part.
2. ``replicate(step, record, due)`` after the commit (the coordinator wrote the documents and the record
   into its own part): the documents and the record into every other part (by its node's leader, local
   rank 0), each part's retention; returns whether the step drains (the coordinator decides).
3. ``drain(step, record, files, ...)`` when due: every rank copies the files it wrote, verified, to the
   durable repository; the coordinator the documents, then the same commit record.

Restore (the caller's thread, on the manager's control group, every rank): ``holdings()`` allgathered,
``candidates`` (the same list on every rank), then ``assemble(step, ...)``, which moves the files each
node's ranks need and its part lacks from a part that holds them (local rank i to local rank i, in one
global order), after which every rank loads from its own part, every checksum verified.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ucl.errors import CheckpointNotFoundError, StepExistsError, UCLError, WriteError
from ucl.format.lock import WriterLock
from ucl.format.metadata import CommitRecord
from ucl.format.repository import Repository, commit_key, step_prefix
from ucl.io.native import crc32c
from ucl.io.ranges import open_regular
from ucl.io.stores.local import HAS_SYNCFS, LocalStore, fsync_dir
from ucl.write.collectives import Collectives, describe
from ucl.write.events import log
from ucl.write.retention import Retention
from ucl.write.step import FileEntry, StepWriter
from ucl.write.tiers import RestoreReport, _shard_of

__all__ = ["PartStore", "SpreadTier", "is_document", "needed_files"]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class PartStore(LocalStore):
    """A node's part of a memory tier spread over nodes: a local directory whose commit records are kept
    under ``parts/`` (spec/core.md §12 item 8). Everything else is a repository's layout, so the
    manager reads and writes a part as a :class:`~ucl.format.repository.Repository`; a reader given
    the directory itself finds no ``commits/`` and no step."""

    def path(self, key: str) -> str:
        if key == "commits" or key.startswith("commits/"):
            key = "parts" + key[len("commits"):]
        return super().path(key)


def is_document(rel: str) -> bool:
    """Whether a file of a step (path relative to it) is a document: shards end in ``/c`` or ``/c/<i>...``,
    documents in ``zarr.json`` (spec/core.md §4)."""
    return rel == "zarr.json" or rel.endswith("/zarr.json")


def needed_files(meta: Any, items: Iterable[Any]) -> set[str]:
    """The shard files (relative to the step) holding the stored boxes of a load plan's ``items``."""
    out: set[str] = set()
    for it in items:
        a = meta.arrays[it.array]
        start, shape = it.stored_box  # (offset, extent) per dimension
        if not all(shape):
            continue
        ranges = [range(o // c, (o + n - 1) // c + 1)
                  for o, n, c in zip(start, shape, a.chunk_shape, strict=True)]
        out.update(a.shard_key(tuple(coords)) for coords in itertools.product(*ranges))
    return out


class SpreadTier:
    """This rank's view of a memory tier spread over ``nodes`` nodes of ``ranks_per_node`` ranks each.

    Parameters
    ----------
    path
        The part directory of this rank's node.
    rank, world, ranks_per_node, peers
        Ranks in the manager's group; node ``n`` holds ranks ``n*ranks_per_node ...``; each node's
        files are copied to the next ``peers`` nodes.
    dist, ctl
        The persister's and the caller's collectives (``dist`` only on the persister thread).
    keep_last
        The part's retention (the coordinator's part is retained by the commit itself).
    """

    def __init__(self, path: Any, rank: int, world: int, ranks_per_node: int, peers: int,
                 dist_: Collectives, ctl: Collectives, keep_last: int) -> None:
        self.rank, self.world, self.rpn, self.peers = rank, world, ranks_per_node, peers
        self.nodes = world // ranks_per_node
        self.node = rank // ranks_per_node
        self.leader = rank % ranks_per_node == 0
        self.dist, self.ctl = dist_, ctl
        self.lock: WriterLock | None = None  # a leader's, of its part
        failed: Exception | None = None
        if self.leader:
            try:
                self.repo = Repository.open(PartStore(os.fspath(path)), create=True)
                self.repo.store.makedirs("parts")
                self.lock = WriterLock.acquire(self.repo)
            except Exception as e:  # e.g. a part still held by a process of an earlier job
                failed = e
        try:
            ctl.agree(failed)  # a leader's failure reaches every rank (a barrier would wait for it)
            if not self.leader:
                try:
                    self.repo = Repository.open(PartStore(os.fspath(path)))
                except Exception as e:
                    failed = e
            ctl.agree(failed)
        except BaseException:
            self.release()
            raise
        self.retention = Retention(self.repo, keep_last, None)

    @property
    def url(self) -> str:
        return self.repo.url

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _leader_of(self, node: int) -> int:
        return node * self.rpn

    # -- saving (the persister thread) -------------------------------------------------------------
    def exchange(self, step: int, files: Mapping[str, FileEntry]) -> None:
        """Send this rank's ``files`` of ``step`` to the same local rank of the next ``peers`` nodes and
        write theirs into this part (every rank, also with no files: the sends pair up in a ring)."""
        prefix, store = step_prefix(step), self.repo.store
        mine = sorted(files)
        header = json.dumps([[n, int(files[n][0])] for n in mine]).encode()
        for d in range(1, self.peers + 1):
            dst = (self.rank + d * self.rpn) % self.world
            src = (self.rank - d * self.rpn) % self.world
            theirs = [(str(n), int(s)) for n, s in json.loads(_swap(self.dist.group, dst, src, header))]
            _transfer(self.dist.group, store, prefix, dst, [(n, int(files[n][0])) for n in mine], src, theirs)

    def replicate(self, step: int, record: CommitRecord | None, due: Callable[[], bool]) -> bool:
        """After ``step`` committed in the coordinator's part (``record`` there): its documents and record
        into every other node's part (down a tree of the nodes' leaders), then each part's retention.
        Returns ``due()`` as the coordinator answered it (whether the step drains), on every rank."""
        payload: Any = None
        flag = None
        if self.rank == 0:
            assert record is not None
            prefix = step_prefix(step)
            docs = {rel: self.repo.store.read(f"{prefix}/{rel}") for rel in record.files if is_document(rel)}
            payload, flag = (docs, record.to_bytes()), bool(due())
        leaders = [self._leader_of(n) for n in range(1, self.nodes)]
        payload = self.dist.tree_send(payload, leaders)
        if self.leader and self.rank != 0:
            self._write_step(step, *payload)
        if self.leader:
            self._retain(step)
        return bool(self.dist.broadcast(flag))

    def _write_step(self, step: int, docs: Mapping[str, bytes], record: bytes) -> None:
        """A leader: the documents of ``step``, durable, then its commit record (the part holds it)."""
        prefix, store = step_prefix(step), self.repo.store
        for rel, data in docs.items():
            store.write(f"{prefix}/{rel}", [data], durable=not HAS_SYNCFS)
        store.sync_all()
        store.write_atomic(commit_key(step), record)

    def _retain(self, newest: int) -> None:
        """A leader: the part's keep_last, and the files of steps older than ``newest`` never committed
        in it (a failed save's shards and copies)."""
        if self.rank != 0:  # the coordinator's part is retained by the commit
            self.retention.retain(newest)
        held = set(self.repo.steps())
        for name in self.repo.store.list_dir("steps"):
            if name.isdigit() and int(name) < newest and int(name) not in held:
                self.repo.store.delete_prefix(f"steps/{name}")

    def drain(self, step: int, record: CommitRecord | None, files: Mapping[str, FileEntry],
              inner: Mapping[str, int], durable: Repository, lock: WriterLock | None,
              retention: Retention) -> None:
        """Copy committed ``step`` to ``durable`` (every rank): each rank the ``files`` it wrote, read back
        from its part and verified against their entries (those of the record); the coordinator (``record``
        there) the documents and the same record last. Raises WriteError on every rank when any rank failed
        (the memory tier keeps the step)."""
        writer = None
        go: dict[str, Any] | None = None
        if self.rank == 0:
            try:
                writer = StepWriter(durable, step, lock=lock)
                writer.begin()
                go = {"ok": True}
            except StepExistsError:
                go = {"ok": False, "error": None}
            except BaseException as e:  # noqa: BLE001 - every rank learns it
                go = {"ok": False, "error": describe(e)}
        go = self.dist.broadcast(go)
        assert go is not None
        if not go["ok"]:
            if go["error"]:
                raise WriteError(f"draining step {step} to {durable.url} failed: {go['error']}")
            return
        prefix = step_prefix(step)
        err = None
        entries = {k: (v[0], v[1]) for k, v in files.items()}
        mine = CommitRecord(step=step, kind="full", parent=None, files=entries)  # this rank's own files
        try:
            for rel in sorted(files):
                data = self.repo.read_verified(step, rel, mine, n_inner=_shard_of(rel, dict(inner)))
                size, _ = durable.store.write(f"{prefix}/{rel}", [data], durable=not HAS_SYNCFS)
                if size != files[rel][0]:
                    raise WriteError(f"{durable.url}/{prefix}/{rel}: {size} bytes written, the record says "
                                     f"{files[rel][0]}", file=f"{prefix}/{rel}")
            _sync(durable, prefix, files)
        except BaseException as e:  # noqa: BLE001
            err = describe(e)
        errors = self.dist.gather(err)
        verdict: dict[str, Any] | None = None
        if self.rank == 0:
            assert writer is not None and record is not None
            bad = [e for e in errors if e]
            if bad:
                verdict = {"ok": False, "error": bad[0]}
                writer.release()
            else:
                try:
                    docs = [rel for rel in record.files if is_document(rel)]
                    for rel in docs:
                        data = self.repo.read_verified(step, rel, record)
                        durable.store.write(f"{prefix}/{rel}", [data], durable=not HAS_SYNCFS)
                    _sync(durable, prefix, docs)
                    writer.commit(self.repo.step_meta(step, record), {}, documents=dict(record.files))
                    if lock is not None:
                        lock.renew()
                    retention.retain(step)
                    verdict = {"ok": True}
                except BaseException as e:  # noqa: BLE001
                    verdict = {"ok": False, "error": describe(e)}
        verdict = self.dist.broadcast(verdict)
        assert verdict is not None
        if not verdict["ok"]:
            raise WriteError(f"draining step {step} to {durable.url} failed: {verdict['error']}")
        log.info("step %d drained from the memory tier's parts to %s", step, durable.url)

    # -- restoring (the caller's thread, every rank) -------------------------------------------------
    def _records(self) -> dict[int, bytes]:
        """A leader: the commit records its part holds that verify (step -> bytes)."""
        out: dict[int, bytes] = {}
        for st in self.repo.steps():
            try:
                raw = self.repo.store.read(commit_key(st))
                CommitRecord.from_bytes(raw, f"{self.url}/{commit_key(st)}", st)
            except (FileNotFoundError, UCLError) as e:
                log.warning("the memory tier's part %s: the record of step %d is passed over: %s",
                            self.url, st, e)
                continue
            out[st] = raw
        return out

    def gather_holdings(self) -> dict[int, dict[int, tuple[CommitRecord, set[str]]]]:
        """Every node's holdings (node -> step -> (record, files held)), on every rank (collective).

        Sized for thousands of ranks (an allgather pads every rank's object to the largest one's size):
        the leaders send each record's crc32c; each step's record travels once, from the first node holding
        it (a part whose record differs from that one is taken not to hold the step); then each part's
        files as a bitmap over the record's sorted files."""
        records = self._records() if self.leader else {}
        crcs = self.ctl.allgather({st: _crc(raw) for st, raw in records.items()} if self.leader else None)
        first: dict[int, tuple[int, int]] = {}  # step -> (node, crc) of the first node holding it
        for r, held in enumerate(crcs):
            for st, c in (held or {}).items():
                first.setdefault(st, (r // self.rpn, c))
        recs: dict[int, CommitRecord] = {}
        for st, (node, _) in sorted(first.items()):
            raw = self.ctl.broadcast_from(records.get(st) if self.node == node and self.leader else None,
                                          self._leader_of(node))
            try:
                recs[st] = CommitRecord.from_bytes(raw, f"node {node}: {commit_key(st)}", st)
            except UCLError:
                continue
        universe = {st: sorted(rec.files) for st, rec in recs.items()}
        bits = None
        if self.leader:
            bits = {}
            for st, raw in records.items():
                if st in recs and _crc(raw) == first[st][1]:
                    prefix = step_prefix(st) + "/"
                    names = {f.key[len(prefix):] for f in self.repo.store.walk(step_prefix(st))}
                    bits[st] = _bitmap(names, universe[st])
        parts: dict[int, dict[int, tuple[CommitRecord, set[str]]]] = {}
        for r, held in enumerate(self.ctl.allgather(bits)):
            if held is not None:
                parts[r // self.rpn] = {st: (recs[st], _members(b, universe[st])) for st, b in held.items()}
        return parts

    @staticmethod
    def covered(parts: Mapping[int, Mapping[int, tuple[CommitRecord, set[str]]]], step: int) -> bool:
        """Whether the parts holding ``step``'s record together hold every file it lists."""
        holders = [p[step] for p in parts.values() if step in p]
        if not holders:
            return False
        union = set().union(*(files for _, files in holders))
        return all(set(rec.files) <= union for rec, _ in holders[:1])

    def assemble(self, step: int, parts: Mapping[int, Mapping[int, tuple[CommitRecord, set[str]]]],
                 need: Callable[[], set[str]]) -> int:
        """Make this node's part hold every file of ``step`` that any of its ranks reads (``need()``,
        called once the documents are here), moving what it lacks from the parts that hold it. Collective
        on the control group; returns the number of files moved between nodes (the same on every rank)."""
        rec = next(p[step][0] for _, p in sorted(parts.items()) if step in p)
        held = {n: set(parts[n][step][1]) if n in parts and step in parts[n] else set()
                for n in range(self.nodes)}
        docs = {rel for rel in rec.files if is_document(rel)}
        moved = self._move(step, rec, {n: docs for n in range(self.nodes)}, held)
        err: BaseException | None = None
        mine: set[str] = set()
        try:
            if self.leader and step not in parts.get(self.node, {}):  # absent, or not the tier's record
                self.repo.store.write_atomic(commit_key(step), rec.to_bytes())
        except BaseException as e:  # noqa: BLE001 - raised after the collectives
            err = e
        self.ctl.barrier()  # the documents and the record are in every part
        if err is None:
            try:
                mine = need()
            except BaseException as e:  # noqa: BLE001
                err, mine = e, set(rec.files)
        wants: dict[int, set[str]] = {n: set() for n in range(self.nodes)}
        universe = sorted(rec.files)
        for r, b in enumerate(self.ctl.allgather(_bitmap(mine, universe))):  # a bit per file: small at scale
            wants[r // self.rpn].update(_members(b, universe))
        moved += self._move(step, rec, wants, held)
        self.ctl.barrier()
        if err is not None:
            raise err
        return moved

    def _move(self, step: int, rec: CommitRecord, wants: Mapping[int, set[str]], held: dict[int, set[str]]
              ) -> int:
        """Move to each node the files it ``wants`` and does not hold, each from the nearest node after
        it that holds it; updates ``held``. The files of a pair of nodes are shared out among their local
        ranks (local rank i of one to local rank i of the other, balanced by bytes), so a node's ranks move
        them in parallel. The same plan on every rank, each rank's transfers done in one global order,
        which cannot deadlock (the first unfinished transfer's two ranks have finished every earlier one)."""
        plan: dict[tuple[int, int], list[str]] = {}
        for dst in range(self.nodes):
            for rel in sorted(wants[dst] - held[dst]):
                if rel not in rec.files:
                    continue
                src = next((m for k in range(1, self.nodes)
                            if rel in held[m := (dst + k) % self.nodes]), None)
                if src is not None:
                    plan.setdefault((src, dst), []).append(rel)
        prefix, store = step_prefix(step), self.repo.store
        group = self.ctl.group
        moved = 0
        local = self.rank % self.rpn
        for (src, dst), names in sorted(plan.items()):
            moved += len(names)
            held[dst].update(names)
            shares: list[list[tuple[str, int]]] = [[] for _ in range(self.rpn)]
            load = [0] * self.rpn
            for n in sorted(names, key=lambda n: (-rec.files[n][0], n)):  # largest first, to the least loaded
                i = load.index(min(load))
                shares[i].append((n, rec.files[n][0]))
                load[i] += rec.files[n][0]
            mine = sorted(shares[local])
            if self.node == src and mine:
                _transfer(group, store, prefix, self._leader_of(dst) + local, mine, None, [])
            elif self.node == dst and mine:
                _transfer(group, store, prefix, None, [], self._leader_of(src) + local, mine)
        return moved

    def steps(self, others: list[tuple[str, Repository]]) -> list[int]:
        """The steps the parts hold together and the slower tiers' (``others``), oldest first
        (collective)."""
        parts = self.gather_holdings()
        held = self.ctl.broadcast([r.steps() for _, r in others] if self.rank == 0 else None)
        return sorted({s for p in parts.values() for s in p if self.covered(parts, s)}.union(*held))

    def restore(self, step: int | None, others: list[tuple[str, Repository]],
                load: Callable[[Repository, int], Any], needed: Callable[[int], set[str]]
                ) -> tuple[Any, int, Repository, RestoreReport]:
        """A tiered restore (spec/core.md §12 item 5; collective): the newest step (or ``step``) the
        parts hold together, then the slower tiers' (``others``: (name, repository), fastest first);
        a memory candidate assembled in this node's part (:meth:`assemble`); each loaded with every
        check, a failure on any rank passing to the next candidate. Returns ``(state, step, repository
        read, report)``; the report's tier is "memory" when no file moved between nodes, "peer" when
        some did, else the slower tier's name."""
        parts = self.gather_holdings()
        listed = self.ctl.broadcast([r.steps() for _, r in others] if self.rank == 0 else None)
        held = [set(h) for h in listed]
        spread = {s for p in parts.values() for s in p}
        memory = {s for s in spread if self.covered(parts, s)}
        reasons = [f"step {s} in the memory tier: the parts that hold its record lack some of its files "
                   "(more nodes lost than peers hold copies)" for s in sorted(spread - memory, reverse=True)
                   if step is None or s == step]
        steps = [step] if step is not None else sorted(memory.union(*held), reverse=True)
        tiers = [("memory", self.repo, memory)] + [(n, r, h) for (n, r), h in zip(others, held, strict=True)]
        candidates = [(s, t, repo) for s in steps for t, repo, has in tiers if s in has]
        for s, t, repo in candidates:
            out, why, moved = None, None, 0
            try:
                if t == "memory":
                    moved = self.assemble(s, parts, lambda s=s: needed(s))  # type: ignore[misc]
                out = load(repo, s)
            except UCLError as e:
                why = f"{e.code}: {e}"
            failed = [(r, w) for r, w in enumerate(self.ctl.allgather(why)) if w is not None]
            if not failed:
                if step is None:
                    self.drop_newer(s)
                name = "peer" if moved else t
                if reasons:
                    log.warning("restored step %d from the %s tier (%s) after: %s", s, name, repo.url,
                                "; ".join(reasons))
                return out, s, repo, RestoreReport(s, name, repo.url, reasons)
            del out
            reasons.append(f"step {s} in the {t} tier ({repo.url}) failed on rank {failed[0][0]}: "
                           f"{failed[0][1]}")
        what = f"step {step}" if step is not None else "a committed step"
        raise CheckpointNotFoundError(f"no tier holds {what} that verifies: "
                                      + ("; ".join(reasons) or "every tier is empty"), file=self.url)

    def drop_newer(self, step: int) -> None:
        """A leader, after a restore of ``step``: remove from its part every step newer than it (copies
        that failed verification or that the parts no longer cover), so that those steps can be saved
        again (spec/core.md §12 item 6)."""
        if not self.leader:
            return
        newer = sorted(s for s in self.repo.steps() if s > step)
        if newer:
            log.warning("removing step(s) %s from the memory tier's part %s: newer than the step restored, "
                        "and not restorable", ", ".join(map(str, newer)), self.url)
            Retention(self.repo, None, None).delete_steps(newer)


def _crc(data: bytes) -> int:
    return int(crc32c(data))


def _bitmap(names: set[str], universe: list[str]) -> bytes:
    """The members of ``universe`` (sorted) in ``names``, one bit each."""
    out = bytearray((len(universe) + 7) // 8)
    for i, n in enumerate(universe):
        if n in names:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def _members(bits: bytes, universe: list[str]) -> set[str]:
    return {n for i, n in enumerate(universe) if bits[i >> 3] >> (i & 7) & 1}


def _transfer(group: Any, store: Any, prefix: str, dst: int | None, send: list[tuple[str, int]],
              src: int | None, recv: list[tuple[str, int]]) -> None:
    """Send the files ``send`` ((name, size), under ``prefix``) to rank ``dst`` and receive ``recv`` from
    rank ``src`` into this part: one message per file, straight from and into the files' pages (mapped),
    so that no copy is made in this process. A received file appears whole (written under a temporary
    name, renamed once complete: a part's holdings count only whole files), then durable."""
    tensors: list[torch.Tensor] = []
    maps: list[mmap.mmap] = []
    done: list[tuple[str, str]] = []
    try:
        reqs = []
        for i, (n, size) in enumerate(send):
            if size:
                buf = _source(store, f"{prefix}/{n}", size, maps)
                tensors.append(torch.frombuffer(buf, dtype=torch.uint8))
                reqs.append(dist.isend(tensors[-1], group=group, group_dst=dst, tag=i))
        for i, (n, size) in enumerate(recv):
            path = store.write_path(f"{prefix}/{n}")
            tmp = f"{path}.peer-{os.getpid()}"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                os.ftruncate(fd, size)
                if size:  # its pages made at once (populate), not one fault at a time in the receive
                    maps.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE))
            finally:
                os.close(fd)
            done.append((tmp, path))
            if size:
                tensors.append(torch.frombuffer(maps[-1], dtype=torch.uint8))
                reqs.append(dist.irecv(tensors[-1], group=group, group_src=src, tag=i))
        for r in reqs:
            r.wait()  # type: ignore[union-attr]
    finally:
        del tensors[:]  # the buffers' exports, before their maps close
        for m in maps:
            m.close()
    for tmp, path in done:
        os.replace(tmp, path)
    if done and not store.sync_all():
        for d in sorted({os.path.dirname(p) for _, p in done}):
            fsync_dir(d)


def _source(store: Any, key: str, size: int, maps: list[mmap.mmap]) -> Any:
    """``size`` bytes of a file to send, mapped (copy on write: a writable buffer, no copy made); a missing
    or short file is sent as zeros of its size (the message sizes come from the record; the receiver's
    verified load rejects what arrives)."""
    try:
        fd, st = open_regular(store.local_path(key), name=key)
    except (OSError, UCLError):
        return bytearray(size)
    try:
        if st.st_size < size:
            return bytearray(size)
        maps.append(mmap.mmap(fd, size, access=mmap.ACCESS_COPY))
        return maps[-1]
    finally:
        os.close(fd)


def _swap(group: Any, dst: int, src: int, data: bytes) -> bytearray:
    """Send ``data`` (a small header) to ``dst`` and receive what ``src`` sends (its length first)."""
    n = torch.tensor([len(data)], dtype=torch.int64)
    m = torch.empty(1, dtype=torch.int64)
    reqs = [dist.isend(n, group=group, group_dst=dst), dist.irecv(m, group=group, group_src=src)]
    for r in reqs:
        r.wait()  # type: ignore[union-attr]
    return _sendrecv(group, dst, data, src, int(m.item()))


def _sendrecv(group: Any, dst: int, data: bytes, src: int, size: int) -> bytearray:
    """Post a send of ``data`` to ``dst`` and a receive of ``size`` bytes from ``src``, then wait for both."""
    reqs = []
    if data:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        reqs.append(dist.isend(buf, group=group, group_dst=dst))
    out = bytearray(size)
    if size:
        reqs.append(dist.irecv(torch.frombuffer(out, dtype=torch.uint8), group=group, group_src=src))
    for r in reqs:
        r.wait()  # type: ignore[union-attr]
    return out


def _sync(repo: Repository, prefix: str, files: Iterable[str]) -> None:
    """Make the files just written under ``prefix`` durable (one syncfs, else their directories)."""
    if not repo.store.sync_all():
        dirs = {prefix, "steps"} | {f"{prefix}/{os.path.dirname(r)}" for r in files if "/" in r}
        for d in sorted(dirs):
            repo.store.sync_dir(d)
