"""The future of one ``CheckpointManager.save``."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from ucl.format.metadata import CommitRecord


class SaveHandle:
    """The future of one ``save``: ``result()`` blocks until the step is committed and durable.

    Parameters
    ----------
    step
        The step being saved.
    skipped
        True when the save was skipped (``when_busy="skip"`` with no free staging slot): the handle is
        done at once, its result None.
    future
        The future the manager's persister completes (a new one when not given).

    Attributes
    ----------
    staged_s : float
        Seconds ``save`` blocked the caller (planning and staging).
    """

    def __init__(self, step: int, skipped: bool = False, *,
                 future: Future[CommitRecord | None] | None = None) -> None:
        self.step = step
        self.skipped = skipped
        self._future: Future[CommitRecord | None] = Future() if future is None else future
        self.staged_s = 0.0
        self.observed = False  # the caller has seen the outcome (result/exception): wait/close do not re-raise it
        if skipped:
            self._future.set_result(None)

    def result(self, timeout: float | None = None) -> CommitRecord | None:
        """The commit record (on the coordinator; None on other ranks and for skipped saves).

        Raises the save's error (a UCLError, e.g. WriteError naming the file) if it failed.
        """
        try:
            out = self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"step {self.step} is not committed after {timeout} s") from None
        except BaseException:
            self.observed = True
            raise
        self.observed = True
        return out

    def done(self) -> bool:
        """Whether the save has finished (committed, failed or skipped)."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error, or None once it committed (blocks like :meth:`result`)."""
        try:
            err = self._future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"step {self.step} is not committed after {timeout} s") from None
        self.observed = True
        return err

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "done" if self.done() else "pending"
        return f"SaveHandle(step={self.step}, {state})"
