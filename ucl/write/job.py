"""What one ``save`` hands the persister: a piece of a step's staged state and where its result goes."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ucl.format.metadata import CommitRecord
from ucl.plan import save as saveplan
from ucl.write.staging import StagingSlot

if TYPE_CHECKING:  # an annotation only: ucl.write.kinds imports this module
    from ucl.write.kinds import GradientJob
    from ucl.write.prune import CompositeJob


@dataclass
class Job:
    """One piece of a step queued for the persister (a step staged in pieces queues several).

    The caller thread fills the first fields; the persister decides ``kind`` (ucl.write.kinds) and the
    writing fills ``changed`` and ``documents``.
    """

    step: int
    plan: saveplan.SavePlan  # this piece's writes (the step's arrays are all in it)
    tree: dict[str, Any]
    staged: dict[str, torch.Tensor]  # source name -> its copy in the slot
    slot: StagingSlot | None
    future: Future[CommitRecord | None]  # the SaveHandle's: completed after the commit
    last_piece: bool = True
    error: BaseException | None = None  # staging failed after earlier pieces were queued
    plan_key: int = 0  # id of the step's whole plan: a delta's base must have been staged under the same
    kind: str = "full"  # decided by the persister: "full", "delta" or "gradients"
    changed: set[str] | None = None  # delta steps: arrays this rank wrote data for
    grad: GradientJob | None = None  # staged gradients: the step may be stored as gradient records
    groups: dict[str, tuple[str, bool]] | None = None  # composite steps: each tensor's group, measured?
    composite: CompositeJob | None = None  # decided by the persister: the groups a composite step stores
    documents: dict[str, tuple[int, int]] | None = None  # full steps: documents written beside the shards
    # seconds spent in each phase of persisting it (ucl.write.shards, ucl.write.commit), logged at DEBUG
    phases: dict[str, float] = field(default_factory=dict)
