"""Recovery time: from a fresh process to the training state restored, for the same state, per tier.

Cases (each in a fresh process, interleaved over ``--reps`` rounds; the median is printed):

- ``memcpy``: the state copied into freshly allocated memory (what any restore must at least pay);
  timed in the memory-tier child, after its restore, on the state it restored.
- ``ucl memory tier``: ``CheckpointManager(disk, memory=MemoryTier(shm)).restore()`` (manager open,
  the newest step found, every checksum verified).
- ``ucl disk (cold)``: ``ucl.load`` of the same step from the disk repository, its pages dropped.
- ``DCP disk (cold)``: ``torch.distributed.checkpoint.load`` into preallocated tensors, pages dropped.
- ``ucl peer tier (node lost)``: two gloo processes as two "nodes" (``MemoryTier(ranks_per_node=1)``,
  one part directory each); node 1's part deleted before each round, so its fresh rank restores every
  file from node 0's part over loopback (timed on that rank). Beside it ``gloo loopback``: the same
  bytes sent between the same two processes in 64 MiB messages (the bandwidth they can reach).

``restore s`` is the restore call alone; ``from start s`` includes the interpreter, imports and the
manager (what a restarted job waits for before its first step). Usage::

    python bench/recovery.py --size small --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import drop_cache, fmt_bytes, markdown_table, median, run_child, settle, training_state  # noqa: E402


def child(case: str, disk: str, shm: str, dcp_dir: str, spawned: float) -> dict[str, float]:
    import torch

    import ucl
    from ucl import CheckpointManager
    from ucl.write.tiers import MemoryTier

    out: dict[str, float] = {}
    if case == "memory":
        with CheckpointManager(disk, memory=MemoryTier(shm, keep_last=1)) as mgr:
            t = time.perf_counter()
            state = mgr.restore()
            out["restore"] = time.perf_counter() - t
            assert mgr.last_restore is not None and mgr.last_restore.tier == "memory", mgr.last_restore
            out["from_start"] = time.time() - spawned
        t = time.perf_counter()
        copies = {k: torch.empty_like(v).copy_(v) for k, v in state.items()}
        out["memcpy"] = time.perf_counter() - t
        del copies
    elif case == "ucl":
        t = time.perf_counter()
        state = ucl.load(disk)
        out["restore"] = time.perf_counter() - t
        out["from_start"] = time.time() - spawned
    elif case == "dcp":
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(dcp_dir).read_metadata()
        t = time.perf_counter()
        items = meta.state_dict_metadata.items()
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in items}
        dcp.load(state, storage_reader=dcp.FileSystemReader(dcp_dir))
        out["restore"] = time.perf_counter() - t
        out["from_start"] = time.time() - spawned
    return out


def peer_save(rank: int, world: int, disk: str, parts: str, size: str) -> bool:
    """Two ranks (two nodes of one rank) save the state once to a memory tier spread over them."""
    from ucl import CheckpointManager
    from ucl.write.tiers import MemoryTier

    state = training_state(size, fill="tiled")
    with CheckpointManager(disk, memory=MemoryTier(parts, keep_last=1, ranks_per_node=1)) as mgr:
        mgr.save(1, state).result()
    return True


def peer_restore(rank: int, world: int, disk: str, parts: str, spawned: float) -> dict[str, float]:
    """Both ranks restore (rank 1's part was deleted: it reads from rank 0's); then the loopback probe."""
    import torch
    import torch.distributed as dist

    from ucl import CheckpointManager
    from ucl.write.tiers import MemoryTier

    out: dict[str, float] = {}
    with CheckpointManager(disk, memory=MemoryTier(parts, keep_last=1, ranks_per_node=1)) as mgr:
        t = time.perf_counter()
        state = mgr.restore()
        out["restore"] = time.perf_counter() - t
        out["from_start"] = time.time() - spawned
        assert mgr.last_restore is not None and mgr.last_restore.tier == "peer", mgr.last_restore
    nbytes = sum(v.nbytes for v in state.values())
    batch = 64 << 20
    buf = torch.empty(batch, dtype=torch.uint8)
    dist.barrier()
    t = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(left, batch)
        (dist.send if rank == 0 else dist.recv)(buf[:n], 1 - rank)
        left -= n
    out["loopback"] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", help="bench/_common.py gpt_state size (x3 with AdamW state)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="disk directory (default: a temporary one under the cwd)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        case, disk, shm, dcp_dir, spawned = a.child
        print(json.dumps(child(case, disk, shm, dcp_dir, float(spawned))))
        return

    import torch.distributed.checkpoint as dcp

    from ucl import CheckpointManager
    from ucl.write.tiers import MemoryTier

    root = tempfile.mkdtemp(prefix="ucl-recovery-", dir=a.dir or os.getcwd())
    shm = tempfile.mkdtemp(prefix="ucl-recovery-", dir="/dev/shm")
    disk, dcp_dir = os.path.join(root, "ucl"), os.path.join(root, "dcp")
    peer_disk, parts = os.path.join(root, "peer"), os.path.join(shm, "node{node}")
    try:
        state = training_state(a.size, fill="tiled")
        nbytes = sum(v.nbytes for v in state.values())
        with CheckpointManager(disk, memory=MemoryTier(shm, keep_last=1, drain_every=1)) as mgr:
            mgr.save(1, state).result()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir))
        del state
        from ucl.testing import dist

        os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.recovery importable
        dist.run(2, "bench.recovery:peer_save", {"disk": peer_disk, "parts": parts, "size": a.size}, 900)
        times: dict[str, list[dict[str, float]]] = {"memory": [], "ucl": [], "dcp": [], "peer": []}
        me = os.path.abspath(__file__)
        for _ in range(a.reps):
            for case in times:
                drop_cache([disk, dcp_dir], method="fadvise")
                settle(root)
                if case == "peer":
                    shutil.rmtree(parts.replace("{node}", "1"), ignore_errors=True)  # node 1 lost
                    got = dist.run(2, "bench.recovery:peer_restore", {"disk": peer_disk, "parts": parts,
                                                                       "spawned": time.time()}, 900)
                    times[case].append(got[1])  # the replacement node's rank
                    continue
                times[case].append(run_child([me, "--child", case, disk, shm, dcp_dir, repr(time.time())]))
        rows = []

        def row(name: str, xs: list[float], starts: list[float] | None) -> list[str]:
            s = median(xs)
            return [name, f"{s:.3f}", "-" if starts is None else f"{median(starts):.2f}",
                    f"{nbytes / s / 1e9:.2f}"]

        mem = times["memory"]
        rows.append(row("memcpy (fresh memory)", [t["memcpy"] for t in mem], None))
        names = {"memory": "ucl memory tier", "peer": "ucl peer tier (node lost)", "ucl": "ucl disk (cold)",
                 "dcp": "DCP disk (cold)"}
        for case, name in names.items():
            ts = times[case]
            rows.append(row(name, [t["restore"] for t in ts], [t["from_start"] for t in ts]))
        rows.append(row("gloo loopback (same bytes)", [t["loopback"] for t in times["peer"]], None))
        print(f"state: {a.size} GPT + AdamW, {fmt_bytes(nbytes)}; median of {a.reps} interleaved fresh "
              "processes")
        print(markdown_table(["case", "restore s", "from start s", "GB/s"], rows))
        m = median([t["memcpy"] for t in mem])
        r = {c: median([t["restore"] for t in times[c]]) for c in times}
        print(f"memory tier / memcpy: {r['memory'] / m:.2f}x (target <= 2x); "
              f"ucl disk / memory tier: {r['ucl'] / r['memory']:.1f}x, DCP disk / memory tier: "
              f"{r['dcp'] / r['memory']:.1f}x (target >= 5x)")
        lo = median([t["loopback"] for t in times["peer"]])
        print(f"peer tier / gloo loopback: {r['peer'] / lo:.2f}x (target: at loopback bandwidth); "
              f"ucl disk / peer tier: {r['ucl'] / r['peer']:.1f}x, DCP disk / peer tier: "
              f"{r['dcp'] / r['peer']:.1f}x (target >= 5x)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
