"""FSDP2/DTensor: the layout derived from placements, on a fake process group (one process, no I/O)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from ucl.errors import InvalidLayoutError
from ucl.layout import Mesh, format_layout, layout_from_dtensors, mesh_rank
from ucl.plan.layout_save import plan_save
from ucl.testing.layout_reference import shard_local_state

from .helpers import local_shapes


@pytest.fixture
def fake_world():
    """A fake 8-rank world in which this process is global rank 6; destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=6, world_size=8)
    try:
        yield init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def _dtensor(full, mesh, placements):
    coord = mesh.get_coordinate()
    shape, offset = _compute_local_shape_and_global_offset(
        tuple(full.shape), tuple(mesh.mesh.shape), coord, placements
    )
    local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].clone()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def test_layout_from_dtensor_placements(fake_world):
    full = {
        "col": torch.arange(64.0).reshape(16, 4),  # FSDP2 + TP colwise: tp first, then dp
        "row": torch.arange(36.0).reshape(4, 9),  # TP rowwise on dim 1, FSDP on dim 0
        "nested": torch.arange(10.0),  # Shard(0) on both mesh dims: dp first, then tp
        "norm": torch.ones(4),
        "acc": torch.arange(8.0),
    }
    placements = {
        "col": [_StridedShard(0, split_factor=4), Shard(0)],
        "row": [Shard(0), Shard(1)],
        "nested": [Shard(0), Shard(0)],
        "norm": [Replicate(), Replicate()],
        "acc": [Partial(), Shard(0)],
    }
    sd = {"model": {n: _dtensor(full[n], fake_world, placements[n]) for n in full}, "step": torch.tensor(3)}
    layout = layout_from_dtensors(sd)
    assert layout.mesh == Mesh.of(dp=2, tp=4)
    assert format_layout(layout) == (
        "ucl-layout 1\n"
        "mesh dp=2 tp=4\n"
        '"model/col": size(0, 16), shard(0, tp), shard(0, dp)\n'
        '"model/row": size(0, 4), shard(0, dp), size(1, 9), shard(1, tp)\n'
        '"model/nested": size(0, 10), shard(0, dp), shard(0, tp)\n'
        '"model/acc": size(0, 8), shard(0, tp), partial(dp)\n'
    )
    rank = mesh_rank(fake_world)
    assert rank == 6
    want = shard_local_state(
        {f"model/{n}": t for n, t in full.items()} | {"step": torch.tensor(3)}, layout, layout.mesh, rank
    )
    for n, t in sd["model"].items():
        if n != "acc":  # partial: contribution 0 holds the value, the others zero
            assert torch.equal(want[f"model/{n}"], t.to_local()), n
    # the global sizes are declared: a rank plans its save with no other rank's shapes
    local = {f"model/{n}": t.to_local() for n, t in sd["model"].items()}
    plan = plan_save(layout, layout.mesh, rank, local_shapes(local | {"step": torch.tensor(3)}))
    assert plan.arrays["model/col"].shape == (16, 4) and plan.arrays["model/col"].logical == {}
    col = next(w for w in plan.writes if w.array.name == "model/col")  # blocks in tp-major order
    assert col.chunk_index == (5, 0) and col.stored_box == ((10, 0), (2, 4))  # rank (dp 1, tp 2)
    assert plan.arrays["model/nested"].shape == (16,)  # 10 -> 5, 5 -> 2,2,1,0 each: 8 blocks of 2
    assert plan.arrays["model/row"].shape == (4, 9) and plan.arrays["model/row"].logical == {}


def test_uneven_strided_shards_are_refused(fake_world):
    t = _dtensor(torch.zeros(10, 4), fake_world, [_StridedShard(0, split_factor=4), Shard(0)])
    with pytest.raises(InvalidLayoutError, match=r"_StridedShard of dim 0 \(10 over 4 \* 2\) is uneven"):
        layout_from_dtensors({"w": t})
