"""Save a small GPT (fused QKV with GQA, gate/up, padded vocabulary, AdamW state, ZeRO flat buffers for
dp > 1) under each (tp, pp, dp) of CONFIGS on real processes, then load every step into every config and
into one process: bit-exact against the single-process reference, and training resumed from the
resharded state takes the same next step (same loss, bit for bit) as the uninterrupted run.

Process budget: one 2-rank and one 4-rank run save every source (each with its own CheckpointManager)
and load the sources into the targets of their world size; the full matrix is checked in this process
(loads need no collective), each (source, target) pair its own test.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ucl
import ucl.adapters.zarr_store
from ucl.testing import dist
from ucl.testing.layout_reference import shard_local_state, unshard

from .gptstate import CONFIGS, ONE, digest, layout_of, mesh_of, next_loss

NAMES = {cfg: "tp{}pp{}dp{}".format(*cfg) for cfg in [*CONFIGS, ONE]}
TARGETS = [*CONFIGS, ONE]


@pytest.fixture(scope="module")
def saved(ref: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("reshard-steps"))
    r2 = dist.run(2, "tests.reshard.cases:save_sources", {"root": root, "ref": ref["path"]})
    r4 = dist.run(4, "tests.reshard.cases:save_sources", {"root": root, "ref": ref["path"]})
    return {"root": root, "ranks": {2: r2, 4: r4}}


def _path(saved: dict[str, Any], cfg: Any) -> str:
    return os.path.join(saved["root"], NAMES[cfg])


def _world(cfg: Any) -> int:
    return cfg[0] * cfg[1] * cfg[2]


@pytest.mark.dist
@pytest.mark.parametrize("src", CONFIGS, ids=[NAMES[c] for c in CONFIGS])
def test_each_source_is_one_valid_step_recording_its_layout(saved: dict[str, Any], src: Any) -> None:
    path = _path(saved, src)
    assert ucl.validate(path).ok
    with ucl.open(path) as ckpt:
        assert ckpt.layout == layout_of(*src) and ckpt.mesh == mesh_of(*src)
        assert ckpt.meta.kind == "full" and ckpt.step == 2
    ranks = saved["ranks"][_world(src)]
    writes = [w for r in ranks for w in r["saved"][NAMES[src]]["writes"]]
    assert len(writes) == len(set(writes))  # every chunk written by exactly one rank
    assert all(r["saved"][NAMES[src]]["writes"] for r in ranks)  # and every rank writes
    assert all(r["saved"][NAMES[src]]["restored"] for r in ranks)  # CheckpointManager.restore: its own state


@pytest.mark.dist
@pytest.mark.parametrize("src", CONFIGS, ids=[NAMES[c] for c in CONFIGS])
def test_logical_tensors_and_resumed_training(saved: dict[str, Any], ref: dict[str, Any], src: Any) -> None:
    """ucl.open/ucl.load present the logical state (padding dropped, fused parts and flat fragments
    reassembled); one process resumes from it with the uninterrupted run's next loss, bit for bit."""
    path = _path(saved, src)
    state = ucl.load(path)
    assert state["optim"]["step"] == ref["step"]
    flat = ucl.load(path, flat=True)
    assert sorted(flat) == sorted(ref["state"])
    for n, t in ref["state"].items():
        assert torch.equal(flat[n], t), n
    with ucl.open(path) as ckpt:
        assert sorted(ckpt.keys()) == sorted(ref["state"])
        qkv = ckpt["model/layers.1.attention.qkv.weight"]
        assert torch.equal(qkv[70:90, 3:9], ref["state"]["model/layers.1.attention.qkv.weight"][70:90, 3:9])
    loss = next_loss(flat, ref["step"])
    assert loss == ref["next_loss"]


@pytest.mark.dist
@pytest.mark.parametrize("tgt", TARGETS, ids=[NAMES[c] for c in TARGETS])
@pytest.mark.parametrize("src", CONFIGS, ids=[NAMES[c] for c in CONFIGS])
def test_reshard_every_rank_bit_exact(saved: dict[str, Any], ref: dict[str, Any], src: Any, tgt: Any) -> None:
    layout, mesh = layout_of(*tgt), mesh_of(*tgt)
    with ucl.open(_path(saved, src)) as ckpt:
        for rank in range(mesh.size):
            want = shard_local_state(ref["state"], layout, mesh, rank)
            got = ucl.load(ckpt, layout=layout, mesh=mesh, rank=rank, flat=True)
            assert sorted(got) == sorted(want)
            for n, t in want.items():
                assert got[n].shape == t.shape and torch.equal(got[n], t), (n, rank)


@pytest.mark.dist
def test_multiprocess_loads_agree(saved: dict[str, Any], ref: dict[str, Any]) -> None:
    """Each rank of the 2- and 4-process runs loaded its own shard of every source (rank from the group)."""
    checked = 0
    for world, results in saved["ranks"].items():
        for rank, r in enumerate(results):
            for pair, digests in r["loaded"].items():
                tgt = next(c for c in CONFIGS if NAMES[c] == pair.split("->")[1])
                assert _world(tgt) == world
                want = shard_local_state(ref["state"], layout_of(*tgt), mesh_of(*tgt), rank)
                assert digests == {n: digest(t) for n, t in want.items()}, pair
                checked += 1
    assert checked >= 5 * 2 * 3  # 2-rank targets from the 2-rank sources, and all 5 sources on 4 ranks


@pytest.mark.dist
@pytest.mark.parametrize(
    ("src", "tgt"), [((2, 2, 1), (1, 1, 2)), ((1, 1, 2), (4, 1, 1))], ids=["tp2pp2-to-dp2", "dp2-to-tp4"]
)
def test_resharded_ranks_reassembled_resume_training(
    saved: dict[str, Any], ref: dict[str, Any], src: Any, tgt: Any
) -> None:
    """Load every rank of another config (ZeRO flat buffers, padded vocabulary shards), reassemble with
    unshard, resume: the same next loss as the uninterrupted run."""
    layout, mesh = layout_of(*tgt), mesh_of(*tgt)
    with ucl.open(_path(saved, src)) as ckpt:
        ranks = [ucl.load(ckpt, layout=layout, mesh=mesh, rank=r, flat=True) for r in range(mesh.size)]
    shapes = {n: tuple(t.shape) for n, t in ref["state"].items()}
    full = unshard(ranks, layout, mesh, shapes=shapes)
    assert all(torch.equal(full[n], t) for n, t in ref["state"].items())
    assert next_loss(full, ref["step"]) == ref["next_loss"]


@pytest.mark.dist
def test_load_into_fills_existing_tensors_in_place(saved: dict[str, Any], ref: dict[str, Any]) -> None:
    layout, mesh = layout_of(2, 2, 1), mesh_of(2, 2, 1)
    for rank in range(mesh.size):
        want = shard_local_state(ref["state"], layout, mesh, rank)
        dest = {n: torch.full_like(t, 7.0) for n, t in want.items()}  # padding must come back as zeros
        ptrs = {n: t.data_ptr() for n, t in dest.items()}
        ucl.load_into(_path(saved, (1, 1, 2)), dest, layout=layout, mesh=mesh, rank=rank)
        assert {n: t.data_ptr() for n, t in dest.items()} == ptrs
        assert all(torch.equal(dest[n], want[n]) for n in want)
    # a subset (the model only), in another dtype
    want = shard_local_state(ref["state"], layout, mesh, 1)
    model = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in want.items() if n.startswith("model/")}
    ucl.load_into(_path(saved, (4, 1, 1)), model, layout=layout, mesh=mesh, rank=1)
    assert all(torch.equal(model[n], want[n].double()) for n in model)


@pytest.mark.dist
def test_zarr_view_presents_logical_tensors(saved: dict[str, Any], ref: dict[str, Any]) -> None:
    import numpy as np
    import zarr

    with ucl.adapters.zarr_store.ZarrStore(_path(saved, (2, 2, 1))) as store:
        group = zarr.open_group(store, mode="r")
        for n in [
            "model/embedding.word_embeddings.weight",
            "model/layers.1.attention.qkv.weight",
            "optim/state/model/layers.0.mlp.gate_up.weight/exp_avg_sq",
        ]:
            a = group[n]
            assert a.shape == tuple(ref["state"][n].shape)
            assert np.array_equal(a[...], ref["state"][n].numpy())
