"""Inner chunks of real vocabularies, before and after issue 14 item 5 (spec/core.md §6 "Inner chunks").

    python bench/chunks.py [--dir DIR] [--repeat N] [--dtypes float32,bfloat16]
                           [--shapes 32001x4096,50257x768] [--writers K] [--drop auto|fadvise|drop_caches]

Each tensor is written twice in one run: with the inner chunk the old rule chose (``old_choose``: the
largest divisor of the block <= 4 MiB along leading dimensions, the grid chunk = the block; copied here
from ucl <= 1.1) and with today's choice (:func:`ucl.format.shardfile.choose_chunks`: 1-8 MiB for any
shape, the grid chunk rounded up along a dimension one writer holds whole). ``--writers K`` writes each
tensor as K row blocks (as K ranks would, torch.chunk semantics) instead of one.

Then zarr-python, tensorstore (zarr3 driver) and ucl (``ucl.open(path)[name]``) read each one whole and
an 8-row slice from its middle, each read in a cold page cache (fsync + fadvise DONTNEED per file,
checked with mincore), a fresh open every time, after one untimed warm read (imports); the table gives
the median of ``--repeat`` reads (3).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

TARGET = 4 << 20


def old_choose(block: tuple[int, ...], itemsize: int, target: int = TARGET) -> tuple[int, ...]:
    """ucl <= 1.1's rule, which ucl still has as ``choose_inner_chunk`` (the zarr_store adapter's views):
    the largest inner chunk <= ``target`` bytes that divides ``block``, splitting leading dimensions first."""
    from ucl.format.shardfile import choose_inner_chunk

    return choose_inner_chunk(block, itemsize, target)


def write(path: str, name: str, t: Any, layout: str, writers: int) -> Any:
    """One full step holding ``t`` with the old or the new chunk choice; returns its ArrayMeta."""
    from ucl.format import structure
    from ucl.format.metadata import StepMeta
    from ucl.format.repository import Repository
    from ucl.plan.save import all_shards, array_for, shard_block
    from ucl.write.step import StepWriter

    block = (-(-t.shape[0] // writers), *t.shape[1:])
    meta = array_for(name, t, chunk_shape=block)  # today's choice
    if layout == "before":
        old = old_choose(block, t.element_size())
        meta = dataclasses.replace(meta, chunk_shape=block, inner_chunk_shape=old)
    w = StepWriter(Repository.open(path, create=True), 0)
    w.begin()
    files = {}
    for coords in all_shards(meta):
        rel, entry = w.write_shard(meta, coords, shard_block(meta, coords, t))
        files[rel] = entry
    _, tree = structure.flatten({name: t})
    w.commit(StepMeta(step=0, kind="full", tree=tree, arrays={name: meta}), files)
    return meta


def readers(path: str, name: str, rows: slice) -> dict[str, Callable[[], Any]]:
    import tensorstore as ts
    import zarr

    import ucl
    from ucl.format.dtypes import register_zarr_dtypes

    register_zarr_dtypes()
    where = os.path.join(path, "steps", "0", name)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": where}}

    def ucl_read(idx: Any) -> Any:
        with ucl.open(path) as ck:
            return ck[name][idx]

    return {
        "zarr-python full": lambda: zarr.open_array(where, mode="r")[...],
        "zarr-python 8 rows": lambda: zarr.open_array(where, mode="r")[rows],
        "tensorstore full": lambda: ts.open(spec).result().read().result(),
        "tensorstore 8 rows": lambda: ts.open(spec).result()[rows].read().result(),
        "ucl full": lambda: ucl_read(...),
        "ucl 8 rows": lambda: ucl_read(rows),
    }


def cold(path: str, fn: Callable[[], Any], repeat: int, drop: str) -> float:
    fn()  # once warm, untimed: imports and first-call setup are not what is measured
    times = []
    for _ in range(repeat):
        C.drop_cache([path], drop)
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return C.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--shapes", default="32001x4096,50257x768")
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--drop", default="auto", choices=["auto", "fadvise", "drop_caches"])
    a = ap.parse_args(argv)
    import torch

    root = a.dir or tempfile.mkdtemp(prefix="ucl-bench-chunks-")
    os.makedirs(root, exist_ok=True)
    args = " ".join(argv if argv is not None else sys.argv[1:])
    print(f"`python bench/chunks.py {args}`; {C.machine_line()}")
    layout_rows, time_rows = [], []
    try:
        for dname in a.dtypes.split(","):
            dtype = getattr(torch, dname)
            for sh in a.shapes.split(","):
                shape = tuple(int(x) for x in sh.split("x"))
                g = torch.Generator().manual_seed(0)
                t = torch.randn(shape, generator=g).to(dtype)
                name = "w"
                mid = shape[0] // 2
                rows = slice(mid, mid + 8)
                timings: dict[str, dict[str, float]] = {}
                for layout in ("before", "after"):
                    path = os.path.join(root, f"{dname}-{sh}-{layout}")
                    shutil.rmtree(path, ignore_errors=True)
                    meta = write(path, name, t, layout, a.writers)
                    n_inner = math.prod(meta.grid) * meta.n_inner
                    layout_rows.append([f"{dname} {list(shape)}", layout, str(list(meta.chunk_shape)),
                                        str(list(meta.inner_chunk_shape)), C.fmt_bytes(meta.inner_nbytes),
                                        f"{n_inner:,}"])
                    timings[layout] = {k: cold(path, fn, a.repeat, a.drop)
                                       for k, fn in readers(path, name, rows).items()}
                    shutil.rmtree(path, ignore_errors=True)
                for k in timings["before"]:
                    b, f = timings["before"][k], timings["after"][k]
                    time_rows.append([f"{dname} {list(shape)}", k, f"{b * 1e3:.0f} ms", f"{f * 1e3:.0f} ms",
                                      f"{b / f:.1f}x"])
                del t
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(C.markdown_table(["tensor", "layout", "grid chunk", "inner chunk", "inner bytes", "inner chunks"],
                           layout_rows, "llllrr"))
    print()
    print(f"cold-cache reads, median of {a.repeat}, {a.writers} writer(s):")
    print()
    print(C.markdown_table(["tensor", "read", "before", "after", "speed-up"], time_rows, "llrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
