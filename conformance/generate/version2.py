"""``cases/version2.json``: steps of format version 2 (spec/core.md §9 item 5), as ucl writes them today.

Version 2 changes three documents: the step document holds the logical records once
(``attributes.ucl.logical``, spec/layout.md §6.3) and a delta step may take its parent's by reference
(``{"from": P}``, §6.9); a delta array has no array document (spec/delta.md §3.2); the commit record
(``ucl_commit`` 2) groups its files by prefix (spec/core.md §7). Every other fixture of the suite is of
version 1; these are written by ucl's writer at version 2 and their records stay grouped through the
generator's edits (``Fx(version=2)``).

- ``valid/version2_steps``: steps 1 (multi-shard arrays, ``StepWriter``) and 2 (``ucl.save``) of
  version 2 beside step 3 of version 1, in one repository (§9 item 5: any mix).
- ``valid/version2_delta_chain``: a full step and two delta steps saved by the engine
  (``CheckpointManager`` with ``DeltaPolicy(base="previous")``): chunked and unchanged delta arrays, none
  with an array document.
- ``valid/version2_records_by_reference``: spec/layout.md §6.3's blocked example (``w``, 10 elements in
  4 blocks of at most 3, stored in 12) as step 1, then delta steps 2 and 3 taking their parent's records
  (``{"from": 1}``, ``{"from": 2}``).
- Copies with one defect each: a path listed twice in a grouped record (§7), a record (even ``{}``) in a
  version 2 array document or consolidated entry (§6 item 5), ``from`` in a full step and ``from`` naming
  a step other than the parent (spec/layout.md §6.9), records resolved through a step that is not
  committed (§6.9: ``broken_chain``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ucl.format.metadata import ArrayMeta, StepMeta
from ucl.format.repository import Repository
from ucl.options import WriteOptions
from ucl.write.kinds import delta_array
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy
from ucl.write.step import StepWriter

from .fixture import Fx, multi_shard_arrays, random_tensor, tiny_state
from .suite import S_COMMIT, Cases

S_V2 = "core.md §9 item 5"
S_GROUPED = "core.md §7"
S_NO_DOC = "delta.md §3.2 The array's delta record"
S_RECORDS = "layout.md §6.3 The logical record"
S_BY_REF = "layout.md §6.9 Records by reference (format version 2)"
V2 = WriteOptions(format_version=2)

# spec/layout.md §6.3's example: w (10 elements) in 4 blocks of at most 3, stored [12] in chunks of 3
W_DATA = torch.arange(10, dtype=torch.float32) * 1.5
W_RECORD = {"tensors": {"w": {"shape": [10], "dtype": "float32"}},
            "maps": [{"tensor": "w", "box": [[0], [3]], "at": [0]}, {"tensor": "w", "box": [[3], [2]], "at": [3]},
                     {"tensor": "w", "box": [[5], [3]], "at": [6]}, {"tensor": "w", "box": [[8], [2]], "at": [9]}]}
BLOCKED = ArrayMeta(name="w", shape=(12,), dtype="float32", chunk_shape=(3,), inner_chunk_shape=(3,),
                    logical=W_RECORD)
TREE = {"t": "dict", "items": [["w", {"t": "tensor", "name": "w"}]]}


def build(root: Path, cases: Cases) -> None:
    _steps(root, cases)
    _delta_chain(root, cases)
    _by_reference(root, cases)


def _is_version_2(f: Fx, step: int) -> None:
    """What makes the step one of version 2: the generator stops if ucl's writer no longer writes it."""
    doc = f.read_json(f"steps/{step}/zarr.json")
    assert doc["attributes"]["ucl"]["format_version"] == 2, doc["attributes"]["ucl"]["format_version"]
    record = f.read_json(f"commits/{step}.json")
    assert record["ucl_commit"] == 2 and all(isinstance(v, dict) for v in record["files"].values()), record


def _steps(root: Path, cases: Cases) -> None:
    fx = "valid/version2_steps"
    f = Fx(root, fx, version=2)
    arrays = multi_shard_arrays(2100)
    f.write(1, arrays)
    st2 = tiny_state(2110)
    f.save(st2, 2)
    st3 = tiny_state(2120)
    f.version = 1  # step 3 of version 1 in the same repository (its record stays of version 1)
    f.save(st3, 3)
    f.version = 2
    for s in (1, 2):
        _is_version_2(f, s)
    assert f.read_json("commits/3.json")["ucl_commit"] == 1
    assert f.read_json("steps/3/zarr.json")["attributes"]["ucl"]["format_version"] == 1
    cases.valid("steps of format version 2 beside one of version 1 validate", S_V2, fx, "validate")
    cases.valid("every step is listed, whatever its version", S_V2, fx, "list_steps", steps=[1, 2, 3])
    t1 = {m.name: t for m, t in arrays}
    cases.valid("a version 2 step of multi-shard arrays opens", S_V2, fx, "open", {"step": 1}, step=1,
                keys=sorted(t1))
    cases.valid("the latest step, of version 1, opens", S_V2, fx, "open", step=3, keys=sorted(st3))
    boxes = {"w": [[[1, 9], [2, 6]]], "v": [[[3, 7]]], "m": [[[1, 4], [1, 3], [0, 3]]], "i": [[[2, 5], [1, 4]]],
             "f8": [[[0, 7], [1, 2]]]}
    cases.reads(S_GROUPED, fx, t1, step=1, boxes=boxes, what=lambda _: ", step 1 (version 2, files grouped)")
    cases.reads(S_V2, fx, st2, step=2, what=lambda _: ", step 2 (version 2, written by ucl.save)")
    cases.reads(S_V2, fx, st3, step=3, what=lambda _: ", step 3 (version 1)")

    # a grouped record may group paths any way, but a path listed twice is corrupt (§7)
    fx = "invalid/commit/version2_path_listed_twice"
    f = Fx(root, fx, version=2)
    f.save(tiny_state(2130), 1)
    raw = f.read_json("commits/1.json")
    w_doc = raw["files"]["w"]["zarr.json"]

    def twice(d: dict[str, Any]) -> None:
        d["files"][""]["w/zarr.json"] = w_doc  # also listed under "w" as "zarr.json"

    _edit_grouped(f, 1, twice)
    cases.invalid("a grouped commit record that lists a path twice (under \"w\" and under \"\")", S_GROUPED,
                  fx, "corrupt_commit_record")
    cases.valid("and its step is not listed", "core.md §7 item 6", fx, "list_steps", steps=[])
    cases.error("its step does not open", S_GROUPED, fx, "open", "corrupt_commit_record", {"step": 1})

    # the records live in the step document; a version 2 array document holding one is refused (§6 item 5)
    fx = "invalid/metadata/version2_array_document_with_record"
    f = Fx(root, fx, version=2)
    st = tiny_state(2140)
    f.save(st, 1)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("logical", {}), consolidated=False)
    cases.invalid("an array document of a version 2 step that holds a logical record (even {})",
                  "core.md §6 item 5", fx, "schema_violation")
    # a reader SHOULD confirm an entry against the array's document before it reads by it (§5.1)
    cases.reads("core.md §5.1", fx, {"w": st["w"]}, may_fail_with=["schema_violation"],
                what=lambda _: ": a reader that confirms the entry against the document refuses it")

    fx = "invalid/metadata/version2_consolidated_entry_with_record"
    f = Fx(root, fx, version=2)
    f.save(tiny_state(2150), 1)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("logical", {}), doc=False)
    cases.invalid("a consolidated entry of a version 2 step that holds a logical record (even {})",
                  "core.md §6 item 5", fx, "schema_violation")
    cases.error("the step does not open", "core.md §6 item 5", fx, "open", "schema_violation", {"step": 1})


def _edit_grouped(f: Fx, step: int, fn: Any) -> None:
    """Edit a grouped record as it is (no regrouping) and seal it: for records no writer would write."""
    from .fixture import seal_commit

    doc = f.read_json(f"commits/{step}.json")
    fn(doc)
    f.put(f"commits/{step}.json", seal_commit(doc))


def _delta_chain(root: Path, cases: Cases) -> None:
    fx = "valid/version2_delta_chain"
    f = Fx(root, fx, version=2)
    state = {"model/w": random_tensor((16, 8), torch.float32, 2200),
             "model/frozen": random_tensor((5, 3), torch.bfloat16, 2201),
             "count": random_tensor((3,), torch.int64, 2202)}
    ref: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(f.path, delta=DeltaPolicy(base="previous", full_every=None), options=V2) as mgr:
        for step in (1, 2, 3):
            if step > 1:
                state["model/w"][step, :] += 1.0  # a row of one inner chunk changes
                state["count"] += 1
            ref[step] = {k: v.clone() for k, v in state.items()}
            mgr.save(step, state).result()
    for step in (1, 2, 3):
        f.fix_time(step)
        _is_version_2(f, step)
    for step in (2, 3):
        doc = f.read_json(f"steps/{step}/zarr.json")
        assert doc["attributes"]["ucl"]["kind"] == "delta", doc["attributes"]["ucl"]
        entries = doc["consolidated_metadata"]["metadata"]
        assert entries["model/frozen"]["attributes"]["ucl"]["delta"]["mode"] == "unchanged"
        assert entries["model/w"]["attributes"]["ucl"]["delta"]["mode"] == "chunked"
        for key in ("model/w", "model/frozen", "count"):
            assert not f.p(f"steps/{step}/{key}/zarr.json").exists(), (step, key)
    cases.valid("a full step and two delta steps of version 2 validate", S_NO_DOC, fx, "validate")
    cases.valid("they are listed", S_NO_DOC, fx, "list_steps", steps=[1, 2, 3])
    cases.valid("the latest delta step opens: its delta arrays are described by the step document alone",
                S_NO_DOC, fx, "open", step=3, keys=sorted(state))
    for step in (2, 3):
        cases.reads(S_NO_DOC, fx, ref[step], step=step, boxes={"model/w": [[[2, 4], [1, 7]]]},
                    what=lambda _, s=step: f", delta step {s} (no array documents)")


def _commit(path: Path, meta: StepMeta, data: dict[tuple[int, ...], torch.Tensor]) -> None:
    repo = Repository.open(path, create=True)
    with StepWriter(repo, meta.step, format_version=2) as w:
        w.begin()
        files = dict(w.write_shard(meta.arrays["w"], c, t) for c, t in data.items())
        w.commit(meta, files)


def _blocks() -> dict[tuple[int, ...], torch.Tensor]:
    out = {}
    for b, (start, n) in enumerate(((0, 3), (3, 2), (5, 3), (8, 2))):
        block = torch.zeros(3)
        block[:n] = W_DATA[start : start + n]
        out[(b,)] = block
    return out


def _chain(f: Fx) -> None:
    """Step 1 full with the blocked record, steps 2 and 3 deltas (``w`` unchanged) taking their parent's."""
    _commit(f.path, StepMeta(step=1, kind="full", tree=TREE, arrays={"w": BLOCKED}), _blocks())
    for s in (2, 3):
        arrays = {"w": delta_array(BLOCKED, False, s - 1)}
        _commit(f.path, StepMeta(step=s, kind="delta", parent=s - 1, tree=TREE, arrays=arrays, logical_from=s - 1),
                {})
    for s in (1, 2, 3):
        f.fix_time(s)
        _is_version_2(f, s)


def _by_reference(root: Path, cases: Cases) -> None:
    fx = "valid/version2_records_by_reference"
    f = Fx(root, fx, version=2)
    _chain(f)
    assert f.read_json("steps/1/zarr.json")["attributes"]["ucl"]["logical"], "step 1 holds the records"
    assert "logical" not in f.read_json("steps/1/w/zarr.json")["attributes"]["ucl"]
    for s in (2, 3):
        assert f.read_json(f"steps/{s}/zarr.json")["attributes"]["ucl"]["logical"] == {"from": s - 1}
    cases.valid("a step whose records are in its step document, and two delta steps taking them by reference",
                S_BY_REF, fx, "validate")
    for s in (1, 2, 3):
        cases.reads(S_RECORDS if s == 1 else S_BY_REF, fx, {"w": W_DATA}, step=s, boxes={"w": [[[4, 9]]]},
                    what=lambda _, s=s: ", the logical tensor" + ("" if s == 1 else f" of step {s} (from {s - 1})"))

    bad = _copy(root, fx, "invalid/layout/version2_from_in_full_step")
    bad.edit_step_doc(1, lambda d: d["attributes"]["ucl"].__setitem__("logical", {"from": 0}))
    cases.invalid("a full step whose records are {\"from\": 0}: only a delta step refers, to its parent",
                  S_BY_REF, bad.rel, "inconsistent_metadata", {"step": 1})
    cases.error("it does not open", S_BY_REF, bad.rel, "open", "inconsistent_metadata", {"step": 1})

    bad = _copy(root, fx, "invalid/layout/version2_from_not_the_parent")
    bad.edit_step_doc(3, lambda d: d["attributes"]["ucl"].__setitem__("logical", {"from": 1}))
    cases.invalid("a delta step of parent 2 whose records are {\"from\": 1}", S_BY_REF, bad.rel,
                  "inconsistent_metadata", {"step": 3})
    cases.error("it does not open", S_BY_REF, bad.rel, "open", "inconsistent_metadata", {"step": 3})

    bad = _copy(root, fx, "invalid/delta/version2_records_from_uncommitted_step")
    bad.p("commits/1.json").unlink()
    cases.invalid("step 3's records resolve through step 2 to step 1, which is not committed", S_BY_REF,
                  bad.rel, "broken_chain", {"step": 3})
    cases.error("step 3 does not open", S_BY_REF, bad.rel, "open", "broken_chain", {"step": 3})
    cases.valid("steps 2 and 3 are still listed (their records verify)", S_COMMIT, bad.rel, "list_steps",
                steps=[2, 3])


def _copy(root: Path, source: str, rel: str) -> Fx:
    f = Fx(root, rel, version=2)
    shutil.copytree(root / source, f.path, dirs_exist_ok=True)
    return f
