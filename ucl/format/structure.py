"""The structure tree of a step (spec/core.md): how a nested state dict maps to flat tensor names.

:func:`flatten` turns a state dict (tensors in dicts, lists and tuples, with JSON-able leaves) into
``{name: tensor}`` and a JSON tree that records everything else; :func:`unflatten` inverts it;
:func:`graft` builds the tree of a state whose tensors are placed by the "/" of their names (a step
saved under a layout, a reshard load).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ucl.errors import InvalidArgumentError, InvalidNameError, LimitExceededError, SchemaError
from ucl.format.names import MAX_DEPTH, check_name


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


# -- the structure tree of a layout step -----------------------------------------------------------
_TENSOR = "tensor"


def _strip(node: Any) -> Any:
    """``node`` without its tensor leaves: dict entries holding tensors dropped (a dict emptied that way
    too), list/tuple items that are tensors kept as ``None`` placeholders (positions matter)."""
    t = node.get("t")
    if t == _TENSOR:
        return None
    if t == "dict":
        items = []
        for k, v in node["items"]:
            s = _strip(v)
            if s is not None:
                items.append([k, s])
        if node["items"] and not items:
            return None
        return {"t": "dict", "items": items}
    if t in ("list", "tuple"):
        return {"t": t, "items": [_strip(v) or {"t": "value", "v": None} for v in node["items"]]}
    return node


def graft(tree: Mapping[str, Any] | None, tensor_names: Sequence[str]) -> dict[str, Any]:
    """A structure tree (ucl.format.names) holding the JSON values of ``tree`` and the tensors ``tensor_names``,
    each at the path its "/"-separated segments give.

    The tensors of ``tree`` are dropped first (for a layout step: the coordinator's local tensors, replaced
    by the logical ones; for a reshard load: the step's logical tensors, replaced by the rank's local
    ones). A name whose path is taken by a value is put at the top level under its full name.
    """
    root = _strip(dict(tree)) if tree else None
    if root is None or root.get("t") != "dict":
        root = {"t": "dict", "items": []}
    root = _nest(root)
    for name in tensor_names:
        leaf = {"t": _TENSOR, "name": name}
        if not _insert(root, name.split("/"), leaf):
            if any(str(k) == name for k, _ in root["items"]):
                raise ValueError(f"tensor {name!r} cannot be placed in the structure tree")
            root["items"].append([name, leaf])
    return root


def _nest(node: dict[str, Any]) -> dict[str, Any]:
    """Values under keys holding "/" (a flat state: ``{"optim/step": 2}``) moved to the path the "/" give,
    as tensor names are; kept where they are when that path is taken."""
    if node.get("t") in ("list", "tuple"):
        return {"t": node["t"], "items": [_nest(v) for v in node["items"]]}
    if node.get("t") != "dict":
        return node
    out: dict[str, Any] = {"t": "dict", "items": []}
    later = []
    for k, v in node["items"]:
        v = _nest(v)
        if isinstance(k, str) and "/" in k:
            later.append((k, v))
        else:
            out["items"].append([k, v])
    for k, v in later:
        segs = k.split("/")
        if "" in segs or not _insert(out, segs, v):
            out["items"].append([k, v])
    return out


def _insert(root: dict[str, Any], segs: list[str], leaf: dict[str, Any]) -> bool:
    node = root
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        t = node.get("t")
        if t == "dict":
            hit = next((it for it in node["items"] if str(it[0]) == seg), None)
            if hit is None:
                new = leaf if last else {"t": "dict", "items": []}
                node["items"].append([seg, new])
                node = new
                continue
            child = hit[1]
            if last:
                if child == {"t": "value", "v": None} or (child.get("t") == "dict" and not child["items"]):
                    hit[1] = leaf
                    return True
                return False
            if child.get("t") not in ("dict", "list", "tuple"):
                return False
            node = child
        elif t in ("list", "tuple"):
            if not seg.isdigit() or int(seg) >= len(node["items"]):
                return False
            j = int(seg)
            child = node["items"][j]
            if last:
                if child != {"t": "value", "v": None}:
                    return False
                node["items"][j] = leaf
                return True
            if child == {"t": "value", "v": None}:
                child = node["items"][j] = {"t": "dict", "items": []}
            elif child.get("t") not in ("dict", "list", "tuple"):
                return False
            node = child
        else:
            return False
    return True
