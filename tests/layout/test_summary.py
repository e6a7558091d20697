"""The compact coordination protocol (ucl/plan/summary.py) against the full one (merge_plans): whatever the
summaries accept, merge_plans accepts with the same arrays; whatever merge_plans refuses, the summaries
refuse (the manager then runs the full protocol, which names the problem)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.errors import UCLError
from ucl.layout import Mesh, parse_layout
from ucl.plan.items import RankPlan
from ucl.plan.layout_save import infer_shapes, merge_plans, plan_save
from ucl.plan.summary import check, missing, representatives, spec_digests, summarize
from ucl.testing.layout_reference import shard_local_state
from ucl.testing.layout_strategies import configs, logical_specs

from .helpers import examples, local_shapes, make_full

SETTINGS = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def L(text: str) -> Any:
    return parse_layout("ucl-layout 1\n" + text)


FLAT = (
    'flat "flat/{state}" -> "opt/{member}/{state}" over dp align 4: ["w.0" [4, 3], "w.1" [6, 3]]\n'
    '"opt/**": shard(0, tp)\n'
)


def compact(layout: Any, mesh: Mesh, plans: list[RankPlan]) -> Any:
    """The coordinator's verdict on these plans, as Planner._plan_compact reaches it (rank 0 coordinates)."""
    digests = [spec_digests(p.arrays) for p in plans]
    sums = [summarize(p, d) for p, d in zip(plans, digests, strict=True)]
    reps = representatives(sums, sums[0].arrays)
    assert 0 not in reps
    received = [missing(plans[r].arrays, digests[r], digests[0]) for r in reps]
    return check(layout, mesh, sums, plans[0].arrays, digests[0], received)


def full(layout: Any, mesh: Mesh, locs: list[dict[str, Any]]) -> Any:
    """merge_plans of the full protocol (logical shapes inferred from every rank's local shapes)."""
    shapes = [local_shapes(loc) for loc in locs]
    inferred = infer_shapes(layout, mesh, shapes)
    return merge_plans([plan_save(layout, mesh, r, s, shapes=inferred) for r, s in enumerate(shapes)])


@SETTINGS
@given(spec=logical_specs(), data=st.data())
def test_the_summaries_accept_exactly_the_merged_arrays(spec, data):
    mesh, layout = data.draw(configs(spec))
    whole = make_full(spec)
    locs = [shard_local_state(whole, layout, mesh, r) for r in range(mesh.size)]
    want = full(layout, mesh, locs)
    try:  # each rank alone: a split dim without a declared size assumed even
        plans = [plan_save(layout, mesh, r, local_shapes(loc)) for r, loc in enumerate(locs)]
    except UCLError:
        return  # a rank could not plan alone: the full protocol runs
    got = compact(layout, mesh, plans)
    if got is not None:
        assert got == want
    else:  # refused: only an uneven split (a rank's even assumption differs from the logical shape)
        assert any(p.arrays[n].shape != want[n].shape for p in plans for n in p.arrays if n in want)


def test_dp_ranks_send_nothing_but_their_summary():
    layout = L('"emb": shard(0, tp)\n"l.*.w": shard(1, tp)\n')
    mesh = Mesh.of(dp=4, tp=2)
    local = {"emb": ((5, 3), "float32"), "l.0.w": ((4, 2), "float32"), "l.1.w": ((4, 2), "float32")}
    plans = [plan_save(layout, mesh, r, local) for r in range(mesh.size)]
    sums = [summarize(p, spec_digests(p.arrays)) for p in plans]
    assert representatives(sums, sums[0].arrays) == []  # every rank holds the same arrays
    assert len({s.coverage for s in sums}) > 1  # but writes other chunks
    got = compact(layout, mesh, plans)
    assert got == merge_plans(plans) and got is not None
    assert len(repr(sums[3].to_tuple())) < 200


def _zero_flat(dp: int) -> tuple[Any, Mesh, list[dict[str, Any]]]:
    layout = L('"w.*": shard(0, tp)\n' + FLAT)
    mesh = Mesh.of(dp=dp, tp=2)
    whole = make_full({"w.0": ((4, 3), "float32"), "w.1": ((6, 3), "float32"),
                       "opt/w.0/m": ((4, 3), "float32"), "opt/w.1/m": ((6, 3), "float32")})
    return layout, mesh, [shard_local_state(whole, layout, mesh, r) for r in range(mesh.size)]


def test_flat_buffers_one_representative_per_tp_coordinate():
    layout, mesh, locs = _zero_flat(3)
    plans = [plan_save(layout, mesh, r, local_shapes(loc)) for r, loc in enumerate(locs)]
    digests = [spec_digests(p.arrays) for p in plans]
    sums = [summarize(p, d) for p, d in zip(plans, digests, strict=True)]
    reps = representatives(sums, sums[0].arrays)
    assert [mesh.coords(r)["tp"] for r in reps] == [1]  # tp=1's flat buffer: its first dp rank
    sent = missing(plans[reps[0]].arrays, digests[reps[0]], digests[0])
    assert [d["name"] for _, d in sent] == ["flat/m.tp1"]
    assert compact(layout, mesh, plans) == full(layout, mesh, locs)


def _without(plan: RankPlan, k: int) -> RankPlan:
    return dataclasses.replace(plan, writes=[w for i, w in enumerate(plan.writes) if i != k])


@pytest.mark.parametrize("tamper", ["duplicate", "missing", "moved", "disagree", "rank", "unmatched", "layout"])
def test_the_summaries_refuse_what_merge_plans_refuses(tamper):
    layout, mesh, locs = _zero_flat(2)
    plans = [plan_save(layout, mesh, r, local_shapes(loc)) for r, loc in enumerate(locs)]
    if tamper == "duplicate":  # rank 3 also writes a chunk rank 1 writes
        plans[3] = dataclasses.replace(plans[3], writes=[*plans[3].writes, plans[1].writes[0]])
    elif tamper == "missing":  # a chunk nobody writes
        plans[2] = _without(plans[2], 0)
    elif tamper == "moved":  # one chunk twice and another not at all: the count matches, the hash does not
        plans[2] = dataclasses.replace(_without(plans[2], 0), writes=[*plans[2].writes[1:], plans[1].writes[0]])
    elif tamper == "disagree":  # a rank records an array with another shape
        name = next(iter(plans[1].arrays))
        spec = plans[1].arrays[name]
        bad = dataclasses.replace(spec, shape=(spec.shape[0] + 2, *spec.shape[1:]))
        plans[1] = dataclasses.replace(plans[1], arrays={**plans[1].arrays, name: bad})
    elif tamper == "rank":  # two plans of one rank
        plans[3] = dataclasses.replace(plans[3], rank=2)
    elif tamper == "unmatched":  # a statement no rank matched
        layout = L('"w.*": shard(0, tp)\n"nothing": replicate\n' + FLAT)
        plans = [plan_save(layout, mesh, r, local_shapes(loc)) for r, loc in enumerate(locs)]
    elif tamper == "layout":  # a rank planned with another layout
        other = L('"w.*": shard(0, tp)\n' + FLAT + '"x": replicate\n')
        plans[2] = dataclasses.replace(plans[2], layout_json=other.to_dict())
    with pytest.raises(UCLError):
        merge_plans(plans)
    assert compact(layout, mesh, plans) is None
