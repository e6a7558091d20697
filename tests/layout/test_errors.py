"""Bad layouts fail with clear errors before any byte is written; messages are pinned here."""

from __future__ import annotations

import pytest
import torch

from ucl import errors
from ucl.layout import Layout, Mesh, check_mesh, parse_layout
from ucl.layout.builtins import zero_flat
from ucl.plan.layout_load import plan_load
from ucl.plan.layout_save import merge_plans, plan_save

from .helpers import local_shapes, make_full, save


def L(text: str) -> Layout:
    return parse_layout("ucl-layout 1\n" + text)


def raises(cls, message):
    return pytest.raises(cls, match="^" + __import__("re").escape(message) + "$")


def test_codes_are_stable_and_all_layout_errors():
    codes = {
        errors.LayoutSyntaxError: "layout_syntax",
        errors.InvalidLayoutError: "invalid_layout",
        errors.MeshMismatchError: "mesh_mismatch",
        errors.UnmatchedPatternError: "pattern_unmatched",
        errors.OverlappingRulesError: "rules_overlap",
        errors.LayoutShapeError: "layout_shape_mismatch",
    }
    for cls, code in codes.items():
        assert cls.code == code and issubclass(cls, errors.LayoutError) and issubclass(cls, ValueError)


def test_a_pattern_matching_nothing():
    layout = L('"model/*.weight": shard(0, tp)\n"model/nothing.*": shard(1, tp)\n')
    full = make_full({"model/a.weight": ((4, 2), "float32")})
    with raises(errors.UnmatchedPatternError, "rule 2 ('model/nothing.*') matches no tensor"):
        save(full, Mesh.of(tp=2), layout)
    _, _, arrays, _ = save(full, Mesh.of(tp=2), L('"model/*.weight": shard(0, tp)\n'))
    with raises(errors.UnmatchedPatternError, "rule 2 ('model/nothing.*') matches no tensor"):
        plan_load(arrays, layout, Mesh.of(tp=2), 0)
    with raises(errors.UnmatchedPatternError, "renumber 1 ('layers.{i}.**') matches no tensor"):
        plan_load(arrays, L('renumber "layers.{i}.**" over tp: 4\n'), Mesh.of(tp=2), 0)


def test_overlapping_rules():
    layout = L('"a.*": shard(0, tp)\n"*.w": replicate\n')
    with raises(
        errors.OverlappingRulesError,
        "tensor 'a.w' matches rule 1 ('a.*') and rule 2 ('*.w'); rules must not overlap",
    ):
        plan_save(layout, Mesh.of(tp=2), 0, {"a.w": ((2,), "float32")})


def test_shapes_not_dividing_as_declared():
    layout, mesh = L('"w": shard(0, tp)\n'), Mesh.of(tp=4)
    with raises(
        errors.LayoutShapeError,
        "tensor 'w' on tp=0 has local shape [3, 4]; the layout gives [2, 4] for logical shape [5, 4]",
    ):
        plan_save(layout, mesh, 0, {"w": ((3, 4), "float32")}, shapes={"w": (5, 4)})
    with raises(
        errors.LayoutShapeError,
        "tensor 'w' on tp=0 has local shape [3, 4]; the layout gives [2, 4] for logical shape [5, 4]",
    ):
        plan_save(L('"w": size(0, 5), shard(0, tp)\n'), mesh, 0, {"w": ((3, 4), "float32")})
    with raises(
        errors.LayoutShapeError,
        "tensor 'qkv': dim 0 has 14 elements; the fused parts (q=8, k=2, v=2) sum to 12",
    ):
        plan_save(
            L('"qkv": fused(0, q=4x2, k=1x2, v=1x2), shard(0, tp)\n'),
            mesh,
            0,
            {"qkv": ((3, 4), "float32")},
            shapes={"qkv": (14, 4)},
        )
    with raises(errors.LayoutShapeError, "tensor 'w' has 1 dims; its rule ('w') names dim 1"):
        plan_save(L('"w": shard(1, tp)\n'), mesh, 0, {"w": ((3,), "float32")})
    with raises(
        errors.LayoutShapeError,
        "tensor 'emb': dim 0 is padded, so its local shape does not tell its logical size; declare "
        "size(0, N) in the rule or pass shapes=",
    ):
        plan_save(L('"emb": pad(0, 8), shard(0, tp)\n'), mesh, 0, {"emb": ((2, 4), "float32")})


def test_uneven_split_without_size_fails_in_merge():
    layout, mesh = L('"w": shard(0, tp)\n'), Mesh.of(tp=4)
    # 10 rows: the ranks hold 3, 3, 3, 1. Ranks 0-2 assume 12 rows, rank 3 assumes 4: no rank alone can tell
    plans = [plan_save(layout, mesh, r, {"w": ((3, 4), "float32")}) for r in range(3)]
    assert plans[0].arrays["w"].shape == (12, 4)
    plans.append(plan_save(layout, mesh, 3, {"w": ((1, 4), "float32")}))
    with raises(
        errors.LayoutShapeError,
        "ranks 0 and 3 disagree on array 'w': shape [12, 4] chunks [3, 4] vs shape [4, 4] chunks [1, 4] "
        "(an uneven split without a declared size?)",
    ):
        merge_plans(plans)


def test_mesh_not_matching_world_size_or_layout():
    layout = L('"w": shard(0, tp)\n')
    with raises(errors.MeshMismatchError, "the mesh dp=2 tp=4 has 8 ranks; the world has 4"):
        check_mesh(layout, Mesh.of(dp=2, tp=4), world_size=4)
    with raises(errors.MeshMismatchError, "the layout names axis 'tp', which the mesh dp=2 lacks"):
        plan_save(layout, Mesh.of(dp=2), 0, {"w": ((2,), "float32")})
    with raises(errors.MeshMismatchError, "the layout declares mesh tp=2; got tp=4"):
        plan_save(L("mesh tp=2\n"), Mesh.of(tp=4), 0, {})
    with raises(errors.MeshMismatchError, "renumber 'l.{i}' gives 3 stages; axis 'pp' has size 2"):
        plan_save(L('renumber "l.{i}" over pp: [0, 1, 2, 3]\n'), Mesh.of(pp=2), 0, {})
    with raises(errors.MeshMismatchError, "rank 4 is outside the mesh tp=4 of 4 ranks"):
        plan_save(layout, Mesh.of(tp=4), 4, {})


def test_stage_and_placement_errors():
    layout = L('renumber "l.{i}.w" over pp: 4\n"emb": replicate on pp=0\n')
    with raises(
        errors.LayoutShapeError,
        "local tensor 'l.2.w' on pp=1 has index 2; stage 1 holds 2 (global 2..3) by renumber 1",
    ):
        plan_save(layout, Mesh.of(pp=2), 1, {"l.2.w": ((2,), "float32")})
    with raises(errors.LayoutShapeError, "rank at pp=1 holds 'emb', which rule 1 places on pp=0"):
        plan_save(layout, Mesh.of(pp=2), 1, {"emb": ((2,), "float32")})


def test_flat_buffer_errors():
    layout = zero_flat([("a", (3, 2)), ("b", (4,))], buffer="flat/{state}", logical="opt/{member}/{state}")
    with raises(
        errors.LayoutShapeError,
        "flat buffer 'flat/m' on dp=0 has shape [6]; the layout gives [5] (members total 10 elements "
        "over 2 ranks, align 1)",
    ):
        plan_save(layout, Mesh.of(dp=2), 0, {"flat/m": ((6,), "float32")})
    full = make_full({"opt/a/m": ((3, 2), "float32")})
    _, _, arrays, _ = save(full, Mesh.of(dp=1), Layout())
    with raises(errors.UnmatchedPatternError, "flat 'flat/{state}': member 'opt/b/m' matches no tensor"):
        plan_load(arrays, layout, Mesh.of(dp=2), 0)
    shard = L('"opt/*/*": shard(0, dp)\n').merged(layout)
    with raises(
        errors.LayoutShapeError, "flat 'flat/{state}': member 'opt/a/m' splits over flat axis 'dp' (rule 1)"
    ):
        plan_save(shard, Mesh.of(dp=2), 0, {"flat/m": ((5,), "float32")})


def test_merge_needs_every_rank_once():
    layout, mesh = L('"w": shard(0, tp)\n'), Mesh.of(tp=2)
    plan = plan_save(layout, mesh, 0, {"w": ((2,), "float32")})
    with raises(errors.MeshMismatchError, "merge_plans got plans of ranks [0]; the mesh tp=2 has 2"):
        merge_plans([plan])
    other = plan_save(L('"w": shard(0, tp)\n"v": replicate\n'), mesh, 1, {"w": ((2,), "float32")})
    with raises(errors.InvalidLayoutError, "rank 1 planned with another layout or mesh than rank 0"):
        merge_plans([plan, other])


def test_a_rank_missing_a_tensor_leaves_a_chunk_unwritten():
    layout, mesh = L('"w": shard(0, tp)\n'), Mesh.of(tp=2)
    plans = [plan_save(layout, mesh, 0, {"w": ((2,), "float32")}), plan_save(layout, mesh, 1, {})]
    with raises(
        errors.LayoutShapeError,
        "chunk [1] of 'w' holds data but no rank writes it (a rank did not pass the tensor?)",
    ):
        merge_plans(plans)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"a" shard(0, tp)', "line 2, column 5: expected ':', found 'shard'"),
        ('"a": shard(0 tp)', "line 2, column 14: expected ',', found 'tp'"),
        (
            '"a": spread(0, tp)',
            "line 2, column 6: expected a transform (replicate, shard, fused, grouped, pad, size, partial), "
            "found 'spread'",
        ),
        ("mesh tp=2\nmesh dp=2", "line 3, column 1: expected one mesh statement at most, found 'mesh'"),
        ('"a": shard(0, tp) on', "line 2, column 21: expected a placement, like pp=0, found end of line"),
        ('"a": fused(0, q=4x)', "line 2, column 18: expected ')', found 'x'"),
        ("$", "line 2, column 1: unexpected character '$'"),
        ('"unterminated', "line 2, column 1: unexpected character '\"'"),
    ],
)
def test_syntax_errors_say_where(text, message):
    with raises(errors.LayoutSyntaxError, message):
        L(text)


def test_header_is_required():
    with raises(
        errors.LayoutSyntaxError, "line 1, column 1: expected 'ucl-layout 1' on the first line, found 'mesh'"
    ):
        parse_layout("mesh tp=2\n")
    msg = "line 1, column 12: layout version 4; this implementation reads 1, 2, 3"
    with raises(errors.LayoutSyntaxError, msg):
        parse_layout("ucl-layout 4\n")
    assert parse_layout("ucl-layout 2\n").version == 2  # a version 2 document need not use grouped
    with raises(errors.InvalidLayoutError, "line 1, column 1: grouped (spec/layout.md §7.10) needs layout version 2; "
                "this layout declares version 1"):
        parse_layout('ucl-layout 1\n"w": grouped(0, 2, q=4, k=2, v=2)\n')
    with raises(errors.InvalidLayoutError,
                "line 2, column 1: grouped part 'k' has 3 units, not a multiple of its 2 groups"):
        parse_layout('ucl-layout 2\n"w": grouped(0, 2, q=4, k=3, v=2)\n')


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '"a": shard(0, tp), shard(1, tp)',
            "line 2, column 1: rule 'a': axis 'tp' is used twice; each axis splits or reduces at most once",
        ),
        (
            '"a": shard(0, tp), pad(0, 8)',
            "line 2, column 1: rule 'a': pad(0, ...) must come before shard(0, ...)",
        ),
        ('"a": replicate, shard(0, tp)', "line 2, column 1: rule 'a': replicate stands alone"),
        (
            '"a": shard(0, tp) on tp=0',
            "line 2, column 1: rule 'a': axis 'tp' both places and splits the tensor",
        ),
        (
            '"a{": replicate',
            "line 2, column 1: pattern 'a{': '{' must open a capture {name} (use \\{ for a brace)",
        ),
        (
            'renumber "l.*" over pp: 4',
            "line 2, column 1: renumber pattern 'l.*' must capture exactly one index, like layers.{i}.**",
        ),
        (
            'renumber "l.{i}" over pp: [0, 3, 2]',
            "line 2, column 1: renumber bounds must start at 0 and not decrease, got [0, 3, 2]",
        ),
        (
            'flat "f" -> "o/{member}/{state}" over dp: ["a" [2]]',
            "line 2, column 1: flat template 'o/{member}/{state}' must name exactly ['member']",
        ),
    ],
)
def test_invalid_layouts(text, message):
    with raises(errors.InvalidLayoutError, message):
        L(text)


def test_json_form_refuses_unknown_fields():
    with raises(errors.InvalidLayoutError, "layout has unknown fields ['extra']"):
        Layout.from_dict({"ucl_layout": 1, "extra": 1})
    with raises(errors.InvalidLayoutError, "layout version 4; this implementation reads versions 1, 2, 3"):
        Layout.from_dict({"ucl_layout": 4})
    with raises(errors.InvalidLayoutError, "layout version True; this implementation reads versions 1, 2, 3"):
        Layout.from_dict({"ucl_layout": True})
    with raises(
        errors.InvalidLayoutError,
        "unknown transform 'spread' (known: replicate, shard, fused, grouped, pad, size, partial)",
    ):
        Layout.from_dict({"ucl_layout": 1, "rules": [{"patterns": ["a"], "transforms": [{"op": "spread"}]}]})


def test_errors_come_before_any_write():
    """plan_save raises on the rank whose tensors do not fit, so the core fails the save before writing."""
    layout, mesh = L('"w": shard(0, tp)\n'), Mesh.of(tp=2)
    with pytest.raises(errors.LayoutError):
        plan_save(layout, mesh, 1, local_shapes({"w": torch.zeros(3, 4)}), shapes={"w": (4, 4)})
