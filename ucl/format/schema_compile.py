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

# the keywords compiled together by Compiler._object (with "type" when it is "object")
_OBJECT_KEYWORDS = frozenset({"type", "properties", "patternProperties", "additionalProperties", "required",
                              "propertyNames", "minProperties", "maxProperties", "dependentRequired"})

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
        fused = _OBJECT_KEYWORDS.intersection(s) if "type" not in s or s["type"] == "object" else set()
        if fused & {"properties", "patternProperties", "additionalProperties", "required"}:
            checks.append(self._object(s, base))
        else:
            fused = set()
        for k, v in s.items():
            if k in _ANNOTATIONS or k in ("then", "else") or k in fused:
                continue
            checks.append(self._keyword(k, v, s, base))
        if not checks:
            return lambda x: True
        if len(checks) == 1:
            return checks[0]
        tup = tuple(checks)

        def every(x: Any) -> bool:  # loops, not all(genexpr): the hot path of every document check
            for c in tup:
                if not c(x):
                    return False
            return True
        return every

    def _object(self, s: Mapping[str, Any], base: str) -> Check:
        """``type: object`` (when given) and the keywords on an object's members, in one pass over it:
        the shape of nearly every node of a ucl document, so its cost is most of a document's check."""
        is_object = s.get("type") == "object"
        req = tuple(s.get("required", ()))
        props = {name: self._schema(sub, base) for name, sub in s.get("properties", {}).items()}
        pats = tuple((re.compile(p), self._schema(sub, base)) for p, sub in s.get("patternProperties", {}).items())
        addl = self._schema(s["additionalProperties"], base) if "additionalProperties" in s else None
        names = self._schema(s["propertyNames"], base) if "propertyNames" in s else None
        lo, hi = s.get("minProperties"), s.get("maxProperties")
        deps = tuple((n, tuple(r)) for n, r in s.get("dependentRequired", {}).items())

        def check(x: Any) -> bool:
            if not isinstance(x, dict):
                return not is_object
            for n in req:
                if n not in x:
                    return False
            if (lo is not None and len(x) < lo) or (hi is not None and len(x) > hi):
                return False
            for n, rs in deps:
                if n in x:
                    for r in rs:
                        if r not in x:
                            return False
            for key, val in x.items():
                if names is not None and not names(key):
                    return False
                c = props.get(key)
                if c is not None and not c(val):
                    return False
                matched = False
                for p, pc in pats:
                    if p.search(key):
                        matched = True
                        if not pc(val):
                            return False
                if c is None and not matched and addl is not None and not addl(val):
                    return False
            return True
        return check

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

            def properties(x: Any) -> bool:
                if not isinstance(x, dict):
                    return True
                for n, c in props:
                    if n in x and not c(x[n]):
                        return False
                return True
            return properties
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

            def required(x: Any) -> bool:
                if not isinstance(x, dict):
                    return True
                for n in req:
                    if n not in x:
                        return False
                return True
            return required
        if k == "propertyNames":
            sub = self._schema(v, base)

            def property_names(x: Any) -> bool:
                if not isinstance(x, dict):
                    return True
                for key in x:
                    if not sub(key):
                        return False
                return True
            return property_names
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

            def items(x: Any) -> bool:
                if not isinstance(x, list):
                    return True
                for e in (x[skip:] if skip else x):
                    if not sub(e):
                        return False
                return True
            return items
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

            def all_of(x: Any) -> bool:
                for c in subs:
                    if not c(x):
                        return False
                return True
            return all_of
        if k == "anyOf":
            subs = tuple(self._schema(e, base) for e in v)

            def any_of(x: Any) -> bool:
                for c in subs:
                    if c(x):
                        return True
                return False
            return any_of
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
