"""Framework checkpoint dicts as ucl state dicts, faithfully: what ucl stores natively stays native, the
rest is converted and converted back.

A training framework hands over a dict holding tensors, JSON values and a few other Python objects
(``OrderedDict`` with ``_metadata``, numpy arrays in RNG states, dict keys that are tuples, hyperparameter
namespaces, ...). ucl stores tensors and JSON-able values and never pickles (spec/core.md §5.3), so
:func:`encode` maps such a dict onto what ucl stores and :func:`decode` maps it back:

- tensors (of a dtype of spec/core.md §4), ``None``, bools, ints, floats, strings, exact lists, tuples and
  dicts with str / int keys: stored as they are, under the names their keys give
  (``state_dict/layer.weight`` is readable with ``ucl.open`` or zarr without this module);
- ``OrderedDict`` and Lightning's ``AttributeDict``: stored as dicts, their class and an ``OrderedDict``'s
  ``_metadata`` (module versions) recorded in a side table under the top-level key ``__ucl_meta__``;
- numpy arrays: as tensors, marked to come back as numpy arrays;
- a dict whose keys are not plain (a tuple, a bool, "", a "/" in a string, a reserved ``__ucl`` prefix):
  as a tagged node of its keys and values;
- anything else (an Enum, a ``Namespace``, a set, an int beyond 64 bits, a tensor subclass or dtype
  ucl does not store): ``torch.save`` bytes in a uint8 tensor, loaded back with ``torch.load`` under
  the caller's ``weights_only`` (so such a value is exactly as safe, or unsafe, as with torch.save
  checkpoints; ``weights_only=True`` refuses arbitrary classes as torch does).

A tensor's device is recorded when it is not the CPU, so ``map_location`` has the meaning
``torch.load`` gives it (a function of (storage, location), a device, or a dict of locations).
"""

from __future__ import annotations

import collections
import importlib
import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ucl.errors import UCLError
from ucl.format import dtypes

__all__ = ["META_KEY", "decode", "encode", "place"]

META_KEY = "__ucl_meta__"
_TAG = "__ucl__"
_INT64 = (-(1 << 63), (1 << 63) - 1)
# dict subclasses rebuilt as cls(dict): constructible from their items, no other state
_DICT_CLASSES = {
    "collections.OrderedDict",
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain_key(k: Any) -> bool:
    if type(k) is int:
        return _INT64[0] <= k <= _INT64[1]
    return (type(k) is str and k != "" and "/" not in k and not k.startswith("__ucl")
            and not any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in k))


def _storable_tensor(t: torch.Tensor) -> bool:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_quantized:
        return False
    if t.device.type == "meta":
        return False
    try:
        dtypes.from_torch(t.dtype)
    except UCLError:
        return False
    return True


def _pickled(obj: Any) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return {_TAG: "object", "torch_save": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}


def encode(obj: dict[str, Any]) -> dict[str, Any]:
    """The ucl state dict of a framework checkpoint dict (see the module docstring)."""
    types: dict[str, str] = {}
    attrs: dict[str, Any] = {}
    devices: dict[str, str] = {}

    def walk(x: Any, path: list[Any]) -> Any:
        if isinstance(x, torch.Tensor):
            if not _storable_tensor(x):
                return _pickled(x)
            if x.device.type != "cpu":
                devices[json.dumps(path)] = str(x.device)
            return x.detach()
        if x is None or type(x) in (bool, str, float):
            return x
        if type(x) is int:
            return x if _INT64[0] <= x <= _INT64[1] else _pickled(x)
        if type(x) is list:
            return [walk(v, [*path, i]) for i, v in enumerate(x)]
        if type(x) is tuple:
            return tuple(walk(v, [*path, i]) for i, v in enumerate(x))
        if (isinstance(x, np.ndarray) and type(x) is np.ndarray and x.dtype.kind in "biufc"
                and x.dtype.byteorder in "=|<"):
            try:
                t = torch.from_numpy(np.ascontiguousarray(x))
                dtypes.from_torch(t.dtype)
            except (TypeError, UCLError):
                return _pickled(x)
            types[json.dumps(path)] = "numpy.ndarray"
            return t.clone()
        if isinstance(x, dict):
            name = _qualname(type(x))
            if type(x) is not dict and name not in _DICT_CLASSES:
                return _pickled(x)
            if type(x) is not dict:
                types[json.dumps(path)] = name
                meta = getattr(x, "_metadata", None)
                if meta is not None:
                    attrs[json.dumps(path)] = {"_metadata": _pickled(meta) if not _jsonable(meta) else meta}
            if all(_plain_key(k) for k in x):
                return {k: walk(v, [*path, k]) for k, v in x.items()}
            keys = list(x)
            return {_TAG: "pairs", "keys": [walk(k, [*path, "keys", i]) for i, k in enumerate(keys)],
                    "values": [walk(x[k], [*path, "values", i]) for i, k in enumerate(keys)]}
        return _pickled(x)

    out = walk(obj, [])
    if not isinstance(out, dict) or _TAG in out:
        raise TypeError(f"a checkpoint must be a dict, got {type(obj).__name__}")
    out[META_KEY] = {"format": 1, "types": types, "attrs": attrs, "devices": devices}
    return out


def _jsonable(x: Any) -> bool:
    if x is None or type(x) in (bool, str, float):
        return True
    if type(x) is int:
        return _INT64[0] <= x <= _INT64[1]
    if type(x) in (list, tuple):
        return all(_jsonable(v) for v in x)
    if type(x) is dict or isinstance(x, collections.OrderedDict):
        return all(_plain_key(k) and _jsonable(v) for k, v in x.items())
    return False


def place(t: torch.Tensor, saved_on: str, map_location: Any) -> torch.Tensor:
    """``t`` (read on the CPU) where ``torch.load(map_location=...)`` would put a tensor saved on ``saved_on``."""
    if map_location is None:
        target: Any = saved_on
    elif isinstance(map_location, dict):
        target = map_location.get(saved_on, saved_on)
    elif isinstance(map_location, str | torch.device):
        target = map_location
    elif callable(map_location):
        res = map_location(t.untyped_storage(), saved_on)
        target = saved_on if res is None else res.device
    else:
        raise TypeError(f"map_location must be None, a device, a str, a dict or a callable, got {map_location!r}")
    target = torch.device(target)
    return t if t.device == target else t.to(target)


def decode(state: dict[str, Any], map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]:
    """The framework checkpoint dict :func:`encode` was given, from the state ``ucl.load`` returned.

    ``map_location`` as for ``torch.load`` (default: every tensor on the CPU); ``weights_only`` is
    passed to ``torch.load`` for values stored as ``torch.save`` bytes (None: torch's default).
    """
    state = dict(state)
    meta = state.pop(META_KEY, None) or {"types": {}, "attrs": {}, "devices": {}}
    types, attrs, devices = meta.get("types", {}), meta.get("attrs", {}), meta.get("devices", {})

    def unpickle(t: torch.Tensor) -> Any:
        buf = io.BytesIO(t.numpy().tobytes())
        kw: dict[str, Any] = {} if weights_only is None else {"weights_only": weights_only}
        return torch.load(buf, map_location=map_location if map_location is not None else None, **kw)

    def walk(x: Any, path: list[Any]) -> Any:
        key = json.dumps(path)
        if isinstance(x, torch.Tensor):
            if types.get(key) == "numpy.ndarray":
                return x.numpy()
            return place(x, devices.get(key, "cpu"), map_location)
        if isinstance(x, list):
            return [walk(v, [*path, i]) for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return tuple(walk(v, [*path, i]) for i, v in enumerate(x))
        if isinstance(x, dict):
            tag = x.get(_TAG)
            if tag == "object":
                return unpickle(x["torch_save"])
            if tag == "pairs":
                ks = [walk(k, [*path, "keys", i]) for i, k in enumerate(x["keys"])]
                vs = [walk(v, [*path, "values", i]) for i, v in enumerate(x["values"])]
                d: dict[Any, Any] = dict(zip(ks, vs, strict=True))
            else:
                d = {k: walk(v, [*path, k]) for k, v in x.items()}
            cls = types.get(key)
            if cls is not None:
                d = _dict_class(cls)(d)
                md = attrs.get(key, {}).get("_metadata")
                if md is not None:
                    md = unpickle(md["torch_save"]) if isinstance(md, dict) and md.get(_TAG) == "object" else md
                    d._metadata = md  # type: ignore[attr-defined]
            return d
        return x

    return walk(state, [])


def _dict_class(name: str) -> Callable[[dict[Any, Any]], dict[Any, Any]]:
    if name not in _DICT_CLASSES:
        raise TypeError(f"a checkpoint records a dict of class {name!r}, not one this module rebuilds")
    mod, _, cls = name.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), cls)  # type: ignore[no-any-return]
    except ImportError:  # e.g. lightning not installed where the checkpoint is read: a plain dict
        return dict
