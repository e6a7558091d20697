"""spec/schemas: valid Draft 2020-12, every example valid against the schema it illustrates, every document of
every valid conformance fixture valid against its schema (plain jsonschema, no ucl code)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from numcodecs import Zstd
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = ROOT / "spec" / "schemas"
VALID = ROOT / "conformance" / "fixtures" / "valid"
SCHEMAS = {p.name: json.loads(p.read_text()) for p in sorted(SCHEMA_DIR.glob("*.schema.json"))}
_COMMIT = re.compile(r"^(0|[1-9][0-9]*)\.json$")


def _registry() -> Registry:
    resources = []
    for name, doc in SCHEMAS.items():
        resources += [(doc["$id"], Resource.from_contents(doc)), (name, Resource.from_contents(doc))]
    return Registry().with_resources(resources)


REGISTRY = _registry()


def _validator(schema: Any, base: str) -> jsonschema.Draft202012Validator:
    # a subschema is checked in the context of its document, so that "#/$defs/..." and relative $refs resolve
    if isinstance(schema, dict) and "$id" not in schema:
        schema = {**schema, "$id": base, "$defs": SCHEMAS[base.rsplit("/", 1)[-1]].get("$defs", {})}
    return jsonschema.Draft202012Validator(schema, registry=REGISTRY)


def _with_examples(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if isinstance(node.get("examples"), list):
            yield path or "(root)", node
        for k, v in node.items():
            if k != "examples":
                yield from _with_examples(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _with_examples(v, f"{path}/{i}")


EXAMPLES = [
    (name, where, i, ex, node)
    for name, doc in SCHEMAS.items()
    for where, node in _with_examples(doc)
    for i, ex in enumerate(node["examples"])
]


def test_there_are_schemas_and_examples() -> None:
    assert {
        "array.schema.json",
        "commit.schema.json",
        "step.schema.json",
        "repository.schema.json",
        "common.schema.json",
    } <= set(SCHEMAS)
    assert len(EXAMPLES) > 20


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_is_valid_draft_2020_12(name: str) -> None:
    doc = SCHEMAS[name]
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(doc)
    assert doc.get("title") and doc.get("description"), f"{name} needs a title and a description"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_refs_resolve(name: str) -> None:
    doc = SCHEMAS[name]
    resolver = REGISTRY.resolver(base_uri=doc["$id"])
    for _, node in _walk(doc):
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            resolver.lookup(node["$ref"])  # raises when a $ref points nowhere


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}/{i}")


@pytest.mark.parametrize(
    ("name", "where", "i", "example", "node"), EXAMPLES, ids=[f"{n}:{w}[{i}]" for n, w, i, _, _ in EXAMPLES]
)
def test_example_is_valid(name: str, where: str, i: int, example: Any, node: dict[str, Any]) -> None:
    base = SCHEMAS[name]["$id"]
    schema = {k: v for k, v in node.items() if k != "examples"}
    errors = list(_validator(schema, base).iter_errors(example))
    assert not errors, f"{name} {where} example {i} {example!r}: {errors[0].message}"


# -- documents of the valid fixtures ----------------------------------------------------------------------
def _expanded(doc: dict[str, Any]) -> dict[str, Any]:
    """A version 3 step document with its packed members in place (spec/core.md §5.1), by the text."""
    ucl = doc["attributes"]["ucl"]
    if ucl.get("format_version") != 3 or "packed" not in ucl:
        return doc
    inner = json.loads(bytes(Zstd().decode(base64.b64decode(ucl.pop("packed"), validate=True))))
    ucl.update(inner.get("ucl", {}))
    if "consolidated_metadata" in inner:
        doc["consolidated_metadata"] = inner["consolidated_metadata"]
    return doc


def _documents() -> Iterator[tuple[str, str, Any]]:
    for repo in sorted(p for p in VALID.iterdir() if p.is_dir()):
        yield "repository.schema.json", f"{repo.name}/zarr.json", json.loads((repo / "zarr.json").read_text())
        commits = repo / "commits"
        for c in sorted(commits.iterdir()) if commits.is_dir() else []:
            if _COMMIT.match(c.name):
                yield "commit.schema.json", f"{repo.name}/commits/{c.name}", json.loads(c.read_text())
        steps = repo / "steps"
        for step in sorted(p for p in steps.iterdir() if p.is_dir()) if steps.is_dir() else []:
            # the schema applies to the document as read: a version 3 one expanded (spec/core.md §5.1)
            doc = _expanded(json.loads((step / "zarr.json").read_text()))
            yield "step.schema.json", f"{repo.name}/steps/{step.name}/zarr.json", doc
            for key, node in doc["consolidated_metadata"]["metadata"].items():
                if node.get("node_type") == "array":
                    yield "array.schema.json", f"{repo.name}/steps/{step.name}/zarr.json#{key}", node
            for p in sorted(step.rglob("zarr.json")):
                if p == step / "zarr.json":
                    continue
                node = json.loads(p.read_text())
                if node.get("node_type") == "array":
                    yield "array.schema.json", p.relative_to(VALID).as_posix(), node


DOCUMENTS = list(_documents())


def test_every_valid_fixture_has_documents() -> None:
    repos = {p.name for p in VALID.iterdir() if p.is_dir()}
    assert repos == {w.split("/")[0] for _, w, _ in DOCUMENTS}
    kinds = {s for s, _, _ in DOCUMENTS}
    assert kinds == {"repository.schema.json", "commit.schema.json", "step.schema.json", "array.schema.json"}


@pytest.mark.parametrize(("schema", "where", "doc"), DOCUMENTS, ids=[f"{w}" for _, w, _ in DOCUMENTS])
def test_valid_fixture_document_matches_schema(schema: str, where: str, doc: Any) -> None:
    errors = list(jsonschema.Draft202012Validator(SCHEMAS[schema], registry=REGISTRY).iter_errors(doc))
    assert not errors, f"{where} vs {schema}: {errors[0].message} at {list(errors[0].absolute_path)}"
