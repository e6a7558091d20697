"""A layout plan pauses the cycle collector (Planner.plan_layout, ucl.format.metadata.acyclic): a plan is tens
of thousands of small acyclic objects whose allocations would trigger collections over the whole heap of
the process (bench/scale.py: a coordinator's plan at 8 ranks of a 70B layout took 0.35 s with them, 0.19 s
without)."""

from __future__ import annotations

import gc
from typing import Any

from ucl.layout import builtins
from ucl.layout.mesh import Mesh
from ucl.layout.resolve import expected_local
from ucl.plan import save as saveplan
from ucl.write.collectives import Collectives
from ucl.write.planning import Planner

MODEL = dict(num_heads=16, hidden=1024, ffn_hidden=4096, vocab_size=32001, num_kv_heads=4)


def _planner_and_local(layers: int) -> tuple[Planner, dict[str, Any], Any, Mesh]:
    mesh = Mesh((("pp", 1), ("dp", 1), ("tp", 1)))
    layout = builtins.megatron_gpt(num_layers=layers, **MODEL, zero=mesh)
    logical: dict[str, tuple[tuple[int, ...], str]] = {}
    for n, s in builtins.megatron_gpt_params(num_layers=layers, **MODEL):
        logical[n] = (tuple(s), "bfloat16")
        for st in ("exp_avg", "exp_avg_sq"):
            logical[f"optim/state/{n}/{st}"] = (tuple(s), "float32")
    local = {n: (lt.shape, lt.dtype) for n, lt in expected_local(layout, mesh, 0, logical).items()}
    planner = Planner(Collectives(None, 0, 1), 0, 1, None, layout, mesh, False, saveplan.INNER_CHUNK_BYTES)
    return planner, local, layout, mesh


def test_a_layout_plan_runs_without_collections() -> None:
    planner, local, layout, mesh = _planner_and_local(40)
    passes: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    gc.collect()
    gc.callbacks.append(seen)
    try:
        plan = planner.plan_layout(local, layout, mesh, 0)
    finally:
        gc.callbacks.remove(seen)
    assert planner.protocol == "compact" and len(plan.arrays) > 200
    # on leaving, the pause ends with one pass over the youngest generation (acyclic); none older
    assert [g for g in passes if g > 0] == [], passes
    assert gc.isenabled()


def test_a_paused_collector_stays_paused() -> None:
    planner, local, layout, mesh = _planner_and_local(2)
    gc.disable()
    try:
        planner.plan_layout(local, layout, mesh, 0)
        assert not gc.isenabled()
    finally:
        gc.enable()
