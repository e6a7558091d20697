"""The packed members of a version 3 step document (spec/core.md §5.1, "Packed members").

A layout step's document is mostly its logical records and its consolidated metadata: JSON that repeats
the same keys and numbers thousands of times (1.1 MB for a LLaMA-70B-like job on 8 ranks, 29 kB as one
Zstandard frame). A version 3 writer moves those members into ``attributes.ucl.packed``: base64 (RFC
4648 §4) of one Zstandard frame (RFC 8878) of a JSON object ``{"ucl": {...}, "consolidated_metadata":
{...}}``. Readers expand it before anything else reads the document; the frame must declare its content
size, which is bounded before a byte is decompressed (a small frame can expand to gigabytes).
"""

from __future__ import annotations

import base64
import binascii

from numcodecs import Zstd

from ucl.errors import LimitExceededError, SchemaError

LEVEL = 9  # ~1.1 MB of records in ~11 ms to 29 kB (level 3: 2.5 ms, 35 kB; 19: 0.5 s, 24 kB)
_MAGIC = b"\x28\xb5\x2f\xfd"


def pack(inner: bytes) -> str:
    """``inner`` (the JSON of the packed members) as ``attributes.ucl.packed``'s text."""
    frame = Zstd(LEVEL).encode(inner)
    assert _header(frame, "packed")[0] == len(inner)  # numcodecs writes the content size
    return base64.b64encode(frame).decode("ascii")


def _header(frame: bytes, what: str) -> tuple[int, int, bool]:
    """A Zstandard frame's header (RFC 8878 §3.1.1.1): (the content size it declares, where its first
    block starts, whether a content checksum ends the frame); ``schema_violation`` when ``frame`` is no
    frame, declares no size, or has a Dictionary_ID field (packed members use no dictionary)."""
    if len(frame) < 6 or frame[:4] != _MAGIC:
        raise SchemaError(f"{what}: attributes.ucl.packed is not a Zstandard frame (RFC 8878)", file=what)
    fhd = frame[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    if dict_flag:
        raise SchemaError(f"{what}: attributes.ucl.packed names a Zstandard dictionary", file=what)
    if fcs_flag == 0 and not single:
        raise SchemaError(f"{what}: attributes.ucl.packed's Zstandard frame does not declare its content size",
                          file=what)
    at = 5 + (0 if single else 1)  # the window descriptor, absent in a single-segment frame
    width = (1, 2, 4, 8)[fcs_flag]
    if len(frame) < at + width:
        raise SchemaError(f"{what}: attributes.ucl.packed's Zstandard frame header is truncated", file=what)
    value = int.from_bytes(frame[at:at + width], "little")
    return (value + 256 if width == 2 else value), at + width, bool(fhd >> 2 & 1)


def _frame_end(frame: bytes, first_block: int, checksum: bool, what: str) -> int:
    """Where the frame that starts ``frame`` ends, by its block headers (RFC 8878 §3.1.1.2): a decoder
    may go on past it (numcodecs skips skippable frames), and §5.1 allows nothing after the one frame."""
    at = first_block
    while True:
        if len(frame) < at + 3:
            raise SchemaError(f"{what}: attributes.ucl.packed's Zstandard frame is truncated", file=what)
        block = int.from_bytes(frame[at:at + 3], "little")
        last, kind, size = block & 1, block >> 1 & 3, block >> 3
        if kind == 3:
            raise SchemaError(f"{what}: attributes.ucl.packed's Zstandard frame has a reserved block type",
                              file=what)
        at += 3 + (1 if kind == 1 else size)  # an RLE block stores its one byte
        if last:
            return at + (4 if checksum else 0)


def unpack(text: object, limit: int, what: str) -> bytes:
    """The JSON bytes ``attributes.ucl.packed`` holds. ``schema_violation`` for anything but padded
    base64 of one Zstandard frame declaring its content size, decompressing to exactly that;
    ``limit_exceeded`` when the declared size is over ``limit`` (checked before decompressing)."""
    if not isinstance(text, str):
        raise SchemaError(f"{what}: attributes.ucl.packed is not a string", file=what)
    try:
        frame = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise SchemaError(f"{what}: attributes.ucl.packed is not base64 (RFC 4648 §4, padded)", file=what) from None
    size, first_block, checksum = _header(frame, what)
    if size < 2:  # no JSON object is shorter ("{}"); and a zero size is how some decoders say "unknown"
        raise SchemaError(f"{what}: attributes.ucl.packed declares {size} bytes, too few for a JSON object",
                          file=what)
    if size > limit:
        raise LimitExceededError(f"{what}: attributes.ucl.packed declares {size} bytes, more than the limit of "
                                 f"{limit}", file=what)
    end = _frame_end(frame, first_block, checksum, what)
    if end != len(frame):
        raise SchemaError(f"{what}: attributes.ucl.packed holds {len(frame) - end} bytes after its Zstandard frame"
                          if end < len(frame) else f"{what}: attributes.ucl.packed's Zstandard frame is truncated",
                          file=what)
    try:
        data = bytes(Zstd().decode(frame))
    except (RuntimeError, ValueError) as e:  # numcodecs' errors
        raise SchemaError(f"{what}: attributes.ucl.packed does not decompress: {e}", file=what) from None
    if len(data) != size:
        raise SchemaError(f"{what}: attributes.ucl.packed decompresses to {len(data)} bytes, its frame "
                          f"declares {size}", file=what)
    return data
