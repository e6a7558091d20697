"""The structure tree of a step (spec/core.md): how a nested state dict maps to flat tensor names.

:func:`flatten` turns a state dict (tensors in dicts, lists and tuples, with JSON-able leaves) into
``{name: tensor}`` and a JSON tree that records everything else; :func:`unflatten` inverts it;
:func:`graft` builds the tree of a state whose tensors are placed by the "/" of their names (a step
saved under a layout, a reshard load).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import math
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ucl.errors import InvalidArgumentError, InvalidNameError, LimitExceededError, SchemaError
from ucl.format import dtypes
from ucl.format.names import MAX_DEPTH, check_name

# -- typed values (spec/core.md §5.3 items 4-9) ------------------------------------------------------
INLINE_BYTES = 1 << 16
"""The most data bytes a numpy array (or, in per-rank state, a tensor) is stored inline as an ``ndarray``
node; a larger numpy array of the state is stored as a tensor (an array of the step)."""

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # the integers a JSON document holds (§3.4 item 3)
_MAX_INT_DIGITS = 4300  # Python's default bound on int <-> str conversions
_KINDS = ("dict", "list", "tuple", "tensor", "value", "float", "int", "bytes", "numpy", "ndarray",
          "namespace", "pyrandom")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(s: Any) -> bytes | None:
    """The bytes of a canonical base64 string (RFC 4648, padded), None when it is not one."""
    if not isinstance(s, str):
        return None
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if base64.b64encode(raw).decode("ascii") == s else None


def _np_name(dt: np.dtype, what: str, path: list[str]) -> str:
    name = dtypes.from_numpy(dt.newbyteorder("=")) if dt.fields is None else None
    if name is None:
        raise InvalidArgumentError(
            f"state dict value at {'/'.join(path)!r} is a {what} of dtype {dt}; ucl stores numpy values of "
            f"the data types {', '.join(dtypes.SPEC_DTYPES)} (spec/core.md §4), never pickles")
    return name


def _le_bytes(arr: np.ndarray) -> bytes:
    """The little-endian C-order bytes of ``arr``."""
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr).tobytes()


def _numpy_scalar(obj: Any, path: list[str]) -> dict[str, Any]:
    name = _np_name(obj.dtype, "numpy scalar", path)
    if name == "bool":
        return {"t": "numpy", "dtype": name, "v": bool(obj)}
    if name.startswith(("int", "uint")):
        return {"t": "numpy", "dtype": name, "v": int(obj)}
    if not name.startswith("complex"):
        f = float(obj)
        if math.isfinite(f):
            return {"t": "numpy", "dtype": name, "v": f}
    return {"t": "numpy", "dtype": name, "b64": _b64(_le_bytes(np.asarray(obj)))}  # complex, NaN, inf


def _ndarray(arr: np.ndarray, path: list[str]) -> dict[str, Any]:
    name = _np_name(arr.dtype, "numpy array", path)
    return {"t": "ndarray", "dtype": name, "shape": list(arr.shape), "b64": _b64(_le_bytes(arr))}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensor_from_numpy(arr: np.ndarray) -> torch.Tensor:
    """A tensor holding ``arr``'s values (the dtypes numpy and torch spell differently through their bits)."""
    arr = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("="), copy=False))
    if not arr.flags.writeable:
        arr = arr.copy()
    name = dtypes.from_numpy(arr.dtype)
    assert name is not None, arr.dtype  # checked by _np_name when the value was stored
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        bits = torch.from_numpy(arr.view(np.uint16 if arr.dtype.itemsize == 2 else np.uint8))
        return bits.view(dtypes.to_torch(name))
    return torch.from_numpy(arr)


def _numpy_from_tensor(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu")
    name = dtypes.from_torch(t.dtype)
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        bits = t.view(torch.uint16 if t.element_size() == 2 else torch.uint8).numpy()
        return bits.view(dtypes.to_numpy(name))
    return t.numpy()


def _pyrandom(obj: tuple[Any, ...]) -> dict[str, Any] | None:
    """``random.getstate()`` (version, 625 words, gauss_next) as one node, None for another tuple."""
    if (type(obj) is tuple and len(obj) == 3 and type(obj[0]) is int and _INT_MIN <= obj[0] <= _INT_MAX
            and type(obj[1]) is tuple and all(type(w) is int and 0 <= w < 1 << 32 for w in obj[1])
            and (obj[2] is None or (type(obj[2]) is float and math.isfinite(obj[2])))):
        return {"t": "pyrandom", "version": obj[0], "state": list(obj[1]), "gauss": obj[2]}
    return None


def _looks_like_pyrandom(obj: Any) -> bool:
    return type(obj) is tuple and len(obj) == 3 and type(obj[1]) is tuple and len(obj[1]) == 625


# -- nested state dicts ----------------------------------------------------------------------------
def _key_str(k: object) -> str:
    if isinstance(k, bool) or not isinstance(k, str | int):
        raise InvalidArgumentError(f"state dict keys must be str or int, got {type(k).__name__} ({k!r})")
    return str(k)


class _Encoder:
    """One walk of a state: nodes out, tensors collected (``inline``: small tensors become ``ndarray``
    nodes with ``torch`` true and no node is a tensor node, for per-rank state)."""

    def __init__(self, inline: bool, what: str) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.inline, self.what = inline, what

    def fail(self, path: list[str], msg: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self.what} value at {'/'.join(path)!r} {msg}")

    def tensor(self, obj: torch.Tensor, path: list[str], as_ndarray: bool = False) -> dict[str, Any]:
        if self.inline:
            if obj.layout != torch.strided or obj.is_quantized or type(obj) not in (torch.Tensor, torch.nn.Parameter):
                raise self.fail(path, f"is a {type(obj).__name__} ({obj.layout}); per-rank state holds plain "
                                "dense tensors")
            name = dtypes.from_torch(obj.dtype, "/".join(path))
            if obj.numel() * obj.element_size() > INLINE_BYTES:
                raise self.fail(path, f"is a tensor of {obj.numel() * obj.element_size()} bytes; per-rank state "
                                f"holds small values ({INLINE_BYTES} bytes at most each): put it in the state")
            return {"t": "ndarray", "dtype": name, "shape": list(obj.shape), "b64": _b64(_tensor_bytes(obj)),
                    "torch": True}
        name = check_name("/".join(path)) if path else "tensor"
        if name in self.tensors:  # {"a/b": x, "a": {"b": y}} flatten to the same name
            raise InvalidNameError(f"two tensors of the state dict flatten to the name {name!r}", tensor=name)
        self.tensors[name] = obj
        return {"t": "tensor", "name": name, "as": "ndarray"} if as_ndarray else {"t": "tensor", "name": name}

    def walk(self, obj: Any, path: list[str], depth: int) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise LimitExceededError(f"{self.what} nests deeper than {MAX_DEPTH} levels at {'/'.join(path)!r}")
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, np.generic) and not isinstance(obj, str | bytes):
            return _numpy_scalar(obj, path)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise self.fail(path, f"is a numpy array of dtype {obj.dtype}; ucl stores numeric arrays, never "
                                "pickles")
            if obj.nbytes <= INLINE_BYTES:
                return _ndarray(obj, path)
            if self.inline:
                raise self.fail(path, f"is a numpy array of {obj.nbytes} bytes; per-rank state holds small values "
                                f"({INLINE_BYTES} bytes at most each): put it in the state")
            _np_name(obj.dtype, "numpy array", path)
            return self.tensor(_tensor_from_numpy(obj), path, as_ndarray=True)
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                items.append([k if isinstance(k, int) else _key_str(k), self.walk(v, [*path, _key_str(k)], depth + 1)])
            return {"t": "dict", "items": items}
        if type(obj) is argparse.Namespace:
            return {"t": "namespace",
                    "items": [[k, self.walk(v, [*path, k], depth + 1)] for k, v in vars(obj).items()]}
        if isinstance(obj, list | tuple):
            if _looks_like_pyrandom(obj):
                node = _pyrandom(obj)  # type: ignore[arg-type]
                if node is not None:
                    return node
            kind = "list" if isinstance(obj, list) else "tuple"
            return {"t": kind, "items": [self.walk(v, [*path, str(i)], depth + 1) for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, bool | str):
            return {"t": "value", "v": str(obj) if isinstance(obj, str) and type(obj) is not str else obj}
        if isinstance(obj, int):
            obj = int(obj)
            if _INT_MIN <= obj <= _INT_MAX:
                return {"t": "value", "v": obj}
            return {"t": "int", "v": str(obj)}
        if isinstance(obj, float):
            obj = float(obj)
            return {"t": "value", "v": obj} if math.isfinite(obj) else {"t": "float", "v": repr(obj)}
        if isinstance(obj, bytes | bytearray):
            return {"t": "bytes", "b64": _b64(bytes(obj))}
        raise self.fail(path, f"is a {type(obj).__name__}; ucl stores tensors, JSON-able values (numbers, strings, "
                        "bools, None, lists, dicts) and the typed values of spec/core.md §5.3 (numpy scalars and "
                        "arrays, bytes, argparse.Namespace, RNG states), never pickles")


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a nested state dict into flat tensors and a JSON tree that rebuilds its structure.

    Returns ``(tensors, tree)``: ``tensors`` maps "/"-joined names to tensors; ``tree`` records dicts
    (with int or str keys), lists, tuples, JSON-able leaves (numbers, strings, bools, None) and the typed
    values of spec/core.md §5.3 (numpy scalars and arrays, bytes, big integers, ``argparse.Namespace``,
    ``random.getstate()``), so that :func:`unflatten` returns a state dict equal to the input (optimizer
    ``param_groups`` included). A numpy array of more than :data:`INLINE_BYTES` is stored as a tensor and
    comes back as a numpy array.
    """
    enc = _Encoder(inline=False, what="state dict")
    tree = enc.walk(state, [], 0)
    return enc.tensors, tree


def encode_value(obj: Any, what: str = "per-rank state") -> dict[str, Any]:
    """One value as a tree node without tensor nodes (spec/core.md §5.3 item 9: per-rank state): small
    tensors (at most :data:`INLINE_BYTES`) inline as ``ndarray`` nodes, larger values refused."""
    return _Encoder(inline=True, what=what).walk(obj, [], 1)


def decode_value(node: Mapping[str, Any]) -> Any:
    """Inverse of :func:`encode_value` (the node checked by :func:`iter_tree_tensors` first)."""
    return unflatten(node, {})


def with_ranks(tree: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``tree`` (a dict root) carrying the per-rank state ``nodes``, item r the data-parallel rank r's."""
    if tree.get("t") != "dict":
        raise InvalidArgumentError("per-rank state needs a state dict at the top of the state")
    return {**tree, "ranks": list(nodes)}


def rank_nodes(tree: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The per-rank state nodes of a step's tree (spec/core.md §5.3 item 9), None when it has none."""
    ranks = tree.get("ranks") if tree.get("t") == "dict" else None
    return list(ranks) if isinstance(ranks, list) else None


def _decode_numpy(node: Mapping[str, Any]) -> Any:
    dt = dtypes.to_numpy(node["dtype"])
    if "b64" in node:
        return np.frombuffer(base64.b64decode(node["b64"]), dtype=dt)[0]
    return dt.type(node["v"])


def _decode_ndarray(node: Mapping[str, Any]) -> Any:
    raw = base64.b64decode(node["b64"])
    shape = tuple(node["shape"])
    if node.get("torch"):
        dtype = dtypes.to_torch(node["dtype"])
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    return np.frombuffer(raw, dtype=dtypes.to_numpy(node["dtype"])).reshape(shape).copy()


def unflatten(tree: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
    """Inverse of :func:`flatten`: rebuild the nested state dict from its tree and loaded tensors."""

    def build(node: Mapping[str, Any], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise LimitExceededError(f"structure tree nests deeper than {MAX_DEPTH} levels")
        t = node.get("t")
        if t == "tensor":
            value = tensors[node["name"]]
            if node.get("as") == "ndarray" and isinstance(value, torch.Tensor):
                return _numpy_from_tensor(value)
            return value
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
        if t == "int":
            return int(node["v"])
        if t == "bytes":
            return base64.b64decode(node["b64"])
        if t == "numpy":
            return _decode_numpy(node)
        if t == "ndarray":
            return _decode_ndarray(node)
        if t == "namespace":
            return argparse.Namespace(**{k: build(v, depth + 1) for k, v in node["items"]})
        if t == "pyrandom":
            return (node["version"], tuple(node["state"]), node["gauss"])
        raise InvalidNameError(f"structure tree has a node of unknown type {t!r}")

    return build(tree, 0)


_DECIMAL = re.compile(r"-?(0|[1-9][0-9]*)")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _is_real(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _typed_ok(node: dict[str, Any], t: str) -> bool:
    """Whether a leaf node of a typed kind has its form (§5.3 items 4-8)."""
    if t == "value":
        return "v" in node and (node["v"] is None or type(node["v"]) in (bool, int, str)
                                or (type(node["v"]) is float and math.isfinite(node["v"])))
    if t == "float":
        return node.get("v") in ("nan", "inf", "-inf")
    if t == "int":
        v = node.get("v")
        return isinstance(v, str) and len(v) <= _MAX_INT_DIGITS and _DECIMAL.fullmatch(v) is not None
    if t == "bytes":
        return _unb64(node.get("b64")) is not None
    if t == "pyrandom":
        state, gauss = node.get("state"), node.get("gauss")
        return (_is_int(node.get("version")) and isinstance(state, list) and "gauss" in node
                and all(_is_int(w) and 0 <= w < 1 << 32 for w in state) and (gauss is None or _is_real(gauss)))
    name = node.get("dtype")
    if name not in dtypes.SPEC_DTYPES:
        return False
    if t == "numpy":
        if ("v" in node) == ("b64" in node):
            return False
        if "b64" in node:
            raw = _unb64(node["b64"])
            return raw is not None and len(raw) == dtypes.itemsize(name) and (name != "bool" or raw in (b"\0", b"\1"))
        v = node["v"]
        if name == "bool":
            return type(v) is bool
        if name.startswith(("int", "uint")):
            info = np.iinfo(dtypes.to_numpy(name))
            return _is_int(v) and int(info.min) <= v <= int(info.max)
        if name.startswith("complex") or not _is_real(v):
            return False
        return bool(float(dtypes.to_numpy(name).type(v)) == v)
    if t == "ndarray":
        shape = node.get("shape")
        if not (isinstance(shape, list) and len(shape) <= MAX_DEPTH and all(_is_int(d) and d >= 0 for d in shape)):
            return False
        if "torch" in node and type(node["torch"]) is not bool:
            return False
        raw = _unb64(node.get("b64"))
        return (raw is not None and len(raw) == math.prod(shape) * dtypes.itemsize(name)
                and (name != "bool" or not raw.translate(None, b"\0\1")))
    return False


def iter_tree_tensors(tree: Mapping[str, Any], what: str = "structure tree") -> Iterator[str]:
    """Names of the tensors a structure tree refers to, checking its form as it goes (spec/core.md §5.3).

    Raises SchemaError for a node that is not one of the spec's (a tensor node among the per-rank state
    included), LimitExceededError past MAX_DEPTH, so that :func:`unflatten` can trust the tree.
    """
    stack: list[tuple[Any, int, bool]] = [(tree, 0, False)]
    if isinstance(tree, dict) and tree.get("t") == "dict" and "ranks" in tree:
        ranks = tree["ranks"]
        if not isinstance(ranks, list):
            raise SchemaError(f"{what}: the structure tree's ranks is not a list of nodes", file=what)
        stack.extend((n, 1, True) for n in ranks)
    while stack:
        node, depth, per_rank = stack.pop()
        if depth > MAX_DEPTH:
            raise LimitExceededError(f"{what}: the structure tree nests deeper than {MAX_DEPTH} levels", file=what)
        t = node.get("t") if isinstance(node, dict) else None
        items = node.get("items") if t in ("dict", "list", "tuple", "namespace") else None
        if t == "tensor" and isinstance(node.get("name"), str) and node.get("as", "ndarray") == "ndarray":
            if per_rank:
                raise SchemaError(f"{what}: the per-rank state names tensor {node['name']!r}; it holds values only",
                                  file=what)
            yield node["name"]
        elif t in ("dict", "namespace") and isinstance(items, list) and all(
                isinstance(i, list) and len(i) == 2 and type(i[0]) in ((str, int) if t == "dict" else (str,))
                for i in items):
            stack.extend((v, depth + 1, per_rank) for _, v in items)
        elif t in ("list", "tuple") and isinstance(items, list):
            stack.extend((v, depth + 1, per_rank) for v in items)
        elif t in _KINDS and t not in ("dict", "list", "tuple", "namespace", "tensor") and _typed_ok(node, t):
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
    if t in ("dict", "namespace"):
        items = []
        for k, v in node["items"]:
            s = _strip(v)
            if s is not None:
                items.append([k, s])
        if node["items"] and not items:
            return None
        return {"t": t, "items": items}
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
    if tree and rank_nodes(tree) is not None:  # per-rank state stays at the root (§5.3 item 9)
        root["ranks"] = rank_nodes(tree)
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
