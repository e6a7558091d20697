"""The text and JSON forms: round trips, the schema, and the spec's examples."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from referencing import Registry, Resource

from ucl.layout import Layout, Mesh, format_layout, parse_layout, parse_mesh
from ucl.layout.builtins import megatron_gpt, zero_flat
from ucl.layout.patterns import ends, escape, match
from ucl.testing.layout_strategies import layouts

from .helpers import examples, make_full, save

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "spec" / "schemas"


def _validator(pointer: str = "") -> jsonschema.Draft202012Validator:
    resources = []
    for p in SCHEMAS.glob("*.schema.json"):
        doc = json.loads(p.read_text())
        resources += [(doc["$id"], Resource.from_contents(doc)), (p.name, Resource.from_contents(doc))]
    schema = {"$ref": "layout.schema.json" + (f"#{pointer}" if pointer else "")}
    return jsonschema.Draft202012Validator(schema, registry=Registry().with_resources(resources))


LAYOUT = _validator()
RECORD = _validator("/$defs/logical_record")


@settings(max_examples=examples(60), deadline=None)
@given(layout=layouts())
def test_text_and_json_round_trip(layout):
    text = format_layout(layout)
    assert parse_layout(text) == layout
    assert format_layout(parse_layout(text)) == text
    d = layout.to_dict()
    assert Layout.from_dict(json.loads(json.dumps(d))) == layout
    LAYOUT.validate(d)


def test_comments_blank_lines_and_continuations():
    text = """
    # a layout
    ucl-layout 1   # the header

    mesh dp=2 tp=2
    "a", "b":    shard(0,
                       tp)   # newlines inside parentheses continue the statement
    """
    layout = parse_layout(text.replace("\n    ", "\n"))
    assert layout.mesh == Mesh.of(dp=2, tp=2) and layout.rules[0].patterns == ("a", "b")
    assert format_layout(layout) == 'ucl-layout 1\nmesh dp=2 tp=2\n"a", "b": shard(0, tp)\n'


def test_mesh_text_and_coordinates():
    mesh = parse_mesh("pp=2 dp=2 tp=4")
    assert mesh.to_text() == "pp=2 dp=2 tp=4" and mesh.size == 16
    assert [mesh.coords(r) for r in (0, 1, 4, 15)] == [
        {"pp": 0, "dp": 0, "tp": 0},
        {"pp": 0, "dp": 0, "tp": 1},
        {"pp": 0, "dp": 1, "tp": 0},
        {"pp": 1, "dp": 1, "tp": 3},
    ]
    assert all(mesh.rank(mesh.coords(r)) == r for r in range(16))
    assert Mesh.from_dict(mesh.to_dict()) == mesh and parse_mesh("") == Mesh(()) and Mesh(()).size == 1


def test_patterns():
    assert match("model/layers.{i}.**", "model/layers.12.attn.w") == {"i": "12"}
    assert match("**layers.{i}.**", "a/layers.1.b.layers.2.c") == {"i": "1"}  # shortest, left to right
    assert match("*.w", "a/b.w") is None and match("**.w", "a/b.w") == {}
    assert match(escape("we*ird{name}"), "we*ird{name}") == {}
    assert match(escape("we*ird{name}"), "weXird{name}") is None


def test_schema_examples_validate():
    schema = json.loads((SCHEMAS / "layout.schema.json").read_text())
    checked = 0

    def walk(node, pointer):
        nonlocal checked
        if isinstance(node, dict):
            for ex in node.get("examples", []):
                _validator(pointer).validate(ex)
                checked += 1
            for k, v in node.items():
                if k != "examples":
                    walk(v, f"{pointer}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{pointer}/{i}")

    walk(schema, "")
    assert checked >= 30
    for ex in schema["examples"]:
        Layout.from_dict(ex)


def test_records_of_saved_arrays_match_the_schema():
    cfg = dict(num_layers=2, num_heads=4, num_kv_heads=2, hidden=8, ffn_hidden=12, vocab_size=30)
    from ucl.layout.builtins import megatron_gpt_params

    full = make_full({f"optim/state/{n}/m": (s, "float32") for n, s in megatron_gpt_params(**cfg)})
    mesh = Mesh.of(pp=2, dp=2, tp=2)
    _, plans, arrays, _ = save(full, mesh, megatron_gpt(**cfg, zero=mesh))
    assert any(a.logical for a in arrays.values())
    for a in arrays.values():
        RECORD.validate(a.logical)
    LAYOUT.validate(plans[0].layout_json)
    json.dumps(plans[0].to_dict())


def _spec_blocks(lang):
    text = (ROOT / "spec" / "layout.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@pytest.mark.parametrize("block", _spec_blocks("ucl"))
def test_spec_examples_parse_and_round_trip(block):
    layout = parse_layout(block)
    assert parse_layout(format_layout(layout)) == layout
    LAYOUT.validate(layout.to_dict())


@pytest.mark.parametrize("block", _spec_blocks("json"))
def test_spec_json_examples_are_layouts_or_records(block):
    doc = json.loads(block)
    if "ucl_layout" in doc:
        LAYOUT.validate(doc)
        Layout.from_dict(doc)
    else:
        RECORD.validate(doc)


def test_builtins_round_trip():
    for layout in (
        megatron_gpt(
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            hidden=16,
            ffn_hidden=32,
            vocab_size=100,
            bias=True,
            tied=True,
            pp_bounds=(0, 1, 4),
        ),
        zero_flat([("a", (2, 3))], align=64),
    ):
        assert parse_layout(format_layout(layout)) == layout
        LAYOUT.validate(layout.to_dict())


_PATTERN_PARTS = st.sampled_from(["a", "b", ".", "/", "*", "**", "{x}", "{y}", "\\*", "\\{", "\\\\", "ab.c"])


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(_PATTERN_PARTS, min_size=1, max_size=6), st.text(alphabet="ab./*{}\\c", max_size=12))
def test_a_pattern_matches_only_names_with_its_literal_ends(parts, name):
    """patterns.ends is the resolver's prefilter before the match (ucl.layout.resolve.Resolver.rule_for): a
    name the pattern matches starts with its head and ends with its tail, so the filter drops no match."""
    pattern = "".join(parts)
    if "{x}" in pattern.replace("{x}", "", 1) or "{y}" in pattern.replace("{y}", "", 1):
        return  # a capture named twice is a malformed pattern
    head, tail = ends(pattern)
    for candidate in (name, head + name + tail, head + tail, head + "a" + tail):
        if match(pattern, candidate) is not None:
            assert candidate.startswith(head) and candidate.endswith(tail), (pattern, candidate, head, tail)
