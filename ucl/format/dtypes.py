"""Data types: torch <-> the spec's names (zarr v3 / tensorstore spellings) <-> numpy (ml_dtypes).

bfloat16 and float8 are not core zarr v3 types; tensorstore reads them natively under these names and
zarr-python does with :mod:`ucl.format.zarr_dtypes` (no torch needed): zarr >= 3.4 finds them through
ucl's entry points (pyproject.toml); zarr 3.1 never loads data-type entry points, so there
:func:`register_zarr_dtypes` registers them (``ucl.zarr_store`` does).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ucl.errors import UnsupportedDTypeError

# spec name -> (torch dtype, numpy dtype, itemsize). The order is the spec's table (spec/core.md §4).
# bfloat16 and float8's numpy dtypes come from ml_dtypes, imported when one is first asked for
# (to_numpy): its import costs 0.2 s (0.6), 1.6 s (0.7.0), which a torch-only open would pay for nothing.
_TABLE: dict[str, tuple[torch.dtype, np.dtype | str, int]] = {
    "bool": (torch.bool, np.dtype(np.bool_), 1),
    "int8": (torch.int8, np.dtype(np.int8), 1),
    "int16": (torch.int16, np.dtype(np.int16), 2),
    "int32": (torch.int32, np.dtype(np.int32), 4),
    "int64": (torch.int64, np.dtype(np.int64), 8),
    "uint8": (torch.uint8, np.dtype(np.uint8), 1),
    "uint16": (torch.uint16, np.dtype(np.uint16), 2),
    "uint32": (torch.uint32, np.dtype(np.uint32), 4),
    "uint64": (torch.uint64, np.dtype(np.uint64), 8),
    "float16": (torch.float16, np.dtype(np.float16), 2),
    "float32": (torch.float32, np.dtype(np.float32), 4),
    "float64": (torch.float64, np.dtype(np.float64), 8),
    "bfloat16": (torch.bfloat16, "bfloat16", 2),
    "float8_e4m3fn": (torch.float8_e4m3fn, "float8_e4m3fn", 1),
    "float8_e5m2": (torch.float8_e5m2, "float8_e5m2", 1),
    "complex64": (torch.complex64, np.dtype(np.complex64), 8),
    "complex128": (torch.complex128, np.dtype(np.complex128), 16),
}
_BY_TORCH = {t: name for name, (t, _, _) in _TABLE.items()}
# Unsigned integer of the same width: the bit pattern view used for checksums and deltas.
_UINT = {1: torch.uint8, 2: torch.uint16, 4: torch.int32, 8: torch.int64, 16: torch.int64}

SPEC_DTYPES: tuple[str, ...] = tuple(_TABLE)


def from_torch(dtype: torch.dtype, tensor: str | None = None) -> str:
    """The spec name of a torch dtype; raises UnsupportedDTypeError for others (naming ``tensor``, when
    given: the tensor of that dtype a writer was asked to store)."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        pass
    what = f"tensor {tensor!r} has dtype {dtype}" if tensor is not None else f"torch dtype {dtype}"
    raise UnsupportedDTypeError(f"{what}, which is not one of ucl's data types ({', '.join(_TABLE)}; "
                                f"spec/core.md §4): {_convert_hint(dtype)}", tensor=tensor)


def _convert_hint(dtype: torch.dtype) -> str:
    """What to store instead of a tensor of ``dtype`` (a dtype outside the table)."""
    if dtype == torch.complex32:
        return "store t.to(torch.complex64) (exact)"
    if dtype in _QUANTIZED:
        return "store t.dequantize(), or t.int_repr() with its scales and zero points"
    bits = f"t.view(torch.uint{8 * dtype.itemsize})" if dtype.itemsize in (1, 2, 4, 8) else None
    if dtype.is_floating_point and "_x" not in str(dtype):  # float8 variants (fnuz, e8m0); not packed float4
        return "store t.to(torch.float32) (its values)" + (f" or {bits} (its bit patterns)" if bits else "")
    if bits is not None and not dtype.is_complex:  # packed sub-byte types, bits8/16
        return f"store its bit patterns, {bits}"
    return "convert it to one of these data types first"


_QUANTIZED = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, n))


def check(name: object) -> str:
    """Return ``name`` when it is a spec data type name, else raise UnsupportedDTypeError."""
    if not isinstance(name, str) or name not in _TABLE:
        raise UnsupportedDTypeError(f"data type {name!r} is not one of the spec's: {', '.join(_TABLE)}")
    return name


def to_torch(name: str) -> torch.dtype:
    return _TABLE[check(name)][0]


def to_numpy(name: str) -> np.dtype:
    dt = _TABLE[check(name)][1]
    if isinstance(dt, str):
        import ml_dtypes

        dt = np.dtype(getattr(ml_dtypes, dt))
        t, _, size = _TABLE[name]
        _TABLE[name] = (t, dt, size)
    return dt


_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
_BY_NUMPY = {dt: name for name, (_, dt, _) in _TABLE.items() if name not in _ML_DTYPES}


def from_numpy(dt: np.dtype) -> str | None:
    """The spec name of a (native byte order) numpy dtype, None for others. A value of bfloat16 or float8
    can only exist once ml_dtypes is imported, so only then is it looked for."""
    name = _BY_NUMPY.get(dt)
    if name is None and "ml_dtypes" in sys.modules:
        name = {to_numpy(n): n for n in _ML_DTYPES}.get(dt)
    return name


def itemsize(name: str) -> int:
    return _TABLE[check(name)][2]


def fill_value_json(name: str) -> bool | int | float | list[float]:
    """The JSON fill value (zero) of a data type, as zarr v3 writes it."""
    if name == "bool":
        return False
    if name.startswith(("int", "uint")):
        return 0
    if name.startswith("complex"):
        return [0.0, 0.0]
    return 0.0


def register_zarr_dtypes() -> None:
    """Register bfloat16 and float8 with zarr-python's data-type registry (idempotent; the classes live in
    :mod:`ucl.format.zarr_dtypes`, which needs no torch)."""
    from ucl.format import zarr_dtypes

    zarr_dtypes.register()
