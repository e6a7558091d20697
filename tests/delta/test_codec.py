"""The delta payload (spec/delta.md §5): bit-exact round trips, both backends, hostile payloads."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.delta import (
    MODE_FULL,
    bit_view,
    decode_chunk,
    encode_chunk,
    encode_chunk_into,
    payload_bound,
    payload_mode,
)
from ucl.errors import DeltaChainError, FormatError, InvalidArgumentError
from ucl.format.records import choose_encoding

from .strategies import DTYPES, HOW, arrays, perturb

BACKENDS = ["native", "reference"]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def roundtrip(
    new: np.ndarray, base: np.ndarray | None, encoding: str, enc_backend: str, dec_backend: str
) -> None:
    nw = bit_view(new)
    bw = None if base is None else bit_view(base)
    payload = encode_chunk(nw, bw, encoding, backend=enc_backend)  # type: ignore[arg-type]
    if payload is None:
        assert bw is not None and nw.tobytes() == bw.tobytes()
        return
    out = np.empty_like(nw)
    decode_chunk(payload, bw, out, backend=dec_backend)  # type: ignore[arg-type]
    assert out.tobytes() == nw.tobytes()


@FAST
@given(
    data=st.data(),
    dtype=st.sampled_from(sorted(DTYPES)),
    n=st.integers(0, 300),
    how=st.sampled_from(HOW),
    encoding=st.sampled_from(["xor", "sub"]),
    enc_backend=st.sampled_from(BACKENDS),
    dec_backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_every_dtype(data, dtype, n, how, encoding, enc_backend, dec_backend, seed) -> None:  # type: ignore[no-untyped-def]
    base = data.draw(arrays(DTYPES[dtype], n))
    new = perturb(np.random.default_rng(seed), base, how)
    roundtrip(new, base, encoding, enc_backend, dec_backend)
    roundtrip(new, None, encoding, enc_backend, dec_backend)


@pytest.mark.parametrize("word", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 33, 40000, 70001])
def test_sizes_around_kernel_and_block_edges(word: int, n: int) -> None:
    # 16-word SIMD steps, 512-word blocks, 32768-word sampling, 128 KiB zstd blocks
    rng = np.random.default_rng(n * 10 + word)
    dt = np.dtype(f"<u{word}")
    base = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    for how in ["small", "sparse", "random"]:
        new = perturb(rng, base, how)
        for enc in ["xor", "sub"]:
            for eb in BACKENDS:
                for db in BACKENDS:
                    roundtrip(new, base, enc, eb, db)


def test_identical_is_none_and_nan_payloads_are_not_equal_values() -> None:
    a = np.array([np.nan, -0.0, 0.0, np.inf], np.float32)
    assert encode_chunk(bit_view(a), bit_view(a.copy()), "xor") is None
    b = a.copy()
    bit_view(b)[0] = 0x7FC00002  # another NaN: equal as floats' "nan-ness", different bits
    bit_view(b)[1] = 0x00000000  # -0.0 -> +0.0: == as floats, different bits
    p = encode_chunk(bit_view(b), bit_view(a), "xor")
    assert p is not None
    out = np.empty(4, np.uint32)
    decode_chunk(p, bit_view(a), out)
    assert out.tobytes() == b.tobytes()


def test_keeps_the_smaller_of_delta_and_full() -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 2**32, 100_000, dtype=np.uint32)
    zeros = np.zeros_like(base)  # an optimizer reset: the full encoding is tiny, the delta is the base
    p = encode_chunk(zeros, base, "xor")
    assert p is not None and payload_mode(p) == "full" and len(p) < 1000
    near = base ^ (rng.integers(0, 4, base.size, dtype=np.uint32))  # a small change: the delta wins
    p = encode_chunk(near, base, "xor")
    assert p is not None and payload_mode(p) == "xor" and len(p) < base.nbytes // 3
    p = encode_chunk(near, base, "sub")
    assert p is not None and payload_mode(p) in ("sub", "xor", "full") and payload_mode(p) != "xor"


def test_in_place_decode_over_the_base() -> None:
    rng = np.random.default_rng(2)
    base = rng.integers(0, 2**16, 5000, dtype=np.uint16)
    new = base + rng.integers(0, 3, base.size, dtype=np.uint16)
    for enc in ["xor", "sub"]:
        for backend in BACKENDS:
            p = encode_chunk(new, base, enc)
            buf = base.copy()
            decode_chunk(p, buf, buf, backend=backend)  # type: ignore[arg-type]
            assert np.array_equal(buf, new)


def test_encode_into_matches_encode_and_respects_the_bound() -> None:
    rng = np.random.default_rng(3)
    base = rng.standard_normal(30000).astype(np.float32)
    new = base + np.float32(1e-4) * rng.standard_normal(base.size).astype(np.float32)
    nw, bw = bit_view(new), bit_view(base)
    out = np.empty(payload_bound(nw.nbytes, 4), np.uint8)
    n = encode_chunk_into(nw, bw, "xor", out)
    assert bytes(out[:n]) == encode_chunk(nw, bw, "xor")
    assert encode_chunk_into(nw, nw.copy(), "xor", out) == 0
    with pytest.raises(InvalidArgumentError, match="out holds 10 bytes"):
        encode_chunk_into(nw, bw, "xor", np.empty(10, np.uint8))
    # incompressible data stays within the bound
    r = rng.integers(0, 2**64, 1000, dtype=np.uint64)
    p = encode_chunk(r, None, "xor")
    assert p is not None and len(p) <= payload_bound(r.nbytes, 8)


def test_bit_view_and_choose_encoding() -> None:
    assert (
        bit_view(np.zeros(3, np.complex128)).dtype == np.uint64
        and bit_view(np.zeros(3, np.complex128)).size == 6
    )
    assert bit_view(np.zeros((2, 3), np.float16)).shape == (6,)
    assert choose_encoding("optim/state/3/exp_avg_sq", "float32") == "sub"
    assert choose_encoding("opt.state.0.exp_avg_sq", "bfloat16") == "sub"
    assert choose_encoding("optim/state/3/exp_avg", "float32") == "xor"
    assert choose_encoding("model/layers/0/weight", "float32") == "xor"
    assert choose_encoding("optim/state/3/step", "int64") == "sub"


def test_bad_arguments() -> None:
    a = np.zeros(8, np.uint32)
    with pytest.raises(InvalidArgumentError, match="uint8/16/32/64"):
        encode_chunk(np.zeros(8, np.float32), None, "xor")
    with pytest.raises(InvalidArgumentError, match="encoding must be one of"):
        encode_chunk(a, a, "add")
    with pytest.raises(DeltaChainError, match="base chunk must match"):
        encode_chunk(a, np.zeros(9, np.uint32), "xor")
    with pytest.raises(DeltaChainError, match="base chunk must match"):
        decode_chunk(b"\x00", np.zeros(8, np.uint16), a)
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        encode_chunk(np.zeros(16, np.uint32)[::2], None, "xor")


# -- hostile payloads: every one raises a ucl error, never returns data ---------------------------------
def _payload() -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    base = rng.standard_normal(4096).astype(np.float32)
    new = base * np.float32(1.0001)
    p = encode_chunk(bit_view(new), bit_view(base), "xor")
    assert p is not None
    return p, bit_view(base), bit_view(new)


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_payloads_raise(backend: str) -> None:
    p, base, _ = _payload()
    out = np.empty_like(base)
    for cut in [0, 1, 2, 5, 13, 20, len(p) // 2, len(p) - 1]:
        with pytest.raises(FormatError):
            decode_chunk(p[:cut], base, out, backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_payloads_raise(backend: str) -> None:
    p, base, new = _payload()
    out = np.empty_like(base)

    def bad(payload: bytes, match: str, base_: np.ndarray | None = base, err: type = FormatError) -> None:
        with pytest.raises(err, match=match):
            decode_chunk(payload, base_, out, backend=backend)  # type: ignore[arg-type]

    bad(b"\x07" + p[1:], "mode")
    bad(b"", "empty")
    bad(p[:1], "frame")  # a mode byte alone
    bad(p[:1] + b"\x00\x00\x00\x00" + p[5:], "frame")  # bad magic
    bad(p + p[1:], "more than|frames")  # twice the content
    bad(p, "needs the base", base_=None, err=DeltaChainError)
    # a frame without content size: zstd's streaming format
    bad(b"\x00" + b"\x28\xb5\x2f\xfd\x00\x58" + b"\x01\x00\x00", "content size|frame")
    # a frame that claims 2^60 bytes: refused before anything is allocated
    huge = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", 1 << 60) + b"\x01\x00\x00"
    bad(b"\x00" + huge, "more than|size")
    # frames decoding to fewer bytes than the chunk
    short = encode_chunk(new[:100].copy(), None, "xor")
    assert short is not None
    bad(short, "decode to|size")


@pytest.mark.parametrize("backend", BACKENDS)
def test_flipped_bytes_never_return_data_silently(backend: str) -> None:
    # A flipped byte the zstd frame cannot detect (inside a raw block) changes the values; the inner
    # chunk's crc32c catches that one layer up. Here: no crash, and either an error or a result.
    p, base, _ = _payload()
    out = np.empty_like(base)
    rng = np.random.default_rng(5)
    for _ in range(200):
        q = bytearray(p)
        q[int(rng.integers(0, len(q)))] ^= 1 << int(rng.integers(0, 8))
        with contextlib.suppress(FormatError, DeltaChainError):
            decode_chunk(bytes(q), base, out, backend=backend)  # type: ignore[arg-type]


def test_payload_mode() -> None:
    assert payload_mode(bytes([MODE_FULL, 0])) == "full"
    with pytest.raises(FormatError, match="unknown mode byte 9"):
        payload_mode(b"\x09")
    with pytest.raises(FormatError, match="empty"):
        payload_mode(b"")


@settings(max_examples=150, deadline=None)
@given(garbage=st.binary(max_size=64), mode=st.integers(0, 2), backend=st.sampled_from(BACKENDS))
def test_random_bytes_never_crash_or_pass_silently(garbage: bytes, mode: int, backend: str) -> None:
    base = np.arange(16, dtype=np.uint32)
    out = np.empty_like(base)
    payload = (
        bytes([mode]) + b"\x28\xb5\x2f\xfd" + garbage if garbage[:1] != b"!" else bytes([mode]) + garbage
    )
    try:
        decode_chunk(payload, base, out, backend=backend)  # type: ignore[arg-type]
    except (FormatError, DeltaChainError):
        return
    # the rare valid stream: both backends agree on it
    other = np.empty_like(base)
    decode_chunk(payload, base, other, backend="reference" if backend == "native" else "native")
    assert other.tobytes() == out.tobytes()


def test_threads_encode_concurrently_with_the_same_result() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ucl import _delta

    rng = np.random.default_rng(6)
    chunks = [rng.standard_normal(50_000).astype(np.float32) for _ in range(12)]
    pairs = [(bit_view(c * np.float32(1.001)), bit_view(c)) for c in chunks]
    serial = [encode_chunk(n, b, "xor") for n, b in pairs]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda nb: encode_chunk(nb[0], nb[1], "xor"), pairs))
    assert parallel == serial
    _delta.release()  # the calling thread's cached contexts and buffers; they come back on next use
    assert encode_chunk(*pairs[0], "xor") == serial[0]


def test_chunks_above_the_per_thread_cache() -> None:
    # > 64 MiB: scratch is allocated per call instead of cached
    n = (64 << 20) // 8 + 1024
    base = np.arange(n, dtype=np.uint64)
    new = base.copy()
    new[::4096] += 1
    p = encode_chunk(new, base, "sub")
    assert p is not None and len(p) < 1 << 20
    out = np.empty_like(base)
    decode_chunk(p, base, out)
    assert np.array_equal(out, new)
