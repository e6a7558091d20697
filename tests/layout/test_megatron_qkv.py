"""Megatron-core's fused QKV through ``grouped`` (spec/layout.md §7.10), against the independent reference
of tests/layout/megatron_qkv.py (written from Megatron-LM's source; file and commit cited there):
every TP size Megatron accepts, tp > groups included; the logical view is the natural [Q; K; V]; real
gloo ranks save it and any TP size loads it back bit for bit."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import ucl
from ucl.layout import Mesh, parse_layout
from ucl.layout.builtins import megatron_gpt
from ucl.layout.model import Grouped, Shard
from ucl.testing import dist
from ucl.testing.layout_reference import shard_local_state

from . import megatron_qkv as ref

CASES = [(nh, ng, tp) for nh, ng, tp in itertools.product([8, 16], [1, 2, 4, 8], [1, 2, 4, 8])
         if ref.allowed(nh, ng, tp)]
HD, HIDDEN = 4, 6


def natural(nh: int, ng: int, *, bias: bool = False, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Q (all heads), K, V (all groups) with distinct values, so a misplaced row shows."""
    tail = () if bias else (HIDDEN,)
    n = (nh + 2 * ng) * HD * (1 if bias else HIDDEN)
    x = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + 1).to(torch.float32)
    x = x.reshape((nh + 2 * ng) * HD, *tail)
    return x[: nh * HD], x[nh * HD:(nh + ng) * HD], x[(nh + ng) * HD:]


def layout_text(nh: int, ng: int) -> str:
    parts = f"q={nh}x{HD}, k={ng}x{HD}, v={ng}x{HD}"
    return (f'ucl-layout 2\n"qkv.weight", "qkv.bias": grouped(0, {ng}, {parts}), shard(0, tp)\n')


@pytest.mark.parametrize("nh,ng,tp", CASES)
def test_the_reference_is_what_megatrons_forward_computes_with(nh, ng, tp) -> None:
    """The reference's rank tensors, run through get_query_key_value_tensors' view and split, give each
    rank Megatron's heads: query heads [r nh/tp, (r+1) nh/tp) and the key and value of their groups."""
    q, k, v = natural(nh, ng)
    locs = [ref.rank_local(q, k, v, nh, ng, tp, r) for r in range(tp)]
    for r in range(tp):
        query, key, value = ref.forward_heads(locs, nh, ng, HD, r)
        heads = nh // tp
        assert torch.equal(query, q[r * heads * HD:(r + 1) * heads * HD])
        g0, gn = (r // (tp // ng), 1) if ng < tp else (r * ng // tp, ng // tp)
        assert torch.equal(key, k[g0 * HD:(g0 + gn) * HD]) and torch.equal(value, v[g0 * HD:(g0 + gn) * HD])


@pytest.mark.parametrize("nh,ng,tp", CASES)
def test_grouped_holds_on_each_rank_what_megatron_holds(nh, ng, tp) -> None:
    layout = parse_layout(layout_text(nh, ng))
    for bias in (False, True):
        q, k, v = natural(nh, ng, bias=bias)
        name = "qkv.bias" if bias else "qkv.weight"
        full = {name: torch.cat([q, k, v])}  # the logical tensor: natural order
        for r in range(tp):
            got = shard_local_state(full, layout, Mesh.of(tp=tp), r)[name]
            assert torch.equal(got, ref.rank_local(q, k, v, nh, ng, tp, r)), (name, r)


def test_the_megatron_builtin_is_grouped_by_default() -> None:
    layout = megatron_gpt(num_layers=2, num_heads=16, num_kv_heads=4, hidden=64, ffn_hidden=128,
                          vocab_size=1000, bias=True)
    assert layout.version == 2
    for name in ("weight", "bias"):
        pattern = f"**decoder.layers.*.self_attention.linear_qkv.{name}"  # and its optimizer states
        (rule,) = [r for r in layout.rules if r.patterns[0] == pattern]
        assert isinstance(rule.transforms[0], Grouped) and rule.transforms[0].groups == 4
        assert [(p.name, p.count, p.unit) for p in rule.transforms[0].parts] == [("q", 16, 4), ("k", 4, 4),
                                                                                 ("v", 4, 4)]
        assert rule.transforms[1] == Shard(0, ("tp",))
    v1 = megatron_gpt(num_layers=2, num_heads=16, num_kv_heads=4, hidden=64, ffn_hidden=128, vocab_size=1000,
                      qkv="concat")
    assert v1.version == 1  # written at the lowest version that expresses it


def save_megatron_ranks(rank: int, world: int, path: str, nh: int, ng: int) -> dict[str, object]:
    """A TP rank of ``world`` saving what Megatron holds (the reference), through CheckpointManager."""
    from ucl.write.manager import CheckpointManager

    state = {}
    for bias in (False, True):
        q, k, v = natural(nh, ng, bias=bias)
        state["qkv.bias" if bias else "qkv.weight"] = ref.rank_local(q, k, v, nh, ng, world, rank)
    with CheckpointManager(path, layout=layout_text(nh, ng), mesh=f"tp={world}") as mgr:
        mgr.save(1, state).result()
    return {"rank": rank}


@pytest.mark.dist
def test_real_ranks_save_megatron_qkv_and_any_tp_loads_it(tmp_path: Path) -> None:
    """4 gloo ranks with 2 query groups (tp > groups: a rank holds part of one group's block) save
    Megatron's tensors; the step's logical tensors are the natural [Q; K; V]; a load under tp = 1, 2, 4
    and 8 gives each rank exactly what Megatron holds there."""
    nh, ng = 8, 2
    dist.run(4, "tests.layout.test_megatron_qkv:save_megatron_ranks",
             {"path": str(tmp_path), "nh": nh, "ng": ng})
    assert ucl.validate(tmp_path).ok
    with ucl.open(tmp_path) as ck:
        for bias in (False, True):
            q, k, v = natural(nh, ng, bias=bias)
            name = "qkv.bias" if bias else "qkv.weight"
            assert torch.equal(ck[name].read(), torch.cat([q, k, v])), name  # framework-neutral
            # what a Hugging Face LLaMA's q_proj, k_proj, v_proj hold: slices of the logical tensor
            assert torch.equal(ck[name][: nh * HD], q)
    for tp in (1, 2, 4, 8):
        for r in range(tp):
            got = ucl.load(tmp_path, layout=layout_text(nh, ng), mesh=f"tp={tp}", rank=r, flat=True)
            for bias in (False, True):
                q, k, v = natural(nh, ng, bias=bias)
                name = "qkv.bias" if bias else "qkv.weight"
                assert torch.equal(got[name], ref.rank_local(q, k, v, nh, ng, tp, r)), (tp, r, name)
