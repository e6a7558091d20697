"""The text form of a layout (spec/layout.md §3): a tokenizer, a recursive-descent parser, a printer.

Statements end at a newline, except inside brackets or parentheses. ``#`` starts a comment. Strings
are JSON strings. :func:`format_layout` prints the canonical text, which parses back to an equal layout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ucl.errors import InvalidLayoutError, LayoutSyntaxError
from ucl.layout.mesh import Mesh
from ucl.layout.model import (
    VERSIONS,
    Flat,
    Fused,
    Grouped,
    Layout,
    Pad,
    Part,
    Partial,
    Placement,
    Renumber,
    Replicate,
    Rule,
    Shard,
    Size,
    Transform,
)

HEADER = "ucl-layout"
_TOKEN = re.compile(
    r"""(?P<ws>[ \t\r]+)
      |(?P<comment>\#[^\n]*)
      |(?P<nl>\n)
      |(?P<string>"(?:[^"\\\n]|\\.)*")
      |(?P<dims>[0-9]+x[0-9]+)
      |(?P<int>-?[0-9]+)
      |(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)*)
      |(?P<punct>->|[()\[\],:=*])""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class Tok:
    kind: str  # string, dims, int, name, punct, nl, eof
    text: str
    line: int
    col: int


def tokenize(text: str) -> list[Tok]:
    toks: list[Tok] = []
    line, line_start, depth, pos = 1, 0, 0, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        col = pos - line_start + 1
        if m is None:
            raise LayoutSyntaxError(f"line {line}, column {col}: unexpected character {text[pos]!r}")
        kind = m.lastgroup or ""
        s = m.group()
        if kind == "nl":
            if depth == 0:
                toks.append(Tok("nl", s, line, col))
            line, line_start = line + 1, m.end()
        elif kind == "punct":
            if s in "([":
                depth += 1
            elif s in ")]":
                depth = max(0, depth - 1)
            toks.append(Tok(kind, s, line, col))
        elif kind not in ("ws", "comment"):
            toks.append(Tok(kind, s, line, col))
        pos = m.end()
    toks.append(Tok("nl", "", line, pos - line_start + 1))
    toks.append(Tok("eof", "", line, pos - line_start + 1))
    return toks


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = tokenize(text)
        self.i = 0

    # -- helpers
    @property
    def tok(self) -> Tok:
        return self.toks[self.i]

    def error(self, expected: str, tok: Tok | None = None) -> LayoutSyntaxError:
        t = tok or self.tok
        found = {"nl": "end of line", "eof": "end of text"}.get(t.kind, repr(t.text))
        return LayoutSyntaxError(f"line {t.line}, column {t.col}: expected {expected}, found {found}")

    def at(self, text: str) -> bool:
        return self.tok.kind in ("punct", "name") and self.tok.text == text

    def take(self, text: str) -> Tok:
        if not self.at(text):
            raise self.error(repr(text))
        t = self.tok
        self.i += 1
        return t

    def take_kind(self, kind: str, expected: str) -> Tok:
        if self.tok.kind != kind:
            raise self.error(expected)
        t = self.tok
        self.i += 1
        return t

    def integer(self, what: str = "an integer") -> int:
        return int(self.take_kind("int", what).text)

    def string(self, what: str = "a string") -> str:
        t = self.take_kind("string", what)
        try:
            s = json.loads(t.text)
        except json.JSONDecodeError:
            raise LayoutSyntaxError(f"line {t.line}, column {t.col}: invalid string {t.text}") from None
        return str(s)

    def name(self, what: str = "a name") -> str:
        return self.take_kind("name", what).text

    def skip_nl(self) -> None:
        while self.tok.kind == "nl":
            self.i += 1

    def end_statement(self) -> None:
        if self.tok.kind not in ("nl", "eof"):
            raise self.error("end of line")
        self.skip_nl()

    def semantic(self, tok: Tok, err: InvalidLayoutError) -> InvalidLayoutError:
        return InvalidLayoutError(f"line {tok.line}, column {tok.col}: {err.message}")

    # -- grammar
    def document(self) -> Layout:
        self.skip_nl()
        head = self.tok
        if not self.at(HEADER):
            raise self.error(f"'{HEADER} 1' on the first line")
        self.i += 1
        v = self.tok
        version = self.integer("the layout version")
        if version not in VERSIONS:
            raise LayoutSyntaxError(
                f"line {v.line}, column {v.col}: layout version {version}; "
                f"this implementation reads {', '.join(map(str, VERSIONS))}"
            )
        self.end_statement()
        rules: list[Rule] = []
        renumbers: list[Renumber] = []
        flats: list[Flat] = []
        mesh: Mesh | None = None
        while self.tok.kind != "eof":
            start = self.tok
            try:
                if self.at("mesh"):
                    if mesh is not None:
                        raise self.error("one mesh statement at most")
                    mesh = self.mesh()
                elif self.at("renumber"):
                    renumbers.append(self.renumber())
                elif self.at("flat"):
                    flats.append(self.flat())
                elif self.tok.kind == "string":
                    rules.append(self.rule())
                else:
                    raise self.error("a statement (mesh, renumber, flat, or a rule's pattern string)")
            except InvalidLayoutError as e:
                if isinstance(e, LayoutSyntaxError):
                    raise
                raise self.semantic(start, e) from None
            self.end_statement()
        try:
            return Layout(tuple(rules), tuple(renumbers), tuple(flats), mesh, version)
        except InvalidLayoutError as e:
            if isinstance(e, LayoutSyntaxError):
                raise
            raise self.semantic(head, e) from None

    def mesh(self) -> Mesh:
        self.take("mesh")
        axes = []
        while self.tok.kind == "name":
            name = self.name()
            self.take("=")
            axes.append((name, self.integer("an axis size")))
        return Mesh(tuple(axes))  # no axes: the one-rank mesh

    def patterns(self) -> tuple[str, ...]:
        out = [self.string("a pattern string")]
        while self.at(","):
            self.i += 1
            out.append(self.string("a pattern string"))
        return tuple(out)

    def renumber(self) -> Renumber:
        self.take("renumber")
        pats = self.patterns()
        self.take("over")
        axis = self.name("an axis name")
        self.take(":")
        if self.at("["):
            return Renumber(pats, axis, bounds=tuple(self.int_list()))
        return Renumber(pats, axis, count=self.integer("a count or [bounds]"))

    def int_list(self) -> list[int]:
        self.take("[")
        out: list[int] = []
        while not self.at("]"):
            out.append(self.integer())
            if not self.at("]"):
                self.take(",")
        self.take("]")
        return out

    def axes(self) -> tuple[str, ...]:
        out = [self.name("an axis name")]
        while self.at("*"):
            self.i += 1
            out.append(self.name("an axis name"))
        return tuple(out)

    def placement(self) -> Placement:
        self.take("on")
        out = []
        while self.tok.kind == "name":
            axis = self.name()
            self.take("=")
            idx = [self.integer("an index")]
            while self.at(","):
                self.i += 1
                idx.append(self.integer("an index"))
            out.append((axis, tuple(idx)))
        if not out:
            raise self.error("a placement, like pp=0")
        return tuple(out)

    def rule(self) -> Rule:
        pats = self.patterns()
        self.take(":")
        ts = [self.transform()]
        while self.at(","):
            self.i += 1
            ts.append(self.transform())
        on = self.placement() if self.at("on") else ()
        return Rule(pats, tuple(ts), on)

    def transform(self) -> Transform:
        t = self.tok
        op = self.name("a transform (replicate, shard, fused, grouped, pad, size, partial)")
        if op == "replicate":
            return Replicate()
        if op not in ("shard", "fused", "grouped", "pad", "size", "partial"):
            raise self.error("a transform (replicate, shard, fused, grouped, pad, size, partial)", t)
        self.take("(")
        out: Transform
        if op == "partial":
            out = Partial(self.axes())
        else:
            dim = self.integer("a dimension")
            self.take(",")
            if op == "shard":
                out = Shard(dim, self.axes())
            elif op == "size":
                out = Size(dim, self.integer("a size"))
            elif op == "pad":
                factors: list[int | str] = [self.factor()]
                while self.at("*"):
                    self.i += 1
                    factors.append(self.factor())
                out = Pad(dim, tuple(factors))
            else:
                groups = None
                if op == "grouped":
                    groups = self.integer("the number of groups")
                    self.take(",")
                parts = [self.part()]
                while self.at(","):
                    self.i += 1
                    parts.append(self.part())
                out = Fused(dim, tuple(parts)) if groups is None else Grouped(dim, groups, tuple(parts))
        self.take(")")
        return out

    def factor(self) -> int | str:
        if self.tok.kind == "int":
            return self.integer()
        return self.name("an integer or an axis name")

    def part(self) -> Part:
        name = self.name("a part name")
        self.take("=")
        if self.tok.kind == "dims":
            count, unit = self.tok.text.split("x")
            self.i += 1
            return Part(name, int(count), int(unit))
        return Part(name, self.integer("a part size, like 4096 or 32x128"))

    def flat(self) -> Flat:
        self.take("flat")
        buffer = self.string("the buffer pattern")
        self.take("->")
        logical = self.string("the logical name template")
        self.take("over")
        axes = self.axes()
        align = 1
        if self.at("align"):
            self.i += 1
            align = self.integer("an alignment")
        pad: list[int | str] = []
        if self.at("pad"):
            self.i += 1
            pad.append(self.factor())
            while self.at("*"):
                self.i += 1
                pad.append(self.factor())
        on = self.placement() if self.at("on") else ()
        self.take(":")
        self.take("[")
        members = []
        while not self.at("]"):
            m = self.string("a member name")
            members.append((m, tuple(self.int_list())))
            if not self.at("]"):
                self.take(",")
        self.take("]")
        return Flat(buffer, logical, axes, tuple(members), align, on, tuple(pad))


def parse_layout(text: str) -> Layout:
    """Parse the text form of a layout; raises LayoutSyntaxError (line, column) or InvalidLayoutError."""
    if not isinstance(text, str):
        raise LayoutSyntaxError(f"layout text must be a string, got {type(text).__name__}")
    return _Parser(text).document()


# -- printing --------------------------------------------------------------------------------------
def _s(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _placement(on: Placement) -> str:
    if not on:
        return ""
    return " on " + " ".join(f"{a}=" + ",".join(str(i) for i in idx) for a, idx in on)


def format_transform(t: Transform) -> str:
    if isinstance(t, Replicate):
        return "replicate"
    if isinstance(t, Shard):
        return f"shard({t.dim}, {'*'.join(t.axes)})"
    if isinstance(t, Size):
        return f"size({t.dim}, {t.size})"
    if isinstance(t, Pad):
        return f"pad({t.dim}, {'*'.join(str(f) for f in t.multiple)})"
    if isinstance(t, Partial):
        return f"partial({'*'.join(t.axes)})"
    parts = ", ".join(
        f"{p.name}={p.count}x{p.unit}" if p.unit != 1 else f"{p.name}={p.count}" for p in t.parts
    )
    if isinstance(t, Grouped):
        return f"grouped({t.dim}, {t.groups}, {parts})"
    return f"fused({t.dim}, {parts})"


def format_rule(r: Rule) -> str:
    pats = ", ".join(_s(p) for p in r.patterns)
    return f"{pats}: {', '.join(format_transform(t) for t in r.transforms)}{_placement(r.on)}"


def format_layout(layout: Layout) -> str:
    """The canonical text of ``layout``: header, mesh, renumber statements, rules, flat statements."""
    lines = [f"{HEADER} {layout.version}"]
    if layout.mesh is not None:
        lines.append(f"mesh {layout.mesh.to_text()}".rstrip())
    for n in layout.renumbers:
        target = f"[{', '.join(str(b) for b in n.bounds)}]" if n.bounds is not None else str(n.count)
        lines.append(f"renumber {', '.join(_s(p) for p in n.patterns)} over {n.axis}: {target}")
    lines.extend(format_rule(r) for r in layout.rules)
    for f in layout.flats:
        align = f" align {f.align}" if f.align != 1 else ""
        align += f" pad {'*'.join(str(x) for x in f.pad)}" if f.pad else ""
        lines.append(
            f"flat {_s(f.buffer)} -> {_s(f.logical)} over {'*'.join(f.axes)}{align}{_placement(f.on)}: ["
        )
        lines.extend(f"  {_s(m)} [{', '.join(str(x) for x in shape)}]," for m, shape in f.members)
        lines.append("]")
    return "\n".join(lines) + "\n"
