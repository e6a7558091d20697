"""Staging memory: the slots a save copies the state into, so training may change it as soon as save returns.

Two slots (three with deltas: the third holds the staged base of the next delta): step t is staged while
step t-1 persists. A slot is allocated once (pinned when CUDA is available), pre-touched and reused; the
caller thread acquires one (waiting while all are busy: backpressure) and the persister releases it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from ucl.errors import InvalidArgumentError
from ucl.plan import save as saveplan

ALIGN = 4096


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN` (each staged tensor starts aligned)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def footprint(tensors: dict[str, torch.Tensor]) -> int:
    """The slot bytes :meth:`Staging.stage` uses for ``tensors``."""
    return sum(aligned(t.numel() * t.element_size()) for t in tensors.values())


class StagingSlot:
    """One staging buffer: allocated once (pinned when the state is on CUDA), pre-touched, reused.

    Parameters
    ----------
    nbytes
        Its size.
    pin
        Allocate pinned memory (device-to-host copies then run asynchronously).
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self.arena = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        self.arena.zero_()  # touch every page now, not during a save (fresh pages are slow here)
        self.pin = pin
        self.busy = False

    def view(self, offset: int, t: torch.Tensor) -> torch.Tensor:
        """The slot's bytes from ``offset`` as a tensor of ``t``'s dtype and shape."""
        n = t.numel() * t.element_size()
        return self.arena[offset : offset + n].view(t.dtype).view(t.shape)


class Staging:
    """The staging slots of one manager and the copy into them.

    :meth:`acquire` and :meth:`stage` run on the caller's thread, :meth:`release` on the persister's
    (or the caller's, when staging fails).

    Parameters
    ----------
    budget
        Upper bound on staging memory (every slot together), None for two copies of what this rank
        writes. With a budget every slot is exactly half of it and a larger state streams through the
        slots in pieces.
    max_slots
        How many slots there may be (2; 3 with deltas).
    """

    def __init__(self, budget: int | None, max_slots: int) -> None:
        self.budget = budget
        self.max_slots = max_slots
        self.slots: list[StagingSlot] = []
        self._free = threading.Condition()
        self._cuda_stream: Any = None

    def pieces(self, plan: saveplan.SavePlan, tensors: dict[str, torch.Tensor]) -> list[list[str]]:
        """The tensors this rank writes, in groups that each fit one slot (one group without a budget)."""
        wanted = plan.sources  # a set built once (a property: not per tensor)
        sources = [s for s in tensors if s in wanted]
        sizes = {s: aligned(tensors[s].numel() * tensors[s].element_size()) for s in sources}
        total = sum(sizes.values())
        if self.budget is None:
            return [sources]
        slot_bytes = self.budget // 2
        if sizes and max(sizes.values()) > slot_bytes:
            big = max(sizes, key=sizes.__getitem__)
            raise InvalidArgumentError(f"staging_bytes={self.budget} gives slots of {slot_bytes} bytes, "
                                       f"smaller than tensor {big!r} ({sizes[big]} bytes)", tensor=big)
        if total <= slot_bytes:
            return [sources]
        pieces: list[list[str]] = [[]]
        used = 0
        for s in sources:
            if used + sizes[s] > slot_bytes:
                pieces.append([])
                used = 0
            pieces[-1].append(s)
            used += sizes[s]
        return pieces

    def free_now(self, pieces: int) -> bool:
        """Whether a save of ``pieces`` pieces could start staging without waiting (``when_busy="skip"``)."""
        with self._free:
            return pieces == 1 and (len(self.slots) < self.max_slots or any(not s.busy for s in self.slots))

    def acquire(self, need: int) -> StagingSlot:
        """A free slot of at least ``need`` bytes, marked busy; waits while every slot is busy."""
        # pieces are sized in aligned bytes; with a budget every slot is exactly half of it
        need = self.budget // 2 if self.budget is not None else aligned(need) + ALIGN * 64
        with self._free:
            while True:
                free = [s for s in self.slots if not s.busy]
                fit = [s for s in free if s.nbytes >= need]
                if fit:
                    slot = fit[0]
                    break
                if len(self.slots) < self.max_slots:
                    slot = StagingSlot(need, pin=self._pin())
                    self.slots.append(slot)
                    break
                if free:  # the state grew: replace a free slot
                    self.slots.remove(free[0])
                    slot = StagingSlot(need, pin=self._pin())
                    self.slots.append(slot)
                    break
                self._free.wait()
            slot.busy = True
            return slot

    def release(self, slot: StagingSlot) -> None:
        """Mark ``slot`` free and wake a waiting :meth:`acquire`."""
        with self._free:
            slot.busy = False
            self._free.notify_all()

    def _pin(self) -> bool:
        return torch.cuda.is_available()

    def stage(self, slot: StagingSlot, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into ``slot`` (each at an aligned offset); returns their staged copies.

        CUDA tensors are copied on a side stream that first waits for the current one; this returns once
        the device-to-host copy is done, so training may change the tensors right away.
        """
        staged: dict[str, torch.Tensor] = {}
        offset = 0
        cuda = any(t.is_cuda for t in tensors.values())
        if cuda and self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream()
        ctx = torch.cuda.stream(self._cuda_stream) if cuda else contextlib.nullcontext()
        if cuda:
            self._cuda_stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), ctx:
            for name, t in tensors.items():
                dst = slot.view(offset, t)
                dst.copy_(t.detach(), non_blocking=t.is_cuda)
                staged[name] = dst
                offset += aligned(t.numel() * t.element_size())
        if cuda:
            self._cuda_stream.synchronize()  # training waits only for the device-to-host copy
        return staged
