"""zarr-python data types for the spec's types that core zarr v3 lacks: bfloat16, float8_e4m3fn,
float8_e5m2 (spec/core.md §4; numpy dtypes from ml_dtypes).

Registered by entry point (pyproject.toml, ``zarr.data_type``), so with zarr >= 3.4 a plain
``zarr.open`` of a ucl step reads them once ucl is installed; zarr 3.1 lists the entry points but never
loads them (its registry's ``match_json`` skips ``_lazy_load``), so there :func:`register` is needed.
Needs only numpy, ml_dtypes and zarr (no torch), so a zarr-only environment reads ucl steps; the classes
are built on first use, so importing this module does not import zarr.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np

NAMES: tuple[str, ...] = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
_ATTRS = {"BFloat16": "bfloat16", "Float8E4M3FN": "float8_e4m3fn", "Float8E5M2": "float8_e5m2"}
_TYPES: dict[str, type] = {}


# BaseFloat's methods that do not depend on byte order: the one-byte types take them, not its class
_ORDER_FREE = ("_check_json_v3", "_from_json_v3", "_check_scalar", "_cast_scalar_unchecked", "cast_scalar",
               "default_scalar", "from_json_scalar", "to_json_scalar")


def _build() -> dict[str, type]:
    from zarr.core.dtype.common import DataTypeValidationError, HasItemSize
    from zarr.core.dtype.npy.float import BaseFloat
    from zarr.core.dtype.wrapper import ZDType

    class _Native:
        """What the three types share: one numpy dtype (ml_dtypes), zarr v3 only."""

        _np: ClassVar[np.dtype]
        _zarr_v3_name: ClassVar[str]
        _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

        @classmethod
        def _check_native_dtype(cls, dtype: object) -> bool:
            return isinstance(dtype, np.dtype) and dtype == cls._np

        @classmethod
        def from_native_dtype(cls, dtype: object):  # type: ignore[no-untyped-def]
            if cls._check_native_dtype(dtype):
                return cls()
            raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {cls._np}")

        def to_native_dtype(self):  # type: ignore[no-untyped-def]
            return self._np

        @property
        def item_size(self) -> int:
            return int(self._np.itemsize)

    class _OneByte(_Native):
        """A one-byte float has no byte order: zarr >= 3.4 requires the bytes codec's ``endian`` for every
        HasEndianness type (BaseFloat is one), while ucl, like zarr for int8, omits it for one-byte types
        (spec/core.md §6), so these are not BaseFloats."""

        @classmethod
        def _check_json_v2(cls, data: object) -> bool:
            return False

        @classmethod
        def _from_json_v2(cls, data: object):  # type: ignore[no-untyped-def]
            raise DataTypeValidationError(f"{cls._zarr_v3_name} is a zarr v3 data type only")

        def to_json(self, zarr_format: int) -> str:
            if zarr_format != 3:
                raise ValueError(f"{self._zarr_v3_name} is a zarr v3 data type only")
            return self._zarr_v3_name

    def make(name: str) -> type:
        np_dtype = np.dtype(getattr(ml_dtypes, name))
        attrs: dict[str, object] = {"_zarr_v3_name": name, "_np": np_dtype, "dtype_cls": type(np_dtype),
                                    "__module__": __name__}
        if np_dtype.itemsize == 1:
            attrs.update({m: BaseFloat.__dict__[m] for m in _ORDER_FREE})
            bases: tuple[type, ...] = (_OneByte, ZDType, HasItemSize)
        else:
            bases = (_Native, BaseFloat)
        return dataclass(frozen=True, kw_only=True)(type(f"ZarrDType_{name}", bases, attrs))

    return {n: make(n) for n in NAMES}


def zarr_type(name: str) -> type:
    """The zarr-python data type class of ``name`` (one of :data:`NAMES`)."""
    if not _TYPES:
        _TYPES.update(_build())
    return _TYPES[name]


def register() -> None:
    """Register the three types with zarr-python's data-type registry (idempotent)."""
    from zarr.core.dtype import data_type_registry

    for name in NAMES:
        if name not in data_type_registry.contents:  # type: ignore[attr-defined]
            data_type_registry.register(name, zarr_type(name))  # type: ignore[attr-defined]


def __getattr__(attr: str) -> type:  # the entry points: ucl.format.zarr_dtypes:BFloat16 etc.
    if attr in _ATTRS:
        return zarr_type(_ATTRS[attr])
    raise AttributeError(attr)
