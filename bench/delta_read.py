"""Reading delta steps end to end: a step at chain depth 8 beside the same state stored full.

    python bench/delta_read.py [--d-model 512] [--layers 4] [--vocab 4096] [--warmup 10] [--chain 8]
                               [--repeat 3] [--dir DIR] [--drop auto|fadvise|drop_caches] [--keep]

(about 2 minutes on 2 cores)

Trains the small transformer of bench/delta_codec.py (CPU, fp32, AdamW) and keeps ``--chain + 1``
consecutive states. The real engine writes them three times:

* ``base='previous'``: ``CheckpointManager(path, delta=DeltaPolicy(full_every=None, base="previous"))``,
  steps 0..N: step 0 full, step k a delta of step k-1, so step N is at chain depth N (N = ``--chain``,
  8 by default);
* ``base='full'``: ``DeltaPolicy(full_every=None, base="full")``, steps 0..N: every delta step is a
  delta of step 0, so step N is one delta, N steps away from its base;
* ``full``: the last state alone, stored full (``delta=None``), as step N.

Then each read of step N runs in a fresh process (as a job that restarts from its checkpoint; one process
per read and round, in rotated order; the tables give the median of ``--repeat`` rounds), once cold, then
once warm:

* ``ucl.open(path, N).load(flat=True)`` (which reads every delta tensor of the step in one
  ``ChainReader.read_many`` pipeline);
* cold: the page cache of every repository dropped first (fsync + posix_fadvise DONTNEED per file,
  checked with mincore, as bench/read.py; ``--drop drop_caches`` uses /proc/sys/vm/drop_caches);
* warm: every file the read needs read once beforehand (buffered), so it is all in the page cache.

Reported per read: wall seconds (open included), the ratio to reading the full step, CPU seconds of the
process (every thread), what the reader says it read (``Checkpoint.bytes_read``: indexes and payloads of
every link) and what the disk delivered (/proc/self/io read_bytes). The reads of the first round are
checked against the state written (a hash of every tensor's bytes). A second table gives the bytes on
disk of each step of each policy, so that the read time can be weighed against what each policy stores.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from delta_codec import train_states  # noqa: E402

CASES = ["full", "previous", "full-base"]  # the repositories
LABELS = {
    "full": "full step (delta=None)",
    "previous": "base='previous', chain depth {n}",
    "full-base": "base='full', 1 delta {n} steps from its base",
}
#: (repository, how): "load" is Checkpoint.load(); "many" reads every delta tensor of the step in one
#: ChainReader.read_many call (what load() does once ucl/read/checkpoint.py hands its delta requests over at once)
#: load() itself hands every delta tensor to read_many now; the "many" rows (read_many without load()'s
#: allocation and tree) are kept for profiling: --child repository:many
READS = [("full", "load"), ("previous", "load"), ("full-base", "load")]


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model/emb.weight": a, "optim/emb.weight/exp_avg": b}`` -> nested dicts of torch tensors."""
    import torch

    out: dict[str, Any] = {}
    for name, a in flat.items():
        *path, leaf = name.split("/")
        d = out
        for p in path:
            d = d.setdefault(p, {})
        d[leaf] = torch.from_numpy(a)
    return out


def write_repos(states: list[dict[str, Any]], d: str) -> tuple[dict[str, str], dict[str, float]]:
    from ucl.write.manager import CheckpointManager
    from ucl.write.policy import DeltaPolicy

    last = len(states) - 1
    paths = {c: os.path.join(d, c) for c in CASES}
    seconds = {}
    for c, policy in (("previous", DeltaPolicy(full_every=None, base="previous")),
                      ("full-base", DeltaPolicy(full_every=None, base="full"))):
        t0 = time.perf_counter()
        with CheckpointManager(paths[c], delta=policy) as mgr:
            for k, s in enumerate(states):
                mgr.save(k, nested(s))
            mgr.wait()
        seconds[c] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with CheckpointManager(paths["full"]) as mgr:
        mgr.save(last, nested(states[-1]))
        mgr.wait()
    seconds["full"] = time.perf_counter() - t0
    return paths, seconds


def step_bytes(path: str, step: int) -> int:
    """Bytes of a step on disk: its directory (documents and shards) and its commit record."""
    rec = os.path.join(path, "commits", f"{step}.json")
    return C.tree_bytes([os.path.join(path, "steps", str(step))]) + os.path.getsize(rec)


def chain_files(path: str, step: int) -> list[str]:
    """Every file of the step and of the steps its chain goes through (what a warm read finds cached)."""
    import ucl

    repo = ucl.Repository.open(path)
    dirs, s = [], step
    while s is not None:
        dirs.append(os.path.join(path, "steps", str(s)))
        rec = repo.commit_record(s)
        s = rec.parent if rec.kind == "delta" else None
    return C.files_under(dirs)


def warm(files: list[str]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def read_once(path: str, step: int, how: str = "load") -> tuple[dict[str, Any], dict[str, Any]]:
    import ucl

    with C.Meter() as m:  # its set-up (a collection, a peak-RSS reset) is not timed: CPU is read after it
        cpu0 = time.process_time()
        if how == "many":
            out, lib = load_many(path, step)
        else:
            with ucl.open(path, step) as ck:
                out = ck.load(flat=True)
                lib = ck.bytes_read
        cpu = time.process_time() - cpu0
    res = m.result(cpu=cpu, lib=lib)
    return out, res


def has_read_many() -> bool:
    from ucl.read.chain import ChainReader

    return hasattr(ChainReader, "read_many")


def load_many(path: str, step: int) -> tuple[dict[str, Any], int]:
    """Every tensor of a step, flat: the stored-full ones through ucl.read.boxes.read, the delta ones in one
    ChainReader.read_many call. Returns them and the bytes read."""
    import torch

    import ucl
    from ucl.format import dtypes
    from ucl.read.boxes import read as read_boxes
    from ucl.read.chain import ChainReader
    from ucl.read.chunks import Request
    from ucl.read.files import StepFiles

    repo = ucl.Repository.open(path)
    steps: dict[int, Any] = {}

    def get(s: int) -> Any:
        if s not in steps:
            rec = repo.commit_record(s)
            steps[s] = (repo.step_meta(s, rec), StepFiles(repo.store, s, rec))
        return steps[s]

    meta, files = get(step)
    out = {n: torch.empty(a.shape, dtype=dtypes.to_torch(a.dtype)) for n, a in meta.arrays.items()}
    reqs = [Request(a, (0,) * len(a.shape), a.shape, out[n]) for n, a in meta.arrays.items()]
    plain = [r for r in reqs if r.meta.delta is None]
    if plain:
        read_boxes(files, plain)
    chained = [r for r in reqs if r.meta.delta is not None]
    if chained:
        ChainReader(step, get).read_many(chained)
    return out, sum(f.bytes_read for _, f in steps.values())


def digests(tensors: dict[str, Any]) -> dict[str, str]:
    """A content hash of each tensor's bytes (numpy arrays or torch tensors)."""
    import hashlib

    import numpy as np

    out = {}
    for n, t in tensors.items():
        a = t if isinstance(t, np.ndarray) else t.numpy()
        out[n] = hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8).data, digest_size=16).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=10, help="training steps before the first state kept")
    ap.add_argument("--chain", type=int, default=8, help="chain depth of the step read (base='previous')")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of reads (median)")
    ap.add_argument("--dir", help="where to write (default: a temporary directory under /tmp, removed after)")
    ap.add_argument("--drop", choices=["auto", "fadvise", "drop_caches"], default="auto")
    ap.add_argument("--keep", action="store_true", help="keep the repositories written")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # "repository:how": one read, cold then warm
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    cmd = "python bench/delta_read.py " + " ".join(sys.argv[1:] if argv is None else argv)
    t_all = time.perf_counter()

    args.pairs = args.chain
    t0 = time.perf_counter()
    states = train_states(args)  # chain + 1 consecutive states
    t_train = time.perf_counter() - t0
    import ucl

    last = len(states) - 1
    raw = sum(a.nbytes for a in states[-1].values())
    own = args.dir is None
    d = tempfile.mkdtemp(prefix="ucl-bench-delta-read-", dir="/tmp") if own else os.path.abspath(args.dir)
    os.makedirs(d, exist_ok=True)
    try:
        for c in CASES:
            shutil.rmtree(os.path.join(d, c), ignore_errors=True)
        paths, wsec = write_repos(states, d)
        n_tensors = len(states[-1])
        with open(os.path.join(d, "manifest.json"), "w") as fh:
            json.dump({"step": last, "digests": digests(states[-1])}, fh)
        del states
        gc.collect()
        reads = [x for x in READS if x[1] == "load" or has_read_many()]
        results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        drop = "-"
        for r in range(args.repeat):
            order = reads[r % len(reads) :] + reads[: r % len(reads)]
            for c, how in order:
                res = C.run_child([os.path.abspath(__file__), "--child", f"{c}:{how}", "--dir", d,
                                   "--drop", args.drop] + (["--check"] if r == 0 else []))
                drop = res.pop("drop")
                for temp, v in res.items():
                    results.setdefault((temp, c, how), []).append(v)
        sizes = {c: [step_bytes(paths[c], s) for s in range(last + 1)] for c in CASES if c != "full"}
        full_size = step_bytes(paths["full"], last)
        print(report(args, cmd, results, sizes, full_size, raw, n_tensors, wsec, t_train, drop,
                     time.perf_counter() - t_all, ucl))
    finally:
        if own and not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    return 0


def child(args: argparse.Namespace) -> int:
    """In a fresh process (as a job that restarts from its checkpoint): one read of one repository cold,
    then warm; prints the measurements as JSON. With --check, the data is compared with the manifest."""
    import torch  # noqa: F401  everything imported before any timing

    import ucl

    c, how = args.child.split(":")
    d = args.dir
    with open(os.path.join(d, "manifest.json")) as fh:
        man = json.load(fh)
    last = man["step"]
    path = os.path.join(d, c)
    every = [os.path.join(d, x) for x in CASES]
    ucl.open(path, last).close()  # one-time costs of the library (schemas), not of the read: no data read
    out: dict[str, Any] = {}
    drop = C.drop_cache(every, args.drop)
    left = C.cached_fraction(every)
    if left > 0.001:
        raise RuntimeError(f"{left:.1%} of the repositories' pages are still cached")
    tensors, out["cold"] = read_once(path, last, how)
    if args.check and digests(tensors) != man["digests"]:
        raise RuntimeError(f"{c} ({how}): step {last} read back differs from the state written")
    del tensors
    gc.collect()
    warm(chain_files(path, last))
    tensors, out["warm"] = read_once(path, last, how)
    if args.check and digests(tensors) != man["digests"]:
        raise RuntimeError(f"{c} ({how}): step {last} read back (warm) differs from the state written")
    out["drop"] = drop
    print(json.dumps(out))
    return 0


def report(args: argparse.Namespace, cmd: str, results: dict[tuple[str, str, str], list[dict[str, Any]]],
           sizes: dict[str, list[int]], full_size: int, raw: int, n_tensors: int, wsec: dict[str, float],
           t_train: float, drop: str, elapsed: float, ucl: Any) -> str:
    n = args.chain
    med = {k: {f: C.median([v[f] for v in vs]) for f in vs[0]} for k, vs in results.items()}
    out = [
        f"`{cmd}`",
        "",
        f"{C.machine_line()}; load average {os.getloadavg()[0]:.2f}; {args.layers}-layer d={args.d_model} "
        f"vocab={args.vocab} transformer, AdamW fp32, {n_tensors} tensors, {C.fmt_bytes(raw)} per step; "
        f"states after training steps {args.warmup + 1}..{args.warmup + n + 1} (trained in {t_train:.0f} s); "
        f"written in " + ", ".join(f"{c} {s:.1f} s" for c, s in wsec.items())
        + f"; median of {args.repeat} rounds; cold = page cache dropped with {drop}; total {elapsed:.0f} s.",
        "",
        f"**Reading step {n} whole** (`ucl.open(path, {n}).load(flat=True)`, open included, in a fresh "
        "process): ratio = seconds / seconds of the full step at the same temperature; CPU = process "
        "CPU time (every thread); library bytes = what the reader counts (`Checkpoint.bytes_read`: "
        "indexes and payloads of every link); disk = /proc/self/io read_bytes.",
        "",
    ]
    rows = []
    for temp in ("cold", "warm"):
        ref = med[(temp, "full", "load")]["seconds"]
        for c, how in READS:
            if (temp, c, how) not in med:
                continue
            m = med[(temp, c, how)]
            rows.append([
                f"{temp}: {LABELS[c].format(n=n)}{', read_many' if how == 'many' else ''}",
                f"{m['seconds']:.3f}",
                f"{m['seconds'] / ref:.2f}x",
                f"{m['cpu']:.2f}",
                C.fmt_bytes(m["lib"]),
                C.fmt_bytes(m["disk"]),
            ])
    out.append(C.markdown_table(["read", "seconds", "vs full", "CPU s", "library bytes", "disk read"], rows))
    hdr = ["policy", *(f"step {s}" for s in range(n + 1)), "mean delta", f"steps 0..{n}"]
    srows = []
    for c, xs in sizes.items():
        deltas = xs[1:]
        srows.append([f"base='{c if c == 'previous' else 'full'}'", *(C.fmt_bytes(x) for x in xs),
                      C.fmt_bytes(sum(deltas) / max(1, len(deltas))), C.fmt_bytes(sum(xs))])
    srows.append(["full every step (delta=None)", *([C.fmt_bytes(full_size)] * (n + 1)), "-",
                  C.fmt_bytes(full_size * (n + 1))])
    out += [
        "",
        f"**Bytes per step on disk** (the step's directory and commit record; step 0 is full in both delta "
        f"repositories; the full step of this state: {C.fmt_bytes(full_size)}, raw tensors "
        f"{C.fmt_bytes(raw)}):",
        "",
        C.markdown_table(hdr, srows),
    ]
    ref = med[("cold", "full", "load")]["seconds"]
    verdict = []
    for c, how in READS:
        if c != "full" and ("cold", c, how) in med:
            x = med[("cold", c, how)]["seconds"] / ref
            verdict.append(f"base='{'previous' if c == 'previous' else 'full'}' "
                           f"{'read_many' if how == 'many' else 'load()'} {x:.2f}x "
                           f"({'met' if x <= 2 else 'NOT met'})")
    out += [
        "",
        f"**Target** (reconstructing a step from a chain of {n} <= 2x the time of reading a full step, "
        "cold): " + ", ".join(verdict) + ".",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
