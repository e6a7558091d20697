"""Optimizer state follows its parameter whatever the optimizer calls it (issue 12 item 4): the layout's
rules name ``<param>/*``, so SGD's ``momentum_buffer`` and Muon's (torch.optim.Muon on the 2-D weights,
AdamW on the rest) are split, saved by real gloo ranks and resharded exactly as their parameters are.
(Adafactor's factored ``row_var``/``col_var`` are not shaped like their parameter: under tensor
parallelism they are each rank's own statistics, not pieces of one logical tensor, so they belong in
per-rank state, not under a parameter's rule.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from ucl.testing import dist, gpt
from ucl.testing.layout_reference import shard_local_state

from .gptstate import CONFIG, layout_of, layout_text, mesh_of, nest

pytestmark = pytest.mark.dist


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]


def trained_state(kind: str, steps: int = 3) -> dict[str, torch.Tensor]:
    """The tiny GPT trained ``steps`` steps with ``kind``: "model/<p>" and every tensor state of the
    parameter's shape as "optim/state/model/<p>/<state name>"."""
    model, _ = gpt.make_model_and_optimizer(CONFIG, seed=0)
    opts = _optimizer(kind, model)
    opts = opts if isinstance(opts, list) else [opts]
    data = gpt.SyntheticData(CONFIG, seed=0)
    for s in range(1, steps + 1):
        for o in opts:
            o.zero_grad(set_to_none=True)
        inputs, targets = data.batch(s)
        logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        for o in opts:
            o.step()
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"model/{name}"] = p.detach().clone()
        for o in opts:
            for key, v in o.state.get(p, {}).items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    out[f"optim/state/model/{name}/{key}"] = v.clone()
    return out


def save_trained(rank: int, world: int, path: str, kind: str) -> dict[str, Any]:
    from ucl.write.manager import CheckpointManager

    full = trained_state(kind)
    local = nest(shard_local_state(full, layout_of(world, 1, 1), mesh_of(world, 1, 1), rank))
    with CheckpointManager(path, layout=layout_text(tp=world), mesh=f"pp=1 dp=1 tp={world}") as mgr:
        mgr.save(3, local).result()
    return {"names": sorted(full)}


@pytest.mark.parametrize("kind,state_name", [("sgd", "momentum_buffer"),
                                             pytest.param("muon", "momentum_buffer", marks=pytest.mark.slow)])
def test_any_optimizers_state_reshards_with_its_parameter(tmp_path: Path, kind: str, state_name: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (OMP_NUM_THREADS=1): CPU reductions depend on the threads
    try:
        full = trained_state(kind)
    finally:
        torch.set_num_threads(threads)
    (names,) = {tuple(r["names"]) for r in dist.run(2, "tests.reshard.test_any_optimizer:save_trained",
                                                      {"path": str(tmp_path), "kind": kind})}
    assert list(names) == sorted(full)
    weight = "optim/state/model/layers.0.attention.qkv.weight/" + state_name
    assert weight in full  # the fused, tensor-parallel QKV's state under the optimizer's own name
    if kind == "muon":
        assert "optim/state/model/final_norm.weight/exp_avg" in full  # AdamW's, beside Muon's
    assert ucl.validate(tmp_path).ok
    got = ucl.load(tmp_path, flat=True)  # the logical view: every state whole, bit for bit
    assert sorted(n for n in got if n.startswith(("model/", "optim/"))) == sorted(full)
    for n, t in full.items():
        assert torch.equal(got[n], t), n
    for tp in (1, 4):  # saved by tp=2, loaded under other tensor-parallel sizes
        for r in range(tp):
            want = shard_local_state(full, layout_of(tp, 1, 1), mesh_of(tp, 1, 1), r)
            back = ucl.load(tmp_path, layout=layout_of(tp, 1, 1), mesh=mesh_of(tp, 1, 1), rank=r, flat=True)
            for n, t in want.items():
                assert torch.equal(back[n], t), (tp, r, n)
