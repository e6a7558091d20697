"""Bodies of the multi-process resharding tests (run on every rank by ucl.testing.dist)."""

from __future__ import annotations

import os
from typing import Any

import torch

import ucl
from ucl.testing.layout_reference import shard_local_state
from ucl.write.manager import CheckpointManager

from .gptstate import CONFIGS, digest, layout_of, layout_text, mesh_of, nest


def _name(cfg: Any) -> str:
    return "tp{}pp{}dp{}".format(*cfg)


def _local(ref: dict[str, Any], cfg: Any, rank: int) -> dict[str, Any]:
    state = nest(shard_local_state(ref["state"], layout_of(*cfg), mesh_of(*cfg), rank))
    state.setdefault("optim", {})["step"] = ref["step"]
    return state


def save_sources(rank: int, world: int, root: str, ref: str, load_targets: bool = True) -> dict[str, Any]:
    """Save every source config with ``world`` ranks (one CheckpointManager each, the layout given as text),
    check the manager's restore, then load every saved source into every target config of ``world`` ranks."""
    reference = torch.load(ref)
    out: dict[str, Any] = {"saved": {}, "loaded": {}}
    for cfg in CONFIGS:
        tp, pp, dp = cfg
        if tp * pp * dp != world:
            continue
        path = os.path.join(root, _name(cfg))
        state = _local(reference, cfg, rank)
        with CheckpointManager(
            path, layout=layout_text(tp=tp, pp=pp, dp=dp), mesh=f"pp={pp} dp={dp} tp={tp}"
        ) as mgr:
            mgr.save(reference["step"], state).result()
            plan = next(iter(mgr._plans.values()))
            back = mgr.restore()
        flat_back = _flat(back)
        want = _flat(state)
        out["saved"][_name(cfg)] = {
            "writes": sorted(f"{w.array.name}@{list(w.coords)}" for w in plan.writes),
            "restored": sorted(flat_back) == sorted(want)
            and all(
                torch.equal(flat_back[n], want[n])
                if isinstance(want[n], torch.Tensor)
                else flat_back[n] == want[n]
                for n in want
            ),
        }
    if not load_targets:
        return out
    for tgt in CONFIGS:
        if tgt[0] * tgt[1] * tgt[2] != world:
            continue
        for src in CONFIGS:
            path = os.path.join(root, _name(src))
            if not os.path.exists(os.path.join(path, "commits")):
                continue
            got = ucl.load(path, layout=layout_of(*tgt), mesh=mesh_of(*tgt), flat=True)  # rank from the group
            out["loaded"][f"{_name(src)}->{_name(tgt)}"] = {n: digest(t) for n, t in got.items()}
    return out


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def bad_layouts(rank: int, world: int, root: str, ref: str) -> dict[str, Any]:
    """Each bad layout fails on every rank with its error before any byte is written; the manager then
    still saves a good state."""
    reference = torch.load(ref)
    cfg = (2, 1, 1)
    good = layout_text(tp=2)
    state = _local(reference, cfg, rank)
    out: dict[str, Any] = {}

    def attempt(case: str, layout: str, mesh: str, st: dict[str, Any], then_good: bool = False) -> None:
        path = os.path.join(root, case)
        try:
            with CheckpointManager(path, layout=layout, mesh=mesh) as mgr:
                try:
                    mgr.save(1, st).result()
                    out[case] = {"error": None}
                except ucl.UCLError as e:
                    out[case] = {"error": e.code, "message": e.message}
                if then_good:
                    mgr.save(2, state).result()  # the same manager, the right state: committed
                    out[case]["then"] = mgr.steps()
        except ucl.UCLError as e:  # refused by the constructor
            out[case] = {"error": e.code, "message": e.message}

    attempt("unmatched", good + '"**nonexistent.weight": shard(0, tp)\n', "pp=1 dp=1 tp=2", state)
    attempt("overlap", good + '"**layers.*.attention.qkv.weight": shard(0, tp)\n', "pp=1 dp=1 tp=2", state)
    fused = good.replace("fused(0, q=8x8", "fused(0, q=6x8")
    attempt("fused_size", fused, "pp=1 dp=1 tp=2", state)
    bad_state = _flat(state)
    if rank == 1:  # rank 1 holds one column too many: 32 + 33 columns do not split as torch.chunk would
        n = "model/layers.1.attention.dense.weight"  # (33 + 32), which rank 0 sees; every rank must fail
        bad_state[n] = torch.cat([bad_state[n], bad_state[n][:, :1]], 1)
    attempt("rank_shape", good, "pp=1 dp=1 tp=2", nest(bad_state), then_good=True)
    attempt("mesh_world", good, "pp=1 dp=1 tp=4", state)
    attempt("mesh_axis", good, "dp=1 tp=2", state)
    return out


def dtensor_roundtrip(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save DTensors sharded one way (layout derived from placements), load them into DTensors sharded
    another way, in place; also into plain tensors of a Megatron-like target and the logical view."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    g = torch.Generator().manual_seed(0)
    full = {
        "w": torch.randn(7, 10, generator=g),
        "v": torch.randn(12, 6, generator=g),
        "b": torch.randn(5, generator=g),
        "n": torch.randn(3, 3, generator=g),
    }
    src = {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "v": distribute_tensor(full["v"], mesh, [Shard(1)]),
            "b": distribute_tensor(full["b"], mesh, [Replicate()]),
            "n": full["n"].clone(),
        },
        "step": 3,
    }
    path = os.path.join(root, "dtensor")
    with CheckpointManager(path, layout="dtensor") as mgr:
        mgr.save(3, src).result()
    dst = {
        "model": {
            "w": distribute_tensor(torch.zeros(7, 10), mesh, [Shard(1)]),
            "v": distribute_tensor(torch.zeros(12, 6), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.zeros(5), mesh, [Shard(0)]),
            "n": torch.zeros(3, 3),
        }
    }
    ucl.load_into(path, dst, layout="dtensor")
    ok = {
        k: bool(
            torch.equal(
                dst["model"][k].full_tensor() if hasattr(dst["model"][k], "full_tensor") else dst["model"][k],
                full[k],
            )
        )
        for k in full
    }
    logical = ucl.load(path, flat=True)
    ok["logical"] = (
        all(torch.equal(logical[f"model/{k}"], full[k]) for k in full) and ucl.open(path).layout is not None
    )
    return ok


def perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The next step's logical state in the delta test: layer 0 changed, the rest as before."""
    return {n: t + 1 if "layers.0." in n else t.clone() for n, t in state.items()}


def delta_steps(rank: int, world: int, root: str, ref: str) -> dict[str, Any]:
    """A layout save with delta=True: the second step is a delta against the first, chunk by chunk."""
    reference = torch.load(ref)
    cfg = (2, 1, 1)
    path = os.path.join(root, "delta")
    nxt = dict(reference, state=perturbed(reference["state"]), step=reference["step"] + 1)
    with CheckpointManager(path, layout=layout_of(*cfg), mesh=mesh_of(*cfg), delta=True) as mgr:
        mgr.save(2, _local(reference, cfg, rank)).result()
        mgr.save(3, _local(nxt, cfg, rank)).result()
        back = _flat(mgr.restore(3))
    want = _flat(_local(nxt, cfg, rank))
    return {
        "restored": all(
            torch.equal(back[n], t) if isinstance(t, torch.Tensor) else back[n] == t for n, t in want.items()
        )
    }
