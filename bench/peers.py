"""Peers: ucl beside torch, safetensors, DCP, tensorstore and the device probes, in one table.

    ./dev bench peers [--size small|gpt2|gpt2-weights|medium|llama] [--reps 3] [--steady 4] [--sections save,load,slice]
                      [--dir DIR] [--keep]

States: ``small``, ``gpt2`` (GPT-2 small, issue 14's 1.49 GB), ``medium``: a GPT-2-like fp32 model (vocabulary
50257) with its AdamW state, as a training checkpoint holds; ``llama``: a Llama-7B-shaped model trimmed to 2
layers, bf16 weights (vocabulary 32001). Values are tiled random blocks (bench/_common.py), cheap to make.

Every measurement runs in a fresh process (python, torch and each library imported before any clock starts),
``--reps`` rounds with the cases' order rotated between rounds (a busy moment of the shared disk and CPUs hits
every case); the tables give medians, with the range over rounds.

- save, first of a process: for ucl a CheckpointManager opened, one save, closed (the durable time ends when
  ``close`` returns; ``blocked`` is the ``save`` call); for the peers the first save of the process, fsync'd.
- save, steady: ``--steady`` saves after that (ucl: a new manager, a warm-up save, then the saves, each waited
  for; the write probe runs before each of them, in the same process: the same-run device figure).
- blocked: how long the call keeps training waiting (synchronous savers: the whole save).
- full load, cold page cache: ``ucl.open(p).load(flat=True)`` and ``load_into`` (preallocated destinations)
  beside torch.load, safetensors (mmap and pread: the better one), DCP (preallocated), tensorstore (zarr3 over
  ucl's files; fp32 states only), bench/read.py's O_DIRECT reader and the C read probe over ucl's files.
- open + 1/8 of the embedding's rows, from a fresh process: everything from the first open to the rows in
  memory (a strided pass touches them), cold page cache, then warm (a second fresh process, pages cached).
  Every library is imported before the clock, ucl's read path included (``import ucl`` alone loads
  nothing: its first ``ucl.open`` would); that import is reported below the table. The ucl package is
  byte-compiled first, as ``pip install`` leaves it (these machines set PYTHONDONTWRITEBYTECODE).

Probes (bench/probe.c, built with the system cc): write, O_DIRECT, 4 requests x 8 MiB in flight from
pre-touched memory (no copy, no checksum), fdatasync, timed open to close, one file of the state's bytes;
and the same over the sizes of ucl's files of a step (one syncfs, as ucl's save), which tells how much of
ucl's distance to the one-file probe is the file layout's; read, the same in reverse over ucl's shard
files into one touched destination.

Ratios: "vs best peer" = the best peer's seconds / ucl's (> 1: ucl is faster); "vs probe" = the probe's
seconds / ucl's (the fraction of the device's speed ucl reaches). The ucl profile table gives the
persister's phases (``Job.phases``, logged by ucl.write.commit at DEBUG).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as c  # noqa: E402
import read as R  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# tiny: a smoke test; gpt2-weights: gpt2's model alone (148 tensors: issue 14's open + slice "on a step of
# ~150 tensors")
STATES = [*c.SIZES, "gpt2-weights", "llama"]
WEIGHTS = "-weights"

SAVE_CASES = ["ucl", "torch.save", "safetensors", "dcp.save", "dcp.async_save"]
SAVE_PEERS = SAVE_CASES[1:]
# bench/read.py's full-load cases (less its buffered reader) and the C read probe
LOAD_CASES = [k for k in R.FULL_CASES if not k.startswith("device: buffered")] + ["probe read"]
SLICE_CASES = ["ucl", "torch.load(mmap)", "safetensors", "tensorstore", "DCP (whole item)"]
STEP = R.STEP  # read.py's cases read ucl's step 1


# == states =======================================================================================
def build_state(size: str) -> dict[str, Any]:
    if size == "llama":
        return c.llama_state()
    if size.endswith(WEIGHTS):
        return {f"model/{k}": v for k, v in c.gpt_state(size.removesuffix(WEIGHTS), fill="tiled").items()}
    return c.training_state(size, fill="tiled")


def embedding_of(size: str) -> str:
    return "model.embed_tokens.weight" if size == "llama" else "model/transformer.wte.weight"


def describe(size: str, man: dict[str, Any]) -> str:
    emb = man["tensors"][man["slice"]["name"]]
    if size == "llama":
        what = (
            f"a Llama-7B-shaped model trimmed to {c.LLAMA['layers']} layers, bf16 weights, vocabulary "
            f"{c.LLAMA['vocab']}"
        )
    else:
        vocab, _ctx, d, layers = c.SIZES[size.removesuffix(WEIGHTS)]
        what = (
            f"a GPT-2-like fp32 model (vocabulary {vocab}, width {d}, {layers} layers)"
            + (" alone" if size.endswith(WEIGHTS) else " with its AdamW state")
        )
    return (
        f"state '{size}': {what}; {len(man['tensors'])} tensors, {c.fmt_bytes(man['nbytes'])}; embedding "
        f"`{man['slice']['name']}` {emb['shape']} {emb['dtype']}"
    )


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Delete outside any timing, then let the disk settle (the filesystem discards freed blocks)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)
    c.settle(os.path.dirname(path) or ".")


# == setup: the checkpoints every read reads =======================================================
def setup(size: str, d: str) -> dict[str, Any]:
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp

    import ucl
    from ucl.format import names

    state = build_state(size)
    p = R.paths(d)
    ucl.save(state, p["ucl"], step=STEP)
    torch.save(state, p["torch"])
    safetensors.torch.save_file(state, p["safetensors"])
    dcp.save(state, checkpoint_id=p["dcp"], no_dist=True)
    name = embedding_of(size)
    rows = state[name].shape[0]
    a, b = 3 * rows // 8, 4 * rows // 8
    man = {
        "size": size,
        "nbytes": c.state_nbytes(state),
        "fingerprint": R.fingerprint(state),
        "tensors": {
            n: {"shape": list(t.shape), "key": names.to_key(n), "dtype": str(t.dtype).split(".")[-1]}
            for n, t in state.items()
        },
        "slice": {
            "name": name,
            "start": a,
            "stop": b,
            "nbytes": state[name][a:b].numel() * state[name].element_size(),
            "fingerprint": float(state[name][a:b].to(torch.float64).sum()),
        },
        "ucl_files": [os.path.getsize(f) for f in R.shard_files(p)],
    }
    with open(p["manifest"], "w") as fh:
        json.dump(man, fh)
    c.settle(d)
    return man


# == children ======================================================================================
class _Phases(logging.Handler):
    """Collects the persister's phases (ucl.write.commit logs them at DEBUG with ``extra=ucl_phases``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_step: dict[int, dict[str, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        ph = getattr(record, "ucl_phases", None)
        if ph is not None:
            self.by_step[int(record.ucl_step)] = ph  # type: ignore[attr-defined]


def save_child(case: str, size: str, root: str, steady: int) -> dict[str, Any]:
    import torch

    state = build_state(size)
    nbytes = c.state_nbytes(state)
    clock = time.perf_counter
    first: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []
    phases: dict[str, Any] = {"first": None, "steady": []}

    dev = c.Device(root)

    file_probes: list[dict[str, Any]] = []

    def probe(i: int, sizes: list[int]) -> None:
        """The one-file write probe, then the probe over the sizes of ucl's files of a step (one syncfs,
        as ucl's save): what the device gives that file layout, beside what it gives one file."""
        for out, sz, sync in ((probes, [nbytes], "fdatasync"), (file_probes, sizes, "syncfs")):
            where = os.path.join(root, f"probe-{i}")
            before = dev.snapshot()
            r = c.probe_write(where, sz, sync=sync)
            out.append({**r, "device": dev.delta(before, r["seconds"]), "files": len(sz)})
            remove(where)
            c.settle(root)

    if case == "ucl":
        from ucl.write.manager import CheckpointManager

        log = logging.getLogger("ucl.write")
        h = _Phases()
        log.addHandler(h)
        log.setLevel(logging.DEBUG)
        where = os.path.join(root, "first")
        before = dev.snapshot()
        t0 = clock()
        mgr = CheckpointManager(where)
        t1 = clock()
        handle = mgr.save(0, state)
        first["blocked"] = clock() - t1
        handle.result()
        mgr.close()
        first["durable"] = clock() - t0
        first["device"] = dev.delta(before)
        phases["first"] = h.by_step.get(0)
        del mgr, handle
        gc.collect()
        remove(where)
        where = os.path.join(root, "steady")
        mgr = CheckpointManager(where)
        mgr.save(0, state).result()  # the warm-up
        sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(where, "steps", "0"))
                 for f in fs]
        for i in range(1, steady + 1):
            probe(i, sizes)
            before = dev.snapshot()
            t0 = clock()
            handle = mgr.save(i, state)
            b = clock() - t0
            handle.result()
            runs.append({"blocked": b, "durable": clock() - t0, "device": dev.delta(before)})
            phases["steady"].append(h.by_step.get(i))
            mgr.delete_step(i - 1)
            c.settle(root)
        mgr.close()
        remove(where)
        return {
            "case": case,
            "bytes": nbytes,
            "first": first,
            "steady": runs,
            "probes": probes,
            "file_probes": file_probes,
            "phases": phases,
        }

    def one(i: int) -> dict[str, float]:
        out = os.path.join(root, f"s{i}")
        os.makedirs(out, exist_ok=True)
        t0 = clock()
        blocked = None
        if case == "torch.save":
            with open(os.path.join(out, "state.pt"), "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        elif case == "safetensors":
            from safetensors.torch import save_file

            path = os.path.join(out, "state.safetensors")
            save_file(state, path)
            _fsync_file(path)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter

            writer = FileSystemWriter(os.path.join(out, "dcp"), thread_count=2)  # sync_files: fsync'd
            if case == "dcp.save":
                dcp.save(state, storage_writer=writer)
            else:
                fut = dcp.async_save(state, storage_writer=writer)
                blocked = clock() - t0
                fut.result()
        _sync_dir(out)
        durable = clock() - t0
        remove(out)
        return {"blocked": durable if blocked is None else blocked, "durable": durable}

    first = one(0)
    for i in range(1, steady + 1):
        runs.append(one(i))
    return {"case": case, "bytes": nbytes, "first": first, "steady": runs, "probes": [], "phases": phases}


def _prealloc(man: dict[str, Any]) -> dict[str, Any]:
    """read.py's destinations, in each tensor's own dtype (read.py's are fp32)."""
    import torch

    return {
        n: torch.zeros(v["shape"], dtype=getattr(torch, v.get("dtype", "float32")))
        for n, v in man["tensors"].items()
    }


def load_child(d: str, order: list[str], drop: str) -> dict[str, Any]:
    import numpy  # noqa: F401  everything imported before any timing
    import safetensors.torch  # noqa: F401
    import tensorstore  # noqa: F401
    import torch
    import torch.distributed.checkpoint  # noqa: F401

    import ucl  # noqa: F401

    torch.set_num_threads(os.cpu_count() or 1)
    p = R.paths(d)
    with open(p["manifest"]) as fh:
        man = json.load(fh)
    R.prealloc = _prealloc  # read.py's cases, with destinations of the state's dtypes
    R.warm_up(p, man)
    results: dict[str, Any] = {}
    for case in order:
        gc.collect()
        if case == "probe read":
            R.cold(p, drop)
            dev = c.Device(p["ucl"])
            before = dev.snapshot()
            r = c.probe_read(R.shard_files(p))
            results[case] = {"seconds": r["seconds"], "bytes": r["bytes"],
                             "device": dev.delta(before, r["seconds"])}
        else:
            results[case], _ = R.full_case(case, p, man, drop)
        gc.collect()
    return results


def slice_child(d: str, case: str, warm: bool, drop: str) -> dict[str, Any]:
    import numpy as np
    import safetensors
    import tensorstore as ts
    import torch
    import torch.distributed.checkpoint as dcp

    import ucl

    p = R.paths(d)
    with open(p["manifest"]) as fh:
        man = json.load(fh)
    s = man["slice"]
    name, a, b = s["name"], s["start"], s["stop"]
    info = man["tensors"][name]
    if not warm:
        R.cold(p, drop)
    lib = -1
    imported = 0.0
    if case == "ucl":
        # `import ucl` loads nothing; its read path loads on the first ucl.open. The peers' libraries are
        # loaded before the clock (above), so ucl's is too, and its cost is reported beside the table
        t0 = time.perf_counter()
        import ucl.read.checkpoint  # noqa: F401
        imported = time.perf_counter() - t0
    opened = 0.0
    with c.Meter() as m:
        if case == "ucl":
            t0 = time.perf_counter()
            with ucl.open(p["ucl"]) as ck:
                opened = time.perf_counter() - t0
                b0 = ck.bytes_read
                t = ck[name][a:b]
                lib = ck.bytes_read - b0
                fp = R.fingerprint({name: t})
        elif case == "torch.load(mmap)":
            t = torch.load(p["torch"], mmap=True, weights_only=True)[name][a:b]
            fp = R.fingerprint({name: t})
        elif case == "safetensors":
            with safetensors.safe_open(p["safetensors"], framework="pt") as f:
                t = f.get_slice(name)[a:b]
                fp = R.fingerprint({name: t})
        elif case == "tensorstore":
            h = ts.open(R.ts_spec(p, info["key"]), context=R.ts_context(), read=True).result()
            t = torch.from_numpy(np.asarray(h[a:b].read().result()))
            fp = R.fingerprint({name: t})
        else:
            dest = {name: torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))}
            dcp.load(dest, checkpoint_id=p["dcp"], no_dist=True)
            t = dest[name][a:b]
            fp = R.fingerprint({name: t})
    want = s["fingerprint"]
    got = float(t.to(torch.float64).sum())
    if tuple(t.shape) != (b - a, *info["shape"][1:]) or abs(got - want) > 1e-6 * max(1.0, abs(want)):
        raise RuntimeError(f"{case}: the rows read differ from those written")
    del fp
    return {"seconds": m.seconds, "disk": m.disk, "lib_bytes": lib, "import_s": imported, "open_s": opened}


# == the parent ====================================================================================
def run(argv: list[str], timeout: float = 3600) -> Any:
    return c.run_child([os.path.abspath(__file__), *argv], timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=STATES, default="small")
    ap.add_argument("--reps", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--steady", type=int, default=4, help="steady saves per save case (default 4)")
    ap.add_argument("--sections", default="save,load,slice")
    ap.add_argument("--only", help="comma-separated substrings: run only the cases whose names hold one")
    ap.add_argument("--dir", help="where to write (default: a temporary directory under ./bench-out)")
    ap.add_argument("--drop", choices=["auto", "fadvise", "drop_caches"], default="auto")
    ap.add_argument("--keep", action="store_true", help="keep the directory written")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--arg", action="append", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        if a.child == "setup":
            out: Any = setup(a.size, a.dir)
        elif a.child == "save":
            out = save_child(a.arg[0], a.size, a.dir, a.steady)
        elif a.child == "load":
            out = load_child(a.dir, json.loads(a.arg[0]), a.drop)
        else:
            out = slice_child(a.dir, a.arg[0], a.arg[1] == "warm", a.drop)
        print(json.dumps(out))
        return 0

    sections = set(a.sections.split(","))
    os.makedirs("bench-out", exist_ok=True)
    d = os.path.abspath(a.dir) if a.dir else tempfile.mkdtemp(prefix="peers-", dir="bench-out")
    os.makedirs(d, exist_ok=True)
    cmd = "./dev bench peers " + " ".join(sys.argv[1:] if argv is None else argv)
    base = ["--size", a.size, "--dir", d, "--drop", a.drop, "--steady", str(a.steady)]
    t_all = time.perf_counter()
    saves: dict[str, list[dict[str, Any]]] = {k: [] for k in SAVE_CASES}
    loads: dict[str, list[dict[str, Any]]] = {k: [] for k in LOAD_CASES}
    slices: dict[str, list[dict[str, Any]]] = {f"{k} {t}": [] for k in SLICE_CASES for t in ("cold", "warm")}
    c.compile_package()
    try:
        man = run(["--child", "setup", *base])
        def wanted(case: str) -> bool:
            return not a.only or any(w in case for w in a.only.split(","))

        save_cases = [k for k in SAVE_CASES if wanted(k)]
        load_cases = [
            k
            for k in LOAD_CASES
            if wanted(k) and (man["tensors"][man["slice"]["name"]]["dtype"] == "float32"
                              or not k.startswith("tensorstore"))
        ]
        slice_cases = [
            k
            for k in SLICE_CASES
            if wanted(k) and (man["tensors"][man["slice"]["name"]]["dtype"] == "float32" or k != "tensorstore")
        ]
        for r in range(a.reps):
            if "save" in sections:
                k = r % max(1, len(save_cases))
                for case in save_cases[k:] + save_cases[:k]:
                    root = os.path.join(d, "save")
                    saves[case].append(
                        run(["--child", "save", "--arg", case, *base[:2], "--dir", root, *base[4:]])
                    )
                    shutil.rmtree(root, ignore_errors=True)
                    print(f"  round {r + 1} save {case}: {_brief(saves[case][-1])}", file=sys.stderr)
            if "load" in sections and load_cases:
                k = r % len(load_cases)
                res = run(["--child", "load", "--arg", json.dumps(load_cases[k:] + load_cases[:k]), *base])
                for case, v in res.items():
                    loads[case].append(v)
                print(
                    f"  round {r + 1} load: " + ", ".join(f"{k} {v['seconds']:.2f}" for k, v in res.items()),
                    file=sys.stderr,
                )
            if "slice" in sections and slice_cases:
                k = r % len(slice_cases)
                for case in slice_cases[k:] + slice_cases[:k]:
                    slices[f"{case} cold"].append(
                        run(["--child", "slice", "--arg", case, "--arg", "cold", *base])
                    )
                    run(["--child", "slice", "--arg", case, "--arg", "warm", *base])  # the pages cached
                    slices[f"{case} warm"].append(
                        run(["--child", "slice", "--arg", case, "--arg", "warm", *base])
                    )
                print(
                    f"  round {r + 1} slice: "
                    + ", ".join(f"{k} {v[-1]['seconds'] * 1e3:.0f} ms" for k, v in slices.items() if v),
                    file=sys.stderr,
                )
        print(report(cmd, man, saves, loads, slices, a.reps, time.perf_counter() - t_all))
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    return 0


def _brief(r: dict[str, Any]) -> str:
    st = r["steady"]
    out = f"first {r['first']['durable']:.2f} s, steady " + " ".join(f"{x['durable']:.2f}" for x in st)
    if r["probes"]:
        out += ", probes " + " ".join(f"{x['seconds']:.2f}" for x in r["probes"])
    if r.get("file_probes"):
        out += ", over ucl's files " + " ".join(f"{x['seconds']:.2f}" for x in r["file_probes"])
    return out


# == the report ====================================================================================
def _med(xs: list[float]) -> float:
    return c.median([x for x in xs if x == x])


def _cell(xs: list[float], unit: str = "s") -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    m = c.median(xs)
    if unit == "ms":
        text = f"{m * 1e3:.0f} ms"
        return text + (f" ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})" if len(xs) > 1 else "")
    return f"{m:.2f} s" + (f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else "")


def report(
    cmd: str,
    man: dict[str, Any],
    saves: dict[str, list[dict[str, Any]]],
    loads: dict[str, list[dict[str, Any]]],
    slices: dict[str, list[dict[str, Any]]],
    reps: int,
    elapsed: float,
) -> str:
    nbytes = man["nbytes"]
    cols = ["torch", "safetensors", "DCP", "DCP async", "tensorstore", "probe", "ucl"]
    rows: list[list[str]] = []
    rates: list[list[str]] = []

    def add(metric: str, vals: dict[str, list[float]], unit: str = "s", rate: bool = False) -> None:
        med = {k: _med(v) for k, v in vals.items() if v and _med(v) == _med(v)}
        peers = [v for k, v in med.items() if k not in ("ucl", "probe")]
        best = min(peers) if peers else float("nan")
        u = med.get("ucl", float("nan"))
        pr = med.get("probe", float("nan"))
        rows.append(
            [
                metric,
                *(_cell(vals.get(k, []), unit) for k in cols),
                f"{best / u:.2f}x" if peers else "-",
                f"{pr / u:.0%}" if pr == pr else "-",
            ]
        )
        if rate:
            rates.append([metric, *(f"{nbytes / med[k] / 1e9:.2f}" if k in med else "-" for k in cols)])

    col_of = {
        "torch.save": "torch",
        "safetensors": "safetensors",
        "dcp.save": "DCP",
        "dcp.async_save": "DCP async",
        "ucl": "ucl",
    }
    if any(saves.values()):
        probes = [p["seconds"] for r in saves["ucl"] for p in r["probes"]]
        for label, key in (
            ("save durable, first of a process", "durable"),
            ("save durable, steady", "durable"),
            ("save blocked, first of a process", "blocked"),
            ("save blocked, steady", "blocked"),
        ):
            vals: dict[str, list[float]] = {}
            for case, rs in saves.items():
                if "first" in label:
                    vals[col_of[case]] = [r["first"][key] for r in rs]
                else:  # each round's median over its steady saves
                    vals[col_of[case]] = [_med([x[key] for x in r["steady"]]) for r in rs]
            if key == "durable":
                vals["probe"] = probes
            add(label, vals, rate=key == "durable")
    if any(loads.values()):
        st = [
            min(a["seconds"], b["seconds"])
            for a, b in zip(loads[LOAD_CASES[3]], loads[LOAD_CASES[4]], strict=False)
        ]
        probe = [x["seconds"] for x in loads["probe read"]]
        peers = {
            "torch": [x["seconds"] for x in loads[LOAD_CASES[2]]],
            "safetensors": st,
            "DCP": [x["seconds"] for x in loads[LOAD_CASES[5]]],
            "tensorstore": [x["seconds"] for x in loads[LOAD_CASES[6]]],
            "probe": probe,
        }
        add(
            "full load, cold: ucl.open(p).load(flat=True)",
            {**peers, "ucl": [x["seconds"] for x in loads[LOAD_CASES[0]]]},
            rate=True,
        )
        add(
            "full load, cold: load_into (preallocated)",
            {**peers, "ucl": [x["seconds"] for x in loads[LOAD_CASES[1]]]},
            rate=True,
        )
    if any(slices.values()):
        s_of = {
            "ucl": "ucl",
            "torch.load(mmap)": "torch",
            "safetensors": "safetensors",
            "tensorstore": "tensorstore",
            "DCP (whole item)": "DCP",
        }
        for t in ("cold", "warm"):
            add(
                f"open + 1/8 of the embedding's rows, {t}",
                {s_of[k]: [x["seconds"] for x in slices[f"{k} {t}"]] for k in SLICE_CASES},
                unit="ms",
            )
    out = [
        f"`{cmd}`",
        "",
        f"{c.machine_line()}; {describe(man['size'], man)}; median of {reps} rounds (range in brackets), "
        f"every figure from a fresh process; total {elapsed:.0f} s.",
        "",
        c.markdown_table(
            ["metric", *cols, "ucl vs best peer", "ucl vs probe"], rows, "l" + "r" * (len(cols) + 2)
        ),
    ]
    if rates:
        out += ["", "GB/s (state bytes / median seconds):", "", c.markdown_table(["metric", *cols], rates)]
    notes = [
        "",
        "Columns: torch = torch.save (+ fsync) / torch.load(weights_only) / torch.load(mmap=True)[rows]; "
        "safetensors = save_file (+ fsync) / load_file, the better of mmap and pread / safe_open get_slice; "
        "DCP = dcp.save, FileSystemWriter(thread_count=2), fsync'd / dcp.load preallocated / the whole item "
        "loaded; DCP async = dcp.async_save (blocked: until it returns); tensorstore = zarr3 over ucl's "
        "files "
        "(reads only). probe: writes, one file of the state's bytes (run before each steady ucl save, in its "
        "process); loads, the C read probe over ucl's shard files " + _probe_note(loads) + ".",
    ]
    out += notes
    fprobes = [x for r in saves.get("ucl", []) for x in r.get("file_probes", [])]
    if fprobes:
        steady = [_med([x["durable"] for x in r["steady"]]) for r in saves["ucl"]]
        fp = [x["seconds"] for x in fprobes]
        out += ["", f"The write probe over the sizes of ucl's files of a step ({fprobes[0]['files']:,} files in one "
                    "directory, each O_DIRECT and rounded up to 4 KiB, one syncfs; run before each steady save "
                    f"beside the one-file probe): {_cell(fp)}; ucl's steady save reaches "
                    f"{_med(fp) / _med(steady):.0%} of its speed (of the one-file probe's: "
                    f"{_med([p['seconds'] for r in saves['ucl'] for p in r['probes']]) / _med(steady):.0%})."]
    opens = {t: [x["open_s"] for x in slices.get(f"ucl {t}", []) if x.get("open_s")] for t in ("cold", "warm")}
    if any(opens.values()):
        out += ["", "`ucl.open` alone, inside the ucl slice rows (a step of "
                    f"{len(man['tensors'])} tensors): " + ", ".join(
                        f"{t} {_med(v) * 1e3:.1f} ms ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})"
                        for t, v in opens.items() if v) + "."]
    imports = [x["import_s"] for k, v in slices.items() if k.startswith("ucl ") for x in v]
    if imports:
        out += ["", f"Not in the slice rows: ucl's read path imported by the first `ucl.open` of a process "
                    f"(bytecode compiled, as a pip install leaves it): {_med(imports) * 1e3:.0f} ms median "
                    f"({min(imports) * 1e3:.0f}-{max(imports) * 1e3:.0f}); the peers' libraries are imported "
                    "before the clock too."]
    phases = [p for r in saves.get("ucl", []) for p in r["phases"]["steady"] if p]
    firsts = [r["phases"]["first"] for r in saves.get("ucl", []) if r["phases"]["first"]]
    if phases:
        keys = [k for k in phases[0] if k != "write"] + ["write"]
        out += [
            "",
            "ucl's persister, where the time goes (seconds, median; ucl.write.shards / ucl.write.commit: "
            "encode = chunk views + crc32c per inner chunk; paths = checking paths, making directories; "
            "documents = the step's documents, beside the shard writes; drain = waiting for the C writers "
            "after Python's part; sync = the one syncfs; write = all of ShardWriter.write; commit = the "
            "commit "
            "record; retention):",
            "",
            c.markdown_table(
                ["save", *keys],
                [
                    ["first", *(f"{_med([p.get(k, float('nan')) for p in firsts]):.3f}" for k in keys)],
                    ["steady", *(f"{_med([p.get(k, float('nan')) for p in phases]):.3f}" for k in keys)],
                ],
            ),
        ]
    out += _device_table(saves, loads)
    return "\n".join(out)


def _device_table(saves: dict[str, list[dict[str, Any]]], loads: dict[str, list[dict[str, Any]]]) -> list[str]:
    """What the device and the CPUs did during ucl's cases and the probes (``c.Device``, medians)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in saves.get("ucl", []):
        runs.setdefault("save, first of a process: ucl", []).append(
            {"seconds": r["first"]["durable"], **r["first"].get("device", {})})
        runs.setdefault("save, steady: ucl", []).extend(
            {"seconds": x["durable"], **x.get("device", {})} for x in r["steady"])
        runs.setdefault("save: write probe (one file)", []).extend(
            {"seconds": x["seconds"], **x.get("device", {})} for x in r["probes"])
        for x in r.get("file_probes", []):
            runs.setdefault(f"save: write probe (ucl's {x['files']:,} files)", []).append(
                {"seconds": x["seconds"], **x.get("device", {})})
    for label, case in (("load: ucl load(flat=True)", LOAD_CASES[0]), ("load: ucl load_into", LOAD_CASES[1]),
                        ("load: read probe", "probe read")):
        for x in loads.get(case, []):
            runs.setdefault(label, []).append({"seconds": x["seconds"], **x.get("device", {})})
    rows = []
    for label, xs in runs.items():
        xs = [x for x in xs if "busy" in x]
        if not xs:
            continue
        m = {k: _med([float(x.get(k, math.nan)) for x in xs]) for k in ("seconds", "busy", "inflight",
                                                                         "requests", "kib", "user", "sys")}
        rows.append([label, f"{m['seconds']:.2f}", f"{m['busy']:.0%}", f"{m['inflight']:.1f}",
                     f"{m['requests']:.0f}", f"{m['kib']:.0f}",
                     *("-" if m[k] != m[k] else f"{m[k]:.2f}" for k in ("user", "sys"))])
    if not rows:
        return []
    return [
        "",
        "What the device and the CPUs did (medians; /sys/dev/block/M:m/stat and os.times around each case: "
        "busy = share of the wall time with a request in flight, in flight = the mean while busy, "
        "requests and KiB per request as the block layer saw them, every process's I/O on that disk "
        "included; CPU seconds of ucl's process, its threads' and the kernel's work for them; a probe's busy "
        "share is of its own timed part, its CPU not shown):",
        "",
        c.markdown_table(["case", "s", "device busy", "in flight", "requests", "KiB/request", "CPU user s",
                          "CPU sys s"], rows),
    ]


def _probe_note(loads: dict[str, list[dict[str, Any]]]) -> str:
    d = loads.get(LOAD_CASES[7]) or []
    if not d:
        return ""
    return f"(bench/read.py's Python O_DIRECT reader, 4 x 8 MiB: {_cell([x['seconds'] for x in d])})"


if __name__ == "__main__":
    raise SystemExit(main())
