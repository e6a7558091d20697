"""ucl.write.policy: Young/Daly checkpoint intervals from measured costs, and full-vs-delta decisions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucl.errors import InvalidArgumentError
from ucl.write.policy import AdaptiveInterval, DeltaPolicy, daly_interval, young_interval


def test_young_and_daly_formulas() -> None:
    assert young_interval(10.0, 3600.0) == pytest.approx(math.sqrt(2 * 10 * 3600))
    # Daly: sqrt(2cM)(1 + sqrt(c/2M)/3 + (c/2M)/9) - c
    c, m = 60.0, 3600.0
    r = c / (2 * m)
    assert daly_interval(c, m) == pytest.approx(math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c)
    assert daly_interval(8000.0, 3600.0) == 3600.0  # cost >= 2 MTBF: checkpoint every MTBF
    assert daly_interval(0.0, 3600.0) == 0.0 == young_interval(0.0, 3600.0)
    with pytest.raises(InvalidArgumentError, match="mtbf must be a positive number"):
        young_interval(1.0, 0.0)
    with pytest.raises(InvalidArgumentError, match="cost must be a non-negative number"):
        daly_interval(-1.0, 10.0)
    with pytest.raises(InvalidArgumentError):
        daly_interval(float("nan"), 10.0)


@settings(max_examples=200, deadline=None)
@given(c=st.floats(1e-6, 1e4), m=st.floats(1.0, 1e7))
def test_daly_tends_to_young_and_minimises_overhead(c: float, m: float) -> None:
    d, y = daly_interval(c, m), young_interval(c, m)
    if c < 1e-4 * m:  # first order regime
        assert d == pytest.approx(y, rel=0.02)
    if c < 2 * m:
        # Daly's expected run time per unit of work, M e^{R/M} (e^{(T+c)/M} - 1) / T, is minimal
        # near T_opt (R = 0)
        def waste(t: float) -> float:
            return m * math.expm1((t + c) / m) / t

        assert waste(d) <= waste(d * 1.3) + 1e-9 * waste(d)
        assert waste(d) <= waste(d / 1.3) + 1e-9 * waste(d)


def test_adaptive_interval_measures_first_then_follows_costs() -> None:
    p = AdaptiveInterval(mtbf=3600.0, alpha=0.5, formula="young")
    assert p.should_save(1, now=0.0)  # no cost yet: save to measure one
    assert not p.should_save(1, now=1000.0)  # never twice for a step
    p.record_save(2.0)
    assert p.interval() == pytest.approx(young_interval(2.0, 3600.0))  # 120 s
    assert not p.should_save(2, now=100.0)
    assert p.should_save(3, now=120.5)
    p.record_save(18.0)  # EWMA: 0.5 * 18 + 0.5 * 2 = 10
    assert p.cost == pytest.approx(10.0)
    assert p.interval() == pytest.approx(young_interval(10.0, 3600.0))  # ~268 s
    assert not p.should_save(4, now=120.5 + 200)
    assert p.should_save(5, now=120.5 + 270)
    assert p.saves == 2
    assert p.expected_overhead() == pytest.approx(10.0 / p.interval() + p.interval() / 7200.0)


def test_a_save_costs_its_blocked_time_and_what_it_slows_the_steps_it_overlaps() -> None:
    """On a CPU-bound host the background write slows training: the cost is the overlapped steps' excess
    over the step time without a save in flight (the step that saved includes the blocked staging)."""
    p = AdaptiveInterval(mtbf=3600.0, alpha=1.0)
    p.step(0.0, busy=False)
    assert not p.should_save(0, 0.0)  # no step time yet to measure a save's excess against
    for t in (1.0, 2.0):
        p.step(t, busy=False)
    assert p.step_time == pytest.approx(1.0) and p.cost is None
    assert p.should_save(2, 2.0)  # now the first save measures a cost
    p.saved(0.1)  # at t = 2.0, blocking 0.1 s
    p.step(3.6, busy=True)  # 1.6 s: the staging and the writer's interference
    p.step(5.1, busy=True)  # 1.5 s
    assert p.saves == 0  # still in flight
    p.step(6.1, busy=False)  # the save is done: 0.6 + 0.5 + 0.0
    assert p.saves == 1 and p.cost == pytest.approx(1.1)
    assert p.step_time == pytest.approx(1.0)  # busy steps do not count as the loop's own
    p.saved(0.2)
    p.step(7.1, busy=False)  # done within one ordinary step: it cost its blocked time
    assert p.saves == 2 and p.cost == pytest.approx(0.2)
    p.saved(0.05)
    p.step(9.1, busy=True)
    p.saved(0.05)  # a save while the previous one is open closes it with what it cost so far
    assert p.saves == 3 and p.cost == pytest.approx(1.0)
    q = AdaptiveInterval(mtbf=3600.0)
    q.saved(0.3)  # before any step time is known: the blocked time is the cost
    q.step(1.0, busy=False)
    q.step(2.0, busy=False)
    assert q.cost == pytest.approx(0.3) and q.saves == 1
    with pytest.raises(InvalidArgumentError):
        q.saved(-1.0)


def test_adaptive_interval_bounds_and_initial_cost() -> None:
    p = AdaptiveInterval(mtbf=100.0, initial_cost=0.0, min_interval=5.0, max_interval=50.0)
    assert p.interval() == 5.0  # a free save would checkpoint every step: floored
    assert not p.should_save(1, now=0.0)  # the first call starts the clock when a cost is known
    assert p.should_save(2, now=5.0)
    p.record_save(1000.0)
    assert p.interval() == 50.0  # ceiling
    assert math.isnan(AdaptiveInterval(mtbf=1.0).expected_overhead())
    for bad in [
        dict(alpha=0.0),
        dict(alpha=1.5),
        dict(min_interval=-1.0),
        dict(min_interval=10.0, max_interval=5.0),
        dict(formula="other"),
    ]:
        with pytest.raises(InvalidArgumentError):
            AdaptiveInterval(mtbf=10.0, **bad)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=30), alpha=st.floats(0.01, 1.0))
def test_ewma_stays_within_the_measured_range(costs: list[float], alpha: float) -> None:
    p = AdaptiveInterval(mtbf=1e5, alpha=alpha)
    for c in costs:
        p.record_save(c)
    assert min(costs) - 1e-9 <= p.cost <= max(costs) + 1e-9  # type: ignore[operator]


def test_delta_policy_full_every_and_max_chain() -> None:
    def run(policy: DeltaPolicy, n: int) -> str:
        since: int | None = None
        out = []
        for _ in range(n):
            kind = policy.decide(since)
            out.append("F" if kind == "full" else "d")
            since = 0 if kind == "full" else since + 1  # type: ignore[operator]
        return "".join(out)

    assert run(DeltaPolicy(full_every=3), 7) == "FddFddF"
    assert run(DeltaPolicy(full_every=1), 3) == "FFF"
    assert run(DeltaPolicy(full_every=None, max_chain=2, base="previous"), 7) == "FddFddF"
    assert run(DeltaPolicy(max_chain=0, base="previous"), 3) == "FFF"
    assert run(DeltaPolicy(full_every=None, base="previous"), 70) == "F" + "d" * 64 + "F" + "d" * 4
    assert run(DeltaPolicy(), 17) == "F" + "d" * 7 + "F" + "d" * 7 + "F"  # default: base="full", full_every=8
    assert run(DeltaPolicy(full_every=10, max_chain=3, base="full"), 11) == "F" + "d" * 9 + "F"
    p = DeltaPolicy(base="full")
    assert p.parent(previous_step=7, last_full_step=4) == 4
    assert DeltaPolicy(base="previous").parent(previous_step=7, last_full_step=4) == 7
    assert DeltaPolicy().parent(previous_step=7, last_full_step=4) == 4
    assert DeltaPolicy(max_chain=1).decide(0, previous_chain=1) == "full"


def test_delta_policy_validates() -> None:
    for bad in [dict(full_every=0), dict(full_every=True), dict(max_chain=-1), dict(base="parent")]:
        with pytest.raises(InvalidArgumentError):
            DeltaPolicy(**bad)  # type: ignore[arg-type]
