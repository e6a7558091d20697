"""What packing a layout step's document costs (format version 3, spec/core.md §5.1): its size, the time a
writer takes to make the step's documents, and the time a reader takes to parse and expand the step
document, for format versions 2 and 3 side by side, interleaved, median of ``--reps``.

    python bench/step_docs.py [--world 8] [--layers 80] [--reps 15]

The step: bench/scale.py's LLaMA-70B-like Megatron job (tp=8, the distributed optimizer), planned by the
manager's own planner for ``--world`` ranks (shapes only). "write": ``ucl.write.step.step_documents``
with a fresh document cache (a writer's first step of a plan) and with a warm one (its later steps: the
array documents and the frame are reused). "open": ``metadata.loads`` + ``StepMeta.from_dict(lazy=True)``
of the step document's bytes, what ``ucl.open`` does with them after reading them (the array entries are
checked at their first use, as there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import scale  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()

    from ucl.format import metadata
    from ucl.format.metadata import StepMeta
    from ucl.plan import save as saveplan
    from ucl.plan.layout_save import merge_plans
    from ucl.write.step import DocumentCache, step_documents

    layout, mesh, logical = scale.job(a.layers, a.world)
    shapes = [{n: (lt.shape, lt.dtype) for n, lt in loc.items()} for loc in scale.local_states(layout, mesh, logical)]
    rank_plans = [saveplan.plan_rank(layout, mesh, r, shapes[r], shapes) for r in range(a.world)]
    plan = saveplan.from_layout(rank_plans[0], merge_plans(rank_plans), None, saveplan.INNER_CHUNK_BYTES)
    meta = StepMeta(step=1, kind="full", parent=None, tree={"t": "dict", "items": []}, arrays=plan.arrays,
                    layout=plan.layout, mesh=plan.mesh)
    raw = {v: step_documents(meta, format_version=v)["zarr.json"] for v in (2, 3)}
    times: dict[str, list[float]] = {}
    warm = {v: DocumentCache() for v in (2, 3)}
    for v in (2, 3):
        step_documents(meta, warm[v], format_version=v)
    for _ in range(a.reps):
        for v in (2, 3):  # interleaved
            t0 = time.perf_counter()
            step_documents(meta, DocumentCache(), format_version=v)
            t1 = time.perf_counter()
            step_documents(replace(meta, step=2), warm[v], format_version=v)
            t2 = time.perf_counter()
            with metadata.acyclic():
                StepMeta.from_dict(metadata.loads(raw[v], "bench"), "bench", lazy=True)
            t3 = time.perf_counter()
            for k, dt in (("write, first step", t1 - t0), ("write, later steps", t2 - t1), ("open", t3 - t2)):
                times.setdefault(f"{k} v{v}", []).append(dt)
    print(C.machine_line())
    print(f"{a.world} ranks, {len(plan.arrays)} arrays; median of {a.reps}, interleaved")
    rows = [["step document", C.fmt_bytes(len(raw[2])), C.fmt_bytes(len(raw[3])), f"{len(raw[3]) / len(raw[2]):.3f}x"]]
    for k in ("write, first step", "write, later steps", "open"):
        m2, m3 = (statistics.median(times[f"{k} v{v}"]) for v in (2, 3))
        rows.append([f"{k} (ms)", f"{1e3 * m2:.1f}", f"{1e3 * m3:.1f}", f"{m3 / m2:.2f}x"])
    print(C.markdown_table(["", "version 2", "version 3 (packed)", "3 / 2"], rows))


if __name__ == "__main__":
    main()
