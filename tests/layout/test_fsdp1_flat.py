"""PyTorch FSDP1's FlatParameters through ``fsdp1_flat``, against the real thing: gloo ranks wrap a model in
``FullyShardedDataParallel`` (CPU, one unit per block, with and without ``use_orig_params``), take one
Adam step, and save each unit's flat shard and its optimizer states as FSDP holds them. The step's
logical tensors are FSDP's own full state dicts, bit for bit; it loads under other world sizes (checked
against a reference written from torch/distributed/fsdp/_flat_param.py, torch 2.13) and as DeepSpeed
ZeRO partitions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from ucl.layout import Mesh
from ucl.layout.builtins import deepspeed_zero, fsdp1_flat
from ucl.testing import dist

from . import deepspeed_zero as ds_ref
from .test_megatron_distopt import assert_same

STATES = ("exp_avg", "exp_avg_sq")


def make_model() -> torch.nn.Module:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(6, 7)  # odd sizes: members straddle shards, starts need aligning
            self.norm = torch.nn.LayerNorm(7)
            self.out = torch.nn.Linear(7, 6, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.out(torch.tanh(self.norm(self.fc(x))))

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(11, 6), Block(), Block(), torch.nn.Linear(6, 5))


def units_of(fsdp: Any) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(module path, [(name in it, shape)]) of each FSDP unit, from FSDP's own FlatParameter metadata."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = []
    for name, mod in fsdp.named_modules():
        if isinstance(mod, FSDP) and mod._handle is not None:
            path = ".".join(p for p in name.split(".") if p != "_fsdp_wrapped_module")
            fp = mod._handle.flat_param
            out.append((path, [(n, tuple(s)) for n, s in zip(fp._fqns, fp._shapes, strict=True)]))
    return out


def save_fsdp1(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ucl.write.manager import CheckpointManager

    model = make_model()
    block = type(model[1])
    for orig in (False, True):
        f = FSDP(
            make_model(),
            device_id=torch.device("cpu"),
            use_orig_params=orig,
            auto_wrap_policy=ModuleWrapPolicy({block}),
        )
        opt = torch.optim.Adam(f.parameters(), lr=0.1)
        f(torch.tensor([[1, 4, 9], [2, 3, 10]])).pow(2).sum().backward()
        opt.step()
        units = units_of(f)
        local: dict[str, torch.Tensor] = {}
        for (path, _), mod in zip(
            units, [m for m in f.modules() if isinstance(m, FSDP) and m._handle], strict=True
        ):
            fp = mod._handle.flat_param
            name = f"{path}._flat_param" if path else "_flat_param"
            local[f"model/{name}"] = fp.detach().clone()
            for s in STATES:
                if not orig:
                    local[f"optim/flat/{name}/{s}"] = opt.state[fp][s].clone()
                    continue
                # use_orig_params: the optimizer holds each parameter's piece of the shard; put them
                # where FSDP's shard metadata says they are
                flat = torch.zeros_like(fp.detach())
                for p, info in zip(fp._params, fp._shard_param_infos, strict=True):
                    if info.in_shard and p in opt.state:
                        flat[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard] = opt.state[
                            p
                        ][s].reshape(-1)
                local[f"optim/flat/{name}/{s}"] = flat
        path = Path(root) / f"orig{int(orig)}"
        with CheckpointManager(
            path, layout=fsdp1_flat(units, use_orig_params=orig), mesh=Mesh.of(fsdp=world)
        ) as mgr:
            mgr.save(1, local).result()
        with FSDP.state_dict_type(
            f,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=False),
            FullOptimStateDictConfig(rank0_only=False),
        ):
            sd, osd = f.state_dict(), FSDP.optim_state_dict(f, opt)
        if rank == 0:  # FSDP's own unsharded view, for the test to compare the logical tensors with
            full = {f"model/{n}": t for n, t in sd.items()}
            full.update({f"optim/state/{n}/{s}": st[s] for n, st in osd["state"].items() for s in STATES})
            torch.save({"full": full, "units": units}, Path(root) / f"orig{int(orig)}.pt")
    return {"rank": rank}


@pytest.fixture(scope="module")
def fsdp1_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fsdp1")
    dist.run(3, "tests.layout.test_fsdp1_flat:save_fsdp1", {"root": str(root)})
    return root


def reference_shard(members: list[torch.Tensor], world: int, rank: int, orig: bool) -> torch.Tensor:
    """FlatParamHandle: members flattened in order (with use_orig_params each start padded to 16 bytes and
    the total to a multiple of the world size), then ``_get_shard``: chunk ``rank`` of ``world``, padded
    with zeros to the first chunk's size."""
    parts, total = [], 0
    align = 16 // members[0].element_size()
    for t in members:
        if orig and total % align:
            parts.append(torch.zeros(align - total % align, dtype=t.dtype))
            total += align - total % align
        parts.append(t.reshape(-1))
        total += t.numel()
    if orig and total % world:
        parts.append(torch.zeros(world - total % world, dtype=members[0].dtype))
    chunks = torch.cat(parts).chunk(world)
    chunk = chunks[rank] if rank < len(chunks) else chunks[0].new_empty(0)
    return torch.nn.functional.pad(chunk, [0, chunks[0].numel() - chunk.numel()])


@pytest.mark.dist
@pytest.mark.parametrize("orig", [False, True])
def test_fsdp1_flat_parameters_are_fsdps_own_tensors(fsdp1_steps: Path, orig: bool) -> None:
    path, saved = fsdp1_steps / f"orig{int(orig)}", torch.load(fsdp1_steps / f"orig{int(orig)}.pt")
    full, units = saved["full"], saved["units"]
    if orig:
        # the same model, data and step: the optimizer states are use_orig_params=False's. (FSDP's own
        # optim_state_dict with use_orig_params=True returns exp_avg_sq's values as exp_avg here, torch
        # 2.13 on CPU with gloo, so it cannot be the reference.)
        base = torch.load(fsdp1_steps / "orig0.pt")["full"]
        full = {n: base[n] if n.startswith("optim/") else t for n, t in full.items()}
    assert ucl.validate(path).ok
    assert_same(ucl.load(path, flat=True), full, "the logical view: FSDP's full state dicts")
    for world in (1, 2, 4, 5):  # another world size, and the other use_orig_params
        for other in (False, True):
            layout, mesh = fsdp1_flat(units, use_orig_params=other), Mesh.of(fsdp=world)
            for rank in sorted({0, world - 1}):
                want = {}
                for unit, members in units:
                    name = f"{unit}._flat_param" if unit else "_flat_param"
                    fqns = [f"{unit}.{n}" if unit else n for n, _ in members]
                    want[f"model/{name}"] = reference_shard(
                        [full[f"model/{n}"] for n in fqns], world, rank, other
                    )
                    for s in STATES:
                        want[f"optim/flat/{name}/{s}"] = reference_shard(
                            [full[f"optim/state/{n}/{s}"] for n in fqns], world, rank, other
                        )
                got = ucl.load(path, layout=layout, mesh=mesh, rank=rank, flat=True)
                assert_same(got, want, f"fsdp={world} use_orig_params={other} rank {rank}")
    # the optimizer state as DeepSpeed ZeRO-2 partitions over dp=2 (one group: every parameter in order)
    group = [(f"{u}.{n}" if u else n, s) for u, members in units for n, s in members]
    layout = deepspeed_zero([group], stage=2, axes=("fsdp",)).merged()
    got = ucl.load(
        path,
        layout=layout,
        mesh=Mesh.of(fsdp=2),
        rank=1,
        tensors=[f"optim/state/{n}/{s}" for n, _ in group for s in STATES],
        flat=True,
    )
    for s in STATES:
        want = ds_ref.stage12_partition([full[f"optim/state/{n}/{s}"] for n, _ in group], 2, 1)
        assert torch.equal(got[f"optim/flat/group0/{s}"], want)
