"""DeepSpeed ZeRO-1/2/3's partitioned optimizer state through ``deepspeed_zero`` (spec/layout.md §7.6
``pad 2*dp``), against the independent reference of tests/layout/deepspeed_zero.py (written from
DeepSpeed's source; files and commit cited there): every rank of many data-parallel sizes and odd-sized
parameters; then real gloo ranks save a ZeRO-2 job through CheckpointManager, and it loads bit for bit
under other data-parallel sizes, under ZeRO-3, and as Megatron-core's distributed optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from ucl.errors import InvalidLayoutError
from ucl.layout import Layout, Mesh
from ucl.layout.builtins import deepspeed_zero
from ucl.testing import dist
from ucl.testing.layout_reference import shard_local_state

from . import deepspeed_zero as ref
from . import megatron_distopt as mref
from .test_megatron_distopt import STATES, assert_same, builtin, logical_state, reference_local

ODD = [
    ("a.weight", (3, 5)),
    ("a.bias", (7,)),
    ("b.weight", (11, 13)),
    ("c.scale", (1,)),
    ("d.weight", (4, 6)),
]


def odd_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"optim/state/{n}/{s}": torch.randn(shape, generator=g) for n, shape in ODD for s in STATES}


def reference(
    groups: list[list[tuple[str, Any]]], logical: dict[str, torch.Tensor], stage: int, dp: int, rank: int
) -> dict[str, torch.Tensor]:
    """The reference rank's partitions under the names ``deepspeed_zero`` gives them."""
    out = {}
    for g, params in enumerate(groups):
        for s in STATES:
            if stage < 3:
                tensors = [logical[f"optim/state/{n}/{s}"] for n, _ in params]
                out[f"optim/flat/group{g}/{s}"] = ref.stage12_partition(tensors, dp, rank)
            else:
                for n, _ in params:
                    out[f"optim/flat/group{g}/{n}/{s}"] = ref.stage3_piece(
                        logical[f"optim/state/{n}/{s}"], dp, rank
                    )
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2, 3, 4, 5, 8, 16])
def test_every_rank_holds_what_deepspeed_holds(stage: int, dp: int) -> None:
    groups = [ODD[:3], ODD[3:]]  # e.g. weight decay and none
    layout = deepspeed_zero(groups, stage=stage)
    logical = odd_state()
    mesh = Mesh.of(dp=dp)
    for rank in range(dp):
        assert_same(
            shard_local_state(logical, layout, mesh, rank),
            reference(groups, logical, stage, dp, rank),
            f"stage {stage} dp {dp} rank {rank}",
        )


def test_the_padding_is_deepspeeds() -> None:
    """One group of 15 + 7 elements over dp = 4: padded to 24 (a multiple of 2 * 4), 6 per rank; rank 3
    holds the last 4 elements and 2 zeros."""
    layout = deepspeed_zero([ODD[:2]])
    assert layout.flats[0].pad == (2, "dp") and layout.version == 3
    logical = odd_state()
    got = shard_local_state(logical, layout, Mesh.of(dp=4), 3)["optim/flat/group0/exp_avg"]
    assert got.shape == (6,)
    assert torch.equal(got[:4], logical["optim/state/a.bias/exp_avg"][3:]) and not got[4:].any()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidLayoutError, match="stage must be 1, 2 or 3"):
        deepspeed_zero([ODD], stage=4)
    with pytest.raises(InvalidLayoutError, match="must name"):
        deepspeed_zero([ODD], buffer="optim/{state}")
    with pytest.raises(InvalidLayoutError, match="no group has a parameter"):
        deepspeed_zero([[]])


# -- real processes: a ZeRO-2 job of a Megatron-named GPT, loaded under other frameworks' layouts ---------
GPT = mref.GPT(num_layers=2, num_heads=8, num_kv_heads=2, hidden=48, ffn_hidden=72, vocab_size=1001)


def gpt_groups() -> list[list[tuple[str, tuple[int, ...]]]]:
    """The model's parameters in registration order, in two groups: matrices (weight decay) and the rest."""
    shapes = dict(mref.logical_names(GPT))
    names = [n for _, n in mref.stage_params(GPT, 1, 0)]
    return [
        [(n, shapes[n]) for n in names if len(shapes[n]) == 2],
        [(n, shapes[n]) for n in names if len(shapes[n]) < 2],
    ]


def zero_layout(stage: int) -> Layout:
    return deepspeed_zero(gpt_groups(), stage=stage)


def save_zero(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank ``rank`` of a dp=4 DeepSpeed job under ZeRO-2 and under ZeRO-3 (one step each): the whole
    model (replicated) and its optimizer partitions."""
    from ucl.write.manager import CheckpointManager

    logical = logical_state(GPT)
    for stage in (2, 3):
        local = {n: t for n, t in logical.items() if n.startswith("model/")}
        local.update(reference(gpt_groups(), logical, stage, world, rank))
        with CheckpointManager(
            Path(root) / f"zero{stage}", layout=zero_layout(stage), mesh=Mesh.of(dp=world)
        ) as mgr:
            mgr.save(1, local).result()
    return {"rank": rank}


@pytest.fixture(scope="module")
def zero_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("deepspeed-zero")
    dist.run(4, "tests.layout.test_deepspeed_zero:save_zero", {"root": str(root)})
    return root


@pytest.mark.dist
@pytest.mark.parametrize("source", [2, 3])
def test_a_zero_step_loads_under_other_dp_sizes_stages_and_megatron(zero_steps: Path, source: int) -> None:
    path = zero_steps / f"zero{source}"
    assert ucl.validate(path).ok
    logical = logical_state(GPT)
    assert_same(ucl.load(path, flat=True), logical, "the logical view")
    model = {n: t for n, t in logical.items() if n.startswith("model/")}
    for stage, dp in [(2, 1), (2, 3), (1, 8), (3, 2), (3, 5)]:
        mesh = Mesh.of(dp=dp)
        for rank in sorted({0, dp - 1}):
            got = ucl.load(path, layout=zero_layout(stage), mesh=mesh, rank=rank, flat=True)
            assert_same(
                got,
                {**model, **reference(gpt_groups(), logical, stage, dp, rank)},
                f"ZeRO-{source} -> ZeRO-{stage} dp {dp} rank {rank}",
            )
    c = mref.GPT(**{**GPT.__dict__})
    for tp, pp, dp in [(2, 2, 2), (1, 1, 4)]:  # Megatron-core's distributed optimizer, another framework
        mesh = Mesh.of(pp=pp, dp=dp, tp=tp)
        for rank in sorted({0, mesh.size - 1}):
            got = ucl.load(path, layout=builtin(c, mesh), mesh=mesh, rank=rank, flat=True)
            assert_same(got, reference_local(c, logical, tp, pp, dp, rank), f"Megatron tp{tp} pp{pp} dp{dp}")
