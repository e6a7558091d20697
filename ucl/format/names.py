"""Tensor names: the naming rules, and escaping names into storage keys (the tree they form: structure).

Names are data, not paths (spec/core.md §5). A name is "/"-separated segments; each segment is stored
percent-escaped so that no name can produce ".", "..", an empty segment, a reserved "__" prefix or a
byte outside [A-Za-z0-9._-] in a key. Escaping is a bijection, so keys decode back to names exactly.
"""

from __future__ import annotations

import functools
import re

from ucl.errors import InvalidNameError

MAX_NAME_BYTES = 1024
MAX_SEGMENT_BYTES = 255
MAX_DEPTH = 32
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_CONTROL = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
_ESCAPED_SEGMENT = re.compile(r"^(?:[A-Za-z0-9._-]|%[0-9A-F]{2})+$")
_PLAIN_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")  # escapes to itself (unless ".", ".." or "__...")


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid tensor name, else raise InvalidNameError saying why."""
    if type(name) is str:
        return _check_str(name)
    return _check(name)


# Names are checked, escaped and unescaped several times per array on every open (a step of 300 tensors:
# ~3,000 calls); the answers are pure functions of the string, so the valid ones are remembered. An
# invalid name raises, and exceptions are never cached.
_CACHED = 1 << 16


@functools.lru_cache(maxsize=_CACHED)
def _check_str(name: str) -> str:
    return _check(name)


def _check(name: object) -> str:
    if not isinstance(name, str):
        raise InvalidNameError(f"tensor name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidNameError("tensor name is empty")
    encoded = name.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_NAME_BYTES:
        raise InvalidNameError(f"tensor name is {len(encoded)} bytes, more than {MAX_NAME_BYTES}", tensor=name)
    segments = name.split("/")
    if len(segments) > MAX_DEPTH:
        raise InvalidNameError(f"tensor name has {len(segments)} segments, more than {MAX_DEPTH}", tensor=name)
    for seg in segments:
        if not seg:
            raise InvalidNameError(f"tensor name {name!r} has an empty segment", tensor=name)
        if _CONTROL.search(seg):
            raise InvalidNameError(f"tensor name {name!r} contains a control character", tensor=name)
        if len(seg.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise InvalidNameError(f"a segment of tensor name {name!r} exceeds {MAX_SEGMENT_BYTES} bytes", tensor=name)
    return name


def _escape_segment(seg: str) -> str:
    if _PLAIN_SEGMENT.fullmatch(seg) and seg not in (".", "..") and not seg.startswith("__"):
        return seg  # most names (every step's document holds one per tensor): nothing to escape
    out = []
    for b in seg.encode("utf-8"):
        out.append(chr(b) if b in _SAFE else f"%{b:02X}")
    s = "".join(out)
    if s in (".", ".."):
        s = s.replace(".", "%2E")
    if s.startswith("__"):  # zarr v3 reserves node names starting with "__"
        s = "%5F" + s[1:]
    return s


def to_key(name: str) -> str:
    """The storage path of a tensor name, relative to its step (a bijection on valid names)."""
    if type(name) is not str:
        name = check_name(name)  # raises for a non-string; a str subclass is then cached as a str
    return _to_key(name)


@functools.lru_cache(maxsize=_CACHED)
def _to_key(name: str) -> str:
    return "/".join(_escape_segment(s) for s in check_name(name).split("/"))


def from_key(key: str) -> str:
    """The tensor name of a storage path; raises InvalidNameError when ``key`` is not a canonical escape."""
    if type(key) is str and key:
        return _from_key(key)
    return _from_key_checked(key)


@functools.lru_cache(maxsize=_CACHED)
def _from_key(key: str) -> str:
    return _from_key_checked(key)


#: A key of plain segments (each escapes to itself) within the limits of a name: the common case, checked
#: in one match. Anything else takes the segment-by-segment path, which names the problem.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9._-]{1,255}(?:/[A-Za-z0-9._-]{1,255}){0,%d}"  # noqa: UP031 - regex braces
                        % (MAX_DEPTH - 1))
_SPECIAL_SEGMENT = re.compile(r"(?:^|/)(?:\.\.?(?:/|$)|__)")


def _from_key_checked(key: str) -> str:
    if (type(key) is str and len(key) <= MAX_NAME_BYTES and _PLAIN_KEY.fullmatch(key)
            and not _SPECIAL_SEGMENT.search(key)):
        return key  # ASCII, no empty, ".", ".." or "__" segment, within every limit: the name is the key
    if not isinstance(key, str) or not key:
        raise InvalidNameError(f"array path {key!r} is empty or not a string")
    segments = key.split("/")
    if all(_PLAIN_SEGMENT.fullmatch(seg) and seg not in (".", "..") and not seg.startswith("__")
           for seg in segments):
        return check_name(key)  # every segment escapes to itself: the name is the key
    names = []
    for seg in segments:
        if not _ESCAPED_SEGMENT.match(seg) or seg in (".", "..") or seg.startswith("__"):
            raise InvalidNameError(f"array path {key!r} has a segment {seg!r} that is not a canonical escape", file=key)
        raw = bytearray()
        i = 0
        while i < len(seg):
            if seg[i] == "%":
                raw.append(int(seg[i + 1 : i + 3], 16))
                i += 3
            else:
                raw.append(ord(seg[i]))
                i += 1
        try:
            names.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidNameError(f"array path {key!r} does not decode as UTF-8", file=key) from None
    name = "/".join(names)
    check_name(name)
    if to_key(name) != key:
        raise InvalidNameError(f"array path {key!r} is not the canonical escape of {name!r}", file=key)
    return name


