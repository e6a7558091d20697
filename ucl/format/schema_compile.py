"""JSON Schemas compiled once into plain Python predicates: the fast path of every schema check.

``jsonschema`` stays the reference (it names the first violation in an error), but it costs ~70 ms to
import, ~80 ms to build the validators and ~0.5 ms per array document: most of an ``ucl.open``. A
compiled predicate answers only "valid or not", as closures over the schema's keywords, so a valid
document (the common case) never touches jsonschema; an invalid one is handed to it for the message.

The predicate may be *stricter* than the reference, never looser: a keyword it does not implement is a
compile-time error, and ``tests/format/test_schema_compile.py`` checks it against jsonschema on every
fixture document and on mutations of them. Semantics are Draft 2020-12 as ``ucl.format.metadata`` applies
it: ``integer`` is an int token only (``4.0`` is not an integer, spec/core.md §3.4); booleans are not
numbers; ``pattern`` is ``re.search`` (what jsonschema does).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[Any], bool]

# keywords that only annotate: no effect on validity
_ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "$defs", "title", "description", "examples", "default"})

_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda x: isinstance(x, dict),
    "array": lambda x: isinstance(x, list),
    "string": lambda x: isinstance(x, str),
    "integer": lambda x: type(x) is int,
    "number": lambda x: type(x) is int or type(x) is float,
    "boolean": lambda x: type(x) is bool,
    "null": lambda x: x is None,
}


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality (jsonschema's): 1 == 1.0, but a boolean equals only a boolean."""
    if type(a) is bool or type(b) is bool:
        return type(a) is type(b) and a == b
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | dict) or isinstance(b, list | dict):
        return False
    return bool(a == b)


def _is_num(x: Any) -> bool:
    return type(x) is int or type(x) is float


class Compiler:
    """Compiles the schemas of one registry (by ``$id`` and by file name) into predicates."""

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]]) -> None:
        self._docs: dict[str, Mapping[str, Any]] = {}
        for name, doc in schemas.items():
            self._docs[name] = doc
            if "$id" in doc:
                self._docs[doc["$id"]] = doc
        self._refs: dict[tuple[str, str], Check] = {}

    def compile(self, name: str, pointer: str = "") -> Check:
        """The predicate of schema ``name`` (a file name or ``$id``), or of its sub-schema at ``pointer``."""
        doc = self._docs[name]
        base = doc.get("$id", name)
        return self._ref(base, pointer)

    # -- references: compiled once each, through a cell so that recursive schemas terminate ----------
    def _ref(self, base: str, pointer: str) -> Check:
        key = (base, pointer)
        if key in self._refs:
            return self._refs[key]
        cell: list[Check] = []
        self._refs[key] = lambda x: cell[0](x)
        node: Any = self._docs[base]
        for part in [p for p in pointer.split("/") if p]:
            node = node[part.replace("~1", "/").replace("~0", "~")]
        check = self._schema(node, base)
        cell.append(check)
        self._refs[key] = check
        return check

    def _resolve(self, ref: str, base: str) -> Check:
        target, _, pointer = ref.partition("#")
        if not target:
            return self._ref(base, pointer)
        if target not in self._docs:  # relative to the base's directory
            target = base.rsplit("/", 1)[0] + "/" + target if "/" in base else target
        if target not in self._docs:
            raise KeyError(f"unresolvable $ref {ref!r} from {base}")
        return self._ref(self._docs[target].get("$id", target), pointer)

    # -- one schema object -> one predicate ------------------------------------------------------------
    def _schema(self, s: Any, base: str) -> Check:
        if s is True:
            return lambda x: True
        if s is False:
            return lambda x: False
        checks: list[Check] = []
        for k, v in s.items():
            if k in _ANNOTATIONS or k in ("then", "else"):
                continue
            checks.append(self._keyword(k, v, s, base))
        if not checks:
            return lambda x: True
        if len(checks) == 1:
            return checks[0]
        tup = tuple(checks)
        return lambda x: all(c(x) for c in tup)

    def _keyword(self, k: str, v: Any, s: Mapping[str, Any], base: str) -> Check:  # noqa: C901 - a dispatch
        if k == "type":
            if isinstance(v, str):
                return _TYPES[v]
            ts = tuple(_TYPES[t] for t in v)
            return lambda x: any(t(x) for t in ts)
        if k == "$ref":
            return self._resolve(v, base)
        if k == "const":
            if isinstance(v, str):
                return lambda x: isinstance(x, str) and x == v
            return lambda x: json_equal(x, v)
        if k == "enum":
            if all(isinstance(e, str) for e in v):
                vs = frozenset(v)
                return lambda x: isinstance(x, str) and x in vs
            return lambda x: any(json_equal(x, e) for e in v)
        if k == "properties":
            props = tuple((name, self._schema(sub, base)) for name, sub in v.items())
            return lambda x: not isinstance(x, dict) or all(c(x[n]) for n, c in props if n in x)
        if k == "patternProperties":
            pats = tuple((re.compile(p), self._schema(sub, base)) for p, sub in v.items())
            return lambda x: not isinstance(x, dict) or all(
                c(val) for key, val in x.items() for p, c in pats if p.search(key))
        if k == "additionalProperties":
            known = frozenset(s.get("properties", {}))
            pats = tuple(re.compile(p) for p in s.get("patternProperties", {}))
            sub = self._schema(v, base)

            def additional(x: Any) -> bool:
                if not isinstance(x, dict):
                    return True
                for key, val in x.items():
                    if key in known or any(p.search(key) for p in pats):
                        continue
                    if not sub(val):
                        return False
                return True
            return additional
        if k == "required":
            req = tuple(v)
            return lambda x: not isinstance(x, dict) or all(n in x for n in req)
        if k == "propertyNames":
            sub = self._schema(v, base)
            return lambda x: not isinstance(x, dict) or all(sub(key) for key in x)
        if k == "maxProperties":
            return lambda x: not isinstance(x, dict) or len(x) <= v
        if k == "minProperties":
            return lambda x: not isinstance(x, dict) or len(x) >= v
        if k == "dependentRequired":
            deps = tuple((n, tuple(r)) for n, r in v.items())
            return lambda x: not isinstance(x, dict) or all(
                all(r in x for r in rs) for n, rs in deps if n in x)
        if k == "items":
            sub = self._schema(v, base)
            skip = len(s.get("prefixItems", ()))
            return lambda x: not isinstance(x, list) or all(sub(e) for e in x[skip:])
        if k == "prefixItems":
            subs = tuple(self._schema(e, base) for e in v)
            return lambda x: not isinstance(x, list) or all(c(e) for c, e in zip(subs, x, strict=False))
        if k == "minItems":
            return lambda x: not isinstance(x, list) or len(x) >= v
        if k == "maxItems":
            return lambda x: not isinstance(x, list) or len(x) <= v
        if k == "uniqueItems":
            if not v:
                return lambda x: True
            return lambda x: not isinstance(x, list) or all(
                not json_equal(x[i], x[j]) for i in range(len(x)) for j in range(i + 1, len(x)))
        if k == "minimum":
            return lambda x: not _is_num(x) or x >= v
        if k == "maximum":
            return lambda x: not _is_num(x) or x <= v
        if k == "exclusiveMinimum":
            return lambda x: not _is_num(x) or x > v
        if k == "exclusiveMaximum":
            return lambda x: not _is_num(x) or x < v
        if k == "minLength":
            return lambda x: not isinstance(x, str) or len(x) >= v
        if k == "maxLength":
            return lambda x: not isinstance(x, str) or len(x) <= v
        if k == "pattern":
            p = re.compile(v)
            return lambda x: not isinstance(x, str) or p.search(x) is not None
        if k == "allOf":
            subs = tuple(self._schema(e, base) for e in v)
            return lambda x: all(c(x) for c in subs)
        if k == "anyOf":
            subs = tuple(self._schema(e, base) for e in v)
            return lambda x: any(c(x) for c in subs)
        if k == "oneOf":
            subs = tuple(self._schema(e, base) for e in v)
            return lambda x: sum(1 for c in subs if c(x)) == 1
        if k == "not":
            sub = self._schema(v, base)
            return lambda x: not sub(x)
        if k == "if":
            cond = self._schema(v, base)
            then = self._schema(s.get("then", True), base)
            other = self._schema(s.get("else", True), base)
            return lambda x: then(x) if cond(x) else other(x)
        raise NotImplementedError(f"schema keyword {k!r} is not compiled (add it, with its test)")
