"""A bulk read plans a shard that is read whole by the index ucl's own writer gives it
(``ucl.format.shardfile.canonical_index``) instead of waiting for its index read; the last segment reads on
to the end of the file and must find exactly that index there. These tests check that the guess is only
ever a shortcut: another writer's layout of the same size (spec/core.md §6.1 allows any chunk order) is
read right, a damaged shard fails with the same error as before, and no unconfirmed guess stays cached."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucl
import ucl.io.ranges
from ucl.errors import ChecksumError, ShardSizeError
from ucl.format.metadata import CommitRecord
from ucl.format.repository import commit_key
from ucl.format.shardfile import canonical_index, chunk_stride, file_digest, index_nbytes, parse_index
from ucl.io import native as _native
from ucl.options import WriteOptions
from ucl.read.files import StepFiles

SMALL_CHUNKS = WriteOptions(inner_chunk_bytes=4096)  # shards of many inner chunks from small tensors


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(257, 63, generator=g), "b": torch.randn(9, generator=g)}


def _save(tmp_path: Path) -> Path:
    ucl.save(_state(), tmp_path / "r", 1, options=SMALL_CHUNKS)
    return tmp_path / "r"


def _shard(repo: Path, name: str) -> tuple[Path, str]:
    [p] = [p for p in (repo / "steps" / "1" / name).rglob("*") if p.is_file() and p.name != "zarr.json"]
    return p, str(p.relative_to(repo / "steps" / "1"))


def _reseal(repo: Path, rel: str, n_inner: int) -> None:
    """Record the rewritten shard's size and digest in the commit record (as a writer would have)."""
    key = repo / commit_key(1)
    rec = CommitRecord.from_bytes(key.read_bytes(), commit_key(1), 1)
    data = (repo / "steps" / "1" / rel).read_bytes()
    files = dict(rec.files)
    files[rel] = (len(data), file_digest(data, n_inner))
    key.write_bytes(replace(rec, files=files).to_bytes())


def _relayout(repo: Path, name: str, order: list[int]) -> np.ndarray:
    """Rewrite ``name``'s shard with its inner chunks in file order ``order`` (a permutation of the index
    order): the same size as ucl's layout, another writer's. Returns the new index."""
    p, rel = _shard(repo, name)
    with ucl.open(repo) as ck:
        meta = ck.array(name).meta
    data = p.read_bytes()
    n = index_nbytes(meta.n_inner)
    old = parse_index(meta, data[-n:], len(data), rel)
    chunks = [data[o : o + nb] for o, nb in old]
    index = np.full_like(old, np.iinfo(np.uint64).max)
    out = b""
    stride = chunk_stride(meta)  # each chunk where ucl's layout starts one, padded alike
    for i in order:
        if out and len(out) % stride:
            out += bytes(stride - len(out) % stride)
        index[i] = (len(out), len(chunks[i]))
        out += chunks[i]
    body = index.astype("<u8").tobytes()
    p.write_bytes(out + body + struct.pack("<I", _native.crc32c(body)))
    _reseal(repo, rel, meta.n_inner)
    return index


def _flip(p: Path, offset: int) -> None:
    """Flip one bit of the byte at ``offset`` of file ``p``."""
    with open(p, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 4]))


def _reads(repo: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every bulk way to read the whole step, each from a fresh open."""
    out = {}
    with ucl.open(repo) as ck:
        out["load"] = ck.load(flat=True)
    dest = {k: torch.empty_like(v) for k, v in _state().items()}
    ucl.load_into(repo, dest)
    out["load_into"] = dest
    return out


def test_the_writers_layout_is_what_the_prediction_says(tmp_path: Path) -> None:
    repo = _save(tmp_path)
    with ucl.open(repo) as ck:
        for name in ("w", "b"):
            meta = ck.array(name).meta
            p, rel = _shard(repo, name)
            data = p.read_bytes()
            guess = canonical_index(meta, (0,) * len(meta.shape))
            assert guess is not None and guess[1] == len(data)
            n = index_nbytes(meta.n_inner)
            assert np.array_equal(guess[0], parse_index(meta, data[-n:], len(data), rel))


def test_a_bulk_read_of_ucls_layout_reads_no_index_on_its_own(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _save(tmp_path)
    calls: list[str] = []
    real = StepFiles._pread

    def counted(self: StepFiles, key: str, offset: int, length: int) -> bytes:
        calls.append(key)
        return real(self, key, offset, length)

    monkeypatch.setattr(StepFiles, "_pread", counted)
    got = _reads(repo)
    assert calls == []  # the indexes came with the data, in the same requests
    for how, state in got.items():
        for k, v in _state().items():
            assert torch.equal(state[k], v), (how, k)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.permutations(list(range(4))))
def test_another_writers_chunk_order_of_the_same_size_reads_right(tmp_path_factory: pytest.TempPathFactory,
                                                                   order: list[int]) -> None:
    repo = tmp_path_factory.mktemp("order")
    ucl.save({"w": torch.arange(4 * 1024, dtype=torch.float32).reshape(4, 1024)}, repo, 1,
             options=SMALL_CHUNKS)  # one shard of 4 inner chunks of one row
    real = _relayout(repo, "w", order)
    want = torch.arange(4 * 1024, dtype=torch.float32).reshape(4, 1024)
    with ucl.open(repo) as ck:
        assert ck.array("w").meta.n_inner == 4
        assert torch.equal(ck.load(flat=True)["w"], want)
        # the cache holds the index the file has, whatever was guessed
        [cached] = [v for (name, _), v in ck.files.indexes.items() if name == "w"]
        assert np.array_equal(cached, real)
    dest = {"w": torch.empty(4, 1024)}
    ucl.load_into(repo, dest)
    assert torch.equal(dest["w"], want)


def test_a_damaged_chunk_fails_as_it_did_and_no_guess_stays_cached(tmp_path: Path) -> None:
    repo = _save(tmp_path)
    p, _ = _shard(repo, "w")
    data = bytearray(p.read_bytes())
    data[5000] ^= 0x10  # in the second inner chunk (4032 bytes + crc each)
    p.write_bytes(bytes(data))
    with ucl.open(repo) as ck:
        with pytest.raises(ChecksumError, match=r"inner chunk \[1, 0\] of tensor 'w' fails its crc32c"):
            ck.load(flat=True)
        meta = ck.array("w").meta
        real = parse_index(meta, bytes(data[-index_nbytes(meta.n_inner):]), len(data), "w")
        for (name, _), v in ck.files.indexes.items():
            assert name != "w" or np.array_equal(v, real)


def test_a_truncated_shard_fails_as_it_did(tmp_path: Path) -> None:
    repo = _save(tmp_path)
    p, _ = _shard(repo, "w")
    p.write_bytes(p.read_bytes()[:-10])
    with ucl.open(repo) as ck, pytest.raises(ShardSizeError, match="'w'"):
        ck.load(flat=True)
    dest = {k: torch.empty_like(v) for k, v in _state().items()}
    with pytest.raises(ShardSizeError, match="'w'"):
        ucl.load_into(repo, dest)


def test_a_wrong_guess_is_dropped_from_the_cache_when_the_read_fails(tmp_path: Path) -> None:
    """Another writer's layout whose chunk is damaged too: the read fails by the real index, and the
    guessed index, which was never confirmed, is not left in the cache for the next read."""
    repo = tmp_path / "r"
    ucl.save({"w": torch.arange(4 * 1024, dtype=torch.float32).reshape(4, 1024)}, repo, 1,
             options=SMALL_CHUNKS)
    real = _relayout(repo, "w", [3, 2, 1, 0])
    p, _ = _shard(repo, "w")
    data = bytearray(p.read_bytes())
    data[int(real[2][0]) + 8] ^= 1  # inner chunk 2, wherever this layout put it
    p.write_bytes(bytes(data))
    with ucl.open(repo) as ck:
        with pytest.raises(ChecksumError, match=r"inner chunk \[2, 0\] of tensor 'w' fails its crc32c"):
            ck.load(flat=True)
        for (name, _), v in ck.files.indexes.items():
            assert name != "w" or np.array_equal(v, real)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("damaged", [False, True])
def test_another_writers_layout_read_on_threads(tmp_path: Path, damaged: bool, direct: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the threaded path a read of more than 8 MiB takes (4 inner chunks of 4 MiB, reversed);
    ``direct``: every segment read with O_DIRECT and checked on the step's check threads
    (ucl.read.boxes.Handoff), where a wrong guess is found."""
    leased: list[int] = []
    if direct:
        monkeypatch.setattr(ucl.io.ranges, "mostly_cached", lambda *a: False)
        orig = ucl.io.ranges.RangeReader._read_direct
        monkeypatch.setattr(ucl.io.ranges.RangeReader, "_read_direct",
                            lambda self, *a: leased.append(1) or orig(self, *a))
    repo = tmp_path / "r"
    want = torch.arange(1024 * 4096, dtype=torch.float32).reshape(1024, 4096)
    ucl.save({"big": want}, repo, 1)
    real = _relayout(repo, "big", [3, 2, 1, 0])
    with ucl.open(repo) as ck:
        assert ck.array("big").meta.n_inner == 4
    if damaged:
        p, _ = _shard(repo, "big")
        _flip(p, int(real[1][0]) + 4096)
    for how in ("load", "load_into"):
        with ucl.open(repo) as ck:
            dest = {"big": torch.empty(1024, 4096)}
            try:
                if how == "load":
                    got = ck.load(flat=True)["big"]
                else:
                    ck.load_into(dest)
                    got = dest["big"]
            except ChecksumError as e:
                assert damaged and "inner chunk [1, 0] of tensor 'big' fails its crc32c" in str(e)
            else:
                assert not damaged and torch.equal(got, want)
            assert ck._pool is not None  # the threaded path
            assert bool(leased) == direct
            leased.clear()
            for (name, _), v in ck.files.indexes.items():
                assert name != "big" or np.array_equal(v, real)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=3))
def test_the_prediction_is_the_writers_index_for_every_shard(dims: list[tuple[int, int, int]]) -> None:
    """Every shard of an array, those inside it (every inner chunk present: the fast path) and those at its
    edges (chunks wholly past the end absent), by ``encode_shard``, the writer's own encoder."""
    from itertools import product

    from ucl.format.metadata import ArrayMeta
    from ucl.format.shardfile import encode_shard

    shape = tuple(n for n, _, _ in dims)
    inner = tuple(i for _, i, _ in dims)
    chunk = tuple(i * k for _, i, k in dims)
    meta = ArrayMeta(name="t", shape=shape, dtype="float32", chunk_shape=chunk, inner_chunk_shape=inner)
    full = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    for shard in product(*(range(g) for g in meta.grid)):
        box = tuple(slice(c * cs, min((c + 1) * cs, n)) for c, cs, n in zip(shard, chunk, shape, strict=True))
        data = b"".join(bytes(memoryview(b).cast("B")) for b in encode_shard(meta, shard, full[box]))
        guess = canonical_index(meta, shard)
        assert guess is not None and guess[1] == len(data), (shard, guess and guess[1], len(data))
        n = index_nbytes(meta.n_inner)
        assert np.array_equal(guess[0], parse_index(meta, data[-n:], len(data), "t/c")), shard



def test_a_damaged_chunk_of_another_writers_layout_is_named_right_on_a_check_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks in the order [0, 2, 1, 3] (another writer's, the same size) and chunk 2 damaged: the segment
    planned by the guess finds chunk 2's bytes where it expects chunk 1, and the crc32c mismatch a check
    thread finds there means "the guess was wrong" (segments read with O_DIRECT). The read done again by
    the real index names the chunk that is damaged, [2, 0], not the one the guess expected there."""
    monkeypatch.setattr(ucl.io.ranges, "mostly_cached", lambda *a: False)
    repo = tmp_path / "r"
    ucl.save({"big": torch.arange(1024 * 4096, dtype=torch.float32).reshape(1024, 4096)}, repo, 1)
    real = _relayout(repo, "big", [0, 2, 1, 3])
    p, _ = _shard(repo, "big")
    _flip(p, int(real[2][0]) + 4096)
    for how in ("load", "load_into"):
        with ucl.open(repo) as ck, pytest.raises(ChecksumError, match=r"inner chunk \[2, 0\] of tensor 'big'"):
            if how == "load":
                ck.load(flat=True)
            else:
                ck.load_into({"big": torch.empty(1024, 4096)})
