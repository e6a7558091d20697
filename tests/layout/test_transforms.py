"""Each transform's index mapping against an independent statement of it (torch.chunk, DTensor, Megatron)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ucl.layout import Layout, Mesh, parse_layout
from ucl.layout.builtins import megatron_gpt, megatron_gpt_params, zero_flat
from ucl.layout.model import Rule, Shard
from ucl.layout.transforms import make_tile
from ucl.plan.layout_load import LogicalIndex, logical_read, plan_load
from ucl.plan.layout_save import plan_save
from ucl.testing.layout_reference import apply_reads, read_logical, shard_local_state

from .helpers import assert_same, examples, local_shapes, make_full, save


def L(text: str) -> Layout:
    return parse_layout("ucl-layout 1\n" + text)


@pytest.mark.parametrize("n", [0, 1, 3, 9, 10, 12, 13])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_shard_is_torch_chunk(n, k):
    full = {"w": torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)}
    layout, mesh = L('"w": shard(0, tp)\n'), Mesh.of(tp=k)
    pieces = torch.chunk(full["w"], k)
    for r in range(k):
        want = pieces[r] if r < len(pieces) else full["w"][n:]
        assert torch.equal(shard_local_state(full, layout, mesh, r)["w"], want)
    _, plans, arrays, _ = save(full, mesh, layout)
    spec = arrays["w"]
    assert spec.shape == (n, 2) and spec.logical == {}  # plain: zarr reads the logical tensor
    assert spec.chunk_shape == (max(1, -(-n // k)), 2)
    assert sorted(w.chunk_index for p in plans for w in p.writes) == [(i, 0) for i in range(len(pieces)) if n]


def test_ten_rows_over_four_ranks_are_three_three_three_one():
    _, plans, arrays, _ = save({"w": torch.zeros(10, 4)}, Mesh.of(tp=4), L('"w": shard(0, tp)\n'))
    assert arrays["w"].chunk_shape == (3, 4)
    assert [w.stored_box for p in plans for w in p.writes] == [
        ((0, 0), (3, 4)),
        ((3, 0), (3, 4)),
        ((6, 0), (3, 4)),
        ((9, 0), (1, 4)),
    ]


def test_combined_axes_split_row_major_and_nested_even_is_plain():
    mesh = Mesh.of(dp=2, tp=2)
    t = make_tile(Rule(("w",), (Shard(0, ("dp", "tp")),)), "w", (8,), mesh)
    assert [t.pieces(mesh, mesh.coords(r))[0][1][0] for r in range(4)] == [(0,), (2,), (4,), (6,)]
    nested = make_tile(Rule(("w",), (Shard(0, ("dp",)), Shard(0, ("tp",)))), "w", (8,), mesh)
    assert nested.plain and nested.chunk_shape == (2,)


def test_nested_uneven_is_stored_as_blocks_of_what_ranks_hold():
    full = {"w": torch.arange(10.0)}
    layout, mesh = L('"w": shard(0, dp), shard(0, tp)\n'), Mesh.of(dp=2, tp=2)
    locs = [shard_local_state(full, layout, mesh, r)["w"].tolist() for r in range(4)]
    assert locs == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]  # 10 -> 5, 5 -> 3, 2, 3, 2
    _, _, arrays, store = save(full, mesh, layout)
    assert arrays["w"].shape == (12,) and arrays["w"].chunk_shape == (3,)
    assert store["w"].tolist() == [0, 1, 2, 3, 4, 0, 5, 6, 7, 8, 9, 0]
    assert arrays["w"].logical["maps"] == [
        {"tensor": "w", "box": [[0], [3]], "at": [0]},
        {"tensor": "w", "box": [[3], [2]], "at": [3]},
        {"tensor": "w", "box": [[5], [3]], "at": [6]},
        {"tensor": "w", "box": [[8], [2]], "at": [9]},
    ]


placements = st.sampled_from(["R", "S0", "S1"])


@settings(max_examples=examples(150), deadline=None)
@given(
    shape=st.lists(st.integers(0, 11), min_size=2, max_size=2),
    m0=st.integers(1, 4),
    m1=st.integers(1, 4),
    p0=placements,
    p1=placements,
    strided=st.booleans(),
)
def test_nested_shards_match_dtensor(shape, m0, m1, p0, p1, strided):
    """DTensor shards left to right over mesh dims; _StridedShard(d, sf) then Shard(d) right to left."""

    def dplace(p):
        return None if p == "R" else DShard(int(p[1]))

    placements_, text = [dplace(p0), dplace(p1)], []
    if strided and p0 == p1 and p0 != "R":  # FSDP2 + TP: _StridedShard on dp, Shard on tp
        d = int(p0[1])
        shape[d] = (
            shape[d] // (m0 * m1) * (m0 * m1)
        )  # even only: DTensor's uneven strided shards are not blocks
        placements_[0] = _StridedShard(d, split_factor=m1)
        text = [f"shard({d}, b)", f"shard({d}, a)"]
    else:
        text = [f"shard({p[1]}, {ax})" for p, ax in ((p0, "a"), (p1, "b")) if p != "R"]
    from torch.distributed.tensor import Replicate

    placements_ = [p if p is not None else Replicate() for p in placements_]
    layout = L(f'"w": {", ".join(text)}\n' if text else "")
    mesh = Mesh.of(a=m0, b=m1)
    full = {"w": torch.arange(shape[0] * shape[1]).reshape(shape).to(torch.float32)}
    for r in range(mesh.size):
        c = mesh.coords(r)
        lshape, offset = _compute_local_shape_and_global_offset(
            tuple(shape), (m0, m1), [c["a"], c["b"]], placements_
        )
        local = shard_local_state(full, layout, mesh, r)["w"]
        assert tuple(local.shape) == tuple(lshape)
        want = full["w"][offset[0] : offset[0] + lshape[0], offset[1] : offset[1] + lshape[1]]
        assert torch.equal(local, want)


def _qkv_rank(q, k, v, tp, r):
    """Megatron-style TP split of separate Q, K, V with GQA: rank r holds [q_r; k_r; v_r]."""

    def part(x, heads):
        hd = x.shape[0] // heads
        if heads < tp:  # fewer KV groups than ranks: rank r uses group r // (tp // heads)
            g = r // (tp // heads)
            return x[g * hd : (g + 1) * hd]
        per = heads // tp
        return x[r * per * hd : (r + 1) * per * hd]

    return torch.cat([part(q, q.shape[0] // 2), part(k, k.shape[0] // 2), part(v, v.shape[0] // 2)])


@pytest.mark.parametrize(("heads", "groups", "tp"), [(4, 4, 2), (4, 2, 2), (8, 2, 4), (4, 1, 2), (4, 2, 4)])
def test_fused_qkv_with_gqa_per_tp_rank(heads, groups, tp):
    hd, hidden = 2, 3
    q = torch.arange(heads * hd * hidden, dtype=torch.float32).reshape(heads * hd, hidden)
    k = 1000 + torch.arange(groups * hd * hidden, dtype=torch.float32).reshape(groups * hd, hidden)
    v = 2000 + torch.arange(groups * hd * hidden, dtype=torch.float32).reshape(groups * hd, hidden)
    full = {"qkv": torch.cat([q, k, v])}
    layout = L(f'"qkv": fused(0, q={heads}x{hd}, k={groups}x{hd}, v={groups}x{hd}), shard(0, tp)\n')
    mesh = Mesh.of(tp=tp)
    for r in range(tp):
        want = (
            _qkv_rank(q, k, v, tp, r)
            if groups >= tp
            else torch.cat(
                [
                    q[r * heads // tp * hd : (r + 1) * heads // tp * hd],
                    k[(r // (tp // groups)) * hd : (r // (tp // groups) + 1) * hd],
                    v[(r // (tp // groups)) * hd : (r // (tp // groups) + 1) * hd],
                ]
            )
        )
        assert torch.equal(shard_local_state(full, layout, mesh, r)["qkv"], want)
    _, plans, arrays, store = save(full, mesh, layout)
    spec = arrays["qkv"]  # the TP-concatenation of the ranks' [q_r; k_r; v_r]
    assert spec.chunk_shape[0] * tp == spec.shape[0]
    assert np.array_equal(
        store["qkv"], torch.cat([shard_local_state(full, layout, mesh, r)["qkv"] for r in range(tp)]).numpy()
    )
    assert np.array_equal(read_logical(store, arrays, "qkv"), full["qkv"].numpy())
    # a single process reads the logical tensor; tp=1 of the same layout holds [q; k; v]
    one = plan_load(arrays, layout, Mesh.of(tp=1), 0)
    assert np.array_equal(apply_reads(store, one)["qkv"], full["qkv"].numpy())


def test_gate_up_fused():
    full = {"fc1": torch.arange(8.0).reshape(8, 1)}  # gate rows 0..3, up rows 4..7
    layout = L('"fc1": fused(0, gate=4, up=4), shard(0, tp)\n')
    got = [shard_local_state(full, layout, Mesh.of(tp=2), r)["fc1"].flatten().tolist() for r in range(2)]
    assert got == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_padded_vocab_stores_only_logical_rows():
    full = {"emb": torch.arange(10.0).reshape(10, 1)}
    layout, mesh = L('"emb": size(0, 10), pad(0, 4*tp), shard(0, tp)\n'), Mesh.of(tp=4)
    locs = [shard_local_state(full, layout, mesh, r)["emb"].flatten().tolist() for r in range(4)]
    assert locs == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0], [0, 0, 0, 0]]  # padded to 16, 4 rows each
    _, plans, arrays, store = save(full, mesh, layout, shapes=False)
    assert (
        arrays["emb"].shape == (10, 1) and arrays["emb"].logical == {} and arrays["emb"].chunk_shape == (4, 1)
    )
    assert [len(p.writes) for p in plans] == [1, 1, 1, 0]
    tp2 = plan_load(arrays, layout, Mesh.of(tp=2), 1)  # padded to 16 again: 8 rows each, 2 logical
    assert tp2.local == {"emb": ((8, 1), "float32")} and "emb" in tp2.zero
    assert apply_reads(store, tp2)["emb"].flatten().tolist() == [8, 9, 0, 0, 0, 0, 0, 0]


def test_pipeline_stages_renumber_layers():
    names = {f"model/layers.{i}.w": ((2,), "float32") for i in range(5)}
    layout = L('renumber "model/layers.{i}.**" over pp: [0, 2, 5]\n')
    full = make_full(names)
    assert sorted(shard_local_state(full, layout, Mesh.of(pp=2), 1)) == [
        "model/layers.0.w",
        "model/layers.1.w",
        "model/layers.2.w",
    ]
    local = shard_local_state(full, layout, Mesh.of(pp=2), 1)
    assert torch.equal(local["model/layers.0.w"], full["model/layers.2.w"])
    plan = plan_save(layout, Mesh.of(pp=2), 1, local_shapes(local))
    assert sorted(plan.arrays) == ["model/layers.2.w", "model/layers.3.w", "model/layers.4.w"]
    assert [w.local_name for w in plan.writes] == ["model/layers.0.w", "model/layers.1.w", "model/layers.2.w"]


def test_experts_over_ep_by_name_and_stacked():
    names = {f"moe.experts.{e}.w": ((2, 2), "float32") for e in range(4)}
    names["moe.stacked"] = ((4, 2), "float32")
    layout = L('renumber "moe.experts.{e}.*" over ep: 4\n"moe.stacked": shard(0, ep)\n')
    full = make_full(names)
    mesh = Mesh.of(ep=2, tp=2)
    local = shard_local_state(full, layout, mesh, 3)  # ep=1: experts 2, 3 as local 0, 1
    assert sorted(local) == ["moe.experts.0.w", "moe.experts.1.w", "moe.stacked"]
    assert torch.equal(local["moe.experts.1.w"], full["moe.experts.3.w"])
    assert torch.equal(local["moe.stacked"], full["moe.stacked"][2:])
    _, _, arrays, store = save(full, mesh, layout)
    assert_same(apply_reads(store, plan_load(arrays, Layout(), Mesh.of(dp=1), 0)), full)


def test_zero_flat_buffer_is_the_concatenation_split_over_dp():
    params = [("a", (3, 2)), ("b", (4,)), ("c", (1, 3))]
    full = {
        f"opt/{n}/exp_avg": torch.arange(1.0, 1 + np.prod(s)).reshape(s) * (i + 1)
        for i, (n, s) in enumerate(params)
    }
    layout = zero_flat(params, buffer="flat/{state}", logical="opt/{member}/{state}", axes=("dp",), align=4)
    mesh = Mesh.of(dp=3)
    # offsets 0 (6 elements), 8 (4), 12 (3): 15 elements; partitions of ceil(15/12)*4 = 8
    flat = torch.zeros(24)
    flat[0:6], flat[8:12], flat[12:15] = (
        full["opt/a/exp_avg"].flatten(),
        full["opt/b/exp_avg"],
        full["opt/c/exp_avg"].flatten(),
    )
    for r in range(3):
        assert torch.equal(
            shard_local_state(full, layout, mesh, r)["flat/exp_avg"], flat[8 * r : 8 * (r + 1)]
        )
    _, plans, arrays, store = save(full, mesh, layout)
    assert list(arrays) == ["flat/exp_avg"] and arrays["flat/exp_avg"].shape == (24,)
    assert np.array_equal(store["flat/exp_avg"], flat.numpy())
    # the same state loads into 2 dp ranks, and into unflattened tensors
    for r in range(2):
        got = apply_reads(store, plan_load(arrays, layout, Mesh.of(dp=2), r))
        assert_same(got, shard_local_state(full, layout, Mesh.of(dp=2), r))
    assert_same(apply_reads(store, plan_load(arrays, Layout(), Mesh.of(dp=1), 0)), full)


def test_zero_flat_with_tp_shards_each_rank_flattens_its_own_pieces():
    params = [("w", (4, 6))]
    full = {"opt/w/m": torch.arange(24.0).reshape(4, 6)}
    layout = L('"opt/w/*": shard(1, tp)\n').merged(
        zero_flat(params, buffer="flat/{state}", logical="opt/{member}/{state}", axes=("dp",))
    )
    mesh = Mesh.of(dp=2, tp=2)
    local = shard_local_state(full, layout, mesh, 1)  # dp=0, tp=1: columns 3..5, rows 0..1 of the flat
    assert local["flat/m"].tolist() == full["opt/w/m"][:, 3:].flatten()[:6].tolist()
    _, _, arrays, store = save(full, mesh, layout)
    assert sorted(arrays) == ["flat/m.tp0", "flat/m.tp1"]
    items = logical_read(arrays, "opt/w/m", ((1, 2), (2, 3)))  # column-crossing box: row runs of each array
    assert sorted(a for a, _, _ in items) == ["flat/m.tp0", "flat/m.tp0", "flat/m.tp1", "flat/m.tp1"]
    assert sum(np.prod(s[1]) for _, s, _ in items) == 6


def test_partial_tensors_are_stored_per_rank_and_summed_on_read():
    full = {"g": torch.tensor([1.0, 2.0])}
    layout, mesh = L('"g": partial(dp)\n'), Mesh.of(dp=2)
    locs = [{"g": torch.tensor([1.0, 2.0])}, {"g": torch.tensor([10.0, 20.0])}]
    plans = [plan_save(layout, mesh, r, local_shapes(loc)) for r, loc in enumerate(locs)]
    from ucl.plan.layout_save import merge_plans
    from ucl.testing.layout_reference import apply_writes, empty_store

    arrays = merge_plans(plans)
    assert arrays["g"].shape == (2, 2) and arrays["g"].chunk_shape == (1, 2)
    assert arrays["g"].logical["partial"] == {"reduce": "sum", "count": 2}
    store = empty_store(arrays)
    for p, loc in zip(plans, locs, strict=True):
        apply_writes(store, p, {n: t.numpy() for n, t in loc.items()})
    assert read_logical(store, arrays, "g").tolist() == [11.0, 22.0]
    assert apply_reads(store, plan_load(arrays, Layout(), Mesh.of(dp=1), 0))["g"].tolist() == [11.0, 22.0]
    same = [apply_reads(store, plan_load(arrays, layout, mesh, r))["g"].tolist() for r in range(2)]
    assert same == [[1.0, 2.0], [10.0, 20.0]]  # the same split reloads bit-exactly
    with pytest.raises(Exception, match="partial contributions"):
        LogicalIndex(arrays).read("g", ((0,), (2,)))
    del full


def test_megatron_gpt_last_stage_holds_what_megatron_does():
    cfg = dict(num_layers=4, num_heads=4, num_kv_heads=2, hidden=8, ffn_hidden=12, vocab_size=30)
    full = {}
    for n, s in megatron_gpt_params(**cfg):
        full["model/" + n] = torch.zeros(s)
        full[f"optim/state/{n}/exp_avg"] = torch.zeros(s)
    mesh = Mesh.of(pp=2, dp=2, tp=2)
    local = shard_local_state(full, megatron_gpt(**cfg, zero=mesh), mesh, 7)  # last stage, dp=1, tp=1
    assert "model/output_layer.weight" in local and "model/embedding.word_embeddings.weight" not in local
    assert local["model/output_layer.weight"].shape == (128, 8)  # vocab 30 padded to 256 over tp=2
    assert sorted(n for n in local if n.startswith("optim")) == ["optim/flat/bucket0/exp_avg"]
    assert sorted(n for n in local if ".layers." in n)[0] == "model/decoder.layers.0.input_layernorm.weight"


@pytest.mark.parametrize(
    ("src", "dst", "zero"),
    [
        ((2, 2, 2), (4, 1, 1), (True, False)),
        ((4, 2, 1), (2, 1, 2), (True, True)),  # middle stages hold only layers: their flats match by stage
        ((1, 1, 4), (4, 2, 1), (False, True)),
    ],
)
def test_megatron_gpt_reshards_between_configurations(src, dst, zero):
    cfg = dict(num_layers=4, num_heads=4, num_kv_heads=2, hidden=8, ffn_hidden=12, vocab_size=30)
    full = {}
    for i, (n, s) in enumerate(megatron_gpt_params(**cfg)):
        full["model/" + n] = torch.arange(float(np.prod(s))).reshape(s) + 100 * i
        full[f"optim/state/{n}/exp_avg"] = -full["model/" + n]
    src_mesh, dst_mesh = Mesh.of(pp=src[0], dp=src[1], tp=src[2]), Mesh.of(pp=dst[0], dp=dst[1], tp=dst[2])
    src_layout = megatron_gpt(**cfg, zero=src_mesh if zero[0] else None)
    dst_layout = megatron_gpt(**cfg, zero=dst_mesh if zero[1] else None)
    _, _, arrays, store = save(full, src_mesh, src_layout)
    for r in range(dst_mesh.size):
        got = apply_reads(store, plan_load(arrays, dst_layout, dst_mesh, r))
        assert_same(got, shard_local_state(full, dst_layout, dst_mesh, r), f"rank {r}")


def test_load_a_selection_of_tensors():
    cfg = dict(num_layers=2, num_heads=4, num_kv_heads=2, hidden=8, ffn_hidden=12, vocab_size=30)
    full = {}
    for n, s in megatron_gpt_params(**cfg):
        full["model/" + n] = torch.ones(s)
        full[f"optim/state/{n}/exp_avg"] = torch.zeros(s)
    mesh = Mesh.of(pp=1, dp=2, tp=2)
    layout = megatron_gpt(**cfg, zero=mesh)
    _, _, arrays, store = save(full, mesh, layout)
    model = [n for n in full if n.startswith("model/")]
    plan = plan_load(arrays, layout, mesh, 3, tensors=model)  # model only: the flat statement matches nothing
    assert sorted(plan.local) == sorted(
        n for n in shard_local_state(full, layout, mesh, 3) if n.startswith("model/")
    )
    from ucl.errors import TensorNotFoundError

    with pytest.raises(TensorNotFoundError, match="no tensor 'model/nope' in the step"):
        plan_load(arrays, layout, mesh, 0, tensors=["model/nope"])


@st.composite
def gpt_configs(draw):
    while True:
        pp, dp, tp = (
            draw(st.sampled_from([1, 2, 4])),
            draw(st.sampled_from([1, 2])),
            draw(st.sampled_from([1, 2, 4])),
        )
        if pp * dp * tp <= 8:
            break
    mesh = Mesh.of(pp=pp, dp=dp, tp=tp)
    return mesh, dict(
        zero=mesh if draw(st.booleans()) else None, qkv=draw(st.sampled_from(["megatron", "concat", "interleaved"]))
    )


@settings(max_examples=examples(12), deadline=None)
@given(
    layers=st.integers(1, 5),
    kv=st.sampled_from([1, 2, 4]),
    tied=st.booleans(),
    bias=st.booleans(),
    swiglu=st.booleans(),
    src=gpt_configs(),
    dst=gpt_configs(),
)
def test_megatron_gpt_any_to_any(layers, kv, tied, bias, swiglu, src, dst):
    cfg = dict(
        num_layers=layers,
        num_heads=4,
        num_kv_heads=kv,
        hidden=4,
        ffn_hidden=6,
        vocab_size=11,
        tied=tied,
        bias=bias,
        swiglu=swiglu,
        vocab_multiple=2,
    )
    full = {}
    params = megatron_gpt_params(**{k: v for k, v in cfg.items() if k != "vocab_multiple"})
    for i, (n, s) in enumerate(params):
        full["model/" + n] = torch.arange(float(np.prod(s))).reshape(s) + 1000 * i
        full[f"optim/state/{n}/exp_avg"] = -full["model/" + n]
    (src_mesh, src_kw), (dst_mesh, dst_kw) = src, dst
    for mesh, kw in (src, dst):  # with zero= (a mesh) the builtin refuses what Megatron-core refuses
        tp, pp = mesh.axis_size("tp"), mesh.axis_size("pp")
        megatron_allows = (4 % tp == 0 and (kv % tp == 0 or tp % kv == 0) and (4 + 2 * kv) % tp == 0
                           and 6 % tp == 0 and layers % pp == 0)
        assume(kw["zero"] is None or megatron_allows)
    src_layout, dst_layout = megatron_gpt(**cfg, **src_kw), megatron_gpt(**cfg, **dst_kw)
    _, _, arrays, store = save(full, src_mesh, src_layout)
    for r in range(dst_mesh.size):
        got = apply_reads(store, plan_load(arrays, dst_layout, dst_mesh, r))
        assert_same(got, shard_local_state(full, dst_layout, dst_mesh, r), f"rank {r}")
