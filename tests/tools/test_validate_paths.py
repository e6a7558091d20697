"""The validator reads a shard whole (small) or chunk by chunk after its index (large, bounded memory):
both find the same damage, with the same codes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ucl
from ucl.options import ChainOptions, ReadOptions, WriteOptions

PATHS = {"whole": ReadOptions(), "chunk by chunk": ReadOptions(chain=ChainOptions(whole_max_bytes=0))}


def _repo(path: Path) -> Path:
    g = torch.Generator().manual_seed(5)
    state = {"a": torch.randn(256, 64, generator=g), "b": torch.randn(256, 64, generator=g),
             "z": torch.zeros(512, 32)}
    ucl.save(state, path, step=1, options=WriteOptions(inner_chunk_bytes=8 << 10))  # 8 inner chunks each
    ucl.save(state, path, step=2, compression="zstd", options=WriteOptions(inner_chunk_bytes=8 << 10))
    return path


@pytest.mark.parametrize("how", list(PATHS))
def test_both_paths_pass_a_sound_repository(tmp_path: Path, how: str) -> None:
    report = ucl.validate(_repo(tmp_path / "r"), options=PATHS[how])
    assert report.ok and report.files_checked == 6 and report.bytes_checked > 0


@pytest.mark.parametrize("how", list(PATHS))
def test_both_paths_find_a_flipped_bit(tmp_path: Path, how: str) -> None:
    root = _repo(tmp_path / "r")
    shard = root / "steps" / "1" / "a" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[3 * 8196 + 17] ^= 0x10  # inside the 4th inner chunk
    shard.write_bytes(bytes(data))
    report = ucl.validate(root, options=PATHS[how])
    assert [(p.code, p.step, p.tensor) for p in report.problems] == [("checksum_mismatch", 1, "a")]
    assert "fails its crc32c" in report.problems[0].message


@pytest.mark.parametrize("how", list(PATHS))
def test_both_paths_find_swapped_shards(tmp_path: Path, how: str) -> None:
    root = _repo(tmp_path / "r")
    a, b = (root / "steps" / "1" / n / "c" / "0" / "0" for n in "ab")
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    report = ucl.validate(root, options=PATHS[how])
    assert sorted((p.code, p.tensor) for p in report.problems) == [("checksum_mismatch", "a"),
                                                                   ("checksum_mismatch", "b")]
    assert all("does not hold the chunks" in p.message for p in report.problems)


@pytest.mark.parametrize("how", list(PATHS))
def test_both_paths_decode_what_they_vouch_for(tmp_path: Path, how: str) -> None:
    import struct

    from ucl.io import native

    root = _repo(tmp_path / "r")
    shard = root / "steps" / "2" / "z" / "c" / "0" / "0"  # zstd chunks
    data = bytearray(shard.read_bytes())
    data[4:8] = b"\xff\xff\xff\xff"  # damage the first chunk's zstd frame header, then reseal its crc32c
    n_inner = 8
    idx_off = len(data) - (16 * n_inner + 4)
    off, nb = struct.unpack_from("<QQ", data, idx_off)
    data[off + nb - 4 : off + nb] = struct.pack("<I", native.crc32c(bytes(data[off : off + nb - 4])))
    shard.write_bytes(bytes(data))
    report = ucl.validate(root, options=PATHS[how])
    assert report.problems and report.problems[0].step == 2 and report.problems[0].tensor == "z"
    assert report.problems[0].code == "integrity_error"
