"""Save plans of a manager: which shards this rank writes, cached per set of shapes.

Without a layout the plan is local (one process, or data-parallel ranks splitting replicated shards).
With a layout (``layout=`` or ``"dtensor"``) the ranks plan together, on the caller thread's group,
before any byte of the step is written (:meth:`Planner.plan_layout`).
"""

from __future__ import annotations

import pickle
import zlib
from typing import Any

import torch

from ucl.errors import UCLError
from ucl.format.metadata import acyclic
from ucl.layout import Layout, Mesh, as_mesh, layout_from_dtensors, mesh_rank
from ucl.plan import save as saveplan
from ucl.plan import summary as summary_mod
from ucl.plan.items import RankPlan
from ucl.plan.layout_save import merge_plans
from ucl.write.collectives import Collectives, error_dict, error_from


class Planner:
    """Plans the saves of one manager (its caller thread only).

    Parameters
    ----------
    ctl
        The caller thread's collectives (layout plans are agreed on by every rank).
    rank, world
        This rank and the number of ranks.
    compression
        The codec of the arrays (None: uncompressed).
    layout, mesh
        The source layout and mesh (None without a layout).
    dtensor
        Derive the layout at each save from the state's DTensor placements.
    """

    def __init__(self, ctl: Collectives, rank: int, world: int, compression: dict[str, Any] | None,
                 layout: Any, mesh: Any, dtensor: bool, inner_bytes: int) -> None:
        self._ctl = ctl
        self.inner_bytes = inner_bytes
        self.rank, self.world = rank, world
        self.compression = compression
        self.layout, self.mesh, self.dtensor = layout, mesh, dtensor
        self.plans: dict[Any, saveplan.SavePlan] = {}
        self._dtensor_layouts: dict[Any, tuple[Any, Any, int]] = {}
        self._dtensor_key: Any = None
        self.protocol = ""  # the protocol of the last layout plan: "compact", or "full" (its fallback)

    def plan(self, tensors: dict[str, torch.Tensor]) -> saveplan.SavePlan:
        """The plan of a state of these tensors (every rank calls it, for a layout save).

        Checks every tensor first, on every save (a cached plan included): what ucl cannot store (sparse,
        meta, nested, quantized, an unsupported dtype) is refused here, on the caller's thread, before a
        byte is staged or written (:func:`ucl.plan.save.check_tensor`). A layout save's ranks plan
        together: a rank's refusal is raised on every rank."""
        if self.layout is None and not self.dtensor:
            saveplan.check_tensors(tensors)  # no collective to join: data-parallel ranks hold one state
            key: Any = tuple((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
            plan = self.plans.get(key)
            if plan is None:
                if self.world == 1:
                    plan = saveplan.single(tensors, self.compression, self.inner_bytes)
                else:
                    plan = saveplan.replicated(tensors, self.rank, self.world, self.compression, self.inner_bytes)
                self.plans = {key: plan}  # one cached plan: the state's shapes rarely change
            return plan
        error = None
        try:
            saveplan.check_tensors(tensors)
        except UCLError as e:
            if self._ctl.group is None:
                raise
            error = error_dict(e, self.rank)
        key = (None if error else tuple((n, tuple(t.shape), t.dtype) for n, t in tensors.items()),
               self._dtensor_key)
        hit = key in self.plans
        if self._ctl.group is not None:  # every rank plans again if any rank's shapes changed
            # two flags reduced, not a vote gathered: a rank receives O(1) per save, whatever the world
            miss, failed = self._ctl.any_of([not hit, error is not None])
            if failed:  # every rank refuses the save, before any byte of it: the lowest rank's error
                errors = [err for err in self._ctl.gather(error) if err is not None]
                raise error_from(self._ctl.broadcast(errors[0] if errors else None))
            hit = not miss
        layout, mesh, rank_in_mesh = self._source()
        if not hit:
            self.plans = {key: self.plan_layout(saveplan.local_shapes(tensors), layout, mesh, rank_in_mesh)}
        return self.plans[key]

    def _source(self) -> tuple[Any, Any, int]:
        """(layout, mesh, this process's rank in the mesh) of the state being saved."""
        if self.dtensor:
            return self._dtensor_layouts[self._dtensor_key]
        return self.layout, self.mesh, self.rank

    def plan_layout(self, local: dict[str, tuple[tuple[int, ...], str]], layout: Any, mesh: Any,
                    rank_in_mesh: int) -> saveplan.SavePlan:
        """Plan a layout save on every rank, checked on the coordinator before any byte is written: every
        chunk written exactly once, ranks agreeing on every array, every statement matched. ``local``: the
        rank's :func:`ucl.plan.save.local_shapes` (bench/scale.py passes simulated ranks' shapes).

        First the compact protocol (:meth:`_plan_compact`: O(1) bytes per rank to the coordinator); if its
        summaries do not verify (an uneven split, a rank's error, a disagreement), the full one
        (:meth:`_plan_full`), whose checks name the problem.

        The cycle collector pauses meanwhile (:func:`ucl.format.metadata.acyclic`): a plan is tens of
        thousands of small acyclic objects whose allocations set off collections over the process's whole
        heap (about half of a coordinator's first plan at 8 ranks of bench/scale.py's 70B layout)."""
        with acyclic():
            plan = self._plan_compact(local, layout, mesh, rank_in_mesh)
            self.protocol = "compact" if plan is not None else "full"
            return plan if plan is not None else self._plan_full(local, layout, mesh, rank_in_mesh)

    def _plan_compact(self, local: dict[str, tuple[tuple[int, ...], str]], layout: Any, mesh: Any,
                      rank_in_mesh: int) -> saveplan.SavePlan | None:
        """Every rank plans alone (a split dim without a declared size assumed even) and sends the
        coordinator a :class:`~ucl.plan.summary.PlanSummary`; the coordinator asks one rank per distinct
        set of arrays for the arrays it lacks (point to point, so the silent ranks send nothing) and checks
        the step (:func:`ucl.plan.summary.check`). None (on every rank): the summaries did not verify.

        A rank receives two broadcasts: which ranks send arrays with the coordinator's array digests, and
        the verdict. The coordinator receives a summary per rank and the arrays it lacks, once per
        distinct set (ranks differing only in a data-parallel coordinate hold the same arrays)."""
        rank_plan, digests, summary = compact_summary(layout, mesh, rank_in_mesh, local)
        summaries = self._ctl.gather(summary)
        ask: dict[str, Any] | None = None
        parsed: list[summary_mod.PlanSummary] = []
        if self.rank == 0 and summary is not None and all(s is not None for s in summaries):
            parsed = [summary_mod.PlanSummary.from_tuple(s) for s in summaries]
            reps = summary_mod.representatives(parsed, parsed[0].arrays)
            ask = {"reps": reps, "have": digests if reps else {}}  # digests only for representatives
        ask = self._ctl.broadcast(ask)
        if ask is None:
            return None
        sent = None
        if self.rank in ask["reps"]:
            assert rank_plan is not None
            sent = compact_arrays(rank_plan, digests, ask["have"])
        received = self._ctl.collect(sent, ask["reps"])
        merged = None
        if self.rank == 0:
            assert rank_plan is not None
            try:
                merged = summary_mod.check(layout, mesh, parsed, rank_plan.arrays, digests,
                                           [pickle.loads(zlib.decompress(b)) for b in received])
            except Exception:  # noqa: BLE001 - the full protocol names what is wrong
                merged = None
        if not self._ctl.broadcast(merged is not None):
            return None
        assert rank_plan is not None
        return saveplan.from_layout(rank_plan, merged, self.compression, self.inner_bytes)

    def _plan_full(self, local: dict[str, tuple[tuple[int, ...], str]], layout: Any, mesh: Any,
                   rank_in_mesh: int) -> saveplan.SavePlan:
        """Allgather the local shapes (the logical shapes of uneven splits are inferred from them), plan
        each rank (errors caught), gather the plans to the coordinator, which merges and checks them
        (:func:`ucl.plan.layout_save.merge_plans`); every rank then learns the verdict."""
        all_local = self._ctl.allgather(local)
        rank_plan = None
        payload: dict[str, Any]
        try:
            rank_plan = saveplan.plan_rank(layout, mesh, rank_in_mesh, local, all_local)
            payload = {"plan": rank_plan.to_dict()}
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            payload = {"error": error_dict(e, self.rank)}
        payloads = self._ctl.gather(payload)
        verdict: dict[str, Any] = {"ok": True}
        merged = None
        if self.rank == 0:
            errors = [p["error"] for p in payloads if "error" in p]
            if errors:
                verdict = {"ok": False, "error": errors[0]}
            else:
                try:
                    merged = merge_plans([RankPlan.from_dict(p["plan"]) for p in payloads])
                except Exception as e:  # noqa: BLE001
                    verdict = {"ok": False, "error": error_dict(e, None)}
        verdict = self._ctl.broadcast(verdict)
        if not verdict["ok"]:
            raise error_from(verdict["error"])
        assert rank_plan is not None
        return saveplan.from_layout(rank_plan, merged, self.compression, self.inner_bytes)

    def dtensor_locals(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The local shards of a DTensor state (its layout derived from the placements, cached)."""
        from torch.distributed.tensor import DTensor  # not needed (nor imported) by other saves

        # before t.shape, which a nested tensor lacks (the local shards are checked by plan())
        saveplan.check_tensors({n: t for n, t in tensors.items() if not isinstance(t, DTensor)})
        key = tuple((n, tuple(t.shape), tuple(t.placements), t.device_mesh) if isinstance(t, DTensor)
                    else (n, tuple(t.shape)) for n, t in tensors.items())
        if key not in self._dtensor_layouts:
            dts = {n: t for n, t in tensors.items() if isinstance(t, DTensor)}
            if dts:
                layout = layout_from_dtensors(dts)
                mesh = as_mesh(None, layout, self.world)
                rank = mesh_rank(next(iter(dts.values())).device_mesh)
            else:  # no DTensor: every tensor replicated
                layout, mesh, rank = Layout(), Mesh((("dp", self.world),)), self.rank
            self._dtensor_layouts = {key: (layout, mesh, rank)}
        self._dtensor_key = key
        return {n: t.to_local() if isinstance(t, DTensor) else t for n, t in tensors.items()}


def compact_summary(layout: Any, mesh: Any, rank: int, local: dict[str, tuple[tuple[int, ...], str]]
                    ) -> tuple[RankPlan | None, dict[str, bytes], tuple[Any, ...] | None]:
    """A rank's part of the compact protocol: its plan (a split dim without a declared size assumed
    even), its arrays' digests and the summary it sends; (None, {}, None) if it could not plan (the full
    protocol then reports why, with every rank's view)."""
    try:
        rank_plan = saveplan.plan_rank(layout, mesh, rank, local)
        digests = summary_mod.spec_digests(rank_plan.arrays)
        return rank_plan, digests, summary_mod.summarize(rank_plan, digests).to_tuple()
    except Exception:  # noqa: BLE001
        return None, {}, None


def compact_arrays(rank_plan: RankPlan, digests: dict[str, bytes], have: dict[str, bytes]) -> bytes:
    """What a representative sends: the arrays the coordinator lacks, pickled and compressed (names of
    a model's layers repeat: ~13x smaller)."""
    return zlib.compress(pickle.dumps(summary_mod.missing(rank_plan.arrays, digests, have)), 1)
