import zlib

import pytest

from ucl import _engine

google_crc32c = pytest.importorskip("google_crc32c")


@pytest.mark.parametrize("n", [0, 1, 7, 8, 63, 64, 65, 1000, 1 << 20])
def test_crc32c_matches_reference(n: int) -> None:
    data = bytes((i * 131 + 7) & 0xFF for i in range(n))
    assert _engine.crc32c(data) == google_crc32c.value(data)
    assert _engine.crc32c(data) != zlib.crc32(data) or n == 0


def test_crc32c_known_vector() -> None:
    # RFC 3720 B.4: 32 bytes of zeros.
    assert _engine.crc32c(bytes(32)) == 0x8A9136AA
    assert _engine.crc32c(b"123456789") == 0xE3069283


def test_crc32c_continues() -> None:
    data = b"hello world, this is ucl" * 100
    assert _engine.crc32c(data[500:], _engine.crc32c(data[:500])) == _engine.crc32c(data)
