"""The plain reader's planner (ucl/read/chunks.py): inner chunks that split several dimensions, clipped shards and
padded chunks, read through any box; and the shard digest checked on whole-shard reads."""

from __future__ import annotations

import dataclasses
import random
import threading
from pathlib import Path

import pytest
import torch

import ucl
from ucl.format import structure
from ucl.format.metadata import StepMeta
from ucl.format.repository import Repository
from ucl.plan.save import all_shards, array_for, shard_block
from ucl.write.step import StepWriter


def _write(path: Path, tensors: dict[str, torch.Tensor], chunk: dict[str, tuple[int, ...]],
           inner: dict[str, tuple[int, ...]], compression: dict | None = None) -> None:
    arrays = {n: dataclasses.replace(array_for(n, t, chunk_shape=chunk[n], compression=compression),
                                     inner_chunk_shape=inner[n]) for n, t in tensors.items()}
    w = StepWriter(Repository.open(str(path), create=True), 0)
    w.begin()
    files = {}
    for n, t in tensors.items():
        for coords in all_shards(arrays[n]):
            rel, entry = w.write_shard(arrays[n], coords, shard_block(arrays[n], coords, t))
            files[rel] = entry
    w.commit(_step_meta(tensors, arrays), files)


def _step_meta(tensors: dict[str, torch.Tensor], arrays: dict) -> StepMeta:

    _, tree = structure.flatten(dict(tensors))
    return StepMeta(step=0, kind="full", tree=tree, arrays=arrays)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "f": torch.randn(20, 23, 17, generator=g),
        "h": torch.randn(33, 40, generator=g).bfloat16(),
        "b": torch.rand(19, 26, generator=g) > 0.5,
        "v": torch.randn(50, generator=g),
    }


CHUNK = {"f": (6, 10, 8), "h": (16, 40), "b": (8, 13), "v": (16,)}
INNER = {"f": (3, 5, 4), "h": (4, 8), "b": (4, 13), "v": (4,)}


@pytest.mark.parametrize("compression", [None, {"name": "zstd", "configuration": {"level": 1}}])
def test_random_boxes(tmp_path: Path, compression: dict | None) -> None:
    st = _state()
    _write(tmp_path / "r", st, CHUNK, INNER, compression)
    ck = ucl.open(str(tmp_path / "r"))
    rnd = random.Random(7)
    for name, t in st.items():
        assert torch.equal(ck[name][...], t)
        for _ in range(25):
            idx = []
            for n in t.shape:
                a = rnd.randrange(n)
                b = rnd.randrange(a + 1, n + 1)
                idx.append(slice(a, b))
            assert torch.equal(ck[name][tuple(idx)], t[tuple(idx)]), (name, idx)
    got = ck.load()
    for name, t in st.items():
        assert torch.equal(got[name], t)


@pytest.mark.parametrize("rows", [8, 4096])  # small shards (read whole with their index) and larger ones
@pytest.mark.parametrize("direct", [False, True])
def test_swapped_shards_fail_whole_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int,
                                         direct: bool) -> None:
    import ucl.io.ranges
    from ucl.errors import ChecksumError
    from ucl.format.repository import step_prefix
    from ucl.options import ReadOptions

    opts = ReadOptions(direct_min_bytes=0 if direct else 256 << 10)
    if direct:
        monkeypatch.setattr(ucl.io.ranges, "mostly_cached", lambda *a: False)
    t = torch.randn(2 * rows, 24, generator=torch.Generator().manual_seed(1))
    inner = (rows // 4, 8)
    _write(tmp_path / "r", {"w": t}, {"w": (rows, 24)}, {"w": inner})
    ck = ucl.open(str(tmp_path / "r"), options=opts)
    assert torch.equal(ck.load()["w"], t) and torch.equal(ck["w"][...], t)
    meta = ck["w"].meta
    a = tmp_path / "r" / step_prefix(0) / meta.shard_key((0, 0))
    b = tmp_path / "r" / step_prefix(0) / meta.shard_key((1, 0))
    da, db = a.read_bytes(), b.read_bytes()
    assert len(da) == len(db)
    a.write_bytes(db)
    b.write_bytes(da)
    ck = ucl.open(str(tmp_path / "r"), options=opts)
    with pytest.raises(ChecksumError, match="does not hold the chunks its commit record names") as e:
        ck.load()
    assert e.value.tensor == "w" and meta.shard_key((0, 0)) in str(e.value)
    with pytest.raises(ChecksumError, match="does not hold the chunks its commit record names"):
        ucl.open(str(tmp_path / "r"), options=opts)["w"][...]
    with pytest.raises(ChecksumError):
        ucl.open(str(tmp_path / "r"), options=opts)["w"][:, 0:24]  # a box covering every chunk of both shards
    # a partial read of one shard passes its chunks' crc32c's (and is not required to see the swap)
    ucl.open(str(tmp_path / "r"), options=opts)["w"][1:3, 2:9]


def test_edge_chunks_of_a_row_slice_read_in_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffered row slice reads the part of an edge chunk it needs in place and the rest through a small
    buffer (read/boxes.py _read_part): bit-exact for every slice, padded last chunk included, and a
    flipped byte anywhere in an edge chunk, inside the rows taken or outside them, fails its crc32c."""
    from ucl.errors import ChecksumError
    from ucl.options import ReadOptions
    from ucl.read import boxes

    monkeypatch.setattr(boxes, "_SCRATCH", 40)  # several pieces per skipped run (a row is 32 bytes)
    t = torch.arange(53 * 8, dtype=torch.float32).reshape(53, 8)
    _write(tmp_path, {"w": t}, {"w": (56, 8)}, {"w": (7, 8)})  # 8 chunks of 7 rows, the last one padded
    opts = ReadOptions(direct=False)
    with ucl.open(str(tmp_path), options=opts) as ck:
        for a in range(53):
            for b in range(a + 1, 54):
                assert torch.equal(ck["w"][a:b], t[a:b]), (a, b)
    shard = tmp_path / "steps" / "0" / "w" / "c" / "0" / "0"
    raw = shard.read_bytes()
    chunk = 7 * 8 * 4 + 4  # bytes of an inner chunk with its crc32c; chunk 1 holds rows 7..13
    for row, _what in ((8, "outside the rows taken"), (11, "inside the rows taken")):
        bad = bytearray(raw)
        bad[chunk + (row - 7) * 32 + 5] ^= 0x10
        shard.write_bytes(bytes(bad))
        with ucl.open(str(tmp_path), options=opts) as ck, pytest.raises(ChecksumError, match=r"inner chunk \[1, 0\]"):
            ck["w"][10:30]
    shard.write_bytes(raw)


def test_a_read_of_few_chunks_starts_no_read_threads(tmp_path: Path) -> None:
    """A few rows of a large tensor touch one inner chunk: read on the caller's thread (starting the read
    pool costs a fresh process ~2 ms a thread); a read that touches many chunks starts it. Both exact."""
    w = torch.randn(12000, 1024)  # 49 MB: inner chunks of a few MiB
    ucl.save({"w": w}, tmp_path / "ck", step=1)

    def readers() -> set[threading.Thread]:  # (other tests' readers may still be winding down)
        return {t for t in threading.enumerate() if t.name.startswith("ucl-read")}

    before = readers()
    with ucl.open(tmp_path / "ck") as ck:
        meta = ck["w"].meta
        rows = meta.inner_chunk_shape[0]
        assert rows < 12000 and meta.inner_nbytes <= 8 << 20, meta.inner_chunk_shape
        assert torch.equal(ck["w"][rows + 1 : rows + 9], w[rows + 1 : rows + 9])
        assert not readers() - before
        assert torch.equal(ck["w"][:, 5:9], w[:, 5:9])  # a column: every chunk
        assert readers() - before
