"""Gradient records (spec/delta.md §8): replaying the optimizer is bit-exact when the fingerprint matches."""

from __future__ import annotations

import copy

import pytest
import torch

from ucl.delta.gradients import fingerprint_mismatches, optimizer_fingerprint, replay_step
from ucl.errors import InvalidArgumentError
from ucl.format.records import GradientRecords


def make(foreach: bool | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return grads


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


@pytest.mark.parametrize("foreach", [False, True])
def test_replay_matches_the_next_full_step_bit_for_bit(foreach: bool) -> None:
    model, opt = make(foreach)
    for s in range(1, 4):
        train(model, opt, s)
    parent = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    fp = optimizer_fingerprint(opt)
    grads = train(model, opt, 4)  # the step whose gradients are recorded
    full = (model.state_dict(), opt.state_dict())  # "the next full step"

    m2, o2 = make(foreach)
    m2.load_state_dict(parent[0])
    o2.load_state_dict(parent[1])
    assert fingerprint_mismatches(fp, optimizer_fingerprint(o2)) == []
    replay_step(o2, dict(m2.named_parameters()), grads)
    for k, v in full[0].items():
        assert bits_equal(m2.state_dict()[k], v), k
    for i, st in full[1]["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert bits_equal(o2.state_dict()["state"][i][k].float(), st[k].float()), (i, k)
    ext = GradientRecords(base_step=3, fingerprint=fp, parameters=tuple(f"model/{n}" for n in full[0]),
                          param_groups=({"lr": 1e-2},)).to_extension()
    assert GradientRecords.from_extension(ext).fingerprint == fp


def test_fingerprint_names_what_differs() -> None:
    _, a = make(foreach=False)
    _, b = make(foreach=True)
    fa, fb = optimizer_fingerprint(a), optimizer_fingerprint(b)
    assert fa.optimizer == "torch.optim.adamw.AdamW" and fa.device.startswith("cpu:") and fa.dtype == "float32"
    assert fa.implementation == "for-loop" and fb.implementation == "foreach"
    assert fingerprint_mismatches(fa, fb) == ["implementation", "options.foreach"]
    c = torch.optim.AdamW(make()[0].parameters(), lr=2e-2)
    assert "options.lr" in fingerprint_mismatches(fa, optimizer_fingerprint(c))


def test_replay_checks_gradients() -> None:
    model, opt = make()
    params = dict(model.named_parameters())
    with pytest.raises(InvalidArgumentError, match="unknown parameters"):
        replay_step(opt, params, {"nope": torch.zeros(1)})
    with pytest.raises(InvalidArgumentError, match="gradient of '0.bias' is"):
        replay_step(opt, params, {"0.bias": torch.zeros(3)})
