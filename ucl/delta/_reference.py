"""Reference implementation of the delta payload (spec/delta.md §5) in numpy + numcodecs' zstd.

Written from the spec, independently of engine/delta.c, to cross-check it: tests decode each backend's
payloads with the other. Simple rather than fast: every plane becomes one zstd frame at ``level``, and
both the delta and the full encoding are made, keeping the smaller. The frame walker checks every
header field it relies on before it allocates or decodes anything.
"""

from __future__ import annotations

import numpy as np
from numcodecs import zstd

from ucl.errors import DeltaChainError, PayloadError

MODE_FULL, MODE_XOR, MODE_SUB = 0, 1, 2
_MAGIC = 0xFD2FB528


def shuffle(words: np.ndarray) -> np.ndarray:
    """Byte-plane shuffle: plane k holds byte k (little-endian) of every word, planes in order."""
    w = words.dtype.itemsize
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, w).T).reshape(-1)


def unshuffle(planes: np.ndarray, dtype: np.dtype) -> np.ndarray:
    w = dtype.itemsize
    return np.ascontiguousarray(planes.reshape(w, -1).T).reshape(-1).view(dtype)


def _transform(new: np.ndarray, base: np.ndarray, mode: int) -> np.ndarray:
    out = np.empty_like(new)
    if mode == MODE_XOR:
        np.bitwise_xor(new, base, out=out)
    else:  # MODE_SUB; unsigned: wraps modulo 2^(8*word)
        np.subtract(new, base, out=out)
    return out


def _payload(mode: int, words: np.ndarray, level: int) -> bytes:
    planes = shuffle(words).reshape(words.dtype.itemsize, -1)
    return bytes([mode]) + b"".join(zstd.compress(p, level) for p in planes)


def encode(new: np.ndarray, base: np.ndarray | None, encoding: int, level: int) -> bytes | None:
    if base is not None and np.array_equal(new, base):
        return None
    full = _payload(MODE_FULL, new, level)
    if base is None:
        return full
    delta = _payload(encoding, _transform(new, base, encoding), level)
    return delta if len(delta) < len(full) else full


def _frame_extent(buf: memoryview, pos: int) -> tuple[int, int, bool]:
    """(content size, end offset, has data blocks) of the zstd frame at ``pos``; RFC 8878 §3.1.1, checked
    field by field."""
    n = len(buf)
    if n - pos < 5 or int.from_bytes(buf[pos : pos + 4], "little") != _MAGIC:
        raise PayloadError(f"delta payload: no zstd frame at offset {pos} (expected magic 28 B5 2F FD)")
    fhd = buf[pos + 4]
    fcs_flag, single, reserved, checksum, did_flag = (
        fhd >> 6,
        (fhd >> 5) & 1,
        (fhd >> 3) & 1,
        (fhd >> 2) & 1,
        fhd & 3,
    )
    if reserved:
        raise PayloadError(f"delta payload: zstd frame at offset {pos} sets the reserved header bit")
    p = pos + 5 + (0 if single else 1)
    did_size = (0, 1, 2, 4)[did_flag]
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if fcs_size == 0:
        raise PayloadError(f"delta payload: zstd frame at offset {pos} has no content size")
    if p + did_size + fcs_size > n:
        raise PayloadError(f"delta payload: zstd frame header at offset {pos} is truncated")
    if int.from_bytes(buf[p : p + did_size], "little") != 0:
        raise PayloadError(f"delta payload: zstd frame at offset {pos} needs a dictionary")
    p += did_size
    size = int.from_bytes(buf[p : p + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    p += fcs_size
    data_blocks = False
    while True:
        if p + 3 > n:
            raise PayloadError(f"delta payload: zstd frame at offset {pos} is truncated (block header)")
        h = int.from_bytes(buf[p : p + 3], "little")
        last, btype, bsize = h & 1, (h >> 1) & 3, h >> 3
        if btype == 3:
            raise PayloadError(f"delta payload: zstd frame at offset {pos} has a reserved block type")
        data_blocks |= bsize > 0 or btype == 2
        p += 3 + (1 if btype == 1 else bsize)
        if p > n:
            raise PayloadError(f"delta payload: zstd frame at offset {pos} is truncated (block data)")
        if last:
            break
    p += 4 * checksum
    if p > n:
        raise PayloadError(f"delta payload: zstd frame at offset {pos} is truncated (checksum)")
    return size, p, data_blocks


def decode(payload: bytes | memoryview | bytearray, base: np.ndarray | None, out: np.ndarray) -> None:
    buf = memoryview(payload).cast("B")
    if len(buf) == 0:
        raise PayloadError("delta payload: empty payload (no mode byte)")
    mode = buf[0]
    if mode not in (MODE_FULL, MODE_XOR, MODE_SUB):
        raise PayloadError(f"delta payload: unknown mode byte {mode} (expected 0 full, 1 xor or 2 sub)")
    if mode != MODE_FULL and base is None:
        raise DeltaChainError("delta payload: a delta payload needs the base chunk, and none was given")
    planes = np.empty(out.nbytes, np.uint8)
    pos, got, frames = 1, 0, 0
    while pos < len(buf):
        size, end, data_blocks = _frame_extent(buf, pos)
        if size > out.nbytes - got:
            raise PayloadError(f"delta payload: the frames decode to more than the chunk's {out.nbytes} bytes")
        if size == 0:  # numcodecs cannot decode empty frames; an empty frame has only empty blocks
            if data_blocks:
                raise PayloadError(
                    f"delta payload: the zstd frame at offset {pos} has content size 0 but data blocks"
                )
            pos, frames = end, frames + 1
            continue
        try:
            zstd.decompress(buf[pos:end], planes[got : got + size])
        except Exception as e:  # numcodecs raises RuntimeError for corrupt frames
            raise PayloadError(f"delta payload: the zstd frame at offset {pos} does not decode: {e}") from None
        got, pos, frames = got + size, end, frames + 1
    if frames == 0:
        raise PayloadError("delta payload: no zstd frame after the mode byte")
    if got != out.nbytes:
        raise PayloadError(f"delta payload: the frames decode to {got} bytes, the chunk holds {out.nbytes}")
    d = unshuffle(planes, out.dtype)
    if mode == MODE_FULL or base is None:  # base is not None here unless mode 0 (checked above)
        out[...] = d
    elif mode == MODE_XOR:
        np.bitwise_xor(d, base, out=out)
    else:
        np.add(d, base, out=out)
