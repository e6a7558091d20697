"""JSON Schemas compiled once into Python functions: the fast path of every schema check.

``jsonschema`` stays the reference (it names the first violation in an error), but it costs ~70 ms to
import, ~80 ms to build the validators and ~0.5 ms per array document: most of an ``ucl.open``. A
compiled predicate answers only "valid or not", so a valid document (the common case) never touches
jsonschema; an invalid one is handed to it for the message.

Each schema is translated to the source of one Python function (as fastjsonschema and ajv do; neither
speaks Draft 2020-12), whose statements test the document in line and ``return False`` at the first
violation: an array document's check is one call instead of the ~280 nested closure calls it took, about
3x faster. Sub-schemas that must answer a boolean (``anyOf``, ``oneOf``, ``not``, ``if``), every ``$ref``
and nodes nested deeper than Python's block limit allows become functions of their own. Compiling the
read path's schemas costs ~6 ms, so their module is generated ahead and shipped
(``ucl/format/_schemas_compiled.py``, :meth:`Compiler.module`; ``ucl.format.metadata`` uses it while its
digest matches the schemas).

The predicate may be *stricter* than the reference, never looser: a keyword it does not implement is a
compile-time error, and ``tests/format/test_schema_compile.py`` checks it against jsonschema on every
fixture document, on mutations of them and on schemas of every keyword. Semantics are Draft 2020-12 as
``ucl.format.metadata`` applies it: ``integer`` is an int token only (``4.0`` is not an integer, spec/core.md
§3.4); booleans are not numbers; ``pattern`` is ``re.search`` (what jsonschema does).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[Any], bool]

# keywords that only annotate: no effect on validity
_ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "$defs", "title", "description", "examples", "default"})
_OBJECT = ("properties", "patternProperties", "additionalProperties", "required", "propertyNames",
           "minProperties", "maxProperties", "dependentRequired")
_ARRAY = ("items", "prefixItems", "minItems", "maxItems", "uniqueItems")
_NUMBER = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_STRING = ("minLength", "maxLength", "pattern")
_OTHER = ("type", "$ref", "const", "enum", "allOf", "anyOf", "oneOf", "not", "if", "then", "else")
_KNOWN = frozenset(_ANNOTATIONS | set(_OBJECT) | set(_ARRAY) | set(_NUMBER) | set(_STRING) | set(_OTHER))

# the test of each type on a variable v
_TYPES = {
    "object": "isinstance({v}, dict)",
    "array": "isinstance({v}, list)",
    "string": "isinstance({v}, str)",
    "integer": "type({v}) is int",
    "number": "(type({v}) is int or type({v}) is float)",
    "boolean": "type({v}) is bool",
    "null": "{v} is None",
}
_MAX_DEPTH = 14  # statically nested blocks in one function (CPython allows 20)


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


def _unique(x: list[Any]) -> bool:
    return all(not json_equal(x[i], x[j]) for i in range(len(x)) for j in range(i + 1, len(x)))


class Compiler:
    """Compiles the schemas of one registry (by ``$id`` and by file name) into predicates."""

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]]) -> None:
        self._docs: dict[str, Mapping[str, Any]] = {}
        for name, doc in schemas.items():
            self._docs[name] = doc
            if "$id" in doc:
                self._docs[doc["$id"]] = doc
        self._refs: dict[tuple[str, str], str] = {}  # (base, pointer) -> the name of its function
        self._ns: dict[str, Any] = {"json_equal": json_equal, "_unique": _unique, "_MISSING": object()}
        self._consts: dict[Any, str] = {}
        self._const_src: dict[str, str] = {}  # name -> the expression that makes it (for module())
        self._pending: list[str] = []  # sources of functions not yet exec'd
        self.sources: list[str] = []  # every function generated (to read what a schema became)
        self._n = 0

    def compile(self, name: str, pointer: str = "") -> Check:
        """The predicate of schema ``name`` (a file name or ``$id``), or of its sub-schema at ``pointer``."""
        doc = self._docs[name]
        fn = self._ref(doc.get("$id", name), pointer)
        if self._pending:
            code = "\n\n".join(self._pending)
            self._pending = []
            exec(compile(code, f"<ucl schema {name}{pointer}>", "exec"), self._ns)  # noqa: S102 - our own source
        check: Check = self._ns[fn]
        return check

    def module(self, entries: list[tuple[str, str]], digest: str) -> str:
        """The source of a Python module holding the predicates of ``entries`` ((schema file name,
        pointer) pairs) as ``ENTRIES``, and ``DIGEST``, the digest of the schemas they were made from: shipped
        with the package so that a process does not compile its schemas (~6 ms) on its first open."""
        names = {e: self._ref(self._docs[e[0]].get("$id", e[0]), e[1]) for e in entries}
        consts = [f"{n} = {src}" for n, src in self._const_src.items()]
        table = ["ENTRIES = {", *[f"    {e!r}: {fn}," for e, fn in names.items()], "}"]
        return "\n".join([
            '"""JSON Schema predicates generated by ucl.format.schema_compile from ucl/format/schemas: do not',
            "edit. Regenerate with ``python -m ucl.format.metadata`` after changing a schema (a test fails while",
            'this file is stale; a stale file is never used: its DIGEST no longer matches the schemas)."""',
            "# ruff: noqa", "# mypy: ignore-errors", "",
            "import re", "", "from ucl.format.schema_compile import _unique, json_equal", "",
            "_MISSING = object()", f"DIGEST = {digest!r}", "", *consts, "", "",
            "\n\n\n".join(self.sources), "", "", *table, ""])

    # -- names ------------------------------------------------------------------------------------------
    def _fresh(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def _const(self, value: Any) -> str:
        """A module-level name holding ``value`` (sets, compiled patterns, JSON constants)."""
        if isinstance(value, frozenset):  # sorted: the generated module is the same on every run
            src = f"frozenset({sorted(value)!r})"
        elif isinstance(value, re.Pattern):
            src = f"re.compile({value.pattern!r})"
        else:  # JSON values: repr is their Python source
            src = repr(value)
        key = (type(value).__name__, src)
        name = self._consts.get(key)
        if name is None:
            name = self._consts[key] = self._fresh("_c")
            self._ns[name] = value
            self._const_src[name] = src
        return name

    # -- functions --------------------------------------------------------------------------------------
    def _ref(self, base: str, pointer: str) -> str:
        key = (base, pointer)
        if key in self._refs:
            return self._refs[key]
        fn = self._refs[key] = self._fresh("_ref")  # named before its body: recursive schemas terminate
        node: Any = self._docs[base]
        for part in [p for p in pointer.split("/") if p]:
            node = node[part.replace("~1", "/").replace("~0", "~")]
        self._function(fn, node, base)
        return fn

    def _resolve(self, ref: str, base: str) -> str:
        target, _, pointer = ref.partition("#")
        if not target:
            return self._ref(base, pointer)
        if target not in self._docs:  # relative to the base's directory
            target = base.rsplit("/", 1)[0] + "/" + target if "/" in base else target
        if target not in self._docs:
            raise KeyError(f"unresolvable $ref {ref!r} from {base}")
        return self._ref(self._docs[target].get("$id", target), pointer)

    def _function(self, fn: str, s: Any, base: str) -> None:
        body: list[str] = []
        self._emit(s, "x", base, body, 1)
        src = "\n".join([f"def {fn}(x):", *body, "    return True"])
        self._pending.append(src)
        self.sources.append(src)

    def _sub(self, s: Any, base: str) -> str:
        """A function of its own for sub-schema ``s``: its name."""
        if isinstance(s, dict) and set(s) - _ANNOTATIONS == {"$ref"}:
            return self._resolve(s["$ref"], base)
        fn = self._fresh("_s")
        self._function(fn, s, base)
        return fn

    # -- one schema on one variable: statements that return False on a violation ------------------------
    def _emit(self, s: Any, v: str, base: str, out: list[str], depth: int) -> None:  # noqa: C901 - a dispatch
        pad = "    " * depth
        if s is True:
            return
        if s is False:
            out.append(f"{pad}return False")
            return
        unknown = set(s) - _KNOWN
        if unknown:
            raise NotImplementedError(f"schema keyword {sorted(unknown)[0]!r} is not compiled (add it, with its test)")
        if depth > _MAX_DEPTH:  # too deep for one function: the rest in a function of its own
            out.append(f"{pad}if not {self._sub(s, base)}({v}): return False")
            return
        t = s.get("type")
        # type: a single type also guards the keywords of that type (no block of their own)
        single = t if isinstance(t, str) else None
        if single is not None:
            out.append(f"{pad}if not {_TYPES[single].format(v=v)}: return False")
        elif t is not None:
            out.append(f"{pad}if not ({' or '.join(_TYPES[x].format(v=v) for x in t)}): return False")
        if "$ref" in s:
            out.append(f"{pad}if not {self._resolve(s['$ref'], base)}({v}): return False")
        if "const" in s:
            c = s["const"]
            if isinstance(c, str):
                out.append(f"{pad}if not (isinstance({v}, str) and {v} == {c!r}): return False")
            elif type(c) is int or type(c) is float:  # 3 == 3.0 in JSON Schema; a boolean is no number
                out.append(f"{pad}if not ({_TYPES['number'].format(v=v)} and {v} == {c!r}): return False")
            else:
                out.append(f"{pad}if not json_equal({v}, {self._const(c)}): return False")
        if "enum" in s:
            e = s["enum"]
            if all(isinstance(x, str) for x in e):
                out.append(f"{pad}if not (isinstance({v}, str) and {v} in {self._const(frozenset(e))}): return False")
            else:
                out.append(f"{pad}if not any(json_equal({v}, e) for e in {self._const(tuple(e))}): return False")
        for kind, keys, emit in (("object", _OBJECT, self._object), ("array", _ARRAY, self._array),
                                 ("number", _NUMBER, self._number), ("string", _STRING, self._string)):
            if not any(k in s for k in keys):
                continue
            if single == kind or (kind == "number" and single == "integer"):
                emit(s, v, base, out, depth)
            elif single is not None:
                continue  # keywords of another type than the one required: they never apply
            else:
                out.append(f"{pad}if {_TYPES[kind].format(v=v)}:")
                n = len(out)
                emit(s, v, base, out, depth + 1)
                if len(out) == n:
                    out.pop()
        for sub in s.get("allOf", ()):
            self._emit(sub, v, base, out, depth)
        if "anyOf" in s:
            calls = " or ".join(f"{self._sub(x, base)}({v})" for x in s["anyOf"])
            out.append(f"{pad}if not ({calls}): return False")
        if "oneOf" in s:
            calls = " + ".join(f"{self._sub(x, base)}({v})" for x in s["oneOf"])
            out.append(f"{pad}if ({calls}) != 1: return False")
        if "not" in s:
            out.append(f"{pad}if {self._sub(s['not'], base)}({v}): return False")
        if "if" in s:
            then, other = s.get("then", True), s.get("else", True)
            out.append(f"{pad}if {self._sub(s['if'], base)}({v}):")
            n = len(out)
            self._emit(then, v, base, out, depth + 1)
            if len(out) == n:
                out.append(f"{pad}    pass")
            m = len(out)
            out.append(f"{pad}else:")
            self._emit(other, v, base, out, depth + 1)
            if len(out) == m + 1:
                out.pop()

    def _object(self, s: Mapping[str, Any], v: str, base: str, out: list[str], depth: int) -> None:
        """The object keywords, ``v`` known to be a dict: the shape of nearly every node of a ucl
        document, so their cost is most of a document's check."""
        pad = "    " * depth
        req = list(s.get("required", ()))
        if req:
            out.append(f"{pad}if {' or '.join(f'{n!r} not in {v}' for n in req)}: return False")
        _lengths(s, "minProperties", "maxProperties", v, pad, out)
        for n, rs in s.get("dependentRequired", {}).items():
            if rs:
                out.append(f"{pad}if {n!r} in {v} and ({' or '.join(f'{r!r} not in {v}' for r in rs)}): return False")
        if "propertyNames" in s:
            k = self._fresh("k")
            body: list[str] = []
            self._emit(s["propertyNames"], k, base, body, depth + 1)
            if body:
                out += [f"{pad}for {k} in {v}:", *body]
        props = s.get("properties", {})
        for n, sub in props.items():
            body = []
            w = self._fresh("v")
            self._emit(sub, w, base, body, depth + (n not in req))
            if not body:
                continue
            if n in req:
                out += [f"{pad}{w} = {v}[{n!r}]", *body]
            else:
                out += [f"{pad}{w} = {v}.get({n!r}, _MISSING)", f"{pad}if {w} is not _MISSING:", *body]
        pats = list(s.get("patternProperties", {}).items())
        addl = s.get("additionalProperties")
        known = self._const(frozenset(props))
        if not pats and addl is None:
            return
        if not pats and addl is False:
            out.append(f"{pad}if not {known}.issuperset({v}): return False")
            return
        k, w = self._fresh("k"), self._fresh("v")
        body = []
        inner = "    " * (depth + 1)
        matched = self._fresh("m")
        if pats and addl is not None:
            body.append(f"{inner}{matched} = False")
        for p, sub in pats:
            body.append(f"{inner}if {self._const(re.compile(p))}.search({k}) is not None:")
            if addl is not None:
                body.append(f"{inner}    {matched} = True")
            n = len(body)
            self._emit(sub, w, base, body, depth + 2)
            if len(body) == n and addl is None:
                body.append(f"{inner}    pass")
        if addl is not None:
            cond = f"{k} not in {known}" + (f" and not {matched}" if pats else "")
            body.append(f"{inner}if {cond}:")
            n = len(body)
            self._emit(addl, w, base, body, depth + 2)
            if len(body) == n:
                body.pop()
        out += [f"{pad}for {k}, {w} in {v}.items():", *body, f"{inner}pass"]

    def _array(self, s: Mapping[str, Any], v: str, base: str, out: list[str], depth: int) -> None:
        pad = "    " * depth
        _lengths(s, "minItems", "maxItems", v, pad, out)
        prefix = s.get("prefixItems", ())
        for i, sub in enumerate(prefix):
            w = self._fresh("v")
            body: list[str] = []
            self._emit(sub, w, base, body, depth + 1)
            if body:
                out += [f"{pad}if len({v}) > {i}:", f"{pad}    {w} = {v}[{i}]", *body]
        if "items" in s:
            w = self._fresh("v")
            body = []
            self._emit(s["items"], w, base, body, depth + 1)
            if body:
                out += [f"{pad}for {w} in {v}[{len(prefix)}:]:" if prefix else f"{pad}for {w} in {v}:", *body]
        if s.get("uniqueItems"):
            out.append(f"{pad}if not _unique({v}): return False")

    def _number(self, s: Mapping[str, Any], v: str, base: str, out: list[str], depth: int) -> None:
        pad = "    " * depth
        for k, op in (("minimum", "<"), ("maximum", ">"), ("exclusiveMinimum", "<="), ("exclusiveMaximum", ">=")):
            if k in s:
                out.append(f"{pad}if {v} {op} {self._const(s[k])}: return False")

    def _string(self, s: Mapping[str, Any], v: str, base: str, out: list[str], depth: int) -> None:
        pad = "    " * depth
        _lengths(s, "minLength", "maxLength", v, pad, out)
        if "pattern" in s:
            out.append(f"{pad}if {self._const(re.compile(s['pattern']))}.search({v}) is None: return False")


def _lengths(s: Mapping[str, Any], lo: str, hi: str, v: str, pad: str, out: list[str]) -> None:
    """Bounds on ``len(v)``: minProperties/maxProperties, minItems/maxItems, minLength/maxLength."""
    if lo in s:
        out.append(f"{pad}if len({v}) < {int(s[lo])}: return False")
    if hi in s:
        out.append(f"{pad}if len({v}) > {int(s[hi])}: return False")
