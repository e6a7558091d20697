"""The writers' log: ``logging.getLogger("ucl.write")`` (a child of ``"ucl"``, which has only a NullHandler:
applications choose where records go, e.g. ``logging.basicConfig(level=logging.INFO)``).

=========  =======  =======================================================================================
level      who      event
=========  =======  =======================================================================================
DEBUG      manager  a save staged: step, bytes, how long ``save`` blocked the caller
DEBUG      writer   a commit record written (every writer: save, the manager, import, compact, DCP)
INFO       writer   a step committed: step, kind, bytes, seconds, GB/s (the manager: the coordinator, from
                    the persister's first byte to the commit record; ``ucl.save``: from ``begin``)
INFO       manager  retention deletes steps; a step deleted; a step restored (step, repository, seconds)
WARNING    manager  a commit slower than expected: over 3x the time the manager's recent commits of the same
                    kind took per byte, and over 1 s
ERROR      manager  a save failed: step, the error's code and message (its handle raises the error)
=========  =======  =======================================================================================
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ucl.write")

SLOW_FACTOR = 3.0  # a commit taking this many times its expected time is slow ...
SLOW_MIN_S = 1.0  # ... when it also takes at least this long
_EWMA = 0.3  # weight of the newest commit in the expected rate


def code_of(e: BaseException) -> str:
    """An error's stable code (a UCLError's), else its type's name."""
    code = getattr(e, "code", None)
    return code if isinstance(code, str) else type(e).__name__


def committed(step: int, url: str, kind: str, nbytes: int, seconds: float, *,
              level: int = logging.INFO) -> None:
    """Log a committed step (its size, time and rate)."""
    if log.isEnabledFor(level):
        rate = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
        log.log(level, "step %d committed (%s) in %s: %.1f MB in %.2f s (%.2f GB/s)", step, kind, url,
                nbytes / 1e6, seconds, rate)


class SaveEvents:
    """The log lines of one :class:`ucl.CheckpointManager` and what they need to remember: when each step's
    persisting began, and the recent rate of commits per kind (for the slow-commit warning).

    Parameters
    ----------
    url
        The repository's URL (named in the records).
    rank
        This process's rank (committed steps are reported at INFO by the coordinator only).
    clock
        Seconds, monotonic (default ``time.perf_counter``).
    """

    def __init__(self, url: str, rank: int = 0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.url, self.rank, self.clock = url, rank, clock
        self._started: dict[int, float] = {}
        self._rate: dict[str, tuple[float, int]] = {}  # kind -> (expected bytes per second, commits seen)

    def staged(self, step: int, nbytes: int, blocked_s: float) -> None:
        log.debug("step %d staged: %.1f MB; save blocked the caller %.1f ms", step, nbytes / 1e6,
                  blocked_s * 1e3)

    def started(self, step: int) -> None:
        """The persister took the step's first piece."""
        self._started.setdefault(step, self.clock())

    def committed(self, step: int, record: Any, kind: str) -> None:
        """The step is committed (``record`` is the commit record on the coordinator, None elsewhere)."""
        t0 = self._started.pop(step, None)
        seconds = 0.0 if t0 is None else max(self.clock() - t0, 0.0)
        if record is None:
            log.debug("step %d committed in %s (rank %d's shards, %.2f s)", step, self.url, self.rank,
                      seconds)
            return
        nbytes = int(record.nbytes)
        committed(step, self.url, kind, nbytes, seconds)
        rate, seen = self._rate.get(kind, (0.0, 0))
        if seen >= 2 and rate > 0 and seconds >= SLOW_MIN_S and seconds > SLOW_FACTOR * nbytes / rate:
            expected = nbytes / rate
            log.warning("step %d was slow to commit: %.2f s for %.1f MB (%s), %.1fx the %.2f s expected from "
                        "the recent commits (%.2f GB/s); storage slower than usual?", step, seconds,
                        nbytes / 1e6, kind, seconds / expected, expected, rate / 1e9)
        if seconds > 0 and nbytes > 0:
            new = nbytes / seconds
            self._rate[kind] = (new if seen == 0 else (1 - _EWMA) * rate + _EWMA * new, seen + 1)

    def failed(self, step: int, e: BaseException) -> None:
        """The step failed (on this rank: its own error, or the verdict of another)."""
        self._started.pop(step, None)
        log.error("step %d was not saved in %s: [%s] %s", step, self.url, code_of(e),
                  getattr(e, "message", e))

    def restored(self, step: int | None, seconds: float, layout: Any = None) -> None:
        where = "" if layout is None else f" (rank {self.rank}'s state under the manager's layout)"
        log.info("restored step %s from %s%s in %.2f s", step, self.url, where, seconds)
