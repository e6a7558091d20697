"""``cases/composite.json``: composite steps (delta.md §9), approximate and marked so.

``valid/composite`` is written by the engine (``CheckpointManager`` with ``DeltaPolicy(base="previous",
prune=Prune(threshold=1e-3))``): step 1 full; in step 2 group ``model/layers.0`` changed by less than
the threshold and is stale (step 1's values, age 1), the others are stored; in step 3 it is stale again
(age 2) and ``model/layers.1`` is bit-identical (``unchanged``). A reader refuses steps 2 and 3 without
approximate loading (§9.3: ``unknown_extension``) and reads step 1; a validator finds the repository
valid. Copies carry one defect each: an age that disagrees with the step (§9.1.2, §9.2.1), stale arrays
without the marker (§9.2.2), a stale array referring to a stale array (§9.1.3: ``broken_chain``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy
from ucl.write.prune import Prune

from .fixture import V1, Fx
from .suite import S_COMMIT, Cases

SOURCE = "valid/composite"
S_COMP = "delta.md §9 Extension: composite steps"
S_RECORD = "delta.md §9.1 The stale array record"
S_MARKER = "delta.md §9.2 The approximate marker"
S_READERS = "delta.md §9.3 Readers"
S_VALIDATORS = "delta.md §9.4 Validators"


def dyadic(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float32 multiples of 1/64 from a seeded integer generator: the same bits on every machine."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-96, 97, shape, generator=g).to(torch.float32) / 64


def composite_run(path: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Three steps saved with a composite policy; returns each step's true state."""
    state = {"model/layers.0.w": dyadic((4, 4), 1901), "model/layers.1.w": dyadic((4, 4), 1902),
             "model/head.w": dyadic((2, 4), 1903)}
    out: dict[int, dict[str, torch.Tensor]] = {}
    policy = DeltaPolicy(base="previous", prune=Prune(threshold=1e-3, max_age=8))
    with CheckpointManager(path, delta=policy, options=V1) as mgr:
        for step in (1, 2, 3):
            if step > 1:
                state["model/layers.0.w"][0, 0] += 1 / 1024  # relative update ~1e-4: stale
                state["model/head.w"] += 1.0  # stored
                if step == 2:
                    state["model/layers.1.w"] *= 2  # stored; bit-identical in step 3
            out[step] = {k: v.clone() for k, v in state.items()}
            mgr.save(step, state).result()
    return out


def _copy(root: Path, rel: str) -> Fx:
    f = Fx(root, rel)
    shutil.copytree(root / SOURCE, f.path, dirs_exist_ok=True)
    return f


def _marker(d: dict[str, Any]) -> dict[str, Any]:
    (ext,) = [e for e in d["attributes"]["ucl"]["extensions"] if e["name"] == "ucl.composite"]
    return ext  # type: ignore[no-any-return]


def build(root: Path, cases: Cases) -> None:
    fx = SOURCE
    f = Fx(root, fx)
    ref = composite_run(f.path)
    for step in ref:
        f.fix_time(step)
    key = "model/layers.0.w"
    for step, age in ((2, 1), (3, 2)):
        arr = f.read_json(f"steps/{step}/{key}/zarr.json")
        assert arr["attributes"]["ucl"]["delta"] == {"mode": "stale", "base_step": 1, "age": age}, arr
    unchanged = f.read_json("steps/3/model/layers.1.w/zarr.json")["attributes"]["ucl"]["delta"]
    assert unchanged["mode"] == "unchanged", unchanged

    cases.valid("a full step and two composite steps validate", S_VALIDATORS, fx, "validate")
    cases.valid("composite steps are steps", S_COMMIT, fx, "list_steps", steps=[1, 2, 3])
    cases.valid("the full step opens", S_COMP, fx, "open", {"step": 1}, step=1, keys=sorted(ref[1]))
    for step in (2, 3):
        cases.error(f"composite step {step} is refused without approximate loading", S_READERS, fx, "open",
                    "unknown_extension", {"step": step})
    cases.error("the latest step, composite, is refused without approximate loading", S_READERS, fx, "open",
                "unknown_extension")
    cases.error("a stale tensor of a composite step is not read as the step's state", S_READERS, fx, "read",
                "unknown_extension", {"tensor": key, "step": 3})
    cases.reads(S_COMP, fx, ref[1], step=1)

    bad = _copy(root, "invalid/delta/composite_age_disagrees")
    bad.edit_array(3, key, lambda d: d["attributes"]["ucl"]["delta"].__setitem__("age", 1))
    bad.edit_step_doc(3, lambda d: _marker(d)["configuration"]["stale"][0].__setitem__("age", 1))
    cases.invalid("a stale age that is not the step minus base_step", S_RECORD, bad.rel,
                  "inconsistent_metadata")
    cases.error("a step whose stale age disagrees does not open", S_RECORD, bad.rel, "open",
                "inconsistent_metadata", {"step": 3})

    bad = _copy(root, "invalid/delta/composite_without_marker")
    bad.edit_step_doc(3, lambda d: d["attributes"]["ucl"].pop("extensions"))
    cases.invalid("stale arrays in a step without the ucl.composite marker", S_MARKER, bad.rel,
                  "inconsistent_metadata")
    cases.error("a step with stale arrays and no marker does not open", S_MARKER, bad.rel, "open",
                "inconsistent_metadata", {"step": 3})

    bad = _copy(root, "invalid/delta/composite_refers_to_stale")

    def to_step_2(d: dict[str, Any]) -> None:
        d["attributes"]["ucl"]["delta"] = {"mode": "stale", "base_step": 2, "age": 1}
        d["codecs"][0]["configuration"]["codecs"][0]["configuration"]["base_step"] = 2

    bad.edit_array(3, key, to_step_2)

    def marker_to_step_2(d: dict[str, Any]) -> None:
        g = _marker(d)["configuration"]["stale"][0]
        g["base_step"], g["age"] = 2, 1

    bad.edit_step_doc(3, marker_to_step_2)
    cases.invalid("a stale array whose base step's array is itself stale", S_RECORD, bad.rel, "broken_chain",
                  {"step": 3})
