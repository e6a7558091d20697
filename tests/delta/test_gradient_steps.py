"""Gradient-record steps written by the engine (spec/delta.md §8): replayed bit-exactly, verified against
full steps of the same training run; fallbacks, fingerprint mismatches, validation, compaction."""

from __future__ import annotations

import copy
import glob
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from ucl.delta.gradients import ReplayWarning
from ucl.errors import InvalidArgumentError, UnknownExtensionError
from ucl.format import structure
from ucl.tools.compact import compact
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy


def model_and_optimizer(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 50))
    sched = None
    if kind == "adamw-foreach":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    elif kind == "adamw-loop-groups":  # two groups, a scheduler changing lr right after each step
        opt = torch.optim.AdamW([{"params": list(model[0].parameters()) + list(model[1].parameters())},
                                 {"params": model[3].parameters(), "lr": 3e-3, "weight_decay": 0.0}],
                                lr=1e-2, foreach=False)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    elif kind == "sgd-momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    else:
        raise AssertionError(kind)
    return model, opt, sched


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 50, (4, 6), generator=g)
    y = torch.randint(0, 50, (4, 6), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1)).backward()
    opt.step()
    if sched is not None:
        sched.step()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "meta": {"step": step}}


def assert_same(got: Any, want: Any, where: str) -> None:
    g, gt = structure.flatten(got)
    w, wt = structure.flatten(want)
    assert gt == wt, f"{where}: structure or JSON values differ"
    assert set(g) == set(w), f"{where}: {sorted(set(g) ^ set(w))}"
    for k in w:
        assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, (where, k)
        assert g[k].contiguous().view(-1).view(torch.uint8).tolist() == \
            w[k].contiguous().view(-1).view(torch.uint8).tolist(), f"{where}: {k} differs"


def run(path: str, kind: str, steps: int, policy: DeltaPolicy | None,
        between: Callable[[int, torch.nn.Module, torch.optim.Optimizer], None] | None = None,
        every: int = 1) -> dict[int, Any]:
    model, opt, sched = model_and_optimizer(kind)
    ref = {}
    with CheckpointManager(path, delta=policy) as mgr:
        for t in range(1, steps + 1):
            train_step(model, opt, sched, t)
            if between is not None:
                between(t, model, opt)
            if t % every == 0:
                st = state_of(model, opt, t)
                ref[t] = copy.deepcopy(st)
                mgr.save(t, st, optimizer=opt if policy is not None and policy.gradients else None)
        mgr.wait()
    return ref


@pytest.mark.parametrize("kind", ["adamw-foreach", "adamw-loop-groups", "sgd-momentum"])
def test_gradient_steps_replay_bit_exactly_and_match_full_steps(tmp_path: Any, kind: str) -> None:
    grads, full = str(tmp_path / "grads"), str(tmp_path / "full")
    ref = run(grads, kind, 9, DeltaPolicy(full_every=4, gradients=True))
    run(full, kind, 9, None)  # the same run stored as full steps: what the replay must reproduce
    kinds = []
    for t in range(1, 10):
        with ucl.open(grads, t) as ck:
            kinds.append("grad" if ck.records is not None else ck.kind)
            got = ck.load()
            assert ck.exact
        assert_same(got, ref[t], f"step {t} vs the state in memory")
        assert_same(got, ucl.open(full, t).load(), f"step {t} vs the full step")
    assert kinds == ["full", "grad", "grad", "grad", "full", "grad", "grad", "grad", "full"]
    assert ucl.validate(grads).ok
    size = {t: sum(os.path.getsize(f) for f in glob.glob(f"{grads}/steps/{t}/**", recursive=True)
                   if os.path.isfile(f)) for t in (1, 2)}
    assert size[2] * 1.5 < size[1], size  # gradients instead of parameters + optimizer state (SGD: 1 buffer)


def test_lazy_slice_and_zarr_view_of_a_gradient_step(tmp_path: Any) -> None:
    import numpy as np
    import zarr

    path = str(tmp_path / "r")
    ref = run(path, "adamw-foreach", 3, DeltaPolicy(gradients=True))
    ck = ucl.open(path, 3)
    assert ck.records is not None and "model/1.weight" in ck and "grad/model/1.weight" not in ck
    assert torch.equal(ck["model/1.weight"][3:7], ref[3]["model"]["1.weight"][3:7])
    first = ck.load(flat=True)
    first["model/1.weight"].zero_()  # the caller's copy: later reads of the same step are unaffected
    assert torch.equal(ck.load(flat=True)["model/1.weight"], ref[3]["model"]["1.weight"])
    assert torch.equal(ck["model/1.weight"][:], ref[3]["model"]["1.weight"])
    assert ck.array("grad/model/1.weight").shape == ref[3]["model"]["1.weight"].shape  # the stored gradient
    z = zarr.open_group(store=ucl.zarr_store(path, 3), mode="r")
    want = ref[3]["optim"]["state"][1]["exp_avg_sq"].numpy()
    assert np.array_equal(z["optim/state/1/exp_avg_sq"][:], want)


@pytest.mark.parametrize("case", ["two optimizer steps", "zero_grad before save", "params touched after step"])
def test_saves_that_cannot_be_replayed_fall_back_to_state_deltas(tmp_path: Any, case: str) -> None:
    path = str(tmp_path / "r")

    def between(t: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if t == 4 and case == "zero_grad before save":
            opt.zero_grad()
        if t == 4 and case == "params touched after step":
            with torch.no_grad():
                model[1].bias.mul_(0.5)

    every = 1
    if case == "two optimizer steps":
        every = 2
    ref = run(path, "adamw-foreach", 6, DeltaPolicy(gradients=True), between=between, every=every)
    recorded = {t: ucl.open(path, t).records is not None for t in ref}
    if case == "two optimizer steps":
        assert not any(recorded.values())  # every save is 2 steps after the previous: state deltas
    else:
        assert recorded == {1: False, 2: True, 3: True, 4: False, 5: True, 6: True}
    for t, want in ref.items():
        assert_same(ucl.open(path, t).load(), want, f"step {t}")
    assert ucl.validate(path).ok


def test_fingerprint_mismatch_fails_unless_approximate(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "r")
    ref = run(path, "adamw-foreach", 3, DeltaPolicy(gradients=True))
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    with pytest.raises(UnknownExtensionError, match="torch_version") as info:
        ucl.open(path, 3).load()
    assert info.value.code == "unknown_extension"
    ck = ucl.open(path, 3, approximate=True)
    with pytest.warns(ReplayWarning, match="torch_version"):
        got = ck.load()
    assert not ck.exact
    assert_same(got, ref[3], "approximate replay (same kernels here, so equal)")


def test_compacting_a_gradient_step_keeps_it_and_its_children_exact(tmp_path: Any) -> None:
    path = str(tmp_path / "r")
    ref = run(path, "adamw-loop-groups", 5, DeltaPolicy(gradients=True))
    assert compact(path, 3).changed
    ck = ucl.open(path, 3)
    assert ck.kind == "full" and ck.records is None and not any(n.startswith("grad/") for n in ck.meta.arrays)
    for t in (3, 4, 5):
        assert_same(ucl.open(path, t).load(), ref[t], f"step {t} after compacting step 3")
    assert ucl.validate(path).ok


def test_corrupt_base_invalidates_every_step_replayed_on_it(tmp_path: Any) -> None:
    path = str(tmp_path / "r")
    run(path, "adamw-foreach", 4, DeltaPolicy(gradients=True))
    shard = next(f for f in sorted(glob.glob(f"{path}/steps/1/optim/state/1/exp_avg/c/**", recursive=True))
                 if os.path.isfile(f))
    data = bytearray(Path(shard).read_bytes())
    data[7] ^= 0x10
    Path(shard).write_bytes(bytes(data))
    report = ucl.validate(path)
    by_step = {p.step: p for p in report.problems}
    assert by_step[1].code == "checksum_mismatch"
    for t in (2, 3, 4):
        assert by_step[t].code == "broken_chain" and "step 1" in by_step[t].message, by_step[t]
    with pytest.raises(ucl.UCLError):
        ucl.open(path, 4).load()


def test_retention_keeps_the_steps_a_replay_needs(tmp_path: Any) -> None:
    path = str(tmp_path / "r")
    model, opt, sched = model_and_optimizer("adamw-foreach")
    with CheckpointManager(path, keep_last=2, delta=DeltaPolicy(full_every=5, gradients=True)) as mgr:
        for t in range(1, 8):
            train_step(model, opt, sched, t)
            mgr.save(t, state_of(model, opt, t), optimizer=opt)
        mgr.wait()
        want = copy.deepcopy(state_of(model, opt, 7))
    steps = ucl.Repository.open(path).steps()
    assert steps == [6, 7], steps  # 6 is full (full_every=5); 1-5 are not needed by 6 or 7
    assert_same(ucl.open(path, 7).load(), want, "newest step after retention")
    assert ucl.validate(path).ok


def test_bad_configurations_are_refused(tmp_path: Any) -> None:
    model, opt, _ = model_and_optimizer("adamw-foreach")
    with CheckpointManager(str(tmp_path / "a"), delta=True) as mgr, \
            pytest.raises(InvalidArgumentError, match="gradients=True"):
        mgr.save(1, state_of(model, opt, 1), optimizer=opt)
    with CheckpointManager(str(tmp_path / "b"), delta=DeltaPolicy(gradients=True)) as mgr:
        train_step(model, opt, None, 1)
        with pytest.raises(InvalidArgumentError, match="not a tensor of the saved state"):
            mgr.save(1, {"optim": opt.state_dict()}, optimizer=opt)
        with pytest.raises(InvalidArgumentError, match="optimizer.state_dict"):
            mgr.save(1, {"model": model.state_dict()}, optimizer=opt)
    with pytest.raises(InvalidArgumentError, match="gradients must be a bool"):
        DeltaPolicy(gradients="yes")  # type: ignore[arg-type]


def test_cli_info_describes_a_gradient_step(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from ucl.tools.cli import main

    path = str(tmp_path / "r")
    run(path, "adamw-foreach", 2, DeltaPolicy(gradients=True))
    assert main(["info", path, "--step", "2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    g = info["gradient_records"]
    assert g["base_step"] == 1 and g["optimizer"] == "torch.optim.adamw.AdamW" and g["parameters"] == 5
    assert "model/1.weight" in g["replayed"] and "optim/state/0/exp_avg" in g["replayed"]
    assert {t["name"] for t in info["tensors"]} == {f"grad/model/{n}" for n in
                                                    ("0.weight", "1.weight", "1.bias", "3.weight", "3.bias")}


def test_a_failed_save_never_leaves_a_gradient_step_without_its_parent(tmp_path: Any) -> None:
    """Step 3's write fails (EIO) after step 4 was staged as its gradients only: step 4 must fail too (never
    committed against a missing parent); step 5 stores the state again, step 6 is gradients again."""
    import errno
    import threading

    from ucl.errors import WriteError
    from ucl.io import native as _native

    path = str(tmp_path / "r")
    model, opt, sched = model_and_optimizer("adamw-foreach")
    want, handles = {}, {}
    with CheckpointManager(path, delta=DeltaPolicy(gradients=True)) as mgr:
        decide, staged = mgr._kinds.decide, threading.Event()

        def after_step_4_is_staged(job: Any) -> None:
            if job.step == 3:
                staged.wait(30)
            decide(job)

        mgr._kinds.decide = after_step_4_is_staged  # type: ignore[method-assign]
        for t in range(1, 7):
            train_step(model, opt, sched, t)
            st = state_of(model, opt, t)
            want[t] = copy.deepcopy(st)
            if t == 3:
                _native.inject_fault("pwrite", nth=1, errno=errno.EIO)
            handles[t] = mgr.save(t, st, optimizer=opt)
            if t == 4:
                staged.set()
                try:
                    for s in (3, 4):
                        with pytest.raises(WriteError):
                            handles[s].result()
                finally:
                    _native.inject_fault(None)
            elif t != 3:
                handles[t].result()
        mgr.wait()  # both failures were seen through their handles: handled, not raised again
    with pytest.raises(WriteError, match="staged as the gradients of step 3"):
        handles[4].result()
    steps = ucl.Repository.open(path).steps()
    assert steps == [1, 2, 5, 6], steps
    assert ucl.open(path, 5).records is None and ucl.open(path, 6).records is not None
    for t in steps:
        assert_same(ucl.load(path, t), want[t], f"step {t}")
    assert ucl.validate(path).ok
