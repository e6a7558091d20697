"""Hypothesis strategies for delta tests: arrays of every dtype as bit patterns, with special values."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

# dtype name -> numpy dtype of the values (the codec sees their unsigned bit view)
DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int32": np.dtype(np.int32),
    "float32": np.dtype(np.float32),
    "int64": np.dtype(np.int64),
    "uint64": np.dtype(np.uint64),
    "float64": np.dtype(np.float64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
}

# Bit patterns worth having in every float array: NaNs with payloads, +-inf, -0.0, subnormals, extremes.
SPECIAL_BITS: dict[int, list[int]] = {
    2: [0x7E01, 0xFFFF, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x03FF, 0x7F80, 0xFF80, 0x7FC1, 0x0040],
    4: [0x7FC00001, 0xFFBADBAD, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF],
    8: [
        0x7FF8000000000001,
        0xFFF0000000000000,
        0x7FF0000000000000,
        0x8000000000000000,
        1,
        0x000FFFFFFFFFFFFF,
    ],
    1: [0x7F, 0xFF, 0x80, 0x01, 0x7C, 0xFC],
}


def words_of(values: np.ndarray) -> np.ndarray:
    from ucl.delta import bit_view

    return bit_view(values)


@st.composite
def arrays(draw: st.DrawFn, dtype: np.dtype, n: int) -> np.ndarray:
    """n values of dtype from random bytes, with special bit patterns sprinkled in."""
    raw = np.frombuffer(
        draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize)), np.uint8
    ).copy()
    a = raw.view(dtype)
    if dtype == np.bool_:
        a = (raw & 1).astype(np.bool_)
    w = words_of(a)
    specials = SPECIAL_BITS.get(w.dtype.itemsize, [])
    if n and specials and draw(st.booleans()):
        k = draw(st.integers(1, min(n, 8)))
        for _ in range(k):
            w[draw(st.integers(0, w.size - 1))] = draw(st.sampled_from(specials))
    return a


def perturb(rng: np.random.Generator, a: np.ndarray, how: str) -> np.ndarray:
    """The next step's values: like training (small relative changes), sparse edits, or unchanged."""
    b = a.copy()
    w = words_of(b)
    if how == "same" or w.size == 0:
        return b
    if how == "small":  # flip low bits of most words: like an optimizer step on floats
        keep = max(1, w.dtype.itemsize * 8 // 2)
        noise = rng.integers(0, 1 << keep, w.size, dtype=np.uint64).astype(w.dtype)
        mask = rng.random(w.size) < 0.8
        w[mask] ^= noise[mask]
    elif how == "sparse":  # a few words change completely (embedding rows, a frozen model's head)
        idx = rng.integers(0, w.size, max(1, w.size // 50))
        w[idx] = rng.integers(0, np.iinfo(w.dtype).max, idx.size, dtype=w.dtype, endpoint=True)
    elif how == "random":
        w[:] = rng.integers(0, np.iinfo(w.dtype).max, w.size, dtype=w.dtype, endpoint=True)
    elif how == "special":
        specials = SPECIAL_BITS.get(w.dtype.itemsize, [0])
        idx = rng.integers(0, w.size, max(1, w.size // 10))
        w[idx] = rng.choice(np.array(specials, dtype=np.uint64), idx.size).astype(w.dtype)
    if b.dtype == np.bool_:
        b = b.view(np.uint8) & 1
        b = b.astype(np.bool_)
    return b


HOW = ["same", "small", "sparse", "random", "special"]
