"""Retention: which committed steps a manager keeps (keep_last / keep_every, and the bases they need)."""

from __future__ import annotations

from collections.abc import Callable

from ucl.errors import UCLError
from ucl.format.repository import Repository, commit_key, step_prefix
from ucl.write.events import log


class Retention:
    """Deletes the steps a manager no longer keeps; the coordinator runs it after each commit.

    Parameters
    ----------
    repo
        The repository.
    keep_last
        Keep the newest ``keep_last`` committed steps (None keeps all).
    keep_every
        Also keep every step divisible by ``keep_every``.
    protected
        Steps also kept, asked at each retention (a memory tier's steps not drained yet: ucl.write.tiers).
    """

    def __init__(self, repo: Repository, keep_last: int | None, keep_every: int | None,
                 protected: Callable[[], set[int]] | None = None) -> None:
        self.repo = repo
        self.keep_last, self.keep_every = keep_last, keep_every
        self.protected = protected

    def retain(self, newest: int) -> None:
        """Delete steps outside keep_last/keep_every; never the newest committed step."""
        if self.keep_last is None:
            return
        steps = self.repo.steps()
        keep = set(steps[-self.keep_last :]) | {newest}
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        if self.protected is not None:
            keep |= self.protected()
        keep |= needed_bases(self.repo, keep)
        drop = [s for s in steps if s not in keep and s < newest]
        if drop:
            log.info("retention (keep_last=%s, keep_every=%s) deletes step(s) %s of %s", self.keep_last,
                     self.keep_every, ", ".join(map(str, drop)), self.repo.url)
        self.delete_steps(drop)

    def delete_steps(self, steps: list[int]) -> None:
        """Remove steps so that at every instant every listed step is readable: the commit records first,
        newest first (a delta child disappears before the base it reads), then the files. A kill between
        two deletions leaves only whole, readable steps listed (and files gc removes). Every deletion goes
        through the store, which never follows a symlink out of the repository (spec/core.md §3, item 2):
        a step directory that is a symlink is unlinked, one below a directory that resolves outside is
        refused."""
        for s in sorted(steps, reverse=True):
            self.repo.store.delete(commit_key(s))
        if steps:  # the removals durable before any file goes: a power cut never revives a record without files
            self.repo.store.sync_dir("commits")
        for s in sorted(steps):
            self.repo.store.delete_prefix(step_prefix(s))

    def delete_step(self, step: int) -> None:
        """Remove a step: its commit record first (the step disappears atomically), then its files."""
        log.info("deleting step %d of %s", step, self.repo.url)
        self.delete_steps([step])


def needed_bases(repo: Repository, keep: set[int]) -> set[int]:
    """Steps that kept delta steps depend on (their chains), so retention never breaks a chain."""
    need: set[int] = set()
    for s in keep:
        cur = s
        for _ in range(1024):
            try:
                rec = repo.commit_record(cur)
            except UCLError:
                break
            if rec.parent is None:
                break
            need.add(rec.parent)
            cur = rec.parent
    return need
