"""The manager's collectives: a private gloo group carrying small Python objects, and errors as plain data.

The manager makes two of these groups (``CheckpointManager._dist`` for the persister thread's commit
protocol, ``CheckpointManager._ctl`` for the caller thread's save-time agreement), because two threads
must never issue collectives on one group: their order could differ between ranks. An error crosses a
group as a dict (:func:`error_dict`) and is rebuilt as the same UCLError class on every rank
(:func:`error_from`).
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import traceback
from typing import Any

import torch
import torch.distributed as dist

from ucl.errors import ALL_CODES, UCLError


class Collectives:
    """Coordination over torch.distributed: a private gloo group, small Python objects only.

    Without an initialised world (or with the default group of a world of one) there is no group and
    every collective returns its own argument, so one-process saves take the same code path.

    Parameters
    ----------
    group
        The gloo group, or None for a single process.
    rank, world
        This process's rank in ``group`` and its size (0 and 1 without a group).
    """

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    @staticmethod
    def size(process_group: Any) -> int:
        """The world of the group :meth:`make` would make, without making it (no collective)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return int(dist.get_world_size(process_group))

    @classmethod
    def make(cls, process_group: Any, timeout: float) -> Collectives:
        """A new gloo group over the ranks of ``process_group`` (default: the world), or none.

        Every rank of the group must call it, in the same order as every other ``new_group``.
        """
        if not (dist.is_available() and dist.is_initialized()) or (
                process_group is None and dist.get_world_size() == 1):
            return cls(None, 0, 1)
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on the coordinator (rank 0), in rank order; an empty list elsewhere."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world if self.rank == 0 else []
        dist.gather_object(obj, out if self.rank == 0 else None, dst=dist.get_global_rank(self.group, 0),
                           group=self.group)
        return out

    def collect(self, obj: Any, senders: list[int]) -> list[Any]:
        """The ``obj`` of each rank in ``senders`` (not the coordinator) on the coordinator, in that
        order; an empty list elsewhere. Point to point: the other ranks send nothing, where
        ``gather_object`` pads every rank's object to the largest one's size (a few large objects among
        many ranks would cost the coordinator world x largest bytes)."""
        if self.group is None or not senders:
            return []
        if self.rank == 0:
            out = []
            for r in senders:
                size = torch.empty(1, dtype=torch.int64)
                dist.recv(size, group=self.group, group_src=r)
                data = torch.empty(int(size.item()), dtype=torch.uint8)
                dist.recv(data, group=self.group, group_src=r)
                out.append(pickle.loads(data.numpy().tobytes()))
            return out
        if self.rank in senders:
            blob = pickle.dumps(obj)
            dist.send(torch.tensor([len(blob)], dtype=torch.int64), group=self.group, group_dst=0)
            dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), group=self.group, group_dst=0)
        return []

    def tree_send(self, obj: Any, receivers: list[int]) -> Any:
        """The coordinator's ``obj`` on each rank in ``receivers`` (not the coordinator), passed down a
        binary tree of them (the coordinator its root): each receiver gets it once and sends it on at
        most twice, so no rank sends ``len(receivers)`` copies. The coordinator and the receivers return
        it, every other rank None."""
        if self.group is None:
            return obj
        order = [0] + [r for r in receivers if r != 0]
        if self.rank not in order:
            return None
        at = order.index(self.rank)
        if at == 0:
            blob = pickle.dumps(obj)
        else:
            size = torch.empty(1, dtype=torch.int64)
            parent = order[(at - 1) // 2]
            dist.recv(size, group=self.group, group_src=parent)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(data, group=self.group, group_src=parent)
            blob = data.numpy().tobytes()
            obj = pickle.loads(blob)
        for child in (2 * at + 1, 2 * at + 2):
            if child < len(order):
                dst = order[child]
                dist.send(torch.tensor([len(blob)], dtype=torch.int64), group=self.group, group_dst=dst)
                data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                dist.send(data, group=self.group, group_dst=dst)
        return obj

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank, in rank order."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def any_of(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether it is set on any rank (one allreduce of len(flags) integers)."""
        if self.group is None:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank (the other ranks' argument is ignored)."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def broadcast_from(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank (the other ranks' argument is ignored)."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        return box[0]

    def agree(self, failed: BaseException | None) -> None:
        """A barrier that carries failures: once every rank is here, every rank raises the error of the
        first rank (in rank order) that failed (a failing rank its own exception), or none returns an
        error. Where some ranks act alone (rank 0 takes a lock), the others would otherwise wait in the
        next collective for a rank that has raised."""
        if self.group is None:
            if failed is not None:
                raise failed
            return
        errors = self.allgather(None if failed is None else error_dict(failed, self.rank))
        if failed is not None:
            raise failed
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise error_from(first)

    def barrier(self) -> None:
        """Wait until every rank of the group is here."""
        if self.group is not None:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Destroy the group (idempotent)."""
        if self.group is not None:
            with contextlib.suppress(Exception):  # the world may already be gone
                dist.destroy_process_group(self.group)
            self.group = None


def error_dict(e: BaseException, rank: int | None) -> dict[str, Any]:
    """``e`` as plain data for a collective; ``rank`` (if given) prefixes its message."""
    where = f"rank {rank}: " if rank is not None else ""
    if isinstance(e, UCLError):
        return {"code": e.code, "message": where + e.message, "tensor": e.tensor}
    return {"code": "invalid_argument", "message": where + describe(e), "tensor": None}


def error_from(d: dict[str, Any]) -> UCLError:
    """The UCLError an :func:`error_dict` describes (its class found by code)."""
    cls = ALL_CODES.get(d["code"], UCLError)
    return cls(d["message"], tensor=d.get("tensor"))


def describe(e: BaseException) -> str:
    """One line naming ``e``: ``[code] message`` for a UCLError, else its type and message."""
    if isinstance(e, UCLError):
        return f"[{e.code}] {e.message}"
    return "".join(traceback.format_exception_only(type(e), e)).strip()
