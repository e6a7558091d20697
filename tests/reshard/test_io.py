"""Resharding in one process: what a target rank reads, the memory bound, partial sums, blocked (uneven
nested) arrays, single-process saves under a layout, and errors before any byte is written."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

import ucl
from ucl.errors import (
    InconsistentMetadataError,
    InvalidArgumentError,
    LayoutShapeError,
    MeshMismatchError,
    OverlappingRulesError,
    TensorNotFoundError,
    UnmatchedPatternError,
)
from ucl.format.shardfile import index_nbytes
from ucl.layout import Mesh, parse_layout
from ucl.plan.items import ArraySpec
from ucl.plan.layout_load import LogicalIndex
from ucl.read.load import load_plan
from ucl.testing.layout_reference import shard_local_state
from ucl.write.manager import CheckpointManager
from ucl.write.save import save_sharded


def _layout(*rules: str) -> Any:
    return parse_layout("ucl-layout 1\n" + "".join(r + "\n" for r in rules))


def _full(**shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {n.replace("__", "/"): torch.randn(*s, generator=g) for n, s in shapes.items()}


def _save(path: Any, full: dict[str, torch.Tensor], layout: Any, mesh: Mesh, step: int = 0) -> None:
    save_sharded(
        [shard_local_state(full, layout, mesh, r) for r in range(mesh.size)],
        path,
        step,
        layout=layout,
        mesh=mesh,
    )


def _check_all(path: Any, full: dict[str, torch.Tensor], layout: Any, mesh: Mesh, **kw: Any) -> None:
    for r in range(mesh.size):
        want = shard_local_state(full, layout, mesh, r)
        got = ucl.load(path, layout=layout, mesh=mesh, rank=r, flat=True, **kw)
        assert sorted(got) == sorted(want)
        for n in want:
            assert torch.equal(got[n], want[n]), (n, r)


def _index_bytes(ckpt: Any) -> int:
    return sum(index_nbytes(a.n_inner) * math.prod(a.grid) for a in ckpt.meta.arrays.values())


@pytest.mark.parametrize(
    ("src", "dst"),
    [("shard(0, tp)", "shard(0, tp)"), ("shard(1, tp)", "shard(1, tp)"), ("shard(1, tp)", "shard(0, tp)")],
    ids=["rows", "columns", "col-to-row"],
)
@pytest.mark.parametrize(("k_src", "k_dst"), [(2, 4), (4, 2), (2, 8), (1, 4)])
def test_a_target_rank_reads_its_shard_and_indexes_only(
    tmp_path: Any, src: str, dst: str, k_src: int, k_dst: int
) -> None:
    full = _full(w=(1024, 1024))
    _save(tmp_path, full, _layout(f'"w": {src}'), Mesh.of(tp=k_src))
    target, mesh = _layout(f'"w": {dst}'), Mesh.of(tp=k_dst)
    for rank in (0, k_dst - 1):
        with ucl.open(tmp_path) as ckpt:
            got = ucl.load(ckpt, layout=target, mesh=mesh, rank=rank, flat=True)
            need = got["w"].numel() * 4
            assert ckpt.bytes_read <= 1.1 * need + _index_bytes(ckpt), (ckpt.bytes_read, need)
        assert torch.equal(got["w"], shard_local_state(full, target, mesh, rank)["w"])


def test_memory_bound_splits_reads_and_stays_exact(tmp_path: Any) -> None:
    """A tiny buffer forces every box through many small temporaries: same bytes in the end."""
    full = _full(w=(96, 80), v=(30, 7), optim__state__w__m=(96, 80))
    layout = _layout('"w", "optim/state/w/*": shard(1, tp)', '"v": shard(0, dp*tp)')
    mesh = Mesh.of(dp=2, tp=2)
    _save(tmp_path, full, layout, mesh)
    target = _layout('"w", "optim/state/w/*": shard(0, tp)', '"v": shard(1, tp)')
    for budget in (1, 1000, 64 << 20):
        _check_all(tmp_path, full, target, Mesh.of(tp=3), buffer_bytes=budget)
    zero = parse_layout(
        'ucl-layout 1\n"w": shard(1, tp)\n"v": shard(0, tp)\n'
        'flat "optim/flat/{state}" -> "optim/state/{member}/{state}" over dp: ["w" [96, 80]]\n'
    )
    _check_all(tmp_path, full, zero, Mesh.of(dp=3, tp=2), buffer_bytes=700)


def test_partial_sums(tmp_path: Any) -> None:
    full = _full(g=(6, 4), h=(3,))
    layout = _layout('"g": shard(0, tp), partial(dp)', '"h": partial(dp*tp)')
    mesh = Mesh.of(dp=2, tp=2)
    locs = []
    for r in range(mesh.size):  # each rank holds a real part of the sum
        loc = shard_local_state(full, layout, mesh, r)
        locs.append({n: t + (r + 1) * 0.25 for n, t in loc.items()})
    save_sharded(locs, tmp_path, 0, layout=layout, mesh=mesh)
    from ucl.testing.layout_reference import unshard

    want = unshard(locs, layout, mesh)
    got = ucl.load(tmp_path, flat=True)
    assert torch.equal(got["g"], want["g"]) and torch.equal(got["h"], want["h"])
    with ucl.open(tmp_path) as ckpt:
        assert torch.equal(ckpt["g"][1:4, 2], want["g"][1:4, 2])
    for r in range(mesh.size):  # the same split: each rank its own contribution back
        back = ucl.load(tmp_path, layout=layout, mesh=mesh, rank=r, flat=True)
        assert all(torch.equal(back[n], locs[r][n]) for n in back)
    other = _layout('"g": shard(1, tp), partial(dp)')  # another split: the sum on contribution 0
    _check_all(tmp_path, {"g": want["g"], "h": want["h"]}, other, Mesh.of(dp=3, tp=2))


def test_uneven_nested_shards_are_blocked_arrays(tmp_path: Any) -> None:
    full = _full(w=(10, 3), e=(9, 2))
    layout = _layout('"w": shard(0, dp), shard(0, tp)', '"e": shard(0, dp*tp)')
    mesh = Mesh.of(dp=2, tp=2)
    _save(tmp_path, full, layout, mesh)
    with ucl.open(tmp_path) as ckpt:
        assert ckpt.array("w").shape == (12, 3)  # 4 blocks of 3 (the stored form of an uneven nested split)
        assert ckpt["w"].shape == (10, 3) and torch.equal(ckpt["w"][4:9], full["w"][4:9])
        assert ckpt.array("e").shape == (9, 2)
    assert ucl.validate(tmp_path).ok  # e's last chunk holds no data and is not written
    _check_all(tmp_path, full, _layout('"w": shard(0, tp)', '"e": shard(1, tp)'), Mesh.of(tp=3))


def test_single_process_save_under_a_layout(tmp_path: Any) -> None:
    """ucl.save(layout=): one rank; padding rows are not stored; the step loads under any layout."""
    layout = _layout(
        '"**emb": size(0, 10), pad(0, 8*tp), shard(0, tp)', '"**fc": fused(0, a=4, b=2), shard(0, tp)'
    )
    full = _full(model__emb=(10, 4), model__fc=(6, 3))
    local = shard_local_state(full, layout, Mesh.of(tp=1), 0)
    assert local["model/emb"].shape == (16, 4)
    state = {"model": {"emb": local["model/emb"], "fc": local["model/fc"]}, "epoch": 3}
    ucl.save(state, tmp_path, 5, layout=layout)  # mesh: the layout's axes, of size 1
    with ucl.open(tmp_path) as ckpt:
        assert ckpt.array("model/emb").shape == (10, 4)  # logical rows only
        assert ckpt.mesh == Mesh.of(tp=1) and ckpt.layout == layout
    back = ucl.load(tmp_path)
    assert back["epoch"] == 3 and torch.equal(back["model"]["emb"], full["model/emb"])
    got = ucl.load(tmp_path, layout=layout, mesh="tp=2", rank=1)
    assert got["epoch"] == 3
    assert torch.equal(got["model"]["emb"], torch.cat([full["model/emb"][8:], torch.zeros(6, 4)]))
    assert torch.equal(got["model"]["fc"], full["model/fc"][[2, 3, 5]])
    assert ucl.validate(tmp_path).ok


@pytest.mark.parametrize(
    ("rules", "error"),
    [
        (['"w": shard(0, tp)', '"nothing*": shard(0, tp)'], UnmatchedPatternError),
        (['"w": shard(0, tp)', '"*": shard(1, tp)'], OverlappingRulesError),
        (['"w": fused(0, a=3, b=3), shard(0, tp)'], LayoutShapeError),
        (['"w": size(0, 9), shard(0, tp)'], LayoutShapeError),
    ],
)
def test_bad_layouts_write_nothing(tmp_path: Any, rules: list[str], error: type) -> None:
    layout = _layout(*rules)
    with pytest.raises(error):
        ucl.save({"w": torch.zeros(8, 4)}, tmp_path / "a", 0, layout=layout, mesh="tp=1")
    assert not os.path.exists(tmp_path / "a")
    with pytest.raises(error), CheckpointManager(tmp_path / "b", layout=layout, mesh="tp=1") as mgr:
        mgr.save(0, {"w": torch.zeros(8, 4)})
    assert ucl.Repository.open(tmp_path / "b").steps() == []
    assert os.listdir(tmp_path / "b" / "steps") == ["zarr.json"]


def test_meshes_must_fit(tmp_path: Any) -> None:
    layout = _layout('"w": shard(0, tp)')
    with pytest.raises(MeshMismatchError, match="2 ranks"):
        ucl.save({"w": torch.zeros(8, 4)}, tmp_path, 0, layout=layout, mesh="tp=2")
    with pytest.raises(MeshMismatchError, match="world has 1"):
        CheckpointManager(tmp_path, layout=layout, mesh="tp=2")
    with pytest.raises(MeshMismatchError, match="lacks"):
        CheckpointManager(tmp_path, layout=layout, mesh="dp=1")
    with pytest.raises(InvalidArgumentError):
        CheckpointManager(tmp_path, mesh="tp=1")
    assert not os.path.exists(tmp_path / "steps")


def test_manager_under_a_layout_restores_its_rank(tmp_path: Any) -> None:
    layout = _layout('"m/emb", "o/emb/*": size(0, 10), pad(0, 4), shard(0, tp)')
    full = _full(m__emb=(10, 3), o__emb__v=(10, 3))
    local = shard_local_state(full, layout, Mesh.of(tp=1), 0)
    state = {"m": {"emb": local["m/emb"]}, "o": {"emb": {"v": local["o/emb/v"]}}, "step": 7}
    with CheckpointManager(tmp_path, layout=layout, delta=True) as mgr:
        mgr.save(7, state).result()
        state["m"]["emb"] = state["m"]["emb"] + 1
        mgr.save(8, state).result()
        back = mgr.restore()
        assert mgr.restore(7)["step"] == 7
    assert torch.equal(back["m"]["emb"][:10], local["m/emb"][:10] + 1)
    assert torch.equal(back["m"]["emb"][10:], torch.zeros(2, 3))  # padding: stored nowhere, loaded as zeros
    assert torch.equal(back["o"]["emb"]["v"], local["o/emb/v"]) and back["step"] == 7
    with ucl.open(tmp_path) as ckpt:
        assert ckpt.kind == "delta" and ckpt["m/emb"].shape == (10, 3)


def test_names_selection_and_errors(tmp_path: Any) -> None:
    layout = _layout('"model/w", "optim/w/*": shard(0, tp)')
    full = _full(model__w=(8, 2), optim__w__m=(8, 2), model__b=(3,))
    _save(tmp_path, full, layout, Mesh.of(tp=2))
    with ucl.open(tmp_path) as ckpt:
        assert ckpt.keys() == sorted(full) and "model/w" in ckpt and len(ckpt) == 3
        with pytest.raises(TensorNotFoundError):
            ckpt["nope"]
        with pytest.raises(TensorNotFoundError):
            ckpt.array("nope")
    got = ucl.load(tmp_path, layout=layout, mesh="tp=4", rank=3, tensors=["model/w", "model/b"])
    assert sorted(got["model"]) == ["b", "w"] and "optim" not in got
    assert torch.equal(got["model"]["w"], full["model/w"][6:])
    assert sorted(ucl.load(tmp_path, tensors=["optim/w/m"], flat=True)) == ["optim/w/m"]
    with pytest.raises(TensorNotFoundError):
        ucl.load(tmp_path, layout=layout, mesh="tp=4", rank=0, tensors=["model/nope"])
    with pytest.raises(MeshMismatchError, match="rank="):
        ucl.load(tmp_path, layout=layout, mesh="tp=4")
    with pytest.raises(LayoutShapeError, match="shape"):
        ucl.load_into(tmp_path, {"model/w": torch.zeros(3, 2)}, layout=layout, mesh="tp=4", rank=0)
    with pytest.raises(TensorNotFoundError):
        ucl.load_into(tmp_path, {"model/other": torch.zeros(2, 2)}, layout=layout, mesh="tp=4", rank=0)
    with pytest.raises(InvalidArgumentError):
        ucl.load(tmp_path, mesh="tp=4")
    plan = load_plan(str(tmp_path), layout=layout, mesh="tp=4", rank=1)
    assert plan.local["model/w"] == ((2, 2), "float32")


def test_hostile_records_are_refused() -> None:
    rec = {
        "tensors": {"w": {"shape": [4], "dtype": "float32"}},
        "maps": [{"tensor": "w", "box": [[0], [4]], "at": [2]}],
    }
    with pytest.raises(InconsistentMetadataError, match="runs past"):
        LogicalIndex({"a": ArraySpec("a", (4,), "float32", (4,), rec)})
    rec["maps"][0]["box"] = [[2], [4]]
    with pytest.raises(InconsistentMetadataError, match="outside"):
        LogicalIndex({"a": ArraySpec("a", (8,), "float32", (4,), rec)})
    rec = {
        "tensors": {"w": {"shape": [4], "dtype": "int8"}},
        "maps": [{"tensor": "w", "box": [[0], [4]], "at": [0]}],
    }
    with pytest.raises(InconsistentMetadataError, match="int8"):
        LogicalIndex({"a": ArraySpec("a", (4,), "float32", (4,), rec)})
    rec = {
        "tensors": {"w": {"shape": [2, 2], "dtype": "float32"}},
        "maps": [
            {"tensor": "w", "box": [[0, 0], [2, 2]], "at": [0, 0], "view": {"offset": 3, "shape": [2, 2]}}
        ],
    }
    with pytest.raises(InconsistentMetadataError, match="view"):
        LogicalIndex({"a": ArraySpec("a", (6,), "float32", (6,), rec)})


def test_op_splitting_covers_each_element_once() -> None:
    from ucl.plan.copies import row_major_pieces

    for shape in [(5,), (3, 4), (2, 3, 5), (1, 1, 7), (4, 1, 3)]:
        for limit in (1, 2, 3, 7, 100):
            seen = torch.zeros(shape, dtype=torch.int32)
            pos = 0
            for start, sub in row_major_pieces(shape, limit):
                idx = tuple(slice(a, a + n) for a, n in zip(start, sub, strict=True))
                seen[idx] += 1
                # each piece is the next run of the box in row-major order
                flat = torch.arange(math.prod(shape)).view(shape)[idx].reshape(-1)
                assert torch.equal(flat, torch.arange(pos, pos + flat.numel()))
                pos += flat.numel()
            assert bool((seen == 1).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_save_and_load_in_place(tmp_path: Any) -> None:
    layout = _layout('"w": shard(1, tp)', '"e": size(0, 10), pad(0, 4*tp), shard(0, tp)')
    full = _full(w=(64, 48), e=(10, 8))
    local = {n: t.cuda() for n, t in shard_local_state(full, layout, Mesh.of(tp=1), 0).items()}
    with CheckpointManager(tmp_path, layout=layout) as mgr:
        mgr.save(1, local).result()
    target, mesh = _layout('"w": shard(0, tp)', '"e": size(0, 10), pad(0, 4*tp), shard(0, tp)'), Mesh.of(tp=2)
    for rank in range(2):
        want = shard_local_state(full, target, mesh, rank)
        dest = {n: torch.full_like(t, 5.0, device="cuda") for n, t in want.items()}
        ucl.load_into(tmp_path, dest, layout=target, mesh=mesh, rank=rank)
        assert all(torch.equal(dest[n].cpu(), want[n]) for n in want)


@pytest.mark.parametrize(("src", "dst", "bound"), [((1, 2, 2), (1, 1, 4), 1.5), ((2, 1, 2), (1, 2, 2), 1.1),
                                                   ((1, 1, 4), (1, 4, 1), 1.1)])
def test_megatron_flat_buffers_under_another_tp_read_each_chunk_once(tmp_path: Any, src: tuple[int, ...],
                                                                     dst: tuple[int, ...], bound: float) -> None:
    """A column-split member of a ZeRO flat buffer is a row run per row on the target (issue 12: each run
    re-read a whole inner chunk, 130x the shard for tp 2 -> 4); every inner chunk is now read once per
    batch and delivered to each run (read/boxes.py _plan_once). The bound is what the chunks allow:
    a target quarter of a source half column reads the whole half."""
    from ucl.layout.builtins import megatron_gpt, megatron_gpt_params
    from ucl.options import WriteOptions

    cfg = dict(num_layers=2, num_heads=8, num_kv_heads=2, hidden=128, ffn_hidden=344, vocab_size=1001)
    g = torch.Generator().manual_seed(0)
    full = {}
    for n, s in megatron_gpt_params(**cfg):
        full["model/" + n] = torch.randn(s, generator=g)
        full[f"optim/state/{n}/exp_avg"] = torch.randn(s, generator=g)
    smesh, tmesh = Mesh.of(pp=src[0], dp=src[1], tp=src[2]), Mesh.of(pp=dst[0], dp=dst[1], tp=dst[2])
    layout = megatron_gpt(**cfg, zero=smesh)
    save_sharded([shard_local_state(full, layout, smesh, r) for r in range(smesh.size)], tmp_path, 0,
                 layout=layout, mesh=smesh, options=WriteOptions(inner_chunk_bytes=16 << 10))
    target = megatron_gpt(**cfg, zero=tmesh)
    for rank in (0, tmesh.size - 1):
        with ucl.open(tmp_path) as ckpt:
            got = ucl.load(ckpt, layout=target, mesh=tmesh, rank=rank, flat=True, buffer_bytes=1 << 20)
            need = sum(t.numel() * t.element_size() for t in got.values())
            assert ckpt.bytes_read <= bound * need + _index_bytes(ckpt), (ckpt.bytes_read, need)
        want = shard_local_state(full, target, tmesh, rank)
        assert sorted(got) == sorted(want)
        for n in want:
            assert torch.equal(got[n], want[n]), (n, rank)
