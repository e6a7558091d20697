"""Property tests of the pure planner: coverage, save/load identity across configurations, bytes read."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.layout import Layout, Mesh, Rule, Shard
from ucl.layout.boxes import full as full_box
from ucl.plan.layout_load import LogicalIndex, plan_load
from ucl.plan.layout_save import stored_chunks
from ucl.testing.layout_reference import apply_reads, read_logical, shard_local_state, unshard
from ucl.testing.layout_strategies import configs, logical_specs, meshes

from .helpers import assert_same, examples, make_full, save, sl

SETTINGS = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(spec=logical_specs(), data=st.data())
def test_writes_cover_every_stored_element_once(spec, data):
    mesh, layout = data.draw(configs(spec))
    _, plans, arrays, _ = save(make_full(spec), mesh, layout)
    counts = {n: np.zeros(a.shape, np.int64) for n, a in arrays.items()}
    written = set()
    for p in plans:
        for w in p.writes:
            chunk = w.array.chunk_box(w.chunk_index)
            assert all(c <= s and s + n <= c + m for s, n, c, m in zip(*w.stored_box, *chunk, strict=True))
            counts[w.array.name][sl(w.stored_box)] += 1
            written.add((w.array.name, w.chunk_index))
    assert written == {(n, c) for n, a in arrays.items() for c in stored_chunks(a)}
    for n, c in counts.items():
        assert c.max(initial=0) <= 1, f"{n}: an element written twice"
    index = LogicalIndex(arrays)
    for name, (shape, _) in index.tensors.items():
        cover = np.zeros(shape, np.int64)
        for array, sbox, rbox in index.read(name, full_box(shape), sum_partial=True):
            cover[sl(rbox)] += 1
            assert (counts[array][sl(sbox)] == 1).all(), f"{name}: reads a stored element nobody wrote"
        assert (cover == max(1, index.partial(name))).all(), f"{name}: not covered exactly once"


@SETTINGS
@given(spec=logical_specs(), data=st.data())
def test_save_then_load_under_another_configuration_is_the_identity(spec, data):
    src_mesh, src = data.draw(configs(spec))
    tgt_mesh, tgt = data.draw(configs(spec))
    full = make_full(spec)
    locs, _, arrays, store = save(full, src_mesh, src, shapes=data.draw(st.booleans()))
    for name, t in full.items():
        assert np.array_equal(read_logical(store, arrays, name), t.numpy()), name
    for rank in range(tgt_mesh.size):
        plan = plan_load(arrays, tgt, tgt_mesh, rank)
        want = shard_local_state(full, tgt, tgt_mesh, rank)
        assert_same(apply_reads(store, plan), want, f"target rank {rank}")
        once = {n: np.zeros(max(1, math.prod(s)), np.int64) for n, (s, _) in plan.local.items()}
        for it in plan.items:
            if it.reduce is None:
                region = once[it.local_name][: math.prod(plan.local[it.local_name][0])]
                view = region.reshape(plan.local[it.local_name][0])
                if it.local_view is not None:
                    off, vshape = it.local_view
                    view = region[off : off + math.prod(vshape)].reshape(vshape)
                view[sl(it.local_box)] += 1
        assert all(c.max(initial=0) <= 1 for c in once.values()), "a local element is read twice"
    back = unshard(locs, src, src_mesh)
    assert sorted(back) == sorted(full)
    for n, t in full.items():
        assert torch.equal(back[n], t), n


@settings(max_examples=examples(60), deadline=None)
@given(
    src=meshes(max_axes=2),
    tgt=meshes(max_axes=2),
    rows=st.integers(0, 9),
    cols=st.integers(0, 9),
    data=st.data(),
)
def test_bytes_read_equal_local_bytes_for_row_and_column_resharding(src, tgt, rows, cols, data):
    def layout(mesh):
        if not mesh.names:
            return Layout()
        axes = tuple(data.draw(st.lists(st.sampled_from(mesh.names), unique=True, min_size=1)))
        return Layout((Rule(("w",), (Shard(data.draw(st.integers(0, 1)), axes),)),))

    full = {"w": torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)}
    src_layout, tgt_layout = layout(src), layout(tgt)
    _, _, arrays, store = save(full, src, src_layout)
    for rank in range(tgt.size):
        plan = plan_load(arrays, tgt_layout, tgt, rank)
        shape = plan.local["w"][0]
        assert sum(it.numel for it in plan.items) == math.prod(shape)
        assert not plan.zero
        assert_same(apply_reads(store, plan), shard_local_state(full, tgt_layout, tgt, rank))


@settings(max_examples=examples(30), deadline=None)
@given(mesh=meshes(max_axes=2, max_ranks=8), sizes=st.lists(st.integers(1, 50), min_size=1, max_size=20))
def test_replicated_chunks_are_written_once_and_balanced(mesh, sizes):
    full = {f"r{i}": torch.ones(n) for i, n in enumerate(sizes)}
    _, plans, _, _ = save(full, mesh, Layout())
    load = [sum(w.nbytes for w in p.writes) for p in plans]
    assert sum(len(p.writes) for p in plans) == len(sizes)
    assert max(load) - min(load) <= 4 * max(sizes)  # greedy largest-first: within one tensor


def test_balance_spreads_equal_tensors_round_robin():
    full = {f"r{i}": torch.ones(8) for i in range(8)}
    _, plans, _, _ = save(full, Mesh.of(dp=2, tp=2), Layout())
    assert [len(p.writes) for p in plans] == [2, 2, 2, 2]
