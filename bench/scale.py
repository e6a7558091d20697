"""Coordination at many ranks, simulated on one machine: what a layout save's coordinator pays, what it
gathers, and the metadata each step writes, for ucl and for torch.distributed.checkpoint (DCP), side by side.

    python bench/scale.py [--worlds 8 64 256] [--layers 80] [--reps 3]

The job: a LLaMA-70B-like Megatron model (80 layers, hidden 8192, 64 heads / 8 KV groups, ffn 28672,
vocab 128256), bf16 parameters over tp=8, the distributed optimizer (exp_avg, exp_avg_sq flat over dp):
``ucl.layout.builtins.megatron_gpt(..., zero=mesh)``; world = 8 x dp, pp = 1. Shapes only, no data.

ucl: every simulated rank's local state is ``ucl.layout.resolve.expected_local`` of the layout. The
coordinator runs the manager's own planning code (``ucl.write.planning.Planner.plan_layout``: the compact
protocol, ucl/plan/summary.py) over a simulated group that hands it every other rank's real payload,
made by the functions those ranks run (``compact_summary``, ``compact_arrays``), and counts the bytes as
gloo carries them: ``gather_object`` pads every rank's object to the largest one's size; ``collect`` is
point to point (only the representatives send); unpickling is timed as the coordinator's. Only the
payloads' bytes are kept, so the coordinator's heap is its own. Metadata: the step's documents
(``ucl.write.step.step_documents``, format version 3: the step document packed, spec/core.md §5.1) and the
commit record (``CommitRecord`` of every rank's shard files) as
a save writes them; and the same for the next step stored as a delta of it with every shape kept ("delta
step (all)": documents and record, every shard rewritten; its logical records are its parent's, by
reference).

DCP: each rank's local plan is what ``DefaultSavePlanner.create_local_plan`` makes of the same local
tensors held as evenly sharded DTensors (one WriteItem per local tensor: fqn, global offset, sizes,
global shape, dtype), built directly (a DTensor of a 16,384-rank mesh cannot be made on one machine); the
coordinator runs DCP's own ``DefaultSavePlanner.create_global_plan`` over the unpickled plans (dedup of
replicas, the global Metadata). Metadata: the pickled ``Metadata`` as ``FileSystemWriter.finish`` writes
``.metadata``: with its ``storage_data`` (each item's file, offset and length; one file per rank) and
``storage_meta``. DCP writes that file every step, full or not.

"coordinator s": the coordinator's part of a first save of a process (its own plan included); medians.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import pickle
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

TP = 8
MODEL = dict(num_heads=64, hidden=8192, ffn_hidden=28672, vocab_size=128256, num_kv_heads=8)


def job(layers: int, world: int) -> tuple[Any, Any, dict[str, tuple[tuple[int, ...], str]]]:
    from ucl.layout import builtins
    from ucl.layout.mesh import Mesh

    mesh = Mesh((("pp", 1), ("dp", world // TP), ("tp", TP)))
    layout = builtins.megatron_gpt(num_layers=layers, **MODEL, zero=mesh)
    logical: dict[str, tuple[tuple[int, ...], str]] = {}
    for n, s in builtins.megatron_gpt_params(num_layers=layers, **MODEL):
        logical[n] = (tuple(s), "bfloat16")
        for st in ("exp_avg", "exp_avg_sq"):
            logical[f"optim/state/{n}/{st}"] = (tuple(s), "float32")
    return layout, mesh, logical


def local_states(layout: Any, mesh: Any, logical: Any) -> list[Any]:
    """Every rank's local tensors (``expected_local``), computed once per distinct tp coordinate: ranks
    that differ only in dp hold the same names and shapes (their flat partitions are equal in size)."""
    from ucl.layout.resolve import expected_local

    by_tp: dict[int, Any] = {}
    out = []
    for r in range(mesh.size):
        tp = mesh.coords(r)["tp"]
        if tp not in by_tp:
            by_tp[tp] = expected_local(layout, mesh, r, logical)
        out.append(by_tp[tp])
    return out


class SimulatedGroup:
    """The coordinator's view of a gloo group: each collective hands it the other ranks' pickled payloads
    (unpickled here, as ``gather_object`` does on the coordinator) and counts the bytes it receives as
    the wire carries them: ``gather_object`` pads every rank's payload to the largest one's size;
    ``collect`` is point to point (only the named ranks send)."""

    def __init__(self, world: int, payloads: dict[str, list[bytes]], collected: dict[int, bytes]) -> None:
        self.group, self.rank, self.world = object(), 0, world
        self.payloads, self.collected = payloads, collected
        self.received = 0

    def gather(self, obj: Any) -> list[Any]:
        blobs = self.payloads["gather"]
        self.payloads = {"gather": self.payloads.get("then", [])}  # the second gather (full protocol only)
        self.received += (len(blobs) - 1) * max(len(b) for b in blobs)
        return [obj] + [pickle.loads(b) for b in blobs[1:]]

    def collect(self, obj: Any, senders: list[int]) -> list[Any]:
        out = []
        for r in senders:
            self.received += len(self.collected[r])
            out.append(pickle.loads(pickle.dumps(self.collected[r])))  # collect() pickles the object
        return out

    def broadcast(self, obj: Any) -> Any:  # the coordinator sends; it receives nothing
        return obj


_SIM: dict[str, Any] = {}


def _sim_init(layers: int, world: int) -> None:
    """A worker of the rank simulation: the job and every rank's local shapes, once."""
    layout, mesh, logical = job(layers, world)
    by_id: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {}
    _SIM.update(layout=layout, mesh=mesh, shapes=[
        by_id.setdefault(id(loc), {n: (lt.shape, lt.dtype) for n, lt in loc.items()})
        for loc in local_states(layout, mesh, logical)])


def _sim_rank(r: int) -> tuple[bytes, bytes, dict[str, tuple[int, int]]]:
    """Rank ``r``'s part, by the functions that rank runs: its pickled summary, the digest of its set of
    arrays, and the shard files its report names."""
    from ucl.format.metadata import acyclic
    from ucl.plan import save as saveplan
    from ucl.plan import summary
    from ucl.write.planning import compact_summary

    # with the cycle collector paused, as Planner.plan_layout runs it on a real rank: otherwise the
    # collections its allocations set off walk this worker's heap, which holds every simulated rank's
    # shapes (16,384 of them): 0.13-0.28 s of CPU per rank at 16,384 ranks instead of ~0.11 s
    with acyclic():
        p, _, s = compact_summary(_SIM["layout"], _SIM["mesh"], r, _SIM["shapes"][r])
        assert p is not None and s is not None, f"rank {r} did not plan"
        writes = saveplan.from_layout(p, None).writes
    files = {w.array.shard_key(w.coords): (w.array.nbytes, 0xDEADBEEF) for w in writes}
    return pickle.dumps(s), summary.PlanSummary.from_tuple(s).arrays, files


def ucl_case(layers: int, world: int, reps: int) -> dict[str, Any]:
    from ucl.format.metadata import CommitRecord, StepMeta
    from ucl.plan import save as saveplan
    from ucl.write.kinds import delta_array
    from ucl.write.planning import Planner, compact_arrays, compact_summary
    from ucl.write.step import step_documents

    layout, mesh, logical = job(layers, world)
    by_id: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {}  # ranks of one tp share their shapes
    shapes_of = [by_id.setdefault(id(loc), {n: (lt.shape, lt.dtype) for n, lt in loc.items()})
                 for loc in local_states(layout, mesh, logical)]
    # every other rank's part of the compact protocol, computed by the functions the ranks run; only
    # their payloads (bytes) are kept, so the coordinator's heap is its own (the collector's passes over
    # a heap of 16,384 plans would be timed as the coordinator's otherwise)
    sent: list[bytes] = []
    collected: dict[int, bytes] = {}
    files: dict[str, tuple[int, int]] = {}  # every rank's shard files, as its report names them
    seen: set[bytes] = set()
    # every rank's summary and shard files, on all cores (each worker builds the job once)
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1, _sim_init, (layers, world)) as pool:
        for r, (blob, arrays_digest, rank_files) in enumerate(pool.imap(_sim_rank, range(world), 64)):
            sent.append(blob)
            files.update(rank_files)
            if r and arrays_digest not in seen:  # the first rank of each other set of arrays
                collected[r] = b""
            seen.add(arrays_digest)
    _, have, _ = compact_summary(layout, mesh, 0, shapes_of[0])
    for r in collected:
        p, digests, _ = compact_summary(layout, mesh, r, shapes_of[r])
        collected[r] = compact_arrays(p, digests, have)
        del p, digests
    gc.collect()
    times, received = [], 0
    plan = None
    for _ in range(reps):
        group = SimulatedGroup(world, {"gather": sent}, collected)
        planner = Planner(group, 0, world, None, layout, mesh, False, saveplan.INNER_CHUNK_BYTES)  # type: ignore[arg-type]
        t = time.perf_counter()
        plan = planner.plan_layout(shapes_of[0], layout, mesh, 0)  # type: ignore[arg-type]
        times.append(time.perf_counter() - t)
        assert planner.protocol == "compact", planner.protocol
        received = group.received
    assert plan is not None
    meta = StepMeta(step=1, kind="full", parent=None, tree={}, arrays=plan.arrays, layout=plan.layout,
                    mesh=plan.mesh)
    docs = step_documents(meta)
    files.update({k: (len(v), 0xDEADBEEF) for k, v in docs.items()})
    record = CommitRecord(step=1, kind="full", parent=None, files=files)
    # the next step, a delta of it with every shape kept (as a manager writes it: its parent's logical
    # records by reference, spec/layout.md §6.9), every array changed: every shard rewritten as a delta
    darrays = {n: delta_array(a, True, 1) for n, a in plan.arrays.items()}
    dmeta = StepMeta(step=2, kind="delta", parent=1, tree={}, arrays=darrays, layout=plan.layout,
                     mesh=plan.mesh, logical_from=1)
    ddocs = step_documents(dmeta)
    dfiles = {k: v for k, v in files.items() if not k.endswith("zarr.json")}
    dfiles.update({k: (len(v), 0xDEADBEEF) for k, v in ddocs.items()})
    drecord = CommitRecord(step=2, kind="delta", parent=1, files=dfiles)
    docs_bytes = sum(len(v) for v in docs.values())
    return {"s": statistics.median(times), "gathered": received, "step_doc": len(docs["zarr.json"]),
            "array_docs": docs_bytes - len(docs["zarr.json"]), "record": len(record.to_bytes()),
            "full": docs_bytes + len(record.to_bytes()),
            "delta": sum(len(v) for v in ddocs.values()) + len(drecord.to_bytes()),
            "arrays": len(plan.arrays), "files": len(files)}


def dcp_case(layers: int, world: int, reps: int) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from ucl.format import dtypes

    layout, mesh, logical = job(layers, world)
    locals_ = local_states(layout, mesh, logical)

    def local_plan(r: int) -> SavePlan:
        coords = mesh.coords(r)
        items = []
        for name, lt in locals_[r].items():
            shape = list(lt.shape)
            if lt.flat is not None:  # the flat partition: 1-D, dp-th of the buffer
                fqn, size = f"{lt.flat.array}", [lt.flat.partition * lt.flat.parts]
                offsets = [coords["dp"] * lt.flat.partition]  # local_states shares dp ranks: not lt.flat.index
            else:  # an even shard along the split dim (tp) of the tensor as held (vocabulary padded)
                fqn, full = lt.logical or name, logical[lt.logical or name][0]
                size = [s * TP if s != g else g for s, g in zip(shape, full, strict=True)]
                offsets = [coords["tp"] * s if s != g else 0 for s, g in zip(shape, full, strict=True)]
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape)),
                    properties=TensorProperties(dtype=dtypes.to_torch(lt.dtype)), size=torch.Size(size))))
        return SavePlan(items, planner_data={})  # the flattening mapping: the state is flat

    blobs = [pickle.dumps(local_plan(r)) for r in range(world)]
    times = []
    metadata = None
    for _ in range(reps):
        t = time.perf_counter()
        plans = [local_plan(0)] + [pickle.loads(b) for b in blobs[1:]]
        planner = DefaultSavePlanner()
        global_plans, metadata = planner.create_global_plan(plans)
        pickle.dumps(global_plans)  # scattered back to the ranks
        times.append(time.perf_counter() - t)
    assert metadata is not None
    # what FileSystemWriter.finish adds before it pickles .metadata: where each item's bytes are (one
    # file per rank, items in plan order), and the storage meta
    storage: dict[Any, Any] = {}
    for r, gp in enumerate(global_plans):
        offset = 0
        for item in gp.items:
            n = item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize
            storage[item.index] = _StorageInfo(f"__{r}_0.distcp", offset, n)
            offset += n
    metadata.storage_data = storage
    metadata.storage_meta = StorageMeta(checkpoint_id="/checkpoints/step_000001", save_id="0" * 32)
    return {"s": statistics.median(times), "gathered": sum(len(b) for b in blobs[1:]),
            "metadata": len(pickle.dumps(metadata))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", default="ucl,dcp",
                    help="ucl,dcp (default) or one of them: DCP's plans of 16,384 simulated ranks hold "
                         "millions of WriteItems in one process")
    a = ap.parse_args()
    cases = set(a.cases.split(","))
    print(C.machine_line())
    print(f"LLaMA-70B-like Megatron job, {a.layers} layers, tp={TP}, distributed optimizer; "
          f"median of {a.reps}")
    rows = []
    for world in a.worlds:
        u = ucl_case(a.layers, world, a.reps) if "ucl" in cases else None
        d = dcp_case(a.layers, world, a.reps) if "dcp" in cases else None
        row: list[Any] = [world]
        row += ["-"] * 5 if u is None else [
            f"{u['s']:.2f}", C.fmt_bytes(u["gathered"]),
            f"{C.fmt_bytes(u['step_doc'])} + {C.fmt_bytes(u['array_docs'])}", C.fmt_bytes(u["record"]),
            C.fmt_bytes(u["delta"])]
        row += ["-"] * 3 if d is None else [
            f"{d['s']:.2f}", C.fmt_bytes(d["gathered"]), C.fmt_bytes(d["metadata"])]
        row += ["-"] * 3 if u is None or d is None else [
            f"{u['s'] / d['s']:.2f}x", f"{u['gathered'] / max(1, d['gathered']):.2f}x",
            f"{u['full'] / d['metadata']:.2f}x / {u['delta'] / d['metadata']:.2f}x"]
        rows.append(row)
        print(f"  world {world}: " + " | ".join(map(str, rows[-1])), flush=True)  # kept if a later world fails
    print(C.markdown_table(
        ["world", "ucl coordinator s", "ucl gathered", "ucl step doc + array docs", "ucl commit record",
         "ucl delta step (all)", "DCP coordinator s", "DCP gathered", "DCP .metadata", "time ucl/DCP",
         "gathered ucl/DCP", "metadata ucl/DCP (full / delta)"], rows))
    print("targets: coordinator time and gathered bytes <= 0.5x DCP's; metadata per step <= DCP's")


if __name__ == "__main__":
    main()
