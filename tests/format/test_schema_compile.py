"""The compiled schema predicates (ucl.format.schema_compile) agree with jsonschema, the reference: on
every JSON document of the conformance fixtures, against every schema, and on mutations of them. The
predicate may never accept what jsonschema refuses (that would drop a check)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.format import metadata

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ["array", "commit", "common", "delta", "layout", "repository", "step"]


def _documents() -> list[object]:
    docs = []
    for p in sorted((ROOT / "conformance" / "fixtures").rglob("*.json")):
        if p.stat().st_size > 1 << 20:
            continue
        try:
            doc = json.loads(p.read_bytes())
        except (ValueError, UnicodeDecodeError, RecursionError):  # fixtures of malformed JSON
            continue
        docs.append(doc)
        if isinstance(doc, dict):  # the arrays of a step document's consolidated metadata, one by one
            meta = doc.get("consolidated_metadata", {})
            if isinstance(meta, dict) and isinstance(meta.get("metadata"), dict):
                docs.extend(meta["metadata"].values())
    return docs


DOCS = _documents()


def _reference(schema: str, doc: object) -> bool:
    return next(iter(metadata._validator(schema).iter_errors(doc)), None) is None


def _mutations(doc: object, rng: random.Random, n: int) -> list[object]:
    """Small edits a hostile or buggy writer makes: a key dropped, a value replaced by another type, an
    integer spelled as a float, a list shortened or grown."""
    paths: list[list[object]] = []

    def walk(x: object, path: list[object]) -> None:
        paths.append(path)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, [*path, k])
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, [*path, i])

    walk(doc, [])
    out = []
    replacements: list[object] = [None, True, 0, -1, 4.0, 2**62, "", "x", [], {}, [1, 2], {"a": 1}]
    for _ in range(n):
        d = copy.deepcopy(doc)
        path = rng.choice(paths)
        if not path:
            continue
        parent = d
        for p in path[:-1]:
            parent = parent[p]  # type: ignore[index]
        key = path[-1]
        op = rng.randrange(4)
        if op == 0 and isinstance(parent, dict):
            del parent[key]
        elif op == 1 and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))  # type: ignore[index]
        elif op == 2 and type(parent[key]) is int:  # type: ignore[index]
            parent[key] = float(parent[key])  # type: ignore[index]
        else:
            parent[key] = rng.choice(replacements)  # type: ignore[index]
        out.append(d)
    return out


def test_fixtures_are_many() -> None:
    assert len(DOCS) > 200


@pytest.mark.parametrize("schema", SCHEMAS)
def test_compiled_agrees_with_jsonschema_on_fixtures(schema: str) -> None:
    fast = metadata._compiled(schema)
    for doc in DOCS:
        assert fast(doc) == _reference(schema, doc), (schema, json.dumps(doc)[:300])


@pytest.mark.parametrize("schema", ["array", "commit", "step", "repository"])
def test_compiled_agrees_with_jsonschema_on_mutations(schema: str) -> None:
    rng = random.Random(schema)
    fast = metadata._compiled(schema)
    valid = [d for d in DOCS if _reference(schema, d)]
    assert valid
    checked = 0
    for doc in rng.sample(valid, min(len(valid), 60)):
        for m in _mutations(doc, rng, 15):
            assert fast(m) == _reference(schema, m), (schema, json.dumps(m)[:300])
            checked += 1
    assert checked > 100


def test_logical_record_predicate_agrees() -> None:
    fast = metadata._compiled("layout", "/$defs/logical_record")
    ref = metadata._logical_validator()
    recs = [d["attributes"]["ucl"]["logical"] for d in DOCS if isinstance(d, dict)
            and isinstance(d.get("attributes"), dict) and isinstance(d["attributes"].get("ucl"), dict)
            and "logical" in d["attributes"]["ucl"]]
    assert recs
    rng = random.Random(0)
    for rec in recs:
        for m in [rec, *_mutations(rec, rng, 10)]:
            assert fast(m) == (next(iter(ref.iter_errors(m)), None) is None)


def test_a_violation_still_names_its_place() -> None:
    doc = next(d for d in DOCS if _reference("array", d))
    bad = copy.deepcopy(doc)
    bad["shape"] = [4.0] * len(bad["shape"]) or [4.0]
    with pytest.raises(metadata.SchemaError, match="shape"):
        metadata.check_schema(bad, "array", "w/zarr.json")


# -- every keyword the compiler knows, on schemas and documents drawn at random -----------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from([0.0, 1.0, 2.5, -1.0])
    | st.sampled_from(["", "a", "ab", "b1", "zz"]),
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.sampled_from(["a", "b", "c", "x1"]), kids, max_size=4),
    max_leaves=10)
_types = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null"])


def _schemas(depth: int = 3) -> st.SearchStrategy[object]:
    sub = st.booleans() | (_schemas(depth - 1) if depth else st.fixed_dictionaries({"type": _types}))
    key = st.sampled_from(["a", "b", "c", "x1"])
    by_keyword: dict[str, st.SearchStrategy[object]] = {
        "type": _types | st.lists(_types, min_size=1, max_size=3, unique=True),
        "const": json_values,
        "enum": st.lists(json_values, min_size=1, max_size=3),
        "properties": st.dictionaries(key, sub, max_size=3),
        "patternProperties": st.dictionaries(st.sampled_from(["^a", "1$", "[bc]"]), sub, max_size=2),
        "additionalProperties": sub,
        "required": st.lists(key, max_size=3, unique=True),
        "propertyNames": st.fixed_dictionaries({"maxLength": st.integers(0, 2)}),
        "minProperties": st.integers(0, 3),
        "maxProperties": st.integers(0, 3),
        "dependentRequired": st.dictionaries(key, st.lists(key, max_size=2, unique=True), max_size=2),
        "items": sub,
        "prefixItems": st.lists(sub, min_size=1, max_size=2),
        "minItems": st.integers(0, 3),
        "maxItems": st.integers(0, 3),
        "uniqueItems": st.booleans(),
        **{k: st.integers(-2, 2) | st.sampled_from([0.5, -1.5])
           for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")},
        "minLength": st.integers(0, 2),
        "maxLength": st.integers(0, 2),
        "pattern": st.sampled_from(["^a", "b", "[0-9]"]),
        **{k: st.lists(sub, min_size=1, max_size=3) for k in ("allOf", "anyOf", "oneOf")},
        **{k: sub for k in ("not", "if", "then", "else")},
    }
    # keywords drawn uniformly (st.one_of would draw its last branches rarely)
    keyword = st.sampled_from(sorted(by_keyword)).flatmap(lambda k: st.tuples(st.just(k), by_keyword[k]))
    return st.lists(keyword, max_size=5).map(dict)


# every scalar the schemas' bounds and patterns can meet, checked beside the drawn documents
_SCALARS: list[object] = [None, True, False, -3, -2, -1, 0, 1, 2, 3, 0.5, -1.5, 2.5, 1.0,
                          "", "a", "ab", "b1", [], {}]


def _strict_validator(schema: object) -> object:
    import jsonschema

    strict = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=(
        jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", lambda _, x: type(x) is int)))
    return strict(schema)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schemas(), st.lists(json_values, min_size=1, max_size=8))
def test_compiled_agrees_with_jsonschema_on_any_schema(schema: object, docs: list[object]) -> None:
    from ucl.format.schema_compile import Compiler

    fast = Compiler({"s.json": schema}).compile("s.json")  # type: ignore[dict-item]
    ref = _strict_validator(schema)
    for doc in [*docs, *_SCALARS]:
        assert fast(doc) == ref.is_valid(doc), (schema, doc)  # type: ignore[attr-defined]


def test_deep_schemas_compile() -> None:
    """A schema nested deeper than one Python function may nest blocks is split into functions."""
    from ucl.format.schema_compile import Compiler

    schema: dict[str, object] = {"type": "integer"}
    doc: object = 1
    for _ in range(40):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        doc = {"a": doc}
    fast = Compiler({"s.json": schema}).compile("s.json")
    assert fast(doc)
    bad = doc
    for _ in range(39):
        bad = bad["a"]  # type: ignore[index]
    bad["a"] = "1"  # type: ignore[index]
    assert not fast(doc)


def test_the_shipped_predicates_are_those_of_the_schemas() -> None:
    """ucl/format/_schemas_compiled.py is what the compiler makes of the schemas as they are (regenerate:
    python -m ucl.format.metadata), and the checks of a read use it."""
    assert metadata.COMPILED_MODULE.read_text() == metadata.compiled_module_source(), (
        "ucl/format/_schemas_compiled.py is stale: run python -m ucl.format.metadata")
    from ucl.format import _schemas_compiled as shipped

    assert metadata._compiled("array") is shipped.ENTRIES[("array.schema.json", "")]
    assert set(shipped.ENTRIES) == {(f"{n}.schema.json", p) for n, p in metadata.SHIPPED_SCHEMAS}


def test_a_stale_shipped_module_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from ucl.format import _schemas_compiled as shipped

    monkeypatch.setattr(shipped, "DIGEST", "0" * 64)
    metadata._shipped.cache_clear()
    metadata._compiled.cache_clear()
    try:
        check = metadata._compiled("array")
        assert check is not shipped.ENTRIES[("array.schema.json", "")]
        doc = next(d for d in DOCS if _reference("array", d))
        assert check(doc)
    finally:
        metadata._shipped.cache_clear()
        metadata._compiled.cache_clear()
