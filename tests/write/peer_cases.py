"""Cases run on real gloo processes by tests/write/test_peers.py (ucl.testing.dist.run): a memory tier
spread over "nodes" (groups of ranks, each with its own part directory) under a Megatron-style layout, so
that ranks hold different shards and some of what a node reads was written by another node."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

from ucl import CheckpointManager
from ucl.errors import InvalidArgumentError, StepExistsError
from ucl.layout import Mesh, parse_layout
from ucl.testing import gpt
from ucl.testing.layout_reference import shard_local_state
from ucl.write.tiers import ArchiveTier, MemoryTier

CONFIG = gpt.PRESETS["tiny"].replace(vocab=500, n_kv_heads=2)


def _template() -> dict[str, torch.Tensor]:
    """The names and shapes of gpt.logical_state (parameters and AdamW's two states)."""
    model, _ = gpt.make_model_and_optimizer(CONFIG, seed=0)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"model/{name}"] = p
        out[f"optim/state/model/{name}/exp_avg"] = out[f"optim/state/model/{name}/exp_avg_sq"] = p
    return out


def full_state(step: int) -> dict[str, torch.Tensor]:
    """The whole logical state at ``step`` (every tensor drawn from the step's seed)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(t.shape, generator=g).to(t.dtype) for n, t in sorted(_template().items())}


def _layout(tp: int, dp: int) -> tuple[str, Mesh]:
    return gpt.layout_text(CONFIG, tp=tp, dp=dp, vocab_multiple=24), Mesh.of(pp=1, dp=dp, tp=tp)


def local_state(step: int, rank: int, tp: int, dp: int) -> dict[str, torch.Tensor]:
    text, mesh = _layout(tp, dp)
    return shard_local_state(full_state(step), parse_layout(text), mesh, rank)


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in flat.items():
        node = out
        *head, last = name.split("/")
        for p in head:
            node = node.setdefault(p, {})
        node[last] = v
    return out


def _manager(disk: str, mem: str, rpn: int, tp: int, dp: int, peers: int = 1,
             archive: str | None = None) -> CheckpointManager:
    text, mesh = _layout(tp, dp)
    tier = MemoryTier(mem, keep_last=2, drain_every=2, ranks_per_node=rpn, peers=peers)
    return CheckpointManager(disk, keep_last=3, layout=text, mesh=mesh, memory=tier,
                             archive=ArchiveTier(archive, every=2) if archive else None)


def save(rank: int, world: int, disk: str, mem: str, rpn: int, tp: int, dp: int, steps: int,
         kill: bool = False, peers: int = 1, archive: str | None = None) -> Any:
    """Save steps 0..steps-1 (drain_every=2); with ``kill``, SIGKILL this process once they committed."""
    text, mesh = _layout(tp, dp)
    try:  # refused on every rank before anything is written: delta chains would span the nodes' parts
        CheckpointManager(disk, layout=text, mesh=mesh, delta=True,
                          memory=MemoryTier(mem, ranks_per_node=rpn, peers=peers))
    except InvalidArgumentError as e:
        assert "spread over nodes" in str(e)
    else:
        raise AssertionError("delta= with a memory tier spread over nodes was accepted")
    mgr = _manager(disk, mem, rpn, tp, dp, peers, archive)
    for s in range(steps):
        mgr.save(s, _nest(local_state(s, rank, tp, dp))).result()
    mgr.wait()
    if kill:
        mgr._ctl.barrier()  # every rank's saves are done: then the whole job dies at once
        os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    return True


def restore(rank: int, world: int, disk: str, mem: str, rpn: int, tp: int, dp: int, then_save: int = -1,
            peers: int = 1, archive: str | None = None) -> Any:
    """A fresh job restores; each rank checks its local state bit for bit against the reference."""
    with _manager(disk, mem, rpn, tp, dp, peers, archive) as mgr:
        latest = mgr.latest_step()
        out = _flat(mgr.restore())
        rep = mgr.last_restore
        assert rep is not None and rep.step is not None
        want = local_state(rep.step, rank, tp, dp)
        exact = out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in want)
        if then_save >= 0:  # training goes on from the restored step
            mgr.save(then_save, _nest(local_state(then_save, rank, tp, dp))).result()
            mgr.wait()
        steps = mgr.steps()
    return {"step": rep.step, "tier": rep.tier, "exact": exact, "reasons": rep.reasons, "latest": latest,
            "steps": steps}


def restore_step_then_save(rank: int, world: int, disk: str, mem: str, rpn: int, tp: int, dp: int, step: int,
                           save: int, archive: str | None = None) -> Any:
    """Restore an older ``step`` explicitly, then save ``save``, which some node's part already holds: every
    rank refuses it alike (the parts differ: a replaced node's lacks it)."""
    with _manager(disk, mem, rpn, tp, dp, archive=archive) as mgr:
        mgr.restore(step)
        rep = mgr.last_restore
        try:
            mgr.save(save, _nest(local_state(save, rank, tp, dp))).result()
        except StepExistsError:
            refused = True
        else:
            refused = False
        assert rep is not None
        return {"tier": rep.tier, "step": rep.step, "refused": refused, "steps": mgr.steps()}


def tree(rank: int, world: int) -> Any:
    """Collectives.tree_send to some of the ranks, out of order, down a tree three levels deep."""
    from ucl.write.collectives import Collectives

    c = Collectives.make(None, 60.0)
    got = c.tree_send({"docs": b"x" * 100_000, "n": 7} if rank == 0 else None, [5, 2, 4, 1, 6])
    c.close()
    return None if got is None else [len(got["docs"]), got["n"]]
