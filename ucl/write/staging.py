"""Staging memory: the slots a save copies the state into, so training may change it as soon as save returns.

Two slots (three with deltas: the third holds the staged base of the next delta): step t is staged while
step t-1 persists. A slot is allocated once (pinned when CUDA is available) and reused; the caller thread
acquires one (waiting while all are busy: backpressure) and the persister releases it.

Fresh pages cost several times the copy into them (here, a virtual machine whose free pages go back to
the host: ~0.3 s per GB to fault in, against ~0.1 s per GB for the copy), so a save must not be the one
that touches them. :meth:`Staging.prepare` makes the slots of a known size at once and touches their
pages on a background thread (``ucl-staging``), while training runs. The preparer works on a slot from
its top down; a save that comes first copies from the bottom up and faults what it reaches itself while
the preparers pause (three threads faulting pages on two cores were slower than the copy alone), then
they go on from the top: nothing is touched twice. Pinned memory (``cudaHostAlloc``) is populated when
it is allocated: there the allocation itself is what the preparer does, and a save needing that slot
waits for it to finish.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ucl.errors import InvalidArgumentError
from ucl.plan import save as saveplan

ALIGN = 4096
SLACK = ALIGN * 64  # a slot sized for a state holds a little more: small changes of shape fit
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in, writable, without changing their content


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN` (each staged tensor starts aligned)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def footprint(tensors: dict[str, torch.Tensor]) -> int:
    """The slot bytes :meth:`Staging.stage` uses for ``tensors``."""
    return sum(aligned(t.numel() * t.element_size()) for t in tensors.values())


class _Pages:
    """Touching pages: MADV_POPULATE_WRITE where the kernel has it (never changes content), else zeros."""

    libc: Any = None  # None: not tried yet; False: unavailable

    @classmethod
    def populate(cls, address: int, nbytes: int) -> bool:
        """Fault in ``nbytes`` from page-aligned ``address``; False when the kernel cannot (then write
        zeros). Other failures (no memory left) raise OSError: the pages are then left to the copy."""
        if cls.libc is None:
            cls.libc = False
            if sys.platform.startswith("linux"):
                with contextlib.suppress(OSError, AttributeError):
                    libc = ctypes.CDLL(None, use_errno=True)
                    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                    cls.libc = libc
        if cls.libc is False:
            return False
        while cls.libc.madvise(address, nbytes, _MADV_POPULATE_WRITE) != 0:  # ctypes releases the GIL
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS):  # kernel < 5.14
                cls.libc = False
                return False
            if err not in (errno.EINTR, errno.EAGAIN):
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {nbytes} bytes of staging memory failed")
        return True


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    """A slot's arena. Pinned: torch's host allocator (cudaHostAlloc; its pages are populated now).
    Else a private anonymous mapping, page-aligned (O_DIRECT writes straight from it), no page touched
    yet, unmapped when the last view of it goes."""
    if pin:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
    m = mmap.mmap(-1, aligned(max(nbytes, 1)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.uint8)[:max(nbytes, 1)]  # the tensor keeps the mapping alive


class StagingSlot:
    """One staging buffer: allocated once (pinned when the state is on CUDA), its pages touched once, reused.

    The pages are touched by a preparer (:meth:`touch_step`, from the top down) and by the copy of the
    first save into the slot (from the bottom up, :meth:`reserve` first), whichever reaches them first.

    Parameters
    ----------
    nbytes
        Its size.
    pin
        Allocate pinned memory (device-to-host copies then run asynchronously).
    touch
        Allocate and touch every page now, on this thread (False: leave both to a preparer and the copy;
        pinned memory is then allocated by the first of them, :meth:`materialize`).
    """

    def __init__(self, nbytes: int, pin: bool, *, touch: bool = True) -> None:
        self.nbytes = nbytes
        self.pin = pin
        self.busy = False
        self.retired = False  # replaced by a larger slot: no preparer works on it any more
        self._cond = threading.Condition()
        self._arena: torch.Tensor | None = None
        self.low = nbytes  # pages at or above ``low`` are touched (the preparer goes down)
        self.claim = 0  # the copy may write below ``claim`` (it goes up); the preparer stays above it
        self._touching: set[tuple[int, int]] = set()  # the preparers' ranges in flight
        if not pin:
            self._arena = _allocate(nbytes, pin)  # address space only: cheap
        if touch:
            self.materialize()
            while self.touch_step(1 << 62):
                pass

    @property
    def arena(self) -> torch.Tensor:
        """The slot's bytes (allocated now if no one has yet)."""
        return self.materialize()

    @property
    def allocated(self) -> bool:
        """Whether the memory exists (False only for a pinned slot not allocated yet)."""
        return self._arena is not None

    @property
    def pending(self) -> bool:
        """Whether pages are left for a preparer to take (or, pinned, the allocation)."""
        return self._arena is None or self.low > aligned(self.claim)

    @property
    def prepared(self) -> bool:
        """Whether the preparers are done with it (every page touched, or left to the copy)."""
        if self._arena is None:  # (never waits for a pinned allocation in flight)
            return False
        with self._cond:
            return not self.pending and not self._touching

    def materialize(self) -> torch.Tensor:
        """Allocate the memory unless done (a second caller waits for the first's allocation)."""
        arena = self._arena
        if arena is not None:
            return arena
        with self._cond:
            if self._arena is None:
                self._arena = _allocate(self.nbytes, self.pin)
                self.low = 0  # pinned pages are populated when allocated
            return self._arena

    def touch_step(self, chunk: int) -> bool:
        """Touch the next ``chunk`` bytes below ``low`` (never below ``claim``); False when done."""
        if self.retired:
            return False
        arena = self.materialize()
        with self._cond:
            lo = aligned(max(self.claim, self.low - chunk))
            hi = self.low
            if self.retired or lo >= hi:
                return False
            self.low = lo  # taken: the next preparer takes the range below
            self._touching.add((lo, hi))
        try:
            if not _Pages.populate(arena.data_ptr() + lo, hi - lo):
                arena[lo:hi].zero_()  # the copy never writes here before we are done (reserve waits)
        finally:
            with self._cond:
                self._touching.discard((lo, hi))
                self._cond.notify_all()
        return True

    def reserve(self, end: int) -> None:
        """Before the copy writes below ``end``: keep the preparer above it, and wait for its range in
        flight if they reach below ``end`` (they zero pages where populating is not available)."""
        if end <= self.claim:
            return
        with self._cond:
            self.claim = max(self.claim, end)
            while any(lo < end for lo, _ in self._touching):
                self._cond.wait()

    def view(self, offset: int, t: torch.Tensor) -> torch.Tensor:
        """The slot's bytes from ``offset`` as a tensor of ``t``'s dtype and shape."""
        n = t.numel() * t.element_size()
        return self.arena[offset : offset + n].view(t.dtype).view(t.shape)


class CopyGate:
    """Whether a save is copying its state into staging now: the persister yields the CPU to it.

    A save that comes while the previous step persists copies beside the persister's work (checksums,
    the C writers' copies and file creations). On 2 cores that made its copy 2.6x a memcpy of the state
    (docs/staging.md): what the save blocks for is what training pays, so the persister starts nothing
    new while a copy runs (its encoder before each shard, its path helper before each path, the C write
    pool by :meth:`listen`) and what is in flight goes on. The persist is delayed by about the copy.
    Not for a state staged in pieces (``staging_bytes`` smaller than it): its later pieces need the
    persister to write the earlier ones.
    """

    def __init__(self) -> None:
        self._copies = 0
        self._cond = threading.Condition()
        self._listeners: list[Callable[[bool], None]] = []

    def listen(self, hold: Callable[[bool], None]) -> None:
        """``hold(True)`` when a copy starts, ``hold(False)`` when it ends (e.g. FileWriter.hold)."""
        with self._cond:
            self._listeners.append(hold)
            if self._copies:
                hold(True)

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        with self._cond:
            self._copies += 1
            if self._copies == 1:
                for hold in self._listeners:
                    hold(True)
        try:
            yield
        finally:
            with self._cond:
                self._copies -= 1
                if not self._copies:
                    for hold in self._listeners:
                        hold(False)
                    self._cond.notify_all()

    def wait(self) -> None:
        """Return once no copy runs (the persister, before it starts a piece of work)."""
        with self._cond:
            while self._copies:
                self._cond.wait()


class Staging:
    """The staging slots of one manager and the copy into them.

    :meth:`acquire` and :meth:`stage` run on the caller's thread, :meth:`release` on the persister's
    (or the caller's, when staging fails). :meth:`prepare` hands slots to the preparer threads.

    Parameters
    ----------
    budget
        Upper bound on staging memory (every slot together), None for two copies of what this rank
        writes. With a budget every slot is exactly half of it and a larger state streams through the
        slots in pieces.
    max_slots
        How many slots there may be (2; 3 with deltas).
    eager
        Once a save has sized a slot, prepare the others of that size in the background (False: each is
        allocated by the save that first needs it, on the caller's thread).
    threads
        Preparer threads (``WriteOptions.staging_threads``): they take a slot's pages chunk by chunk.
    """

    CHUNK = 16 << 20  # the preparer's unit: how long a save may wait for it, and how soon close() stops it

    def __init__(self, budget: int | None, max_slots: int, *, eager: bool = True, threads: int = 2) -> None:
        self.budget = budget
        self.max_slots = max_slots
        self.eager = eager
        self.threads = max(1, threads)
        self.slots: list[StagingSlot] = []
        self.target = 0  # bytes per slot the preparer keeps ``max_slots`` slots at (0: none asked for)
        self.allocations = 0  # slots made so far (tests: a prepared save allocates none)
        self._free = threading.Condition()
        self._cuda_stream: Any = None
        self._threads: list[threading.Thread] = []
        self._halt = threading.Event()
        self.error: BaseException | None = None  # the preparer's failure (it then stops preparing)
        # saves copying now and local writes in flight: the preparers pause (on 2 cores they slowed the
        # copy; beside the first save's O_DIRECT writes they made it 1.5-2x slower, docs/staging.md)
        self._paused = 0
        self.gate = CopyGate()  # a save's copy of a whole state: the persister yields to it

    def slot_bytes(self, need: int) -> int:
        """The size of a slot for ``need`` staged bytes (with a budget every slot is half of it)."""
        return self.budget // 2 if self.budget is not None else aligned(need) + SLACK

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

    # -- preparing (the preparer thread) -------------------------------------------------------------
    def prepare(self, nbytes: int) -> None:
        """Keep ``max_slots`` slots of at least ``nbytes`` bytes (a slot's size, :meth:`slot_bytes`): the
        missing ones are made now (address space only) and touched by the preparer thread; free smaller
        ones are replaced now, busy ones when released. Returns at once; :meth:`wait_prepared` waits."""
        with self._free:
            if self._halt.is_set():
                return
            self.target = max(self.target, nbytes)
            for s in [s for s in self.slots if not s.busy and s.nbytes < self.target]:
                self._retire(s)
            while len(self.slots) < self.max_slots:
                self._new_slot(self.target)
            self._start()

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Block until the preparers have nothing left to do; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._free:
                threads = list(self._threads)
            if not threads:
                return True
            for t in threads:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    return False

    def close(self, timeout: float | None = None) -> None:
        """Stop the preparers (each after its current chunk) and join them."""
        self._halt.set()
        self.wait_prepared(timeout)

    def _new_slot(self, nbytes: int) -> StagingSlot:  # under self._free
        slot = StagingSlot(nbytes, pin=self._pin(), touch=False)
        self.slots.append(slot)
        self.allocations += 1
        return slot

    def _retire(self, slot: StagingSlot) -> None:  # under self._free
        slot.retired = True
        self.slots.remove(slot)

    def _start(self) -> None:  # under self._free
        if self.error is not None or self._halt.is_set() or self._next_work() is None:
            return
        while len(self._threads) < self.threads:
            t = threading.Thread(target=self._run, name="ucl-staging", daemon=True)
            self._threads.append(t)
            t.start()

    def _next_work(self) -> StagingSlot | None:  # under self._free
        if self._paused:
            return None  # resumed when the copy or the write is done (stage_batches, persisting)
        # a busy one first (a save copied into it: what its copy did not reach), then the free ones
        todo = [s for s in self.slots if s.pending]
        return min(todo, key=lambda s: not s.busy) if todo else None

    def _run(self) -> None:
        try:
            while not self._halt.is_set():
                with self._free:
                    slot = self._next_work()
                    if slot is None:
                        return
                while not self._halt.is_set() and not self._paused and slot.touch_step(self.CHUNK):
                    pass
        except BaseException as e:  # noqa: BLE001 - e.g. no pinned memory: the saves allocate and touch
            self.error = e  # what is left themselves (and report a failure there, on the caller's thread)
        finally:
            with self._free:
                self._threads.remove(threading.current_thread())
                self._start()  # work handed over while we were leaving

    # -- saving (the caller's thread) ----------------------------------------------------------------
    def acquire(self, need: int) -> StagingSlot:
        """A free slot of at least ``need`` bytes, marked busy; waits while every slot is busy."""
        # pieces are sized in aligned bytes; with a budget every slot is exactly half of it
        need = self.slot_bytes(need)
        with self._free:
            while True:
                free = [s for s in self.slots if not s.busy]
                fit = [s for s in free if s.nbytes >= need]
                if fit:
                    slot = min(fit, key=lambda s: (not s.prepared, s.low))  # the most touched one
                    break
                if len(self.slots) < self.max_slots:
                    slot = self._new_slot(need)
                    break
                if free:  # the state grew: replace a free slot
                    self._retire(free[0])
                    slot = self._new_slot(need)
                    break
                self._free.wait()
            slot.busy = True
            if self.eager and need > self.target:  # the others of this size, in the background
                self.target = need
                for s in [s for s in self.slots if not s.busy and s.nbytes < need]:
                    self._retire(s)
                while len(self.slots) < self.max_slots:
                    self._new_slot(need)
            return slot

    def release(self, slot: StagingSlot) -> None:
        """Mark ``slot`` free and wake a waiting :meth:`acquire` (a slot smaller than what the preparer
        keeps is replaced, in the background)."""
        with self._free:
            slot.busy = False
            if slot.nbytes < self.target and slot in self.slots and not self._halt.is_set():
                self._retire(slot)
                self._new_slot(self.target)
                self._start()
            self._free.notify_all()

    def _pin(self) -> bool:
        return torch.cuda.is_available()

    def stage(self, slot: StagingSlot, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into ``slot`` (each at an aligned offset); returns their staged copies.

        CUDA tensors are copied on a side stream that first waits for the current one; this returns once
        the device-to-host copy is done, so training may change the tensors right away. Into a slot whose
        pages are not all touched yet, the copy faults them from the bottom while the preparer touches them
        from the top.
        """
        staged: dict[str, torch.Tensor] = {}
        for part, _ in self.stage_batches(slot, tensors, None):
            staged.update(part)
        return staged

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """While inside, the preparers touch no page (each ends its current chunk first); they go on
        after. The persister holds it while it writes a job to a local disk (ucl.write.manager)."""
        with self._free:
            self._paused += 1
        try:
            yield
        finally:
            with self._free:
                self._paused -= 1
                self._start()  # the other slots (and what is left of this one) in the background

    def stage_batches(self, slot: StagingSlot, tensors: dict[str, torch.Tensor], batch_bytes: int | None,
                      *, whole: bool = True) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
        """:meth:`stage`, one batch of consecutive tensors of about ``batch_bytes`` at a time (None: all
        of them): yields each batch's staged copies, and whether it is the last, as soon as it is copied
        (its device-to-host copy done), so the persister can write it while the next one is copied.
        ``whole``: these tensors are all the save stages; False for one piece of a state larger than a
        slot (``staging_bytes``), whose later pieces wait for the persister to free a slot."""
        with self.paused():  # the preparers pause (after their current chunk) until the copy is done
            slot.materialize()  # pinned: allocated now, or the preparer's allocation awaited
            racing = not slot.prepared  # a preparer's chunk in flight below the copy is waited for
            cuda = any(t.is_cuda for t in tensors.values())
            if cuda and self._cuda_stream is None:
                self._cuda_stream = torch.cuda.Stream()
            offset = 0
            batch: list[tuple[str, torch.Tensor]] = []
            size = 0
            items = list(tensors.items())
            for i, (name, t) in enumerate(items):
                batch.append((name, t))
                size += t.numel() * t.element_size()
                if i + 1 < len(items) and (batch_bytes is None or size < batch_bytes):
                    continue
                # a whole state copied by the CPU: the persister waits (a streamed state's batches, and
                # the pieces of a state larger than a slot, are meant to be written while the next ones
                # are copied; a device's copy is a DMA)
                yields = whole and batch_bytes is None and not cuda
                with self.gate.copying() if yields else contextlib.nullcontext():
                    staged, offset = self._copy(slot, batch, offset, racing, cuda)
                batch, size = [], 0
                yield staged, i + 1 == len(items)
            if not items:
                yield {}, True

    def _copy(self, slot: StagingSlot, batch: list[tuple[str, torch.Tensor]], offset: int, racing: bool,
              cuda: bool) -> tuple[dict[str, torch.Tensor], int]:
        staged: dict[str, torch.Tensor] = {}
        ctx = torch.cuda.stream(self._cuda_stream) if cuda else contextlib.nullcontext()
        if cuda:
            self._cuda_stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), ctx:
            for name, t in batch:
                n = t.numel() * t.element_size()
                if racing:
                    slot.reserve(offset + n)
                dst = slot.view(offset, t)
                dst.copy_(t.detach(), non_blocking=t.is_cuda)
                staged[name] = dst
                offset += aligned(n)
        if cuda:
            self._cuda_stream.synchronize()  # training waits only for the device-to-host copy
        return staged, offset
