"""Staging memory prepared off the critical path (ucl.write.staging; CheckpointManager(prepare=), prepare()).

Structure, not speed: which slots exist, who made them, whether every page was touched, the staged bytes,
the process's memory; never a time.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ucl
from ucl.errors import InvalidArgumentError
from ucl.format import structure
from ucl.options import WriteOptions
from ucl.write import staging as stg
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy


def state(seed: int = 0, rows: int = 512) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(rows, 300, generator=g), "b": torch.randn(300, generator=g).bfloat16(),
                  "i": torch.randint(-9, 9, (rows, 3), generator=g)},
        "optim": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(rows, 300, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "empty": torch.empty(0, 3),
        "flag": torch.tensor(True),
    }


def flat(sd: object) -> dict[str, torch.Tensor]:
    return structure.flatten(sd)[0]  # type: ignore[arg-type]


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8),
                           b.contiguous().view(-1).view(torch.uint8)), k


def slot_size(sd: object) -> int:
    return stg.aligned(stg.footprint(flat(sd))) + stg.SLACK


def staging_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ucl-staging"]


# -- the manager ------------------------------------------------------------------------------------
def test_a_prepared_first_save_allocates_nothing_and_round_trips(tmp_path) -> None:
    sd = state()
    snaps = []
    with CheckpointManager(tmp_path, prepare=sd) as mgr:
        st = mgr._staging
        assert st.wait_prepared(60)
        assert st.allocations == 2 and all(s.prepared and s.nbytes == slot_size(sd) for s in st.slots)
        arenas = [s.arena for s in st.slots]  # (kept: ids of live objects stay unique)
        for step in range(4):
            snaps.append({k: v.clone() for k, v in flat(sd).items()})
            mgr.save(step, sd)
            sd["model"]["w"].add_(1.0)  # training changes the state as soon as save returns
            sd["optim"]["state"][0]["exp_avg"].mul_(-0.5)
        mgr.wait()
        assert st.allocations == 2  # no save made a slot
        assert {id(s.arena) for s in st.slots} == {id(a) for a in arenas}
    for step, snap in enumerate(snaps):
        assert_bits(ucl.load(tmp_path, step, flat=True), snap)
    assert ucl.validate(tmp_path).ok


def test_save_if_due_prepares_the_staging_at_its_first_step_without_a_save(tmp_path) -> None:
    from ucl.write.policy import AdaptiveInterval

    sd = state(11)
    with CheckpointManager(tmp_path, interval=AdaptiveInterval(mtbf=3600.0, min_interval=10.0)) as mgr:
        st = mgr._staging
        assert mgr.save_if_due(0, sd, now=0.0) is None  # the first step saves nothing (its cost unknown)
        assert st.allocations == 2 and all(s.nbytes == slot_size(sd) for s in st.slots)
        assert st.wait_prepared(60) and all(s.prepared for s in st.slots)
        h = mgr.save_if_due(1, sd, now=1.0)
        assert h is not None
        h.result()
        assert st.allocations == 2  # the first save made no slot
        assert mgr.save_if_due(2, sd, now=2.0) is None and st.allocations == 2  # prepared once
    assert_bits(ucl.load(tmp_path, 1, flat=True), flat(sd))
    with CheckpointManager(tmp_path / "f", interval=AdaptiveInterval(mtbf=3600.0), prepare=False) as mgr:
        assert mgr.save_if_due(0, sd, now=0.0) is None and not mgr._staging.slots  # asked not to


def test_prepare_method_waits_and_staging_memory_stays_within_the_budget(tmp_path) -> None:
    sd = state(1, rows=4096)  # ~10 MB: the process's memory shows it
    budget = 2 * stg.footprint(flat(sd))
    with CheckpointManager(tmp_path) as mgr:
        assert mgr._staging.slots == []
        rss0 = _rss()
        mgr.prepare(sd, wait=True)
        assert not staging_threads()
        grown = _rss() - rss0
        assert budget * 0.9 <= grown <= budget * 1.1 + (8 << 20)  # touched: resident now; no more than that
        for step in range(3):
            mgr.save(step, sd).result()
        assert mgr._staging.allocations == 2
        assert sum(s.nbytes for s in mgr._staging.slots) <= budget * 1.1
        mgr.prepare(state(2, rows=16))  # a smaller state: the slots stay
        assert mgr._staging.allocations == 2
    assert_bits(ucl.load(tmp_path, 2, flat=True), flat(sd))


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_staging_bytes_are_prepared_at_construction(tmp_path) -> None:
    sd = state(3)
    total = stg.footprint(flat(sd))
    with CheckpointManager(tmp_path, staging_bytes=total) as mgr:  # two slots of half the state
        assert mgr._staging.allocations == 2 and all(s.nbytes == total // 2 for s in mgr._staging.slots)
        assert mgr._staging.wait_prepared(60)
        mgr.save(1, sd).result()  # streamed through both slots in pieces
        assert mgr._staging.allocations == 2
    assert_bits(ucl.load(tmp_path, 1, flat=True), flat(sd))
    with CheckpointManager(tmp_path / "lazy", staging_bytes=total, prepare=False) as mgr:
        assert mgr._staging.slots == []


def test_default_prepares_the_other_slots_after_the_first_save(tmp_path) -> None:
    sd = state(4)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr._staging.slots == []
        mgr.save(0, sd)  # allocates its own slot (it cannot know the size before)
        assert mgr._staging.allocations == 2  # ... and the second is being prepared
        assert mgr._staging.wait_prepared(60)
        mgr.save(1, sd)  # while step 0 may still persist: the other slot, made already
        mgr.wait()
        assert mgr._staging.allocations == 2
    with CheckpointManager(tmp_path / "lazy", prepare=False) as mgr:  # each slot when a save needs it
        mgr.save(0, sd).result()
        assert mgr._staging.allocations == 1 and not staging_threads()
    assert_bits(ucl.load(tmp_path, 1, flat=True), flat(sd))


def test_the_preparers_wait_while_a_local_job_is_written(tmp_path) -> None:
    # the first save's write ran 1.5-2x longer beside preparers faulting the other slot (docs/staging.md)
    sd = state(7)
    seen: list[tuple[int, list[int]]] = []
    with CheckpointManager(tmp_path) as mgr:
        write = mgr._shards.write

        def watched(job, base):  # type: ignore[no-untyped-def]
            before = [s.low for s in mgr._staging.slots]
            out = write(job, base)
            assert [s.low for s in mgr._staging.slots] == before  # no page touched meanwhile
            seen.append((mgr._staging._paused, before))
            return out

        mgr._shards.write = watched  # type: ignore[method-assign]
        mgr.save(0, sd).result()
        assert [paused for paused, _ in seen] == [1]
        assert mgr._staging.wait_prepared(60)  # the other slot is prepared once the write is done
        assert all(s.prepared for s in mgr._staging.slots)
    assert_bits(ucl.load(tmp_path, 0, flat=True), flat(sd))


def test_the_persister_starts_nothing_while_a_save_copies(tmp_path) -> None:
    # a save while the previous step persists: its copy got 2.6x a memcpy beside the persister's work on
    # 2 cores (docs/staging.md), so the persister yields; here a copy is held open by hand
    sd = state(8)
    with CheckpointManager(tmp_path, prepare=sd) as mgr:
        gate = mgr._staging.gate
        with gate.copying():
            h = mgr.save(0, sd)  # its own copy ends; the one held here goes on
            time.sleep(0.5)
            assert not h.done()
            assert not [p for p in tmp_path.rglob("*") if "0" in p.relative_to(tmp_path).parts[1:2]]
        h.result(timeout=60)
    assert_bits(ucl.load(tmp_path, 0, flat=True), flat(sd))


def test_a_state_staged_in_pieces_never_holds_the_persister(tmp_path) -> None:
    # its later pieces wait for the persister to write the earlier ones and free a slot
    sd = state(10, rows=2048)
    budget = 2 * (stg.aligned(2048 * 300 * 4) + (1 << 20))  # slots of one large tensor each, and a bit
    with CheckpointManager(tmp_path, staging_bytes=budget) as mgr:
        holds: list[bool] = []
        mgr._staging.gate.listen(holds.append)
        assert len(mgr._staging.pieces(mgr._planner.plan(flat(sd)), flat(sd))) > 1
        mgr.save(0, sd).result(timeout=60)
        mgr.save(1, sd).result(timeout=60)
        assert holds == []
    assert_bits(ucl.load(tmp_path, 1, flat=True), flat(sd))


def test_a_copy_holds_the_c_writers_and_a_streamed_one_does_not(tmp_path) -> None:
    holds: list[bool] = []
    sd = flat(state(9))
    st = stg.Staging(None, 2)
    st.gate.listen(holds.append)
    slot = st.acquire(stg.footprint(sd))
    for _ in st.stage_batches(slot, sd, None):
        pass
    assert holds == [True, False]
    for _ in st.stage_batches(slot, sd, 1):  # streamed: its batches are written while the next are copied
        pass
    for _ in st.stage_batches(slot, sd, None, whole=False):  # a piece: the next ones wait for its write
        pass
    assert holds == [True, False]
    with st.gate.copying(), st.gate.copying():
        assert holds == [True, False, True]
        late: list[bool] = []
        st.gate.listen(late.append)  # a listener added during a copy is held at once
        assert late == [True]
    assert holds == [True, False, True, False] and late == [True, False]
    st.release(slot)
    st.close()


def test_paused_staging_starts_no_preparer_until_resumed() -> None:
    st = SmallChunks(None, 2, threads=2)
    with st.paused():
        st.prepare(8 << 20)
        assert not staging_threads() and all(s.pending for s in st.slots)
    assert st.wait_prepared(60)
    assert all(s.prepared for s in st.slots)
    st.close()


def test_a_too_small_preparation_grows(tmp_path) -> None:
    small, big = state(5, rows=8), state(6, rows=600)
    with CheckpointManager(tmp_path, prepare=small) as mgr:
        st = mgr._staging
        assert st.wait_prepared(60) and st.allocations == 2
        mgr.save(0, big).result()  # the save replaces a free slot; the other is replaced in the background
        assert st.wait_prepared(60)
        assert st.allocations == 4 and len(st.slots) == 2
        assert all(s.nbytes >= slot_size(big) and s.prepared for s in st.slots)
        mgr.save(1, big)
        mgr.save(2, big)
        mgr.wait()
        assert st.allocations == 4
    for step in range(3):
        assert_bits(ucl.load(tmp_path, step, flat=True), flat(big))


def test_a_save_racing_the_preparation_is_bit_exact(tmp_path) -> None:
    for i in range(3):
        sd = state(7 + i, rows=2048)
        with CheckpointManager(tmp_path / str(i), prepare=sd) as mgr:  # the first save at once
            h = mgr.save(0, sd)
            want = {k: v.clone() for k, v in flat(sd).items()}
            sd["model"]["w"].zero_()
            h.result()
            mgr.save(1, sd).result()
            assert mgr._staging.allocations == 2
            assert mgr._staging.wait_prepared(60)
            assert all(s.prepared and not s._touching for s in mgr._staging.slots)
        assert_bits(ucl.load(tmp_path / str(i), 0, flat=True), want)
        assert_bits(ucl.load(tmp_path / str(i), 1, flat=True), flat(sd))


def test_closing_before_the_preparation_finished_is_clean(tmp_path) -> None:
    sd = state(10, rows=8192)  # ~20 MB a slot
    for i in range(3):
        mgr = CheckpointManager(tmp_path / str(i), prepare=sd)
        if i == 1:
            mgr.save(0, sd)
        mgr.close()
        assert not staging_threads()  # joined
        with pytest.raises(InvalidArgumentError, match="closed"):
            mgr.prepare(sd)
    assert_bits(ucl.load(tmp_path / "1", 0, flat=True), flat(sd))
    with CheckpointManager(tmp_path / "0") as mgr:  # the lock was released
        mgr.save(1, sd).result()


def test_delta_steps_prepare_three_slots(tmp_path) -> None:
    sd = state(11)
    with CheckpointManager(tmp_path, delta=DeltaPolicy(full_every=3), prepare=sd) as mgr:
        snaps = []
        for step in range(5):
            snaps.append({k: v.clone() for k, v in flat(sd).items()})
            mgr.save(step, sd)
            sd["model"]["w"][step].add_(1.0)
        mgr.wait()
        assert mgr._staging.allocations == 3
    for step, snap in enumerate(snaps):
        assert_bits(ucl.load(tmp_path, step, flat=True), snap)


def test_gradient_records_are_prepared_with_the_optimizer(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train() -> None:
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()

    train()  # the optimizer's state exists after its first step
    snaps = {}
    with CheckpointManager(tmp_path, delta=DeltaPolicy(full_every=3, gradients=True)) as mgr:
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        mgr.prepare(sd, optimizer=opt, wait=True)
        params = sum(stg.aligned(p.nbytes) for p in model.parameters())
        assert all(s.nbytes == slot_size(sd) + params for s in mgr._staging.slots)
        for step in range(1, 6):  # full, then gradient records (the state and the gradients staged)
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            snaps[step] = {k: v.clone() for k, v in flat(sd).items()}
            mgr.save(step, sd, optimizer=opt)
            train()
        mgr.wait()
        assert mgr._staging.allocations == 3
    assert any(ucl.open(tmp_path, t).records is not None for t in range(1, 6))
    for step, snap in snaps.items():
        assert_bits(ucl.load(tmp_path, step, flat=True), snap)


def test_prepare_arguments_are_checked(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError, match="prepare=True"):
        CheckpointManager(tmp_path, prepare=True)
    with pytest.raises(InvalidArgumentError, match="prepare must be"):
        CheckpointManager(tmp_path, prepare=3)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(InvalidArgumentError, match="staging_bytes"):
            mgr.prepare()
        with pytest.raises(InvalidArgumentError, match="sparse|layout|store"):
            mgr.prepare({"s": torch.eye(3).to_sparse()})  # refused as save refuses it
    with pytest.raises(InvalidArgumentError, match="smaller than tensor"):
        CheckpointManager(tmp_path / "b", staging_bytes=1 << 20, prepare=state())
    with CheckpointManager(tmp_path / "b", options=WriteOptions(staging_threads=1), prepare=state()) as mgr:
        assert mgr._staging.threads == 1  # the failed constructor above released the lock


# -- the slots and the preparers themselves ----------------------------------------------------------
class SmallChunks(stg.Staging):
    CHUNK = 64 << 10  # many steps: the copy and the preparers meet inside the state


@pytest.mark.parametrize("populate", [True, False])
def test_preparers_and_copy_meet_without_touching_the_copy(monkeypatch, populate) -> None:
    if not populate:  # the fallback writes zeros: only the claim keeps it off the staged bytes
        monkeypatch.setattr(stg._Pages, "libc", False)
    g = torch.Generator().manual_seed(12)
    sizes = [70000, 3, 250000, 1, 120000] * 4
    tensors = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    for _ in range(5):
        st = SmallChunks(None, 2, threads=2)
        st.prepare(st.slot_bytes(stg.footprint(tensors)))
        slot = st.acquire(stg.footprint(tensors))  # at once: the preparers are starting
        staged = st.stage(slot, tensors)
        assert st.wait_prepared(60)
        assert_bits(staged, tensors)  # after the preparers finished: nothing they did changed the copy
        assert slot.prepared and slot.low <= stg.aligned(slot.claim) and st.allocations == 2
        other = next(s for s in st.slots if s is not slot)
        assert other.prepared and other.low == 0
        st.release(slot)
        again = st.acquire(stg.footprint(tensors))
        assert_bits(st.stage(again, tensors), tensors)
        st.close()


def test_a_slot_touched_on_its_own_thread_is_ready() -> None:
    slot = stg.StagingSlot(3 * stg.ALIGN + 5, pin=False)
    assert slot.prepared and slot.low == 0 and slot.arena.numel() == 3 * stg.ALIGN + 5
    lazy = stg.StagingSlot(1 << 20, pin=False, touch=False)
    assert lazy.pending and not lazy.prepared
    while lazy.touch_step(1 << 16):
        pass
    assert lazy.prepared and lazy.low == 0


def test_closed_staging_stops_its_preparers() -> None:
    st = SmallChunks(None, 2, threads=2)
    st.prepare(64 << 20)
    st.close()
    assert not staging_threads()
    assert any(s.pending for s in st.slots) or all(s.prepared for s in st.slots)
    st.prepare(128 << 20)  # ignored once closed
    assert st.target == 64 << 20
    slot = st.acquire(1 << 20)  # saves still work: their copy touches what is left
    t = torch.arange(1000.0)
    assert torch.equal(st.stage(slot, {"t": t})["t"], t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_slots_are_allocated_by_the_preparer_and_stage_cuda_tensors(tmp_path) -> None:
    sd = {k: v.cuda() for k, v in flat(state(13)).items()}
    with CheckpointManager(tmp_path, prepare=sd) as mgr:
        assert mgr._staging.wait_prepared(120)
        assert all(s.allocated and s.arena.is_pinned() and s.prepared for s in mgr._staging.slots)
        mgr.save(0, sd)
        mgr.wait()
        assert mgr._staging.allocations == 2
    with CheckpointManager(tmp_path / "race", prepare=sd) as mgr:  # the save waits for the allocation
        mgr.save(0, sd).result()
    for p in (tmp_path, tmp_path / "race"):
        assert_bits(ucl.load(p, 0, flat=True), {k: v.cpu() for k, v in sd.items()})


# -- streaming: a full step's batches reach the persister as they are copied ---------------------------
def test_stage_batches_yields_consecutive_batches_of_the_state_bit_exact() -> None:
    tensors = flat(state())
    staging = stg.Staging(None, 2)
    slot = staging.acquire(stg.footprint(tensors))
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    batches = list(staging.stage_batches(slot, tensors, 200_000))
    # consecutive, in order, each closed once it holds 200,000 bytes (or at the end), the last flagged
    assert [n for b, _ in batches for n in b] == list(tensors)
    assert [last for _, last in batches] == [False] * (len(batches) - 1) + [True]
    assert len(batches) == 3  # w (614,400 B) | b, i, exp_avg (>= 200,000 B) | step, empty, flag
    for b, _ in batches[:-1]:
        assert sum(sizes[n] for n in b) >= 200_000 and sum(sizes[n] for n in list(b)[:-1]) < 200_000
    staged = {n: t for b, _ in batches for n, t in b.items()}
    assert_bits(staged, tensors)
    start, end = slot.arena.data_ptr(), slot.arena.data_ptr() + slot.nbytes
    assert all(start <= t.data_ptr() < end for t in staged.values() if t.numel())  # copies in the slot
    assert staging.stage(slot, tensors).keys() == tensors.keys()  # one batch: stage() as before
    staging.release(slot)
    staging.close()


@pytest.mark.parametrize("stream", [1, 100_000, 0])
def test_a_streamed_full_step_round_trips_and_validates(tmp_path, stream: int) -> None:
    opts = WriteOptions(stream_bytes=stream)
    with CheckpointManager(tmp_path, options=opts) as mgr:
        for step in range(3):
            mgr.save(step, state(step))
        mgr.wait()
    for step in range(3):
        assert_bits(flat(ucl.load(tmp_path, step=step)), flat(state(step)))
    assert ucl.validate(tmp_path).ok


class _Boom(torch.Tensor):
    """A tensor whose staging copy fails (its detach raises): a save that fails half way through the copy."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.detach:
            raise RuntimeError("device lost during the copy")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_copy_failing_after_batches_were_queued_fails_the_step_and_frees_the_slot(tmp_path) -> None:
    sd = state(0)
    sd["z_last"] = torch.randn(64, 64).as_subclass(_Boom)  # copied last, after batches went out
    mgr = CheckpointManager(tmp_path, options=WriteOptions(stream_bytes=1))
    mgr.save(0, state(0)).result()
    with pytest.raises(RuntimeError, match="device lost during the copy"):
        mgr.save(1, sd)
    mgr.save(2, state(2)).result(timeout=60)
    # the failed step's slot was released once the batches queued in it were written: no slot is held
    assert len(mgr._staging.slots) == 2 and not any(s.busy for s in mgr._staging.slots)
    # save raised the failure, so close does not raise it again (as for a save that failed before any
    # batch was queued: a failure the caller has seen is handled, CheckpointManager.wait)
    mgr.close()
    assert ucl.Repository.open(tmp_path).steps() == [0, 2]
    assert_bits(flat(ucl.load(tmp_path, step=2)), flat(state(2)))
    assert ucl.validate(tmp_path).ok
