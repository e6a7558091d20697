"""ucl.adapters.dcp: torch.distributed.checkpoint save/load through ucl steps, resharding, no pickle in the files."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

import ucl
import ucl.adapters.dcp
from ucl.errors import InvalidArgumentError, StepExistsError
from ucl.testing import dist

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")


def full_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(8, 6, generator=g), "emb": torch.randn(7, 5, generator=g).to(torch.bfloat16),
                  "b": torch.arange(6, dtype=torch.int64)},
        "optim": {"state": {0: {"exp_avg": torch.randn(8, 6, generator=g), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0], "name": None}]},
        "step": 17,
    }


def zeros_like_state(s: Any) -> Any:
    if isinstance(s, torch.Tensor):
        return torch.zeros_like(s)
    if isinstance(s, dict):
        return {k: zeros_like_state(v) for k, v in s.items()}
    if isinstance(s, list):
        return [zeros_like_state(v) for v in s]
    return s if isinstance(s, tuple) else (None if s is None else type(s)())


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8)
                           if b.numel() else b), path
    elif isinstance(a, dict):
        assert [str(k) for k in a] == [str(k) for k in b], path
        for (k, v), w in zip(a.items(), b.values(), strict=True):
            assert_same(v, w, f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (v, w) in enumerate(zip(a, b, strict=True)):
            assert_same(v, w, f"{path}/{i}")
    else:
        assert a == b, path


def no_pickle_in(path: os.PathLike[str] | str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                head = fh.read(2)
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), f
            assert not f.endswith((".pkl", ".pt", ".metadata")), f


# -- pure planning ---------------------------------------------------------------------------------
def test_chunk_grid_of_torch_chunk_boxes_is_one_shard_per_box() -> None:
    assert ucl.adapters.dcp.chunk_grid("w", (10, 6), [((0, 0), (4, 6)), ((4, 0), (4, 6)), ((8, 0), (2, 6))]) == (4, 6)
    assert ucl.adapters.dcp.chunk_grid("w", (8, 6), [((0, 0), (8, 3)), ((0, 3), (8, 3))]) == (8, 3)
    boxes = [((r, c), (4, 3)) for r in (0, 4) for c in (0, 3)]
    assert ucl.adapters.dcp.chunk_grid("w", (8, 6), boxes) == (4, 3)
    assert ucl.adapters.dcp.chunk_grid("s", (), [((), ())]) == ()
    assert ucl.adapters.dcp.chunk_grid("e", (0, 4), [((0, 0), (0, 4))]) == (1, 4)
    assert ucl.adapters.dcp.chunk_grid("w", (3,), [((0,), (1,)), ((1,), (1,)), ((2,), (1,)), ((3,), (0,))]) == (1,)


def test_chunk_grid_refines_irregular_boxes() -> None:
    assert ucl.adapters.dcp.chunk_grid("w", (10, 4), [((0, 0), (3, 4)), ((3, 0), (7, 4))]) == (3, 4)
    assert ucl.adapters.dcp.chunk_grid("w", (10,), [((0,), (4,)), ((4,), (6,))]) == (4,)  # [4, 10) is cells 1 and 2


def test_chunk_grid_refuses_holes_overlaps_and_too_fine_grids() -> None:
    with pytest.raises(InvalidArgumentError, match="cover 1 of the 2 cells"):
        ucl.adapters.dcp.chunk_grid("w", (10,), [((0,), (5,))])
    with pytest.raises(InvalidArgumentError, match="overlap at grid cell"):
        ucl.adapters.dcp.chunk_grid("w", (10,), [((0,), (6,)), ((4,), (6,))])
    with pytest.raises(InvalidArgumentError, match="would take 100003 shard files"):
        ucl.adapters.dcp.chunk_grid("w", (100003,), [((0,), (1,)), ((1,), (100002,))])
    with pytest.raises(InvalidArgumentError, match="outside its shape"):
        ucl.adapters.dcp.chunk_grid("w", (4,), [((2,), (4,))])


def test_tree_from_paths_matches_dcp_set_element() -> None:
    tree = ucl.adapters.dcp.tree_from_paths({("a", "x"): {"t": "tensor", "name": "a/x"},
                                             ("l", 2): {"t": "value", "v": 1}})
    assert tree == {"t": "dict", "items": [
        ["a", {"t": "dict", "items": [["x", {"t": "tensor", "name": "a/x"}]]}],
        ["l", {"t": "list", "items": [{"t": "value", "v": None}, {"t": "value", "v": None}, {"t": "value", "v": 1}]}]]}


# -- one process -----------------------------------------------------------------------------------
def test_single_process_round_trip_is_a_valid_ucl_step(tmp_path) -> None:
    state = full_state()
    dcp.save(state, storage_writer=ucl.adapters.dcp.Writer(tmp_path, step=3))
    assert ucl.Repository.open(tmp_path).steps() == [3]
    assert ucl.validate(tmp_path).ok
    no_pickle_in(tmp_path)
    with ucl.open(tmp_path) as ckpt:  # named as ucl.save names nested state
        assert ckpt.keys() == ["model/w", "model/emb", "model/b", "optim/state/0/exp_avg", "optim/state/0/step"]
        assert ckpt["model/w"].meta.chunk_shape == (8, 6)
    got = ucl.load(tmp_path)
    assert got["step"] == 17 and got["optim"]["param_groups"] == [
        {"lr": 0.01, "betas": (0.9, 0.999), "params": [0], "name": None}]
    assert_same(state["model"], got["model"])
    target = zeros_like_state(state)  # DCP loads into a state of the same structure
    assert target["optim"]["param_groups"][0]["lr"] == 0.0
    dcp.load(target, storage_reader=ucl.adapters.dcp.Reader(tmp_path))
    assert_same(state, target)


def test_tensorstore_reads_a_dcp_written_step_as_plain_arrays(tmp_path) -> None:
    import numpy as np
    import tensorstore as ts

    state = full_state()
    dcp.save(state, storage_writer=ucl.adapters.dcp.Writer(tmp_path, step=0))
    a = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{tmp_path}/steps/0/model/w"}}).result()
    assert np.array_equal(a.read().result(), state["model"]["w"].numpy())


def test_reads_steps_written_by_ucl_save_and_the_engine(tmp_path) -> None:
    from ucl.write.manager import CheckpointManager

    state = full_state(1)
    ucl.save(state, tmp_path / "ref", step=5)
    with CheckpointManager(tmp_path / "eng") as mgr:
        mgr.save(9, state).result()
    for path in (tmp_path / "ref", tmp_path / "eng"):
        target = zeros_like_state(state)
        dcp.load(target, storage_reader=ucl.adapters.dcp.Reader(path))
        assert_same(state, target)


def test_partial_and_resharded_reads_serve_only_the_asked_boxes(tmp_path) -> None:
    w = torch.randn(64, 48)
    ucl.save({"w": w}, tmp_path, step=0)
    # a DCP load whose destination is a non-contiguous column block of a bigger tensor
    dest = torch.zeros(48, 64).t()  # non-contiguous (64, 48) view
    dcp.load({"w": dest}, storage_reader=ucl.adapters.dcp.Reader(tmp_path))
    assert torch.equal(dest, w)
    dest16 = {"w": torch.zeros(64, 48, dtype=torch.float64)}  # converted on copy, as DCP's own reader does
    dcp.load(dest16, storage_reader=ucl.adapters.dcp.Reader(tmp_path))
    assert torch.equal(dest16["w"], w.double())


class IrregularPlanner(DefaultSavePlanner):
    """Writes 'w' as two irregular pieces (rows 0-3 and 3-10), as an uneven FSDP shard would."""

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        plan = super().create_local_plan()
        items = []
        for it in plan.items:
            if it.index.fqn != "w":
                items.append(it)
                continue
            for start, n in ((0, 3), (3, 7)):
                td = TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([n, 4])),
                                     properties=it.tensor_data.properties, size=it.tensor_data.size)
                items.append(WriteItem(index=type(it.index)("w", torch.Size([start, 0])), type=WriteItemType.SHARD,
                                       tensor_data=td))
        import dataclasses

        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
        if write_item.index.fqn == "w":
            start = write_item.index.offset[0]
            return self.state_dict["w"][start : start + write_item.tensor_data.chunk.sizes[0]]
        return super().resolve_data(write_item)


def test_irregular_pieces_are_split_into_a_regular_grid(tmp_path) -> None:
    w = torch.randn(10, 4)
    dcp.save({"w": w}, storage_writer=ucl.adapters.dcp.Writer(tmp_path, step=0), planner=IrregularPlanner())
    with ucl.open(tmp_path) as ckpt:
        assert ckpt["w"].meta.chunk_shape == (3, 4)
        assert torch.equal(ckpt["w"][:], w)
    assert ucl.validate(tmp_path).ok


def test_values_that_are_not_json_are_refused_and_nothing_commits(tmp_path) -> None:
    with pytest.raises(BaseException, match=r"DCP value 'cfg' cannot be stored: state dict value at 'v' is a set"):
        dcp.save({"w": torch.ones(2), "cfg": {1, 2}}, storage_writer=ucl.adapters.dcp.Writer(tmp_path, step=0))
    assert ucl.Repository.open(tmp_path).steps() == []
    with pytest.raises(BaseException, match="is a tuple holding tensors, which DCP would pickle"):
        dcp.save({"pair": (torch.ones(2), 1)}, storage_writer=ucl.adapters.dcp.Writer(tmp_path, step=0))


def test_committed_steps_are_never_overwritten_and_step_none_appends(tmp_path) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=ucl.adapters.dcp.Writer(tmp_path, step=0))
    with pytest.raises(BaseException, match="step 0 is already committed") as e:
        dcp.save({"w": torch.zeros(2)}, storage_writer=ucl.adapters.dcp.Writer(tmp_path, step=0))
    assert any(isinstance(x, StepExistsError) for x in _causes(e.value))
    dcp.save({"w": torch.full((2,), 2.0)}, storage_writer=ucl.adapters.dcp.Writer(tmp_path))
    assert ucl.Repository.open(tmp_path).steps() == [0, 1]
    t = {"w": torch.zeros(2)}
    dcp.load(t, storage_reader=ucl.adapters.dcp.Reader(tmp_path, step=0))
    assert torch.equal(t["w"], torch.ones(2))


def _causes(e: BaseException) -> list[BaseException]:
    out = [e]
    failures = getattr(e, "failures", None) or {}
    for v in failures.values():
        out.append(v[0] if isinstance(v, tuple) else v)
    return out


def test_missing_tensor_and_checkpoint_id(tmp_path) -> None:
    ucl.save({"w": torch.ones(3)}, tmp_path / "a", step=2)
    t = {"w": torch.zeros(3)}
    dcp.load(t, checkpoint_id=str(tmp_path / "a"), storage_reader=ucl.adapters.dcp.Reader("/nonexistent"))
    assert torch.equal(t["w"], torch.ones(3))
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict: v"):
        dcp.load({"v": torch.zeros(3)}, storage_reader=ucl.adapters.dcp.Reader(tmp_path / "a"))
    assert ucl.adapters.dcp.Reader.validate_checkpoint_id(str(tmp_path / "a"))
    assert not ucl.adapters.dcp.Reader.validate_checkpoint_id(str(tmp_path / "nope"))


# -- two processes (gloo) --------------------------------------------------------------------------
def sharded_save_then_reshard(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save DTensors sharded Shard(0), load them Shard(1) and compare with the full tensors."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    full = full_state(7)
    state = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full["model"].items()},
             "step": full["step"], "lr": 0.5}
    dcp.save(state, storage_writer=ucl.adapters.dcp.Writer(path, step=1))
    target = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(v.dim() - 1)])
                        for k, v in full["model"].items()}, "step": 0, "lr": 0.0}
    dcp.load(target, storage_reader=ucl.adapters.dcp.Reader(path))
    same = {k: bool(torch.equal(target["model"][k].full_tensor(), v)) for k, v in full["model"].items()}
    local = {k: list(target["model"][k].to_local().shape) for k in full["model"]}
    return {"rank": rank, "same": same, "local": local, "step": target["step"], "lr": target["lr"]}


@pytest.mark.dist
def test_two_process_dtensor_save_loads_with_other_sharding(tmp_path) -> None:
    results = dist.run(2, "tests.adapters.test_dcp:sharded_save_then_reshard", {"path": str(tmp_path)})
    for r in results:
        assert all(r["same"].values()), r
        assert r["step"] == 17 and r["lr"] == 0.5
    assert results[0]["local"]["w"] == [8, 3]
    assert ucl.validate(tmp_path).ok
    no_pickle_in(tmp_path)
    with ucl.open(tmp_path, 1) as ckpt:  # torch.chunk sharding over 2 ranks: one shard per rank
        assert ckpt["model/w"].meta.chunk_shape == (4, 6)
        assert ckpt["model/emb"].meta.chunk_shape == (4, 5)  # 7 rows: 4 + 3
        assert ckpt["model/b"].meta.chunk_shape == (3,)
        assert len([f for f in ckpt.record.files if f.startswith("model/w/c/")]) == 2
    # and replicated, in this single process
    full = full_state(7)
    target = {"model": {k: torch.zeros_like(v) for k, v in full["model"].items()}, "step": 0, "lr": 0.0}
    dcp.load(target, storage_reader=ucl.adapters.dcp.Reader(tmp_path))
    assert_same(full["model"], target["model"])
    assert target["step"] == 17 and target["lr"] == 0.5


def test_loads_a_delta_step_written_by_the_engine(tmp_path) -> None:
    import inspect

    from ucl.write.manager import CheckpointManager

    if "delta" not in inspect.signature(CheckpointManager).parameters:
        pytest.skip("the engine does not write delta steps yet")
    s = full_state(2)
    with CheckpointManager(tmp_path, delta=True) as mgr:
        mgr.save(0, s).result()
        s["model"]["w"][3] += 1
        mgr.save(1, s).result()
    target = zeros_like_state(s)
    dcp.load(target, storage_reader=ucl.adapters.dcp.Reader(tmp_path, step=1))
    assert_same(s, target)


def test_metadata_alone_rebuilds_the_state(tmp_path) -> None:
    """DCP's load-without-a-model path builds the state from Metadata (planner_data) alone."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    ucl.save({"model": {"w": torch.ones(2, 3)}, "opt": {"pg": [{"lr": 0.1, "params": [0]}]}, "n": 4}, tmp_path, step=0)
    sd = _load_state_dict_from_keys(storage_reader=ucl.adapters.dcp.Reader(tmp_path))
    assert torch.equal(sd["model"]["w"], torch.ones(2, 3))
    assert sd["opt"] == {"pg": [{"lr": 0.1, "params": [0]}]} and sd["n"] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_save_and_load(tmp_path) -> None:
    s = {"w": torch.randn(300, 70, device="cuda"), "h": torch.randn(9, device="cuda").half(), "n": 1}
    dcp.save(s, storage_writer=ucl.adapters.dcp.Writer(tmp_path, step=0))
    target = {"w": torch.zeros(300, 70, device="cuda"), "h": torch.zeros(9, device="cuda").half(), "n": 0}
    dcp.load(target, storage_reader=ucl.adapters.dcp.Reader(tmp_path))
    assert torch.equal(target["w"], s["w"]) and torch.equal(target["h"], s["h"]) and target["n"] == 1
    assert torch.equal(ucl.load(tmp_path)["w"], s["w"].cpu())
