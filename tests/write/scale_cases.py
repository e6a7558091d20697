"""Bodies of the many-rank tests (run on every rank by ucl.testing.dist): a layout save of tp=4 x dp
through the CheckpointManager, on the coordinator path a large job takes (tests/write/test_many_ranks.py)."""

from __future__ import annotations

from typing import Any

import torch

import ucl
from tests.reshard.gptstate import nest  # the state as a training loop holds it
from ucl.layout import Mesh, parse_layout
from ucl.testing.layout_reference import shard_local_state
from ucl.write.manager import CheckpointManager

TP = 4


def layout_text(uneven: bool) -> str:
    # uneven: "emb" has 10 rows over tp=4 (blocks 3, 3, 3, 1) and no declared size, so no rank alone
    # knows its logical shape: the compact protocol cannot verify it and the full one infers it
    return (
        "ucl-layout 1\n"
        '"emb": shard(0, tp)\n'
        '"l.*.w": shard(1, tp)\n'
        '"l.*.b": replicate\n'
        'flat "flat/{state}" -> "opt/{member}/{state}" over dp align 4: [\n'
        '    "l.0.w" [8, 12], "l.1.w" [8, 12]]\n'
        '"opt/**": shard(1, tp)\n'
    )


def full_state(uneven: bool, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {"emb": torch.randn(10 if uneven else 12, 6, generator=g)}
    for i in range(2):
        out[f"l.{i}.w"] = torch.randn(8, 12, generator=g)
        out[f"l.{i}.b"] = torch.randn(8, generator=g)
        out[f"opt/l.{i}.w/exp_avg"] = torch.randn(8, 12, generator=g)
    return out


def save_many(rank: int, world: int, path: str, uneven: bool) -> dict[str, Any]:
    text = layout_text(uneven)
    layout, mesh = parse_layout(text), Mesh.of(dp=world // TP, tp=TP)
    exact = True
    protocols = []
    with CheckpointManager(path, layout=text, mesh=f"dp={world // TP} tp={TP}") as mgr:
        for step in (1, 2):  # the second save reuses the first's plan: no planning collective
            local = shard_local_state(full_state(uneven, step), layout, mesh, rank)
            mgr.save(step, nest(local)).result()
            protocols.append(mgr._planner.protocol)
    got = ucl.load(path, layout=text, mesh=f"dp={world // TP} tp={TP}", flat=True)  # rank from the group
    exact &= sorted(got) == sorted(local) and all(torch.equal(got[n], local[n]) for n in local)
    out: dict[str, Any] = {"protocols": protocols, "exact": exact}
    if rank == 0:  # the logical tensors, as any reader sees them
        with ucl.open(path) as ckpt:
            want = full_state(uneven, 2)
            logical = ckpt.load(flat=True)
            same = all(torch.equal(logical[n], want[n]) for n in want)
            out["logical"] = sorted(want) == sorted(logical) and same
    return out
