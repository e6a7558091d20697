"""Name patterns (spec/layout.md §4): glob-like, matched against whole tensor names.

``**`` matches any text, ``*`` any text without "/", ``{name}`` captures one or more characters other
than "/" (in a renumber pattern: a decimal integer), ``\\c`` is the literal character c; everything
else matches itself. Wildcards and captures take as few characters as possible, left to right.
"""

from __future__ import annotations

import functools
import re

from ucl.errors import InvalidLayoutError

_CAPTURE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT = r"0|[1-9][0-9]*"


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str, int_captures: bool = False) -> re.Pattern[str]:
    """The regular expression of ``pattern``; raises InvalidLayoutError for a malformed one."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidLayoutError(f"a pattern is a non-empty string, got {pattern!r}")
    out: list[str] = []
    names: set[str] = set()
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if i + 1 == len(pattern):
                raise InvalidLayoutError(f"pattern {pattern!r} ends with a lone backslash")
            out.append(re.escape(pattern[i + 1]))
            i += 2
        elif pattern.startswith("**", i):
            out.append(".*?")
            i += 2
        elif c == "*":
            out.append("[^/]*?")
            i += 1
        elif c == "{":
            end = pattern.find("}", i)
            name = pattern[i + 1 : end] if end > 0 else ""
            if end < 0 or not _CAPTURE.fullmatch(name):
                raise InvalidLayoutError(
                    f"pattern {pattern!r}: '{{' must open a capture {{name}} (use \\{{ for a brace)"
                )
            if name in names:
                raise InvalidLayoutError(f"pattern {pattern!r} captures {{{name}}} twice")
            names.add(name)
            out.append(f"(?P<{name}>{_INT})" if int_captures else f"(?P<{name}>[^/]+?)")
            i = end + 1
        elif c == "}":
            raise InvalidLayoutError(f"pattern {pattern!r} has an unmatched '}}' (use \\}} for a brace)")
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def captures(pattern: str) -> tuple[str, ...]:
    """The capture names of ``pattern``, in order."""
    return tuple(compile_pattern(pattern).groupindex)


def match(pattern: str, name: str, int_captures: bool = False) -> dict[str, str] | None:
    """The captures when ``name`` matches ``pattern`` as a whole, else None."""
    m = compile_pattern(pattern, int_captures).fullmatch(name)
    return None if m is None else m.groupdict()


@functools.lru_cache(maxsize=4096)
def ends(pattern: str) -> tuple[str, str]:
    """The literal text ``pattern`` starts with and ends with (before its first and after its last
    wildcard or capture; the whole pattern, unescaped, when it has none): a name it matches starts and
    ends with them, a test much cheaper than the match (a Megatron layout's ~20 patterns are tried on
    every tensor name)."""
    parts: list[str] = [""]  # literal runs, split at each wildcard or capture
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            parts[-1] += pattern[i + 1]
            i += 2
        elif c == "*":
            parts.append("")
            i += 2 if pattern.startswith("**", i) else 1
        elif c == "{":
            end = pattern.find("}", i)
            parts.append("")
            i = end + 1 if end > 0 else len(pattern)
        else:
            parts[-1] += c
            i += 1
    return (parts[0], "") if len(parts) == 1 else (parts[0], parts[-1])


def literal(pattern: str) -> str | None:
    """The one name ``pattern`` matches when it has no wildcard or capture, else None."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i + 1])
            i += 2
        elif c in "*{}":
            return None
        else:
            out.append(c)
            i += 1
    return "".join(out)


def escape(name: str) -> str:
    """A pattern that matches exactly ``name``."""
    return "".join("\\" + c if c in "\\*{}" else c for c in name)


def substitute(template: str, values: dict[str, str]) -> str:
    """Replace each capture ``{name}`` of ``template`` by ``values[name]`` (escapes are unescaped).

    The template must contain no wildcard: it names one tensor.
    """
    out: list[str] = []
    i = 0
    while i < len(template):
        c = template[i]
        if c == "\\" and i + 1 < len(template):
            out.append(template[i + 1])
            i += 2
        elif c == "{":
            end = template.find("}", i)
            key = template[i + 1 : end] if end > 0 else ""
            if key not in values:
                raise InvalidLayoutError(f"template {template!r} names {{{key}}}, which has no value")
            out.append(values[key])
            i = end + 1
        elif c == "*":
            raise InvalidLayoutError(f"template {template!r} contains a wildcard; it must name one tensor")
        else:
            out.append(c)
            i += 1
    return "".join(out)


@functools.lru_cache(maxsize=1024)
def template_regex(template: str) -> re.Pattern[str]:
    """A regex matching the names ``template`` produces: ``{member}`` any text, other captures no "/"."""
    out: list[str] = []
    i = 0
    while i < len(template):
        c = template[i]
        if c == "\\" and i + 1 < len(template):
            out.append(re.escape(template[i + 1]))
            i += 2
        elif c == "{":
            end = template.find("}", i)
            key = template[i + 1 : end]
            out.append(f"(?P<{key}>.+?)" if key == "member" else f"(?P<{key}>[^/]+)")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out), re.DOTALL)
