"""Save: ucl's engine beside torch.save, safetensors, DCP (sync and async) and the device limit.

    ./dev bench save [--size small|medium] [--dir DIR]

One table, every row measured in the same run on the same state: a GPT-2-like fp32 model plus its
AdamW state (exp_avg, exp_avg_sq), each case in a fresh process (so peak memory is its own).

Columns:
- blocking: how long the call blocks training (for synchronous savers, the whole save);
- durable: from the call until the data is on disk and fsync'd (for ucl: committed);
- GB/s: state bytes / durable time;
- peak RSS above state: the process's peak resident memory minus what it held once the state existed
  (includes ucl's two staging slots, allocated once);
- vs limit: GB/s against the same-run device limit (bench/probe.c: plain O_DIRECT from pre-touched memory,
  8 MiB blocks, 4 in flight, fdatasync, timed open to close, one file of the state's bytes; in its own
  process, not interleaved with ucl's saves: bench/peers.py runs it before each of them instead);
- memcpy: one plain copy of the state into warm memory, the floor for a snapshot's blocking time.

Rows: ucl's manager (a steady save: the second of the process), the same with a staging budget of the
state's size, ``ucl.save`` (the one-call writer, the first save of a process), the peers, the memcpy and
the device probe.
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

import _common as c  # noqa: E402

training_state = c.training_state  # its home is bench/_common.py (bench/blocked.py imports it from here)


def _fsync_tree(path: str) -> None:
    for f in c.files_under([path]):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def child(case: str, size: str, root: str) -> dict:
    import torch

    state = training_state(size)
    nbytes = c.state_nbytes(state)
    c.reset_peak_rss()
    base = c.rss()
    out = os.path.join(root, case)
    os.makedirs(out, exist_ok=True)
    blocking = durable = float("nan")
    if case == "memcpy":
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        for k, v in state.items():  # warm the destination pages
            dst[k].copy_(v)
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        blocking = durable = time.perf_counter() - t0
    elif case == "device limit":  # bench/probe.c: the probe of bench/peers.py
        r = c.probe_write(os.path.join(out, "probe"), [nbytes])
        blocking = durable = r["seconds"]
    elif case == "ucl.save (one call)":  # the one-call writer, as a script saving once would use it
        import ucl

        t0 = time.perf_counter()
        ucl.save(state, out, step=0)
        blocking = durable = time.perf_counter() - t0
    elif case.startswith("ucl"):
        from ucl.write.manager import CheckpointManager

        budget = nbytes if "budget" in case else None
        with CheckpointManager(out, staging_bytes=budget) as mgr:
            mgr.save(0, state).result()  # first save allocates and touches the staging slots
            t0 = time.perf_counter()
            h = mgr.save(1, state)
            blocking = time.perf_counter() - t0
            h.result()
            durable = time.perf_counter() - t0
    elif case == "torch.save":
        t0 = time.perf_counter()
        with open(os.path.join(out, "state.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        blocking = durable = time.perf_counter() - t0
    elif case == "safetensors":
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        p = os.path.join(out, "state.safetensors")
        save_file(state, p)
        _fsync_tree(p)
        blocking = durable = time.perf_counter() - t0
    elif case.startswith("dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        dcp.save(state, storage_writer=FileSystemWriter(os.path.join(out, "warm"), thread_count=2))
        if case == "dcp.save":
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=FileSystemWriter(os.path.join(out, "s"), thread_count=2))
            blocking = durable = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=FileSystemWriter(os.path.join(out, "s"), thread_count=2))
            blocking = time.perf_counter() - t0
            fut.result()
            durable = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown case {case}")
    peak = c.peak_rss() - base
    shutil.rmtree(out, ignore_errors=True)
    return {"case": case, "bytes": nbytes, "blocking": blocking, "durable": durable, "peak": peak}


CASES = ["memcpy", "device limit", "ucl", "ucl (staging budget = 1x state)", "ucl.save (one call)", "torch.save",
         "safetensors", "dcp.save", "dcp.async_save"]
PEERS = ["torch.save", "safetensors", "dcp.save", "dcp.async_save"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(c.SIZES))
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under ./bench-out)")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "ROOT"), help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.size, a.child[1])))
        return
    os.makedirs(a.dir or "bench-out", exist_ok=True)
    root = tempfile.mkdtemp(prefix="save-", dir=a.dir or "bench-out")
    rows = {}
    try:
        for case in a.cases.split(","):
            os.sync()
            rows[case] = c.run_child([__file__, "--size", a.size, "--child", case, root])
            print(f"  {case}: {json.dumps(rows[case])}", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = next(iter(rows.values()))["bytes"]
    limit = rows.get("device limit", {}).get("durable", float("nan"))
    memcpy = rows.get("memcpy", {}).get("blocking", float("nan"))
    peers = [rows[p] for p in PEERS if p in rows]
    best = min((r["durable"] for r in peers), default=float("nan"))
    dcp_async_block = rows.get("dcp.async_save", {}).get("blocking", float("nan"))
    table = []
    for case, r in rows.items():
        gbps = nbytes / r["durable"] / 1e9
        table.append([case, f"{r['blocking']:.3f} s", f"{r['blocking'] / memcpy:.2f}x", f"{r['durable']:.2f} s",
                      f"{gbps:.2f}", f"{limit / r['durable']:.0%}", f"{best / r['durable']:.2f}x",
                      c.fmt_bytes(r["peak"]), f"{r['peak'] / nbytes:.2f}x"])
    print(f"\nsave of a GPT-2-like model + AdamW state, size={a.size}: {c.fmt_bytes(nbytes)} fp32; {c.machine_line()}")
    print(f"command: ./dev bench save --size {a.size}\n")
    print(c.markdown_table(["case", "blocking", "vs memcpy", "durable", "GB/s", "vs device limit", "vs best peer",
                            "peak RSS above state", "/ state"], table))
    if "ucl" in rows:
        u = rows["ucl"]
        print(f"\nucl: throughput {limit / u['durable']:.0%} of the device limit (target >= 85%); blocking "
              f"{u['blocking'] / memcpy:.2f}x memcpy (target <= 1.5x), {u['blocking'] / dcp_async_block:.2f}x DCP "
              f"async_save's blocking (target <= 0.5x)")


if __name__ == "__main__":
    main()
