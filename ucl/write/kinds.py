"""Which kind each step is stored as: full, delta (spec/delta.md) or gradient records (spec/delta.md §8).

The decision is split between the manager's two threads:

- the caller thread (in ``save``) learns whether the save may become gradient records
  (:meth:`StepKinds.gradients`, :meth:`StepKinds.agree`) and, mirroring the persister's count of saves
  since a full step, whether to stage only the gradients and the tensors the replay does not define;
- the persister decides each job's kind from committed history only (:meth:`StepKinds.decide`), so every
  rank decides the same, and after a commit makes the step the base of the next delta
  (:meth:`StepKinds.advance`), keeping the base's staging slot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ucl.delta.gradients import GradientTracker, locate, optimizer_fingerprint
from ucl.errors import InvalidArgumentError, UCLError, WriteError
from ucl.format.metadata import ArrayMeta
from ucl.format.records import GradientRecords, choose_encoding
from ucl.plan import save as saveplan
from ucl.write.collectives import Collectives
from ucl.write.job import Job
from ucl.write.policy import DeltaPolicy
from ucl.write.prune import Composer, CompositeJob, group_map, optimizer_owners
from ucl.write.staging import Staging, StagingSlot


@dataclass
class GradientJob:
    """What a gradient-record step (spec/delta.md §8) needs beside the staged state."""

    parent: int  # the previous save: the state this step is one optimizer step after
    records: GradientRecords  # base_step = parent
    staged: dict[str, torch.Tensor]  # gradient arrays' names -> staged gradients
    plan: saveplan.SavePlan  # the gradients' arrays (stored full, zstd)
    replayed: frozenset[str]  # the state's tensors the replay defines (not written)
    only: bool = False  # the replayed tensors were not staged: the step can only be stored as gradients


@dataclass
class DeltaBase:
    """The staged copy of the committed step the next delta refers to (its slot kept busy)."""

    step: int
    slot: StagingSlot | None  # None: composite steps' base, the Composer's own copy (no staging slot)
    staged: dict[str, torch.Tensor]
    plan_key: int


def delta_array(meta: ArrayMeta, changed: bool, parent: int) -> ArrayMeta:
    """``meta`` as an array of a delta step: chunked against ``parent`` if ``changed``, else unchanged."""
    rec: dict[str, Any] = {"mode": "chunked" if changed else "unchanged", "base_step": parent}
    if changed:
        rec["encoding"] = choose_encoding(meta.name, meta.dtype)
    return replace(meta, delta=rec, compression=None)


def composite_array(meta: ArrayMeta, changed: bool, job: CompositeJob) -> ArrayMeta:
    """``meta`` as an array of a composite step (spec/delta.md §9): stale (a reference to the step that
    carries its values, with their age), stored full, or a delta against its last stored version."""
    name = meta.name
    if name in job.stale:
        base, age = job.stale[name]
        return replace(meta, delta={"mode": "stale", "base_step": base, "age": age}, compression=None)
    if name in job.write_full:
        return meta
    return delta_array(meta, changed, job.bases[name])


class StepKinds:
    """The step-kind state machine of one manager.

    Parameters
    ----------
    policy
        The manager's DeltaPolicy (None: every step full).
    staging
        The manager's staging, where a replaced base's slot is released.
    ctl
        The caller thread's collectives (data-parallel ranks vote on gradient records).
    rank, world
        This rank and the number of ranks.
    """

    def __init__(self, policy: DeltaPolicy | None, staging: Staging, ctl: Collectives, rank: int,
                 world: int, inner_bytes: int) -> None:
        self.policy = policy
        self.composer: Composer | None = None  # composite steps (DeltaPolicy(prune=...))
        if policy is not None and policy.prune is not None:
            if world != 1:
                raise InvalidArgumentError(f"DeltaPolicy(prune=...): composite steps are written by one "
                                           f"process for now, this manager has {world} ranks")
            self.composer = Composer(policy.prune)
        self.inner_bytes = inner_bytes
        self._staging = staging
        self._ctl = ctl
        self.rank, self.world = rank, world
        # the caller thread's state
        self._tracker: GradientTracker | None = None  # the tracker of the optimizer passed to save()
        self._last_saved: int | None = None  # the step of the previous (not skipped) save
        self._grad_plans: dict[Any, saveplan.SavePlan] = {}
        self._c_since_full: int | None = None  # the caller's count of saves since a full one (gradient mode)
        self._grad_reset = False  # set by the persister after a failed save: stage the next state whole
        # the persister's state
        self.base: DeltaBase | None = None  # the staged copy of the step the next delta refers to
        self._head: int | None = None  # the newest committed step of this manager (delta mode)
        self._since_full: int | None = None  # saves since the last full step (None: no usable base)

    # -- the caller thread -------------------------------------------------------------------------
    def gradients(self, tensors: dict[str, torch.Tensor],
                  optimizer: Any) -> tuple[GradientJob, dict[str, torch.Tensor]] | None:
        """The gradients to stage with this save, when it may be stored as gradient records (else None:
        the state is stored; also for gradients ucl cannot store, e.g. nn.Embedding(sparse=True)'s)."""
        # a state without the optimizer's tensors fails every save
        params, prefix = locate(optimizer, tensors)
        flat = [p for g in optimizer.param_groups for p in g["params"]]
        try:  # before a tracker is made: it reads every .grad's storage after each optimizer step
            saveplan.check_tensors({n: p.grad for n, p in zip(params, flat, strict=True)
                                    if p.grad is not None})
        except UCLError:
            return None
        if self._tracker is None or self._tracker.optimizer is not optimizer:
            if self._tracker is not None:
                self._tracker.close()
            self._tracker = GradientTracker(optimizer)
        if self._tracker.check() is not None or prefix is None or self._last_saved is None:
            return None
        gp = "grad/"
        while any(n.startswith(gp) for n in tensors):
            gp = gp[:-1] + "_/"
        grads = {gp + n: p.grad for n, p in zip(params, flat, strict=True) if p.grad is not None}
        key = tuple((n, tuple(t.shape), t.dtype) for n, t in grads.items())
        if key not in self._grad_plans:
            zstd = {"name": "zstd", "configuration": {"level": 1, "checksum": False}}
            self._grad_plans = {key: saveplan.single(grads, zstd, self.inner_bytes) if self.world == 1 else
                                saveplan.replicated(grads, self.rank, self.world, zstd, self.inner_bytes)}
        rec = GradientRecords(base_step=self._last_saved, fingerprint=optimizer_fingerprint(optimizer),
                              gradients=gp, parameters=tuple(params), optimizer_state=prefix,
                              param_groups=tuple(dict(g) for g in self._tracker.param_groups))
        job = GradientJob(self._last_saved, rec, {}, self._grad_plans[key], frozenset(rec.replayed(tensors)))
        return job, grads

    def agree(self, grads: tuple[GradientJob, dict[str, torch.Tensor]] | None
              ) -> tuple[tuple[GradientJob, dict[str, torch.Tensor]] | None, bool]:
        """``(grads, only)`` for this save: ``only`` when only the gradients (and the tensors the replay
        does not define) are staged.

        Every save in gradient mode calls it, on every rank (a collective on the caller's group): the
        ranks agree on gradient records, else every rank stages its state.
        """
        if self.policy is None or not self.policy.gradients:
            return grads, False
        # the caller mirrors the persister's full/delta count: a save that will be a delta and can be
        # gradient records stages only the gradients and the tensors the replay does not define (the
        # parameters and optimizer state are most of the copy that blocks training)
        if self._grad_reset:
            self._grad_reset, self._c_since_full = False, None
        full_next = self.policy.decide(self._c_since_full) == "full"
        only = grads is not None and not full_next
        self._c_since_full = 0 if full_next else (self._c_since_full or 0) + 1
        if self._ctl.group is not None:  # data-parallel ranks: gradient records only if every rank agrees
            votes = self._ctl.allgather((grads is not None, only))
            if not all(v[0] for v in votes):
                grads = None
            only = grads is not None and all(v[1] for v in votes)
        return grads, only

    def groups(self, tensors: dict[str, torch.Tensor], optimizer: Any) -> dict[str, tuple[str, bool]] | None:
        """Composite steps: each tensor's group (the caller thread; names and storage identity only).
        With ``optimizer``, each parameter's optimizer state joins the parameter's group."""
        if self.composer is None:
            return None
        owners = None
        if optimizer is not None:
            params, prefix = locate(optimizer, tensors)
            owners = optimizer_owners(params, prefix, tensors)
        return group_map(self.composer.prune, tensors, owners)

    def saved(self, step: int, optimizer: Any) -> None:
        """After a save staged its state: the next gradient records refer to ``step``."""
        if optimizer is not None and self._tracker is not None and self._tracker.optimizer is optimizer:
            self._tracker.saved()  # (no tracker: this optimizer's gradients cannot be stored)
        self._last_saved = step

    # -- the persister thread ----------------------------------------------------------------------
    def failed(self) -> None:
        """After a failed save: gradient records of the next save would have no parent."""
        self._grad_reset = True

    def decide(self, job: Job) -> None:
        """Full, delta or gradients (the same decision on every rank: it depends only on committed history).

        Gradient records need their parent (the previous save) committed: otherwise the staged state is
        stored as a delta (or full) instead."""
        job.kind = "full"
        if job.grad is not None and job.grad.only:  # only the gradients were staged
            if self._head != job.grad.parent or self._since_full is None:
                self._grad_reset = True
                raise WriteError(f"step {job.step} was staged as the gradients of step {job.grad.parent}, "
                                 "which is not committed (its save failed); the next save stores the state")
            job.kind, job.changed = "gradients", set()
            return
        if self.policy is None or self.base is None or self.base.plan_key != job.plan_key:
            return
        if self.policy.decide(self._since_full) == "delta":
            if self.composer is not None:
                if job.groups is None or not self.composer.usable(job.staged, job.groups, job.plan_key):
                    return  # another set of tensors or groups: a full step
                job.composite = self.composer.select(job.step, self.base.step, job.staged)
            job.kind = "delta"
            job.changed = set()
            if job.grad is not None and self._head == job.grad.parent:
                job.kind = "gradients"

    def base_of(self, job: Job) -> DeltaBase | None:
        """The staged base ``job``'s state is encoded against (None: its arrays are stored whole)."""
        base = self.base
        if job.kind in ("delta", "gradients") and base is not None and base.plan_key == job.plan_key:
            return base
        return None

    def advance(self, job: Job) -> bool:
        """After a committed step: make it the base of the next delta if the policy says so.

        Returns whether ``job``'s slot is kept (as the new base); a replaced base's slot is released.
        """
        if self.policy is None or job.slot is None:
            return False
        self._head = job.step
        self._since_full = 0 if job.kind == "full" else (self._since_full or 0) + 1
        if job.kind == "gradients":
            return False  # its state is not stored as arrays: later deltas refer to the older base
        if self.composer is not None:  # the composer keeps its own copy: no slot is kept
            if job.kind == "full":
                assert job.groups is not None
                self.composer.reset(job.step, job.staged, job.groups, job.plan_key)
            else:
                assert job.composite is not None
                self.composer.committed(job.step, job.composite, job.staged)
            self.base = DeltaBase(job.step, None, self.composer.values, job.plan_key)
            return False
        if self.policy.base == "full" and job.kind == "delta":
            return False  # deltas keep referring to the last full step
        old = self.base
        self.base = DeltaBase(job.step, job.slot, job.staged, job.plan_key)
        if old is not None and old.slot is not None and old.slot is not job.slot:
            self._staging.release(old.slot)
        return True
