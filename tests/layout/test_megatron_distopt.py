"""Megatron-core's GPT with its distributed optimizer, as ``megatron_gpt(..., zero=mesh)`` lays it out,
against the independent reference of tests/layout/megatron_distopt.py (written from Megatron-LM's source;
files and commit cited there): what every rank holds, bucket by bucket, for the configurations of issue
12's matrix and more; then real gloo ranks save the matrix's sources through CheckpointManager and every
target configuration loads them back bit for bit, with the logical view framework-neutral."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from ucl.errors import InvalidLayoutError
from ucl.layout import Mesh
from ucl.layout.builtins import megatron_gpt
from ucl.testing import dist
from ucl.testing.layout_reference import shard_local_state

from . import megatron_distopt as ref

STATES = ("param", "exp_avg", "exp_avg_sq")
GPT = ref.GPT(num_layers=4, num_heads=8, num_kv_heads=2, hidden=48, ffn_hidden=72, vocab_size=1001)


def logical_state(c: ref.GPT, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Distinct values everywhere, so a misplaced element shows: model parameters in ``dtype``, their
    fp32 main copies (``param``) and Adam moments."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in ref.logical_names(c):
        out["model/" + name] = torch.randn(shape, generator=g).to(dtype)
        for s in STATES:
            out[f"optim/state/{name}/{s}"] = torch.randn(shape, generator=g)
    return out


def mref_bounds(c: ref.GPT, mesh: Mesh) -> list[int]:
    return ref.stage_layers(c, mesh.axis_size("pp"))


def builtin(c: ref.GPT, mesh: Mesh, bucket_size: int | None = None, high_busbw: bool = False) -> Any:
    return megatron_gpt(
        num_layers=c.num_layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        hidden=c.hidden,
        ffn_hidden=c.ffn_hidden,
        vocab_size=c.vocab_size,
        vocab_multiple=c.make_vocab_size_divisible_by,
        bias=c.bias,
        tied=c.tied,
        te=c.te,
        # Megatron's num_layers_in_first/last_pipeline_stage, as the stage bounds ucl takes
        pp_bounds=None
        if c.first_stage_layers is None and c.last_stage_layers is None
        else mref_bounds(c, mesh),
        zero=mesh,
        bucket_size=bucket_size,
        pad_buckets_for_high_nccl_busbw=high_busbw,
    )


def reference_local(
    c: ref.GPT,
    logical: dict[str, torch.Tensor],
    tp: int,
    pp: int,
    dp: int,
    rank: int,
    bucket_size: int | None = None,
    high_busbw: bool = False,
) -> dict[str, torch.Tensor]:
    """The reference rank's tensors under the names a ucl user hands them over: ``model/<Megatron's local
    name>`` (the tied copy on the last stage under the embedding's name, as the layout places it) and
    ``optim/flat/bucket<b>/<state>`` for each bucket's local shard."""
    model, buckets = ref.rank_state(
        c, logical, STATES, tp=tp, pp=pp, dp=dp, rank=rank, bucket_size=bucket_size, high_busbw=high_busbw
    )
    out = {}
    for name, t in model.items():
        if c.tied and name == "output_layer.weight":
            name = "embedding.word_embeddings.weight"
        out["model/" + name] = t
    for b, shards in buckets.items():
        for s, t in shards.items():
            out[f"optim/flat/bucket{b}/{s}"] = t
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(got) == sorted(want), where
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, (where, n)
        assert torch.equal(got[n], want[n]), (where, n)


CONFIGS = [  # (tp, pp, dp, model, bucket_size, pad_buckets_for_high_nccl_busbw)
    *[
        (tp, pp, dp, GPT, None, False)
        for tp, pp, dp in itertools.product([1, 2, 4, 8], [1, 2, 4], [1, 2, 3, 4, 8])
        if tp * pp * dp <= 16
    ],
    (1, 1, 4, GPT, 6000, False),  # several buckets, cut where Megatron cuts them
    (2, 2, 2, GPT, 3000, False),  # buckets on the first stage only
    (1, 1, 2, GPT, 1, False),  # a bucket per parameter
    (2, 1, 4, GPT, None, True),  # bucket ends padded to lcm(dp, 128, 2**16)
    (2, 2, 2, ref.GPT(4, 8, 2, 48, 72, 1001, tied=True), 3000, False),  # shared embeddings: own buckets
    (1, 2, 4, ref.GPT(4, 8, 2, 48, 72, 1001, tied=True), None, False),
    (1, 1, 2, ref.GPT(4, 8, 2, 48, 72, 1001, tied=True), 4000, False),  # tied on one stage: not shared
    (4, 2, 2, ref.GPT(4, 8, 2, 48, 72, 1001, bias=True), 5000, False),
    (8, 1, 2, ref.GPT(2, 8, 8, 48, 72, 50257, make_vocab_size_divisible_by=64), None, False),
    (2, 2, 2, ref.GPT(4, 8, 2, 48, 72, 1001, te=True), 3000, False),  # Transformer Engine's norm names
    (1, 3, 2, ref.GPT(5, 8, 2, 48, 72, 1001, first_stage_layers=1, last_stage_layers=2), None, False),
    (2, 4, 1, ref.GPT(6, 8, 2, 48, 72, 1001, tied=True, te=True, last_stage_layers=0), 2000, False),
]


@pytest.mark.parametrize("tp,pp,dp,c,bucket_size,high", CONFIGS)
def test_every_rank_holds_what_megatron_holds(
    tp: int, pp: int, dp: int, c: ref.GPT, bucket_size: int | None, high: bool
) -> None:
    mesh = Mesh.of(pp=pp, dp=dp, tp=tp)
    layout = builtin(c, mesh, bucket_size, high)
    logical = logical_state(c)
    for rank in range(mesh.size):
        got = shard_local_state(logical, layout, mesh, rank)
        assert_same(got, reference_local(c, logical, tp, pp, dp, rank, bucket_size, high), f"rank {rank}")


def test_the_buckets_are_megatrons() -> None:
    """The reference's own buckets on a case worked by hand: 64-aligned starts, a bucket closed once it
    spans bucket_size, ends padded to lcm(dp, 128) = 384 for dp = 3."""
    index, buckets = ref.buffer_layout([10, 100, 30], [False] * 3, 120, 3)
    # reversed: 30 at [0, 30); 100 at [64, 164), which closes bucket 0 (164 >= 120), its end padded to 384;
    # 10 at [384, 394), the last bucket's end padded to 768
    assert index == [(384, 394), (64, 164), (0, 30)]
    assert buckets == [(0, 384), (384, 768)]
    layout = builtin(
        ref.GPT(1, 2, 2, 8, 8, 16, make_vocab_size_divisible_by=8), Mesh.of(pp=1, dp=3, tp=1), 120
    )
    members = [[m for m, _ in f.members] for f in layout.flats]  # the output layer (128) fills a bucket
    assert members[0] == ["output_layer.weight"] and members[1][0] == "decoder.final_layernorm.weight"
    assert {f.pad for f in layout.flats} == {(128,)} and layout.flats[0].length(128, Mesh.of(dp=3)) == 384


# -- real processes: the matrix of issue 12 -------------------------------------------------------------
TIED = ref.GPT(4, 8, 2, 48, 72, 1001, tied=True)
SOURCES = {  # name: (tp, pp, dp, model, params dtype, bucket_size)
    "tp2pp2": (2, 2, 1, GPT, torch.float32, None),
    "tp4": (4, 1, 1, GPT, torch.float32, None),
    "pp2dp2_tied": (1, 2, 2, TIED, torch.float32, 3000),
    "tp2dp2_bf16": (2, 1, 2, GPT, torch.bfloat16, None),
    "dp4_buckets": (1, 1, 4, GPT, torch.float32, 6000),
}
TARGETS = [(1, 1, 1), (2, 1, 2), (1, 4, 1), (8, 1, 1), (1, 1, 4), (4, 2, 1)]


def save_sources(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank ``rank`` of every source job: the reference's tensors saved through CheckpointManager."""
    from ucl.write.manager import CheckpointManager

    for name, (tp, pp, dp, c, dtype, bucket_size) in SOURCES.items():
        mesh = Mesh.of(pp=pp, dp=dp, tp=tp)
        local = reference_local(c, logical_state(c, dtype), tp, pp, dp, rank, bucket_size)
        with CheckpointManager(Path(root) / name, layout=builtin(c, mesh, bucket_size), mesh=mesh) as mgr:
            mgr.save(1, local).result()
    return {"rank": rank}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("megatron-distopt")
    dist.run(4, "tests.layout.test_megatron_distopt:save_sources", {"root": str(root)})
    return root


@pytest.mark.dist
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_megatron_step_loads_under_every_target_bit_exactly(sources: Path, source: str) -> None:
    tp, pp, dp, c, dtype, bucket_size = SOURCES[source]
    path = sources / source
    assert ucl.validate(path).ok
    logical = logical_state(c, dtype)
    assert_same(ucl.load(path, flat=True), logical, "the logical view")  # natural QKV, unpadded, global
    for ttp, tpp, tdp in TARGETS:
        mesh = Mesh.of(pp=tpp, dp=tdp, tp=ttp)
        for target_buckets in {None, bucket_size}:
            layout = builtin(c, mesh, target_buckets)
            for rank in sorted({0, mesh.size - 1}):  # every rank's layout: the test above
                got = ucl.load(path, layout=layout, mesh=mesh, rank=rank, flat=True)
                want = reference_local(c, logical, ttp, tpp, tdp, rank, target_buckets)
                want = {n: t.to(dtype) if n.startswith("model/") else t for n, t in want.items()}
                assert_same(got, want, f"{source} -> tp{ttp} pp{tpp} dp{tdp} rank {rank}")


def test_bucket_sizes_that_do_not_fit_are_refused() -> None:
    mesh = Mesh.of(pp=1, dp=2, tp=1)
    for bad in (0, -5, 2.5, "40M"):
        with pytest.raises(InvalidLayoutError, match="bucket_size must be a positive number of elements"):
            builtin(GPT, mesh, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mesh,c,why",
    [
        (Mesh.of(pp=1, dp=1, tp=3), GPT, "tp=3 does not divide the 8 attention heads"),
        (Mesh.of(pp=1, dp=1, tp=8), ref.GPT(4, 8, 4, 48, 72, 1001), None),  # allowed: 8 is a multiple of 4
        (Mesh.of(pp=1, dp=1, tp=8), ref.GPT(4, 8, 2, 40, 72, 1001), "does not divide linear_qkv's 60 rows"),
        (Mesh.of(pp=1, dp=1, tp=4), ref.GPT(4, 8, 2, 48, 70, 1001), "tp=4 does not divide ffn_hidden 70"),
        (Mesh.of(pp=3, dp=1, tp=1), GPT, "pp=3 does not divide the 4 layers"),
    ],
)
def test_configurations_megatron_refuses_are_refused(mesh: Mesh, c: ref.GPT, why: str | None) -> None:
    if why is None:
        builtin(c, mesh)
        return
    with pytest.raises(InvalidLayoutError, match=why):
        builtin(c, mesh)


def test_the_spec_example_of_a_padded_bucket() -> None:
    """spec/layout.md §7.6's Megatron example: offsets 0 and 64, 384 elements, 128 per rank."""
    from ucl.layout import parse_layout
    from ucl.layout.resolve import Resolver

    layout = parse_layout(
        'ucl-layout 3\nflat "optim/flat/bucket0/{state}" -> "optim/state/{member}/{state}" '
        'over dp align 64 pad 128: [\n  "n" [6],\n  "w" [4, 25],\n]\n'
    )
    geom = Resolver(layout, Mesh.of(dp=3)).flat_geom(0, "exp_avg", {"dp": 1})
    assert [m.offset for m in geom.members] == [0, 64] and (geom.total, geom.partition) == (164, 128)
    logical = {
        "optim/state/n/exp_avg": torch.arange(6.0) + 1,
        "optim/state/w/exp_avg": torch.arange(100.0).reshape(4, 25) + 10,
    }
    ranks = [
        shard_local_state(logical, layout, Mesh.of(dp=3), r)["optim/flat/bucket0/exp_avg"] for r in range(3)
    ]
    assert torch.equal(ranks[0][:6], logical["optim/state/n/exp_avg"]) and not ranks[0][6:64].any()
    assert torch.equal(
        torch.cat([ranks[0][64:], ranks[1][:36]]), logical["optim/state/w/exp_avg"].reshape(-1)
    )
    assert not ranks[1][36:].any() and not ranks[2].any()
