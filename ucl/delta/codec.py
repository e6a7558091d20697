"""The delta chunk payload (spec/delta.md §5): encode and decode one inner chunk.

A payload is one mode byte (0 full values, 1 XOR of bit patterns, 2 wrapping subtraction of bit
patterns, both against the base chunk) followed by a zstd stream whose content is the byte-plane
shuffle of the values or of the delta. Values are handled as unsigned integer *words* (the bit patterns
of any dtype: use :func:`bit_view`), so reconstruction is bit-exact for NaN payloads, signed zeros,
subnormals, bfloat16 and float8 alike.

Two backends implement the same format: ``"native"`` (``ucl._delta``, C, the default: the throughput
path) and ``"reference"`` (numpy + numcodecs, for tests and as a readable second implementation). Each
decodes what the other writes. Nothing falls back silently: a missing ``ucl._delta`` is an ImportError
when the native backend is used.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from ucl.errors import DeltaChainError, InvalidArgumentError, PayloadError
from ucl.format.records import choose_encoding

__all__ = [
    "ENCODINGS",
    "PayloadError",
    "MODE_FULL",
    "MODE_SUB",
    "MODE_XOR",
    "Backend",
    "bit_view",
    "check_payload",
    "choose_encoding",
    "decode_chunk",
    "encode_chunk",
    "encode_chunk_into",
    "payload_bound",
    "payload_mode",
]

MODE_FULL, MODE_XOR, MODE_SUB = 0, 1, 2
ENCODINGS: dict[str, int] = {"xor": MODE_XOR, "sub": MODE_SUB}
_MODE_NAMES = {MODE_FULL: "full", MODE_XOR: "xor", MODE_SUB: "sub"}
_WORDS = (1, 2, 4, 8)
Backend = Literal["native", "reference"]


# C error codes (engine/delta.h) -> (error class, what went wrong)
_C_ERRORS: dict[int, tuple[type[Exception], str]] = {
    -1: (InvalidArgumentError, "invalid arguments"),
    -2: (MemoryError, "out of memory"),
    -3: (PayloadError, "empty payload (no mode byte)"),
    -4: (PayloadError, "unknown mode byte"),
    -5: (DeltaChainError, "a delta payload needs the base chunk, and none was given"),
    -6: (PayloadError, "not a zstd frame with a content size and no dictionary (or no frame at all)"),
    -7: (PayloadError, "a zstd frame does not decode (corrupt or truncated)"),
    -8: (PayloadError, "the frames do not decode to the chunk's size"),
}


def _native() -> Any:
    from ucl import _delta

    return _delta


def bit_view(a: np.ndarray) -> np.ndarray:
    """The flat unsigned-integer view of an array's bit patterns, as the codec takes it.

    Words are the itemsize for 1, 2, 4 and 8-byte types, and 8 bytes for complex128 (two words per
    element). No copy for contiguous arrays.

    Parameters
    ----------
    a : numpy.ndarray
        Any array of a fixed-size dtype (bool, ints, floats incl. ml_dtypes bfloat16/float8, complex).

    Returns
    -------
    numpy.ndarray
        1-D ``uint8``/``uint16``/``uint32``/``uint64`` view of the same memory.
    """
    a = np.ascontiguousarray(a).reshape(-1)
    size = a.dtype.itemsize
    word = size if size in _WORDS else 8
    if size % word:
        raise InvalidArgumentError(f"bit_view: itemsize {size} is not a multiple of a word size in {_WORDS}")
    return a.view(np.dtype(f"<u{word}"))


def word_dtype(itemsize: int) -> np.dtype:
    """The unsigned word the codec uses for a data type of ``itemsize`` bytes (as :func:`bit_view`)."""
    return np.dtype(f"<u{itemsize if itemsize in _WORDS else 8}")


def payload_bound(nbytes: int, word: int) -> int:
    """The largest payload the native encoder writes for a chunk of ``nbytes`` in words of ``word`` bytes."""
    if word not in _WORDS or nbytes < 0 or nbytes % word:
        raise InvalidArgumentError(
            f"payload_bound: nbytes {nbytes} and word {word} (must be one of {_WORDS})"
        )
    return int(_native().bound(nbytes, word))


def payload_mode(payload: bytes | memoryview | bytearray) -> str:
    """The mode of a payload: ``"full"``, ``"xor"`` or ``"sub"``; raises PayloadError for others."""
    if len(payload) == 0:
        raise PayloadError("delta payload: empty (no mode byte)")
    mode = payload[0]
    if mode not in _MODE_NAMES:
        raise PayloadError(f"delta payload: unknown mode byte {mode} (expected 0 full, 1 xor or 2 sub)")
    return _MODE_NAMES[mode]


def _check_words(new: np.ndarray, base: np.ndarray | None, what: str) -> int:
    if not isinstance(new, np.ndarray) or new.dtype.kind != "u" or new.dtype.itemsize not in _WORDS:
        got = getattr(new, "dtype", type(new).__name__)
        raise InvalidArgumentError(
            f"{what}: values must be a numpy array of uint8/16/32/64 (see bit_view), got {got}"
        )
    if not new.flags.c_contiguous:
        raise InvalidArgumentError(f"{what}: values must be C-contiguous")
    if base is not None:
        if not isinstance(base, np.ndarray) or base.dtype != new.dtype or base.size != new.size:
            raise DeltaChainError(
                f"{what}: base chunk must match the chunk: expected {new.size} words of {new.dtype}, "
                f"found {getattr(base, 'size', '?')} of {getattr(base, 'dtype', type(base).__name__)}"
            )
        if not base.flags.c_contiguous:
            raise InvalidArgumentError(f"{what}: base must be C-contiguous")
    return int(new.dtype.itemsize)


def _raise_c(rc: int, what: str) -> None:
    cls, text = _C_ERRORS.get(rc, (PayloadError, f"error {rc}"))
    if cls is MemoryError:
        raise MemoryError(f"{what}: {text}")
    raise cls(f"{what}: {text}")


def encode_chunk(
    new: np.ndarray, base: np.ndarray | None, encoding: str, level: int = 1, *, backend: Backend = "native"
) -> bytes | None:
    """Encode one inner chunk against its base.

    Parameters
    ----------
    new : numpy.ndarray
        The chunk's values as a C-contiguous unsigned-integer array (``bit_view`` of the tensor chunk).
    base : numpy.ndarray or None
        The same chunk in the base step (same dtype and size), or None to store full values.
    encoding : {"xor", "sub"}
        The delta encoding recorded for the array (``choose_encoding``).
    level : int, optional
        zstd level for byte planes made of long runs (1: fast; higher: smaller, slower).
    backend : {"native", "reference"}, optional
        The implementation; both write valid payloads and read each other's.

    Returns
    -------
    bytes or None
        None when ``new`` equals ``base`` bit for bit (store nothing: the chunk is absent), else the
        payload: the smaller of the delta and the full encoding (the native backend estimates both from
        a sample and encodes both only when the estimates are within a few percent).

    Raises
    ------
    InvalidArgumentError
        Not unsigned words, not contiguous, or an unknown encoding.
    DeltaChainError
        ``base`` does not match ``new`` in dtype or size.
    """
    word = _check_words(new, base, "encode_chunk")
    if encoding not in ENCODINGS:
        raise InvalidArgumentError(
            f"encode_chunk: encoding must be one of {sorted(ENCODINGS)}, got {encoding!r}"
        )
    if backend == "reference":
        from ucl.delta import _reference

        return _reference.encode(new, base, ENCODINGS[encoding], level)
    r = _native().encode(new, base, word, ENCODINGS[encoding], int(level))
    if isinstance(r, int):
        _raise_c(r, "encode_chunk")
    return r  # type: ignore[no-any-return]


def encode_chunk_into(
    new: np.ndarray,
    base: np.ndarray | None,
    encoding: str,
    out: np.ndarray | memoryview | bytearray,
    level: int = 1,
) -> int:
    """Like :func:`encode_chunk` (native backend) but writes into ``out`` and returns the length.

    For writers that place payloads straight into a shard buffer. ``out`` must hold at least
    ``payload_bound(new.nbytes, new.dtype.itemsize)`` bytes. Returns 0 when ``new`` equals ``base`` bit
    for bit (payloads are never empty). Releases the GIL while it works.
    """
    word = _check_words(new, base, "encode_chunk_into")
    if encoding not in ENCODINGS:
        raise InvalidArgumentError(
            f"encode_chunk_into: encoding must be one of {sorted(ENCODINGS)}, got {encoding!r}"
        )
    bound = payload_bound(new.nbytes, word)
    cap = out.nbytes if isinstance(out, np.ndarray) else memoryview(out).nbytes
    if cap < bound:
        raise InvalidArgumentError(f"encode_chunk_into: out holds {cap} bytes, the payload may need {bound}")
    r = int(_native().encode(new, base, word, ENCODINGS[encoding], int(level), out))
    if r < 0:
        _raise_c(r, "encode_chunk_into")
    return r


def decode_chunk(
    payload: bytes | memoryview | bytearray,
    base: np.ndarray | None,
    out: np.ndarray,
    *,
    backend: Backend = "native",
) -> None:
    """Decode one payload into ``out``: never returns wrong data, raises instead.

    Parameters
    ----------
    payload : bytes-like
        The inner chunk's bytes without its crc32c (verified by the caller).
    base : numpy.ndarray or None
        The chunk's values in the base step (same dtype and size as ``out``); may be ``out`` itself for
        an in-place update. Needed unless the payload holds full values (mode 0).
    out : numpy.ndarray
        C-contiguous unsigned-integer array receiving the values.
    backend : {"native", "reference"}, optional

    Raises
    ------
    PayloadError
        (``integrity_error``, also a FormatError) Empty or truncated payload, unknown mode byte, frames
        that are not zstd frames with a content size, frames that fail to decode, or decoded size
        different from the chunk's.
    DeltaChainError
        A delta payload without a base, or a base that does not match ``out``.
    """
    _check_words(out, base, "decode_chunk")
    if not out.flags.writeable:
        raise InvalidArgumentError("decode_chunk: out is read-only")
    if backend == "reference":
        from ucl.delta import _reference

        _reference.decode(payload, base, out)
        return
    rc, mode = _native().decode(payload, base, out, out.dtype.itemsize)
    if rc != 0:
        _raise_c(rc, f"delta payload (mode byte {mode})" if rc == -4 else "delta payload")


def check_payload(payload: bytes | memoryview | bytearray, itemsize: int, inner_nbytes: int,
                  encoding: str) -> None:
    """Check one stored payload (crc32c verified and removed) as a reader would decode it, without its
    base (spec/delta.md §5.4, §7 check 6): its mode is 0 or the array's ``encoding``'s, and its frames
    decode to exactly ``inner_nbytes``.

    Raises
    ------
    PayloadError
        (``integrity_error``) The payload does not decode to exactly its inner chunk.
    """
    mode = payload_mode(payload)
    if mode not in ("full", encoding):
        raise PayloadError(f"delta payload: mode {_MODE_NAMES_REV[mode]} ({mode}) is neither 0 (full) nor "
                           f"that of the array's encoding {encoding!r}")
    word = word_dtype(itemsize)
    scratch = np.zeros(inner_nbytes // word.itemsize, word)
    decode_chunk(payload, scratch, scratch)


_MODE_NAMES_REV = {v: k for k, v in _MODE_NAMES.items()}
