"""Checkpoint policies: when to save (Young/Daly) and whether a save is full or a delta.

:class:`AdaptiveInterval` picks the checkpoint interval that minimises expected lost work for a
user-given mean time between failures (MTBF) and the *measured* cost of a save, re-estimated as costs
change (an exponentially weighted moving average). :class:`DeltaPolicy` decides, save by save, whether
a step is written full or as a delta (spec/delta.md §6).

Call sequence (the training loop, or ``CheckpointManager`` on its behalf, on the coordinator)::

    interval = AdaptiveInterval(mtbf=6 * 3600)
    for step in ...:
        train_step()
        if interval.should_save(step, time.monotonic()):   # 1. ask
            t0 = time.monotonic()
            handle = manager.save(step, state)              # 2. save (blocking part only)
            interval.record_save(time.monotonic() - t0)     # 3. tell what it cost

The cost to record is what the save takes away from training: for an asynchronous save, the time the
training loop was blocked (staging), not the time the background write took, *plus* what the background
write slows the loop down while it runs (on a CPU-bound host the writer's checksums and copies compete
with training for the cores). :meth:`AdaptiveInterval.step` measures that for a loop that reports every
step: it keeps the step time of steps with no save in flight and charges each save the excess of the
steps it overlapped, its blocked staging included (``CheckpointManager.save_if_due`` does this).

Nothing here reads a clock: times are passed in, so the policies are deterministic and testable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ucl.errors import InvalidArgumentError
from ucl.write.prune import Prune, parse_policy_args

__all__ = ["AdaptiveInterval", "DeltaPolicy", "daly_interval", "young_interval"]


def _positive(x: float, what: str, allow_zero: bool = False) -> float:
    if (
        not isinstance(x, (int, float))
        or isinstance(x, bool)
        or math.isnan(x)
        or x < 0
        or (x == 0 and not allow_zero)
    ):
        raise InvalidArgumentError(
            f"{what} must be a {'non-negative' if allow_zero else 'positive'} number, got {x!r}"
        )
    return float(x)


def young_interval(cost: float, mtbf: float) -> float:
    """Young's first-order optimum: ``sqrt(2 * cost * mtbf)`` seconds of work between checkpoints.

    Parameters
    ----------
    cost : float
        Seconds a checkpoint costs (>= 0).
    mtbf : float
        Mean time between failures in seconds (> 0).

    Returns
    -------
    float
        The interval in seconds.
    """
    return math.sqrt(2.0 * _positive(cost, "cost", allow_zero=True) * _positive(mtbf, "mtbf"))


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum (Daly 2006, eq. 37), accurate when ``cost`` is not << ``mtbf``.

    For ``cost < 2 * mtbf``::

        T = sqrt(2 c M) * (1 + sqrt(c / (2 M)) / 3 + (c / (2 M)) / 9) - c

    and ``T = M`` otherwise. Reduces to Young's ``sqrt(2 c M)`` as ``c / M -> 0``.

    Parameters
    ----------
    cost : float
        Seconds a checkpoint costs (>= 0).
    mtbf : float
        Mean time between failures in seconds (> 0).

    Returns
    -------
    float
        The interval in seconds of work between the end of one checkpoint and the start of the next
        (never below ``cost``'s Young interval's lower bound of 0).
    """
    c, m = _positive(cost, "cost", allow_zero=True), _positive(mtbf, "mtbf")
    if c >= 2.0 * m:
        return m
    r = c / (2.0 * m)
    return max(0.0, math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - c)


class AdaptiveInterval:
    """When to checkpoint: every Daly-optimal interval, re-estimated from measured save costs.

    Parameters
    ----------
    mtbf : float
        Mean time between failures of the job, in seconds (the whole job: for n nodes that each fail
        every M seconds on average, M / n).
    initial_cost : float, optional
        A first guess of a save's cost in seconds. Without it the first opportunity saves, so that a
        cost is measured.
    alpha : float, optional
        Weight of the newest measurement in the moving average of costs (0 < alpha <= 1).
    min_interval, max_interval : float, optional
        Bounds on the interval in seconds (e.g. a floor against saving every step when saves are
        nearly free, a ceiling for the work one is willing to lose).
    formula : {"daly", "young"}, optional
        The optimum used.

    Notes
    -----
    ``should_save`` compares the time since the last save was *decided* against the interval, so the
    interval counts wall time including the training the save overlapped with.
    """

    def __init__(
        self,
        mtbf: float,
        *,
        initial_cost: float | None = None,
        alpha: float = 0.3,
        min_interval: float = 0.0,
        max_interval: float = math.inf,
        formula: str = "daly",
    ) -> None:
        self.mtbf = _positive(mtbf, "mtbf")
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
            raise InvalidArgumentError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.min_interval = _positive(min_interval, "min_interval", allow_zero=True)
        self.max_interval = (
            float(max_interval) if max_interval == math.inf else _positive(max_interval, "max_interval")
        )
        if self.min_interval > self.max_interval:
            raise InvalidArgumentError(f"min_interval {min_interval} exceeds max_interval {max_interval}")
        if formula not in ("daly", "young"):
            raise InvalidArgumentError(f"formula must be 'daly' or 'young', got {formula!r}")
        self.formula = formula
        self.cost: float | None = (
            None if initial_cost is None else _positive(initial_cost, "initial_cost", allow_zero=True)
        )
        self.saves = 0
        self._last_time: float | None = None
        self._last_step: int | None = None
        self._start: float | None = None
        # step(): the loop's step time without a save in flight, and the excess the open save caused
        self.step_time: float | None = None
        self._tick: float | None = None
        self._open: float | None = None  # the blocked time of the save in flight, or None
        self._excess = 0.0

    def interval(self) -> float:
        """The current interval in seconds (``min_interval`` while no cost is known)."""
        if self.cost is None:
            return self.min_interval
        f = daly_interval if self.formula == "daly" else young_interval
        return min(self.max_interval, max(self.min_interval, f(self.cost, self.mtbf)))

    def should_save(self, step: int, now: float) -> bool:
        """Whether to checkpoint ``step`` now (``now``: a monotonic clock in seconds).

        True at the first call when no cost is known (to measure one; with :meth:`step` reporting, at
        the first call once a step time is known), then whenever at least ``interval()`` seconds passed
        since the last save was decided. A True answer starts the next interval; never True twice for
        the same step.
        """
        if self._start is None:
            self._start = now
        if self._last_step is not None and step <= self._last_step:
            return False
        since = now - (self._last_time if self._last_time is not None else self._start)
        if self.cost is None and self._last_time is None:
            # save to measure a cost; with step() reporting, once the loop's step time is known, so
            # that the save's excess over it can be measured
            due = self._tick is None or self.step_time is not None
        else:
            due = since >= self.interval()
        if due:
            self._last_time, self._last_step = now, step
        return due

    def record_save(self, cost_seconds: float) -> None:
        """Report what the last save cost training, in seconds; updates the moving average."""
        c = _positive(cost_seconds, "cost_seconds", allow_zero=True)
        self.cost = c if self.cost is None else self.alpha * c + (1.0 - self.alpha) * self.cost
        self.saves += 1

    def step(self, now: float, busy: bool) -> None:
        """Report that the loop reached its next step at ``now``; ``busy``: a save's background write was
        still running during the step that just ended. Updates :attr:`step_time` from steps without a
        save in flight, accumulates the open save's excess, and records the save's cost (its blocked
        time and the excess of every step it overlapped) once it is done."""
        if self._tick is not None:
            dt = now - self._tick
            if self._open is not None:
                if self.step_time is not None:
                    self._excess += max(0.0, dt - self.step_time)
            elif not busy:
                old = self.step_time
                self.step_time = dt if old is None else self.alpha * dt + (1 - self.alpha) * old
        self._tick = now
        if self._open is not None and not busy:
            self._close()

    def saved(self, blocked: float) -> None:
        """A save was just taken, blocking the loop ``blocked`` seconds; with :meth:`step` its cost is
        recorded when it is done (a save still open is closed first, with what it cost so far)."""
        if self._open is not None:
            self._close()
        self._open, self._excess = _positive(blocked, "blocked", allow_zero=True), 0.0

    def _close(self) -> None:
        blocked, self._open = self._open or 0.0, None
        # without a step time yet the excess is unknown: the blocked time is the best there is; the
        # blocked time is inside the excess otherwise (the step that saved took it longer)
        self.record_save(blocked if self.step_time is None else max(blocked, self._excess))

    def expected_overhead(self) -> float:
        """Expected fraction of time lost to checkpoints and re-done work at the current interval
        (first order: ``c / T + T / (2 M)``); ``nan`` while no cost is known."""
        if self.cost is None:
            return math.nan
        t = max(self.interval(), 1e-9)
        return self.cost / t + t / (2.0 * self.mtbf)


@dataclass(frozen=True)
class DeltaPolicy:
    """Full or delta, save by save (spec/delta.md §6).

    Parameters
    ----------
    full_every : int or None
        Write a full step every ``full_every`` saves (1: always full; default 8); None: only when
        ``max_chain`` forces it (or when no base is available).
    max_chain : int
        The most delta steps between a step and its full base; must not exceed the limit readers apply
        (64 by default, spec/delta.md §6).
    base : {"full", "previous"}
        The parent of a delta step. ``"full"`` (default): the last full step, whose staged copy the
        engine keeps; every chain is one delta long, so a restore reads about 1.5x the bytes of a full
        step at any distance (bench/delta_read.py: 1.9x the time of a full read, 8 saves away), and a
        damaged delta harms only its own step; deltas grow with the distance (7% at 8 saves).
        ``"previous"``: the previous saved step: the smallest deltas, but a restore reads every link of
        the chain (6.3x the bytes of a full step at depth 8, 7.7x the time).
    gradients : bool
        Store a save taken one optimizer step after the previous one as that step's gradients (the
        ``ucl.gradient_records`` extension, spec/delta.md §8) when ``save(..., optimizer=)`` is given;
        readers replay the optimizer step. Other saves are full or delta steps as above.
    prune : Prune or None
        Composite steps (spec/delta.md §9, opt-in, lossy): a delta save stores only the groups of tensors
        (a parameter with its optimizer state, by default a layer's) that changed more than
        ``prune.threshold`` since their last stored version, and refers to older steps for the others;
        such a step is marked approximate and readers refuse it unless asked for ``approximate=True``.
        Needs ``base="previous"`` (a stale group's values are in an older step of the chain), one
        process, and no layout; ``save(..., optimizer=)`` puts each parameter's optimizer state in its
        group. Full steps every ``full_every`` saves, as above. docs/composite.md.
    """

    full_every: int | None = 8
    max_chain: int = 64
    base: str = "full"
    gradients: bool = False
    prune: Prune | None = None

    def __post_init__(self) -> None:
        if self.full_every is not None and (
            not isinstance(self.full_every, int) or isinstance(self.full_every, bool) or self.full_every < 1
        ):
            raise InvalidArgumentError(
                f"full_every must be a positive integer or None, got {self.full_every!r}"
            )
        if not isinstance(self.max_chain, int) or isinstance(self.max_chain, bool) or self.max_chain < 0:
            raise InvalidArgumentError(f"max_chain must be a non-negative integer, got {self.max_chain!r}")
        if self.base not in ("previous", "full"):
            raise InvalidArgumentError(f"base must be 'previous' or 'full', got {self.base!r}")
        if not isinstance(self.gradients, bool):
            raise InvalidArgumentError(f"gradients must be a bool, got {self.gradients!r}")
        if parse_policy_args(self.prune) is not None:
            if self.base != "previous":
                raise InvalidArgumentError("DeltaPolicy(prune=...) needs base='previous': a composite step "
                                           "refers to older steps of its chain for the groups it does not "
                                           "store")
            if self.gradients:
                raise InvalidArgumentError("DeltaPolicy: prune and gradients cannot be combined (a gradient "
                                           "replay needs the exact parent state)")

    def decide(self, saves_since_full: int | None, previous_chain: int | None = None) -> str:
        """``"full"`` or ``"delta"`` for the next save.

        Parameters
        ----------
        saves_since_full : int or None
            Saves since the last full one (0 right after it), or None when there is no usable base
            (first save, a base evicted, a changed set of tensors, a failed previous save).
        previous_chain : int, optional
            Delta steps in the chain of the step the new delta would use as its parent (defaults to
            ``saves_since_full`` for ``base="previous"`` and 0 for ``base="full"``).

        Returns
        -------
        str
        """
        if saves_since_full is None or saves_since_full < 0:
            return "full"
        if self.full_every is not None and saves_since_full + 1 >= self.full_every:
            return "full"
        if previous_chain is None:
            previous_chain = saves_since_full if self.base == "previous" else 0
        if previous_chain + 1 > self.max_chain:
            return "full"
        return "delta"

    def parent(self, previous_step: int, last_full_step: int) -> int:
        """The parent of a delta step: the previous saved step, or the last full one."""
        return previous_step if self.base == "previous" else last_full_step
