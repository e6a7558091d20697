"""``cases/layouts.json``: steps saved under a layout by several ranks (spec/layout.md).

The valid fixtures are written with ``ucl.save_sharded`` from the local states of every rank of a
simulated parallel job (each rank's state cut from the logical tensors with
``ucl.testing.layout_reference.shard_local_state``): tensor-parallel row and column shards, fused QKV
with GQA and a fused gate/up, a padded vocabulary, pipeline renumbering and placement, nested uneven
shards, partial sums, flat ZeRO fragments. Read cases expect the sha256 of the *original* logical
tensors. A Level-0 reader (spec/core.md §9 item 3) fails on a layout step with ``unknown_extension``,
which the cases on the valid fixtures accept.

The invalid fixtures are copies of a small layout step with one lie each in a logical record, in the
step's layout or mesh, or a chunk holding data left out, resealed (spec/layout.md §6.5, §6.6, §6.8): a
validator reports each; a reader refuses the records' lies when it opens the step, and MAY ignore the
step's layout and mesh (it reads logical tensors from the records).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ucl
from ucl.layout import parse_layout, parse_mesh
from ucl.testing.layout_reference import shard_local_state

from .fixture import V1, Fx
from .suite import Cases, sha

S_RECORD = "layout.md §6.3 The logical record"
S_READ = "layout.md §6.4 Reading a logical box"
S_WRITES = "layout.md §6.5 Which chunks hold data; writes"
S_CHECKS = "layout.md §6.6 Checking the records of a step"
S_LEVEL0 = "layout.md §6.7 Readers that do not implement layouts"
S_STEP_LAYOUT = "layout.md §6.8 The step's layout and mesh"
S_PLAIN = "layout.md §6.2 Plain arrays"
S_FUSED = "layout.md §7.3 `fused(d, p1=c1xu1, p2=..., ...)`: sub-parameters, with GQA"
S_PAD = "layout.md §7.4 `pad(d, f1*f2*...)`: padding"
S_RENUMBER = "layout.md §7.5 `renumber`: pipeline stages and experts"
S_FLAT = "layout.md §7.6 `flat`: flat fragments (ZeRO-1/2, FSDP1)"
S_NESTED = "layout.md §7.2 Nesting: several `shard` of one dimension"
S_PARTIAL = "layout.md §7.8 `partial(a*...)`: partial sums"
S_SHARD = "layout.md §7.1 `shard(d, a*b*...)`: one split over one or more axes"

LEVEL0 = ["unknown_extension"]  # what a reader without layouts reports (spec/core.md §9 item 3)


def dyadic(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Multiples of 1/8 in [-12, 12], never -0.0: exact in every dtype used here and in sums of two."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-96, 97, shape, generator=g).to(torch.float32) / 8
    return (t + 0.0).to(dtype)


def save_layout(
    fx: Fx,
    text: str,
    mesh: str,
    full: dict[str, torch.Tensor],
    extra: dict[str, Any] | None = None,
    adjust: Callable[[list[dict[str, torch.Tensor]]], None] | None = None,
) -> None:
    """Step 1 of ``fx``: what every rank of (layout, mesh) holds of ``full``, saved by ``save_sharded``."""
    layout, m = parse_layout(text), parse_mesh(mesh)
    states: list[dict[str, Any]] = [dict(shard_local_state(full, layout, m, r)) for r in range(m.size)]
    if adjust is not None:
        adjust(states)
    for s in states:
        s.update(extra or {})
    ucl.save_sharded(states, fx.path, 1, layout=layout, mesh=m, options=V1)
    fx.fix_time(1)


MEGATRON = """ucl-layout 1
mesh pp=2 tp=2
renumber "model/layers.{i}.**" over pp: [0, 1, 3]
"model/layers.*.qkv.weight": fused(0, q=4x2, k=1x2, v=1x2), shard(0, tp)
"model/layers.*.fc1.weight": fused(0, gate=3, up=3), shard(0, tp)
"model/layers.*.fc2.weight": shard(1, tp)
"model/embed.weight": size(0, 10), pad(0, 4*tp), shard(0, tp) on pp=0
"model/output.weight": size(0, 10), pad(0, 4*tp), shard(0, tp) on pp=-1
"model/norm.weight": replicate on pp=-1
"""

ZERO = """ucl-layout 1
mesh dp=2 tp=2
"model/col.weight": shard(1, tp)
"model/nested": shard(0, dp), shard(0, tp)
"grad_acc/b": shard(0, tp), partial(dp)
"opt/*/*": shard(-1, tp)
flat "flat/{state}" -> "opt/{member}/{state}" over dp align 4: [
  "a" [3, 4],
  "b" [2, 2],
  "c" [1, 6],
]
"""


DISTOPT = """ucl-layout 3
mesh dp=3
flat "flat/bucket0/{state}" -> "opt/{member}/{state}" over dp align 64 pad 128: [
  "n" [6],
  "w" [4, 25],
]
flat "flat/bucket1/{state}" -> "opt/{member}/{state}" over dp align 64 pad 128: [
  "e" [7, 60],
]
"""


def distopt_state() -> dict[str, torch.Tensor]:
    full = {"model/w": dyadic((4, 25), 2200)}
    for k, (m, shape) in enumerate([("n", (6,)), ("w", (4, 25)), ("e", (7, 60))]):
        full[f"opt/{m}/exp_avg"] = dyadic(shape, 2210 + k)
    return full


def megatron_state() -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for i in range(3):
        full[f"model/layers.{i}.qkv.weight"] = dyadic((12, 4), 2000 + i)  # q 8 rows, k 2, v 2
        full[f"model/layers.{i}.fc1.weight"] = dyadic((6, 4), 2010 + i, torch.bfloat16)
        full[f"model/layers.{i}.fc2.weight"] = dyadic((4, 3), 2020 + i)
    full["model/embed.weight"] = dyadic((10, 4), 2030)
    full["model/output.weight"] = dyadic((10, 4), 2031)
    full["model/norm.weight"] = dyadic((4,), 2032)
    return full


def zero_state() -> dict[str, torch.Tensor]:
    full = {
        "model/col.weight": dyadic((3, 6), 2100),
        "model/nested": dyadic((10, 2), 2101),
        "grad_acc/b": dyadic((6,), 2102),
    }
    for k, (m, shape) in enumerate([("a", (3, 4)), ("b", (2, 2)), ("c", (1, 6))]):
        for j, state in enumerate(("exp_avg", "exp_avg_sq")):
            full[f"opt/{m}/{state}"] = dyadic(shape, 2110 + 2 * k + j)
    return full


def split_partial(name: str, full: torch.Tensor, k: int) -> Callable[[list[dict[str, torch.Tensor]]], None]:
    """Each of the k contributions of a partial tensor holds a part; their sum (in order) is ``full``."""
    parts = [torch.round(full * 8 / k) / 8 for _ in range(k - 1)]
    parts.append(full - sum(parts, torch.zeros_like(full)))

    def adjust(states: list[dict[str, torch.Tensor]]) -> None:
        for r, s in enumerate(states):  # mesh dp=2 tp=2: rank r has dp = r // 2, tp = r % 2
            t = r % 2
            n = -(-full.shape[0] // 2)
            s[name] = parts[r // 2][t * n : (t + 1) * n].clone()

    return adjust


def build(root: Path, cases: Cases) -> None:
    _megatron(root, cases)
    _zero(root, cases)
    _distopt(root, cases)
    _invalid(root, cases)


def _megatron(root: Path, cases: Cases) -> None:
    fx = "valid/layout_megatron"
    full = megatron_state()
    save_layout(Fx(root, fx), MEGATRON, "pp=2 tp=2", full, extra={"iteration": 7})
    cases.add(
        "a step saved by 4 ranks (pp=2 tp=2) under a Megatron-style layout validates",
        S_CHECKS,
        fx,
        "validate",
        verdict="valid",
        may_fail_with=LEVEL0,
    )
    cases.add(
        "it opens with the logical tensors (global layer numbers)",
        S_RENUMBER,
        fx,
        "open",
        verdict="valid",
        keys=sorted(full),
        may_fail_with=LEVEL0,
    )
    fused = {n: t for n, t in full.items() if ".qkv." in n or ".fc1." in n}
    cases.reads(
        S_FUSED,
        fx,
        fused,
        may_fail_with=LEVEL0,
        boxes={
            "model/layers.2.qkv.weight": [[[7, 11], [1, 3]], [[8, 12], [0, 4]]],
            "model/layers.1.fc1.weight": [[[2, 5], [0, 4]]],
        },
        what=lambda n: ": fused parts gathered from the blocks of both TP ranks",
    )
    cases.reads(
        S_SHARD,
        fx,
        {n: t for n, t in full.items() if ".fc2." in n},
        boxes={"model/layers.0.fc2.weight": [[[1, 3], [1, 3]]]},
        what=lambda n: ": a column split, stored as the plain logical tensor",
    )
    cases.reads(
        S_PAD,
        fx,
        {n: full[n] for n in ("model/embed.weight", "model/output.weight")},
        boxes={"model/embed.weight": [[[7, 10], [0, 4]]]},
        what=lambda n: ": the vocabulary without its padding rows",
    )
    cases.reads(
        S_PLAIN,
        fx,
        {"model/norm.weight": full["model/norm.weight"]},
        what=lambda n: ": replicated on the last stage",
    )


def _zero(root: Path, cases: Cases) -> None:
    fx = "valid/layout_zero"
    full = zero_state()
    save_layout(
        Fx(root, fx), ZERO, "dp=2 tp=2", full, adjust=split_partial("grad_acc/b", full["grad_acc/b"], 2)
    )
    cases.add(
        "a step saved by 4 ranks (dp=2 tp=2) with flat ZeRO fragments, partial sums and nested "
        "shards validates",
        S_CHECKS,
        fx,
        "validate",
        verdict="valid",
        may_fail_with=LEVEL0,
    )
    cases.add(
        "it opens with the logical tensors (flat members, not buffers)",
        S_FLAT,
        fx,
        "open",
        verdict="valid",
        keys=sorted(full),
        may_fail_with=LEVEL0,
    )
    opt = {n: t for n, t in full.items() if n.startswith("opt/")}
    cases.reads(
        S_FLAT,
        fx,
        opt,
        may_fail_with=LEVEL0,
        boxes={"opt/a/exp_avg": [[[1, 3], [1, 4]], [[0, 3], [2, 3]]], "opt/c/exp_avg_sq": [[[0, 1], [2, 5]]]},
        what=lambda n: ": flat fragments of two TP arrays, read as row runs of each view",
    )
    cases.reads(
        S_NESTED,
        fx,
        {"model/nested": full["model/nested"]},
        may_fail_with=LEVEL0,
        boxes={"model/nested": [[[4, 9], [0, 2]], [[9, 10], [1, 2]]]},
        what=lambda n: ": an uneven nested split, stored blocked",
    )
    cases.reads(
        S_PARTIAL,
        fx,
        {"grad_acc/b": full["grad_acc/b"]},
        may_fail_with=LEVEL0,
        boxes={"grad_acc/b": [[[2, 5]]]},
        what=lambda n: ": the sum of 2 stored contributions",
    )
    cases.reads(
        S_SHARD,
        fx,
        {"model/col.weight": full["model/col.weight"]},
        boxes={"model/col.weight": [[[0, 3], [2, 4]]]},
        what=lambda n: ": a column split",
    )


def _distopt(root: Path, cases: Cases) -> None:
    fx = "valid/layout_distopt"
    full = distopt_state()
    save_layout(Fx(root, fx), DISTOPT, "dp=3", full)
    cases.add(
        "a step saved by 3 ranks (dp=3) with Megatron-style distributed-optimizer buckets (members aligned "
        "to 64, bucket ends padded to lcm(dp, 128) = 384, layout version 3) validates",
        S_FLAT,
        fx,
        "validate",
        verdict="valid",
        may_fail_with=LEVEL0,
    )
    cases.reads(
        S_FLAT,
        fx,
        {n: t for n, t in full.items() if n.startswith("opt/")},
        may_fail_with=LEVEL0,
        boxes={"opt/w/exp_avg": [[[2, 3], [20, 25]]], "opt/e/exp_avg": [[[3, 6], [50, 60]]]},
        what=lambda n: ": a member that spans two ranks' partitions, after a 64-aligned gap",
    )


# -- invalid: one lie each ---------------------------------------------------------------------------
SMALL_RULES = {
    "w": '"w": shard(0, dp), shard(0, tp)\n',
    "g": '"g": partial(tp)\n',
    "opt/a/m": (
        '"opt/*/m": shard(1, tp)\n'
        'flat "flat/{state}" -> "opt/{member}/{state}" over dp: [\n  "a" [3, 4],\n]\n'
    ),
}


def small_state() -> dict[str, torch.Tensor]:
    return {"w": dyadic((10, 2), 2200), "g": dyadic((3,), 2201), "opt/a/m": dyadic((3, 4), 2202)}


def small(root: Path, rel: str, parts: str = "w") -> tuple[Fx, dict[str, torch.Tensor]]:
    """A step saved by 4 ranks (dp=2 tp=2) of the tensors ``parts`` (comma-separated) of
    ``small_state``: ``w`` a nested uneven split (blocked, §7.2), ``g`` a partial sum over tp, ``opt/a/m``
    a member of flat buffers over dp whose column halves are in two arrays (§7.6)."""
    f = Fx(root, rel)
    st = {n: t for n, t in small_state().items() if n in parts.split(",")}
    text = "ucl-layout 1\nmesh dp=2 tp=2\n" + "".join(SMALL_RULES[n] for n in st)

    def adjust(states: list[dict[str, torch.Tensor]]) -> None:  # g: contribution k is at tp = k
        if "g" in st:
            for r, s in enumerate(states):
                s["g"] = st["g"] * 0.5 if r % 2 == 0 else st["g"] - st["g"] * 0.5

    save_layout(f, text, "dp=2 tp=2", st, adjust=adjust)
    return f, st


def _invalid(root: Path, cases: Cases) -> None:
    def defect(name: str, what: str, code: str, section: str, edit: Callable[[Fx], None], read: str) -> None:
        fx = f"invalid/layout/{name}"
        f, _ = small(root, fx, read)
        edit(f)
        cases.invalid(what, section, fx, code)
        cases.error(f"{what}: the step does not open", section, fx, "open", code, {"step": 1})
        cases.broken_read(fx, read, code, f"fails: {what}", section=section)

    def arr(key: str, fn: Callable[[dict[str, Any]], Any]) -> Callable[[Fx], None]:
        return lambda f: f.edit_array(1, key, lambda d: fn(d["attributes"]["ucl"]["logical"]))

    def map_of(key: str, i: int, fn: Callable[[dict[str, Any]], Any]) -> Callable[[Fx], None]:
        return arr(key, lambda r: fn(r["maps"][i]))

    # schema: caught when the array document is parsed (validator and reader alike)
    defect(
        "record_unknown_field",
        "a logical record with a field the schema does not list",
        "schema_violation",
        S_RECORD,
        arr("w", lambda r: r.__setitem__("order", "C")),
        "w",
    )
    defect(
        "record_map_without_at",
        "a map without its 'at'",
        "schema_violation",
        S_RECORD,
        map_of("w", 0, lambda m: m.pop("at")),
        "w",
    )
    # §6.6: the rules a schema cannot express
    defect(
        "record_dtype_differs",
        "a record that gives its tensor another dtype than the array's",
        "inconsistent_metadata",
        S_CHECKS,
        arr("w", lambda r: r["tensors"]["w"].__setitem__("dtype", "float16")),
        "w",
    )
    defect(
        "map_of_unlisted_tensor",
        "a map of a tensor its record does not list",
        "inconsistent_metadata",
        S_CHECKS,
        map_of("w", 1, lambda m: m.__setitem__("tensor", "v")),
        "w",
    )
    defect(
        "map_box_outside_tensor",
        "a map whose box lies outside its tensor",
        "inconsistent_metadata",
        S_CHECKS,
        map_of("w", 3, lambda m: m["box"][0].__setitem__(0, 9)),
        "w",
    )
    defect(
        "map_rank_differs",
        "a map whose box has another rank than its tensor",
        "inconsistent_metadata",
        S_CHECKS,
        map_of("w", 0, lambda m: (m["box"][0].append(0), m["box"][1].append(1))),
        "w",
    )
    defect(
        "map_past_array",
        "a map stored past the end of its array",
        "inconsistent_metadata",
        S_CHECKS,
        map_of("w", 3, lambda m: m["at"].__setitem__(0, 11)),
        "w",
    )
    defect(
        "view_past_array",
        "a flat map whose view runs past its 1-D array",
        "inconsistent_metadata",
        S_CHECKS,
        map_of("flat/m.tp1", 0, lambda m: m["view"].__setitem__("offset", 10)),
        "opt/a/m",
    )
    defect(
        "partial_count_differs",
        "a partial record whose count differs from the leading dimension",
        "inconsistent_metadata",
        S_CHECKS,
        arr("g", lambda r: r["partial"].__setitem__("count", 3)),
        "g",
    )
    defect(
        "records_disagree_on_shape",
        "two arrays that give one tensor different shapes",
        "inconsistent_metadata",
        S_CHECKS,
        arr("flat/m.tp1", lambda r: r["tensors"]["opt/a/m"].__setitem__("shape", [3, 5])),
        "opt/a/m",
    )
    defect(
        "maps_leave_a_gap",
        "maps that leave elements of their tensor without a map",
        "inconsistent_metadata",
        S_CHECKS,
        arr("w", lambda r: r["maps"].pop(2)),
        "w",
    )
    defect(
        "maps_overlap",
        "two maps that hold the same elements of their tensor",
        "inconsistent_metadata",
        S_CHECKS,
        map_of(
            "w",
            1,
            lambda m: (
                m["box"][0].__setitem__(0, 2),
                m["box"][1].__setitem__(0, 3),
                m["at"].__setitem__(0, 3),
            ),
        ),
        "w",
    )

    # §6.5: a chunk that holds data and is not written
    fx = "invalid/layout/chunk_holding_data_missing"
    f, _ = small(root, fx, "w")
    f.p("steps/1/w/c/3/0").unlink()
    f.edit_commit(1, lambda d: d["files"].pop("w/c/3/0"))
    cases.invalid("a chunk that holds data (§6.5) is not in the commit record", S_WRITES, fx, "missing_shard")
    cases.broken_read(
        fx,
        "w",
        "missing_shard",
        "fails: the chunk holding rows 8-9 is not in the commit record",
        section=S_WRITES,
        box=[[8, 10], [0, 2]],
    )

    # §6.8: the step's layout and mesh (a validator checks them; reading logical tensors does not need them)
    def step_layout(name: str, what: str, code: str, fn: Callable[[dict[str, Any]], Any]) -> None:
        fx = f"invalid/layout/{name}"
        f, st = small(root, fx, "w,g")
        f.edit_step_doc(1, lambda d: fn(d["attributes"]["ucl"]))
        cases.invalid(what, S_STEP_LAYOUT, fx, code)
        cases.add(
            f"{what}: the logical tensors read from the records, or the reader refuses the step",
            S_STEP_LAYOUT,
            fx,
            "read",
            {"tensor": "w"},
            verdict="valid",
            data_sha256=sha(st["w"]),
            shape=list(st["w"].shape),
            may_fail_with=[code],
        )

    step_layout(
        "layout_version_4",
        "a step layout of ucl_layout version 4 (versions 1 to 3 are defined)",
        "invalid_layout",
        lambda u: u["layout"].__setitem__("ucl_layout", 4),
    )
    step_layout(
        "layout_unknown_field",
        "a step layout with a field the schema does not list",
        "invalid_layout",
        lambda u: u["layout"].__setitem__("order", "C"),
    )
    step_layout(
        "mesh_differs_from_declared",
        "a step mesh that differs from the mesh its layout declares",
        "mesh_mismatch",
        lambda u: u["mesh"].__setitem__("axes", [["dp", 1], ["tp", 4]]),
    )
    step_layout(
        "mesh_lacks_axis",
        "a step mesh without an axis its layout names",
        "mesh_mismatch",
        lambda u: (u["layout"].pop("mesh"), u["mesh"].__setitem__("axes", [["tp", 4]])),
    )
