"""ucl.adapters.zarr_store: a committed step as a plain Zarr v3 hierarchy, checked by zarr-python's own store
suite (StoreTests), zarr-python, tensorstore over HTTP, and our own tests of what a view must do."""

from __future__ import annotations

import functools
import inspect
import json
import pickle
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import cpu, default_buffer_prototype
from zarr.core.sync import _collect_aiterator, sync
from zarr.testing.store import StoreTests

import ucl
import ucl.adapters.zarr_store
from ucl.adapters.zarr_store import ZarrStore
from ucl.errors import CheckpointNotFoundError, ChecksumError, InvalidArgumentError, MissingShardError
from ucl.format import names, structure
from ucl.format.metadata import StepMeta
from ucl.format.repository import Repository
from ucl.format.shardfile import INNER_CHUNK_BYTES
from ucl.plan.save import all_shards, array_for, shard_block
from ucl.write.step import StepWriter

RO = "store was opened in read-only mode and does not support writing"


# -- helpers -----------------------------------------------------------------------------------------
def nest(flat: dict[str, torch.Tensor]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, t in flat.items():
        *groups, leaf = name.split("/")
        d = out
        for g in groups:
            d = d.setdefault(g, {})  # type: ignore[assignment]
        d[leaf] = t  # type: ignore[index]
    return out


INNER_BYTES = {"bytes": INNER_CHUNK_BYTES}  # what write_step chunks by (small_chunks lowers it)


def write_step(
    path, step: int, flat: dict[str, torch.Tensor], chunks: dict[str, tuple[int, ...]] | None = None
) -> None:
    """Commit ``flat`` ({"a/b": tensor}) as a full step, each tensor in shards of ``chunks[name]``."""
    tensors, tree = structure.flatten(nest(flat))
    arrays = {n: array_for(n, t, chunk_shape=(chunks or {}).get(n), inner_bytes=INNER_BYTES["bytes"])
              for n, t in tensors.items()}
    w = StepWriter(Repository.open(path, create=True), step)
    w.begin()
    files = {}
    for n, t in tensors.items():
        for coords in all_shards(arrays[n]):
            rel, entry = w.write_shard(arrays[n], coords, shard_block(arrays[n], coords, t))
            files[rel] = entry
    w.commit(StepMeta(step=step, kind="full", tree=tree, arrays=arrays), files)


def bits(t: torch.Tensor | np.ndarray) -> bytes:
    if not isinstance(t, torch.Tensor):
        return np.ascontiguousarray(t).tobytes()
    t = t.contiguous().reshape(-1)
    return t.numpy().tobytes() if t.dtype == torch.bool else t.view(torch.uint8).numpy().tobytes()


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    f = torch.randn(9, 5, generator=g)
    out = {
        "float/f32": f,
        "float/f64": f.double(),
        "float/f16": f.half(),
        "float/bf16": f.bfloat16(),
        "float/f8e4m3": f.to(torch.float8_e4m3fn),
        "float/f8e5m2": f.to(torch.float8_e5m2),
        "float/specials": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
        "int/i8": torch.randint(-128, 128, (7, 3), dtype=torch.int8, generator=g),
        "int/i16": torch.randint(-(2**15), 2**15, (7, 3), dtype=torch.int16, generator=g),
        "int/i32": torch.randint(-(2**31), 2**31, (7, 3), dtype=torch.int32, generator=g),
        "int/i64": torch.randint(-(2**62), 2**62, (7, 3), generator=g),
        "uint/u8": torch.randint(0, 256, (11,), dtype=torch.uint8, generator=g),
        "uint/u16": torch.randint(0, 2**15, (11,), dtype=torch.int32, generator=g).to(torch.uint16),
        "uint/u32": torch.randint(0, 2**31, (11,), dtype=torch.int64, generator=g).to(torch.uint32),
        "uint/u64": torch.randint(0, 2**62, (11,), generator=g).to(torch.uint64),
        "bool": torch.rand(4, 6, generator=g) > 0.5,
        "complex/c64": torch.randn(5, dtype=torch.complex64, generator=g),
        "complex/c128": torch.randn(5, dtype=torch.complex128, generator=g),
        "scalar": torch.tensor(-2.5),
        "empty": torch.empty(0, 4),
        "empty3": torch.empty(3, 0, 2, dtype=torch.bfloat16),
    }
    return out


@pytest.fixture
def small_chunks(monkeypatch):
    """Small inner chunks (ucl) and no growth of small chunks (the view), so tiny tensors have many."""
    monkeypatch.setitem(INNER_BYTES, "bytes", 256)
    monkeypatch.setattr(ucl.adapters.zarr_store, "MIN_CHUNK_BYTES", 1)


# -- zarr-python's own store suite --------------------------------------------------------------------
_CHUNK_KEY = re.compile(r"^(?P<array>.+?)/c(?P<coords>(?:/(?:0|[1-9][0-9]*))*)$")
_SCALAR = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
# keys a ucl view can hold, standing in for the suite's "c/0", "foo/c/0.0", "foo/0/0"
VIEW_KEYS = ["a/c/0", "foo/a/c/0/0", "foo/b/c/1/2", "s/c"]


def run_async_tests_with_zarr_sync(cls: type) -> type:
    """Run the suite's ``async def`` tests through zarr's own event loop (zarr.core.sync.sync), so the
    suite needs no async pytest plugin; marks and signatures are kept (functools.wraps)."""

    def syncify(fn):  # noqa: ANN001, ANN202
        @functools.wraps(fn)
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return sync(fn(*args, **kwargs))

        return run

    for name in dir(cls):
        if name.startswith("test_") and inspect.iscoroutinefunction(getattr(cls, name)):
            setattr(cls, name, syncify(getattr(cls, name)))
    return cls


def skipped(name: str, reason: str):  # noqa: ANN201
    """The suite's test ``name`` (its signature and parameters), skipped for ``reason``."""
    base = getattr(StoreTests, name)

    @functools.wraps(base)
    def test(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pytest.skip(reason)

    return test


@run_async_tests_with_zarr_sync
class TestZarrStoreSuite(StoreTests[ZarrStore, cpu.Buffer]):
    """zarr.testing.store.StoreTests against ZarrStore.

    The suite's ``set(store, key, value)`` puts a value into the backend without the store. Here the
    backend is a repository of immutable steps, so ``set`` commits a new step (through ucl's writer)
    holding every value set so far, one uint8 tensor per array, each value one chunk, and re-points
    the store object at that step. It can do so for chunk keys ``<tensor>/c/<i>...`` with non-empty
    values; anything else (metadata documents with arbitrary bytes, chunks of the root group, empty
    chunks) is skipped, saying why. Tests that write through the store are skipped: it is read-only.
    """

    store_cls = ZarrStore
    buffer_cls = cpu.Buffer

    @pytest.fixture(autouse=True)
    def _chunking(self, small_chunks) -> None:
        pass

    @pytest.fixture
    def store_kwargs(self, tmp_path) -> dict[str, object]:
        write_step(tmp_path, 0, {"seed": torch.zeros(1, dtype=torch.uint8)})
        return {"path": str(tmp_path), "step": 0}

    @pytest.fixture
    def store(self, open_kwargs: dict[str, object]) -> ZarrStore:
        return sync(self.store_cls.open(**open_kwargs))

    @pytest.fixture
    def store_not_open(self, store_kwargs: dict[str, object]) -> ZarrStore:
        return self.store_cls(**store_kwargs)

    async def set(self, store: ZarrStore, key: str, value: cpu.Buffer) -> None:
        data = value.to_bytes()
        m = _CHUNK_KEY.match(key)
        if m is None:
            kind = (
                "a metadata document, generated from the step"
                if key.endswith("zarr.json")
                else "a chunk of the root, which is a group"
                if re.match(r"^c(/|$)", key)
                else "not a chunk key"
            )
            pytest.skip(
                f"a ucl view cannot hold arbitrary bytes at {key!r}: it is {kind}; a view's keys are "
                "zarr.json documents and chunks <tensor>/c/<i>/..."
            )
        if not data:
            pytest.skip(
                f"a ucl view cannot hold an empty value at {key!r}: zarr chunk shapes are positive, "
                "so a chunk is never empty"
            )
        coords = tuple(int(c) for c in m.group("coords").split("/")[1:])
        name = names.from_key(m.group("array"))
        written = self.__dict__.setdefault("_written", {})
        written.setdefault(name, {})[coords] = data
        flat, chunks = {}, {}
        for n, vals in written.items():
            sizes = {len(v) for v in vals.values()}
            if len(sizes) != 1:
                pytest.skip(
                    f"chunks of one array have one size; {n!r} was given values of sizes {sorted(sizes)}"
                )
            (size,) = sizes
            ndim = len(next(iter(vals)))
            if ndim == 0:
                if size not in _SCALAR:
                    pytest.skip(f"a 0-d chunk is one element; {size} bytes is no data type's size")
                flat[n] = torch.frombuffer(bytearray(vals[()]), dtype=_SCALAR[size]).reshape(())
                continue
            grid = [max(c[d] for c in vals) + 1 for d in range(ndim)]
            t = torch.zeros(*grid[:-1], grid[-1] * size, dtype=torch.uint8)
            for c, v in vals.items():
                t[(*c[:-1], slice(c[-1] * size, (c[-1] + 1) * size))] = torch.frombuffer(
                    bytearray(v), dtype=torch.uint8
                )
            flat[n] = t
            chunks[n] = (1,) * (ndim - 1) + (size,)
        step = store.step + 1
        write_step(store._location, step, flat, chunks)
        is_open = store._is_open
        ZarrStore.__init__(store, store._location, step)
        store._is_open = is_open

    async def get(self, store: ZarrStore, key: str) -> cpu.Buffer:
        m = _CHUNK_KEY.match(key)
        assert m is not None, key
        coords = tuple(int(c) for c in m.group("coords").split("/")[1:])
        lt = ucl.open(store._location, store.step)[names.from_key(m.group("array"))]
        t = lt.read()
        if coords:  # the helper's arrays are uint8 with chunks (1, ..., 1, size)
            size = lt.meta.chunk_shape[-1]
            t = t[coords[:-1]][coords[-1] * size : (coords[-1] + 1) * size]
        return cpu.Buffer.from_bytes(bits(t))

    def test_store_repr(self, store: ZarrStore) -> None:
        assert re.fullmatch(r"ZarrStore\('.+', step=0\)", repr(store))

    def test_store_supports_writes(self, store: ZarrStore) -> None:
        assert not store.supports_writes
        assert not store.supports_deletes

    def test_store_supports_listing(self, store: ZarrStore) -> None:
        assert store.supports_listing

    # the suite's key parametrisations, with keys a view can hold
    @pytest.mark.parametrize("key", VIEW_KEYS)
    @pytest.mark.parametrize(
        ("data", "byte_range"),
        [
            (b"\x01\x02\x03\x04", None),
            (b"\x01\x02\x03\x04", RangeByteRequest(1, 4)),
            (b"\x01\x02\x03\x04", OffsetByteRequest(1)),
            (b"\x01\x02\x03\x04", SuffixByteRequest(1)),
            (b"", None),
        ],
    )
    async def test_get(self, store, key, data, byte_range) -> None:
        await super().test_get(store, key, data, byte_range)

    @pytest.mark.parametrize("key", VIEW_KEYS)
    @pytest.mark.parametrize("data", [b"\x01\x02\x03\x04", b""])
    async def test_getsize(self, store, key, data) -> None:
        await super().test_getsize(store, key, data)

    @pytest.mark.parametrize(
        "key_ranges",
        [
            [],
            [("zarr.json", RangeByteRequest(0, 2))],
            [("a/c/0", RangeByteRequest(0, 2)), ("zarr.json", None)],
            [("a/c/0", RangeByteRequest(0, 2)), ("b/c/0/0", None)],
            [
                ("a/c/0/0", RangeByteRequest(0, 2)),
                ("a/c/0/1", SuffixByteRequest(2)),
                ("a/c/0/2", OffsetByteRequest(2)),
            ],
        ],
    )
    async def test_get_partial_values(self, store, key_ranges) -> None:
        await super().test_get_partial_values(store, key_ranges)

    # -- skipped, each saying why (same parameters and signature as the suite's test) -----------------
    test_store_read_only = skipped(
        "test_store_read_only",
        "asserts a store is writable; a view of a committed step is always read-only "
        "(test_read_only_attribute checks read_only is True and cannot be assigned)",
    )
    test_serializable_store = skipped(
        "test_serializable_store",
        "after pickling, writes a key through the store, which is read-only "
        "(test_pickle_round_trip checks the unpickled store reads the same step)",
    )
    test_getsize_prefix = skipped(
        "test_getsize_prefix",
        "writes its keys through the store (_set_many), which is read-only "
        "(test_partial_reads_fetch_only_needed_chunks checks getsize_prefix over a step)",
    )
    test_set = skipped("test_set", "writes through the store, which is read-only (test_writes_raise)")
    test_set_not_open = skipped(
        "test_set_not_open", "writes through the store, which is read-only (test_writes_raise)"
    )
    test_set_many = skipped(
        "test_set_many", "writes through the store, which is read-only (test_writes_raise)"
    )
    test_set_if_not_exists = skipped(
        "test_set_if_not_exists", "writes through the store, which is read-only (test_writes_raise)"
    )
    test_exists = skipped(
        "test_exists",
        "writes foo/zarr.json through the store, which is read-only (test_exists_and_getsize "
        "checks exists on documents, chunks, and keys outside the grid)",
    )
    test_clear = skipped("test_clear", "clears the store, which is read-only (test_writes_raise)")
    test_is_empty = skipped(
        "test_is_empty",
        "expects a new store to be empty; a view always has its root zarr.json "
        "(test_listing checks is_empty on groups, arrays and absent prefixes)",
    )
    test_list = skipped(
        "test_list",
        "expects a new store to be empty and writes empty values through it; a view has its "
        "root zarr.json and is read-only (test_listing)",
    )
    test_list_prefix = skipped(
        "test_list_prefix",
        "writes empty zarr.json values through the store, which is read-only (test_listing)",
    )
    test_list_empty_path = skipped(
        "test_list_empty_path", "writes empty values through the store, which is read-only (test_listing)"
    )
    test_list_dir = skipped(
        "test_list_dir",
        "expects a new store to be empty and writes through it; a view has its root "
        "zarr.json and is read-only (test_listing)",
    )

    @pytest.mark.parametrize("read_only", [True, False])
    async def test_store_open_read_only(self, open_kwargs, read_only) -> None:
        if not read_only:
            pytest.skip(
                "read_only=False: a committed step never changes, so a view cannot be opened for "
                "writing (test_read_only_false_is_refused)"
            )
        await super().test_store_open_read_only(open_kwargs, read_only)


# -- the view ---------------------------------------------------------------------------------------
def test_zarr_store_is_exported(tmp_path) -> None:
    write_step(tmp_path, 3, {"w": torch.arange(6.0)})
    assert "zarr_store" in ucl.__all__ and callable(ucl.zarr_store)
    assert isinstance(ucl.zarr_store(tmp_path), ZarrStore)
    assert callable(ucl.adapters.zarr_store.serve_http)


def test_every_dtype_reads_bit_exactly_through_zarr(tmp_path) -> None:
    state = every_dtype()
    write_step(tmp_path, 7, state)
    g = zarr.open_group(store=ucl.zarr_store(tmp_path), mode="r")
    for name, t in state.items():
        a = g[name]
        assert isinstance(a, zarr.Array)
        assert a.shape == tuple(t.shape), name
        assert a.dtype.itemsize == t.element_size(), name
        assert bits(a[...]) == bits(t), name


def test_hierarchy_documents(tmp_path, small_chunks) -> None:
    t = torch.arange(10 * 7, dtype=torch.float32).reshape(10, 7)
    write_step(
        tmp_path,
        4,
        {"model/layers/0/w": t, "model/b": torch.ones(3).bfloat16(), "step_count": torch.tensor(9)},
        chunks={"model/layers/0/w": (4, 7)},
    )
    store = ucl.zarr_store(tmp_path)
    root = json.loads(store.get_sync("zarr.json").to_bytes())
    assert root["node_type"] == "group"
    assert root["attributes"] == {"step": 4, "kind": "full", "parent": None}
    assert sorted(root["consolidated_metadata"]["metadata"]) == [
        "model",
        "model/b",
        "model/layers",
        "model/layers/0",
        "model/layers/0/w",
        "step_count",
    ]
    doc = json.loads(store.get_sync("model/layers/0/w/zarr.json").to_bytes())
    inner = ucl.open(tmp_path)["model/layers/0/w"].meta.inner_chunk_shape
    assert doc["shape"] == [10, 7] and doc["data_type"] == "float32"
    assert doc["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
    assert doc["chunk_grid"]["configuration"]["chunk_shape"] == list(
        inner
    )  # one zarr chunk = one inner chunk
    assert doc["attributes"] == {"ucl": {"name": "model/layers/0/w"}}
    assert doc == root["consolidated_metadata"]["metadata"]["model/layers/0/w"]
    assert json.loads(store.get_sync("model/b/zarr.json").to_bytes())["data_type"] == "bfloat16"

    g = zarr.open_group(store=store, mode="r")
    assert g.attrs["step"] == 4 and g.attrs["kind"] == "full"
    assert sorted(g.group_keys()) == ["model"] and sorted(g.array_keys()) == ["step_count"]
    assert np.array_equal(g["model/layers/0/w"][...], t.numpy())
    # the same without consolidated metadata: every document from its own key
    g2 = zarr.open_group(store=store, mode="r", use_consolidated=False)
    assert np.array_equal(g2["model"]["layers"]["0"]["w"][3:9, 2], t.numpy()[3:9, 2])


def test_names_are_escaped_keys(tmp_path) -> None:
    state = {"enc oder/%x": torch.ones(2), "__priv": torch.zeros(1)}
    write_step(tmp_path, 0, state)
    g = zarr.open_group(store=ucl.zarr_store(tmp_path), mode="r")
    assert sorted(g.keys()) == ["%5F_priv", "enc%20oder"]
    a = g["enc%20oder/%25x"]
    assert a.attrs["ucl"]["name"] == "enc oder/%x"
    assert np.array_equal(a[...], np.ones(2, dtype=np.float32))


def test_edge_chunks_are_full_size_and_zero_padded(tmp_path, small_chunks) -> None:
    t = torch.arange(1, 10 * 7 + 1, dtype=torch.int32).reshape(10, 7)
    write_step(tmp_path, 0, {"t": t}, chunks={"t": (4, 7)})
    store = ucl.zarr_store(tmp_path)
    chunks = json.loads(store.get_sync("t/zarr.json").to_bytes())["chunk_grid"]["configuration"][
        "chunk_shape"
    ]
    rows, cols = chunks
    assert 10 % rows and cols == 7, chunks  # the test needs a partial last chunk
    last = 10 // rows
    raw = store.get_sync(f"t/c/{last}/0").to_bytes()
    assert len(raw) == rows * cols * 4
    got = np.frombuffer(raw, dtype="<i4").reshape(rows, cols)
    n = 10 - last * rows
    assert np.array_equal(got[:n], t[last * rows :].numpy())
    assert not got[n:].any()
    assert store.get_sync(f"t/c/{last + 1}/0") is None
    assert sync(store.getsize(f"t/c/{last}/0")) == len(raw)


def test_partial_reads_fetch_only_needed_chunks(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(INNER_BYTES, "bytes", 64 << 10)
    monkeypatch.setattr(ucl.adapters.zarr_store, "MIN_CHUNK_BYTES", 64 << 10)
    t = torch.randn(1024, 256)  # 1 MiB: 16 inner chunks of 64 rows
    write_step(tmp_path, 0, {"t": t, "other": torch.randn(256, 256)})
    store = ucl.zarr_store(tmp_path)
    a = zarr.open_group(store=store, mode="r")["t"]
    assert a.chunks == (64, 256)
    before = store.checkpoint.bytes_read
    assert np.array_equal(a[130:190, 5:9], t[130:190, 5:9].numpy())  # rows 128..191: one chunk
    cost = store.checkpoint.bytes_read - before
    assert 64 * 256 * 4 <= cost <= 64 * 256 * 4 + 4 + 16 * 16 + 4  # one chunk, its crc, the shard index
    before = store.checkpoint.bytes_read
    assert np.array_equal(a[100:300], t[100:300].numpy())  # rows 64..319: four chunks
    assert store.checkpoint.bytes_read - before <= 4 * (64 * 256 * 4 + 4)
    # metadata and sizes cost nothing
    before = store.checkpoint.bytes_read
    assert sync(store.getsize("t/c/3/0")) == 64 * 256 * 4
    assert sync(store.getsize_prefix("t")) == t.nbytes + len(store.get_sync("t/zarr.json").to_bytes())
    assert store.checkpoint.bytes_read == before


def test_damaged_steps_raise_instead_of_reading_fill_values(tmp_path) -> None:
    t = torch.randn(64, 8)
    write_step(tmp_path, 0, {"a": t, "b": t + 1})
    shard_b = tmp_path / "steps" / "0" / "b" / "c" / "0" / "0"
    shard_b.unlink()
    shard_a = tmp_path / "steps" / "0" / "a" / "c" / "0" / "0"
    raw = bytearray(shard_a.read_bytes())
    raw[100] ^= 0xFF
    shard_a.write_bytes(bytes(raw))
    g = zarr.open_group(store=ucl.zarr_store(tmp_path), mode="r")
    with pytest.raises(MissingShardError):
        g["b"][...]
    with pytest.raises(ChecksumError):
        g["a"][...]


def test_writes_raise(tmp_path) -> None:
    write_step(tmp_path, 0, {"w": torch.ones(4)})
    store = ucl.zarr_store(tmp_path)
    buf = cpu.Buffer.from_bytes(b"x")
    for call in (
        store.set("w/c/0", buf),
        store.set("new", buf),
        store.set_if_not_exists("w/c/0", buf),
        store._set_many([("k", buf)]),
        store.delete("w/c/0"),
        store.delete_dir("w"),
        store.clear(),
    ):
        with pytest.raises(ValueError, match=RO):
            sync(call)
    with pytest.raises(ValueError, match=RO):
        zarr.open_group(store=store, mode="r")["w"][0] = 5.0
    assert sync(store.exists("w/c/0"))


def test_read_only_attribute(tmp_path) -> None:
    write_step(tmp_path, 0, {"w": torch.ones(4)})
    store = ucl.zarr_store(tmp_path)
    assert store.read_only
    with pytest.raises(AttributeError):
        store.read_only = False  # type: ignore[misc]
    copy = store.with_read_only(True)
    assert copy == store and copy.read_only and not copy._is_open


def test_read_only_false_is_refused(tmp_path) -> None:
    write_step(tmp_path, 0, {"w": torch.ones(4)})
    with pytest.raises(InvalidArgumentError, match="read-only"):
        ZarrStore(tmp_path, read_only=False)
    with pytest.raises(InvalidArgumentError):
        sync(ZarrStore.open(path=tmp_path, read_only=False))


def test_listing(tmp_path, small_chunks) -> None:
    write_step(
        tmp_path,
        0,
        {"m/w": torch.zeros(6, 4), "m/s": torch.tensor(1.0), "e": torch.empty(0, 3)},
        chunks={"m/w": (2, 4)},
    )
    store = ucl.zarr_store(tmp_path)

    def ls(it):  # noqa: ANN001
        return sorted(sync(_collect_aiterator(it)))

    assert store.get_sync("m/w/zarr.json") is not None
    chunks = json.loads(store.get_sync("m/w/zarr.json").to_bytes())["chunk_grid"]["configuration"][
        "chunk_shape"
    ]
    grid = (-(-6 // chunks[0]), -(-4 // chunks[1]))
    w_chunks = [f"m/w/c/{i}/{j}" for i in range(grid[0]) for j in range(grid[1])]
    everything = sorted(
        ["zarr.json", "m/zarr.json", "m/w/zarr.json", "m/s/zarr.json", "m/s/c", "e/zarr.json", *w_chunks]
    )
    assert ls(store.list()) == everything
    assert ls(store.list_prefix("")) == everything
    assert ls(store.list_prefix("m/")) == [k for k in everything if k.startswith("m/")]
    assert ls(store.list_prefix("m/w/c/")) == w_chunks
    assert ls(store.list_prefix("m/w/c/1")) == [k for k in w_chunks if k.startswith("m/w/c/1")]
    assert ls(store.list_prefix("nope/")) == []
    assert ls(store.list_dir("")) == ["e", "m", "zarr.json"]
    assert ls(store.list_dir("m")) == ls(store.list_dir("m/")) == ["s", "w", "zarr.json"]
    assert ls(store.list_dir("m/w")) == ["c", "zarr.json"]
    assert ls(store.list_dir("m/s")) == ["c", "zarr.json"]
    assert ls(store.list_dir("e")) == ["zarr.json"]  # no chunks in an empty array
    assert ls(store.list_dir("m/w/c")) == [str(i) for i in range(grid[0])]
    assert ls(store.list_dir("m/w/c/0")) == [str(j) for j in range(grid[1])]
    assert ls(store.list_dir("m/w/c/0/0")) == []
    assert ls(store.list_dir(f"m/w/c/{grid[0]}")) == []
    assert ls(store.list_dir("nope")) == []
    assert not sync(store.is_empty("")) and not sync(store.is_empty("m")) and sync(store.is_empty("nope"))
    assert not sync(store.is_empty("m/w/"))


def test_exists_and_getsize(tmp_path, small_chunks) -> None:
    write_step(tmp_path, 0, {"w": torch.zeros(6, 4)}, chunks={"w": (2, 4)})
    store = ucl.zarr_store(tmp_path)
    for key in ("zarr.json", "w/zarr.json", "w/c/0/0", "w/c/2/0"):
        assert sync(store.exists(key)), key
    for key in (
        "w",
        "w/c",
        "w/c/0",
        "w/c/3/0",
        "w/c/0/0/0",
        "w/c/00/0",
        "w/c/-1/0",
        "c/0",
        "x/zarr.json",
        "",
    ):
        assert not sync(store.exists(key)), key
        assert store.get_sync(key) is None
        with pytest.raises(FileNotFoundError):
            sync(store.getsize(key))


def test_byte_ranges_and_partial_values(tmp_path) -> None:
    t = torch.arange(16, dtype=torch.uint8)
    write_step(tmp_path, 0, {"t": t})
    store = ucl.zarr_store(tmp_path)
    doc = store.get_sync("zarr.json").to_bytes()
    p = default_buffer_prototype()
    cases = [
        (None, slice(None)),
        (RangeByteRequest(2, 5), slice(2, 5)),
        (OffsetByteRequest(3), slice(3, None)),
        (SuffixByteRequest(4), slice(-4, None)),
        (RangeByteRequest(10, 100), slice(10, 100)),
    ]
    for rng, sl in cases:
        assert sync(store.get("t/c/0", p, rng)).to_bytes() == bytes(range(16))[sl]
        assert store.get_sync("t/c/0", byte_range=rng).to_bytes() == bytes(range(16))[sl]
        assert sync(store.get("zarr.json", p, rng)).to_bytes() == doc[sl]
    with pytest.raises(TypeError, match="Unexpected byte_range"):
        sync(store.get("t/c/0", p, (0, 2)))  # type: ignore[arg-type]
    got = sync(
        store.get_partial_values(p, [("t/c/0", RangeByteRequest(0, 2)), ("nope", None), ("zarr.json", None)])
    )
    assert got[0].to_bytes() == b"\x00\x01" and got[1] is None and got[2].to_bytes() == doc


def test_pickle_round_trip(tmp_path) -> None:
    write_step(tmp_path, 0, {"w": torch.arange(5.0)})
    write_step(tmp_path, 1, {"w": torch.arange(5.0) + 1})
    store = ucl.zarr_store(tmp_path, 0)
    sync(store._ensure_open())
    again = pickle.loads(pickle.dumps(store))
    assert again == store and again.read_only and again.step == 0 and again._is_open
    assert np.array_equal(
        zarr.open_array(store=again, path="w", mode="r")[...], np.arange(5.0, dtype=np.float32)
    )


def test_step_selection_and_sources(tmp_path) -> None:
    write_step(tmp_path, 1, {"w": torch.zeros(3)})
    write_step(tmp_path, 2, {"w": torch.ones(3)})
    newest, first = ucl.zarr_store(tmp_path), ucl.zarr_store(tmp_path, 1)
    assert newest.step == 2 and first.step == 1 and newest != first
    assert zarr.open_array(store=first, path="w", mode="r")[...].sum() == 0
    with ucl.open(tmp_path, 2) as ckpt:
        view = ucl.zarr_store(ckpt)
        assert view == newest and view.checkpoint is ckpt
        with pytest.raises(InvalidArgumentError):
            ucl.zarr_store(ckpt, 1)
        view.close()
        assert ckpt["w"].read().sum() == 3  # the caller's checkpoint stays usable
    with pytest.raises(CheckpointNotFoundError):
        ucl.zarr_store(tmp_path, 3)
    with pytest.raises(CheckpointNotFoundError):
        ucl.zarr_store(tmp_path / "nothing")


def test_memory_url() -> None:
    url = "memory://ucl-zarr-store-test"
    t = torch.randn(5, 5).bfloat16()
    ucl.save({"w": t}, url, step=0)
    try:
        a = zarr.open_group(store=ucl.zarr_store(url), mode="r")["w"]
        assert bits(a[...]) == bits(t)
    finally:
        import fsspec

        fsspec.filesystem("memory").rm("/ucl-zarr-store-test", recursive=True)


# -- tensorstore, over HTTP ----------------------------------------------------------------------------
def test_tensorstore_reads_the_view_over_http(tmp_path, small_chunks) -> None:
    ts = pytest.importorskip("tensorstore")
    state = {
        "model/w": torch.randn(10, 7),
        "model/b": torch.randn(13).bfloat16(),
        "f8": torch.randn(6).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
    }
    write_step(tmp_path, 2, state, chunks={"model/w": (4, 7)})
    with ucl.adapters.zarr_store.serve_http(tmp_path, host="127.0.0.1", port=0) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        for name, t in state.items():
            arr = ts.open(
                {
                    "driver": "zarr3",
                    "kvstore": {"driver": "http", "base_url": srv.url, "path": f"{names.to_key(name)}/"},
                }
            ).result()
            assert tuple(arr.shape) == tuple(t.shape), name
            assert bits(arr.read().result()) == bits(t), name
        w = ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "http", "base_url": f"{srv.url}/model/w"}}
        ).result()
        assert np.array_equal(w[3:9, 1:4].read().result(), state["model/w"][3:9, 1:4].numpy())


def test_http_server_ranges_head_and_errors(tmp_path) -> None:
    write_step(tmp_path, 0, {"t": torch.arange(16, dtype=torch.uint8), "gone": torch.ones(4)})
    (tmp_path / "steps" / "0" / "gone" / "c" / "0").unlink()
    store = ucl.zarr_store(tmp_path)

    def fetch(url, **headers):  # noqa: ANN001, ANN003
        req = urllib.request.Request(url, headers=headers, method=headers.pop("method", "GET"))
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    with ucl.adapters.zarr_store.serve_http(store) as srv:
        u = f"{srv.url}/t/c/0"
        assert fetch(u)[:2] == (200, bytes(range(16)))
        code, body, headers = fetch(u, Range="bytes=2-4")
        assert (code, body, headers["Content-Range"]) == (206, b"\x02\x03\x04", "bytes 2-4/16")
        assert fetch(u, Range="bytes=10-")[:2] == (206, bytes(range(10, 16)))
        assert fetch(u, Range="bytes=-3")[:2] == (206, bytes(range(13, 16)))
        assert fetch(u, Range="bytes=12-100")[:2] == (206, bytes(range(12, 16)))
        assert fetch(u, Range="bytes=16-")[0] == 416
        assert fetch(u, Range="lines=1-2")[0] == 416
        code, body, headers = fetch(u, method="HEAD")
        assert (code, body, headers["Content-Length"]) == (200, b"", "16")
        assert json.loads(fetch(f"{srv.url}/zarr.json")[1])["attributes"]["step"] == 0
        assert fetch(f"{srv.url}/t/c/1")[0] == 404
        assert fetch(f"{srv.url}/")[0] == 404
        code, body, _ = fetch(f"{srv.url}/gone/c/0")
        assert code == 500 and b"MissingShardError" in body
