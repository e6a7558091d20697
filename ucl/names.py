"""Tensor names: flattening nested state dicts, the naming rules, and escaping names into storage keys.

Names are data, not paths (spec/core.md §5). A name is "/"-separated segments; each segment is stored
percent-escaped so that no name can produce ".", "..", an empty segment, a reserved "__" prefix or a
byte outside [A-Za-z0-9._-] in a key. Escaping is a bijection, so keys decode back to names exactly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ucl.errors import InvalidArgumentError, InvalidNameError, LimitExceededError, SchemaError

MAX_NAME_BYTES = 1024
MAX_SEGMENT_BYTES = 255
MAX_DEPTH = 32
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_CONTROL = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
_ESCAPED_SEGMENT = re.compile(r"^(?:[A-Za-z0-9._-]|%[0-9A-F]{2})+$")


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid tensor name, else raise InvalidNameError saying why."""
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
    return "/".join(_escape_segment(s) for s in check_name(name).split("/"))


def from_key(key: str) -> str:
    """The tensor name of a storage path; raises InvalidNameError when ``key`` is not a canonical escape."""
    if not isinstance(key, str) or not key:
        raise InvalidNameError(f"array path {key!r} is empty or not a string")
    segments = key.split("/")
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


# -- nested state dicts ----------------------------------------------------------------------------
def _key_str(k: object) -> str:
    if isinstance(k, bool) or not isinstance(k, str | int):
        raise InvalidArgumentError(f"state dict keys must be str or int, got {type(k).__name__} ({k!r})")
    return str(k)


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a nested state dict into flat tensors and a JSON tree that rebuilds its structure.

    Returns ``(tensors, tree)``: ``tensors`` maps "/"-joined names to tensors; ``tree`` records dicts
    (with int or str keys), lists, tuples and JSON-able leaves (numbers, strings, bools, None), so
    that :func:`unflatten` returns a state dict equal to the input (optimizer ``param_groups`` included).
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: list[str], depth: int) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise LimitExceededError(f"state dict nests deeper than {MAX_DEPTH} levels at {'/'.join(path)!r}")
        if isinstance(obj, torch.Tensor):
            name = check_name("/".join(path)) if path else "tensor"
            if name in tensors:  # {"a/b": x, "a": {"b": y}} flatten to the same name
                raise InvalidNameError(f"two tensors of the state dict flatten to the name {name!r}", tensor=name)
            tensors[name] = obj
            return {"t": "tensor", "name": name}
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                items.append([k if isinstance(k, int) else _key_str(k), walk(v, [*path, _key_str(k)], depth + 1)])
            return {"t": "dict", "items": items}
        if isinstance(obj, list | tuple):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {"t": kind, "items": [walk(v, [*path, str(i)], depth + 1) for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, bool | int | str):
            return {"t": "value", "v": obj}
        if isinstance(obj, float):
            return {"t": "value", "v": obj} if math.isfinite(obj) else {"t": "float", "v": repr(obj)}
        raise InvalidArgumentError(
            f"state dict value at {'/'.join(path)!r} is a {type(obj).__name__}; ucl stores tensors and "
            "JSON-able values (numbers, strings, bools, None, lists, dicts), never pickles"
        )

    tree = walk(state, [], 0)
    return tensors, tree


def unflatten(tree: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    """Inverse of :func:`flatten`: rebuild the nested state dict from its tree and loaded tensors."""

    def build(node: Mapping[str, Any], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise LimitExceededError(f"structure tree nests deeper than {MAX_DEPTH} levels")
        t = node.get("t")
        if t == "tensor":
            return tensors[node["name"]]
        if t == "dict":
            return {k: build(v, depth + 1) for k, v in node["items"]}
        if t == "list":
            return [build(v, depth + 1) for v in node["items"]]
        if t == "tuple":
            return tuple(build(v, depth + 1) for v in node["items"])
        if t == "value":
            return node["v"]
        if t == "float":
            return float(node["v"])
        raise InvalidNameError(f"structure tree has a node of unknown type {t!r}")

    return build(tree, 0)


def iter_tree_tensors(tree: Mapping[str, Any], what: str = "structure tree") -> Iterator[str]:
    """Names of the tensors a structure tree refers to, checking its form as it goes (spec/core.md §5.3).

    Raises SchemaError for a node that is not one of the spec's, LimitExceededError past MAX_DEPTH, so that
    :func:`unflatten` can trust the tree.
    """
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise LimitExceededError(f"{what}: the structure tree nests deeper than {MAX_DEPTH} levels", file=what)
        t = node.get("t") if isinstance(node, dict) else None
        items = node.get("items") if t in ("dict", "list", "tuple") else None
        if t == "tensor" and isinstance(node.get("name"), str):
            yield node["name"]
        elif t == "dict" and isinstance(items, list) and all(
                isinstance(i, list) and len(i) == 2 and type(i[0]) in (str, int) for i in items):
            stack.extend((v, depth + 1) for _, v in items)
        elif t in ("list", "tuple") and isinstance(items, list):
            stack.extend((v, depth + 1) for v in items)
        elif t == "value" or (t == "float" and node.get("v") in ("nan", "inf", "-inf")):
            pass
        else:
            raise SchemaError(f"{what}: a structure tree node is malformed: {str(node)[:200]}", file=what)
