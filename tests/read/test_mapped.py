"""Row slices served by mapping cached shard pages (ucl/read/mapped.py), and the page-aligned layout that
allows it (ucl/format/shardfile.py: aligned, chunk_stride; spec/core.md §6.1)."""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucl
import ucl.read.mapped as mapped
from tests.read.test_predicted_index import _reseal
from ucl.errors import ChecksumError
from ucl.format.shardfile import PAGE, aligned, chunk_stride, index_nbytes, parse_index
from ucl.io import native
from ucl.options import ReadOptions, WriteOptions

COPY = ReadOptions(map_slices=False)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "wte": torch.randn(50257, 768, generator=g),  # GPT-2's embedding: 30 chunks of 1676 rows
        "emb": torch.randn(4099, 1024, generator=g).to(torch.bfloat16),  # rows of 2 KiB
        "mask": torch.rand(3000, 4096, generator=g) > 0.5,  # one byte per element, 1 chunk of 12 MiB
        "small": torch.randn(64, 1024, generator=g),  # 256 KiB: under MIN_BYTES, copied
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    repo = tmp_path_factory.mktemp("mapped") / "r"
    st_ = _state()
    ucl.save(st_, repo, step=0)
    # a slice is mapped only where its pages are cached (a cold one is copied: a mapping would fault them
    # in one by one), and ucl.save writes with O_DIRECT, which leaves none cached: read them once
    for f in repo.rglob("*"):
        if f.is_file():
            f.read_bytes()
    return repo, st_


def _shard(repo: Path, name: str, step: int = 0) -> Path:
    (p,) = [q for q in (repo / "steps" / str(step) / name / "c").rglob("*") if q.is_file()]
    return p


def _slice(ck: ucl.Checkpoint, name: str, a: int, b: int) -> tuple[torch.Tensor, bool]:
    """``ck[name][a:b]`` and whether it was mapped (ucl.read.mapped.rows returned it)."""
    seen: list[bool] = []
    orig = mapped.rows

    def spy(*args: object) -> torch.Tensor | None:
        t = orig(*args)  # type: ignore[arg-type]
        seen.append(t is not None)
        return t

    with mock.patch.object(mapped, "rows", spy):
        t = ck[name][a:b]
    return t, any(seen)


def test_the_layout_starts_every_chunk_on_a_page(saved) -> None:  # type: ignore[no-untyped-def]
    """GPT-2's [50257, 768] float32: 30 inner chunks of 1676 rows (whole pages), each at a multiple of
    the page size, the crc32c right after it, as the index says; the file is the canonical layout."""
    repo, _ = saved
    with ucl.open(repo) as ck:
        meta = ck.array("wte").meta
    assert aligned(meta) and meta.inner_nbytes % PAGE == 0 and chunk_stride(meta) == meta.inner_nbytes + PAGE
    data = _shard(repo, "wte").read_bytes()
    n = index_nbytes(meta.n_inner)
    index = parse_index(meta, data[-n:], len(data), "wte")
    assert [int(o) for o in index[:, 0]] == [k * chunk_stride(meta) for k in range(meta.n_inner)]
    assert len(data) == (meta.n_inner - 1) * chunk_stride(meta) + meta.inner_nbytes + 4 + n
    for k, (o, nb) in enumerate(index.tolist()):  # the padding after each crc32c is zeros
        end = o + nb
        nxt = int(index[k + 1, 0]) if k + 1 < meta.n_inner else len(data) - n
        assert data[end:nxt] == bytes(nxt - end)


def test_chunks_under_1_mib_stay_back_to_back(tmp_path: Path) -> None:
    """Inner chunks of whole pages but under ALIGNED_MIN_BYTES (256 KiB here) get no padding: their
    neighbours are read in one request, as before the aligned layout (bench/reshard.py's layouts of
    96 KiB chunks read 2-3x slower padded)."""
    repo = tmp_path / "r"
    w = torch.randn(4096, 1024)
    ucl.save({"w": w}, repo, step=0, options=WriteOptions(inner_chunk_bytes=256 << 10))
    with ucl.open(repo) as ck:
        meta = ck.array("w").meta
        assert meta.inner_nbytes == 256 << 10 and meta.n_inner == 64
        assert not aligned(meta) and chunk_stride(meta) == meta.inner_nbytes + 4
        assert torch.equal(ck["w"][100:3000], w[100:3000])
    assert _shard(repo, "w").stat().st_size == 64 * (meta.inner_nbytes + 4) + index_nbytes(64)


def _data_reads(monkeypatch: pytest.MonkeyPatch, shard: Path) -> list[int]:
    """The lengths of the reads of ``shard`` of 1 MiB or more (its chunks, not its index) from now on."""
    from ucl.io.ranges import RangeReader

    seen: list[int] = []
    read, readinto = RangeReader.read, RangeReader.readinto

    def spy_read(self, path, offset, length, *a, **k):  # type: ignore[no-untyped-def]
        if os.path.samefile(path, shard) and length >= 1 << 20:
            seen.append(length)
        return read(self, path, offset, length, *a, **k)

    def spy_readinto(self, path, offset, buffers):  # type: ignore[no-untyped-def]
        n = sum(memoryview(b).nbytes for b in buffers)
        if os.path.samefile(path, shard) and n >= 1 << 20:
            seen.append(n)
        return readinto(self, path, offset, buffers)

    monkeypatch.setattr(RangeReader, "read", spy_read)
    monkeypatch.setattr(RangeReader, "readinto", spy_readinto)
    return seen


@pytest.mark.parametrize("cold", [True, False])
def test_a_copied_slice_reads_its_padded_chunks_in_one_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               cold: bool) -> None:
    """Page-aligned chunks are a page apart: a read goes on through the padding (chunks.GAP) instead of
    one request per chunk (the delta-read bench's cold one-delta case read its base 15% slower split)."""
    repo = tmp_path / "r"
    w = torch.randn(4096, 1024)
    ucl.save({"w": w}, repo, step=0, options=WriteOptions(inner_chunk_bytes=1 << 20))
    shard = _shard(repo, "w")
    if cold:
        fd = os.open(shard, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    with ucl.open(repo, options=COPY) as ck:
        assert aligned(ck.array("w").meta) and ck.array("w").meta.n_inner == 16
        seen = _data_reads(monkeypatch, shard)
        got = ck["w"][256:1792]  # chunks 1..6 whole (256 rows each)
    assert torch.equal(got, w[256:1792])
    assert seen == [6 * (1 << 20) + 5 * PAGE + 4]  # with the 5 pages of padding between them


def test_a_delta_step_reads_its_padded_base_chunks_in_one_request(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from ucl.write.manager import CheckpointManager
    from ucl.write.policy import DeltaPolicy

    repo = tmp_path / "r"
    w = torch.randn(4096, 1024)
    w1 = w.clone()
    w1[3000:3010] += 1  # step 1 changes chunk 11 only: chunks 0..7 come from step 0, the full base
    with CheckpointManager(repo, delta=DeltaPolicy(base="full"),
                           options=WriteOptions(inner_chunk_bytes=1 << 20)) as mgr:
        mgr.save(0, {"w": w}).result()
        mgr.save(1, {"w": w1}).result()
    with ucl.open(repo, 1, options=COPY) as ck:
        assert ck.array("w").meta.delta is not None
        seen = _data_reads(monkeypatch, _shard(repo, "w", 0))
        got = ck["w"][0:2048]
    assert torch.equal(got, w1[0:2048])
    assert seen == [8 * (1 << 20) + 7 * PAGE + 4]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["wte", "emb", "mask", "small"]), a=st.integers(0, 5000), n=st.integers(1, 6000))
def test_a_row_slice_is_bit_exact_mapped_or_copied(saved, name: str, a: int, n: int) -> None:  # type: ignore[no-untyped-def]
    """Any row slice, any dtype: the same bits as the state and as a copying read; mapped exactly when it
    is 1 MiB or more inside one shard (these arrays are one shard each)."""
    repo, st_ = saved
    want = st_[name]
    a = min(a, want.shape[0] - 1)
    b = min(a + n, want.shape[0])
    row = want[0].numel() * want.element_size()
    with ucl.open(repo) as ck, ucl.open(repo, options=COPY) as cp:
        got, was = _slice(ck, name, a, b)
        copied, copy_was = _slice(cp, name, a, b)
    assert got.dtype == want.dtype and got.shape == want[a:b].shape
    assert torch.equal(got, want[a:b]) and torch.equal(copied, want[a:b])
    assert not copy_was
    assert was == ((b - a) * row >= mapped.MIN_BYTES)


def test_a_damaged_chunk_is_named(tmp_path: Path) -> None:
    """A flipped bit in a mapped chunk: the slice raises the crc32c error naming the chunk, as a copy does."""
    repo = tmp_path / "r"
    st_ = _state()
    ucl.save({"wte": st_["wte"]}, repo, step=0)
    p = _shard(repo, "wte")
    with ucl.open(repo) as ck:
        meta = ck.array("wte").meta
    data = bytearray(p.read_bytes())
    data[2 * chunk_stride(meta) + 4000] ^= 1
    p.write_bytes(bytes(data))
    rows = meta.inner_chunk_shape[0]
    for options in (ReadOptions(), COPY):
        with ucl.open(repo, options=options) as ck:
            assert torch.equal(ck["wte"][: 2 * rows], st_["wte"][: 2 * rows])  # chunks 0 and 1 are sound
            with pytest.raises(ChecksumError, match=r"inner chunk \[2, 0\] of tensor 'wte' fails its crc32c"):
                ck["wte"][rows : 3 * rows + 5]


def test_writes_stay_private_and_the_slice_outlives_its_step(tmp_path: Path) -> None:
    """Writing into a mapped slice changes neither the file nor the next read; the slice stays valid after
    the checkpoint is closed and the step's files are deleted."""
    repo = tmp_path / "r"
    st_ = _state()
    ucl.save({"wte": st_["wte"]}, repo, step=0)
    p = _shard(repo, "wte")
    before = p.read_bytes()
    with ucl.open(repo) as ck:
        t, was = _slice(ck, "wte", 100, 4000)
        assert was
        t.fill_(7.0)
        assert torch.equal(ck["wte"][100:4000], st_["wte"][100:4000])
    assert p.read_bytes() == before
    u = ucl.open(repo)["wte"][5000:9000]
    shutil.rmtree(repo)
    assert torch.equal(u, st_["wte"][5000:9000]) and bool((t == 7.0).all())


def test_a_cold_file_or_another_layout_is_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages not cached: the planned reads (a mapping would fault them in one by one). Chunks at offsets
    that are not whole pages (another writer's layout, back to back): copied, bit-exact."""
    repo = tmp_path / "r"
    st_ = _state()
    ucl.save({"wte": st_["wte"]}, repo, step=1)
    monkeypatch.setattr(mapped, "mostly_cached", lambda *a: False)
    with ucl.open(repo) as ck:
        t, was = _slice(ck, "wte", 0, 3000)
    assert torch.equal(t, st_["wte"][:3000]) and not was
    monkeypatch.undo()
    # the same chunks back to back (what ucl wrote before), the index and the commit record to match
    p = _shard(repo, "wte", 1)
    with ucl.open(repo) as ck:
        meta = ck.array("wte").meta
    data = p.read_bytes()
    n = index_nbytes(meta.n_inner)
    index = parse_index(meta, data[-n:], len(data), "wte")
    body = b"".join(data[o : o + nb] for o, nb in index.tolist())
    new = np.array([[k * (meta.inner_nbytes + 4), meta.inner_nbytes + 4] for k in range(meta.n_inner)], "<u8")
    raw = new.tobytes()
    p.write_bytes(body + raw + native.crc32c(raw).to_bytes(4, "little"))
    _reseal(repo, p.relative_to(repo / "steps" / "1").as_posix(), meta.n_inner)
    with ucl.open(repo) as ck:
        t, was = _slice(ck, "wte", 2000, 9000)
    assert torch.equal(t, st_["wte"][2000:9000]) and not was
    assert ucl.validate(repo).ok


def test_map_file_refuses_what_is_not_page_aligned(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(os.urandom(3 * PAGE))
    fd = os.open(p, os.O_RDONLY)
    try:
        view = mmap.mmap(-1, 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        assert native.map_file(view, 1, PAGE, fd, 0) != 0  # not at a page of the buffer
        assert native.map_file(view, 0, PAGE, fd, 100) != 0  # not at a page of the file
        assert native.map_file(view, PAGE, 2 * PAGE, fd, 0) != 0  # past the buffer
        assert native.map_file(view, PAGE, PAGE, fd, PAGE) == 0
        assert view[PAGE : 2 * PAGE] == p.read_bytes()[PAGE : 2 * PAGE] and view[:PAGE] == bytes(PAGE)
        view.close()
    finally:
        os.close(fd)


def test_zarr_and_tensorstore_read_the_aligned_layout(saved) -> None:  # type: ignore[no-untyped-def]
    """The padding between chunks is Zarr v3's to skip: zarr-python and tensorstore read the step's arrays
    by their indexes, bit-exact."""
    import tensorstore as ts
    import zarr

    repo, st_ = saved
    want = st_["wte"].numpy()
    z = zarr.open_array(store=str(repo / "steps" / "0" / "wte"), mode="r")
    assert np.array_equal(z[1000:9000], want[1000:9000])
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(repo / "steps" / "0" / "wte")}},
                read=True).result()
    assert np.array_equal(t[40000:50257].read().result(), want[40000:])
